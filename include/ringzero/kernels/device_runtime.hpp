// The CUDA runtime calls a messaging transport's device executor needs (detail/device_executor.hpp:
// libfabric with FI_HMEM), as plain C++ sees them: function pointers registered at start-up by
// kernels/cuda/device_reduction.cuh, like the reductions of kernels/device_reduction.hpp. The
// collectives stay plain C++ and the libfabric component links no CUDA; a program that includes
// that header in one .cu file can pass device buffers to ringzero::all_reduce and friends on a
// communicator whose transport moves device memory. Tests register a host stand-in.
#pragma once

#include <atomic>
#include <cstddef>

// CUDA's stream and event types (cudaStream_t is CUstream_st*, cudaEvent_t CUevent_st*), named
// without including a CUDA header.
struct CUstream_st;
struct CUevent_st;

namespace ringzero::kernels {

/// Every function may throw transport_error on a CUDA error, except those marked noexcept.
struct device_runtime {
  /// The ordinal of the CUDA device `p` is device memory of, or -1 for any other memory.
  int (*device_of)(const void* p);
  /// The current device of the calling thread, and setting it.
  int (*current_device)();
  void (*set_device)(int device);
  /// A non-blocking stream on `device` (which is current), and its destruction.
  CUstream_st* (*create_stream)(int device);
  void (*destroy_stream)(CUstream_st* stream) noexcept;
  /// Enqueues a device-to-device copy of `bytes` on `stream`.
  void (*copy)(void* dst, const void* src, std::size_t bytes, CUstream_st* stream);
  /// An event recorded on `stream` now; whether it completed (never blocks); its destruction.
  CUevent_st* (*record)(CUstream_st* stream);
  bool (*done)(CUevent_st* event);
  void (*destroy_event)(CUevent_st* event) noexcept;
  /// Blocks until `stream` is idle, ignoring errors: for unwinding after a failure.
  void (*drain)(CUstream_st* stream) noexcept;
  /// Device memory of the current device, and its release.
  void* (*allocate)(std::size_t bytes);
  void (*release)(void* p) noexcept;
};

namespace detail {

[[nodiscard]] inline std::atomic<const device_runtime*>& device_runtime_slot() noexcept {
  static std::atomic<const device_runtime*> slot{nullptr};
  return slot;
}

}  // namespace detail

/// The table a CUDA translation unit registered, or null.
[[nodiscard]] inline const device_runtime* registered_device_runtime() noexcept {
  return detail::device_runtime_slot().load(std::memory_order_acquire);
}

/// Makes `r` (which must outlive every use: a constant) the program's table; null removes it.
inline void register_device_runtime(const device_runtime* r) noexcept {
  detail::device_runtime_slot().store(r, std::memory_order_release);
}

}  // namespace ringzero::kernels
