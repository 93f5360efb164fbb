// The kernels behind kernels::device_reproducible: options::reproducible's per-element passes
// (reduce/reproducible.hpp) on device buffers, one thread per block of 64 for the windows and
// one per element for the digits and the rounding, so the device computes exactly the host's
// integers and rounds them to the host's bits; the digits' layout is CUB's scan of the blocks'
// digit counts. Registered by kernels/cuda/device_reduction.cuh.
#pragma once

#include <cuda_runtime.h>
#include <cub/device/device_scan.cuh>

#include <cstddef>
#include <cstdint>

#include "ringzero/detail/cuda_runtime.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/kernels/cuda/detail/launch.cuh"
#include "ringzero/kernels/device_reproducible.hpp"
#include "ringzero/reduce/reproducible.hpp"
#include "ringzero/types.hpp"

namespace ringzero::kernels::cuda {

namespace detail {

namespace rp = ringzero::reproducible;

template <class T>
__global__ void rp_windows_kernel(const T* in, std::size_t n, std::size_t blocks,
                                  std::int32_t* win) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t b = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks;
       b += stride) {
    bool special = false;
    const rp::window w = rp::block_window(in, n, b, special);
    win[2 * b] = w.top;
    win[2 * b + 1] = w.neg_low;
    if (special) atomicOr(&win[2 * blocks], 1);
  }
}

/// off[b] = block b's digit count for b < blocks, and 0 at `blocks`, where the scan leaves the
/// total. (A template, as every kernel in these headers, so each program has one definition.)
template <class Off>
__global__ void rp_block_digits_kernel(const std::int32_t* win, std::size_t n, std::size_t blocks,
                                       Off* off) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t b = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; b <= blocks;
       b += stride)
    off[b] = b < blocks ? rp::block_digits(win, n, b) : 0;
}

template <class Off>
__global__ void rp_bounds_kernel(const std::int32_t* win, const Off* off, std::size_t n,
                                 std::size_t part, std::size_t parts, Off* bounds) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t r = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; r <= parts;
       r += stride)
    bounds[r] = rp::range_position(win, off, n, r * part);
}

template <class T>
__global__ void rp_digits_kernel(const T* in, std::size_t n, const std::int32_t* win,
                                 const std::uint64_t* off, std::size_t count, std::size_t seg,
                                 std::int64_t* q) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    rp::element_digits(in, i, win, off, count, seg, q);
}

template <class T>
__global__ void rp_round_kernel(const std::int64_t* q, const std::int32_t* win,
                                const std::uint64_t* off, std::size_t from, std::size_t count,
                                std::uint32_t divisor, T* out) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t j = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < count;
       j += stride)
    out[j] = rp::element_round<T>(q, win, off, from, from + j, divisor);
}

template <class T>
__global__ void rp_codes_kernel(const T* in, std::size_t n, std::int64_t* codes) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    codes[i] = rp::special_code(rp::decompose(in[i]));
}

template <class T>
__global__ void rp_apply_kernel(const std::int64_t* codes, std::size_t n, T* out) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    T v{};
    if (rp::special_result(codes[i], v)) out[i] = v;
  }
}

/// f(T{}) for the floating types the reproducible sum takes; others are refused before here.
template <class F>
void visit_reproducible(dtype type, F&& f) {
  visit_dtype(type, [&](auto zero) {
    using T = decltype(zero);
    if constexpr (rp::supported_v<T>) {
      f(zero);
    } else {
      throw invalid_argument("options::reproducible: no device kernels for this element type");
    }
  });
}

inline void rp_windows(dtype type, const void* in, std::size_t n, std::int32_t* win,
                       CUstream_st* s) {
  const std::size_t blocks = rp::blocks(n);
  check_cuda(cudaMemsetAsync(win + 2 * blocks, 0, sizeof(std::int32_t), s), "cudaMemsetAsync");
  if (blocks == 0) return;
  visit_reproducible(type, [&](auto zero) {
    using T = decltype(zero);
    rp_windows_kernel<T>
        <<<grid_for(blocks), block_threads, 0, s>>>(static_cast<const T*>(in), n, blocks, win);
    check_launch("options::reproducible: windows");
  });
}

inline std::size_t rp_layout_scratch(std::size_t n) {
  const std::size_t blocks = rp::blocks(n);
  std::size_t bytes = 0;
  check_cuda(cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<std::uint64_t*>(nullptr),
                                           blocks + 1),
             "options::reproducible: the layout's scan (size)");
  return bytes;
}

inline void rp_layout(const std::int32_t* win, std::size_t n, std::size_t part, std::size_t parts,
                      std::uint64_t* off, std::uint64_t* bounds, void* scratch,
                      std::size_t scratch_bytes, CUstream_st* s) {
  const std::size_t blocks = rp::blocks(n);
  rp_block_digits_kernel<<<grid_for(blocks + 1), block_threads, 0, s>>>(win, n, blocks, off);
  check_launch("options::reproducible: digit counts");
  check_cuda(cub::DeviceScan::ExclusiveSum(scratch, scratch_bytes, off, blocks + 1, s),
             "options::reproducible: the layout's scan");
  rp_bounds_kernel<<<grid_for(parts + 1), block_threads, 0, s>>>(win, off, n, part, parts, bounds);
  check_launch("options::reproducible: part bounds");
}

inline void rp_digits(dtype type, const void* in, std::size_t n, const std::int32_t* win,
                      const std::uint64_t* off, std::size_t count, std::size_t seg, std::int64_t* q,
                      CUstream_st* s) {
  if (n == 0) return;
  // The padding between reduce_scatter segments is added and never read; zeroed all the same,
  // so no collective reads memory nothing wrote.
  if (seg != 0)
    check_cuda(cudaMemsetAsync(q, 0, seg * (n / count) * sizeof(std::int64_t), s),
               "cudaMemsetAsync");
  visit_reproducible(type, [&](auto zero) {
    using T = decltype(zero);
    rp_digits_kernel<T><<<grid_for(n), block_threads, 0, s>>>(static_cast<const T*>(in), n, win,
                                                              off, count, seg, q);
    check_launch("options::reproducible: digits");
  });
}

inline void rp_round(dtype type, const std::int64_t* q, const std::int32_t* win,
                     const std::uint64_t* off, std::size_t from, std::size_t count,
                     std::uint32_t divisor, void* out, CUstream_st* s) {
  if (count == 0) return;
  visit_reproducible(type, [&](auto zero) {
    using T = decltype(zero);
    rp_round_kernel<T><<<grid_for(count), block_threads, 0, s>>>(q, win, off, from, count, divisor,
                                                                 static_cast<T*>(out));
    check_launch("options::reproducible: round");
  });
}

inline void rp_special_codes(dtype type, const void* in, std::size_t n, std::int64_t* codes,
                             CUstream_st* s) {
  if (n == 0) return;
  visit_reproducible(type, [&](auto zero) {
    using T = decltype(zero);
    rp_codes_kernel<T><<<grid_for(n), block_threads, 0, s>>>(static_cast<const T*>(in), n, codes);
    check_launch("options::reproducible: inf/NaN codes");
  });
}

inline void rp_apply_specials(dtype type, const std::int64_t* codes, std::size_t n, void* out,
                              CUstream_st* s) {
  if (n == 0) return;
  visit_reproducible(type, [&](auto zero) {
    using T = decltype(zero);
    rp_apply_kernel<T><<<grid_for(n), block_threads, 0, s>>>(codes, n, static_cast<T*>(out));
    check_launch("options::reproducible: inf/NaN results");
  });
}

inline void rp_copy(void* dst, const void* src, std::size_t bytes, CUstream_st* s) {
  check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), "cudaMemcpyAsync");
}

inline void rp_synchronize(CUstream_st* s) {
  ringzero::detail::wait_stream(s, ringzero::detail::env_timeout(), "options::reproducible");
}

inline void rp_after(CUstream_st* s, CUstream_st* caller) {
  cudaEvent_t e = nullptr;
  check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  const cudaError_t recorded = cudaEventRecord(e, caller);
  const cudaError_t waited = recorded == cudaSuccess ? cudaStreamWaitEvent(s, e, 0) : recorded;
  static_cast<void>(cudaEventDestroy(e));  // released once the wait is satisfied
  check_cuda(waited, "options::reproducible: ordering behind the caller's stream");
}

}  // namespace detail

/// The table kernels/cuda/device_reduction.cuh registers.
inline constexpr device_reproducible device_reproducible_kernels{
    &detail::rp_windows,        &detail::rp_layout_scratch, &detail::rp_layout,
    &detail::rp_digits,         &detail::rp_round,          &detail::rp_special_codes,
    &detail::rp_apply_specials, &detail::rp_copy,           &detail::rp_synchronize,
    &detail::rp_after};

}  // namespace ringzero::kernels::cuda
