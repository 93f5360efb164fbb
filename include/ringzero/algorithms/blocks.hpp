// How a buffer is cut into one block per rank, and blocks into pipeline chunks. Every rank
// computes the same layout from (count, ranks), so sender and receiver always agree on which
// chunks exist and how long they are, without exchanging sizes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include "ringzero/base.hpp"

namespace ringzero::algorithms {

struct block_layout {
  std::vector<std::size_t> offset;
  std::vector<std::size_t> length;
  std::size_t max_length = 0;

  /// `count` elements in `ranks` near-equal blocks: the first count % ranks get one more.
  [[nodiscard]] static block_layout even(std::size_t count, int ranks) {
    block_layout b;
    const auto n = static_cast<std::size_t>(ranks);
    b.offset.resize(n);
    b.length.resize(n);
    std::size_t off = 0;
    for (std::size_t i = 0; i < n; ++i) {
      b.offset[i] = off;
      b.length[i] = count / n + (i < count % n ? 1 : 0);
      off += b.length[i];
    }
    b.max_length = n ? b.length[0] : 0;
    return b;
  }

  /// `ranks` blocks of exactly `count` elements each (reduce_scatter input, all_gather output).
  [[nodiscard]] static block_layout uniform(std::size_t count, int ranks) {
    block_layout b;
    const auto n = static_cast<std::size_t>(ranks);
    b.offset.resize(n);
    b.length.assign(n, count);
    for (std::size_t i = 0; i < n; ++i) b.offset[i] = i * count;
    b.max_length = count;
    return b;
  }
};

/// Chunking of blocks of at most max_length elements into pieces of chunk elements.
struct chunking {
  std::size_t chunk = 1;
  std::size_t count = 1;

  /// At most `max_chunks` (and tag_layout::max_chunks, so chunk ids fit their tag bits) chunks
  /// per block. Algorithms that post a whole message at once pass the transport's
  /// tuning::policy::burst.
  [[nodiscard]] static chunking make(std::size_t max_length, std::size_t elem_size,
                                     std::size_t chunk_bytes,
                                     std::size_t max_chunks = tag_layout::max_chunks) {
    chunking c;
    max_chunks = std::clamp<std::size_t>(max_chunks, 1, tag_layout::max_chunks);
    c.chunk = std::max<std::size_t>(1, chunk_bytes / std::max<std::size_t>(1, elem_size));
    c.chunk = std::max(c.chunk, (max_length + max_chunks - 1) / max_chunks);
    c.count = std::max<std::size_t>(1, (max_length + c.chunk - 1) / c.chunk);
    return c;
  }

  struct range {
    std::size_t begin = 0;
    std::size_t size = 0;
  };
  /// Chunk i of a block of `length` elements; size 0 when the block is shorter.
  [[nodiscard]] range of(std::size_t length, std::size_t i) const noexcept {
    const std::size_t lo = i * chunk;
    if (lo >= length) return {lo, 0};
    return {lo, std::min(chunk, length - lo)};
  }
};

[[nodiscard]] constexpr int mod(int a, int n) noexcept {
  return ((a % n) + n) % n;
}

}  // namespace ringzero::algorithms
