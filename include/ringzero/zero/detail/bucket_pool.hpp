// The gradient reducer's pool of bucket buffers (zero/gradient_reducer.hpp, stages 2-3 and
// reproducible mode): which buffer a complete bucket fills next and when a buffer is free again.
// Host memory: a buffer is free once the communication thread's reduction of it is done; the pool
// takes a free one, else waits for the one whose reduction finishes first, else (gradients
// arriving out of order) grows. Device spaces: every buffer is reusable in stream order. Apart
// from the reducer because choosing a buffer is a job of its own, the same in every stage.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "ringzero/log.hpp"
#include "ringzero/zero/detail/buffer_meter.hpp"
#include "ringzero/zero/detail/worker.hpp"
#include "ringzero/zero/device_space.hpp"
#include "ringzero/zero/memory_space.hpp"

namespace ringzero::zero::detail {

template <class G, memory_space Space>
class bucket_pool {
 public:
  static constexpr bool device = on_device<Space>;

  struct pool_entry {
    buffer<G> data;
    worker::ticket busy = 0;  ///< free once this ticket completed
    int bucket = -1;          ///< the bucket filling it, or -1
    /// Device spaces: the point of the communication stream after its last reduction.
    typename device_traits<Space>::event done{};
  };

  /// Buffers of `elements` each; `work` and `meter` must outlive the pool (`work` may be
  /// constructed after it: only its address is taken here).
  bucket_pool(worker& work, buffer_meter& meter, std::size_t elements)
      : work_(work), meter_(meter), elements_(elements) {}

  /// One more buffer, from `space`.
  void add_buffer(const Space& space) {
    buffer<G> b = space.template allocate_local<G>(elements_);
    meter_.add(b.bytes());
    pool_.push_back({std::move(b), 0, -1});
  }

  [[nodiscard]] pool_entry& operator[](std::size_t k) noexcept { return pool_[k]; }

  /// A buffer for bucket b, zeroed (on the host only when `zero_host`); returns its index.
  [[nodiscard]] int acquire(int b, const Space& space, bool zero_host) {
    if constexpr (device) {
      // Every buffer is reusable in stream order: take the next one round the pool (the one
      // whose reduction was enqueued longest ago) and make the compute stream wait for it.
      int pick = -1;
      for (std::size_t i = 0; i < pool_.size() && pick < 0; ++i) {
        const std::size_t j = (next_pool_ + i) % pool_.size();
        if (pool_[j].bucket < 0) pick = static_cast<int>(j);
      }
      if (pick < 0) pick = grow(space);
      next_pool_ = (static_cast<std::size_t>(pick) + 1) % pool_.size();
      auto& e = pool_[static_cast<std::size_t>(pick)];
      const auto compute = space.compute_stream();
      space.wait(compute, e.done);
      space.zero(compute, e.data.data(), e.data.size());
      e.bucket = b;
      return pick;
    }
    int pick = -1;
    for (std::size_t i = 0; i < pool_.size() && pick < 0; ++i)
      if (pool_[i].bucket < 0 && work_.done(pool_[i].busy)) pick = static_cast<int>(i);
    if (pick < 0) {
      for (std::size_t i = 0; i < pool_.size(); ++i)
        if (pool_[i].bucket < 0 &&
            (pick < 0 || pool_[i].busy < pool_[static_cast<std::size_t>(pick)].busy))
          pick = static_cast<int>(i);
      if (pick >= 0) work_.wait(pool_[static_cast<std::size_t>(pick)].busy);
    }
    if (pick < 0) pick = grow(space);
    auto& e = pool_[static_cast<std::size_t>(pick)];
    if (zero_host) std::fill_n(e.data.data(), e.data.size(), G{});
    e.bucket = b;
    return pick;
  }

 private:
  /// A buffer more, when none is free (gradients arriving for more buckets than it holds).
  int grow(const Space& space) {
    log::warn(
        "zero: gradients arrive for {} buckets at once; adding a gradient buffer "
        "(hand gradients over in backward order, or raise reduce_buffers)",
        pool_.size() + 1);
    add_buffer(space);
    return static_cast<int>(pool_.size()) - 1;
  }

  worker& work_;
  buffer_meter& meter_;
  std::size_t elements_;
  std::vector<pool_entry> pool_;
  std::size_t next_pool_ = 0;  // device spaces: the buffer to try first
};

}  // namespace ringzero::zero::detail
