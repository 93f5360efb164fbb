// The kernels behind reproducible training's accumulators on the GPU (zero/exact_gradients.hpp):
// the adds one thread to a block of 64 (compact_block_add of
// reduce/detail/reproducible_compact_block.hpp, which the host and the emulated device run too),
// the rounding one thread to an element, and the clear. Every step is that header's own
// __host__ __device__ function, so the device's words are the host's bit for bit. A thread
// streams its block's terms and words in order: each warp reads 32 separate runs of 256 and 512
// bytes, which the caches serve, where a warp to a block would read whole lines at once but
// could no longer run the same function as the host.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ringzero/kernels/cuda/detail/launch.cuh"
#include "ringzero/reduce/reproducible_compact.hpp"

namespace ringzero::kernels::cuda {

namespace detail {

namespace rp = ringzero::reproducible;

/// Thread b adds terms[64b, 64b + 64) to block b of v: compact_block_add itself, the function
/// the host's loops and the emulated device run, so the device's words are theirs.
template <class G>
__global__ void compact_add_kernel(rp::compact_view v, const G* terms, std::size_t blocks) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t b = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks;
       b += stride) {
    const std::size_t base = b * rp::block_elems;
    const std::size_t len = v.n - base < rp::block_elems ? v.n - base : rp::block_elems;
    // A full pool is marked in v.pool.counts, which the step reads.
    (void)rp::compact_block_add(v, b, terms + base, 0, len);
  }
}

template <class G>
__global__ void compact_round_kernel(rp::compact_view v, G* out) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < v.n;
       i += stride)
    out[i] = rp::compact_round<G>(v, i);
}

template <class Unused = void>
__global__ void compact_clear_kernel(rp::compact_head* heads, std::size_t blocks) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t b = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks;
       b += stride)
    heads[b] = rp::compact_head{};
}

}  // namespace detail

/// v's n elements take terms[0, n) (device memory), enqueued on `stream`.
template <class G>
void compact_add(reproducible::compact_view v, const G* terms, cudaStream_t stream) {
  const std::size_t blocks = reproducible::blocks(v.n);
  if (blocks == 0) return;
  detail::compact_add_kernel<G>
      <<<detail::grid_for(blocks), detail::block_threads, 0, stream>>>(v, terms, blocks);
  detail::check_launch("reproducible accumulator: add");
}

/// out[i] = v's element i rounded, for i < n.
template <class G>
void compact_round(reproducible::compact_view v, G* out, cudaStream_t stream) {
  if (v.n == 0) return;
  detail::compact_round_kernel<G>
      <<<detail::grid_for(v.n), detail::block_threads, 0, stream>>>(v, out);
  detail::check_launch("reproducible accumulator: round");
}

/// Every block of v empty.
inline void compact_clear(reproducible::compact_view v, cudaStream_t stream) {
  const std::size_t blocks = reproducible::blocks(v.n);
  if (blocks == 0) return;
  detail::compact_clear_kernel<>
      <<<detail::grid_for(blocks), detail::block_threads, 0, stream>>>(v.heads, blocks);
  detail::check_launch("reproducible accumulator: clear");
}

}  // namespace ringzero::kernels::cuda
