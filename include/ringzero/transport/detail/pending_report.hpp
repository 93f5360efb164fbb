// The list a transport logs when a wait gives up (RINGZERO_DEBUG=INFO): one line per message
// posted and not finished, its tag decoded with tag_layout, so that the log names the collective
// call (sequence), the step and the chunk a rank was stuck in, alike on every transport.
#pragma once

#include <fmt/core.h>

#include <cstddef>
#include <string>
#include <string_view>

#include "ringzero/base.hpp"

namespace ringzero::detail {

class pending_report {
 public:
  /// Lines listed at most; the rest are counted.
  static constexpr std::size_t max_lines = 64;

  /// One message: its direction and peer (the communicator's rank; `world_peer`, the
  /// transport's, where it differs), its size, its tag, and a note of the transport's own.
  void add(bool is_send, int peer, std::size_t bytes, tag_t tag, int world_peer = -1,
           std::string_view note = {}) {
    if (++count_ > max_lines) return;
    lines_ += fmt::format("\n  {} rank {}", is_send ? "send to" : "receive from", peer);
    if (world_peer >= 0 && world_peer != peer) lines_ += fmt::format(" (world {})", world_peer);
    lines_ += fmt::format(", {} bytes, sequence {}, step {}, chunk {}{}", bytes,
                          tag_layout::sequence_of(tag), tag_layout::step_of(tag),
                          tag_layout::chunk_of(tag), note);
  }
  [[nodiscard]] std::size_t count() const noexcept { return count_; }
  /// The lines, each starting on a new line, and how many more there were.
  [[nodiscard]] std::string lines() const {
    if (count_ <= max_lines) return lines_;
    return lines_ + fmt::format("\n  ... and {} more", count_ - max_lines);
  }

 private:
  std::size_t count_ = 0;
  std::string lines_;
};

}  // namespace ringzero::detail
