// Reproducible training's accumulators on the CUDA device space: exact_ops (detail/
// exact_device.hpp) as the kernels of kernels/cuda/exact_accumulator.cuh and the exact norm's
// binning below, enqueued on the stream the sharder names, on the space's device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ringzero/kernels/cuda/exact_accumulator.cuh"
#include "ringzero/reduce/reproducible_compact.hpp"
#include "ringzero/zero/cuda_space.cuh"
#include "ringzero/zero/detail/exact_device.hpp"
#include "ringzero/zero/detail/exact_sumsq.hpp"

namespace ringzero::zero::detail {

namespace cuda_exact {

/// Squares of g[0, n) into bins (device_bins words): each block bins its elements in shared
/// memory (128-bit bins as two 64-bit words, the carry found from the returned old value), then
/// adds its bins to the global ones.
template <class G>
__global__ void sumsq_kernel(const G* g, std::size_t n, std::uint64_t* bins) {
  using ull = unsigned long long;
  __shared__ ull lo[256], hi[256];
  __shared__ int bad;
  for (unsigned t = threadIdx.x; t < 256; t += blockDim.x) lo[t] = hi[t] = 0;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    std::uint32_t e = 0;
    std::uint64_t m2 = 0;
    if (!square_of(g[i], e, m2)) {
      bad = 1;
      continue;
    }
    const ull old = atomicAdd(&lo[e], static_cast<ull>(m2));
    if (old + m2 < old) atomicAdd(&hi[e], 1ull);
  }
  __syncthreads();
  auto* out = reinterpret_cast<ull*>(bins);
  for (unsigned t = threadIdx.x; t < 256; t += blockDim.x) {
    if (lo[t] != 0) {
      const ull old = atomicAdd(&out[2 * t], lo[t]);
      if (old + lo[t] < old) atomicAdd(&out[2 * t + 1], 1ull);
    }
    if (hi[t] != 0) atomicAdd(&out[2 * t + 1], hi[t]);
  }
  if (threadIdx.x == 0 && bad != 0) atomicExch(&out[512], 1ull);
}

}  // namespace cuda_exact

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
  template <class G>
  static void sumsq(const cuda_device_space& sp, cudaStream_t s, const G* g, std::size_t n,
                    std::uint64_t* bins) {
    if (n == 0) return;
    const cuda_space::device_guard guard(sp.device());
    cuda_exact::sumsq_kernel<G>
        <<<kernels::cuda::detail::grid_for(n), kernels::cuda::detail::block_threads, 0, s>>>(g, n,
                                                                                             bins);
    kernels::cuda::detail::check_launch("zero: reproducible norm");
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
