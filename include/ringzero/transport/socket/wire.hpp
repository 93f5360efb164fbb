// The socket transport's frames: a 40-byte header, then (data frames only) the payload. Every
// host of a job runs the same build on the same byte order, so the header is sent as it sits
// in memory.
#pragma once

#include <cstdint>

#include "ringzero/transport/concept.hpp"

namespace ringzero::socket::detail {

enum class frame_kind : std::uint32_t {
  data = 1,  ///< a piece of a message: seq, tag, total, offset, length
  ack = 2,   ///< seq: data frames read whole on this connection so far; length: the rate they
             ///< arrive at, KiB/s (0: not measured yet)
  bye = 3,   ///< the sender closes its transport; seq: the rank it saw fail first, plus 1 (0: none)
};

struct frame_header {
  frame_kind kind = frame_kind::data;
  std::uint32_t length = 0;  ///< payload bytes that follow
  std::uint64_t seq = 0;     ///< the message's number between this pair of ranks
  tag_t tag = 0;
  std::uint64_t total = 0;   ///< the message's size
  std::uint64_t offset = 0;  ///< where this piece starts in it

  [[nodiscard]] static frame_header data(std::uint64_t seq, tag_t tag, std::uint64_t total,
                                         std::uint64_t offset, std::uint32_t length) noexcept {
    return {frame_kind::data, length, seq, tag, total, offset};
  }
  [[nodiscard]] static frame_header ack(std::uint64_t count, std::uint32_t rate_kib) noexcept {
    return {frame_kind::ack, rate_kib, count, 0, 0, 0};
  }
  [[nodiscard]] static frame_header bye(int failed_rank) noexcept {
    return {frame_kind::bye, 0, static_cast<std::uint64_t>(failed_rank + 1), 0, 0, 0};
  }
};
static_assert(sizeof(frame_header) == 40, "the header is 40 bytes on the wire");

/// The first bytes each connecting rank sends: who it is and on which rail.
struct hello {
  std::uint32_t magic = 0x4b53525a;  // "ZRSK"
  std::uint32_t rank = 0;
  std::uint32_t rail = 0;
  std::uint32_t generation = 0;
};
static_assert(sizeof(hello) == 16);

}  // namespace ringzero::socket::detail
