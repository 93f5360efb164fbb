// The sharder on GPU memory: cuda_device_space, the device space (device_space.hpp) of CUDA
// device memory, streams and events, whose work runs as ringzero's CUDA kernels
// (kernels/cuda/optimizer.cuh). With NCCL, memory_space_for(nccl::communicator&) returns it, so
//
//   auto comm = ringzero::nccl::communicator::from_env();
//   zero::sharder<ringzero::nccl::communicator, bfloat16> shd(comm, layout, cfg);
//
// keeps parameters, gradients, buckets and the fp32 optimizer state in device memory. Compile
// such a translation unit with nvcc (this header launches kernels); ringzero/transport/nccl.hpp
// includes it there by itself.
//
// Streams: the communication stream is the NCCL communicator's own (comm.transport().stream()),
// so a collective issued with default options is ordered with the sharder's work. The compute
// stream defaults to the legacy default stream (a trainer that never names a stream is correct,
// though then nothing overlaps); set_compute_stream(s) names the trainer's.
//
// Memory: parameters and gradients come from ncclMemAlloc and are registered with the
// communicator (ncclCommRegister) where NCCL has both (2.19 and later), so NCCL can take its
// zero-copy paths on them; other buffers from cudaMalloc, and gathered stage-3 buckets from the
// stream-ordered allocator on the compute stream. Host values travel through a pinned staging
// buffer. The only host waits are the ones the sharder asks for: reading the two gradient
// statistics once per step, copies to and from the host, and synchronize().
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/kernels/cuda/detail/launch.cuh"
#include "ringzero/kernels/cuda/optimizer.cuh"
#include "ringzero/kernels/element.hpp"
#include "ringzero/zero/device_space.hpp"
#include "ringzero/zero/memory_space.hpp"

#if __has_include(<nccl.h>)
#include <nccl.h>
#define RINGZERO_CUDA_SPACE_NCCL 1
#endif

namespace ringzero::zero {

namespace detail::cuda_space {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw transport_error(std::string("zero (CUDA device space): ") + what + ": " +
                          cudaGetErrorString(e));
}

/// param[i] = values[i] rounded to P and, where master is not null, master[i] = values[i].
template <class P>
__global__ void set_values_kernel(P* param, float* master, const float* values, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float v = values[i];
    if (master != nullptr) master[i] = v;
    param[i] = kernels::from_float<P>(v);
  }
}

/// The device's shared state: streams, the statistics accumulator, the pinned staging buffer.
struct state {
  int device = 0;
  cudaStream_t compute = nullptr;  // null: the legacy default stream
  cudaStream_t comm = nullptr;
#ifdef RINGZERO_CUDA_SPACE_NCCL
  ncclComm_t nccl = nullptr;  // registers parameter and gradient memory; null: no registration
#endif
  std::unique_ptr<kernels::cuda::grad_stats_accumulator> stats;
  std::mutex staging_mutex;
  void* staging = nullptr;
  std::size_t staging_bytes = 0;

  ~state() {
    if (staging != nullptr) static_cast<void>(cudaFreeHost(staging));
  }
};

/// Makes `device` current for the scope (the sharder may run on a thread whose current device
/// is another).
class device_guard {
 public:
  explicit device_guard(int device) {
    static_cast<void>(cudaGetDevice(&previous_));
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~device_guard() { static_cast<void>(cudaSetDevice(previous_)); }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace detail::cuda_space

/// CUDA device memory with a compute and a communication stream: see the header comment.
class cuda_device_space {
 public:
  static constexpr bool host_accessible = false;
  using stream = cudaStream_t;
  /// A recorded point of a stream; shared, destroyed once the last copy goes (CUDA releases a
  /// recorded event's resources only once it completed).
  using event = std::shared_ptr<CUevent_st>;

  /// Device `device`; `comm_stream` is the communicator's stream (never null for NCCL).
  cuda_device_space(int device, cudaStream_t comm_stream, cudaStream_t compute_stream = nullptr)
      : state_(std::make_shared<detail::cuda_space::state>()) {
    state_->device = device;
    state_->comm = comm_stream;
    state_->compute = compute_stream;
    const detail::cuda_space::device_guard guard(device);
    state_->stats = std::make_unique<kernels::cuda::grad_stats_accumulator>();
  }

#ifdef RINGZERO_CUDA_SPACE_NCCL
  /// Registers the parameters and gradients with `comm` (ncclCommRegister), which must outlive
  /// every buffer allocated here.
  void register_with(ncclComm_t comm) noexcept {
    state_->nccl = comm;
  }
#endif

  [[nodiscard]] static constexpr bool collective() noexcept {
    return false;
  }
  [[nodiscard]] int device() const noexcept {
    return state_->device;
  }
  [[nodiscard]] stream compute_stream() const noexcept {
    return state_->compute;
  }
  [[nodiscard]] stream comm_stream() const noexcept {
    return state_->comm;
  }
  /// The trainer's stream: forward and backward read parameters and write gradients there. Set
  /// it before the first gather or add_grad of a step; every copy of this space sees it.
  void set_compute_stream(cudaStream_t s) const noexcept {
    state_->compute = s;
  }

  /// Zeroed device memory for the parameters and gradients (NCCL-registered where it can be).
  template <class T>
  [[nodiscard]] buffer<T> allocate(std::size_t n) const {
    const detail::cuda_space::device_guard guard(state_->device);
    const std::size_t bytes = std::max<std::size_t>(n * sizeof(T), 1);
    void* p = nullptr;
#if defined(RINGZERO_CUDA_SPACE_NCCL) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 19, 0)
    if (state_->nccl != nullptr) {
      if (ncclMemAlloc(&p, bytes) != ncclSuccess)
        throw transport_error("zero (CUDA device space): ncclMemAlloc of " + std::to_string(bytes) +
                              " bytes failed");
      void* handle = nullptr;
      if (ncclCommRegister(state_->nccl, p, bytes, &handle) != ncclSuccess) handle = nullptr;
      detail::cuda_space::check(cudaMemset(p, 0, bytes), "cudaMemset");
      std::shared_ptr<void> owner(p, [st = state_, handle](void* q) noexcept {
        const detail::cuda_space::device_guard g(st->device);
        if (handle != nullptr) static_cast<void>(ncclCommDeregister(st->nccl, handle));
        static_cast<void>(ncclMemFree(q));
      });
      return {std::span<T>(static_cast<T*>(p), n), std::move(owner), false};
    }
#endif
    return allocate_local<T>(n);
  }

  /// Zeroed device memory from cudaMalloc.
  template <class T>
  [[nodiscard]] buffer<T> allocate_local(std::size_t n) const {
    const detail::cuda_space::device_guard guard(state_->device);
    const std::size_t bytes = std::max<std::size_t>(n * sizeof(T), 1);
    void* p = nullptr;
    detail::cuda_space::check(cudaMalloc(&p, bytes), "cudaMalloc");
    detail::cuda_space::check(cudaMemset(p, 0, bytes), "cudaMemset");
    std::shared_ptr<void> owner(p, [device = state_->device](void* q) noexcept {
      const detail::cuda_space::device_guard g(device);
      static_cast<void>(cudaFree(q));
    });
    return {std::span<T>(static_cast<T*>(p), n), std::move(owner), false};
  }

  /// Zeroed device memory allocated and freed in compute-stream order (cudaMallocAsync /
  /// cudaFreeAsync): the free follows every kernel enqueued there before the last handle went.
  template <class T>
  [[nodiscard]] buffer<T> allocate_ordered(std::size_t n) const {
    const detail::cuda_space::device_guard guard(state_->device);
    const std::size_t bytes = std::max<std::size_t>(n * sizeof(T), 1);
    void* p = nullptr;
    detail::cuda_space::check(cudaMallocAsync(&p, bytes, state_->compute), "cudaMallocAsync");
    detail::cuda_space::check(cudaMemsetAsync(p, 0, bytes, state_->compute), "cudaMemsetAsync");
    std::shared_ptr<void> owner(p, [st = state_](void* q) noexcept {
      const detail::cuda_space::device_guard g(st->device);
      static_cast<void>(cudaFreeAsync(q, st->compute));
    });
    return {std::span<T>(static_cast<T*>(p), n), std::move(owner), false};
  }

  [[nodiscard]] event record(stream s) const {
    const detail::cuda_space::device_guard guard(state_->device);
    cudaEvent_t e = nullptr;
    detail::cuda_space::check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                              "cudaEventCreateWithFlags");
    event owned(e, [](cudaEvent_t q) noexcept { static_cast<void>(cudaEventDestroy(q)); });
    detail::cuda_space::check(cudaEventRecord(e, s), "cudaEventRecord");
    return owned;
  }
  void wait(stream s, const event& e) const {
    if (!e) return;
    const detail::cuda_space::device_guard guard(state_->device);
    detail::cuda_space::check(cudaStreamWaitEvent(s, e.get(), 0), "cudaStreamWaitEvent");
  }
  void synchronize(stream s) const {
    const detail::cuda_space::device_guard guard(state_->device);
    detail::cuda_space::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  }
  void synchronize() const {
    synchronize(state_->compute);
    synchronize(state_->comm);
  }

  template <class T>
  void zero(stream s, T* p, std::size_t n) const {
    if (n == 0) return;
    const detail::cuda_space::device_guard guard(state_->device);
    // All bits zero is 0 for every element type the sharder keeps.
    detail::cuda_space::check(cudaMemsetAsync(p, 0, n * sizeof(T), s), "cudaMemsetAsync");
  }

  /// Host to device through the pinned staging buffer; returns once `host` may be reused.
  template <class T>
  void upload(stream s, T* dst, const T* host, std::size_t n) const {
    staged(s, n * sizeof(T), [&](std::size_t at, std::size_t len, void* pinned) {
      std::memcpy(pinned, reinterpret_cast<const std::byte*>(host) + at, len);
      detail::cuda_space::check(cudaMemcpyAsync(reinterpret_cast<std::byte*>(dst) + at, pinned, len,
                                                cudaMemcpyHostToDevice, s),
                                "cudaMemcpyAsync (host to device)");
      detail::cuda_space::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    });
  }
  /// Device to host through the pinned staging buffer, in `s`'s order; returns once it is there.
  template <class T>
  void download(stream s, T* host, const T* src, std::size_t n) const {
    staged(s, n * sizeof(T), [&](std::size_t at, std::size_t len, void* pinned) {
      detail::cuda_space::check(
          cudaMemcpyAsync(pinned, reinterpret_cast<const std::byte*>(src) + at, len,
                          cudaMemcpyDeviceToHost, s),
          "cudaMemcpyAsync (device to host)");
      detail::cuda_space::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
      std::memcpy(reinterpret_cast<std::byte*>(host) + at, pinned, len);
    });
  }

  template <class D, class S>
  void accumulate(stream s, D* dst, const S* src, std::size_t n, bool first, float scale) const {
    const detail::cuda_space::device_guard guard(state_->device);
    kernels::cuda::accumulate<D, S>(dst, src, n, first, s, scale);
  }

  /// Host fp32 values into parameters (and master weights): staged into a stream-ordered
  /// temporary, then one kernel; returns once `values` may be reused.
  template <class P>
  void set_values(stream s, P* param, float* master, const float* values, std::size_t n) const {
    if (n == 0) return;
    const detail::cuda_space::device_guard guard(state_->device);
    void* tmp = nullptr;
    detail::cuda_space::check(cudaMallocAsync(&tmp, n * sizeof(float), s), "cudaMallocAsync");
    upload(s, static_cast<float*>(tmp), values, n);
    detail::cuda_space::set_values_kernel<P>
        <<<kernels::cuda::detail::grid_for(n), kernels::cuda::detail::block_threads, 0, s>>>(
            param, master, static_cast<const float*>(tmp), n);
    kernels::cuda::detail::check_launch("zero: set_values");
    detail::cuda_space::check(cudaFreeAsync(tmp, s), "cudaFreeAsync");
  }

  void stats_reset(stream s) const {
    const detail::cuda_space::device_guard guard(state_->device);
    state_->stats->reset(s);
  }
  template <class G>
  void stats_add(stream s, const G* g, std::size_t n, float scale) const {
    const detail::cuda_space::device_guard guard(state_->device);
    state_->stats->add(g, n, scale, s);
  }
  [[nodiscard]] device_stats stats() const noexcept {
    kernels::cuda::grad_stats* r = state_->stats->result();
    return {&r->sumsq, &r->nonfinite};
  }

  template <class P, class G>
  void optimizer_step(stream s, optimizer_kind kind, std::span<const device_segment<P, G>> segs,
                      const step_constants& k) const {
    if (segs.empty()) return;
    const detail::cuda_space::device_guard guard(state_->device);
    std::vector<kernels::cuda::optimizer_segment<P, G>> list;
    list.reserve(segs.size());
    for (const auto& g : segs)
      list.push_back({g.grad, g.master, g.moment1, g.moment2, g.param, g.count, g.decay});
    kernels::optimizer_constants c;
    c.grad_scale = k.grad_scale;
    c.lr = k.lr;
    c.beta1 = k.beta1;
    c.beta2 = k.beta2;
    c.eps = k.eps;
    c.step_size = k.step_size;
    c.inv_bias2 = k.inv_bias2;
    c.momentum = k.momentum;
    c.nesterov = k.nesterov;
    c.weight_decay = k.weight_decay;
    const std::span<const kernels::cuda::optimizer_segment<P, G>> view(list);
    if (kind == optimizer_kind::adamw)
      kernels::cuda::adamw_step<P, G>(view, c, s);
    else
      kernels::cuda::sgd_step<P, G>(view, c, s);
  }

  /// Calls f(on) now: f issues its collectives with on(options), which enqueues them on `s`
  /// and returns (options::async) instead of waiting.
  template <class F>
  void enqueue(stream s, F&& f) const {
    std::forward<F>(f)([s](ringzero::options o) {
      o.stream = s;
      o.async = true;
      return o;
    });
  }
  /// Runs f() now: its collectives, with their own options, run on the communicator's stream
  /// (the communication stream) and wait there.
  template <class F>
  decltype(auto) run_sync(stream, F&& f) const {
    return std::forward<F>(f)();
  }

 private:
  /// Runs copy(offset, length, pinned) over `bytes` in pieces of the staging buffer's size,
  /// one copy at a time (the buffer is shared by every copy of this space).
  template <class Copy>
  void staged(stream, std::size_t bytes, Copy&& copy) const {
    if (bytes == 0) return;
    constexpr std::size_t piece = std::size_t{64} << 20;
    const detail::cuda_space::device_guard guard(state_->device);
    const std::lock_guard lock(state_->staging_mutex);
    const std::size_t want = std::min(bytes, piece);
    if (state_->staging_bytes < want) {
      if (state_->staging != nullptr) static_cast<void>(cudaFreeHost(state_->staging));
      state_->staging = nullptr;
      state_->staging_bytes = 0;
      detail::cuda_space::check(cudaMallocHost(&state_->staging, want), "cudaMallocHost");
      state_->staging_bytes = want;
    }
    for (std::size_t at = 0; at < bytes; at += piece)
      copy(at, std::min(piece, bytes - at), state_->staging);
  }

  std::shared_ptr<detail::cuda_space::state> state_;
};

}  // namespace ringzero::zero

#ifdef RINGZERO_CUDA_SPACE_NCCL
#include "ringzero/communicator.hpp"
#include "ringzero/transport/nccl/communicator.hpp"

namespace ringzero::nccl {

/// The sharder's memory on an NCCL communicator: device memory of its GPU, the communicator's
/// stream as the communication stream, parameters and gradients registered with NCCL (the world
/// communicator only: a split one shares its transport's handle, and registration is per
/// handle).
[[nodiscard]] inline zero::cuda_device_space memory_space_for(
    ringzero::communicator<transport>& comm) {
  zero::cuda_device_space space(comm.transport().device(), comm.transport().stream());
  if (comm.comm_id() == 0) space.register_with(comm.transport().native_handle());
  return space;
}

}  // namespace ringzero::nccl
#endif
