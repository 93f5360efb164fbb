// The shm transport: ranks as processes on one host, talking through one shared-memory segment
// (header-only, POSIX only: shm_open, mmap, /proc). Small messages are a cache line the
// receiver polls; larger ones stream through a ring of slots per pair of ranks; no syscall on
// the message path and no lock shared between processes, so a rank killed at any instant can
// only make the others fail (peer_error naming it), never hang.
//
//   auto comm = ringzero::shm::communicator::from_env();   // ringzero-run, torchrun, Slurm, ...
//   ringzero::all_reduce(comm, std::span<float>(grads), ringzero::op::sum);
//
// ringzero::shm::transport is messaging (send, receive, test, progress), its tuning policy and
// host names, and two capabilities the communicator uses where they apply: symmetric memory
// (comm.allocate<T>(n): a buffer every rank of the node addresses) and collectives run in the
// segment itself (try_native(), transport/native.hpp). shm::communicator is
// ringzero::communicator<shm::transport> (transport/shm/communicator.hpp). transport::join()
// sets one up over another communicator's messages instead of a store: the hierarchical
// algorithm's node level under libfabric (libfabric::transport::node_transport).
#pragma once

#include <sys/prctl.h>

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
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
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/op.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/request.hpp"
#include "ringzero/transport/native.hpp"
#include "ringzero/transport/shm/detail/collectives.hpp"
#include "ringzero/transport/shm/detail/engine.hpp"
#include "ringzero/transport/shm/detail/segment.hpp"
#include "ringzero/transport/shm/symmetric.hpp"
#include "ringzero/transport/shm/workspace.hpp"
#include "ringzero/tuning/defaults.hpp"
#include "ringzero/types.hpp"

namespace ringzero::shm {

/// The segment's geometry and the sizes up to which collectives run in it. Must be the same on
/// every rank (rank 0's geometry is the one the segment gets). The cost model's constants are
/// options::tuning (tuning::defaults::shm).
struct segment_options {
  /// Bytes per rank of the workspace that collectives in the segment use
  /// (shm/detail/collectives.hpp): two buffers of this size each.
  std::size_t workspace_bytes = std::size_t{1} << 20;
  /// broadcast, all_gather and reduce_scatter up to this many bytes run in the segment's
  /// workspace rather than over messages (shm/detail/collectives.hpp), when the caller leaves
  /// the algorithm to ringzero.
  std::size_t segment_bytes = std::size_t{4} << 20;
  /// The same for all_reduce on host buffers, in pieces of the workspace: unbounded, since the
  /// segment beat every algorithm over messages at every size measured (busbw, 2 ranks: 5.2
  /// against 2.7 GB/s at 16 MiB, 3.6 against 1.9 at 64 MiB; 4 ranks: 2.6 against 1.0 at
  /// 64 MiB).
  std::size_t all_reduce_segment_bytes = std::numeric_limits<std::size_t>::max();
  /// The same for all_to_all (its whole buffer, size() blocks): one phase instead of a message
  /// per peer. Against pairwise over messages, float, 2 and 4 ranks: 1.7-5.3x faster below
  /// 8 KiB, 1.2-2.3x up to 2 MiB but for 2 ranks at 512 KiB (0.89x); docs/performance.md.
  std::size_t all_to_all_segment_bytes = std::size_t{4} << 20;
  /// all_gather and all_to_all blocks (each rank's input; the part of it for one peer) of at
  /// least this many bytes are read from the peers' inputs in their own address spaces by
  /// cross-memory attach (process_vm_readv), one copy per block, instead of through the
  /// workspace or over messages (shm/detail/collectives.hpp).
  /// RINGZERO_SHM_CMA=0 turns it off; where the kernel refuses such reads, the first call finds
  /// out on every rank alike, warns once and takes the other paths from then on.
  std::size_t cross_memory_bytes = std::size_t{16} << 10;
  /// all_reduce (not options::reproducible's sum) of at least this many bytes on buffers that
  /// are not symmetric memory: each rank reduces its block reading the peers' inputs by
  /// cross-memory attach, and reads the other blocks from their owners' outputs, about half the
  /// memory traffic of the workspace's path (shm/detail/collectives.hpp). Off by default: it
  /// pays only where the kernel's cross-process copy runs near memcpy's speed, and on the
  /// virtual machines measured it ran at a quarter of it in cache and half out of it, so the
  /// path took 1.6-4.2x the workspace's time (docs/performance.md, "all_reduce by cross-memory
  /// attach"; bench/cross_memory measures a machine). Under RINGZERO_SHM_CMA as above.
  std::size_t cross_memory_all_reduce_bytes = std::numeric_limits<std::size_t>::max();
  /// Outputs of at least this many bytes are written with streaming stores that bypass the
  /// cache (the output would not stay in it, and reading it for ownership costs a third more
  /// memory traffic).
  std::size_t streaming_bytes = std::size_t{8} << 20;
  /// Slots per ordered pair of ranks and bytes per slot (a 32-byte header, then payload): a
  /// message of up to slot_bytes - 32 bytes takes one slot, the eager limit. 64 x 8 KiB keeps a
  /// pair's ring (512 KiB) inside the L2 cache of the two cores that share it.
  std::size_t slots = 64;
  std::size_t slot_bytes = 8192;

  [[nodiscard]] std::size_t eager_limit() const noexcept {
    return slot_bytes - detail::slot_header_bytes;
  }
};

struct options {
  /// 0: RINGZERO_TIMEOUT (default 300 s). Bounds the setup and every wait of the transport.
  std::chrono::nanoseconds timeout{0};
  /// The cost model's constants and the algorithms' flow control on this transport.
  ringzero::tuning::policy tuning = ringzero::tuning::defaults::shm.value;
  segment_options segment{};
};

class transport {
 public:
  using from_env_options = shm::options;

  /// Tags with all of these bits set are the transport's own (symmetric allocation); the
  /// communicator keeps its ids below them (comm_id_bits()).
  static constexpr std::uint64_t internal_tag = std::uint64_t{0xfff} << tag_bits;

  /// Handle to one posted send or receive. Destroying it before completion cancels it: a
  /// receive is never written afterwards; a send already under way is finished from a copy.
  using request = ringzero::detail::transport_request<transport, detail::engine, detail::op*>;

  /// Joins the job the environment describes (ringzero-run, torchrun, Slurm, Open MPI
  /// variables): opens the store, builds the transport, closes the store again.
  [[nodiscard]] static transport from_env(const from_env_options& opt = {}) {
    const bootstrap::launch_info info = bootstrap::detect_launch();
    log::detail::process_rank().store(info.rank);
    const auto timeout = opt.timeout.count() > 0 ? opt.timeout : ringzero::detail::env_timeout();
    const std::unique_ptr<bootstrap::store> store = bootstrap::make_store(info, timeout);
    return transport(*store, info.rank, info.world_size, opt);
  }

  /// Collective over the `size` processes sharing `store` (used only while constructing).
  transport(bootstrap::store& store, int rank, int size, const options& opt = {})
      : rank_(rank),
        size_(size),
        timeout_(opt.timeout.count() > 0 ? opt.timeout : ringzero::detail::env_timeout()),
        segment_(opt.segment),
        tuning_(opt.tuning),
        host_(log::detail::host_name()),
        cross_memory_(cross_memory_from_env()) {
    if (size < 1 || rank < 0 || rank >= size)
      throw invalid_argument(fmt::format("shm transport: rank {} is not in [0, {})", rank, size));
    check_options(opt);
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    // Several transports may be built over one store: each gets its own keys.
    const std::int64_t generation = (store.add("ringzero-shm/joined", 1) - 1) / size;
    const auto key = [&](std::string_view what, int r) {
      return fmt::format("ringzero-shm/{}/{}/{}", generation, what, r);
    };
    store.set_string(key("host", rank), log::detail::host_name());
    for (int r = 0; r < size; ++r)
      if (const auto h = store.get_string(key("host", r)); h != log::detail::host_name())
        throw unsupported(fmt::format(
            "shm transport: rank {} runs on host '{}' and rank {} on '{}': shm serves ranks on "
            "one host only (use the libfabric transport across hosts)",
            r, h, rank, log::detail::host_name()));

    detail::mapping seg;
    if (rank == 0) {
      seg = create_segment(size, segment_);
      store.set_string(key("segment", 0), fmt::format("{} {}", seg.name(), seg.size()));
    } else {
      seg = open_segment(store.get_string(key("segment", 0)), size);
    }
    attach(std::move(seg), deadline);
  }

  /// Collective over the ranks of `node`, a communicator whose ranks all run on this host (the
  /// hierarchical algorithm's node level under libfabric): its rank 0 creates the segment and
  /// names it to the others in `node`'s own messages, within node's deadline. Returns nullopt on
  /// every rank alike when a rank passes use = false or cannot map the segment (hosts that share
  /// a name but not /dev/shm), so that the caller keeps its own messaging for the node.
  template <class Comm>
  [[nodiscard]] static std::optional<transport> join(Comm& node, bool use,
                                                     const options& opt = {}) {
    check_options(opt);
    const auto timeout =
        opt.timeout.count() > 0 ? opt.timeout : std::chrono::nanoseconds(node.timeout());
    detail::mapping seg;
    try {
      return join_over(node, use, opt, timeout, seg);
    } catch (...) {
      // A rank failed mid-setup: the name must not outlive the job.
      seg.unlink();
      throw;
    }
  }

  transport(transport&&) noexcept = default;
  transport& operator=(transport&&) noexcept = default;
  transport(const transport&) = delete;
  transport& operator=(const transport&) = delete;
  ~transport() = default;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] const ringzero::tuning::policy& tuning() const noexcept { return tuning_; }
  /// The section of a RINGZERO_TUNING file that applies here.
  [[nodiscard]] std::string tuning_name() const { return "shm"; }
  [[nodiscard]] std::chrono::nanoseconds default_timeout() const noexcept { return timeout_; }
  /// Every rank runs on this host (the constructor checked it).
  [[nodiscard]] const std::string& host_of(int /*rank*/) const noexcept { return host_; }
  /// Communicator ids stay below internal_tag's.
  [[nodiscard]] static constexpr int comm_id_bits() noexcept {
    return tag_layout::comm_id_bits - 1;
  }
  [[nodiscard]] const segment_options& segment() const noexcept { return segment_; }
  /// Whether a collective ran in the segment yet (the first one allocates its workspace).
  [[nodiscard]] bool segment_used() const noexcept { return ws_ != nullptr; }
  /// The phases the last collective run in the segment posted: for an all_reduce through the
  /// workspace one per piece in one phase, two per piece in two (tuning::policy::one_phase_bytes).
  [[nodiscard]] int segment_phases() const noexcept { return segment_phases_; }

  [[nodiscard]] request isend(int peer, std::uint64_t tag, std::span<const std::byte> data) {
    check_peer(peer, "isend");
    eng_->check_aborted("shm isend");
    request r;
    r.eng_ = eng_;
    std::lock_guard lock(eng_->mutex());
    r.op_ = eng_->send(peer, tag, data);
    r.done_ = r.op_ == nullptr;
    return r;
  }

  [[nodiscard]] request irecv(int peer, std::uint64_t tag, std::span<std::byte> data) {
    check_peer(peer, "irecv");
    eng_->check_aborted("shm irecv");
    request r;
    r.eng_ = eng_;
    std::lock_guard lock(eng_->mutex());
    r.op_ = eng_->recv(peer, tag, data);
    r.done_ = r.op_ == nullptr;
    return r;
  }

  /// Moves messages; true once r finished. Throws transport_error on a size mismatch and
  /// peer_error, naming the peer, once its process is found gone.
  [[nodiscard]] bool test(request& r) {
    if (r.done_) return true;
    if (!r.op_) throw invalid_argument("shm: test() on an empty request");
    if (eng_->aborted())
      throw peer_error(fmt::format("shm: rank {}: the communicator was aborted ({}) while a {} "
                                   "rank {} was pending",
                                   rank_, eng_->abort_reason(),
                                   r.op_->is_send ? "send to" : "receive from", r.op_->peer),
                       -1);
    std::lock_guard lock(eng_->mutex());
    if (r.op_->state == detail::op::status::pending) eng_->progress();
    switch (r.op_->state) {
      case detail::op::status::done:
        eng_->free_op(std::exchange(r.op_, nullptr));
        r.done_ = true;
        return true;
      case detail::op::status::failed: {
        detail::op* o = std::exchange(r.op_, nullptr);
        std::string why = std::move(o->error);
        const bool dead = eng_->peer_gone(o->peer);
        const int peer = o->peer;
        eng_->free_op(o);
        if (dead) throw peer_error(why, peer);
        throw transport_error(why);
      }
      case detail::op::status::pending:
        break;
    }
    // Liveness costs a /proc read: look at most every few milliseconds of waiting.
    if ((++idle_polls_ & 255u) == 0) {
      const auto now = std::chrono::steady_clock::now();
      if (now - last_liveness_ > std::chrono::milliseconds(5)) {
        last_liveness_ = now;
        if (const int peer = eng_->find_gone(r.op_->peer); peer >= 0) {
          // The peer may have written the rest of this message just before it died: take
          // that before blaming it.
          eng_->progress();
          if (r.op_->state == detail::op::status::done) {
            eng_->free_op(std::exchange(r.op_, nullptr));
            r.done_ = true;
            return true;
          }
          throw peer_error(eng_->dead_message(peer), peer);
        }
      }
    }
    return false;
  }

  void progress() {
    std::lock_guard lock(eng_->mutex());
    eng_->progress();
  }

  /// Fails every wait of this transport, in any thread, and every call after with peer_error
  /// carrying `why` (communicator::abort()). Thread-safe; the waits read a flag of this process
  /// where they already poll their deadline.
  void abort(const std::string& why) { eng_->abort(why); }
  /// The ranks whose process is stopped (SIGSTOP, a debugger): a wait that gives up names the
  /// first (communicator::stopped_rank()), as on libfabric.
  [[nodiscard]] std::vector<int> stopped_ranks() const { return eng_->stopped_peers(); }
  /// Why abort() was called, or nullopt if it was not.
  [[nodiscard]] std::optional<std::string> abort_reason() const {
    if (!eng_->aborted()) return std::nullopt;
    return eng_->abort_reason();
  }

  /// Throws peer_error naming `peer` if its process is gone or it closed its transport (a /proc
  /// read: for waits outside the message path, every few milliseconds).
  void check_alive(int peer) {
    std::lock_guard lock(eng_->mutex());
    if (eng_->peer_gone(peer)) throw peer_error(eng_->dead_message(peer), peer);
  }

  /// Collective over every rank of the transport: n elements of T per rank, addressed by every
  /// rank (communicator::allocate).
  template <class T>
  [[nodiscard]] symmetric_buffer<T> allocate(std::size_t n) {
    return {allocate_memory(n * sizeof(T)), n};
  }

  /// Collective over every rank of the transport: `bytes` of memory per rank, in one mapping
  /// every rank addresses (symmetric memory, as ncclMemAlloc and a registered window give).
  [[nodiscard]] symmetric_memory allocate_memory(std::size_t bytes) {
    const std::size_t stride = detail::round_up(std::max<std::size_t>(bytes, 1), 4096);
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    const std::uint64_t tag = internal_tag | allocations_++;
    std::shared_ptr<detail::mapping> m;
    std::array<char, 256> name{};
    if (rank_ == 0) {
      m = std::make_shared<detail::mapping>(
          detail::mapping::create(stride * static_cast<std::size_t>(size_)));
      std::memcpy(name.data(), m->name().c_str(), std::min(name.size() - 1, m->name().size()));
      std::vector<request> sent;
      for (int r = 1; r < size_; ++r)
        sent.push_back(isend(r, tag, std::as_bytes(std::span<const char>(name))));
      for (std::size_t i = 0; i < sent.size(); ++i)
        wait(sent[i], deadline, "symmetric allocation", static_cast<int>(i) + 1);
      // Every other rank answers once it mapped the memory; then the name can go.
      std::vector<std::byte> acks(static_cast<std::size_t>(size_));
      std::vector<request> got;
      for (int r = 1; r < size_; ++r)
        got.push_back(irecv(r, tag, std::span<std::byte>(&acks[static_cast<std::size_t>(r)], 1)));
      try {
        for (std::size_t i = 0; i < got.size(); ++i)
          wait(got[i], deadline, "symmetric allocation", static_cast<int>(i) + 1);
      } catch (...) {
        m->unlink();
        throw;
      }
      m->unlink();
    } else {
      auto q = irecv(0, tag, std::as_writable_bytes(std::span<char>(name)));
      wait(q, deadline, "symmetric allocation", 0);
      name.back() = '\0';
      m = std::make_shared<detail::mapping>(
          detail::mapping::open(name.data(), stride * static_cast<std::size_t>(size_)));
      const std::byte ack{1};
      auto a = isend(0, tag, std::span<const std::byte>(&ack, 1));
      wait(a, deadline, "symmetric allocation", 0);
    }
    std::erase_if(allocations_live_, [](const auto& w) { return w.expired(); });
    allocations_live_.push_back(m);
    return {std::move(m), bytes, stride, rank_, size_};
  }

  /// Where rank `peer` holds the byte that p addresses in this rank's part of a live symmetric
  /// allocation; nullptr if p is not in one. How a collective finds a peer's copy of a
  /// symmetric buffer.
  [[nodiscard]] std::byte* peer_address(const void* p, int peer) const {
    const auto* b = static_cast<const std::byte*>(p);
    for (const auto& w : allocations_live_) {
      const auto m = w.lock();
      if (!m) continue;
      const std::size_t stride = m->size() / static_cast<std::size_t>(size_);
      const std::byte* mine = m->data() + static_cast<std::size_t>(rank_) * stride;
      if (b >= mine && b < mine + stride)
        return m->data() + static_cast<std::size_t>(peer) * stride +
               static_cast<std::size_t>(b - mine);
    }
    return nullptr;
  }

  /// Blocks on q, a message exchanged with `peer`, until it completes or the deadline passes
  /// (spinning, then yielding); the timeout names the peer that never answered.
  void wait(request& q, std::chrono::steady_clock::time_point deadline, std::string_view what,
            int peer) {
    eng_->check_aborted(what);
    ringzero::detail::backoff b = ringzero::detail::backoff_for(size_);
    while (!test(q)) {
      if (std::chrono::steady_clock::now() > deadline) {
        const std::string text =
            fmt::format("shm: {} on rank {} timed out after {:g} s waiting for rank {}", what,
                        rank_, std::chrono::duration<double>(timeout_).count(), peer);
        // The rank waited for may only be waiting on a stopped one: that one is the culprit.
        if (const auto stopped = stopped_ranks(); !stopped.empty())
          throw timeout_error(
              fmt::format("{}; rank {} is stopped (SIGSTOP or a debugger)", text, stopped.front()),
              stopped.front());
        throw timeout_error(text, peer);
      }
      b.pause();
    }
  }

  /// Runs a validated call of a world communicator (ranks are the transport's) in the segment
  /// and returns true where that path applies: all_reduce up to
  /// segment_options::all_reduce_segment_bytes (unbounded by default), broadcast, all_gather and
  /// reduce_scatter up to segment_options::segment_bytes, all_to_all up to
  /// segment_options::all_to_all_segment_bytes, all_reduce of any size on symmetric
  /// buffers (read in place from detail::symmetric_min_bytes up), all_gather and all_to_all of
  /// any size from segment_options::cross_memory_bytes per block (read across processes),
  /// barrier. False leaves the call to ringzero's algorithms over messages. The decision depends
  /// only on what every rank passes alike (kind, size, whether the buffers are symmetric), so all
  /// ranks take the same path.
  [[nodiscard]] bool try_native(const native_call& c, const ringzero::options& opt) {
    if (size_ == 1) return false;
    if (c.reproducible && !runs_reproducible(c)) return false;
    // Only what the kind uses: the fields it ignores may differ across ranks harmlessly.
    const collective_descriptor* d = builtin_collectives::find(c.kind);
    if (d == nullptr) return false;  // a collective of the caller's own: never a segment's
    const bool reduces = d->reduces;
    const bool barrier = c.kind == collective::barrier;
    detail::segment_call call{
        .what = d->name,
        .desc = {.kind = static_cast<std::uint8_t>(c.kind),
                 .type = barrier ? std::uint8_t{0} : static_cast<std::uint8_t>(c.type),
                 .reduction = reduces ? static_cast<std::uint8_t>(c.reduction) : std::uint8_t{0},
                 .symmetric = 0,
                 .exact = static_cast<std::uint8_t>(c.reproducible ? 1 : 0),
                 .root = d->rooted ? c.root : 0,
                 .count = barrier ? 0 : c.count},
        .sequence = c.sequence,
        .timeout = opt.timeout.count() > 0 ? opt.timeout : timeout_};
    if (barrier) {
      detail::barrier(workspace(), call);
      return true;
    }
    const auto divisor = static_cast<std::uint32_t>(c.reduction == op::avg ? size_ : 1);
    const bool ran = c.reproducible
                         ? run_segment<float>(c, call, detail::exact_float_sum{divisor})
                         : visit_dtype(c.type, [&]<class E>(E) {
                             return run_segment<E>(
                                 c, call, detail::in_rank_order<E>{c.reduction, c.one_phase_bytes});
                           });
    if (ran) segment_phases_ = call.step;
    return ran;
  }

  /// Whether try_native runs `c`, a call with options::reproducible: a float sum or average,
  /// all_reduce up to segment_options::all_reduce_segment_bytes (or on symmetric buffers) and
  /// reduce_scatter up to segment_options::segment_bytes, as the plain calls; the segment then
  /// sums each element's terms exactly where they meet (detail::exact_float_sum).
  [[nodiscard]] bool runs_reproducible(const native_call& c) const {
    return size_ > 1 && c.type == dtype::float32 &&
           (c.reduction == op::sum || c.reduction == op::avg) && segment_reduces<float>(c);
  }

 private:
  // join() after its checks; `seg` is the caller's, so that it can remove the name on failure.
  template <class Comm>
  [[nodiscard]] static std::optional<transport> join_over(Comm& node, bool use, const options& opt,
                                                          std::chrono::nanoseconds timeout,
                                                          detail::mapping& seg) {
    const int rank = node.rank();
    const int size = node.size();
    std::array<char, 256> where{};
    std::string failure;
    ringzero::detail::exchange<Comm> ex(node, "shm setup", "direct", timeout);
    std::vector<typename ringzero::detail::exchange<Comm>::pending> ps;
    if (rank == 0) {
      if (use) {
        try {
          seg = create_segment(size, opt.segment);
          const std::string text = fmt::format("{} {}", seg.name(), seg.size());
          std::memcpy(where.data(), text.data(), std::min(text.size(), where.size() - 1));
        } catch (const transport_error& e) {
          failure = e.what();
        }
      }
      for (int r = 1; r < size; ++r)
        ps.push_back(ex.send(r, 0, 0, std::as_bytes(std::span<const char>(where))));
    } else {
      ps.push_back(ex.recv(0, 0, 0, std::as_writable_bytes(std::span<char>(where))));
    }
    ex.wait_all(ps);
    ps.clear();
    where.back() = '\0';
    if (rank != 0 && use && where[0] != '\0') {
      try {
        seg = open_segment(where.data(), size);
      } catch (const transport_error& e) {
        failure = e.what();
      }
    }
    // Rank 0 gathers who mapped it and tells everyone the verdict, so all ranks decide alike.
    std::vector<std::uint8_t> mapped(static_cast<std::size_t>(size), 0);
    mapped[static_cast<std::size_t>(rank)] = seg.data() != nullptr ? 1 : 0;
    std::uint8_t verdict = 0;
    if (rank == 0) {
      for (int r = 1; r < size; ++r)
        ps.push_back(ex.recv(
            r, 1, 0, std::as_writable_bytes(std::span(&mapped[static_cast<std::size_t>(r)], 1))));
      ex.wait_all(ps);
      ps.clear();
      verdict = std::all_of(mapped.begin(), mapped.end(), [](std::uint8_t m) { return m != 0; });
      for (int r = 1; r < size; ++r)
        ps.push_back(ex.send(r, 2, 0, std::as_bytes(std::span(&verdict, 1))));
    } else {
      ps.push_back(
          ex.send(0, 1, 0, std::as_bytes(std::span(&mapped[static_cast<std::size_t>(rank)], 1))));
      ps.push_back(ex.recv(0, 2, 0, std::as_writable_bytes(std::span(&verdict, 1))));
    }
    ex.wait_all(ps);
    if (!verdict) {
      seg.unlink();
      if (!failure.empty())
        log::warn(
            "shm: rank {} of the node cannot share memory with the others ({}); the node "
            "keeps the messaging transport",
            rank, failure);
      return std::nullopt;
    }
    return transport(std::move(seg), rank, size, timeout, opt);
  }

  static void check_options(const options& opt) {
    ringzero::tuning::check(opt.tuning, "shm transport");
    const segment_options& t = opt.segment;
    if (t.slots < 2 || t.slot_bytes < 2 * detail::cache_line ||
        t.slot_bytes % detail::cache_line != 0 || t.slot_bytes > (std::size_t{1} << 30))
      throw invalid_argument(fmt::format(
          "shm transport: {} slots of {} bytes: need at least 2 slots of a multiple of 64 bytes, "
          "at least 128",
          t.slots, t.slot_bytes));
  }

  // The second half of construction, once this rank mapped the segment.
  transport(detail::mapping seg, int rank, int size, std::chrono::nanoseconds timeout,
            const options& opt)
      : rank_(rank),
        size_(size),
        timeout_(timeout),
        segment_(opt.segment),
        tuning_(opt.tuning),
        host_(log::detail::host_name()),
        cross_memory_(cross_memory_from_env()) {
    attach(std::move(seg), std::chrono::steady_clock::now() + timeout_);
  }

  /// RINGZERO_SHM_CMA: 0 keeps all_reduce, all_gather and all_to_all off cross-memory attach
  /// (segment_options::cross_memory_bytes, cross_memory_all_reduce_bytes). On, it lets the
  /// job's other processes read this one's memory where Yama restricts that to ancestors
  /// (kernel.yama.ptrace_scope = 1, Ubuntu's default; ranks are siblings), as Open MPI's vader
  /// does: any process of this user may then, which scope 0 allows anyway.
  [[nodiscard]] static bool cross_memory_from_env() {
    const auto v = ringzero::detail::getenv_int("RINGZERO_SHM_CMA");
    const bool on = !v || *v != 0;
    if (on) {
      std::ifstream scope("/proc/sys/kernel/yama/ptrace_scope");
      int level = 0;
      if (scope >> level && level == 1)
        static_cast<void>(::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY));
    }
    return on;
  }

  [[nodiscard]] static detail::mapping create_segment(int size, const segment_options& geometry) {
    const detail::layout l{static_cast<std::size_t>(size), geometry.slots, geometry.slot_bytes};
    detail::mapping seg = detail::mapping::create(l.bytes());
    auto* h = reinterpret_cast<detail::segment_header*>(seg.data());
    h->ranks = static_cast<std::uint32_t>(size);
    h->slots = static_cast<std::uint32_t>(geometry.slots);
    h->slot_bytes = geometry.slot_bytes;
    h->bytes = l.bytes();
    h->magic = detail::segment_magic;
    return seg;
  }

  /// `where`: "name bytes", as rank 0 publishes it.
  [[nodiscard]] static detail::mapping open_segment(std::string_view where, int size) {
    const auto space = where.find(' ');
    if (space == std::string_view::npos)
      throw transport_error(fmt::format("shm: '{}' does not name a segment", where));
    detail::mapping seg = detail::mapping::open(std::string(where.substr(0, space)),
                                                std::stoull(std::string(where.substr(space + 1))));
    const auto* h = reinterpret_cast<const detail::segment_header*>(seg.data());
    if (h->magic != detail::segment_magic || h->ranks != static_cast<std::uint32_t>(size))
      throw transport_error(
          fmt::format("shm: segment {} is not a {}-rank ringzero segment", seg.name(), size));
    return seg;
  }

  // Publishes this rank in the mapped segment and waits, until `deadline`, for every rank to
  // have mapped it; the last one to map it removes its name.
  void attach(detail::mapping seg, std::chrono::steady_clock::time_point deadline) {
    eng_ = std::make_shared<detail::engine>(std::move(seg), rank_, size_);
    auto& me = eng_->record(rank_);
    const detail::process_id self = detail::self_process();
    me.pid.store(self.pid, std::memory_order_relaxed);
    me.start.store(self.start, std::memory_order_relaxed);
    me.state.store(detail::rank_running, std::memory_order_release);
    // From the last mapping on, the segment disappears with the last process that maps it,
    // however the processes end.
    auto& mapped = eng_->header()->mapped;
    if (mapped.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<std::uint32_t>(size_))
      eng_->unlink_segment();
    ringzero::detail::backoff b;
    while (mapped.load(std::memory_order_acquire) < static_cast<std::uint32_t>(size_)) {
      if (std::chrono::steady_clock::now() > deadline) {
        eng_->unlink_segment();
        throw timeout_error(
            fmt::format("shm: only {} of {} ranks mapped the segment within {:g} s", mapped.load(),
                        size_, std::chrono::duration<double>(timeout_).count()),
            -1);
      }
      b.pause();
    }
    log::info("shm: rank {} of {}, {} slots of {} bytes per pair of ranks", rank_, size_,
              eng_->geometry().slots, eng_->geometry().slot_bytes);
  }

  /// Whether run_segment runs `c`, an all_reduce (on symmetric buffers, or up to
  /// segment_options::all_reduce_segment_bytes) or a reduce_scatter (up to
  /// segment_options::segment_bytes); false for the other kinds. runs_reproducible asks it ahead.
  template <element E>
  [[nodiscard]] bool segment_reduces(const native_call& c) const {
    if (c.kind == collective::all_reduce)
      // The size first: it is unbounded by default, and the symmetric test scans allocations.
      return c.count * sizeof(E) <= segment_.all_reduce_segment_bytes || symmetric_call<E>(c);
    if (c.kind == collective::reduce_scatter)
      return c.count * static_cast<std::size_t>(size_) * sizeof(E) <= segment_.segment_bytes;
    return false;
  }

  /// Whether an all_reduce's buffers are both symmetric memory, read and written in place.
  template <element E>
  [[nodiscard]] bool symmetric_call(const native_call& c) const {
    const auto* in = static_cast<const E*>(c.in);
    const auto* out = static_cast<const E*>(c.out);
    return c.count * sizeof(E) >= detail::symmetric_min_bytes && peer_address(in, 0) &&
           peer_address(out, 0) && peer_address(in + c.count - 1, 0) &&
           peer_address(out + c.count - 1, 0);
  }

  /// `combine`: how the ranks' contributions to an all_reduce or reduce_scatter combine
  /// (detail::in_rank_order or detail::exact_float_sum).
  template <element E, class Combine>
  [[nodiscard]] bool run_segment(const native_call& c, detail::segment_call& call,
                                 const Combine& combine) {
    const auto n = static_cast<std::size_t>(size_);
    const auto* in = static_cast<const E*>(c.in);
    auto* out = static_cast<E*>(c.out);
    switch (c.kind) {
      case collective::all_reduce:
        if (symmetric_call<E>(c)) {
          call.desc.symmetric = 1;
          detail::all_reduce_symmetric<E>(
              workspace(), [&](int q) { return reinterpret_cast<const E*>(peer_address(in, q)); },
              [&](int q) { return reinterpret_cast<E*>(peer_address(out, q)); }, c.count, combine,
              call);
          return true;
        }
        if constexpr (std::is_same_v<Combine, detail::in_rank_order<E>>)
          if (reduce_across_processes<E>(c, call, combine)) return true;
        if (!segment_reduces<E>(c)) return false;
        detail::all_reduce<E>(workspace(), std::span<const E>(in, c.count),
                              std::span<E>(out, c.count), combine, call);
        return true;
      case collective::broadcast:
        if (c.count * sizeof(E) > segment_.segment_bytes) return false;
        detail::broadcast<E>(
            workspace(),
            std::span<const E>(rank_ == c.root ? in : nullptr, rank_ == c.root ? c.count : 0),
            std::span<E>(out, c.count), c.root, call);
        return true;
      case collective::all_gather:
        if (across_processes(reinterpret_cast<const std::byte*>(in), 0, c.count * sizeof(E),
                             reinterpret_cast<std::byte*>(out), call))
          return true;
        if (c.count * n * sizeof(E) > segment_.segment_bytes) return false;
        detail::all_gather<E>(workspace(), std::span<const E>(in, c.count),
                              std::span<E>(out, c.count * n), call);
        return true;
      case collective::reduce_scatter:
        if (!segment_reduces<E>(c)) return false;
        detail::reduce_scatter<E>(workspace(), std::span<const E>(in, c.count * n),
                                  std::span<E>(out, c.count), combine, call);
        return true;
      case collective::all_to_all: {
        // In place, a peer would read this rank's slices while this rank overwrites them with
        // its own reads: it publishes a copy instead (the other ranks cannot tell).
        const std::size_t block = c.count * sizeof(E);
        const auto* base = reinterpret_cast<const std::byte*>(in);
        if (cross_memory_ && block >= segment_.cross_memory_bytes &&
            static_cast<const void*>(in) == static_cast<const void*>(out)) {
          staged_.assign(base, base + block * n);
          base = staged_.data();
        }
        if (across_processes(base, block, block, reinterpret_cast<std::byte*>(out), call))
          return true;
        if (c.count * n * sizeof(E) > segment_.all_to_all_segment_bytes) return false;
        detail::all_to_all<E>(workspace(), std::span<const E>(in, c.count * n),
                              std::span<E>(out, c.count * n), call);
        return true;
      }
      default:
        return false;
    }
  }

  /// all_gather and all_to_all by cross-memory attach (detail::exchange_across_processes) where
  /// it is on and the blocks are large enough: true when the call ran so. False leaves it to
  /// the other paths: below the threshold, or when some rank's reads were refused, in which
  /// case this call and every later one take them (decided alike on every rank).
  [[nodiscard]] bool across_processes(const std::byte* base, std::size_t stride, std::size_t block,
                                      std::byte* out, detail::segment_call& call) {
    if (!cross_memory_ || block < segment_.cross_memory_bytes) return false;
    // Ranks that differ here (RINGZERO_SHM_CMA, segment_options) differ in the call's
    // descriptor, so they fail alike at its first phase instead of waiting on each other.
    call.desc.symmetric = detail::path_cross_memory;
    detail::cross_memory_failure failed;
    if (detail::exchange_across_processes(workspace(), base, stride, block, out, call, failed))
      return true;
    cross_memory_ = false;
    throw_if_dead(failed, call);
    log::warn(
        "shm: rank {} could not read rank {}'s input across processes ({}); all_gather and "
        "all_to_all take the shared segment and messages from now on (RINGZERO_SHM_CMA=0 "
        "skips the attempt)",
        failed.rank, failed.peer, std::strerror(failed.error));
    return false;
  }

  /// A read across processes that found its peer gone: the engine's words for a dead peer, as
  /// every other wait of this transport says them, and where this rank found out. Other
  /// failures are the caller's to handle.
  void throw_if_dead(const detail::cross_memory_failure& failed,
                     const detail::segment_call& call) const {
    if (failed.error != ESRCH) return;
    throw peer_error(fmt::format("{} (shm {}: rank {} found no process of it when it read "
                                 "across processes)",
                                 eng_->dead_message(failed.peer), call.what, failed.rank),
                     failed.peer);
  }

  /// all_reduce by cross-memory attach (detail::all_reduce_across_processes) where it is on and
  /// the call large enough: true when the call ran so. The first such call makes sure the
  /// kernel allows the reads (probe_cross_memory), since a failure in the middle of an in-place
  /// call leaves buffers no other path can start from; a failure after that is an error.
  template <element E, class Combine>
  [[nodiscard]] bool reduce_across_processes(const native_call& c, detail::segment_call& call,
                                             const Combine& combine) {
    if (!cross_memory_ || size_ < 2 || c.count * sizeof(E) < segment_.cross_memory_all_reduce_bytes)
      return false;
    call.desc.symmetric = detail::path_cross_memory;
    if (!probe_cross_memory(call)) {
      call.desc.symmetric = detail::path_segment;
      return false;
    }
    detail::cross_memory_failure failed;
    if (detail::all_reduce_across_processes<E>(workspace(), static_cast<const E*>(c.in),
                                               static_cast<E*>(c.out), c.count, combine, call,
                                               failed))
      return true;
    cross_memory_ = false;
    throw_if_dead(failed, call);
    throw transport_error(fmt::format(
        "shm {}: rank {} could not read rank {}'s buffers across processes ({}); the output is "
        "incomplete (RINGZERO_SHM_CMA=0 keeps all_reduce in the shared segment)",
        call.what, failed.rank, failed.peer, std::strerror(failed.error)));
  }

  /// Whether the ranks can read each other's memory (process_vm_readv), found out once on
  /// every rank alike: each reads a word from every peer. Where the kernel refuses (EPERM
  /// under a restrictive ptrace scope or seccomp profile, ENOSYS), warns once and turns
  /// cross-memory attach off for every collective.
  [[nodiscard]] bool probe_cross_memory(detail::segment_call& call) {
    if (cross_memory_probed_) return cross_memory_;
    cross_memory_probed_ = true;
    const std::uint64_t word = 0x72696e677a65726full;  // "ringzero"
    std::vector<std::byte> words(sizeof word * static_cast<std::size_t>(size_));
    detail::cross_memory_failure failed;
    if (detail::exchange_across_processes(workspace(), reinterpret_cast<const std::byte*>(&word), 0,
                                          sizeof word, words.data(), call, failed))
      return true;
    cross_memory_ = false;
    throw_if_dead(failed, call);
    log::warn(
        "shm: rank {} could not read rank {}'s memory across processes ({}); collectives take "
        "the shared segment and messages from now on (RINGZERO_SHM_CMA=0 skips the attempt)",
        failed.rank, failed.peer, std::strerror(failed.error));
    return false;
  }

  /// The segment collectives' workspace, allocated (collectively) by the first of them.
  [[nodiscard]] shm::workspace& workspace() {
    if (!ws_)
      ws_ = std::make_unique<shm::workspace>(
          eng_, allocate_memory(shm::workspace::bytes_for(segment_.workspace_bytes)),
          segment_.workspace_bytes, segment_.streaming_bytes);
    return *ws_;
  }

  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= size_ || peer == rank_)
      throw invalid_argument(fmt::format(
          "shm {}: peer {} is not another rank of this {}-rank transport (this is rank {})", what,
          peer, size_, rank_));
  }

  int rank_ = 0;
  int size_ = 1;
  std::chrono::nanoseconds timeout_{0};
  segment_options segment_{};
  ringzero::tuning::policy tuning_{};
  std::string host_;
  std::shared_ptr<detail::engine> eng_;
  std::unique_ptr<shm::workspace> ws_;
  /// Whether all_gather and all_to_all may read peers' inputs across processes
  /// (segment_options::cross_memory_bytes).
  bool cross_memory_ = true;
  bool cross_memory_probed_ = false;  ///< probe_cross_memory ran
  /// An in-place all_to_all's input, published in its place (across_processes); kept between
  /// calls, so that its pages are not faulted in again each time.
  std::vector<std::byte> staged_;
  std::uint64_t allocations_ = 0;
  std::vector<std::weak_ptr<detail::mapping>> allocations_live_;
  unsigned idle_polls_ = 0;
  int segment_phases_ = 0;
  std::chrono::steady_clock::time_point last_liveness_{};
};

}  // namespace ringzero::shm
