// The operation engine of the libfabric transport, shared by a communicator and every
// sub-communicator split from it: the operations' pool, their flow control (a queue per rail
// and direction), posting, completions, cancellation, the deadline's watchdog, abort and the
// diagnostics when a wait gives up. The provider calls themselves are the rails' (rail.hpp): one
// rail per NIC, each with its own domain, endpoint, address vector and registrations. A message
// below config::stripe_bytes goes over one rail, chosen from its tag (rail_for); a larger one is
// cut into one piece per rail, sized in proportion to the two ends' link speeds (stripe), each
// piece sent with the message's tag on its rail. Both choices are functions of what both ends
// know (the tag, the length, the speeds exchanged at connect), so sender and receiver place
// every byte alike without talking, and messages with one (peer, tag) keep their order on every
// rail; adding a NIC is opening another rail, and nothing here changes.
//
// What every provider needs from the engine, whatever the rail:
//   - -FI_EAGAIN on a post: the completion queues are read (which is what frees provider
//     resources under manual progress) and the post retried until the deadline;
//   - data progress is manual: test() and progress() read every rail's completion queue.
#pragma once

#include <fmt/core.h>
#include <rdma/fi_errno.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/abort_state.hpp"
#include "ringzero/transport/detail/pending_report.hpp"
#include "ringzero/transport/libfabric/error.hpp"
#include "ringzero/transport/libfabric/mr_cache.hpp"
#include "ringzero/transport/libfabric/rail.hpp"
#include "ringzero/transport/libfabric/watchdog.hpp"

namespace ringzero::libfabric::detail {

/// The engine's own limits, named once.
struct engine_limits {
  /// How long a cancelled send may take to leave: a send the provider cannot cancel is usually
  /// already on the wire and completes within microseconds; one that has not after 10 ms
  /// will not, and its buffer is kept instead (the communicator outlives it).
  static constexpr std::chrono::nanoseconds cancel_send_grace{10'000'000};
  /// How long submit() drives progress for the first queued operation before returning it to
  /// the caller's own wait loop: long enough to post behind a momentarily full queue, short
  /// enough that the caller's deadline is looked at again.
  static constexpr std::chrono::milliseconds post_progress_window{100};
  /// Completions read per fi_cq_read: one cache-friendly batch; the loop reads until fewer.
  static constexpr std::size_t completion_batch = 16;
  /// Rails one engine drives: op_context::rail is a byte, and a host has far fewer NICs.
  static constexpr std::size_t max_rails = 32;
  /// A striped message's pieces start at multiples of this: a cache line, so that no two
  /// rails' copies write into one line, and small enough that pieces stay in proportion for
  /// the smallest striped message.
  static constexpr std::size_t piece_alignment = 64;
};

class engine {
 public:
  struct config {
    std::string provider;  ///< empty: libfabric's first choice under FI_PROVIDER
    /// One rail per entry, each the NIC the provider names as a domain (tcp: an interface, efa:
    /// a device); empty: one rail on the provider's best candidate.
    std::vector<std::string> rails{};
    bool register_always = false;
    bool one_host = true;  ///< every rank on this host: loopback addresses will do
    std::chrono::nanoseconds timeout{std::chrono::seconds(300)};
    /// Ask for FI_HMEM: the caller will pass CUDA device buffers (register_device).
    bool device_memory = false;
    /// With several rails, messages of at least this many bytes are striped over all of them;
    /// must be alike on every rank (connect() checks).
    std::size_t stripe_bytes = SIZE_MAX;
    /// Pieces in proportion to the rails' link speeds (rail::link_mbps, the lower of the two
    /// ends'); false, or a speed unknown at either end: equal pieces.
    bool weigh_rails = true;
  };

  explicit engine(const config& cfg)
      : timeout_(cfg.timeout), stripe_bytes_(cfg.stripe_bytes), weigh_rails_(cfg.weigh_rails) {
    if (cfg.rails.size() > engine_limits::max_rails)
      throw invalid_argument(fmt::format("{} rails asked for; a libfabric engine drives at most {}",
                                         cfg.rails.size(), engine_limits::max_rails));
    const auto open = [&](std::string domain) {
      rails_.push_back(std::make_unique<rail>(rail::config{.provider = cfg.provider,
                                                           .domain = std::move(domain),
                                                           .register_always = cfg.register_always,
                                                           .one_host = cfg.one_host,
                                                           .device_memory = cfg.device_memory}));
    };
    if (cfg.rails.empty()) open({});
    for (const auto& d : cfg.rails) open(d);
    lanes_.resize(rails_.size());
    const rail& first = *rails_.front();
    for (const auto& r : rails_) {
      if (r->provider() != first.provider())
        throw invalid_argument(fmt::format(
            "libfabric rails on different providers ({} on {}, {} on {}): a job's rails share one",
            first.provider(), first.domain_name(), r->provider(), r->domain_name()));
      tag_width_ = std::min(tag_width_, r->tag_width());
      max_msg_size_ = std::min(max_msg_size_, r->max_message_size());
      hmem_ = hmem_ && r->hmem();
    }
  }

  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  ~engine() {
    if (held_ > 0) {
      // Operations the provider never gave back (abandoned after a failure) still point into
      // buffers the caller has likely freed, and at a peer that may never answer: closing the
      // endpoint then makes the provider finish them, and ofi_rxm, tearing down a rendezvous
      // with a stopped peer, read a context of its own it had already freed (SIGSEGV in
      // fi_close). Nothing here drives progress any more, so the provider's objects and the
      // contexts it holds are left as they are, and only the names other processes could
      // still find (this process's /dev/shm regions) are removed: an engine that failed is
      // not closed, and its process is usually about to exit.
      log::info("libfabric: {} operation{} still held by provider {}: the endpoints are left open",
                held_, held_ == 1 ? "" : "s", provider());
      auto kept = std::make_unique<left_open>();
      for (auto& r : rails_) r->leave_open(*kept);
      kept->contexts = std::move(pool_);  // a deque moves its blocks: the addresses stay
      {
        std::lock_guard lock(left_open::mutex());
        left_open::all().push_back(std::move(kept));
      }
      remove_shm_regions(static_cast<long>(::getpid()));
      dog_.reset();
      return;
    }
    // Each rail's close is watched, briefly: a close that waits on a peer that stopped must not
    // hold the process past its deadline.
    for (auto& r : rails_)
      watched(
          dog_.get(), [&] { return r.reset(), 0; }, true);
    dog_.reset();
  }

  /// This engine's address: every rail's name, then the striping threshold and each rail's link
  /// speed (0 where unknown or not weighed), as connect() reads them back. It starts with a
  /// letter: the rendezvous marks a rank's failure with a control byte in its place.
  [[nodiscard]] std::vector<std::byte> name() const {
    std::vector<std::byte> out{name_mark};
    const auto put = [&](auto v) {
      const auto* b = reinterpret_cast<const std::byte*>(&v);
      out.insert(out.end(), b, b + sizeof v);
    };
    put(static_cast<std::uint32_t>(rails_.size()));
    for (const auto& r : rails_) {
      const auto n = r->name();
      put(static_cast<std::uint32_t>(n.size()));
      out.insert(out.end(), n.begin(), n.end());
    }
    put(static_cast<std::uint64_t>(stripe_bytes_));
    for (const auto& r : rails_) put(weigh_rails_ ? r->link_mbps() : std::uint64_t{0});
    return out;
  }

  /// Inserts every rank's names (index = world rank), each rail's into that rail.
  void connect(const std::vector<std::vector<std::byte>>& names) {
    std::vector<std::vector<std::vector<std::byte>>> per_rail(
        rails_.size(), std::vector<std::vector<std::byte>>(names.size()));
    shares_.clear();
    for (std::size_t r = 0; r < names.size(); ++r) {
      std::span<const std::byte> in(names[r]);
      if (in.empty() || in[0] != name_mark)
        throw transport_error(fmt::format("rank {}'s libfabric address is not an engine's", r));
      in = in.subspan(1);
      const auto get = [&](auto& v) {
        if (in.size() < sizeof v) return false;
        std::memcpy(&v, in.data(), sizeof v);
        in = in.subspan(sizeof v);
        return true;
      };
      std::uint32_t count = 0;
      if (!get(count))
        throw transport_error(fmt::format("rank {}'s libfabric address is truncated", r));
      if (count != rails_.size())
        throw invalid_argument(fmt::format(
            "rank {} opened {} libfabric rail{} and this rank {}: RINGZERO_RAILS must name as "
            "many NICs on every host",
            r, count, count == 1 ? "" : "s", rails_.size()));
      for (auto& rail_names : per_rail) {
        std::uint32_t len = 0;
        if (!get(len) || in.size() < len)
          throw transport_error(fmt::format("rank {}'s libfabric address is truncated", r));
        rail_names[r].assign(in.begin(), in.begin() + len);
        in = in.subspan(len);
      }
      std::uint64_t stripe = 0;
      std::vector<std::uint64_t> speeds(rails_.size());
      bool complete = get(stripe);
      for (auto& v : speeds) complete = complete && get(v);
      if (!complete)
        throw transport_error(fmt::format("rank {}'s libfabric address is truncated", r));
      if (rails_.size() > 1 && stripe != stripe_bytes_)
        throw invalid_argument(fmt::format(
            "rank {} stripes messages of {} bytes and more over its rails, this rank from {}: "
            "libfabric::options::stripe_bytes (RINGZERO_STRIPE_BYTES) must be alike on every rank",
            r, stripe, stripe_bytes_));
      // The lower of the two ends' speeds is what a rail carries between them; one unknown
      // anywhere and the rails count alike (weighing some by a guess would be worse).
      for (std::size_t i = 0; i < rails_.size(); ++i)
        speeds[i] = std::min(speeds[i], weigh_rails_ ? rails_[i]->link_mbps() : 0);
      if (std::find(speeds.begin(), speeds.end(), 0) != speeds.end())
        std::fill(speeds.begin(), speeds.end(), 1);
      shares_.push_back(std::move(speeds));
    }
    for (std::size_t i = 0; i < rails_.size(); ++i) rails_[i]->connect(per_rail[i]);
    failures_.assign(names.size(), std::string());
  }

  /// One piece of a striped message: the rail it travels on and the bytes it carries.
  struct piece {
    std::size_t rail = 0;
    std::size_t offset = 0;
    std::size_t length = 0;
  };

  /// How a striped message of `bytes` is cut: consecutive pieces in rail order, each rail's in
  /// proportion to its share (every share > 0), boundaries on piece_alignment; a rail whose
  /// piece rounds to nothing is skipped. A function of its arguments alone: both ends of a
  /// message compute it from the same length and the same agreed shares.
  [[nodiscard]] static std::vector<piece> stripe(std::size_t bytes,
                                                 std::span<const std::uint64_t> shares) {
    // bytes × a share's running sum can pass 64 bits (a 1 TiB message, shares in Mbit/s).
    __extension__ using u128 = unsigned __int128;
    std::vector<piece> out;
    u128 total = 0;
    for (const auto s : shares) total += s;
    u128 before = 0;
    std::size_t start = 0;
    for (std::size_t i = 0; i < shares.size(); ++i) {
      before += shares[i];
      std::size_t end = bytes;
      if (i + 1 < shares.size()) {
        end = static_cast<std::size_t>(u128{bytes} * before / total);
        end -= end % engine_limits::piece_alignment;
      }
      if (end > start) out.push_back({.rail = i, .offset = start, .length = end - start});
      start = std::max(start, end);
    }
    return out;
  }

  /// The shares a message to or from world rank `peer` is striped by, one per rail.
  [[nodiscard]] std::span<const std::uint64_t> shares(int peer) const {
    return shares_.at(static_cast<std::size_t>(peer));
  }
  [[nodiscard]] std::size_t stripe_bytes() const noexcept { return stripe_bytes_; }

  /// Starts the watchdog (watchdog.hpp) over the ranks in `peers` (index = world rank); with
  /// a `board`, the ranks agree through it on which rank failed first.
  void watch(int rank, std::vector<process_id> peers,
             std::shared_ptr<failure_board> board = nullptr) {
    watchdog::config cfg;
    cfg.rank = rank;
    cfg.peers = std::move(peers);
    cfg.timeout = timeout_;
    cfg.board = std::move(board);
    dog_ = std::make_unique<watchdog>(std::move(cfg));
  }

  /// The world rank the watchdog found dead, or -1.
  [[nodiscard]] int failed_rank() const noexcept { return dog_ ? dog_->failed_rank() : -1; }
  /// World ranks on this host the watchdog finds stopped (SIGSTOP, a debugger), or none.
  [[nodiscard]] std::vector<int> stopped_ranks() const {
    return dog_ ? dog_->stopped_ranks() : std::vector<int>{};
  }
  [[nodiscard]] const watchdog* dog() const noexcept { return dog_.get(); }

  /// Fails every operation waiting on this engine, now and from now on, with `why`. Safe to
  /// call from any thread, without waiting for a thread that is inside a call.
  void abort(const std::string& why) { abort_.set(why); }
  [[nodiscard]] bool aborted() const noexcept { return abort_.is_set(); }
  /// What abort() was given (empty until it was called).
  [[nodiscard]] std::string abort_reason() const { return abort_.reason(); }

  [[nodiscard]] const std::string& provider() const noexcept { return rails_.front()->provider(); }
  /// Tag bits above the algorithm's that every rail's provider matches: room for communicator
  /// ids.
  [[nodiscard]] int comm_id_bits() const noexcept {
    return std::min(tag_width_ - tag_bits, tag_layout::comm_id_bits);
  }
  [[nodiscard]] int tag_width() const noexcept { return tag_width_; }
  [[nodiscard]] std::uint64_t mr_mode() const noexcept { return rails_.front()->mr_mode(); }
  [[nodiscard]] std::size_t inject_size() const noexcept { return rails_.front()->inject_size(); }
  [[nodiscard]] std::size_t max_message_size() const noexcept { return max_msg_size_; }
  [[nodiscard]] bool registers() const noexcept { return rails_.front()->registers(); }
  /// Opened for device memory (config::device_memory) on a provider that reports FI_HMEM.
  /// Whether it can register CUDA memory in particular is known only once it tried: libfabric
  /// has no query for the HMEM interfaces it was built with.
  [[nodiscard]] bool hmem() const noexcept { return hmem_; }
  /// The provider registered CUDA memory at least once (register_device succeeded).
  [[nodiscard]] bool registered_cuda() const {
    std::lock_guard lock(mutex_);
    return registered_cuda_;
  }
  /// Device ranges declared (each rail registers every one in its own domain).
  [[nodiscard]] std::size_t device_ranges() const {
    std::lock_guard lock(mutex_);
    return rails_.front()->memory().device_ranges();
  }

  /// The rails, in the order config::rails named them, and the messages each has carried
  /// (sends and receives posted or injected): how a caller sees the traffic spread.
  [[nodiscard]] std::size_t rails() const noexcept { return rails_.size(); }
  [[nodiscard]] const std::string& rail_domain(std::size_t i) const {
    return rails_.at(i)->domain_name();
  }
  [[nodiscard]] std::uint64_t rail_messages(std::size_t i) const {
    std::lock_guard lock(mutex_);
    return lanes_.at(i).carried;
  }

  /// The rail a message with `tag` travels on: a mix of all its bits, so that the steps and
  /// chunks of one collective spread over the rails, and a function of the tag alone, so that
  /// sender and receiver agree and messages with one (peer, tag) stay in one rail's order.
  [[nodiscard]] static std::size_t rail_for(std::uint64_t tag, std::size_t rails) noexcept {
    if (rails <= 1) return 0;
    // splitmix64's finalizer: consecutive tags (chunk k, k+1) land on unrelated rails.
    tag ^= tag >> 30;
    tag *= 0xbf58476d1ce4e5b9ULL;
    tag ^= tag >> 27;
    tag *= 0x94d049bb133111ebULL;
    tag ^= tag >> 31;
    return static_cast<std::size_t>(tag % rails);
  }

  /// Registers [p, p+n) as memory of CUDA device `device` (fi_mr_regattr with FI_HMEM_CUDA) on
  /// every rail: sends and receives inside it then pass that registration to the provider.
  /// Throws unsupported when the engine was not opened for device memory or the provider
  /// refuses.
  void register_device(const void* p, std::size_t n, int device) {
    if (n == 0) return;
    if (device < 0)
      throw invalid_argument(fmt::format("CUDA device ordinal {} is negative", device));
    if (!hmem_)
      throw unsupported(
          fmt::format("libfabric provider '{}' was opened for host memory only: set "
                      "libfabric::options::device_memory to pass CUDA device buffers",
                      provider()));
    std::lock_guard lock(mutex_);
    for (std::size_t i = 0; i < rails_.size(); ++i) {
      try {
        rails_[i]->memory().register_device(p, n, device);
      } catch (...) {
        // All rails or none: a message placed on a rail without it would be refused later.
        for (std::size_t j = 0; j < i; ++j) rails_[j]->memory().forget(p, n);
        throw;
      }
    }
    registered_cuda_ = true;
  }
  [[nodiscard]] std::size_t registrations() const {
    std::lock_guard lock(mutex_);
    std::size_t n = 0;
    for (const auto& r : rails_) n += r->memory().size();
    return n;
  }
  void forget_memory(const void* p, std::size_t n) {
    std::lock_guard lock(mutex_);
    for (auto& r : rails_) r->memory().forget(p, n);
  }

  /// Posts a tagged send; nullptr when it was injected (complete on return). A send beyond
  /// the flow-control limit waits in the engine and is posted as earlier ones complete.
  [[nodiscard]] op_context* send(int world_peer, int peer, std::uint64_t tag,
                                 std::span<const std::byte> data) {
    std::lock_guard lock(mutex_);
    check_aborted();
    check_size(data.size(), peer, "send to");
    if (striping(data.size()))
      return post_striped(world_peer, peer, true, tag, const_cast<std::byte*>(data.data()),
                          data.size());
    const std::size_t ri = rail_for(tag, rails_.size());
    rail& r = *rails_[ri];
    // Injecting past queued sends could reorder two messages with one tag.
    if (r.inject_size() > 0 && data.size() <= r.inject_size() && lanes_[ri].sends.empty() &&
        !r.memory().is_device(data.data(), data.size())) {
      const ssize_t rc = watched(dog_.get(), [&] { return r.inject(world_peer, data, tag); });
      if (rc == 0) {
        ++lanes_[ri].carried;
        return nullptr;
      }
      if (rc != -FI_EAGAIN) throw post_failed("send to", peer, rc);
    }
    op_context* c = make(ri, world_peer, peer, true, data.size(), data.data());
    c->buffer = const_cast<std::byte*>(data.data());  // only read: fi_tsend takes const
    c->address = r.address(world_peer);
    c->tag = tag;
    submit(c);
    return c;
  }

  [[nodiscard]] op_context* recv(int world_peer, int peer, std::uint64_t tag,
                                 std::span<std::byte> data) {
    std::lock_guard lock(mutex_);
    check_aborted();
    check_size(data.size(), peer, "receive from");
    if (striping(data.size()))
      return post_striped(world_peer, peer, false, tag, data.data(), data.size());
    const std::size_t ri = rail_for(tag, rails_.size());
    op_context* c = make(ri, world_peer, peer, false, data.size(), data.data());
    c->buffer = data.data();
    c->address = rails_[ri]->address(world_peer);
    c->tag = tag;
    submit(c);
    return c;
  }

  /// Operations handed to the providers and not yet complete, and those waiting to be.
  [[nodiscard]] std::size_t posted_operations() const {
    std::lock_guard lock(mutex_);
    std::size_t n = 0;
    for (const auto& l : lanes_) n += l.posted_sends + l.posted_recvs;
    return n;
  }
  [[nodiscard]] std::size_t waiting_operations() const {
    std::lock_guard lock(mutex_);
    std::size_t n = 0;
    for (const auto& l : lanes_) n += l.sends.size() + l.recvs.size();
    return n;
  }
  /// How many sends (receives) the engine posts at once, over all its rails.
  [[nodiscard]] std::size_t send_limit() const noexcept {
    std::size_t n = 0;
    for (const auto& r : rails_) n += r->send_limit();
    return n;
  }
  [[nodiscard]] std::size_t receive_limit() const noexcept {
    std::size_t n = 0;
    for (const auto& r : rails_) n += r->receive_limit();
    return n;
  }
  /// Reads completions; true once c finished, and c is freed. When it throws, c is freed
  /// (or, if it could not be cancelled, left to the engine) too.
  [[nodiscard]] bool test(op_context* c) {
    std::lock_guard lock(mutex_);
    if (c->state == op_context::status::pending) progress_locked();
    switch (c->state) {
      case op_context::status::pending: {
        if (aborted()) {
          const int peer = c->peer;
          const bool is_send = c->is_send;
          abandon_locked(c);
          throw peer_error(fmt::format("the communicator was aborted ({}) while a {} rank {} was "
                                       "pending",
                                       abort_reason(), is_send ? "send to" : "receive from", peer),
                           -1);
        }
        // Waits on live ranks fail too: a collective with a dead member cannot finish. A
        // short delay first lets completions a rank sent just before it exited arrive.
        if (const int dead = failed_rank();
            dead >= 0 && dog_->failure_age_ms() >= settle_ms && dead != c->world_peer) {
          const int peer = c->peer;
          const bool is_send = c->is_send;
          abandon_locked(c);
          throw peer_error(fmt::format("rank {} died ({}); this rank was waiting for a {} rank {} "
                                       "over {}",
                                       dead, dog_->failure(), is_send ? "send to" : "receive from",
                                       peer, provider()),
                           dead);
        }
        const auto& dead = failures_[static_cast<std::size_t>(c->world_peer)];
        if (dead.empty() &&
            !(failed_rank() == c->world_peer && dog_->failure_age_ms() >= settle_ms))
          return false;
        if (dead.empty()) {
          const int peer = c->peer;
          std::string what =
              fmt::format("rank {} died ({}) during a {} it over {}", peer, dog_->failure(),
                          c->is_send ? "send to" : "receive from", provider());
          abandon_locked(c);
          throw peer_error(what, peer);
        }
        const int peer = c->peer;
        // The ranks' verdict (failure_board) names who failed first; this peer may only have
        // gone down after it.
        if (const int first = failed_rank(); first >= 0 && first != c->world_peer) {
          std::string what = fmt::format(
              "rank {} died ({}); then this rank's {} rank {} failed over {}: {}", first,
              dog_->failure(), c->is_send ? "send to" : "receive from", peer, provider(), dead);
          abandon_locked(c);
          throw peer_error(what, first);
        }
        std::string what =
            fmt::format("rank {} is unreachable over {}: {}", peer, provider(), dead);
        abandon_locked(c);
        throw peer_error(what, peer);
      }
      case op_context::status::done:
        recycle(c);
        return true;
      case op_context::status::failed:
      case op_context::status::cancelled:
        break;
    }
    const std::string what = c->error;
    const bool lost = c->peer_loss;
    const bool cancelled = c->state == op_context::status::cancelled;
    const int peer = c->peer;
    const int world_peer = c->world_peer;
    recycle(c);
    if (cancelled) {
      // Only abandon() cancels, and it never hands the operation back: the provider cancelled
      // it, as rxm does when a connection closes. The closing is this rank's news of a death
      // somewhere; the watchdog says whose.
      const int dead = await_culprit();
      if (dead >= 0)
        throw peer_error(
            fmt::format("rank {} died ({}); provider {} then cancelled a pending operation ({})",
                        dead, dog_->failure(), provider(), what),
            dead);
      throw peer_error(fmt::format("{} by provider {} (its connection to rank {} closed: has it "
                                   "died?)",
                                   what, provider(), peer),
                       peer);
    }
    if (lost) {
      // The ranks' verdict (failure_board, settled when the completion failed) names who failed
      // first: this peer may be a survivor that raised and exited after it, resetting its
      // connections (with eager sends, a send to it fails at once).
      if (const int first = failed_rank(); first >= 0 && first != world_peer)
        throw peer_error(
            fmt::format("rank {} died ({}); then this rank's {}", first, dog_->failure(), what),
            first);
      throw peer_error(what, peer);
    }
    throw transport_error(what);
  }

  void progress() {
    std::lock_guard lock(mutex_);
    progress_locked();
  }

  /// The request for c was destroyed before it completed: cancel it and wait for the
  /// provider to let go of its buffer. A receive is drained until the deadline (it is the
  /// one the provider would write into freed memory); a send, which only reads, briefly.
  /// An operation still pending after that is left to the engine, which frees its context
  /// when the completion arrives or the engine closes.
  void abandon(op_context* c) noexcept {
    std::lock_guard lock(mutex_);
    abandon_locked(c);
  }

 private:
  static constexpr std::int64_t settle_ms = 200;
  static constexpr std::byte name_mark{'R'};

  /// The world rank the watchdog found dead, waiting up to half a second for it to look: a
  /// failure seen first as a closed connection is named once the watchdog has probed.
  [[nodiscard]] int await_culprit() const {
    if (!dog_) return -1;
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
    int dead = dog_->failed_rank();
    while (dead < 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      dead = dog_->failed_rank();
    }
    return dead;
  }

  void check_aborted() const {
    if (aborted())
      throw peer_error(fmt::format("the communicator was aborted: {}", abort_reason()), -1);
  }

  /// Every posted or queued operation, for RINGZERO_DEBUG=INFO when a wait gives up.
  void log_pending() const {
    if (!log::enabled(log::level::info)) return;
    ringzero::detail::pending_report report;
    for (const op_context& o : pool_) {
      if (o.state != op_context::status::pending ||
          std::find(free_.begin(), free_.end(), &o) != free_.end())
        continue;
      std::string where;
      if (o.striped)
        where = fmt::format(" (striped: {} of its pieces pending, listed apart)", o.unsettled);
      else if (!o.posted)
        where = " (queued in the engine)";
      if (rails_.size() > 1 && !o.striped)
        where += fmt::format(" on rail {}", rails_[o.rail]->domain_name());
      report.add(o.is_send, o.peer, o.length, o.tag, o.world_peer, where);
    }
    log::info("libfabric: {} pending operations when a wait gave up:{}", report.count(),
              report.lines());
  }

  void abandon_locked(op_context* c) noexcept {
    if (c->striped) {
      recycle(c);  // abandons the pieces still held
      return;
    }
    if (c->state == op_context::status::pending && !c->posted) {
      // Still waiting in the engine: the provider never saw it.
      auto& queue = lanes_[c->rail].queue(c->is_send);
      queue.erase(std::remove(queue.begin(), queue.end(), c), queue.end());
      recycle(c);
      return;
    }
    if (c->state == op_context::status::pending) {
      if (!logged_pending_) {
        logged_pending_ = true;
        try {
          log_pending();
        } catch (...) {
          // Only a diagnostic: the cancellation below matters more.
        }
      }
      watched(dog_.get(), [&] { return rails_[c->rail]->cancel(c); });
      // Once a rank is dead or stopped, the communicator aborted, or an operation was already
      // given up on, operations that have not finished will not: drain briefly, so that the
      // error reaches the caller in time (a receive from a stopped peer that the provider had
      // matched, say, a rendezvous under way, cannot be cancelled, and waiting out the
      // deadline once for each would keep the caller for as many timeouts).
      const bool failing = aborted() || failed_rank() >= 0 || held_ > 0 ||
                           (dog_ && !dog_->stopped_ranks().empty()) ||
                           !failures_[static_cast<std::size_t>(c->world_peer)].empty();
      const auto limit =
          c->is_send || failing
              ? std::min(timeout_, std::chrono::nanoseconds(engine_limits::cancel_send_grace))
              : timeout_;
      const auto deadline = std::chrono::steady_clock::now() + limit;
      try {
        while (c->state == op_context::status::pending &&
               std::chrono::steady_clock::now() < deadline)
          progress_locked();
      } catch (const std::exception& e) {
        log::warn("libfabric: draining a cancelled operation failed: {}", e.what());
      }
      if (c->state == op_context::status::pending) {
        // One warning per engine: after a failure, every pending operation ends up here.
        if (orphans_++ == 0)
          log::warn(
              "libfabric: a {} rank {} could not be cancelled; its buffer, and those of any "
              "further operations that cannot be cancelled, must stay valid until the "
              "communicator is destroyed",
              c->is_send ? "send to" : "receive from", c->peer);
        else
          log::info("libfabric: a {} rank {} could not be cancelled either",
                    c->is_send ? "send to" : "receive from", c->peer);
        c->orphaned = true;
        ++held_;
        return;
      }
    }
    recycle(c);
  }

  void check_size(std::size_t bytes, int peer, const char* what) const {
    if (bytes > max_msg_size_)
      throw unsupported(
          fmt::format("a {} rank {} of {} bytes exceeds provider {}'s largest message ({} bytes); "
                      "use a smaller chunk_bytes",
                      what, peer, bytes, provider(), max_msg_size_));
  }

  /// A fresh operation on rail `ri`, with `buf`'s registration where the rail needs one
  /// (none for a striped message, whose pieces hold their own).
  [[nodiscard]] op_context* make(std::size_t ri, int world_peer, int peer, bool is_send,
                                 std::size_t length, const void* buf) {
    op_context* c;
    if (free_.empty()) {
      pool_.emplace_back();
      c = &pool_.back();
    } else {
      c = free_.back();
      free_.pop_back();
      *c = op_context{};
    }
    c->rail = static_cast<std::uint8_t>(ri);
    c->world_peer = world_peer;
    c->peer = peer;
    c->is_send = is_send;
    c->length = length;
    rail& r = *rails_[ri];
    if ((r.registers() || r.hmem()) && length > 0 && buf != nullptr) {
      try {
        c->mr = r.memory().acquire(buf, length, r.registers());
      } catch (...) {
        free_.push_back(c);
        throw;
      }
    }
    return c;
  }

  [[nodiscard]] bool striping(std::size_t bytes) const noexcept {
    return rails_.size() > 1 && bytes >= stripe_bytes_ && bytes > 0;
  }

  /// A message cut into one piece per rail (stripe), each posted on its rail with the message's
  /// tag; the caller holds the striped operation, which no provider sees.
  [[nodiscard]] op_context* post_striped(int world_peer, int peer, bool is_send, std::uint64_t tag,
                                         std::byte* buf, std::size_t bytes) {
    const auto parts = stripe(bytes, shares(world_peer));
    op_context* m = make(0, world_peer, peer, is_send, bytes, nullptr);
    m->striped = true;
    m->buffer = buf;
    m->tag = tag;
    // Counted before any is posted: a piece may complete while the next one is submitted.
    m->unsettled = static_cast<std::uint8_t>(parts.size());
    try {
      for (const auto& part : parts) {
        op_context* c = make(part.rail, world_peer, peer, is_send, part.length, buf + part.offset);
        c->buffer = buf + part.offset;
        c->address = rails_[part.rail]->address(world_peer);
        c->tag = tag;
        c->parent = m;
        m->pieces.push_back(c);
        submit(c);
      }
    } catch (...) {
      recycle(m);  // abandons the pieces already posted
      throw;
    }
    return m;
  }

  /// A piece has finished (its state is set): the striped message learns of it, and the
  /// piece, which nobody else holds, is freed.
  void settle(op_context* c) noexcept {
    op_context* m = c->parent;
    if (!m) return;
    if (c->state != op_context::status::done && m->state == op_context::status::pending) {
      m->state = c->state;
      m->peer_loss = c->peer_loss;
      m->error = std::move(c->error);  // a move: nothing here may throw
    }
    if (--m->unsettled == 0 && m->state == op_context::status::pending)
      m->state = op_context::status::done;
    recycle(c);
  }

  /// Lets go of a striped message's pieces that are still held: each is cancelled and drained
  /// as a request's would be (abandon_locked).
  void drop_pieces(op_context* m) noexcept {
    std::vector<op_context*> pieces = std::move(m->pieces);
    m->pieces.clear();
    // Unlinked first: a piece that completes while another is drained must not reach m.
    for (op_context* c : pieces) c->parent = nullptr;
    for (op_context* c : pieces) abandon_locked(c);
  }

  void recycle(op_context* c) noexcept {
    if (c->parent) {
      auto& held = c->parent->pieces;
      held.erase(std::remove(held.begin(), held.end(), c), held.end());
      c->parent = nullptr;
    }
    if (!c->pieces.empty()) drop_pieces(c);
    if (c->mr) rails_[c->rail]->memory().release(c->mr);
    c->mr = nullptr;
    c->error.clear();
    free_.push_back(c);
  }

  void progress_locked() {
    std::array<fi_cq_tagged_entry, engine_limits::completion_batch> done;
    for (std::size_t ri = 0; ri < rails_.size(); ++ri) {
      rail& r = *rails_[ri];
      for (;;) {
        const ssize_t n = watched(dog_.get(), [&] { return r.read(done); });
        if (n > 0) {
          for (ssize_t i = 0; i < n; ++i)
            complete(static_cast<op_context*>(done[static_cast<std::size_t>(i)].op_context),
                     done[static_cast<std::size_t>(i)].len);
          if (static_cast<std::size_t>(n) < done.size()) break;
          continue;
        }
        if (n == -FI_EAGAIN) break;
        if (n == -FI_EAVAIL) {
          read_error(r);
          continue;
        }
        throw transport_error(fmt::format("fi_cq_read failed on provider {} domain {}: {}",
                                          provider(), r.domain_name(), fi_text(n)));
      }
      drain(ri, false);
      drain(ri, true);
    }
  }

  /// Queues c behind any waiting operation of its direction, then posts what fits. When c is
  /// first in line and only the provider refuses it (-FI_EAGAIN: shm maps a peer's region on
  /// the first message, rxm sets up a connection), progress and retry briefly before leaving
  /// it queued: a caller that posts a send and then waits elsewhere (on the store, say)
  /// expects the message to be on its way.
  void submit(op_context* c) {
    lane& l = lanes_[c->rail];
    auto& queue = l.queue(c->is_send);
    queue.push_back(c);
    drain(c->rail, c->is_send);
    if (queue.size() != 1 || queue.front() != c ||
        l.posted(c->is_send) >= limit(c->rail, c->is_send))
      return;
    const auto until = std::chrono::steady_clock::now() + engine_limits::post_progress_window;
    const bool piece = c->parent != nullptr;
    try {
      while (!c->posted && c->state == op_context::status::pending &&
             std::chrono::steady_clock::now() < until)
        progress_locked();  // drains the queues too
    } catch (...) {
      // Nobody holds c yet: the caller gets the exception, not a request. (A piece that
      // finished was freed when it settled.)
      if (!c->posted && !(piece && c->state != op_context::status::pending)) {
        queue.erase(std::remove(queue.begin(), queue.end(), c), queue.end());
        recycle(c);
      }
      throw;
    }
  }

  /// Posts waiting operations in order while the limit allows and the provider accepts them.
  /// A refusal (-FI_EAGAIN) leaves the rest for the next progress call; an error fails that
  /// operation alone, and its test() reports it.
  void drain(std::size_t ri, bool sends) {
    lane& l = lanes_[ri];
    auto& queue = l.queue(sends);
    std::size_t& posted = l.posted(sends);
    const std::size_t cap = limit(ri, sends);
    while (!queue.empty() && posted < cap) {
      op_context* c = queue.front();
      const ssize_t rc = watched(dog_.get(), [&] { return rails_[ri]->post(c); });
      if (rc == -FI_EAGAIN) return;
      queue.pop_front();
      if (rc != 0) {
        c->state = op_context::status::failed;
        c->error = post_failed(c->is_send ? "send to" : "receive from", c->peer, rc).what();
        settle(c);
        continue;
      }
      c->posted = true;
      ++posted;
      ++l.carried;
    }
  }

  [[nodiscard]] std::size_t limit(std::size_t ri, bool sends) const noexcept {
    return sends ? rails_[ri]->send_limit() : rails_[ri]->receive_limit();
  }

  [[nodiscard]] transport_error post_failed(const char* what, int peer, ssize_t rc) const {
    return transport_error(fmt::format("posting a {} rank {} on provider {} failed: {}", what, peer,
                                       provider(), fi_text(rc)));
  }

  /// Bookkeeping for an operation the provider has finished with.
  void retire(op_context* c) noexcept {
    if (!c->posted) return;
    c->posted = false;
    --lanes_[c->rail].posted(c->is_send);
  }

  /// An abandoned operation the provider has now given back.
  void release_orphan(op_context* c) noexcept {
    --held_;
    recycle(c);
  }

  void complete(op_context* c, std::size_t len) {
    retire(c);
    if (c->orphaned) return release_orphan(c);
    if (!c->is_send && len != c->length) {
      c->state = op_context::status::failed;
      c->error = fmt::format(
          "message size mismatch with rank {}: posted a {} byte receive{}, the "
          "peer sent {} bytes (ranks disagree on the collective's count or "
          "type?)",
          c->peer, c->length, piece_note(c), len);
    } else {
      c->state = op_context::status::done;
    }
    settle(c);
  }

  /// Where an error concerns one piece of a striped message, says so: the sizes it names are
  /// the piece's.
  [[nodiscard]] std::string piece_note(const op_context* c) const {
    if (!c->parent) return {};
    return fmt::format(" (a piece, on rail {}, of a {} byte message striped over the rails)",
                       rails_[c->rail]->domain_name(), c->parent->length);
  }

  void read_error(rail& r) {
    fi_cq_err_entry err{};
    const ssize_t rc = watched(dog_.get(), [&] { return r.read_error(err); });
    if (rc == -FI_EAGAIN) return;
    if (rc < 0)
      throw transport_error(fmt::format("fi_cq_readerr failed on provider {} domain {}: {}",
                                        provider(), r.domain_name(), fi_text(rc)));
    const std::string text = r.error_text(err);
    auto* c = static_cast<op_context*>(err.op_context);
    if (!c) {
      log::warn("libfabric: completion error without an operation: {}", text);
      return;
    }
    retire(c);
    if (c->orphaned) return release_orphan(c);
    // Providers disagree on the sign of err.
    const int code = err.err < 0 ? -err.err : err.err;
    if (code == FI_ECANCELED) {
      c->state = op_context::status::cancelled;
      c->error =
          fmt::format("{} rank {} was cancelled", c->is_send ? "send to" : "receive from", c->peer);
      return settle(c);
    }
    c->state = op_context::status::failed;
    if (code == FI_ETRUNC) {
      c->error = fmt::format(
          "message size mismatch with rank {}: posted a {} byte receive{}, the peer sent {} "
          "(ranks disagree on the collective's count or type?): {}",
          c->peer, c->length, piece_note(c),
          err.olen ? fmt::format("{} bytes", c->length + err.olen) : std::string("more"), text);
      return settle(c);
    }
    c->peer_loss = true;
    c->error = fmt::format("{} rank {} failed over {}{}: {}",
                           c->is_send ? "send to" : "receive from", c->peer, provider(),
                           rails_.size() > 1 ? fmt::format(" rail {}", r.domain_name()) : "", text);
    if (is_peer_loss(code)) {
      failures_[static_cast<std::size_t>(c->world_peer)] = text;
      if (dog_) dog_->suspect(c->world_peer, fmt::format("its connection failed: {}", text));
    }
    settle(c);
  }

  /// One rail's flow control: operations waiting for room, and how many are posted.
  struct lane {
    std::deque<op_context*> sends;
    std::deque<op_context*> recvs;
    std::size_t posted_sends = 0;
    std::size_t posted_recvs = 0;
    std::uint64_t carried = 0;  ///< messages posted or injected on this rail
    [[nodiscard]] std::deque<op_context*>& queue(bool is_send) noexcept {
      return is_send ? sends : recvs;
    }
    [[nodiscard]] std::size_t& posted(bool is_send) noexcept {
      return is_send ? posted_sends : posted_recvs;
    }
  };

  std::chrono::nanoseconds timeout_;
  std::size_t stripe_bytes_;
  bool weigh_rails_;
  /// By world rank: the shares a message to or from that rank is striped by (stripe).
  std::vector<std::vector<std::uint64_t>> shares_;
  std::vector<std::unique_ptr<rail>> rails_;
  std::vector<lane> lanes_;  ///< by rail
  int tag_width_ = 64;
  std::size_t max_msg_size_ = SIZE_MAX;
  bool hmem_ = true;  ///< every rail reports FI_HMEM (and device memory was asked for)
  bool registered_cuda_ = false;
  std::vector<std::string> failures_;  ///< why a world rank is known unreachable, or empty
  mutable std::mutex mutex_;
  std::deque<op_context> pool_;  ///< stable addresses: the provider holds pointers
  std::vector<op_context*> free_;
  bool logged_pending_ = false;
  std::size_t orphans_ = 0;
  std::size_t held_ = 0;  ///< orphaned operations the provider has not given back
  ringzero::detail::abort_state abort_;
  // Last: stopped first, before anything it watches goes.
  std::unique_ptr<watchdog> dog_;
};

}  // namespace ringzero::libfabric::detail
