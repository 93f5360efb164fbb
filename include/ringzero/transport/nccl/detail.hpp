// Internals of the NCCL backend: CUDA and NCCL status codes turned into ringzero errors, element
// types and ops mapped to NCCL's enums, the current-device guard, and the check that a buffer is
// memory the communicator's GPU can address. Plain C++: nothing here needs nvcc.
#pragma once

#include <cuda_runtime.h>
#include <fmt/core.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>

#include "ringzero/detail/cuda_runtime.hpp"
#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::nccl::detail {

[[nodiscard]] constexpr ncclDataType_t to_nccl(dtype t) noexcept {
  switch (t) {
    case dtype::int8:
      return ncclInt8;
    case dtype::uint8:
      return ncclUint8;
    case dtype::int32:
      return ncclInt32;
    case dtype::uint32:
      return ncclUint32;
    case dtype::int64:
      return ncclInt64;
    case dtype::uint64:
      return ncclUint64;
    case dtype::float16:
      return ncclFloat16;
    case dtype::float32:
      return ncclFloat32;
    case dtype::float64:
      return ncclFloat64;
    case dtype::bfloat16:
      return ncclBfloat16;
  }
  return ncclNumTypes;
}

[[nodiscard]] constexpr ncclRedOp_t to_nccl(op o) noexcept {
  switch (o) {
    case op::sum:
      return ncclSum;
    case op::prod:
      return ncclProd;
    case op::min:
      return ncclMin;
    case op::max:
      return ncclMax;
    case op::avg:
      return ncclAvg;
  }
  return ncclNumOps;
}

template <element E>
inline constexpr ncclDataType_t nccl_type_v = to_nccl(dtype_of<std::remove_cv_t<E>>());

using ringzero::detail::check_cuda;
using ringzero::detail::cuda_message;

/// NCCL's text for a status, plus its last-error text when it has one. The last error is
/// process-wide in NCCL, so it can describe an earlier failure; it is still the best detail
/// there is (it names the duplicate GPU, the failed socket, the bad argument).
[[nodiscard]] inline std::string nccl_message(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') s += fmt::format("; NCCL's last error: {}", last);
  return s;
}

/// A communicator's handle for as long as it may be used: null once the communicator was aborted
/// or closed (ncclCommAbort and ncclCommDestroy free it). Memory registered through it
/// deregisters under the mutex, and only while the handle is set: a sharder's buffers freed
/// after a failure must not reach a freed communicator.
struct live_handle {
  std::mutex mutex;
  ncclComm_t comm = nullptr;
};

/// CUDA's current device is per thread and NCCL enqueues on whatever device is current, so every
/// entry point pins the communicator's own.
using device_guard = ringzero::detail::cuda_device_guard;

/// Refuses a buffer the GPU cannot address before NCCL sees it: NCCL does not check pointers by
/// default, and a host pointer reaches the kernel as an illegal address that poisons the whole
/// CUDA context. Both ends of the range are checked, which also catches a span longer than its
/// allocation in the common case. Costs two cudaPointerGetAttributes calls (well under a
/// microsecond each).
/// Whether [data, data + bytes) is host memory CUDA does not know (not device, managed or
/// registered host memory): what NCCL cannot read.
[[nodiscard]] inline bool plain_host(const void* data, std::size_t bytes) {
  if (bytes == 0) return true;
  const auto* first = static_cast<const std::byte*>(data);
  for (const std::byte* p : {first, first + bytes - 1}) {
    cudaPointerAttributes attr{};
    const cudaError_t e = cudaPointerGetAttributes(&attr, p);
    if (e != cudaSuccess) static_cast<void>(cudaGetLastError());
    if (e == cudaSuccess && attr.type != cudaMemoryTypeUnregistered) return false;
  }
  return true;
}

inline void check_device_buffer(std::string_view what, std::string_view name, const void* data,
                                std::size_t bytes, int device) {
  if (bytes == 0) return;
  const auto* first = static_cast<const std::byte*>(data);
  for (const std::byte* p : {first, first + bytes - 1}) {
    cudaPointerAttributes attr{};
    const cudaError_t e = cudaPointerGetAttributes(&attr, p);
    if (e != cudaSuccess) static_cast<void>(cudaGetLastError());
    const std::string_view end = p == first ? "start" : "end";
    if (e != cudaSuccess || attr.type == cudaMemoryTypeUnregistered)
      throw invalid_argument(fmt::format(
          "{}: the {} of the {} ({} bytes at {}) is not memory a GPU can address (allocate it "
          "with cudaMalloc or ncclMemAlloc, or register host memory with cudaHostRegister)",
          what, end, name, bytes, data));
    if (attr.type == cudaMemoryTypeDevice && attr.device != device)
      throw invalid_argument(
          fmt::format("{}: the {} of the {} is memory of device {} but this "
                      "communicator uses device {}",
                      what, end, name, attr.device, device));
  }
}

}  // namespace ringzero::nccl::detail

namespace ringzero::nccl {

/// Number of CUDA devices this process can use; 0 where there is no device or no driver (the
/// NCCL backend is then unavailable, and tests skip). Other CUDA failures raise transport_error.
[[nodiscard]] inline int device_count() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
    static_cast<void>(cudaGetLastError());
    return 0;
  }
  detail::check_cuda(e, "cudaGetDeviceCount");
  return n;
}

}  // namespace ringzero::nccl
