// CUDA runtime failures as ringzero errors, and the current-device guard: one definition for the
// NCCL backend, the CUDA kernels, the sharder's CUDA space and ringzero-perf's device buffers.
// Plain C++ (nothing here needs nvcc), but it needs the CUDA runtime's headers, so it ships with
// ringzero::nccl and ringzero::cuda rather than with the core.
#pragma once

#include <cuda_runtime.h>
#include <fmt/core.h>

#include <chrono>
#include <string>
#include <string_view>

#include "ringzero/detail/backoff.hpp"
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

/// Waits on the host until everything queued on `s` has run, polling (cudaStreamQuery) for at
/// most `limit`: a stream behind a collective whose peer died never drains, and
/// cudaStreamSynchronize would hold the host for good. Throws timeout_error "<what>: ..." past
/// the limit and transport_error on a CUDA error.
inline void wait_stream(cudaStream_t s, std::chrono::nanoseconds limit, std::string_view what) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  backoff b;
  for (;;) {
    const cudaError_t q = cudaStreamQuery(s);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) check_cuda(q, what);
    if (std::chrono::steady_clock::now() > deadline)
      throw timeout_error(
          fmt::format("{}: the device's work did not finish within {:g} s (RINGZERO_TIMEOUT sets "
                      "the limit)",
                      what, std::chrono::duration<double>(limit).count()),
          -1);
    b.pause();
  }
}

/// wait_stream for unwinding: errors ignored; false when `limit` passed first.
[[nodiscard]] inline bool drain_stream(cudaStream_t s, std::chrono::nanoseconds limit) noexcept {
  try {
    wait_stream(s, limit, "drain");
    return true;
  } catch (const timeout_error&) {
    return false;
  } catch (...) {
    static_cast<void>(cudaGetLastError());
    return true;
  }
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
