// What the CUDA kernels share: error checks, the grid size, and 16-byte vector access.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "ringzero/detail/cuda_runtime.hpp"
#include "ringzero/error.hpp"

namespace ringzero::kernels::cuda::detail {

using ringzero::detail::check_cuda;

/// Raises the error of the launch just made (bad configuration, no device), if any.
inline void check_launch(const char* what) {
  check_cuda(cudaGetLastError(), what);
}

inline constexpr int block_threads = 256;

/// The multiprocessor count of the current device, asked of the driver once per device: a
/// launch should not pay for two driver queries (a step launches dozens of kernels).
inline int multiprocessors() {
  constexpr int cached_devices = 64;
  static std::atomic<int> known[cached_devices] = {};
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (device >= 0 && device < cached_devices) {
    if (const int n = known[device].load(std::memory_order_relaxed); n > 0) return n;
  }
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute(multiprocessor count)");
  if (device >= 0 && device < cached_devices) known[device].store(sms, std::memory_order_relaxed);
  return sms;
}

/// Enough blocks to fill every SM several times over, and no more than there is work for: the
/// kernels loop over the rest (grid-stride), so one launch shape serves every size.
inline unsigned grid_for(std::size_t items) {
  const std::size_t wanted = (items + block_threads - 1) / block_threads;
  const std::size_t cap = static_cast<std::size_t>(multiprocessors()) * 8;
  return static_cast<unsigned>(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
}

[[nodiscard]] inline bool aligned(const void* p, std::size_t bytes) noexcept {
  return (reinterpret_cast<std::uintptr_t>(p) & (bytes - 1)) == 0;
}
[[nodiscard]] inline bool aligned16(const void* p) noexcept {
  return aligned(p, 16);
}

/// V elements of T held in registers and moved as whole 16-byte words (8-byte ones when the
/// vector is 8 bytes: four 16-bit elements beside four floats).
template <class T, int V>
struct vec {
  static_assert((V * sizeof(T)) % 16 == 0 || V * sizeof(T) == 8,
                "a vec is 8 bytes or a whole number of 16-byte words");
  alignas(V * sizeof(T) >= 16 ? 16 : 8) T v[V];
};

template <class T, int V>
__device__ __forceinline__ vec<T, V> load(const T* p) {
  vec<T, V> r;
  if constexpr (V * sizeof(T) == 8) {
    *reinterpret_cast<uint2*>(r.v) = *reinterpret_cast<const uint2*>(p);
  } else {
    constexpr int words = static_cast<int>(V * sizeof(T) / 16);
#pragma unroll
    for (int k = 0; k < words; ++k)
      reinterpret_cast<uint4*>(r.v)[k] = reinterpret_cast<const uint4*>(p)[k];
  }
  return r;
}

template <class T, int V>
__device__ __forceinline__ void store(T* p, const vec<T, V>& r) {
  if constexpr (V * sizeof(T) == 8) {
    *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(r.v);
  } else {
    constexpr int words = static_cast<int>(V * sizeof(T) / 16);
#pragma unroll
    for (int k = 0; k < words; ++k)
      reinterpret_cast<uint4*>(p)[k] = reinterpret_cast<const uint4*>(r.v)[k];
  }
}

}  // namespace ringzero::kernels::cuda::detail
