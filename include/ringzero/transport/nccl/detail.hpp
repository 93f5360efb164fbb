// Internals of the NCCL backend: CUDA and NCCL status codes turned into ringzero errors, element
// types and ops mapped to NCCL's enums, the current-device guard, the check that a buffer is
// memory the communicator's GPU can address, the device a rank picks, stream-ordered scratch and
// the groups of sends and receives the block collectives are made of. Plain C++: nothing here
// needs nvcc.
#pragma once

#include <cuda_runtime.h>
#include <fmt/core.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "ringzero/detail/cuda_runtime.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/detail/rank_device.hpp"
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

namespace ringzero::nccl::detail {

[[nodiscard]] inline std::chrono::nanoseconds resolve_timeout(std::chrono::nanoseconds t) {
  return t.count() > 0 ? t : ringzero::detail::env_timeout();
}

inline void check_nccl(ncclResult_t r, std::string_view what) {
  if (r != ncclSuccess)
    throw transport_error(fmt::format("{}: NCCL error: {}", what, nccl_message(r, nullptr)));
}

/// The number of visible devices; unsupported when there is none.
[[nodiscard]] inline int require_devices() {
  const int n = device_count();
  if (n == 0)
    throw unsupported(
        "nccl: no CUDA device is visible to this process (cudaGetDeviceCount found no GPU or no "
        "driver); the NCCL backend needs one GPU per rank");
  return n;
}

/// The device of rank `rank` (ringzero::detail::choose_rank_device).
[[nodiscard]] inline int pick_device(int requested, int rank) {
  const int n = require_devices();
  try {
    return ringzero::detail::choose_rank_device(requested, n, rank);
  } catch (const invalid_argument& e) {
    throw invalid_argument(
        fmt::format("nccl: {}", std::string_view(e.what()).substr(sizeof "ringzero: " - 1)));
  }
}

/// Makes `device` the calling thread's current device, for good (the constructors' contract).
inline void make_current(int device) {
  check_cuda(cudaSetDevice(device), fmt::format("nccl: cudaSetDevice({})", device));
}

/// A CUDA failure inside an enqueued group, reported the way NCCL reports its own.
[[nodiscard]] inline ncclResult_t cuda_status(cudaError_t e) noexcept {
  return e == cudaSuccess ? ncclSuccess : ncclUnhandledCudaError;
}

/// Stream-ordered device scratch (cudaMallocAsync), freed on the same stream when the scope
/// ends. Freed only after the enqueue that uses it has returned: in non-blocking mode
/// ncclGroupEnd may answer before the group's kernels are on the stream, so a free enqueued
/// inside the group's callback could run ahead of them.
class stream_scratch {
 public:
  stream_scratch(int device, cudaStream_t s, std::size_t bytes) : device_(device), stream_(s) {
    const device_guard guard(device_);
    check_cuda(cudaMallocAsync(&data_, bytes, stream_), "nccl: cudaMallocAsync");
  }
  ~stream_scratch() {
    int previous = device_;
    static_cast<void>(cudaGetDevice(&previous));
    if (previous != device_) static_cast<void>(cudaSetDevice(device_));
    static_cast<void>(cudaFreeAsync(data_, stream_));
    if (previous != device_) static_cast<void>(cudaSetDevice(previous));
  }
  stream_scratch(const stream_scratch&) = delete;
  stream_scratch& operator=(const stream_scratch&) = delete;
  [[nodiscard]] void* data() const noexcept { return data_; }

 private:
  int device_;
  cudaStream_t stream_;
  void* data_ = nullptr;
};

/// Blocks between every pair of ranks in one group, as nccl-tests' alltoall issues them: per
/// peer (this rank included) one ncclSend of its block and one ncclRecv of the peer's. Counts
/// and displacements are in elements of `es` bytes; empty blocks are skipped on both sides,
/// which agree on them.
[[nodiscard]] inline ncclResult_t exchange_blocks(
    ncclComm_t h, cudaStream_t s, int size, ncclDataType_t type, std::size_t es,
    const std::byte* in, std::span<const std::size_t> send_counts,
    std::span<const std::size_t> send_displs, std::byte* out,
    std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
  if (const ncclResult_t r = ncclGroupStart(); r != ncclSuccess) return r;
  ncclResult_t first = ncclSuccess;
  for (int p = 0; p < size && first == ncclSuccess; ++p) {
    const auto up = static_cast<std::size_t>(p);
    if (send_counts[up] > 0)
      first = ncclSend(in + send_displs[up] * es, send_counts[up], type, p, h, s);
    if (first == ncclSuccess && recv_counts[up] > 0)
      first = ncclRecv(out + recv_displs[up] * es, recv_counts[up], type, p, h, s);
  }
  const ncclResult_t end = ncclGroupEnd();
  return first != ncclSuccess ? first : end;
}

/// The root's side of gather (receive) or scatter (send): one message per other rank, grouped.
template <class Op>
[[nodiscard]] ncclResult_t root_group(int size, int root, Op&& one) {
  if (const ncclResult_t r = ncclGroupStart(); r != ncclSuccess) return r;
  ncclResult_t first = ncclSuccess;
  for (int p = 0; p < size && first == ncclSuccess; ++p)
    if (p != root) first = one(p);
  const ncclResult_t end = ncclGroupEnd();
  return first != ncclSuccess ? first : end;
}

}  // namespace ringzero::nccl::detail
