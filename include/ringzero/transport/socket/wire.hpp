// The socket transport's frames: a 40-byte header, then (data frames only) the payload. Every
// host of a job runs the same build on the same byte order, so the header is sent as it sits
// in memory.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "ringzero/transport/concept.hpp"

namespace ringzero::socket::detail {

enum class frame_kind : std::uint8_t {
  data = 1,  ///< a message, or a piece of one: piece, tag, word, total, offset, length
  bye = 2,  ///< the sender closes its transport; word: the rank it saw fail first, plus 1 (0: none)
};

struct frame_header {
  frame_kind kind = frame_kind::data;
  std::uint8_t piece = 0;      ///< its number within its message (the rail engine's)
  std::uint8_t with_word = 0;  ///< 1: `word` is the engine's (delivery::cq_word)
  std::uint8_t reserved = 0;
  std::uint32_t word = 0;
  std::uint64_t length = 0;  ///< payload bytes that follow
  tag_t tag = 0;
  std::uint64_t total = 0;   ///< the message's size
  std::uint64_t offset = 0;  ///< where this piece starts in it

  [[nodiscard]] static frame_header bye(int failed_rank) noexcept {
    return {.kind = frame_kind::bye, .word = static_cast<std::uint32_t>(failed_rank + 1)};
  }
};
static_assert(sizeof(frame_header) == 40, "the header is 40 bytes on the wire");

// The handshake (handshake.hpp), before any frame: the connecting rank says who it is, the
// accepting rank answers with a fresh nonce and proves it holds the job's secret, the connecting
// rank proves the same over that nonce, and the accepting rank welcomes it. Each proof is an
// HMAC-SHA-256 under the secret over the hello and both nonces, so neither side's proof can be
// replayed on another connection.

/// The connecting rank's first message: who it is, on which rail, and its nonce.
struct hello {
  std::uint32_t magic = 0x3253525a;  // "ZRS2"
  std::uint32_t rank = 0;
  std::uint32_t rail = 0;
  std::uint32_t generation = 0;
  std::array<std::byte, 16> nonce{};
};
static_assert(sizeof(hello) == 32);

/// What the accepting rank makes of a hello.
enum class verdict : std::uint32_t {
  welcome = 0,
  stale_generation = 1,  ///< a connection of another setup of this job (an earlier generation)
  unexpected_rank = 2,   ///< not a rank this one accepts (only lower ranks connect to it)
  wrong_rail = 3,        ///< the hello names another rail than the listener it reached
  duplicate = 4,         ///< that rank is connected on that rail already
};

/// The accepting rank's answer: its verdict and, when it is welcome, its nonce and proof.
struct challenge {
  std::uint32_t magic = 0x3253525a;
  verdict says = verdict::welcome;
  std::array<std::byte, 16> nonce{};
  std::array<std::byte, 32> mac{};
};
static_assert(sizeof(challenge) == 56);

/// The connecting rank's proof over the accepting rank's nonce.
struct proof {
  std::array<std::byte, 32> mac{};
};
static_assert(sizeof(proof) == 32);

/// The accepting rank took the connection: frames follow.
struct welcome {
  std::uint32_t magic = 0x3253525a;
  verdict says = verdict::welcome;
};
static_assert(sizeof(welcome) == 8);

}  // namespace ringzero::socket::detail
