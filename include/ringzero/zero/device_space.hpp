// Device memory spaces: memory the sharder's host thread never dereferences, and the streams and
// events that order the work on it. A device space is a memory space (memory_space.hpp) with
// host_accessible = false and the operations below; the sharder then keeps every parameter,
// gradient, gathered bucket and optimizer array in it and touches them only through these
// operations, each enqueued on a stream:
//
//   compute_stream()  the trainer's stream: its forward and backward read the parameters and
//                     write gradients there; the sharder accumulates handed-over gradients on it
//   comm_stream()     the sharder's: collectives, the reduced gradients' accumulation, the
//                     gradient statistics and the optimizer step
//   record(s) / wait(s, e)   hand-offs between the two (cudaEventRecord / cudaStreamWaitEvent)
//   synchronize(s)    waits on the host for everything enqueued on s; raises its failure
//   drain()           waits for both streams whatever failed, within RINGZERO_TIMEOUT: what a
//                     teardown does before freeing memory that queued work may still use
//
// Two spaces implement it: cuda_device_space (zero/cuda_space.cuh: device memory, CUDA streams
// and events, the kernels of kernels/cuda/) and emulated_device_space below, where memory is host
// memory and each stream is a thread that runs its work in order. The emulated space is what
// lets every CI run (no GPU) check the sharder's stream and event logic: a hand-off the sharder
// forgets shows up as a wrong result or, under ThreadSanitizer, as a data race between the two
// stream threads or between a stream and the trainer thread. Its element work is the host
// sharder's own (optimizer_math.hpp), so its results are bitwise those of host memory.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/kernels/optimizer.hpp"
#include "ringzero/zero/detail/worker.hpp"
#include "ringzero/zero/device_optimizer.hpp"
#include "ringzero/zero/memory_space.hpp"
#include "ringzero/zero/optimizer.hpp"
#include "ringzero/zero/optimizer_math.hpp"
#include "ringzero/zero/options.hpp"

namespace ringzero::zero {

/// One run of the optimizer over device memory: `count` elements of one parameter segment. `grad`
/// in the reduce type G; `master` is `param` when P is float; `moment2` is null for SGD. The
/// kernels' own type, so a list of them goes to the CUDA kernels as it is.
template <class P, class G>
using device_segment = kernels::optimizer_segment<P, G>;

/// A rank's share of a step's gradient checks, or, once agreed, every rank's.
struct gradient_stats {
  double sumsq = 0.0;      ///< sum of squares of the unscaled gradients
  bool nonfinite = false;  ///< some gradient is inf or NaN
};

/// One run of device gradients whose statistics are taken: `count` elements at `data`.
template <class G>
struct device_run {
  const G* data = nullptr;
  std::size_t count = 0;
};

/// What a device space was asked to do, for tests and the GPU check to hold a step to its
/// budget: a step should cost a fixed number of launches, one host synchronization (the
/// overflow and norm verdict), no new events and no memory from the driver once warm.
struct device_counters {
  std::uint64_t launches = 0;             ///< element work enqueued (kernels, memsets)
  std::uint64_t statistics_launches = 0;  ///< of which gradient statistics (one per step)
  /// The space's own host waits: synchronize, copies to or from the host, the statistics. A
  /// blocking collective a trainer runs through run_collective waits in the communicator.
  std::uint64_t host_syncs = 0;
  std::uint64_t events_created = 0;      ///< events made (recorded ones are reused)
  std::uint64_t driver_allocations = 0;  ///< allocations the pool could not serve from its cache
};

/// How allocate_ordered leaves new memory: zeroed, or as it is where the first use overwrites
/// all of it (a gathered bucket), which saves a pass over it.
enum class fill { zeroed, uninitialized };

/// The gradient statistics as the device holds them: every rank's share is all_reduced where it
/// lies (max over `nonfinite`, sum over `sumsq`) before the host reads the result.
struct device_stats {
  double* sumsq = nullptr;
  std::int32_t* nonfinite = nullptr;
};

template <class S>
concept device_space =
    memory_space<S> && !host_accessible<S> &&
    requires(const S& s, typename S::stream st, typename S::event ev, float* f, const float* cf,
             bfloat16* b, std::size_t n, std::span<const device_segment<bfloat16, float>> segs,
             const step_constants& k) {
  { s.compute_stream() } -> std::same_as<typename S::stream>;
  { s.comm_stream() } -> std::same_as<typename S::stream>;
  { s.record(st) } -> std::same_as<typename S::event>;
  s.wait(st, ev);
  s.synchronize(st);
  s.synchronize();
  { s.drain() }
  noexcept;
  s.zero(st, f, n);
  s.upload(st, f, cf, n);
  s.download(st, f, cf, n);
  s.accumulate(st, f, cf, n, true, 1.0f);
  s.set_values(st, b, f, cf, n);
  s.stats_reset(st);
  s.stats_add(st, std::span<const device_run<float>>(), 1.0f);
  { s.stats() } -> std::same_as<device_stats>;
  { s.read_stats(st) } -> std::same_as<gradient_stats>;
  s.optimizer_step(st, optimizer_kind::adamw, segs, k);
  { s.template allocate_ordered<float>(n, fill::uninitialized) } -> std::same_as<buffer<float>>;
  { s.counters() } -> std::same_as<device_counters>;
};

/// Whether Space is a device space (the sharder then works through its streams).
template <class Space>
inline constexpr bool on_device = !host_accessible<Space>;

/// A space's event type, and an empty stand-in where it has none (host memory), so components
/// can keep one member for both.
template <class Space>
struct device_traits {
  struct event {};
};
template <class Space>
requires requires {
  typename Space::event;
}
struct device_traits<Space> {
  using event = typename Space::event;
};

/// A device emulated in host memory: each stream is a thread running its work in submission
/// order (detail::worker), an event is a point in one stream's order, and wait(s, e) enqueues on
/// s a task that blocks until e's stream got there. A failed task fails its stream (later work is
/// dropped, synchronize rethrows), and a stream waiting on a failed one fails with it, as a
/// CUDA error is sticky. Copies are cheap handles onto one device (its two streams).
class emulated_device_space {
  struct state {
    // The pool before the streams: a stream's last queued free returns memory to it.
    std::mutex pool_mutex;
    std::multimap<std::size_t, std::shared_ptr<std::byte[]>> pool;  // freed ordered blocks
    std::atomic<std::uint64_t> launches{0}, statistics{0}, host_syncs{0}, events{0},
        driver_allocations{0};
    double sumsq = 0.0;
    std::int32_t nonfinite = 0;
    std::chrono::microseconds latency{0};  // before each compute-stream task
    detail::worker compute{true};
    detail::worker comm{true};
  };

 public:
  static constexpr bool host_accessible = false;
  using stream = detail::worker*;
  struct event {
    detail::worker* on = nullptr;
    detail::worker::ticket at = 0;
  };

  emulated_device_space() : state_(std::make_shared<state>()) {}
  /// Every task on the compute stream first sleeps `compute_latency`, as kernels take time on a
  /// GPU: a hand-off the sharder forgets then loses the race every time instead of now and then.
  explicit emulated_device_space(std::chrono::microseconds compute_latency)
      : state_(std::make_shared<state>()) {
    state_->latency = compute_latency;
  }

  [[nodiscard]] static constexpr bool collective() noexcept { return false; }
  [[nodiscard]] stream compute_stream() const noexcept { return &state_->compute; }
  [[nodiscard]] stream comm_stream() const noexcept { return &state_->comm; }

  /// Zeroed memory (allocation is synchronous, as cudaMalloc); freed when the last buffer handle
  /// goes, which the sharder does only once its streams are idle.
  template <class T>
  [[nodiscard]] buffer<T> allocate(std::size_t n) const {
    ++state_->driver_allocations;
    return host_space::allocate<T>(n);
  }
  template <class T>
  [[nodiscard]] buffer<T> allocate_local(std::size_t n) const {
    ++state_->driver_allocations;
    return host_space::allocate<T>(n);
  }
  /// Memory freed in compute-stream order (cudaFreeAsync on the compute stream): it outlives
  /// every task enqueued there before the last handle went. Like CUDA's stream-ordered pool with
  /// its release threshold raised (cuda_space.cuh), freed blocks stay cached for the next
  /// allocation of the same size, and only a miss counts as memory from the driver. Zeroing is
  /// compute-stream work, as cudaMemsetAsync is.
  template <class T>
  [[nodiscard]] buffer<T> allocate_ordered(std::size_t n, fill how = fill::zeroed) const {
    static_assert(std::is_trivially_copyable_v<T> && alignof(T) <= alignof(std::max_align_t));
    const std::size_t bytes = std::max<std::size_t>(n * sizeof(T), 1);
    std::shared_ptr<std::byte[]> block;
    {
      const std::lock_guard lock(state_->pool_mutex);
      if (auto it = state_->pool.find(bytes); it != state_->pool.end()) {
        block = std::move(it->second);
        state_->pool.erase(it);
      }
    }
    if (!block) {
      ++state_->driver_allocations;
      block = std::shared_ptr<std::byte[]>(new std::byte[bytes]);
    }
    auto* p = reinterpret_cast<T*>(block.get());
    // The queued free owns the block: a stream that failed drops its tasks, and the block with
    // them. The state outlives every task its streams run (they are joined first).
    std::shared_ptr<void> owner(p, [st = state_, block, bytes](void*) noexcept {
      try {
        st->compute.submit([pool = st.get(), block, bytes] {
          const std::lock_guard lock(pool->pool_mutex);
          pool->pool.emplace(bytes, block);
        });
      } catch (...) {
        // The stream failed: nothing runs on it any more, and the block goes with `block`.
      }
    });
    if (how == fill::zeroed) zero(compute_stream(), p, n);
    return {std::span<T>(p, n), std::move(owner), false};
  }

  /// What this device was asked to do so far (see device_counters).
  [[nodiscard]] device_counters counters() const noexcept {
    return {state_->launches.load(), state_->statistics.load(), state_->host_syncs.load(),
            state_->events.load(), state_->driver_allocations.load()};
  }

  [[nodiscard]] event record(stream s) const {
    // The submitted no-op's ticket: complete once everything enqueued before it ran. A ticket is
    // a number, so nothing is created (CUDA's spaces reuse their events likewise).
    return {s, post(s, [] {})};
  }
  void wait(stream s, const event& e) const {
    if (e.on == nullptr || e.on == s) return;  // one stream is ordered already
    post(s, [e] { e.on->wait(e.at); });
  }
  void synchronize(stream s) const {
    ++state_->host_syncs;
    s->drain();
  }
  /// Both streams (one host wait).
  void synchronize() const {
    ++state_->host_syncs;
    state_->compute.drain();
    state_->comm.drain();
  }
  /// Both streams, whatever failed: a failed stream drops its remaining work, so each returns
  /// once its queue is empty.
  void drain() const noexcept {
    for (detail::worker* w : {&state_->compute, &state_->comm}) try {
        w->drain();
      } catch (...) {
        // The stream failed: nothing more runs on it.
      }
  }

  template <class T>
  void zero(stream s, T* p, std::size_t n) const {
    if (n == 0) return;
    launch(s, [p, n] { std::fill_n(p, n, T{}); });
  }
  /// Copies n elements from host memory; returns once `host` may be reused.
  template <class T>
  void upload(stream s, T* dst, const T* host, std::size_t n) const {
    if (n == 0) return;
    ++state_->host_syncs;
    s->wait(post(s, [dst, host, n] { std::memcpy(dst, host, n * sizeof(T)); }));
  }
  /// Copies n elements to host memory; returns once they are there.
  template <class T>
  void download(stream s, T* host, const T* src, std::size_t n) const {
    if (n == 0) return;
    ++state_->host_syncs;
    s->wait(post(s, [host, src, n] { std::memcpy(host, src, n * sizeof(T)); }));
  }
  /// dst = src * scale (first) or dst += src * scale, in D (the sharder's accumulate()).
  template <class D, class S>
  void accumulate(stream s, D* dst, const S* src, std::size_t n, bool first, float scale) const {
    if (n == 0) return;
    launch(s, [=] { zero::accumulate(dst, src, n, first, scale); });
  }
  /// Sets n parameters (and, when `master` is not null, their fp32 master weights) from host fp32
  /// values; returns once `values` may be reused.
  template <class P>
  void set_values(stream s, P* param, float* master, const float* values, std::size_t n) const {
    if (n == 0) return;
    std::vector<float> copy(values, values + n);
    launch(s, [param, master, n, v = std::move(copy)] {
      for (std::size_t i = 0; i < n; ++i) {
        if (master != nullptr) master[i] = v[i];
        param[i] = to_param<P>(v[i]);
      }
    });
  }

  void stats_reset(stream s) const {
    launch(s, [st = state_.get()] {
      st->sumsq = 0.0;
      st->nonfinite = 0;
    });
  }
  /// Adds the runs' share of the gradient statistics, one task for all of them (the host
  /// sharder's grad_stats, run by run in the same order, so the same bits).
  template <class G>
  void stats_add(stream s, std::span<const device_run<G>> runs, float scale) const {
    if (runs.empty()) return;
    ++state_->statistics;
    launch(s,
           [st = state_.get(), scale, list = std::vector<device_run<G>>(runs.begin(), runs.end())] {
             bool bad = st->nonfinite != 0;
             for (const auto& r : list) grad_stats(r.data, r.count, scale, st->sumsq, bad);
             st->nonfinite = bad ? 1 : 0;
           });
  }
  [[nodiscard]] device_stats stats() const noexcept { return {&state_->sumsq, &state_->nonfinite}; }
  /// The statistics, once `s` got there: one host wait.
  [[nodiscard]] gradient_stats read_stats(stream s) const {
    gradient_stats r;
    ++state_->host_syncs;
    s->wait(post(s, [&r, st = state_.get()] {
      r.sumsq = st->sumsq;
      r.nonfinite = st->nonfinite != 0;
    }));
    return r;
  }

  /// One optimizer step of the rule of `kind` in Table over `segs`, in s's order. Throws
  /// invalid_argument (now, not on the stream) for a kind Table does not have.
  template <class Table = builtin_optimizers, class P, class G>
  void optimizer_step(stream s, optimizer_kind kind, std::span<const device_segment<P, G>> segs,
                      const step_constants& k) const {
    if (segs.empty()) return;
    Table::visit(kind, [&]<class R>(std::type_identity<R>) {
      launch(s, [k, list = std::vector<device_segment<P, G>>(segs.begin(), segs.end())] {
        for (const auto& g : list)
          update_run<R>(g.grad, g.master, g.moment1, g.moment2, g.param, g.count, k, g.decay);
      });
    });
  }

  /// Enqueues f(on) on s, where on(o) turns a collective's options into those that run it in s's
  /// order. Here f runs later, on s's thread, and its collectives block that thread as on the host.
  template <class F>
  void enqueue(stream s, F&& f) const {
    post(s,
         [fn = std::forward<F>(f)]() mutable { fn([](const ringzero::options& o) { return o; }); });
  }
  /// Runs f() in s's order and returns its result; an exception f throws reaches the caller and
  /// leaves the stream usable (a refused checkpoint is not a device failure).
  template <class F>
  decltype(auto) run_sync(stream s, F&& f) const {
    // Not counted as a host wait: on a GPU, f runs on the calling thread and enqueues; the wait
    // here only hands f to the emulated stream's thread.
    using R = std::invoke_result_t<F&>;
    std::exception_ptr error;
    if constexpr (std::is_void_v<R>) {
      s->wait(post(s, [&] {
        try {
          f();
        } catch (...) {
          error = std::current_exception();
        }
      }));
      if (error) std::rethrow_exception(error);
    } else {
      std::optional<R> r;
      s->wait(post(s, [&] {
        try {
          r.emplace(f());
        } catch (...) {
          error = std::current_exception();
        }
      }));
      if (error) std::rethrow_exception(error);
      return R(std::move(*r));
    }
  }

 private:
  /// Queues element work (what a kernel or memset would be on a GPU) on s, and counts it.
  template <class F>
  void launch(stream s, F&& f) const {
    ++state_->launches;
    post(s, std::forward<F>(f));
  }

  /// Queues f on s (with the compute stream's latency, if any).
  template <class F>
  detail::worker::ticket post(stream s, F&& f) const {
    if (s != &state_->compute || state_->latency.count() == 0) return s->submit(std::forward<F>(f));
    return s->submit([latency = state_->latency, fn = std::forward<F>(f)]() mutable {
      std::this_thread::sleep_for(latency);
      fn();
    });
  }

  std::shared_ptr<state> state_;
};

}  // namespace ringzero::zero
