// Reductions on device memory as plain C++ sees them: two function pointers that take the
// element type at run time. Kernels need nvcc, the NCCL backend does not; the backend's device
// schedules (ring, tree on GPU buffers) reduce through this table, which
// kernels/cuda/device_reduction.cuh fills with the kernels of kernels/cuda/reduce.cuh when a
// translation unit compiled by nvcc includes it. A program that includes it nowhere has no
// table, and the schedules that reduce are refused with an error that says what to include.
#pragma once

#include <fmt/core.h>

#include <atomic>
#include <cstddef>
#include <string_view>

#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

// CUDA's stream type (cudaStream_t is CUstream_st*), named without including a CUDA header.
struct CUstream_st;

namespace ringzero::kernels {

/// Element-wise reductions enqueued on a stream; the pointers are device memory of the current
/// device. Both may throw (a failed launch is a transport_error).
struct device_reduction {
  /// out[i] = a[i] (op) b[i] for i < n, as kernels::cuda::combine; out may alias a or b.
  void (*combine)(dtype type, op o, const void* a, const void* b, void* out, std::size_t n,
                  CUstream_st* stream);
  /// A sum over `ranks` contributions turned into their average in place, as
  /// kernels::cuda::finish_avg.
  void (*finish_avg)(dtype type, void* data, std::size_t n, int ranks, CUstream_st* stream);
};

namespace detail {

// One slot per program: an inline function's static is shared by every translation unit.
[[nodiscard]] inline std::atomic<const device_reduction*>& device_reduction_slot() noexcept {
  static std::atomic<const device_reduction*> slot{nullptr};
  return slot;
}

}  // namespace detail

/// The table a CUDA translation unit registered, or null.
[[nodiscard]] inline const device_reduction* registered_device_reduction() noexcept {
  return detail::device_reduction_slot().load(std::memory_order_acquire);
}

/// The registered table, or unsupported saying what to include: `what` (a collective) run with
/// `algorithm` on GPU buffers reduces.
[[nodiscard]] inline const device_reduction& required_device_reduction(std::string_view what,
                                                                       std::string_view algorithm) {
  if (const device_reduction* r = registered_device_reduction(); r != nullptr) return *r;
  throw unsupported(fmt::format(
      "{}: algorithm '{}' on GPU buffers reduces with ringzero's CUDA kernels, and this program "
      "has none: include <ringzero/kernels/cuda/device_reduction.cuh> in one .cu file compiled "
      "by nvcc (CMake: link ringzero::cuda)",
      what, algorithm));
}

/// Makes `r` (which must outlive every use: a constant) the program's table.
inline void register_device_reduction(const device_reduction& r) noexcept {
  detail::device_reduction_slot().store(&r, std::memory_order_release);
}

}  // namespace ringzero::kernels
