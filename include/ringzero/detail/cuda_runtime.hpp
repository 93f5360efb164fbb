// CUDA runtime failures as ringzero errors, and the current-device guard: one definition for the
// NCCL backend, the CUDA kernels, the sharder's CUDA space and ringzero-perf's device buffers.
// Plain C++ (nothing here needs nvcc), but it needs the CUDA runtime's headers, so it ships with
// ringzero::nccl and ringzero::cuda rather than with the core.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <string_view>

#include "ringzero/error.hpp"

namespace ringzero::detail {

/// The runtime's text for a status and its enumerator's name: "out of memory
/// (cudaErrorMemoryAllocation)".
[[nodiscard]] inline std::string cuda_message(cudaError_t e) {
  return std::string(cudaGetErrorString(e)) + " (" + cudaGetErrorName(e) + ")";
}

/// Throws transport_error "<what>: CUDA error: <message>" unless `e` is cudaSuccess.
inline void check_cuda(cudaError_t e, std::string_view what) {
  if (e != cudaSuccess)
    throw transport_error(std::string(what) + ": CUDA error: " + cuda_message(e));
}

/// Makes `device` current for a scope and restores the caller's device after. CUDA's current
/// device is per thread, and a launch, an allocation or an NCCL call goes to whichever device is
/// current: every entry point that works on an object's device pins it, whatever thread calls.
class cuda_device_guard {
 public:
  explicit cuda_device_guard(int device) : device_(device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device_) check_cuda(cudaSetDevice(device_), "cudaSetDevice");
  }
  ~cuda_device_guard() {
    if (previous_ != device_) static_cast<void>(cudaSetDevice(previous_));
  }
  cuda_device_guard(const cuda_device_guard&) = delete;
  cuda_device_guard& operator=(const cuda_device_guard&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

}  // namespace ringzero::detail
