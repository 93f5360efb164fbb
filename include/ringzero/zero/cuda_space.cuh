// The sharder on GPU memory: cuda_device_space, the device space (device_space.hpp) of CUDA
// device memory, streams and events, whose work runs as ringzero's CUDA kernels
// (kernels/cuda/optimizer.cuh). With NCCL, memory_space_for(nccl::communicator&) returns it, so
//
//   auto comm = ringzero::nccl::communicator::from_env();
//   zero::sharder<ringzero::nccl::communicator, bfloat16> shd(comm, layout, cfg);
//
// keeps parameters, gradients, buckets and the fp32 optimizer state in device memory. Compile
// such a translation unit with nvcc (this header launches kernels); ringzero/zero/sharder.hpp
// includes it there by itself.
//
// Streams: the communication stream is the NCCL communicator's own (comm.transport().stream(),
// non-blocking), so a collective issued with default options is ordered with the sharder's work.
// The compute stream defaults to the default stream of the translation unit that builds the
// sharder (the legacy stream, or the thread's own under --default-stream per-thread), so a
// trainer that never names a stream is correct; set_compute_stream(s) names the trainer's. New
// memory is zeroed in compute-stream order, never with a plain cudaMemset.
//
// Waits: every host wait goes through the communicator (nccl::transport::wait_idle): a deadline,
// NCCL's asynchronous errors, and an abort when either fires. A dead peer makes step(),
// synchronize() and the sharder's destructor raise instead of hanging.
//
// Memory: parameters and gradients come from ncclMemAlloc and are registered with the
// communicator (ncclCommRegister) where NCCL has both (2.19 and later), so NCCL can take its
// zero-copy paths on them; other buffers from cudaMalloc, and gathered stage-3 buckets from the
// stream-ordered allocator on the compute stream, from a pool of the space's own that keeps
// freed memory (no driver call after the first step; the device's default pool, which NCCL and
// the rest of the process use, is left alone). Host values travel through a pinned staging
// buffer. The only host waits are the ones the sharder asks for: reading the gradient statistics
// once per step (one copy), copies to and from the host, and synchronize(). Events come from a
// pool and are reused. After a failure, drain() waits for both streams before memory is freed.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ringzero/detail/cuda_runtime.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"
#include "ringzero/kernels/cuda/detail/launch.cuh"
#include "ringzero/kernels/cuda/optimizer.cuh"
#include "ringzero/kernels/element.hpp"
#include "ringzero/log.hpp"
#include "ringzero/zero/device_space.hpp"
#include "ringzero/zero/memory_space.hpp"

#if __has_include(<nccl.h>)
#define RINGZERO_CUDA_SPACE_NCCL 1
#endif

namespace ringzero::zero {

/// Memory a communicator wants parameters and gradients in (NCCL: ncclMemAlloc, registered with
/// the communicator so its zero-copy paths apply). `free` must stay safe after the communicator
/// failed or went: it deregisters only through a handle that is still alive.
struct registered_allocator {
  std::function<void*(std::size_t bytes, void** handle)> allocate;
  std::function<void(void* p, void* handle)> free;
  explicit operator bool() const noexcept { return static_cast<bool>(allocate); }
};

namespace detail::cuda_space {

// Errors read "zero (CUDA device space): <call>: CUDA error: ...": which part of ringzero made the
// call that failed.
inline void check(cudaError_t e, const char* what) {
  ringzero::detail::check_cuda(e, std::string("zero (CUDA device space): ") + what);
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

/// The device's shared state: streams, the statistics accumulator, the pinned staging buffer,
/// the event pool, the counters, and what the communicator lent (its allocator and its waits).
struct state {
  int device = 0;
  cudaStream_t compute = nullptr;  // null: the default stream of the including translation unit
  cudaStream_t comm = nullptr;
  registered_allocator allocator;               // empty: cudaMalloc
  std::function<void(cudaStream_t)> wait_idle;  // empty: poll with RINGZERO_TIMEOUT
  std::unique_ptr<kernels::cuda::grad_stats_accumulator> stats;
  std::mutex staging_mutex;
  void* staging = nullptr;
  std::size_t staging_bytes = 0;
  std::mutex events_mutex;
  std::vector<cudaEvent_t> free_events;  // recorded before, complete or not: reusable
  std::atomic<std::uint64_t> launches{0}, statistics{0}, host_syncs{0}, events_created{0},
      driver_allocations{0};
  cudaMemPool_t pool = nullptr;  // the stream-ordered allocations' (make_pool)

  ~state() {
    if (staging != nullptr) static_cast<void>(cudaFreeHost(staging));
    for (cudaEvent_t e : free_events) static_cast<void>(cudaEventDestroy(e));
    // Frees still queued on a stream complete first: CUDA releases the pool after them.
    if (pool != nullptr) static_cast<void>(cudaMemPoolDestroy(pool));
  }
};

/// The sharder may run on a thread whose current device is another.
using device_guard = ringzero::detail::cuda_device_guard;

/// The space's own stream-ordered pool on `device`, which keeps what is freed instead of giving
/// it back to the driver at every synchronization (a pool's default release threshold is 0): a
/// stage-3 step gathers and frees every bucket, and would otherwise map them afresh each time.
/// Its own, not the device's default pool: raising that one's threshold kept every
/// cudaMallocAsync of the process (NCCL's schedule scratch, the trainer's) mapped for good, out
/// of reach of the buffers NCCL sets up lazily at its first collectives.
[[nodiscard]] inline cudaMemPool_t make_pool(int device) {
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  check(cudaMemPoolCreate(&pool, &props), "cudaMemPoolCreate");
  std::uint64_t keep = UINT64_MAX;
  if (const cudaError_t e = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
      e != cudaSuccess) {
    static_cast<void>(cudaMemPoolDestroy(pool));
    check(e, "cudaMemPoolSetAttribute(release threshold)");
  }
  return pool;
}

/// Bytes `pool` holds from the driver.
[[nodiscard]] inline std::uint64_t pool_reserved(cudaMemPool_t pool) {
  std::uint64_t bytes = 0;
  check(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &bytes),
        "cudaMemPoolGetAttribute(reserved)");
  return bytes;
}

/// `bytes` from `pool` in `s`'s order; when the device is out of memory, once more after
/// handing back what the pool holds unused (fragments no allocation of this size fits).
[[nodiscard]] inline void* allocate_from(cudaMemPool_t pool, std::size_t bytes, cudaStream_t s) {
  void* p = nullptr;
  cudaError_t e = cudaMallocFromPoolAsync(&p, bytes, pool, s);
  if (e == cudaErrorMemoryAllocation) {
    static_cast<void>(cudaGetLastError());
    check(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
    e = cudaMallocFromPoolAsync(&p, bytes, pool, s);
  }
  check(e, "cudaMallocFromPoolAsync");
  return p;
}

/// Waits until `s` is idle, within RINGZERO_TIMEOUT (detail::wait_stream): spaces lent by a
/// communicator wait through it instead (its abort path).
inline void poll_idle(cudaStream_t s, const char* what) {
  ringzero::detail::wait_stream(s, ringzero::detail::env_timeout(),
                                std::string("zero (CUDA device space): ") + what);
}

}  // namespace detail::cuda_space

/// CUDA device memory with a compute and a communication stream: see the header comment.
class cuda_device_space {
 public:
  static constexpr bool host_accessible = false;
  using stream = cudaStream_t;
  /// A recorded point of a stream; shared, and returned to the space's pool once the last copy
  /// goes (a later record reuses it: a wait already enqueued keeps the point it was given).
  using event = std::shared_ptr<CUevent_st>;

  /// Device `device`; `comm_stream` is the communicator's stream (never null for NCCL).
  /// `allocator`: where parameters and gradients come from (empty: cudaMalloc); `wait_idle`:
  /// how a host wait on a stream is made, with its deadline (empty: poll for RINGZERO_TIMEOUT).
  cuda_device_space(int device, cudaStream_t comm_stream, cudaStream_t compute_stream = nullptr,
                    registered_allocator allocator = {},
                    std::function<void(cudaStream_t)> wait_idle = {})
      : state_(std::make_shared<detail::cuda_space::state>()) {
    state_->device = device;
    state_->comm = comm_stream;
    state_->compute = compute_stream;
    state_->allocator = std::move(allocator);
    state_->wait_idle = std::move(wait_idle);
    const detail::cuda_space::device_guard guard(device);
    state_->pool = detail::cuda_space::make_pool(device);
    state_->stats = std::make_unique<kernels::cuda::grad_stats_accumulator>(comm_stream);
  }

  [[nodiscard]] static constexpr bool collective() noexcept { return false; }
  [[nodiscard]] int device() const noexcept { return state_->device; }
  [[nodiscard]] stream compute_stream() const noexcept { return state_->compute; }
  [[nodiscard]] stream comm_stream() const noexcept { return state_->comm; }
  /// The trainer's stream: forward and backward read parameters and write gradients there. Set
  /// it before the first gather or add_grad of a step; every copy of this space sees it. The new
  /// stream waits for what the old one and the communication stream have queued (zeroed and
  /// initial parameters), so the switch needs no synchronization from the trainer.
  void set_compute_stream(cudaStream_t s) const {
    if (s == state_->compute) return;
    wait(s, record(state_->compute));
    wait(s, record(state_->comm));
    state_->compute = s;
  }

  /// Zeroed device memory for the parameters and gradients (the communicator's registered
  /// memory where it lent an allocator).
  template <class T>
  [[nodiscard]] buffer<T> allocate(std::size_t n) const {
    if (!state_->allocator) return allocate_local<T>(n);
    const detail::cuda_space::device_guard guard(state_->device);
    const std::size_t bytes = std::max<std::size_t>(n * sizeof(T), 1);
    ++state_->driver_allocations;
    void* handle = nullptr;
    void* p = state_->allocator.allocate(bytes, &handle);
    std::shared_ptr<void> owner(p, [st = state_, handle](void* q) noexcept {
      const detail::cuda_space::device_guard g(st->device);
      st->allocator.free(q, handle);
    });
    zero_new(p, bytes);
    return {std::span<T>(static_cast<T*>(p), n), std::move(owner), false};
  }

  /// Zeroed device memory from cudaMalloc.
  template <class T>
  [[nodiscard]] buffer<T> allocate_local(std::size_t n) const {
    const detail::cuda_space::device_guard guard(state_->device);
    const std::size_t bytes = std::max<std::size_t>(n * sizeof(T), 1);
    void* p = nullptr;
    ++state_->driver_allocations;
    detail::cuda_space::check(cudaMalloc(&p, bytes), "cudaMalloc");
    std::shared_ptr<void> owner(p, [device = state_->device](void* q) noexcept {
      const detail::cuda_space::device_guard g(device);
      static_cast<void>(cudaFree(q));
    });
    zero_new(p, bytes);
    return {std::span<T>(static_cast<T*>(p), n), std::move(owner), false};
  }

  /// Device memory allocated and freed in compute-stream order (cudaMallocFromPoolAsync /
  /// cudaFreeAsync): the free follows every kernel enqueued there before the last handle went.
  /// The space's pool keeps freed memory (make_pool), so after the first step this asks nothing
  /// of the driver; a call that grew the pool counts as a driver allocation.
  template <class T>
  [[nodiscard]] buffer<T> allocate_ordered(std::size_t n, fill how = fill::zeroed) const {
    const detail::cuda_space::device_guard guard(state_->device);
    const std::size_t bytes = std::max<std::size_t>(n * sizeof(T), 1);
    const std::uint64_t before = detail::cuda_space::pool_reserved(state_->pool);
    void* p = detail::cuda_space::allocate_from(state_->pool, bytes, state_->compute);
    if (detail::cuda_space::pool_reserved(state_->pool) > before) ++state_->driver_allocations;
    if (how == fill::zeroed) {
      ++state_->launches;
      detail::cuda_space::check(cudaMemsetAsync(p, 0, bytes, state_->compute), "cudaMemsetAsync");
    }
    std::shared_ptr<void> owner(p, [st = state_](void* q) noexcept {
      const detail::cuda_space::device_guard g(st->device);
      static_cast<void>(cudaFreeAsync(q, st->compute));
    });
    return {std::span<T>(static_cast<T*>(p), n), std::move(owner), false};
  }

  /// Records `s`'s current point in an event from the pool (created only when none is free).
  [[nodiscard]] event record(stream s) const {
    const detail::cuda_space::device_guard guard(state_->device);
    cudaEvent_t e = nullptr;
    {
      const std::lock_guard lock(state_->events_mutex);
      if (!state_->free_events.empty()) {
        e = state_->free_events.back();
        state_->free_events.pop_back();
      }
    }
    if (e == nullptr) {
      ++state_->events_created;
      detail::cuda_space::check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                                "cudaEventCreateWithFlags");
    }
    event owned(e, [st = state_](cudaEvent_t q) noexcept {
      try {
        const std::lock_guard lock(st->events_mutex);
        st->free_events.push_back(q);
      } catch (...) {
        static_cast<void>(cudaEventDestroy(q));
      }
    });
    detail::cuda_space::check(cudaEventRecord(e, s), "cudaEventRecord");
    return owned;
  }
  void wait(stream s, const event& e) const {
    if (!e) return;
    const detail::cuda_space::device_guard guard(state_->device);
    detail::cuda_space::check(cudaStreamWaitEvent(s, e.get(), 0), "cudaStreamWaitEvent");
  }
  /// Waits on the host until `s` is idle, with the deadline and abort path of the communicator
  /// that lent this space (or RINGZERO_TIMEOUT): never a bare cudaStreamSynchronize.
  void synchronize(stream s) const {
    ++state_->host_syncs;
    idle(s, "synchronize");
  }
  /// Both streams.
  void synchronize() const {
    ++state_->host_syncs;
    idle(state_->compute, "synchronize");
    idle(state_->comm, "synchronize");
  }
  /// Both streams, polled directly rather than through the communicator (which refuses every
  /// wait once aborted), errors ignored, each within RINGZERO_TIMEOUT: after an abort NCCL's
  /// kernels have stopped, so the streams drain, and what was queued behind them has run before
  /// the memory it uses is freed.
  void drain() const noexcept {
    const auto limit = ringzero::detail::env_timeout();
    int previous = state_->device;
    static_cast<void>(cudaGetDevice(&previous));
    static_cast<void>(cudaSetDevice(state_->device));
    for (cudaStream_t s : {state_->compute, state_->comm})
      if (!ringzero::detail::drain_stream(s, limit))
        log::warn("zero (CUDA device space): a stream of device {} did not drain in {:g} s",
                  state_->device, std::chrono::duration<double>(limit).count());
    static_cast<void>(cudaSetDevice(previous));
  }

  template <class T>
  void zero(stream s, T* p, std::size_t n) const {
    if (n == 0) return;
    const detail::cuda_space::device_guard guard(state_->device);
    ++state_->launches;
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
      idle(s, "upload");
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
      idle(s, "download");
      std::memcpy(reinterpret_cast<std::byte*>(host) + at, pinned, len);
    });
  }

  template <class D, class S>
  void accumulate(stream s, D* dst, const S* src, std::size_t n, bool first, float scale) const {
    if (n == 0) return;
    const detail::cuda_space::device_guard guard(state_->device);
    ++state_->launches;
    kernels::cuda::accumulate<D, S>(dst, src, n, first, s, scale);
  }

  /// Host fp32 values into parameters (and master weights): staged into a stream-ordered
  /// temporary, then one kernel; returns once `values` may be reused.
  template <class P>
  void set_values(stream s, P* param, float* master, const float* values, std::size_t n) const {
    if (n == 0) return;
    const detail::cuda_space::device_guard guard(state_->device);
    void* tmp = detail::cuda_space::allocate_from(state_->pool, n * sizeof(float), s);
    upload(s, static_cast<float*>(tmp), values, n);
    ++state_->launches;
    detail::cuda_space::set_values_kernel<P>
        <<<kernels::cuda::detail::grid_for(n), kernels::cuda::detail::block_threads, 0, s>>>(
            param, master, static_cast<const float*>(tmp), n);
    kernels::cuda::detail::check_launch("zero: set_values");
    detail::cuda_space::check(cudaFreeAsync(tmp, s), "cudaFreeAsync");
  }

  void stats_reset(stream s) const {
    const detail::cuda_space::device_guard guard(state_->device);
    ++state_->launches;
    state_->stats->reset(s);
  }
  /// Every run's statistics in one launch (per 400 runs).
  template <class G>
  void stats_add(stream s, std::span<const device_run<G>> runs, float scale) const {
    if (runs.empty()) return;
    const detail::cuda_space::device_guard guard(state_->device);
    static_assert(sizeof(device_run<G>) == sizeof(kernels::cuda::stats_segment<G>));
    std::vector<kernels::cuda::stats_segment<G>> list;
    list.reserve(runs.size());
    for (const auto& r : runs) list.push_back({r.data, r.count});
    ++state_->launches;
    ++state_->statistics;
    state_->stats->add<G>(list, scale, s);
  }
  [[nodiscard]] device_stats stats() const noexcept {
    kernels::cuda::grad_stats* r = state_->stats->result();
    return {&r->sumsq, &r->nonfinite};
  }
  /// Both statistics in one copy and one host wait.
  [[nodiscard]] gradient_stats read_stats(stream s) const {
    kernels::cuda::grad_stats r;
    download(s, &r, state_->stats->result(), 1);
    return {r.sumsq, r.nonfinite != 0};
  }

  /// One optimizer step of the rule of `kind` in Table, enqueued on `s`.
  template <class Table = builtin_optimizers, class P, class G>
  void optimizer_step(stream s, optimizer_kind kind, std::span<const device_segment<P, G>> segs,
                      const step_constants& k) const {
    if (segs.empty()) return;
    const detail::cuda_space::device_guard guard(state_->device);
    Table::visit(kind, [&]<class R>(std::type_identity<R>) {
      ++state_->launches;
      kernels::cuda::optimizer_step<R, P, G>(segs, k, s);
    });
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

  /// What this device was asked to do so far (device_space.hpp's device_counters).
  [[nodiscard]] device_counters counters() const noexcept {
    return {state_->launches.load(), state_->statistics.load(), state_->host_syncs.load(),
            state_->events_created.load(), state_->driver_allocations.load()};
  }
  /// Bytes the space's stream-ordered pool holds from the driver (constant once warm).
  [[nodiscard]] std::uint64_t pool_reserved_bytes() const {
    return detail::cuda_space::pool_reserved(state_->pool);
  }
  /// Hands back to the driver what the space's pool holds and no allocation uses (between steps,
  /// for memory wanted elsewhere); the next step maps what it needs again.
  void trim_pool() const {
    const detail::cuda_space::device_guard guard(state_->device);
    detail::cuda_space::check(cudaMemPoolTrimTo(state_->pool, 0), "cudaMemPoolTrimTo");
  }

 private:
  void idle(stream s, const char* what) const {
    const detail::cuda_space::device_guard guard(state_->device);
    if (state_->wait_idle)
      state_->wait_idle(s);
    else
      detail::cuda_space::poll_idle(s, what);
  }

  /// New memory zeroed in compute-stream order, and the communication stream behind it: a
  /// plain cudaMemset is ordered only with the legacy default stream, which non-blocking
  /// streams and per-thread default streams do not wait for.
  void zero_new(void* p, std::size_t bytes) const {
    ++state_->launches;
    detail::cuda_space::check(cudaMemsetAsync(p, 0, bytes, state_->compute), "cudaMemsetAsync");
    if (state_->comm != state_->compute) wait(state_->comm, record(state_->compute));
  }

  /// Runs copy(offset, length, pinned) over `bytes` in pieces of the staging buffer's size,
  /// one copy at a time (the buffer is shared by every copy of this space). One host wait.
  template <class Copy>
  void staged(stream, std::size_t bytes, Copy&& copy) const {
    if (bytes == 0) return;
    ++state_->host_syncs;
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
#include "ringzero/transport/nccl/transport.hpp"

namespace ringzero::nccl {

/// The sharder's memory on an NCCL communicator: device memory of its GPU, the communicator's
/// stream as the communication stream, every host wait through the communicator's (its deadline,
/// and its abort when the deadline passes or NCCL fails), parameters and gradients from
/// ncclMemAlloc and registered with NCCL (the world communicator only: a split one shares its
/// transport's handle, and registration is per handle). The communicator must outlive the
/// sharder; the memory may outlive the communicator's handle (a failure aborts it), and then
/// frees without deregistering.
[[nodiscard]] inline zero::cuda_device_space memory_space_for(
    ringzero::communicator<transport>& comm) {
  transport& t = comm.transport();
  zero::registered_allocator memory;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 19, 0)
  if (comm.comm_id() == 0) {
    memory.allocate = [live = t.live()](std::size_t bytes, void** handle) -> void* {
      void* p = nullptr;
      if (ncclMemAlloc(&p, bytes) != ncclSuccess)
        throw transport_error("zero (CUDA device space): ncclMemAlloc of " + std::to_string(bytes) +
                              " bytes failed");
      *handle = nullptr;
      const std::lock_guard lock(live->mutex);
      if (live->comm != nullptr && ncclCommRegister(live->comm, p, bytes, handle) != ncclSuccess)
        *handle = nullptr;
      return p;
    };
    memory.free = [live = t.live()](void* p, void* handle) noexcept {
      {
        const std::lock_guard lock(live->mutex);
        if (handle != nullptr && live->comm != nullptr)
          static_cast<void>(ncclCommDeregister(live->comm, handle));
      }
      static_cast<void>(ncclMemFree(p));
    };
  }
#endif
  return zero::cuda_device_space(t.device(), t.stream(), nullptr, std::move(memory),
                                 [&t](cudaStream_t s) { t.wait_idle(s); });
}

}  // namespace ringzero::nccl
#endif
