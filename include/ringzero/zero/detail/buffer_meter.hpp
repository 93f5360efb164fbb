// Bytes of the sharder's transient buffers (gradient buckets, gathered parameters), now and at
// their peak, shared by the components that allocate them.
#pragma once

#include <algorithm>
#include <cstddef>

namespace ringzero::zero::detail {

struct buffer_meter {
  std::size_t now = 0;
  std::size_t peak = 0;
  void add(std::size_t bytes) noexcept {
    now += bytes;
    peak = std::max(peak, now);
  }
  void remove(std::size_t bytes) noexcept { now -= bytes; }
};

}  // namespace ringzero::zero::detail
