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
#include <atomic>
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
#include "ringzero/detail/env.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/detail/rank_device.hpp"
#include "ringzero/error.hpp"
#include "ringzero/kernels/device_reduction.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/detail/abort_state.hpp"
#include "ringzero/transport/native.hpp"
#include "ringzero/transport/nccl/detail.hpp"
#include "ringzero/transport/nccl/executor.hpp"
#include "ringzero/tuning/defaults.hpp"

namespace ringzero::nccl {

/// How a communicator is created.
struct config {
  /// CUDA device of this rank; -1 picks the launcher's local rank, else the device a rank on
  /// this thread used before, else the rank, modulo the number of visible devices (see the header
  /// comment). Current in the constructing thread from construction on. NCCL allows one rank per
  /// GPU per communicator on one host (see docs/nccl.md for several ranks on one GPU).
  int device = -1;
  /// Deadline for creation and the default for every blocking call; 0 = RINGZERO_TIMEOUT
  /// (default 300 s).
  std::chrono::nanoseconds timeout{0};
  /// Store key prefix under which rank 0 publishes the NCCL unique id; empty =
  /// "ringzero/nccl/<size>". Groups of different ranks that create communicators through one
  /// store at the same time need different keys.
  std::string key{};
  /// Handed to ncclCommInitRankConfig (CTA counts, network name, ...); ringzero sets blocking = 0.
  ncclConfig_t nccl = NCCL_CONFIG_INITIALIZER;
  /// Asked, at most every 100 ms while a call waits and before the communicator is closed, for a
  /// rank of this communicator known dead (-1: none): what a launcher that reaped a process or a
  /// heartbeat that stopped knows before NCCL would. elastic::session::communicator fills it in.
  std::function<int()> dead_rank{};
};

/// Whether an adopted ncclComm_t is destroyed with the communicator.
enum class ownership { owned, borrowed };

namespace detail {

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

}  // namespace detail

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
    dead_rank_ = cfg.dead_rank;
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
    dead_rank_ = cfg.dead_rank;
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
    c.dead_rank_ = cfg.dead_rank;
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
  void abort(const std::string& why) { shared_->abort.set(why); }
  /// Why abort() was called or a dead rank was found, once one was: communicator::check_usable
  /// refuses every call then.
  [[nodiscard]] std::optional<std::string> abort_reason() const {
    return shared_->abort.reason_if_set();
  }
  /// The rank config::dead_rank named while a call waited, or -1 (communicator::failed_rank()).
  [[nodiscard]] int failed_rank() const noexcept {
    return shared_->failed_rank.load(std::memory_order_acquire);
  }

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

  /// One validated collective (transport/native.hpp), as NCCL's own call. Every buffer is
  /// checked to be memory this rank's GPU can address before anything is enqueued; in place is
  /// NCCL's (same pointer, or this rank's block).
  void run_native(const native_call& c, const ringzero::options& opt) {
    if (staged_through_device(c, opt)) return;
    const std::string_view what = collective_name(c.kind);
    const std::size_t es = dtype_size(c.type);
    const ncclDataType_t type = detail::to_nccl(c.type);
    const auto n = static_cast<std::size_t>(size_);
    const bool is_root = rank_ == c.root;
    const auto* in = static_cast<const std::byte*>(c.in);
    auto* out = static_cast<std::byte*>(c.out);
    const auto check = [&](std::string_view name, const void* p, std::size_t elems) {
      detail::check_device_buffer(what, name, p, elems * es, device_);
    };
    switch (c.kind) {
      case collective::all_reduce:
        check_operands(c);
        return enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
          return ncclAllReduce(in, out, c.count, type, detail::to_nccl(c.reduction), h, s);
        });
      case collective::reduce_scatter:
        check_operands(c);
        return enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
          return ncclReduceScatter(in, out, c.count, type, detail::to_nccl(c.reduction), h, s);
        });
      case collective::all_gather:
        check_operands(c);
        return enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
          return ncclAllGather(in, out, c.count, type, h, s);
        });
      case collective::broadcast:
        check_operands(c);
        return enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
          return ncclBroadcast(is_root ? in : out, out, c.count, type, c.root, h, s);
        });
      case collective::reduce:
        check_operands(c);
        return enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
          return ncclReduce(in, is_root ? out : nullptr, c.count, type,
                            detail::to_nccl(c.reduction), c.root, h, s);
        });
      case collective::barrier: {
        // A one-element all_reduce, always waited for: only the deadline of opt applies.
        const std::span<std::byte> buf = scratch();
        return enqueue(what, {.timeout = opt.timeout}, [&](ncclComm_t h, cudaStream_t s) {
          return ncclAllReduce(buf.data(), buf.data(), 1, ncclInt32, ncclSum, h, s);
        });
      }
      case collective::send_recv:
        if (c.peer >= 0) check("send buffer", in, c.count);
        if (c.from >= 0) check("receive buffer", out, c.recv_count);
        // One NCCL group, so a ring of ranks each sending to the next cannot deadlock.
        return enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
          if (const ncclResult_t r = ncclGroupStart(); r != ncclSuccess) return r;
          ncclResult_t rr = ncclSuccess, sr = ncclSuccess;
          if (c.from >= 0) rr = ncclRecv(out, c.recv_count, type, c.from, h, s);
          if (c.peer >= 0) sr = ncclSend(in, c.count, type, c.peer, h, s);
          const ncclResult_t er = ncclGroupEnd();
          return rr != ncclSuccess ? rr : sr != ncclSuccess ? sr : er;
        });
      case collective::all_to_all: {
        // c.count is one rank's block. In place the input is first copied to a stream-ordered
        // temporary, since a peer may write a block before this rank has sent it.
        const std::size_t total = c.count * n;
        check_operands(c);
        std::vector<std::size_t> counts(n, c.count), displs(n);
        for (std::size_t i = 0; i < n; ++i) displs[i] = i * c.count;
        if (out != in)
          return enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
            return detail::exchange_blocks(h, s, size_, type, es, in, counts, displs, out, counts,
                                           displs);
          });
        const detail::stream_scratch copy(device_, opt.stream != nullptr ? opt.stream : stream_,
                                          total * es);
        return enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
          if (const ncclResult_t r = detail::cuda_status(
                  cudaMemcpyAsync(copy.data(), in, total * es, cudaMemcpyDeviceToDevice, s));
              r != ncclSuccess)
            return r;
          return detail::exchange_blocks(h, s, size_, type, es,
                                         static_cast<const std::byte*>(copy.data()), counts, displs,
                                         out, counts, displs);
        });
      }
      case collective::all_to_allv: {
        std::size_t in_len = 0, out_len = 0;
        for (std::size_t r = 0; r < n; ++r) {
          in_len = std::max(in_len, c.send_displs[r] + c.send_counts[r]);
          out_len = std::max(out_len, c.recv_displs[r] + c.recv_counts[r]);
        }
        if (in_len > 0) check("input", in, in_len);
        if (out_len > 0) check("output", out, out_len);
        return enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
          return detail::exchange_blocks(h, s, size_, type, es, in, c.send_counts, c.send_displs,
                                         out, c.recv_counts, c.recv_displs);
        });
      }
      case collective::gather: {
        std::byte* own = is_root ? out + c.count * es * static_cast<std::size_t>(c.root) : nullptr;
        check_operands(c);
        return enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
          if (!is_root) return ncclSend(in, c.count, type, c.root, h, s);
          if (own != in)
            if (const ncclResult_t r = detail::cuda_status(
                    cudaMemcpyAsync(own, in, c.count * es, cudaMemcpyDeviceToDevice, s));
                r != ncclSuccess)
              return r;
          return detail::root_group(size_, c.root, [&](int p) {
            return ncclRecv(out + c.count * es * static_cast<std::size_t>(p), c.count, type, p, h,
                            s);
          });
        });
      }
      case collective::scatter: {
        const std::byte* own =
            is_root ? in + c.count * es * static_cast<std::size_t>(c.root) : nullptr;
        check_operands(c);
        return enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
          if (!is_root) return ncclRecv(out, c.count, type, c.root, h, s);
          if (own != out)
            if (const ncclResult_t r = detail::cuda_status(
                    cudaMemcpyAsync(out, own, c.count * es, cudaMemcpyDeviceToDevice, s));
                r != ncclSuccess)
              return r;
          return detail::root_group(size_, c.root, [&](int p) {
            return ncclSend(in + c.count * es * static_cast<std::size_t>(p), c.count, type, p, h,
                            s);
          });
        });
      }
    }
    throw unsupported(fmt::format("nccl: {} has no NCCL collective", what));
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
    check_operands(c);
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
    sub.dead_rank_ = std::move(dead_rank);
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

  /// Runs `c` on device copies of its buffers when they are small, plain host memory and the call
  /// is blocking (host_staging_bytes); returns false to leave it to the normal path (which refuses
  /// host memory). The in-place forms keep their meaning: an input inside the output is copied
  /// with it.
  bool staged_through_device(const native_call& c, const ringzero::options& opt) {
    if (opt.async || c.count == 0) return false;
    const std::size_t es = dtype_size(c.type);
    if (c.kind != collective::all_reduce && c.kind != collective::reduce_scatter &&
        c.kind != collective::all_gather && c.kind != collective::broadcast)
      return false;
    const collective_descriptor& desc = *builtin_collectives::find(c.kind);
    const std::size_t in_len = desc.in_elems(c.count, size_, rank_, c.root);
    const std::size_t out_len = desc.out_elems(c.count, size_, rank_, c.root);
    const std::size_t in_bytes = in_len * es, out_bytes = out_len * es;
    const auto* in = static_cast<const std::byte*>(c.in);
    auto* out = static_cast<std::byte*>(c.out);
    const bool in_inside = in_len > 0 && in >= out && in + in_bytes <= out + out_bytes;
    if (in_bytes + out_bytes > host_staging_bytes || !detail::plain_host(out, out_bytes) ||
        (in_len > 0 && !in_inside && !detail::plain_host(in, in_bytes)))
      return false;
    const std::string_view what = collective_name(c.kind);
    ensure_usable(what);
    detail::device_guard guard(device_);
    cudaStream_t s = stream_for(opt);
    const detail::stream_scratch scratch(device_, s, out_bytes + (in_inside ? 0 : in_bytes));
    auto* dout = static_cast<std::byte*>(scratch.data());
    std::byte* din = in_inside ? dout + (in - out) : dout + out_bytes;
    if (in_inside)
      detail::check_cuda(cudaMemcpyAsync(dout, out, out_bytes, cudaMemcpyHostToDevice, s),
                         "nccl: staging host memory");
    else if (in_len > 0)
      detail::check_cuda(cudaMemcpyAsync(din, in, in_bytes, cudaMemcpyHostToDevice, s),
                         "nccl: staging host memory");
    native_call d = c;
    d.in = in_len > 0 ? din : dout;
    d.out = dout;
    run_native(d, {.timeout = opt.timeout, .stream = s});
    detail::check_cuda(cudaMemcpyAsync(out, dout, out_bytes, cudaMemcpyDeviceToHost, s),
                       "nccl: staging host memory");
    const std::chrono::nanoseconds limit = opt.timeout.count() > 0 ? opt.timeout : timeout_;
    wait("staging host memory", s, clock::now() + limit, limit);
    return true;
  }

  /// Refuses any buffer of a call (not all_to_allv, barrier or send_recv) that this rank's GPU
  /// cannot address; the one the call shares in place is checked once.
  void check_operands(const native_call& c) const {
    // Every buffer this rank uses must be this GPU's memory, as large as the descriptor's
    // extent says; in place, the smaller one lies inside the larger and is covered by it.
    const collective_descriptor& d = *builtin_collectives::find(c.kind);
    const std::size_t es = dtype_size(c.type);
    const auto* in = static_cast<const std::byte*>(c.in);
    const auto* out = static_cast<const std::byte*>(c.out);
    const bool uses_in = d.uses_in(rank_, c.root), uses_out = d.uses_out(rank_, c.root);
    const bool in_place = uses_in && uses_out && d.in_place(in, out, c.count * es, rank_);
    const bool in_is_part = in_place && d.out.size == extent::blocks && d.in.size != extent::blocks;
    if (uses_in && !in_is_part)
      detail::check_device_buffer(d.name, "input", in,
                                  d.in_elems(c.count, size_, rank_, c.root) * es, device_);
    if (uses_out && !(in_place && !in_is_part))
      detail::check_device_buffer(d.name, "output", out,
                                  d.out_elems(c.count, size_, rank_, c.root) * es, device_);
  }

  void ensure_usable(std::string_view what) {
    if (!aborted() && shared_->abort.is_set()) stop(*shared_->abort.reason_if_set());
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
    if (shared_->abort.is_set()) {
      const std::string why = *shared_->abort.reason_if_set();
      stop(why);
      throw peer_error(
          fmt::format("{} on rank {} of {} (device {}): {}", what, rank_, size_, device_, why),
          failed_rank());
    }
    const int dead = probe_dead_rank();
    if (dead < 0) return;
    const std::string msg = fmt::format(
        "{} on rank {} of {} (device {}): rank {} died (its launcher or its heartbeat says so); "
        "the communicator was stopped",
        what, rank_, size_, device_, dead);
    shared_->failed_rank.store(dead, std::memory_order_release);
    shared_->abort.set(msg);
    stop(msg);
    throw peer_error(msg, dead);
  }

  /// config::dead_rank's answer, asked at most every 100 ms; -1 without one.
  [[nodiscard]] int probe_dead_rank() {
    if (!dead_rank_) return -1;
    const auto now = clock::now();
    if (now < next_probe_) return -1;
    next_probe_ = now + std::chrono::milliseconds(100);
    const int r = dead_rank_();
    return r >= 0 && r < size_ && r != rank_ ? r : -1;
  }

  /// Stops the communicator's work after a failure NCCL did not report (a dead rank, abort()):
  /// ncclCommRevoke where NCCL has it stops what is in flight and keeps the handle for shrink();
  /// otherwise, or if revoking fails, ncclCommAbort.
  void stop(const std::string& reason) noexcept {
    if (comm_ == nullptr || revoked_) {
      failure_ = reason;
      return;
    }
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
    int previous = device_;
    static_cast<void>(cudaGetDevice(&previous));
    static_cast<void>(cudaSetDevice(device_));
    ncclResult_t r = ncclCommRevoke(comm_, NCCL_REVOKE_DEFAULT);
    // Quiescent once NCCL's state leaves "in progress"; bounded, since a revoke that does not
    // settle leaves the abort.
    const auto until =
        clock::now() + std::min<std::chrono::nanoseconds>(timeout_, std::chrono::seconds(10));
    ringzero::detail::backoff b;
    while (r == ncclInProgress || r == ncclSuccess) {
      ncclResult_t state = ncclInProgress;
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
      if (state == ncclSuccess) {
        revoked_ = true;
        break;
      }
      if (state != ncclInProgress || clock::now() > until) break;
      b.pause();
    }
    static_cast<void>(cudaSetDevice(previous));
    if (revoked_) {
      failure_ = reason;
      log::warn("nccl: rank {} of {} revoked its communicator: {}", rank_, size_, reason);
      return;
    }
#endif
    abort_with(reason);
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
      const auto peer_dead = [&] {
        try {
          return probe_dead_rank() >= 0;
        } catch (...) {
          return false;
        }
      };
      next_probe_ = {};
      const bool stopped = revoked_ || shared_->abort.is_set() || failed_rank() >= 0;
      ncclResult_t r = stopped || peer_dead() ? ncclInternalError : ncclCommFinalize(comm_);
      const auto deadline = clock::now() + timeout_;
      ringzero::detail::backoff b;
      while (r == ncclInProgress) {
        if (clock::now() > deadline || peer_dead()) break;
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
    shared_ = std::move(o.shared_);
    dead_rank_ = std::move(o.dead_rank_);
    next_probe_ = o.next_probe_;
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

  /// What another thread may set while a call waits (abort(); a dead rank found), shared with
  /// the object this one is moved to.
  struct failure_state {
    ringzero::detail::abort_state abort;
    std::atomic<int> failed_rank{-1};
  };

  ncclComm_t comm_ = nullptr;
  std::shared_ptr<detail::live_handle> live_ = std::make_shared<detail::live_handle>();
  std::shared_ptr<failure_state> shared_ = std::make_shared<failure_state>();
  std::function<int()> dead_rank_;  // config::dead_rank
  clock::time_point next_probe_{};  // when dead_rank_ may be asked again
  bool revoked_ = false;            // stop() revoked the handle: kept for shrink(), then aborted
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
