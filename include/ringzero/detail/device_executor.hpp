// The executor (ringzero/executor.hpp) of a messaging transport that moves device memory itself
// (libfabric with FI_HMEM: the provider reads and writes GPU buffers): messages are the
// transport's tagged sends and receives, posted by the host; reductions and copies are CUDA
// kernels on one stream, through the run-time tables of kernels/device_reduction.hpp and
// kernels/device_runtime.hpp, so this header is plain C++.
//
// The provider reads device memory as it is, not the stream's future, so a message may start
// only once the kernels it depends on have finished. Every kernel records an event, with the
// ranges it reads and writes; a step posts each of its messages as soon as no unfinished kernel
// writes its buffer (a receive: nor reads it), and polls message progress and events together
// until all are done. A receive into a buffer no pending kernel touches is posted at once and
// fills while the previous reduction runs; a send goes the moment the reduction that made it
// completes. The host never blocks on the stream inside a call, and never waits for a kernel a
// message does not need.
//
// A NIC that writes a receive into GPU memory (GPUDirect RDMA) may complete it before a kernel on
// that GPU would see every byte: where the device does not order such writes for itself
// (cudaDevAttrGPUDirectRDMAWritesOrdering below "owner"), the first kernel or copy after a step's
// receives is preceded by cudaDeviceFlushGPUDirectRDMAWrites, as NCCL's network plugins flush.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/error.hpp"
#include "ringzero/executor.hpp"
#include "ringzero/kernels/device_reduction.hpp"
#include "ringzero/kernels/device_runtime.hpp"
#include "ringzero/log.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::detail {

/// Makes `device` current for its lifetime, then restores the caller's.
class device_scope {
 public:
  device_scope(const kernels::device_runtime& rt, int device)
      : rt_(rt), previous_(rt.current_device()) {
    if (previous_ != device) rt_.set_device(device);
  }
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;
  ~device_scope() {
    try {
      rt_.set_device(previous_);
    } catch (...) {
      // Restoring is best effort: the call's own error, if any, is the one to report.
    }
  }

 private:
  const kernels::device_runtime& rt_;
  int previous_;
};

/// What a communicator keeps between device calls (in comm_state::device_cache): the stream the
/// kernels run on and a few scratch allocations, each registered with the transport once and
/// grown, never shrunk, so a registering provider sees the same memory every call.
class device_cache {
 public:
  using forget_fn = std::function<void(const void*, std::size_t)>;

  device_cache(const kernels::device_runtime& rt, int device, forget_fn forget)
      : rt_(rt),
        device_(device),
        forget_(std::move(forget)),
        ordered_(rt.remote_writes_ordered(device)) {
    stream_ = rt_.create_stream(device_);
  }
  device_cache(const device_cache&) = delete;
  device_cache& operator=(const device_cache&) = delete;
  ~device_cache() {
    try {
      device_scope scope(rt_, device_);
      // Scratch a kernel may still read is left allocated: a GPU that cannot finish its work
      // in RINGZERO_TIMEOUT has failed, and a fault in memory handed out again would be worse.
      if (!rt_.drain(stream_, env_timeout())) {
        log::warn("device executor: the stream of device {} did not drain; its scratch is left",
                  device_);
        return;
      }
      release_scratch();
      rt_.destroy_stream(stream_);
    } catch (...) {
      // Teardown after a failed device has nothing better to do.
    }
  }

  [[nodiscard]] const kernels::device_runtime& runtime() const noexcept { return rt_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] CUstream_st* stream() const noexcept { return stream_; }
  /// Whether kernels on this device see a NIC's writes without a flush (device_runtime).
  [[nodiscard]] bool remote_writes_ordered() const noexcept { return ordered_; }

  /// Scratch of at least `bytes` on this cache's device (current), registered by `adopt`
  /// when new. Only between calls may it move: no message or kernel uses it then. `slot` 0 is
  /// the schedules'; options::reproducible's passes keep theirs in the others
  /// (detail/reproducible_device.hpp), which a schedule they call must not move.
  template <class Adopt>
  [[nodiscard]] std::byte* scratch(std::size_t bytes, Adopt&& adopt, std::size_t slot = 0) {
    block& b = slots_.at(slot);
    if (bytes <= b.bytes) return b.data;
    release(b);
    b.data = static_cast<std::byte*>(rt_.allocate(bytes));
    b.bytes = bytes;
    adopt(b.data, b.bytes);
    return b.data;
  }
  static constexpr std::size_t slots = 10;

 private:
  struct block {
    std::byte* data = nullptr;
    std::size_t bytes = 0;
  };

  void release(block& b) noexcept {
    if (b.data == nullptr) return;
    try {
      forget_(b.data, b.bytes);
    } catch (...) {
      // A transport already torn down dropped its registrations with its endpoint.
    }
    rt_.release(b.data);
    b = {};
  }
  void release_scratch() noexcept {
    for (block& b : slots_) release(b);
  }

  const kernels::device_runtime& rt_;
  int device_;
  forget_fn forget_;
  bool ordered_;
  CUstream_st* stream_ = nullptr;
  std::array<block, slots> slots_{};
};

/// The communicator's device_cache for `device` (current) and runtime `rt`, made anew when
/// either changed. Memory the transport registered is forgotten there before it is freed: the
/// callback holds the transport, which a communicator keeps on the heap through every move, not
/// the communicator, which a move leaves behind.
template <class Comm>
[[nodiscard]] device_cache& device_cache_of(Comm& comm, const kernels::device_runtime& rt,
                                            int device) {
  std::shared_ptr<device_cache>& cache = comm.state().device;
  if (!cache || cache->device() != device || &cache->runtime() != &rt) {
    cache.reset();
    auto* t = &comm.transport();
    cache = std::make_shared<device_cache>(rt, device, [t](const void* p, std::size_t bytes) {
      if constexpr (requires { t->forget_memory(p, bytes); })
        t->forget_memory(p, bytes);
      else
        (void)t, (void)p, (void)bytes;  // nothing registered: nothing to forget
    });
  }
  return *cache;
}

/// Waits on the host until the work queued on `s` so far has run, polling an event, and throws
/// timeout_error "<what> ... on rank r of n" once `deadline` passed: a stream behind a collective
/// whose peer died never drains, and a blocking wait would hold the host for good.
template <class Comm>
void wait_for_stream(const Comm& comm, const kernels::device_runtime& rt, CUstream_st* s,
                     clock::time_point deadline, std::chrono::nanoseconds limit,
                     std::string_view what) {
  CUevent_st* e = rt.record(s);
  struct destroy {
    const kernels::device_runtime& rt;
    CUevent_st* e;
    ~destroy() { rt.destroy_event(e); }
  } owned{rt, e};
  backoff b;
  while (!rt.done(e)) {
    if (clock::now() > deadline)
      throw timeout_error(
          fmt::format("{} on rank {} of {}: timed out after {:g} s waiting for the device to "
                      "finish (RINGZERO_TIMEOUT sets the limit)",
                      what, comm.rank(), comm.size(), std::chrono::duration<double>(limit).count()),
          -1);
    b.pause();
  }
}

/// Executor over communicator `comm` for one call on device buffers of the cache's device
/// (current for the executor's lifetime): takes one collective sequence number, like a host
/// algorithm, and every wait has the call's deadline. Call finish() after the schedule: it
/// waits for the last kernels. Destroyed unfinished (a schedule threw), it cancels its messages
/// and waits for the stream, so no kernel still runs on scratch or on the caller's buffers.
template <collective_comm C, element E>
class device_executor {
 public:
  /// `reductions` may be null for schedules that do not reduce.
  device_executor(C& comm, device_cache& cache, const kernels::device_reduction* reductions,
                  std::string_view collective, std::string_view algorithm,
                  std::chrono::nanoseconds timeout = std::chrono::nanoseconds{0})
      : ex_(comm, collective, algorithm, timeout),
        rt_(cache.runtime()),
        stream_(cache.stream()),
        ordered_(cache.remote_writes_ordered()),
        reductions_(reductions),
        collective_(collective),
        algorithm_(algorithm),
        limit_(timeout.count() > 0 ? timeout : std::chrono::nanoseconds(comm.timeout())),
        deadline_(clock::now() + limit_) {}
  device_executor(const device_executor&) = delete;
  device_executor& operator=(const device_executor&) = delete;
  ~device_executor() {
    if (kernels_.empty()) return;
    if (!rt_.drain(stream_, limit_))
      log::warn("{} ({}): the device did not finish the call's kernels while it unwound",
                collective_, algorithm_);
    for (const auto& k : kernels_) rt_.destroy_event(k.event);
  }

  [[nodiscard]] int rank() const { return ex_.rank(); }
  [[nodiscard]] int size() const { return ex_.size(); }

  void exchange(std::span<const transfer<const E>> sends, std::span<const transfer<E>> recvs) {
    std::vector<message> ms;
    ms.reserve(sends.size() + recvs.size());
    // Receives first: a peer's send finds its receive posted as early as possible.
    for (const auto& t : recvs) ms.push_back({t.peer, step_of(t.id), false, span_of(t)});
    for (const auto& t : sends) ms.push_back({t.peer, step_of(t.id), true, span_of(t)});
    backoff b;
    for (;;) {
      retire();
      bool all_done = true;
      bool moved = false;
      for (auto& m : ms) {
        if (!m.posted && !blocked(m)) {
          m.p = m.is_send ? ex_.send(m.peer, m.step, 0, m.bytes)
                          : ex_.recv(m.peer, m.step, 0, m.bytes);
          m.posted = true;
          moved = true;
        }
        if (m.posted && !m.p.done) moved = ex_.test(m.p) || moved;
        all_done = all_done && m.posted && m.p.done;
      }
      if (all_done) {
        unflushed_ = unflushed_ || (!ordered_ && !recvs.empty());
        return;
      }
      if (moved) {
        b.reset();
        continue;
      }
      b.pause();
      check_deadline();
    }
  }

  void combine(op o, const E* a, const E* b, E* out, std::size_t n) {
    flush();
    reductions().combine(dtype_of<E>(), o, a, b, out, n, stream_);
    enqueued({a, n}, {b, n}, {out, n});
  }

  void finish_avg(E* data, std::size_t n, int ranks) {
    flush();
    reductions().finish_avg(dtype_of<E>(), data, n, ranks, stream_);
    enqueued({data, n}, {}, {data, n});
  }

  void copy(E* dst, const E* src, std::size_t n) {
    flush();
    rt_.copy(dst, src, n * sizeof(E), stream_);
    enqueued({src, n}, {}, {dst, n});
  }

  /// Waits, with the call's deadline, until every kernel enqueued has finished: the results
  /// are in the caller's buffers when the call returns, as on the host.
  void finish() {
    backoff b;
    for (retire(); !kernels_.empty(); retire()) {
      b.pause();
      check_deadline();
    }
  }

 private:
  struct range {
    const std::byte* lo = nullptr;
    const std::byte* hi = nullptr;
    range() = default;
    range(const E* p, std::size_t n)
        : lo(reinterpret_cast<const std::byte*>(p)), hi(lo + n * sizeof(E)) {}
    [[nodiscard]] bool overlaps(std::span<const std::byte> s) const noexcept {
      return lo < s.data() + s.size() && s.data() < hi;
    }
  };
  struct kernel {
    CUevent_st* event;
    range reads[2];
    range writes;
  };
  struct message {
    int peer;
    int step;
    bool is_send;
    std::span<std::byte> bytes;
    bool posted = false;
    typename ringzero::detail::exchange<C>::pending p{};
  };

  [[nodiscard]] static int step_of(std::uint32_t id) {
    if (id >= max_message_ids)
      throw invalid_argument(
          fmt::format("schedule: message id {} does not fit a tag's step bits", id));
    return static_cast<int>(id);
  }
  template <class T>
  [[nodiscard]] static std::span<std::byte> span_of(const transfer<T>& t) noexcept {
    // A send's bytes are only read: the endpoint takes them as const again.
    return {reinterpret_cast<std::byte*>(const_cast<E*>(t.data)), t.count * sizeof(E)};
  }

  /// Whether an unfinished kernel writes the message's buffer, or (a receive) reads it.
  [[nodiscard]] bool blocked(const message& m) const noexcept {
    for (const auto& k : kernels_) {
      if (k.writes.overlaps(m.bytes)) return true;
      if (!m.is_send && (k.reads[0].overlaps(m.bytes) || k.reads[1].overlaps(m.bytes))) return true;
    }
    return false;
  }

  /// Makes what the last receives wrote visible to the device before work that may read it.
  void flush() {
    if (!unflushed_) return;
    rt_.flush_remote_writes();
    unflushed_ = false;
  }

  void enqueued(range a, range b, range out) {
    CUevent_st* e = rt_.record(stream_);
    kernels_.push_back({e, {a, b}, out});
  }

  /// Drops the kernels that finished; a stream completes them in order.
  void retire() {
    while (!kernels_.empty() && rt_.done(kernels_.front().event)) {
      rt_.destroy_event(kernels_.front().event);
      kernels_.pop_front();
    }
  }

  void check_deadline() const {
    if (clock::now() <= deadline_) return;
    throw timeout_error(
        fmt::format("{} ({}) on rank {} of {}: timed out after {:g} s waiting for the device to "
                    "finish a reduction or copy (RINGZERO_TIMEOUT sets the limit)",
                    collective_, algorithm_, ex_.rank(), ex_.size(),
                    std::chrono::duration<double>(limit_).count()),
        -1);
  }

  [[nodiscard]] const kernels::device_reduction& reductions() const {
    // Reached only by a schedule that reduces without a table: collectives.hpp refuses such a
    // call first, so this is a guard, not the error users see.
    if (reductions_ == nullptr)
      throw unsupported("a schedule reduced without ringzero's CUDA kernels registered");
    return *reductions_;
  }

  ringzero::detail::exchange<C> ex_;
  const kernels::device_runtime& rt_;
  CUstream_st* stream_;
  bool ordered_;
  bool unflushed_ = false;  ///< receives completed since the last flush (unordered devices)
  const kernels::device_reduction* reductions_;
  std::string_view collective_;
  std::string_view algorithm_;
  std::chrono::nanoseconds limit_;
  clock::time_point deadline_;
  std::deque<kernel> kernels_;
};

}  // namespace ringzero::detail
