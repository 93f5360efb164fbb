// The shm transport's messaging and setup: ranks as processes on one host, talking through one
// shared-memory segment (header-only, POSIX only: shm_open, mmap, /proc). Small messages are a
// cache line the receiver polls; larger ones stream through a ring of slots per pair of ranks; no
// syscall on the message path and no lock shared between processes, so a rank killed at any
// instant can only make the others fail (peer_error naming it), never hang.
//
// The class is messaging (send, receive, test, progress), its tuning policy and host names, and
// two capabilities the communicator uses where they apply, each a part of its own: symmetric
// memory (shm/detail/heap.hpp: comm.allocate<T>(n), a buffer every rank of the node addresses)
// and collectives run in the segment itself (shm/detail/segment_collectives.hpp: try_native(),
// transport/native.hpp), some reading across processes (shm/detail/cross_memory.hpp). The
// segment's setup is shm/detail/setup.hpp's. ringzero/transport/shm.hpp gives the communicator.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ringzero/base.hpp"
#include "ringzero/bootstrap/environment.hpp"
#include "ringzero/bootstrap/rendezvous.hpp"
#include "ringzero/bootstrap/store.hpp"
#include "ringzero/detail/backoff.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/request.hpp"
#include "ringzero/transport/shm/detail/engine.hpp"
#include "ringzero/transport/shm/detail/heap.hpp"
#include "ringzero/transport/shm/detail/segment.hpp"
#include "ringzero/transport/shm/detail/segment_collectives.hpp"
#include "ringzero/transport/shm/detail/setup.hpp"
#include "ringzero/transport/shm/options.hpp"
#include "ringzero/transport/shm/symmetric.hpp"
#include "ringzero/transport/shm/workspace.hpp"
#include "ringzero/tuning/policy.hpp"

namespace ringzero::shm {

class transport : public detail::segment_collectives<transport>,
                  public detail::symmetric_heap<transport> {
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
        host_(log::detail::host_name()) {
    if (size < 1 || rank < 0 || rank >= size)
      throw invalid_argument(fmt::format("shm transport: rank {} is not in [0, {})", rank, size));
    detail::check_options(opt);
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
      seg = detail::create_segment(size, segment_);
      store.set_string(key("segment", 0), fmt::format("{} {}", seg.name(), seg.size()));
    } else {
      seg = detail::open_segment(store.get_string(key("segment", 0)), size);
    }
    eng_ = detail::attach(std::move(seg), rank_, size_, deadline, timeout_);
  }

  /// Collective over the ranks of a node (the hierarchical algorithm's node level under
  /// libfabric and sockets), over another communicator's messages: `node` says its rank and
  /// size, its deadline (timeout()), shares rank 0's bytes with every rank (share(span<char>))
  /// and tells every rank whether all passed true (every(bool)); communicator::nodes() passes
  /// its node communicator's (detail::node_messages). Rank 0 creates the segment and names it
  /// to the others. Returns nullopt on every rank alike when a rank passes use = false or
  /// cannot map the segment (hosts that share a name but not /dev/shm), so that the caller
  /// keeps its own messaging for the node.
  template <class Node>
  [[nodiscard]] static std::optional<transport> join(Node& node, bool use,
                                                     const options& opt = {}) {
    detail::check_options(opt);
    const auto timeout =
        opt.timeout.count() > 0 ? opt.timeout : std::chrono::nanoseconds(node.timeout());
    const int rank = node.rank();
    const int size = node.size();
    detail::mapping seg;
    try {
      std::array<char, 256> where{};
      std::string failure;
      if (rank == 0 && use) {
        try {
          seg = detail::create_segment(size, opt.segment);
          const std::string text = fmt::format("{} {}", seg.name(), seg.size());
          std::memcpy(where.data(), text.data(), std::min(text.size(), where.size() - 1));
        } catch (const transport_error& e) {
          failure = e.what();
        }
      }
      node.share(std::span<char>(where));
      where.back() = '\0';
      if (rank != 0 && use && where[0] != '\0') {
        try {
          seg = detail::open_segment(where.data(), size);
        } catch (const transport_error& e) {
          failure = e.what();
        }
      }
      // Every rank learns whether all of them mapped it, so all decide alike.
      if (!node.every(seg.data() != nullptr)) {
        seg.unlink();
        if (!failure.empty())
          log::warn(
              "shm: rank {} of the node cannot share memory with the others ({}); the node "
              "keeps the messaging transport",
              rank, failure);
        return std::nullopt;
      }
      return transport(std::move(seg), rank, size, timeout, opt);
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

 private:
  friend class detail::segment_collectives<transport>;
  friend class detail::cross_memory_reads<transport>;
  friend class detail::symmetric_heap<transport>;

  // The second half of construction, once this rank mapped the segment.
  transport(detail::mapping seg, int rank, int size, std::chrono::nanoseconds timeout,
            const options& opt)
      : rank_(rank),
        size_(size),
        timeout_(timeout),
        segment_(opt.segment),
        tuning_(opt.tuning),
        host_(log::detail::host_name()) {
    eng_ = detail::attach(std::move(seg), rank_, size_, std::chrono::steady_clock::now() + timeout_,
                          timeout_);
  }

  [[nodiscard]] detail::engine& engine() const noexcept { return *eng_; }
  [[nodiscard]] const std::shared_ptr<detail::engine>& engine_ptr() const noexcept { return eng_; }

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
  unsigned idle_polls_ = 0;
  std::chrono::steady_clock::time_point last_liveness_{};
};

}  // namespace ringzero::shm
