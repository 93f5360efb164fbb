// The kernels of reduce.cuh behind kernels::device_reduction's run-time table, and the CUDA
// runtime behind kernels::device_runtime's, both registered when the program starts. Include
// this in one .cu file of a program (CMake: link ringzero::cuda) to let ringzero's schedules run
// on GPU buffers: on NCCL those options::algorithm forces (ring or tree), on libfabric opened
// with options::device_memory every collective the schedules implement; a program without it
// gets an error naming this header instead. Instantiates combine and finish_avg for every
// element type and op, and options::reproducible's kernels (kernels/cuda/reproducible.cuh).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstddef>
#include <cstdint>

#include "ringzero/detail/cuda_runtime.hpp"
#include "ringzero/kernels/cuda/reduce.cuh"
#include "ringzero/kernels/cuda/reproducible.cuh"
#include "ringzero/kernels/device_reduction.hpp"
#include "ringzero/kernels/device_runtime.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::kernels::cuda {

namespace detail {

inline void combine_any(dtype type, op o, const void* a, const void* b, void* out, std::size_t n,
                        CUstream_st* stream) {
  visit_dtype(type, [&](auto zero) {
    using T = decltype(zero);
    cuda::combine<T>(o, static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), n,
                     stream);
  });
}

inline void finish_avg_any(dtype type, void* data, std::size_t n, int ranks, CUstream_st* stream) {
  visit_dtype(type, [&](auto zero) {
    using T = decltype(zero);
    cuda::finish_avg<T>(static_cast<T*>(data), n, ranks, stream);
  });
}

}  // namespace detail

/// The table this header registers.
inline constexpr device_reduction device_reductions{&detail::combine_any, &detail::finish_avg_any};

namespace detail {

/// Every collective on a transport that moves device memory asks this of its buffers, so the
/// last few host pointers are remembered per thread: a training loop passes the same buffers
/// call after call, and cudaPointerGetAttributes costs more than a small shm message's whole
/// exchange. Only "not device memory" is remembered, which stays true: under unified
/// addressing cudaMalloc hands out addresses from a range the driver reserved, which host
/// allocations never reuse.
inline int device_of(const void* p) {
  constexpr std::size_t remembered = 4;
  thread_local const void* host[remembered] = {};
  thread_local std::size_t next = 0;
  for (const void* h : host)
    if (h == p && p != nullptr) return -1;
  cudaPointerAttributes attr{};
  int device = -1;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess)
    // Older runtimes answer an unknown host pointer with an error: it is not device memory.
    static_cast<void>(cudaGetLastError());
  else if (attr.type == cudaMemoryTypeDevice)
    device = attr.device;
  if (device < 0) host[next++ % remembered] = p;
  return device;
}

inline int current_device() {
  int d = 0;
  check_cuda(cudaGetDevice(&d), "cudaGetDevice");
  return d;
}

inline void set_device(int device) {
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
}

inline CUstream_st* create_stream(int) {
  cudaStream_t s = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return s;
}

inline void destroy_stream(CUstream_st* s) noexcept {
  static_cast<void>(cudaStreamDestroy(s));
}

inline void copy(void* dst, const void* src, std::size_t bytes, CUstream_st* s) {
  check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
}

inline CUevent_st* record(CUstream_st* s) {
  cudaEvent_t e = nullptr;
  check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  if (const cudaError_t r = cudaEventRecord(e, s); r != cudaSuccess) {
    static_cast<void>(cudaEventDestroy(e));
    check_cuda(r, "cudaEventRecord");
  }
  return e;
}

inline bool done(CUevent_st* e) {
  const cudaError_t r = cudaEventQuery(e);
  if (r == cudaErrorNotReady) return false;
  check_cuda(r, "cudaEventQuery");
  return true;
}

inline void destroy_event(CUevent_st* e) noexcept {
  static_cast<void>(cudaEventDestroy(e));
}

inline bool drain(CUstream_st* s, std::chrono::nanoseconds limit) noexcept {
  return ringzero::detail::drain_stream(s, limit);
}

inline void* allocate(std::size_t bytes) {
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, bytes), "cudaMalloc");
  return p;
}

inline void release(void* p) noexcept {
  static_cast<void>(cudaFree(p));
}

/// The driver's cuPointerGetAttributes, found through the runtime: linking libcuda itself would
/// make every program of the component need the driver to start, GPU or not.
inline decltype(&cuPointerGetAttributes) pointer_attributes() {
  static const auto fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuPointerGetAttributes", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      static_cast<void>(cudaGetLastError());
      f = nullptr;
    }
    return reinterpret_cast<decltype(&cuPointerGetAttributes)>(f);
  }();
  return fn;
}

inline device_allocation allocation_of(const void* p) {
  const auto get = pointer_attributes();
  if (get == nullptr) return {};
  unsigned long long id = 0;
  CUdeviceptr base = 0;
  std::size_t bytes = 0;
  CUpointer_attribute which[] = {CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                 CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                 CU_POINTER_ATTRIBUTE_RANGE_SIZE};
  void* into[] = {&id, &base, &bytes};
  if (get(3, which, into, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) return {};
  return {reinterpret_cast<const void*>(base), bytes, static_cast<std::uint64_t>(id)};
}

inline bool remote_writes_ordered(int device) {
  int scope = 0;
  check_cuda(cudaDeviceGetAttribute(&scope, cudaDevAttrGPUDirectRDMAWritesOrdering, device),
             "cudaDeviceGetAttribute(GPUDirectRDMAWritesOrdering)");
  return scope >= cudaGPUDirectRDMAWritesOrderingOwner;
}

inline void flush_remote_writes() {
  check_cuda(cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                                cudaFlushGPUDirectRDMAWritesToOwner),
             "cudaDeviceFlushGPUDirectRDMAWrites");
}

}  // namespace detail

/// The runtime table this header registers.
inline constexpr device_runtime cuda_runtime{&detail::device_of,
                                             &detail::current_device,
                                             &detail::set_device,
                                             &detail::create_stream,
                                             &detail::destroy_stream,
                                             &detail::copy,
                                             &detail::record,
                                             &detail::done,
                                             &detail::destroy_event,
                                             &detail::drain,
                                             &detail::allocate,
                                             &detail::release,
                                             &detail::allocation_of,
                                             &detail::remote_writes_ordered,
                                             &detail::flush_remote_writes};

namespace detail {

// Registration at start-up, so that merely including this header in a .cu file is enough: the
// collectives are plain C++ and cannot name a kernel themselves.
inline const bool device_reductions_registered =
    (register_device_reduction(device_reductions), register_device_runtime(&cuda_runtime),
     register_device_reproducible(&device_reproducible_kernels), true);

}  // namespace detail

}  // namespace ringzero::kernels::cuda
