// ringzero::nccl::transport: one rank of an NCCL communicator, with ringzero's guarantees on top
// of NCCL's. Every NCCL and CUDA status is checked and raised as a ringzero::error, and every
// blocking call has a deadline (RINGZERO_TIMEOUT) after which the communicator is aborted, where
// NCCL alone would leave the GPU spinning forever on a peer that never came. It is a transport
// with native collectives (transport/native.hpp): ringzero::communicator validates each call
// and hands it to run_native(), or runs one of ringzero's algorithms (algorithms/schedule.hpp)
// on the executor with_device_executor() offers when options::algorithm asks for one.
//
//   auto comm = ringzero::nccl::communicator::from_env();   // torchrun / Slurm / Open MPI env
//   ringzero::all_reduce(comm, std::span<float>(grads, n), ringzero::op::sum);
//
// NCCL communicators are created non-blocking (ncclConfig_t::blocking = 0): that is what makes
// them abortable while a call is stuck, and ringzero waits out NCCL's "in progress" states itself.
// A communicator is used by one thread at a time, like the ncclComm_t it wraps.
//
// The rank's device: every constructor (from_env(), single(), the store's, adoption of an
// ncclComm_t) makes the communicator's GPU the current device of the calling thread and leaves it
// so, as NCCL programs call cudaSetDevice(local_rank) first: the trainer's cudaMalloc, streams and
// kernels after it land on the GPU the collectives use. Calls pin that device whatever thread
// makes them. Which GPU: config::device, else the launcher's local rank (LOCAL_RANK,
// OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID), else the device a rank on this thread used before
// (an elastic rank keeps its GPU across generations), else the rank; modulo the visible devices
// (detail/rank_device.hpp).
//
// A dead peer: NCCL itself does not say which rank it waits for. config::dead_rank (an elastic
// session passes its heartbeat and the launcher's death marks) names one while a call waits: the
// communicator then stops its work at once (ncclCommRevoke where NCCL has it, 2.28 and later,
// which keeps the handle for ncclCommShrink; ncclCommAbort before), failed_rank() names the rank
// and the call throws peer_error. abort() does the same from any thread. shrink() (NCCL 2.27 and
// later) makes the survivors' communicator from this one without a new rendezvous.
#pragma once

#include <cuda_runtime.h>
#include <fmt/core.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/bootstrap/environment.hpp"
#include "ringzero/bootstrap/rendezvous.hpp"
#include "ringzero/bootstrap/store.hpp"
#include "ringzero/detail/backoff.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/detail/rank_device.hpp"
#include "ringzero/error.hpp"
#include "ringzero/kernels/device_reduction.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/native.hpp"
#include "ringzero/transport/nccl/config.hpp"
#include "ringzero/transport/nccl/detail.hpp"
#include "ringzero/transport/nccl/executor.hpp"
#include "ringzero/transport/nccl/native_calls.hpp"
#include "ringzero/transport/nccl/peer_watch.hpp"
#include "ringzero/tuning/defaults.hpp"

namespace ringzero::nccl {

class transport {
 public:
  using from_env_options = config;
  /// Its collectives take GPU memory only (small blocking control data aside: see
  /// host_staging_bytes); the sharder refuses to be built over it with host buffers.
  static constexpr bool device_memory_only = true;
  /// The most bytes (inputs and outputs together) of a blocking all_reduce, reduce_scatter,
  /// all_gather or broadcast on plain host memory that are staged through device memory instead
  /// of refused: control data such as a checkpoint's agreement or a caller's flag. Bulk data on
  /// host memory is still refused, so it never takes a hidden copy.
  static constexpr std::size_t host_staging_bytes = std::size_t{1} << 20;

  /// Rank `rank` of `size`: rank 0 creates the NCCL unique id and publishes it in `store`, the
  /// others read it there. Every rank must construct its communicators in the same order. The
  /// rank's device (config::device) is current in the calling thread from here on.
  transport(bootstrap::store& store, int rank, int size, const config& cfg = {}) : transport() {
    if (size < 1 || rank < 0 || rank >= size)
      throw invalid_argument(fmt::format(
          "nccl::communicator: rank {} is out of range for a {}-rank communicator", rank, size));
    timeout_ = detail::resolve_timeout(cfg.timeout);
    device_ = detail::pick_device(cfg.device, rank);
    watch_ = detail::peer_watch(cfg.dead_rank);
    const std::string prefix = cfg.key.empty() ? fmt::format("ringzero/nccl/{}", size) : cfg.key;
    // Every rank counts itself in; a creation completes only once all ranks joined it, so the
    // count tells each rank which creation through this prefix it is part of.
    const std::int64_t joined = store.add(prefix + "/joined", 1);
    const std::string id_key = fmt::format("{}/{}/unique_id", prefix, (joined - 1) / size);
    ncclUniqueId id{};
    if (rank == 0) {
      detail::check_nccl(ncclGetUniqueId(&id), "nccl: ncclGetUniqueId");
      store.set(id_key, std::as_bytes(std::span(&id, 1)));
    } else {
      const std::vector<std::byte> v = store.get(id_key);
      if (v.size() != sizeof id)
        throw bootstrap_error(
            fmt::format("nccl: store key '{}' holds {} bytes, expected an NCCL "
                        "unique id of {}",
                        id_key, v.size(), sizeof id));
      std::memcpy(&id, v.data(), sizeof id);
    }
    init(id, rank, size, cfg);
  }

  /// Takes over an ncclComm_t created elsewhere (already initialized). With ownership::borrowed
  /// the handle is not destroyed with this object; a missed deadline still aborts it, after
  /// which its creator must not use or destroy it. The handle's device is current in the calling
  /// thread from here on.
  explicit transport(ncclComm_t comm, ownership own = ownership::owned, const config& cfg = {})
      : transport() {
    if (comm == nullptr)
      throw invalid_argument("nccl::communicator: cannot adopt a null ncclComm_t");
    comm_ = comm;
    owned_ = own == ownership::owned;
    timeout_ = detail::resolve_timeout(cfg.timeout);
    config_ = cfg.nccl;
    config_.blocking = 0;
    detail::check_nccl(ncclCommUserRank(comm, &rank_), "nccl: ncclCommUserRank");
    detail::check_nccl(ncclCommCount(comm, &size_), "nccl: ncclCommCount");
    detail::check_nccl(ncclCommCuDevice(comm, &device_), "nccl: ncclCommCuDevice");
    watch_ = detail::peer_watch(cfg.dead_rank);
    detail::make_current(device_);
    ringzero::detail::thread_rank_device() = device_;
    detail::check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                       "nccl: cudaStreamCreateWithFlags");
    live_->comm = comm_;
  }

  /// A world of one rank in this process: no store, no peers. For tests and single-GPU runs. Its
  /// device is current in the calling thread from here on.
  [[nodiscard]] static transport single(const config& cfg = {}) {
    transport c;
    c.timeout_ = detail::resolve_timeout(cfg.timeout);
    c.device_ = detail::pick_device(cfg.device, 0);
    c.watch_ = detail::peer_watch(cfg.dead_rank);
    ncclUniqueId id{};
    detail::check_nccl(ncclGetUniqueId(&id), "nccl: ncclGetUniqueId");
    c.init(id, 0, 1, cfg);
    return c;
  }

  /// This process's rank of the job that started it (ringzero-run, torchrun, mpirun, srun; see
  /// bootstrap/environment.hpp), on device local rank modulo the visible devices unless
  /// cfg.device says otherwise; that device is current in the calling thread from here on, so
  /// memory and streams the trainer makes next are on it. The unique id travels through the
  /// job's rendezvous store (bootstrap::make_store: TCP on rank 0 or RINGZERO_STORE=file:DIR)
  /// that lives only while the communicator is created. Without a launcher it is single().
  [[nodiscard]] static transport from_env(const config& cfg = {}) {
    const int devices = detail::require_devices();
    const bootstrap::launch_info job = bootstrap::detect_launch();
    log::detail::process_rank().store(job.rank);
    config c = cfg;
    if (c.device < 0) c.device = job.local_rank % devices;
    if (job.world_size == 1) return single(c);
    c.timeout = detail::resolve_timeout(cfg.timeout);
    const auto store = bootstrap::make_store(job, c.timeout);
    return transport(*store, job.rank, job.world_size, c);
  }

  /// Collective over this transport's ranks, as ncclCommSplit: ranks passing the same color
  /// >= 0 get a new NCCL communicator of their own, ranked by (key, rank here); a negative color
  /// takes part and gets nullopt. The new transport has its own stream, this one's deadline and
  /// NCCL configuration, non-blocking so that the deadline holds while NCCL builds it: the parent
  /// reports the split's progress, the new handle its own creation.
  [[nodiscard]] std::optional<transport> split(int color, int key) {
    constexpr std::string_view what = "split";
    ensure_usable(what);
    detail::device_guard guard(device_);
    const auto deadline = clock::now() + timeout_;
    ncclConfig_t c = config_;
    ncclComm_t h = nullptr;
    const ncclResult_t r =
        ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &h, &c);
    settle("splitting the NCCL communicator", r, deadline, timeout_);
    if (color < 0) return std::nullopt;
    if (h == nullptr)
      throw transport_error(fmt::format(
          "nccl: split on rank {} of {} (color {}) returned no communicator", rank_, size_, color));
    transport sub = child(h, "creating the NCCL communicator split from another", deadline, {});
    log::info("nccl: rank {} of {} split to rank {} of {} (color {})", rank_, size_, sub.rank_,
              sub.size_, color);
    return std::optional<transport>(std::move(sub));
  }

  ~transport() { release(); }
  transport(const transport&) = delete;
  transport& operator=(const transport&) = delete;
  transport(transport&& o) noexcept { steal(o); }
  transport& operator=(transport&& o) noexcept {
    if (this != &o) {
      release();
      steal(o);
    }
    return *this;
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  /// The communicator's own stream (options::stream = nullptr).
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }
  [[nodiscard]] std::chrono::nanoseconds default_timeout() const noexcept { return timeout_; }
  /// NCCL picks its own algorithms; these constants only describe the link for reports.
  /// NCCL picks its own algorithms: nothing here is priced.
  [[nodiscard]] const ringzero::tuning::policy& tuning() const noexcept {
    return ringzero::tuning::defaults::generic.value;
  }
  /// The wrapped handle, for NCCL calls ringzero does not cover; null once aborted or moved from.
  [[nodiscard]] ncclComm_t native_handle() const noexcept { return comm_; }
  /// True after a failure aborted the communicator; every later call then throws.
  [[nodiscard]] bool aborted() const noexcept { return !failure_.empty(); }

  /// Fails the communicator from any thread, now: a call waiting in another thread stops its
  /// work (as when a dead rank is found) and throws peer_error carrying `why`, and every later
  /// call throws. communicator::abort() calls it. Without a call in flight the work stops at the
  /// next call or when the communicator is destroyed.
  void abort(const std::string& why) { watch_.abort(why); }
  /// Why abort() was called or a dead rank was found, once one was: communicator::check_usable
  /// refuses every call then.
  [[nodiscard]] std::optional<std::string> abort_reason() const { return watch_.reason(); }
  /// The rank config::dead_rank named while a call waited, or -1 (communicator::failed_rank()).
  [[nodiscard]] int failed_rank() const noexcept { return watch_.failed_rank(); }

  /// The communicator of this one's ranks but `excluded` (ranks here), as ncclCommShrink:
  /// collective over the ranks that remain, each passing the same list; they keep their order.
  /// Works on a healthy communicator and on one stopped after a dead rank was found where NCCL
  /// revokes (2.28 and later: the handle is kept); an aborted one cannot shrink. The new
  /// transport has this one's device, deadline and configuration, and `dead_rank` as its
  /// config::dead_rank (its ranks are numbered anew). unsupported before NCCL 2.27.
  [[nodiscard]] transport shrink(std::span<const int> excluded,
                                 std::function<int()> dead_rank = {}) {
    if (comm_ == nullptr)
      throw transport_error(fmt::format(
          "nccl: shrink on rank {} of {}: this communicator was aborted or moved from{}{}", rank_,
          size_, failure_.empty() ? "" : ": ", failure_));
    std::vector<int> list(excluded.begin(), excluded.end());
    for (int r : list)
      if (r < 0 || r >= size_ || r == rank_)
        throw invalid_argument(fmt::format(
            "nccl: shrink on rank {} of {}: rank {} cannot be excluded (out of range, or this "
            "rank, which then must not call shrink)",
            rank_, size_, r));
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
    detail::device_guard guard(device_);
    const auto deadline = clock::now() + timeout_;
    ncclConfig_t c = config_;
    ncclComm_t h = nullptr;
    const ncclResult_t r = ncclCommShrink(comm_, list.data(), static_cast<int>(list.size()), &h, &c,
                                          NCCL_SHRINK_DEFAULT);
    settle("shrinking the NCCL communicator", r, deadline, timeout_, false);
    if (h == nullptr)
      throw transport_error(
          fmt::format("nccl: shrink on rank {} of {} returned no communicator", rank_, size_));
    transport sub = child(h, "creating the NCCL communicator shrunk from another", deadline,
                          std::move(dead_rank));
    log::info("nccl: rank {} of {} shrunk to rank {} of {} ({} excluded)", rank_, size_, sub.rank_,
              sub.size_, list.size());
    return sub;
#else
    static_cast<void>(dead_rank);
    throw unsupported(
        fmt::format("nccl: shrink needs ncclCommShrink (NCCL 2.27 or later); this is NCCL {}.{}.{}",
                    NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH));
#endif
  }

  /// Runs f(native handle, stream) (one or more NCCL calls that return ncclResult_t) with this
  /// communicator's device current, then, unless opt.async, waits for the stream with the
  /// deadline. The collectives are built on this; it is public so NCCL calls ringzero does not
  /// wrap get the same error mapping and deadlines. `what` names the call in errors.
  template <class F>
  requires std::is_invocable_r_v<ncclResult_t, F, ncclComm_t, cudaStream_t>
  void enqueue(std::string_view what, const ringzero::options& opt, F&& f) {
    ensure_usable(what);
    const std::chrono::nanoseconds limit = opt.timeout.count() > 0 ? opt.timeout : timeout_;
    const auto deadline = clock::now() + limit;
    detail::device_guard guard(device_);
    cudaStream_t s = stream_for(opt);
    settle(what, std::forward<F>(f)(comm_, s), deadline, limit);
    if (!opt.async) wait(what, s, deadline, limit);
  }

  /// Waits until everything enqueued on `s` (nullptr: the communicator's stream) has completed,
  /// raising NCCL's asynchronous errors, and times out like a blocking collective.
  void synchronize(cudaStream_t s = nullptr, std::chrono::nanoseconds timeout = {}) {
    constexpr std::string_view what = "synchronize";
    ensure_usable(what);
    const std::chrono::nanoseconds limit = timeout.count() > 0 ? timeout : timeout_;
    detail::device_guard guard(device_);
    wait(what, s != nullptr ? s : stream_, clock::now() + limit, limit);
  }

  /// Waits until exactly `s` is idle (a null `s` is the default stream, not the communicator's),
  /// with the deadline, NCCL's asynchronous errors and the abort of synchronize(): how memory
  /// the sharder keeps on this communicator's GPU waits for its streams.
  void wait_idle(cudaStream_t s, std::chrono::nanoseconds timeout = {}) {
    constexpr std::string_view what = "synchronize";
    ensure_usable(what);
    const std::chrono::nanoseconds limit = timeout.count() > 0 ? timeout : timeout_;
    detail::device_guard guard(device_);
    wait(what, s, clock::now() + limit, limit);
  }

  /// The handle while it is alive (see detail::live_handle), for memory registered with it.
  [[nodiscard]] std::shared_ptr<detail::live_handle> live() const noexcept {
    return live_;
  }

  /// One validated collective (transport/native.hpp), as NCCL's own call
  /// (nccl/native_calls.hpp). Every buffer is checked to be memory this rank's GPU can address
  /// before anything is enqueued; in place is NCCL's (same pointer, or this rank's block).
  void run_native(const native_call& c, const ringzero::options& opt) {
    detail::run_native(*this, c, opt);
  }

  /// Runs `body(executor, scratch)` for one validated call, which runs algorithm `schedule` (its
  /// name, for errors): the executor
  /// (ringzero/executor.hpp; transport/nccl/executor.hpp) makes each step one NCCL group of
  /// ncclSend/ncclRecv and reduces with ringzero's kernels, all on the options' stream, with
  /// the options' async flag and deadline as run_native; `scratch` is `scratch_elems` elements
  /// of stream-ordered device memory (cudaMallocAsync) for the call. collectives.hpp passes a
  /// body that runs one of ringzero's schedules (algorithms/schedule.hpp). Buffers are checked
  /// as run_native checks them. A failure partway aborts the communicator, since the peers may
  /// be left inside the schedule.
  template <element E, class Body>
  void with_device_executor(const native_call& c, const ringzero::options& opt,
                            std::string_view schedule, std::size_t scratch_elems, Body&& body) {
    const std::string_view what = collective_name(c.kind);
    ensure_usable(what);
    detail::check_operands(*this, c);
    const bool reduces = builtin_collectives::find(c.kind)->reduces;
    const kernels::device_reduction* reductions =
        reduces ? &kernels::required_device_reduction(what, schedule)
                : kernels::registered_device_reduction();
    const std::chrono::nanoseconds limit = opt.timeout.count() > 0 ? opt.timeout : timeout_;
    const auto deadline = clock::now() + limit;
    detail::device_guard guard(device_);
    cudaStream_t s = stream_for(opt);
    auto settle_step = [&](ncclResult_t r) { settle(what, r, deadline, limit); };
    try {
      std::optional<detail::stream_scratch> scratch;
      if (scratch_elems > 0) scratch.emplace(device_, s, scratch_elems * sizeof(E));
      detail::executor<E, decltype(settle_step)> x(comm_, s, rank_, size_, reductions, settle_step);
      body(x, std::span<E>(scratch ? static_cast<E*>(scratch->data()) : nullptr, scratch_elems));
    } catch (const std::exception& e) {
      if (!aborted())
        abort_with(fmt::format("{} ({}) on rank {} of {} (device {}): {}", what, schedule, rank_,
                               size_, device_, e.what()));
      throw;
    }
    if (!opt.async) wait(what, s, deadline, limit);
  }

  /// Every rank's `mine` (at most 16 bytes), in rank order, into `all` on the host: how
  /// RINGZERO_CHECK compares call signatures through NCCL.
  void all_gather_bytes(std::span<const std::byte> mine, std::span<std::byte> all,
                        const ringzero::options& opt) {
    constexpr std::size_t slot = 16;
    if (mine.size() > slot || all.size() != mine.size() * static_cast<std::size_t>(size_))
      throw invalid_argument("nccl: all_gather_bytes takes at most 16 bytes per rank");
    const std::span<std::byte> buf = scratch();
    std::byte* own = buf.data() + slot * static_cast<std::size_t>(rank_);
    detail::device_guard guard(device_);
    cudaStream_t s = stream_for(opt);
    detail::check_cuda(cudaMemcpyAsync(own, mine.data(), mine.size(), cudaMemcpyHostToDevice, s),
                       "RINGZERO_CHECK: cudaMemcpyAsync");
    enqueue("RINGZERO_CHECK", {.timeout = opt.timeout, .stream = s},
            [&](ncclComm_t h, cudaStream_t st) {
              return ncclAllGather(own, buf.data(), slot, ncclUint8, h, st);
            });
    // The exchange completed (waited for above, with the deadline); the copy back is waited
    // for with it too, never with a bare cudaMemcpy.
    std::vector<std::byte> host(buf.size());
    detail::check_cuda(
        cudaMemcpyAsync(host.data(), buf.data(), host.size(), cudaMemcpyDeviceToHost, s),
        "RINGZERO_CHECK: cudaMemcpyAsync");
    const std::chrono::nanoseconds limit = opt.timeout.count() > 0 ? opt.timeout : timeout_;
    wait("RINGZERO_CHECK", s, clock::now() + limit, limit);
    for (std::size_t r = 0; r < static_cast<std::size_t>(size_); ++r)
      std::memcpy(all.data() + r * mine.size(), host.data() + r * slot, mine.size());
  }

 private:
  template <class T>
  friend void detail::run_native(T& t, const native_call& c, const ringzero::options& opt);
  template <class T>
  friend bool detail::staged_through_device(T& t, const native_call& c,
                                            const ringzero::options& opt);
  template <class T>
  friend void detail::check_operands(const T& t, const native_call& c);

  using clock = std::chrono::steady_clock;

  transport() = default;

  /// The transport of handle `h`, which split() or shrink() made from this one (non-blocking:
  /// waited for here, by `deadline`): this one's device, deadline and configuration.
  [[nodiscard]] transport child(ncclComm_t h, std::string_view what, clock::time_point deadline,
                                std::function<int()> dead_rank) {
    transport sub;
    sub.comm_ = h;
    sub.owned_ = true;
    sub.timeout_ = timeout_;
    sub.config_ = config_;
    sub.device_ = device_;
    sub.watch_ = detail::peer_watch(std::move(dead_rank));
    sub.live_->comm = h;
    sub.settle(what, ncclInProgress, deadline, timeout_);
    detail::check_nccl(ncclCommUserRank(h, &sub.rank_), "nccl: ncclCommUserRank");
    detail::check_nccl(ncclCommCount(h, &sub.size_), "nccl: ncclCommCount");
    detail::check_cuda(cudaStreamCreateWithFlags(&sub.stream_, cudaStreamNonBlocking),
                       "nccl: cudaStreamCreateWithFlags");
    return sub;
  }

  void init(const ncclUniqueId& id, int rank, int size, const config& cfg) {
    rank_ = rank;
    size_ = size;
    owned_ = true;
    // The rank's device stays current in this thread: see the header comment.
    detail::make_current(device_);
    // Non-blocking: work the trainer puts on the legacy default stream must not serialize with
    // NCCL's, and the sharder orders the two with events.
    detail::check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                       "nccl: cudaStreamCreateWithFlags");
    ncclConfig_t c = cfg.nccl;
    c.blocking = 0;
    config_ = c;
    ncclUniqueId copy = id;
    const auto deadline = clock::now() + timeout_;
    const ncclResult_t r = ncclCommInitRankConfig(&comm_, size, copy, rank, &c);
    settle("creating the NCCL communicator", r, deadline, timeout_);
    live_->comm = comm_;
    log::info("nccl: rank {} of {} ready on device {} (current in the creating thread)", rank_,
              size_, device_);
  }

  void ensure_usable(std::string_view what) {
    if (!aborted() && watch_.aborted()) stop(*watch_.reason());
    if (aborted()) {
      const std::string msg = fmt::format(
          "{}: this communicator was aborted after an earlier failure: {}", what, failure_);
      if (const int dead = failed_rank(); dead >= 0) throw peer_error(msg, dead);
      throw transport_error(msg);
    }
    if (comm_ == nullptr)
      throw invalid_argument(fmt::format("{}: this communicator was moved from", what));
  }

  /// What every wait checks between polls: abort() from another thread, and (every 100 ms)
  /// config::dead_rank. Either stops the communicator's work (stop()) and throws peer_error.
  void check_peers(std::string_view what) {
    if (watch_.aborted()) {
      const std::string why = *watch_.reason();
      stop(why);
      throw peer_error(
          fmt::format("{} on rank {} of {} (device {}): {}", what, rank_, size_, device_, why),
          failed_rank());
    }
    const int dead = watch_.probe(rank_, size_);
    if (dead < 0) return;
    const std::string msg = fmt::format(
        "{} on rank {} of {} (device {}): rank {} died (its launcher or its heartbeat says so); "
        "the communicator was stopped",
        what, rank_, size_, device_, dead);
    watch_.dead(dead, msg);
    stop(msg);
    throw peer_error(msg, dead);
  }

  /// Stops the communicator's work after a failure NCCL did not report (a dead rank, abort()):
  /// ncclCommRevoke where NCCL has it stops what is in flight and keeps the handle for shrink();
  /// otherwise, or if revoking fails, ncclCommAbort.
  void stop(const std::string& reason) noexcept {
    if (comm_ != nullptr && !revoked_) {
      if (!detail::revoke(comm_, device_, timeout_)) return abort_with(reason);
      revoked_ = true;
      log::warn("nccl: rank {} of {} revoked its communicator: {}", rank_, size_, reason);
    }
    failure_ = reason;
  }

  /// Turns what an NCCL call returned into success or an error. In non-blocking mode a call may
  /// answer "in progress"; the communicator's asynchronous state then says when it is done.
  /// `watch`: also stop for abort() and config::dead_rank (not while shrinking a communicator
  /// stopped for exactly that).
  void settle(std::string_view what, ncclResult_t r, clock::time_point deadline,
              std::chrono::nanoseconds limit, bool watch = true) {
    if (r == ncclSuccess) return;
    if (r != ncclInProgress) fail(what, r);
    ringzero::detail::backoff b;
    for (;;) {
      ncclResult_t state = ncclInProgress;
      if (const ncclResult_t q = ncclCommGetAsyncError(comm_, &state); q != ncclSuccess)
        fail(what, q);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) fail(what, state);
      if (watch) check_peers(what);
      if (clock::now() > deadline) timed_out(what, limit);
      b.pause();
    }
  }

  /// Polls the stream and NCCL's asynchronous error until the stream is idle.
  void wait(std::string_view what, cudaStream_t s, clock::time_point deadline,
            std::chrono::nanoseconds limit) {
    ringzero::detail::backoff b;
    for (;;) {
      const cudaError_t q = cudaStreamQuery(s);
      if (q != cudaSuccess && q != cudaErrorNotReady) {
        static_cast<void>(cudaGetLastError());
        std::string msg =
            fmt::format("{} on rank {} of {} (device {}): CUDA error on the stream: {}", what,
                        rank_, size_, device_, detail::cuda_message(q));
        abort_with(msg);
        throw transport_error(msg + "; the communicator was aborted");
      }
      ncclResult_t state = ncclSuccess;
      if (const ncclResult_t e = ncclCommGetAsyncError(comm_, &state); e != ncclSuccess)
        fail(what, e);
      if (state != ncclSuccess && state != ncclInProgress) fail(what, state);
      if (q == cudaSuccess) return;
      check_peers(what);
      if (clock::now() > deadline) timed_out(what, limit);
      b.pause();
    }
  }

  /// Any NCCL error is fatal here: a non-blocking communicator records even a refused argument
  /// as its asynchronous error, and every later call on it fails the same way (seen with NCCL
  /// 2.28), so the only way forward is to abort it and create a new one.
  [[noreturn]] void fail(std::string_view what, ncclResult_t r) {
    std::string msg = fmt::format("{} on rank {} of {} (device {}): NCCL error: {}", what, rank_,
                                  size_, device_, detail::nccl_message(r, comm_));
    abort_with(msg);
    throw transport_error(msg + "; the communicator was aborted");
  }

  [[noreturn]] void timed_out(std::string_view what, std::chrono::nanoseconds limit) {
    const double secs = std::chrono::duration<double>(limit).count();
    std::string msg = fmt::format(
        "{} on rank {} of {} (device {}) did not complete within {:g} s. NCCL does not report "
        "which rank it is waiting for: check that every rank made the same call with the same "
        "count, type, op and root (RINGZERO_CHECK=1 verifies this) and that none has exited or "
        "hung. The communicator was aborted; RINGZERO_TIMEOUT sets the limit",
        what, rank_, size_, device_, secs);
    abort_with(msg);
    throw timeout_error(msg, -1);
  }

  /// ncclCommAbort is the one way out of a stuck or failed communicator: it stops NCCL's kernels
  /// and proxy threads and frees everything, without waiting for peers.
  void abort_with(const std::string& reason) noexcept {
    failure_ = reason;
    if (comm_ == nullptr) return;
    retire();
    int previous = device_;
    static_cast<void>(cudaGetDevice(&previous));
    static_cast<void>(cudaSetDevice(device_));
    if (const ncclResult_t r = ncclCommAbort(comm_); r != ncclSuccess)
      log::warn("nccl: ncclCommAbort failed: {}", ncclGetErrorString(r));
    comm_ = nullptr;
    static_cast<void>(cudaSetDevice(previous));
  }

  /// Finalize (flush outstanding work, bounded by the deadline) then destroy; abort if either
  /// fails, since a destructor cannot throw and must not hang.
  void release() noexcept {
    if (comm_ == nullptr && stream_ == nullptr && scratch_ == nullptr && order_ == nullptr) return;
    int previous = device_;
    static_cast<void>(cudaGetDevice(&previous));
    static_cast<void>(cudaSetDevice(device_));
    retire();
    if (comm_ != nullptr && owned_) {
      // Finalizing flushes work with every peer: with one known dead (or after abort() or a
      // revoke, after which NCCL refuses it) it would only wait out the deadline. Abort instead.
      const auto peer_dead = [&](bool now) {
        try {
          return watch_.probe(rank_, size_, now) >= 0;
        } catch (...) {
          return false;
        }
      };
      const bool stopped = revoked_ || watch_.aborted() || failed_rank() >= 0;
      ncclResult_t r = stopped || peer_dead(true) ? ncclInternalError : ncclCommFinalize(comm_);
      const auto deadline = clock::now() + timeout_;
      ringzero::detail::backoff b;
      while (r == ncclInProgress) {
        if (clock::now() > deadline || peer_dead(false)) break;
        b.pause();
        if (ncclCommGetAsyncError(comm_, &r) != ncclSuccess) r = ncclInternalError;
      }
      if (r == ncclSuccess) r = ncclCommDestroy(comm_);
      if (r != ncclSuccess) {
        if (!stopped)
          log::warn("nccl: closing the communicator of rank {} of {} failed ({}); aborting it",
                    rank_, size_, ncclGetErrorString(r));
        static_cast<void>(ncclCommAbort(comm_));
      }
    }
    comm_ = nullptr;
    if (scratch_ != nullptr) static_cast<void>(cudaFree(scratch_));
    scratch_ = nullptr;
    if (order_ != nullptr) static_cast<void>(cudaEventDestroy(order_));
    order_ = nullptr;
    if (stream_ != nullptr) static_cast<void>(cudaStreamDestroy(stream_));
    stream_ = nullptr;
    static_cast<void>(cudaSetDevice(previous));
  }

  /// The stream a call runs on: options::stream, else the communicator's own, ordered first
  /// behind the work already queued on the default stream. The communicator's stream is
  /// non-blocking (so the trainer's default-stream work and NCCL's overlap), which also means
  /// it would not wait for that work by itself: a buffer filled by cudaMemcpy from pageable
  /// memory or by a kernel on the default stream would be read before it is written. One event
  /// record and one stream wait, no host wait; a caller that names its stream does its own
  /// ordering and pays nothing.
  cudaStream_t stream_for(const ringzero::options& opt) {
    if (opt.stream != nullptr) return opt.stream;
    if (order_ == nullptr)
      detail::check_cuda(cudaEventCreateWithFlags(&order_, cudaEventDisableTiming),
                         "nccl: cudaEventCreateWithFlags");
    detail::check_cuda(cudaEventRecord(order_, nullptr), "nccl: cudaEventRecord");
    detail::check_cuda(cudaStreamWaitEvent(stream_, order_, 0), "nccl: cudaStreamWaitEvent");
    return stream_;
  }

  /// Marks the handle gone for the memory registered with it, before it is freed.
  void retire() noexcept {
    if (!live_) return;
    const std::lock_guard lock(live_->mutex);
    live_->comm = nullptr;
  }

  void steal(transport& o) noexcept {
    live_ = std::move(o.live_);
    watch_ = std::move(o.watch_);
    revoked_ = std::exchange(o.revoked_, false);
    comm_ = std::exchange(o.comm_, nullptr);
    stream_ = std::exchange(o.stream_, nullptr);
    order_ = std::exchange(o.order_, nullptr);
    scratch_ = std::exchange(o.scratch_, nullptr);
    rank_ = o.rank_;
    size_ = o.size_;
    device_ = o.device_;
    owned_ = o.owned_;
    timeout_ = o.timeout_;
    config_ = o.config_;
    failure_ = std::move(o.failure_);
  }

  /// A device buffer of 16 bytes per rank, allocated on first use and kept, for the barrier and
  /// RINGZERO_CHECK's exchange of call signatures.
  std::span<std::byte> scratch() {
    const std::size_t bytes = 16 * static_cast<std::size_t>(size_);
    if (scratch_ == nullptr) {
      detail::device_guard guard(device_);
      detail::check_cuda(cudaMalloc(&scratch_, bytes), "nccl: cudaMalloc of scratch space");
    }
    return {static_cast<std::byte*>(scratch_), bytes};
  }

  ncclComm_t comm_ = nullptr;
  std::shared_ptr<detail::live_handle> live_ = std::make_shared<detail::live_handle>();
  detail::peer_watch watch_;  // abort(), the rank found dead, config::dead_rank
  bool revoked_ = false;      // stop() revoked the handle: kept for shrink(), then aborted
  cudaStream_t stream_ = nullptr;
  cudaEvent_t order_ = nullptr;  // stream_for's: the default stream's point stream_ waits for
  void* scratch_ = nullptr;
  int rank_ = 0;
  int size_ = 0;
  int device_ = 0;
  bool owned_ = false;
  std::chrono::nanoseconds timeout_{0};
  /// What split() hands ncclCommSplit: the configuration this handle was made with, non-blocking.
  ncclConfig_t config_ = NCCL_CONFIG_INITIALIZER;
  std::string failure_;
};

}  // namespace ringzero::nccl
