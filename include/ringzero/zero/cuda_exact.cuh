// Reproducible training's accumulators on the CUDA device space: exact_ops (detail/
// exact_device.hpp) as the kernels of kernels/cuda/exact_accumulator.cuh, enqueued on the stream
// the sharder names, on the space's device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "ringzero/kernels/cuda/exact_accumulator.cuh"
#include "ringzero/reduce/reproducible_compact.hpp"
#include "ringzero/zero/cuda_space.cuh"
#include "ringzero/zero/detail/exact_device.hpp"

namespace ringzero::zero::detail {

template <>
struct exact_ops<cuda_device_space> {
  template <class G>
  static void add(const cuda_device_space& sp, cudaStream_t s, reproducible::compact_view v,
                  const G* terms) {
    const cuda_space::device_guard guard(sp.device());
    kernels::cuda::compact_add<G>(v, terms, s);
  }
  static void clear(const cuda_device_space& sp, cudaStream_t s, reproducible::compact_view v) {
    const cuda_space::device_guard guard(sp.device());
    kernels::cuda::compact_clear(v, s);
  }
  template <class G>
  static void round(const cuda_device_space& sp, cudaStream_t s, reproducible::compact_view v,
                    G* out) {
    const cuda_space::device_guard guard(sp.device());
    kernels::cuda::compact_round<G>(v, out, s);
  }
  template <class T>
  static void copy(const cuda_device_space& sp, cudaStream_t s, T* dst, const T* src,
                   std::size_t n) {
    if (n == 0) return;
    const cuda_space::device_guard guard(sp.device());
    cuda_space::check(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDeviceToDevice, s),
                      "cudaMemcpyAsync (device to device)");
  }
};

}  // namespace ringzero::zero::detail
