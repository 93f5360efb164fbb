// The fp32 optimizer state of a device space (device_space.hpp): master weights and moments in
// device memory, the counterpart of shard_optimizer (optimizer.hpp) in host memory. In a header of
// its own because it is model state, not part of what makes a space a device space: model_state.hpp
// picks one or the other. device_space.hpp includes it, so code that named it there still compiles.
#pragma once

#include <cstddef>
#include <type_traits>

#include "ringzero/zero/memory_space.hpp"
#include "ringzero/zero/optimizer_table.hpp"
#include "ringzero/zero/options.hpp"

namespace ringzero::zero {

/// The fp32 optimizer state of a device space: master weights (16-bit P only) and moments, as
/// shard_optimizer holds them in host memory, addressed by the same local positions.
template <class P, class Space, class Table = builtin_optimizers>
class device_optimizer {
 public:
  static constexpr bool has_master = !std::is_same_v<P, float>;

  /// Throws invalid_argument when Table has no rule for o.kind.
  device_optimizer(const optimizer_options& o, std::size_t local_size, const Space& space)
      : kind_(o.kind), moments_(Table::at(o.kind).moments), size_(local_size) {
    if constexpr (has_master) master_ = space.template allocate_local<float>(local_size);
    m1_ = space.template allocate_local<float>(local_size);
    if (moments_ > 1) m2_ = space.template allocate_local<float>(local_size);
  }

  [[nodiscard]] optimizer_kind kind() const noexcept { return kind_; }
  [[nodiscard]] std::size_t local_size() const noexcept { return size_; }
  [[nodiscard]] int moment_count() const noexcept { return moments_; }
  /// Device pointers, as shard_optimizer's.
  [[nodiscard]] float* master(std::size_t local, P* param) const noexcept {
    if constexpr (has_master)
      return master_.data() + local;
    else
      return param;
  }
  [[nodiscard]] float* moment(int which, std::size_t local) const noexcept {
    return (which == 1 ? m1_.data() : m2_.data()) + local;
  }
  [[nodiscard]] std::size_t moment_size(int which) const noexcept {
    return which <= moments_ ? size_ : 0;
  }
  [[nodiscard]] std::size_t bytes() const noexcept {
    return master_.bytes() + m1_.bytes() + m2_.bytes();
  }

 private:
  optimizer_kind kind_;
  int moments_;
  std::size_t size_;
  buffer<float> master_;
  buffer<float> m1_;
  buffer<float> m2_;
};

}  // namespace ringzero::zero
