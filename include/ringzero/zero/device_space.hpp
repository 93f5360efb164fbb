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
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/zero/detail/worker.hpp"
#include "ringzero/zero/memory_space.hpp"
#include "ringzero/zero/optimizer.hpp"
#include "ringzero/zero/optimizer_math.hpp"
#include "ringzero/zero/options.hpp"

namespace ringzero::zero {

/// One run of the optimizer over device memory: `count` elements of one parameter segment. `grad`
/// in the reduce type G; `master` is `param` when P is float; `moment2` is null for SGD.
template <class P, class G>
struct device_segment {
  const G* grad = nullptr;
  float* master = nullptr;
  float* moment1 = nullptr;
  float* moment2 = nullptr;
  P* param = nullptr;
  std::size_t count = 0;
  bool decay = false;
};

/// A rank's share of a step's gradient checks, or, once agreed, every rank's.
struct gradient_stats {
  double sumsq = 0.0;      ///< sum of squares of the unscaled gradients
  bool nonfinite = false;  ///< some gradient is inf or NaN
};

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
  s.zero(st, f, n);
  s.upload(st, f, cf, n);
  s.download(st, f, cf, n);
  s.accumulate(st, f, cf, n, true, 1.0f);
  s.set_values(st, b, f, cf, n);
  s.stats_reset(st);
  s.stats_add(st, cf, n, 1.0f);
  { s.stats() } -> std::same_as<device_stats>;
  s.optimizer_step(st, optimizer_kind::adamw, segs, k);
  { s.template allocate_ordered<float>(n) } -> std::same_as<buffer<float>>;
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

/// The fp32 optimizer state of a device space: master weights (16-bit P only) and moments, as
/// shard_optimizer holds them in host memory, addressed by the same local positions.
template <class P, class Space>
class device_optimizer {
 public:
  static constexpr bool has_master = !std::is_same_v<P, float>;

  device_optimizer(const optimizer_options& o, std::size_t local_size, const Space& space)
      : kind_(o.kind), size_(local_size) {
    if constexpr (has_master) master_ = space.template allocate_local<float>(local_size);
    m1_ = space.template allocate_local<float>(local_size);
    if (kind_ == optimizer_kind::adamw) m2_ = space.template allocate_local<float>(local_size);
  }

  [[nodiscard]] optimizer_kind kind() const noexcept { return kind_; }
  [[nodiscard]] std::size_t local_size() const noexcept { return size_; }
  [[nodiscard]] int moment_count() const noexcept { return kind_ == optimizer_kind::adamw ? 2 : 1; }
  /// Device pointers, as shard_optimizer's.
  [[nodiscard]] float* master(std::size_t local, P* param) const noexcept {
    if constexpr (has_master)
      return master_.data() + local;
    else
      return param;
  }
  [[nodiscard]] float* moment(int which, std::size_t local) const noexcept {
    return (which == 1 ? m1_.data() : m2_.data()) + local;
  }
  [[nodiscard]] std::size_t moment_size(int which) const noexcept {
    return which == 1 || kind_ == optimizer_kind::adamw ? size_ : 0;
  }
  [[nodiscard]] std::size_t bytes() const noexcept {
    return master_.bytes() + m1_.bytes() + m2_.bytes();
  }

 private:
  optimizer_kind kind_;
  std::size_t size_;
  buffer<float> master_;
  buffer<float> m1_;
  buffer<float> m2_;
};

/// A device emulated in host memory: each stream is a thread running its work in submission
/// order (detail::worker), an event is a point in one stream's order, and wait(s, e) enqueues on
/// s a task that blocks until e's stream got there. A failed task fails its stream (later work is
/// dropped, synchronize rethrows), and a stream waiting on a failed one fails with it, as a
/// CUDA error is sticky. Copies are cheap handles onto one device (its two streams).
class emulated_device_space {
  struct state {
    detail::worker compute{true};
    detail::worker comm{true};
    double sumsq = 0.0;
    std::int32_t nonfinite = 0;
    std::chrono::microseconds latency{0};  // before each compute-stream task
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
    return host_space::allocate<T>(n);
  }
  template <class T>
  [[nodiscard]] buffer<T> allocate_local(std::size_t n) const {
    return host_space::allocate<T>(n);
  }
  /// Zeroed memory freed in compute-stream order (cudaFreeAsync on the compute stream): the
  /// memory outlives every task enqueued there before the last handle went.
  template <class T>
  [[nodiscard]] buffer<T> allocate_ordered(std::size_t n) const {
    auto* v = new std::vector<T>(n, T{});
    const std::span<T> view(*v);
    std::shared_ptr<void> owner(v, [st = state_](void* p) noexcept {
      auto* mem = static_cast<std::vector<T>*>(p);
      try {
        st->compute.submit([mem] { delete mem; });
      } catch (...) {
        delete mem;  // the stream failed: nothing runs on it any more
      }
    });
    return {view, std::move(owner), false};
  }

  [[nodiscard]] event record(stream s) const {
    // The submitted no-op's ticket: complete once everything enqueued before it ran.
    return {s, post(s, [] {})};
  }
  void wait(stream s, const event& e) const {
    if (e.on == nullptr || e.on == s) return;  // one stream is ordered already
    post(s, [e] { e.on->wait(e.at); });
  }
  void synchronize(stream s) const { s->drain(); }
  /// Both streams.
  void synchronize() const {
    state_->compute.drain();
    state_->comm.drain();
  }

  template <class T>
  void zero(stream s, T* p, std::size_t n) const {
    if (n == 0) return;
    post(s, [p, n] { std::fill_n(p, n, T{}); });
  }
  /// Copies n elements from host memory; returns once `host` may be reused.
  template <class T>
  void upload(stream s, T* dst, const T* host, std::size_t n) const {
    if (n == 0) return;
    s->wait(post(s, [dst, host, n] { std::memcpy(dst, host, n * sizeof(T)); }));
  }
  /// Copies n elements to host memory; returns once they are there.
  template <class T>
  void download(stream s, T* host, const T* src, std::size_t n) const {
    if (n == 0) return;
    s->wait(post(s, [host, src, n] { std::memcpy(host, src, n * sizeof(T)); }));
  }
  /// dst = src * scale (first) or dst += src * scale, in D (the sharder's accumulate()).
  template <class D, class S>
  void accumulate(stream s, D* dst, const S* src, std::size_t n, bool first, float scale) const {
    if (n == 0) return;
    post(s, [=] { zero::accumulate(dst, src, n, first, scale); });
  }
  /// Sets n parameters (and, when `master` is not null, their fp32 master weights) from host fp32
  /// values; returns once `values` may be reused.
  template <class P>
  void set_values(stream s, P* param, float* master, const float* values, std::size_t n) const {
    if (n == 0) return;
    std::vector<float> copy(values, values + n);
    post(s, [param, master, n, v = std::move(copy)] {
      for (std::size_t i = 0; i < n; ++i) {
        if (master != nullptr) master[i] = v[i];
        param[i] = to_param<P>(v[i]);
      }
    });
  }

  void stats_reset(stream s) const {
    post(s, [st = state_.get()] {
      st->sumsq = 0.0;
      st->nonfinite = 0;
    });
  }
  /// Adds g's share of the gradient statistics (the host sharder's grad_stats, segment by segment
  /// in the same order, so the same bits).
  template <class G>
  void stats_add(stream s, const G* g, std::size_t n, float scale) const {
    post(s, [st = state_.get(), g, n, scale] {
      bool bad = st->nonfinite != 0;
      grad_stats(g, n, scale, st->sumsq, bad);
      st->nonfinite = bad ? 1 : 0;
    });
  }
  [[nodiscard]] device_stats stats() const noexcept { return {&state_->sumsq, &state_->nonfinite}; }

  template <class P, class G>
  void optimizer_step(stream s, optimizer_kind kind, std::span<const device_segment<P, G>> segs,
                      const step_constants& k) const {
    if (segs.empty()) return;
    post(s, [kind, k, list = std::vector<device_segment<P, G>>(segs.begin(), segs.end())] {
      for (const auto& g : list)
        update_elements<P>(kind, g.grad, g.master, g.moment1, g.moment2, g.param, g.count, k,
                           g.decay);
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
