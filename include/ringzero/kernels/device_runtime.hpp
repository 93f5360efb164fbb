// The CUDA runtime calls a messaging transport's device executor needs (detail/device_executor.hpp:
// libfabric with FI_HMEM), as plain C++ sees them: function pointers registered at start-up by
// kernels/cuda/device_reduction.cuh, like the reductions of kernels/device_reduction.hpp. The
// collectives stay plain C++ and the libfabric component links no CUDA; a program that includes
// that header in one .cu file can pass device buffers to ringzero::all_reduce and friends on a
// communicator whose transport moves device memory. Tests register a host stand-in.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

// CUDA's stream and event types (cudaStream_t is CUstream_st*, cudaEvent_t CUevent_st*), named
// without including a CUDA header.
struct CUstream_st;
struct CUevent_st;

namespace ringzero::kernels {

/// The device allocation a pointer lies in: its first byte, its size, and the id the driver gave
/// it (CU_POINTER_ATTRIBUTE_BUFFER_ID, never reused in a process), so that a new allocation at
/// the address of a freed one is told apart from it. All zero for memory that is not device
/// memory.
struct device_allocation {
  const void* base = nullptr;
  std::size_t bytes = 0;
  std::uint64_t id = 0;
};

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
  /// Waits until `stream` is idle, ignoring errors, for at most `limit`: for unwinding after a
  /// failure, where a stream held by a collective whose peer died never drains. false when it
  /// gave up.
  bool (*drain)(CUstream_st* stream, std::chrono::nanoseconds limit) noexcept;
  /// Device memory of the current device, and its release.
  void* (*allocate)(std::size_t bytes);
  void (*release)(void* p) noexcept;
  /// The allocation `p` lies in (cuPointerGetAttributes).
  device_allocation (*allocation_of)(const void* p);
  /// Whether a kernel on `device` sees what a NIC wrote into its memory by GPUDirect RDMA once
  /// the receive completed (cudaDevAttrGPUDirectRDMAWritesOrdering at least "owner"). Where not,
  /// flush_remote_writes() must come between the completion and the kernel that reads the data.
  bool (*remote_writes_ordered)(int device);
  /// Returns once remote writes to the current device are visible to it
  /// (cudaDeviceFlushGPUDirectRDMAWrites, to the owner).
  void (*flush_remote_writes)();
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
