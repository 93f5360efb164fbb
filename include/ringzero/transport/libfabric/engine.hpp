// The operation engine of the libfabric transport, shared by a communicator and every
// sub-communicator split from it: the operations' pool, their flow control (a queue per rail
// and direction), posting, completions, cancellation, the deadline's watchdog, abort and the
// diagnostics when a wait gives up. The provider calls themselves are the rails' (rail.hpp): one
// rail per NIC, each with its own domain, endpoint, address vector and registrations. A message
// below config::stripe_bytes goes over one rail, chosen from its tag (rail_for); a larger one is
// cut into one piece per rail, sized in proportion to the two ends' link speeds (stripe), each
// piece sent on its rail with the message's tag and its piece number. Both choices are
// functions of what both ends know (the tag, the length, the speeds exchanged at connect), so
// sender and receiver place every byte alike without talking, and messages with one (peer, tag)
// keep their order on every rail; adding a NIC is opening another rail, and nothing here
// changes.
//
// With several rails every message is delivered reliably (delivery.hpp): numbered, its pieces
// tagged apart, acknowledged by the receiver, and sent again over the rails that are left when
// its rail fails (a link found down, an error on the rail, the peer saying it gave the rail up),
// with a warning naming the rail; a peer becomes unreachable only when its last rail fails.
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
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/abort_state.hpp"
#include "ringzero/transport/detail/interfaces.hpp"
#include "ringzero/transport/detail/pending_report.hpp"
#include "ringzero/transport/libfabric/delivery.hpp"
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
  /// With several rails, how long closing waits for its last messages to be acknowledged (they
  /// may have completed on return, copied) and lets its own acknowledgements leave.
  static constexpr std::chrono::seconds close_grace{10};
  static constexpr std::chrono::milliseconds close_linger{5};
};

class engine {
 public:
  struct config {
    std::string provider;  ///< empty: libfabric's first choice under FI_PROVIDER
    /// One rail per entry, each the NIC the provider names as a domain (tcp: an interface, efa:
    /// a device); empty: one rail on the provider's best candidate.
    std::vector<std::string> rails{};
    /// With no rails named: the address this rank rendezvouses from, whose candidate the rail
    /// takes (rail::config::near).
    std::optional<in_addr> near{};
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
    /// With rails {"auto"}: the PCI address of this rank's GPU; the rendezvous then keeps the
    /// NICs nearest it (detail::rails_near_gpu). Empty: every NIC found.
    std::string gpu_bus_id{};
  };

  explicit engine(const config& cfg)
      : timeout_(cfg.timeout),
        stripe_bytes_(cfg.stripe_bytes),
        weigh_rails_(cfg.weigh_rails),
        reliable_(cfg.rails.size() > 1) {
    const std::size_t most = reliable_ ? delivery::limits::max_rails : engine_limits::max_rails;
    if (cfg.rails.size() > most)
      throw invalid_argument(fmt::format("{} rails asked for; a libfabric engine drives at most {}",
                                         cfg.rails.size(), most));
    const auto open = [&](std::string domain) {
      rails_.push_back(std::make_unique<rail>(rail::config{.provider = cfg.provider,
                                                           .domain = std::move(domain),
                                                           .near = cfg.near,
                                                           .register_always = cfg.register_always,
                                                           .one_host = cfg.one_host,
                                                           .device_memory = cfg.device_memory,
                                                           .cq_data = reliable_}));
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
      if (reliable_ && r->cq_data_bytes() < 4)
        throw unsupported(fmt::format(
            "libfabric provider {} carries {} bytes of remote CQ data on {}; several rails need "
            "4 (each message's sequence number, so that a failed rail loses none)",
            r->provider(), r->cq_data_bytes(), r->domain_name()));
    }
    if (reliable_ && tag_width_ - tag_bits <= delivery::limits::piece_bits)
      throw unsupported(
          fmt::format("libfabric provider {} matches {} tag bits; several rails need more than {}",
                      provider(), tag_width_, tag_bits + delivery::limits::piece_bits));
    piece_shift_ = tag_width_ - delivery::limits::piece_bits;
  }

  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  ~engine() {
    deliver_before_close();
    // After a rank of this host died or stopped, closing an shm endpoint may wait on a lock in
    // that rank's region for good, and an elastic job's survivors close theirs in the middle
    // of forming the next generation: the watchdog would end them (exit status 70), fewer than
    // the job can go on with. Left open, the endpoint costs its memory until the process exits.
    const bool lock_risk = provider() == "shm" && dog_ && dog_->any_lost();
    if (held_ > 0 || lock_risk) {
      // Operations the provider never gave back (abandoned after a failure) still point into
      // buffers the caller has likely freed, and at a peer that may never answer: closing the
      // endpoint then makes the provider finish them, and ofi_rxm, tearing down a rendezvous
      // with a stopped peer, read a context of its own it had already freed (SIGSEGV in
      // fi_close). Nothing here drives progress any more, so the provider's objects and the
      // contexts it holds are left as they are, and only the names other processes could
      // still find (this process's /dev/shm regions) are removed: an engine that failed is
      // not closed, and its process is usually about to exit.
      if (held_ > 0)
        log::info(
            "libfabric: {} operation{} still held by provider {}: the endpoints are left open",
            held_, held_ == 1 ? "" : "s", provider());
      else
        log::info(
            "libfabric: a rank of this host died or is stopped: the {} endpoints are left "
            "open",
            provider());
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

  /// Inserts every rank's names (index = world rank), each rail's into that rail; `rank` is this
  /// engine's own world rank.
  void connect(const std::vector<std::vector<std::byte>>& names, int rank) {
    rank_ = rank;
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
    if (reliable_) {
      std::lock_guard lock(mutex_);
      links_.assign(names.size(), link{});
      for (std::size_t r = 0; r < rails_.size(); ++r)
        for (std::size_t i = 0; i < control_receives; ++i) post_control_receive(r);
      next_link_poll_ = std::chrono::steady_clock::now() + delivery::limits::link_poll;
    }
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
  /// Whether `world_peer`'s process was found gone: no provider call goes to it any more.
  [[nodiscard]] bool gone(int world_peer) const {
    return dog_ && world_peer >= 0 && dog_->is_gone(world_peer);
  }
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
    return std::min(tag_width_ - tag_bits - (reliable_ ? delivery::limits::piece_bits : 0),
                    tag_layout::comm_id_bits);
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

  /// Registers [p, p+n) as memory of CUDA device `device`, in allocation `id` (0: unknown), with
  /// fi_mr_regattr and FI_HMEM_CUDA on every rail (mr_cache::register_device): sends and
  /// receives inside it then pass that registration to the provider.
  /// Throws unsupported when the engine was not opened for device memory or the provider
  /// refuses.
  void register_device(const void* p, std::size_t n, int device, std::uint64_t id = 0) {
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
        rails_[i]->memory().register_device(p, n, device, id);
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
    if (reliable_) return send_reliably(world_peer, peer, tag, data);
    const std::size_t ri = rail_for(tag, rails_.size());
    rail& r = *rails_[ri];
    // Injecting past queued sends could reorder two messages with one tag.
    if (r.inject_size() > 0 && data.size() <= r.inject_size() && lanes_[ri].sends.empty() &&
        !r.memory().is_device(data.data(), data.size()) && !gone(world_peer)) {
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
    if (reliable_) return post_pieces(world_peer, peer, false, tag, data.data(), data.size());
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
    return n - control_posted_;  // delivery's own control receives are not the caller's
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

  /// With several rails: gives rail `r` up toward every rank, as when its link is found down (a
  /// test's stand-in for pulling a cable). Its messages move to the other rails.
  void fail_rail(std::size_t r, const std::string& why) {
    std::lock_guard lock(mutex_);
    if (!reliable_ || r >= rails_.size())
      throw invalid_argument(fmt::format("fail_rail({}): this engine has {} rail{}", r,
                                         rails_.size(), rails_.size() == 1 ? "" : "s"));
    for (std::size_t wp = 0; wp < links_.size(); ++wp) rail_down(static_cast<int>(wp), r, why);
    progress_locked();
  }
  /// Whether messages to and from world rank `peer` still use rail `r`.
  [[nodiscard]] bool rail_in_use(int peer, std::size_t r) const {
    std::lock_guard lock(mutex_);
    if (!reliable_) return r == 0;
    return (links_.at(static_cast<std::size_t>(peer)).dead & (std::uint32_t{1} << r)) == 0;
  }
  /// Messages to world rank `peer` not yet acknowledged (several rails; 0 with one).
  [[nodiscard]] std::size_t unacknowledged(int peer) const {
    std::lock_guard lock(mutex_);
    return reliable_ ? links_.at(static_cast<std::size_t>(peer)).unacked.size() : 0;
  }

 private:
  static constexpr std::int64_t settle_ms = 200;
  static constexpr std::byte name_mark{'R'};
  /// Control receives kept posted on each rail (several rails): acknowledgements from many
  /// peers at once wait as the provider's unexpected messages until one is reposted.
  static constexpr std::size_t control_receives = 4;
  using role = op_context::role;
  using clock = std::chrono::steady_clock;

  /// A send not yet acknowledged: a piece the caller waits for, or a copied send (copy) that
  /// completed at once.
  struct outstanding {
    op_context* piece = nullptr;
    std::size_t rail = 0;  ///< where it was last sent
    std::uint64_t tag = 0;
    std::shared_ptr<std::byte[]> copy{};
    std::size_t length = 0;
    bool held = false;  ///< not sent yet (holding)
  };
  /// Delivery to and from one world rank (several rails).
  struct link {
    std::uint32_t dead = 0;       ///< rails this rank gave up toward the peer
    std::uint32_t peer_dead = 0;  ///< rails the peer gave up: its receives there are gone
    std::uint64_t next_seq = 0;
    std::map<std::uint64_t, outstanding> unacked{};
    delivery::received_set received{};
    std::size_t receipts = 0;  ///< arrivals not yet acknowledged
    clock::time_point first_receipt{};
    bool owed = false;  ///< a control message must go now
    bool listed = false;
    std::vector<std::uint64_t> cut{};  ///< the latest arrivals cut short (delivery::control)
  };

  [[nodiscard]] std::uint64_t piece_tag(std::size_t i) const noexcept {
    return static_cast<std::uint64_t>(i) << piece_shift_;
  }
  [[nodiscard]] std::uint64_t control_tag() const noexcept {
    return delivery::limits::control_piece << piece_shift_;
  }
  [[nodiscard]] const std::string& rail_name(std::size_t r) const {
    return rails_[r]->domain_name();
  }

  /// Throws when every rail to `world_peer` failed.
  void check_reachable(int world_peer, int peer) const {
    const auto& why = failures_[static_cast<std::size_t>(world_peer)];
    if (delivery::substitute(0, links_[static_cast<std::size_t>(world_peer)].dead, rails_.size()) <
        0)
      throw peer_error(fmt::format("rank {} is unreachable over {}: {}", peer, provider(), why),
                       peer);
  }
  /// The rail a message with home `home` takes to or from `world_peer`.
  [[nodiscard]] std::size_t place(int world_peer, std::size_t home) const {
    const int r = delivery::substitute(home, links_[static_cast<std::size_t>(world_peer)].dead,
                                       rails_.size());
    if (r < 0)
      throw peer_error(fmt::format("rank {} is unreachable over {}: {}", world_peer, provider(),
                                   failures_[static_cast<std::size_t>(world_peer)]),
                       world_peer);
    return static_cast<std::size_t>(r);
  }

  /// Several rails, before closing: what this rank sent reaches its peers (a small send
  /// completed on return, so only an acknowledgement says it arrived) and what it received is
  /// acknowledged, so that a peer still waiting for that is not left to time out. Bounded by
  /// close_grace, and skipped once anything failed.
  void deliver_before_close() noexcept {
    if (!reliable_ || links_.empty() || aborted() || failed_rank() >= 0) return;
    try {
      std::lock_guard lock(mutex_);
      const auto until =
          clock::now() + std::min<std::chrono::nanoseconds>(timeout_, engine_limits::close_grace);
      bool told = false;
      for (;;) {
        for (const int wp : owing_) {
          link& l = links_[static_cast<std::size_t>(wp)];
          if (l.receipts > 0) l.owed = told = true;
        }
        progress_locked();
        std::size_t waiting = 0;
        for (std::size_t wp = 0; wp < links_.size(); ++wp)
          if (failures_[wp].empty()) waiting += links_[wp].unacked.size();
        if (waiting == 0) break;
        if (failed_rank() >= 0 || clock::now() >= until) {
          log::info("libfabric: closing with {} message{} not acknowledged", waiting,
                    waiting == 1 ? "" : "s");
          break;
        }
        std::this_thread::yield();
      }
      if (told) {
        const auto linger = clock::now() + engine_limits::close_linger;
        while (clock::now() < linger) progress_locked();
      }
    } catch (const std::exception& e) {
      log::info("libfabric: delivering before close failed: {}", e.what());
    }
  }

  /// Numbers a send piece and lists it until acknowledged.
  void track(op_context* c, std::shared_ptr<std::byte[]> copy, bool urgent) {
    link& l = links_[static_cast<std::size_t>(c->world_peer)];
    c->seq = l.next_seq++;
    c->with_data = true;
    c->cq_data = delivery::cq_word::make(c->seq, urgent);
    c->tracked = true;
    l.unacked.emplace(c->seq, outstanding{.piece = c,
                                          .rail = c->rail,
                                          .tag = c->tag,
                                          .copy = std::move(copy),
                                          .length = c->length});
  }

  /// A send over several rails: a small one (host memory) is copied, sent from the copy and
  /// complete on return (nullptr), as an injected send is; a larger one is held until the
  /// receiver acknowledges every piece.
  [[nodiscard]] op_context* send_reliably(int world_peer, int peer, std::uint64_t tag,
                                          std::span<const std::byte> data) {
    const bool copy = !striping(data.size()) && data.size() <= delivery::limits::copy_bytes &&
                      !rails_.front()->memory().is_device(data.data(), data.size());
    if (!copy)
      return post_pieces(world_peer, peer, true, tag, const_cast<std::byte*>(data.data()),
                         data.size());
    check_reachable(world_peer, peer);
    std::shared_ptr<std::byte[]> bytes(new std::byte[std::max<std::size_t>(data.size(), 1)]);
    if (!data.empty()) std::memcpy(bytes.get(), data.data(), data.size());
    link& l = links_[static_cast<std::size_t>(world_peer)];
    const std::uint64_t seq = l.next_seq++;
    auto& e = l.unacked
                  .emplace(seq, outstanding{.piece = nullptr,
                                            .rail = rail_for(tag, rails_.size()),
                                            .tag = tag | piece_tag(0),
                                            .copy = std::move(bytes),
                                            .length = data.size()})
                  .first->second;
    if (holding(world_peer))
      e.held = true;
    else
      transmit_copy(world_peer, seq, e);
    return nullptr;
  }

  /// Whether sends to `world_peer` wait: this rank gave a rail up that the peer has not yet
  /// said it gave up. Until it has, what that rail held cannot go again (the peer may still
  /// take it there), and a new message with the tag of one that must go again would overtake
  /// it; so new sends wait, and go in order after the messages sent again.
  [[nodiscard]] bool holding(int world_peer) const noexcept {
    const link& l = links_[static_cast<std::size_t>(world_peer)];
    return (l.dead & ~l.peer_dead) != 0;
  }
  void hold(int world_peer, std::uint64_t seq) {
    link& l = links_[static_cast<std::size_t>(world_peer)];
    auto& e = l.unacked.at(seq);
    e.held = true;
    if (e.piece) e.piece->held = true;
  }
  /// Sends what waited, in the order it was sent (sequence numbers), once holding is over.
  void release_held(int world_peer) {
    if (holding(world_peer)) return;
    link& l = links_[static_cast<std::size_t>(world_peer)];
    std::vector<std::uint64_t> todo;
    for (const auto& [seq, e] : l.unacked)
      if (e.held) todo.push_back(seq);
    for (const auto seq : todo) {
      auto it = l.unacked.find(seq);
      if (it == l.unacked.end() || !it->second.held) continue;
      resend(world_peer, seq, it->second);
    }
  }

  /// Sends a copied message (again): injected when it fits, else posted from the copy.
  void transmit_copy(int world_peer, std::uint64_t seq, outstanding& e) {
    const std::size_t ri = place(world_peer, e.rail);
    e.rail = ri;
    rail& r = *rails_[ri];
    const std::uint64_t word = delivery::cq_word::make(seq, false);
    if (e.length <= r.inject_size() && lanes_[ri].sends.empty() && !gone(world_peer)) {
      const ssize_t rc = watched(dog_.get(), [&] {
        return r.inject(world_peer, std::span<const std::byte>(e.copy.get(), e.length), e.tag,
                        word);
      });
      if (rc == 0) {
        ++lanes_[ri].carried;
        return;
      }
      // Refused or failed: posted instead, where a failure is the rail's (read_error).
    }
    op_context* w = make(ri, world_peer, world_peer, true, e.length, e.copy.get());
    w->kind = role::copy;
    w->buffer = e.copy.get();
    w->address = r.address(world_peer);
    w->tag = e.tag;
    w->with_data = true;
    w->cq_data = word;
    w->seq = seq;
    w->own = e.copy;
    submit(w);
  }

  /// Removes c from its lane's queue, if it waits there.
  void dequeue(op_context* c) noexcept {
    if (c->posted) return;
    auto& queue = lanes_[c->rail].queue(c->is_send);
    queue.erase(std::remove(queue.begin(), queue.end(), c), queue.end());
  }

  /// Moves c (not with the provider) to rail `ri`, with that rail's registration.
  void rehome(op_context* c, std::size_t ri) {
    if (c->mr) rails_[c->rail]->memory().release(c->mr);
    c->mr = nullptr;
    c->rail = static_cast<std::uint8_t>(ri);
    c->address = rails_[ri]->address(c->world_peer);
    rail& r = *rails_[ri];
    if ((r.registers() || r.hmem()) && c->length > 0 && c->buffer != nullptr)
      c->mr = r.memory().acquire(c->buffer, c->length, r.registers());
  }

  /// A fresh context standing in for c, which the provider still holds (on a failed rail): c
  /// is left to the provider (orphaned, freed if it ever completes), the new one takes its
  /// place in its message and among the unacknowledged.
  [[nodiscard]] op_context* replace(op_context* c) {
    op_context* n = make(c->rail, c->world_peer, c->peer, c->is_send, c->length, nullptr);
    n->buffer = c->buffer;
    n->address = c->address;
    n->tag = c->tag;
    n->kind = c->kind;
    n->with_data = c->with_data;
    n->cq_data = c->cq_data;
    n->seq = c->seq;
    n->tracked = c->tracked;
    n->acked = c->acked;
    n->own = c->own;
    n->order = c->order;
    n->held = c->held;
    n->parent = c->parent;
    if (c->parent) std::replace(c->parent->pieces.begin(), c->parent->pieces.end(), c, n);
    if (c->tracked) {
      auto& l = links_[static_cast<std::size_t>(c->world_peer)];
      if (auto it = l.unacked.find(c->seq); it != l.unacked.end() && it->second.piece == c)
        it->second.piece = n;
    }
    c->parent = nullptr;
    c->tracked = false;
    c->moving = false;
    c->orphaned = true;
    ++held_;
    return n;
  }

  /// A receive (not with the provider) goes to the rail that stands in for its own.
  void move_receive(op_context* c) {
    c->moving = false;
    rehome(c, place(c->world_peer, c->rail));
    submit(c);
  }

  /// Sends an unacknowledged message again, on the rail standing in for the one it was on.
  void resend(int world_peer, std::uint64_t seq, outstanding& e) {
    e.held = false;
    if (!e.piece) return transmit_copy(world_peer, seq, e);
    op_context* c = e.piece;
    c->held = false;
    if (c->posted) c = replace(c);
    dequeue(c);
    rehome(c, place(world_peer, c->rail));
    e.rail = c->rail;
    c->wire_done = false;
    submit(c);
  }

  /// Sends again what the peer gave up: unacknowledged messages last sent on a rail whose
  /// receives it has cancelled (its control message said so), so none can arrive twice.
  void resend_given_up(int world_peer) {
    link& l = links_[static_cast<std::size_t>(world_peer)];
    std::vector<std::uint64_t> todo;
    for (const auto& [seq, e] : l.unacked)  // held ones were never sent: release_held sends them
      if (!e.held && (l.peer_dead & (std::uint32_t{1} << e.rail))) todo.push_back(seq);
    if (!todo.empty())
      log::info("libfabric: {} unacknowledged message{} to rank {} sent again over the rails left",
                todo.size(), todo.size() == 1 ? "" : "s", world_peer);
    for (const auto seq : todo) {
      auto it = l.unacked.find(seq);
      if (it != l.unacked.end() && !it->second.held &&
          (l.peer_dead & (std::uint32_t{1} << it->second.rail)))
        resend(world_peer, seq, it->second);
    }
  }

  /// Rail `r` is given up toward `world_peer`: its receives from the peer are cancelled and
  /// moved (each either arrived or is moved, never both), queued sends move, the peer is told,
  /// and what it already gave up is sent again. With no rail left the peer is unreachable.
  void rail_down(int world_peer, std::size_t r, const std::string& why) {
    link& l = links_[static_cast<std::size_t>(world_peer)];
    const std::uint32_t bit = std::uint32_t{1} << r;
    if (l.dead & bit) return;
    l.dead |= bit;
    const int next = delivery::substitute(r, l.dead, rails_.size());
    if (next < 0) return peer_unreachable(world_peer, r, why);
    if ((warned_ & bit) == 0 && world_peer != rank_) {
      warned_ |= bit;
      log::warn("libfabric: rail {} failed toward rank {} ({}); its messages go over rail {}{}",
                rail_name(r), world_peer, why, rail_name(static_cast<std::size_t>(next)),
                std::popcount(~l.dead & ((std::uint32_t{1} << rails_.size()) - 1)) > 1
                    ? " and the others left"
                    : "");
    } else {
      log::info("libfabric: rail {} given up toward rank {} too ({})", rail_name(r), world_peer,
                why);
    }
    std::vector<op_context*> queued;
    std::vector<op_context*> cancelled;
    for (op_context& o : pool_) {
      if (!o.in_use || o.orphaned || o.striped || o.held || o.kind == role::control_recv ||
          o.world_peer != world_peer || o.rail != r || o.state != op_context::status::pending)
        continue;
      if (!o.posted) {
        // Waiting in the engine: never sent, so it may go elsewhere at once (a piece whose
        // provider completion came waits for its acknowledgement, not for a rail).
        if (!o.is_send || !o.wire_done) queued.push_back(&o);
      } else if (!o.is_send) {
        o.moving = true;
        watched(dog_.get(), [&] { return rails_[r]->cancel(&o); });
        cancelled.push_back(&o);
      }
    }
    // Unsent sends wait (hold) and go, in order, with what must go again; receives move in
    // the order they were posted, so that two with one tag still match in that order.
    std::vector<op_context*> receives;
    for (op_context* c : queued) {
      dequeue(c);
      if (!c->is_send) {
        receives.push_back(c);
        continue;
      }
      auto it = l.unacked.find(c->seq);
      if (c->kind == role::message) {
        if (c->tracked && it != l.unacked.end()) hold(world_peer, c->seq);
        continue;
      }
      // A copy's sending or a statement: the copy is sent again from its entry, a newer
      // statement goes instead (owed below).
      if (c->kind == role::copy && it != l.unacked.end() && it->second.piece == nullptr)
        it->second.held = true;
      recycle(c);
    }
    const auto until = clock::now() + std::chrono::nanoseconds(engine_limits::cancel_send_grace);
    const auto unresolved = [&] {
      return std::any_of(cancelled.begin(), cancelled.end(),
                         [](const op_context* c) { return c->in_use && c->moving && c->posted; });
    };
    while (unresolved() && clock::now() < until) poll_rail(r);
    for (op_context* c : cancelled) {
      if (!c->in_use || !c->moving) continue;  // it arrived before the cancellation took
      receives.push_back(c->posted ? replace(c) : c);
    }
    std::sort(receives.begin(), receives.end(),
              [](const op_context* a, const op_context* b) { return a->order < b->order; });
    for (op_context* c : receives) move_receive(c);
    l.owed = true;
    note_owing(world_peer);
    resend_given_up(world_peer);
    release_held(world_peer);
  }

  /// Every rail to `world_peer` failed: its operations fail, naming the rank.
  void peer_unreachable(int world_peer, std::size_t r, const std::string& why) {
    auto& failure = failures_[static_cast<std::size_t>(world_peer)];
    if (!failure.empty()) return;
    failure =
        rails_.size() > 1 ? fmt::format("its last rail, {}, failed: {}", rail_name(r), why) : why;
    log::warn("libfabric: rank {} is unreachable: {}", world_peer, failure);
    link& l = links_[static_cast<std::size_t>(world_peer)];
    for (auto& [seq, e] : l.unacked)
      if (e.piece) e.piece->tracked = false;
    l.unacked.clear();
    if (dog_) dog_->suspect(world_peer, failure);
  }

  /// The receiver has `seq`: the message is done with (a piece settles once the provider has
  /// given it back too).
  void acknowledge(int world_peer, std::uint64_t seq) {
    link& l = links_[static_cast<std::size_t>(world_peer)];
    auto it = l.unacked.find(seq);
    if (it == l.unacked.end()) return;
    op_context* c = it->second.piece;
    l.unacked.erase(it);
    if (!c) return;
    c->tracked = false;
    c->acked = true;
    if (c->posted) return;
    dequeue(c);
    c->state = op_context::status::done;
    settle(c);
  }

  void note_owing(int world_peer) {
    link& l = links_[static_cast<std::size_t>(world_peer)];
    if (l.listed) return;
    l.listed = true;
    owing_.push_back(world_peer);
  }

  /// A message from `world_peer` arrived with CQ data `word`.
  void note_receipt(int world_peer, std::uint64_t word) {
    link& l = links_[static_cast<std::size_t>(world_peer)];
    l.received.add(l.received.expand(word));
    if (l.receipts++ == 0) l.first_receipt = clock::now();
    if (delivery::cq_word::urgent(word)) l.owed = true;
    note_owing(world_peer);
  }

  /// A message from `world_peer` arrived cut short (a receive of the wrong size): received, and
  /// named to its sender, whose other pieces of it will never be.
  void note_cut(int world_peer, std::uint64_t word) {
    link& l = links_[static_cast<std::size_t>(world_peer)];
    l.cut.push_back(l.received.expand(word));
    if (l.cut.size() > delivery::limits::max_cut) l.cut.erase(l.cut.begin());
    note_receipt(world_peer, word | delivery::cq_word::urgent_bit);
  }

  /// Sends `world_peer` this rank's statement (rails given up, messages received) on the lowest
  /// rail both still use; stays owed when the provider has no room now.
  void flush_control(int world_peer) {
    link& l = links_[static_cast<std::size_t>(world_peer)];
    const int ri = delivery::substitute(0, l.dead, rails_.size());
    if (ri >= 0) {
      const auto bytes = delivery::control::encode(rank_, l.dead, l.received, l.cut);
      rail& r = *rails_[static_cast<std::size_t>(ri)];
      ssize_t rc = 1;
      if (bytes.size() <= r.inject_size() && lanes_[static_cast<std::size_t>(ri)].sends.empty() &&
          !gone(world_peer)) {
        rc = watched(dog_.get(), [&] { return r.inject(world_peer, bytes, control_tag()); });
        if (rc == -FI_EAGAIN) return;
      }
      if (rc != 0) {
        std::shared_ptr<std::byte[]> own(new std::byte[bytes.size()]);
        std::memcpy(own.get(), bytes.data(), bytes.size());
        op_context* w = make(static_cast<std::size_t>(ri), world_peer, world_peer, true,
                             bytes.size(), own.get());
        w->kind = role::control_send;
        w->buffer = own.get();
        w->address = r.address(world_peer);
        w->tag = control_tag();
        w->own = std::move(own);
        submit(w);
      }
    }
    l.owed = false;
    l.receipts = 0;
  }

  /// Posts (or reposts) a control receive on its rail: any sender, the control tag.
  void post_control(op_context* c) {
    const ssize_t rc = watched(dog_.get(), [&] { return rails_[c->rail]->post(c); });
    if (rc == -FI_EAGAIN) {
      control_unposted_.push_back(c);
      return;
    }
    if (rc != 0) throw post_failed("control receive from", -1, rc);
    c->posted = true;
    ++lanes_[c->rail].posted_recvs;
    ++control_posted_;
  }
  void post_control_receive(std::size_t ri) {
    std::shared_ptr<std::byte[]> own(new std::byte[delivery::control::max_bytes()]);
    op_context* c = make(ri, -1, -1, false, delivery::control::max_bytes(), own.get());
    c->kind = role::control_recv;
    c->buffer = own.get();
    c->own = std::move(own);
    c->address = FI_ADDR_UNSPEC;
    c->tag = control_tag();
    c->ignore = (std::uint64_t{1} << piece_shift_) - 1;  // the bits below the piece field
    post_control(c);
  }

  /// A control receive finished: its message is kept for tend_delivery, and it is reposted.
  void control_arrived(op_context* c, std::size_t len) {
    --control_posted_;
    if (auto m = delivery::control::decode(
            std::span<const std::byte>(c->own.get(), std::min(len, c->length))))
      controls_.push_back(std::move(*m));
    else
      log::warn("libfabric: a control message of {} bytes on rail {} is not one; dropped", len,
                rail_name(c->rail));
    post_control(c);
  }

  /// A peer's statement: rails it gave up are given up here too, what it has is done with, and
  /// what it gave up is sent again.
  void apply_control(const delivery::control& m) {
    if (m.from < 0 || static_cast<std::size_t>(m.from) >= links_.size()) {
      log::warn("libfabric: a control message from rank {}, which is not in this job; dropped",
                m.from);
      return;
    }
    link& l = links_[static_cast<std::size_t>(m.from)];
    const std::uint32_t all = (std::uint32_t{1} << rails_.size()) - 1;
    l.peer_dead |= m.dead & all;
    for (std::size_t r = 0; r < rails_.size(); ++r)
      if ((m.dead & ~l.dead) & (std::uint32_t{1} << r))
        rail_down(m.from, r, fmt::format("rank {} gave it up", m.from));
    std::vector<std::uint64_t> done;
    for (const auto& [seq, e] : l.unacked)
      if (m.received.contains(seq)) done.push_back(seq);
    // A message cut short: its pieces the receiver never posted for go with it.
    for (const auto seq : m.cut)
      if (auto it = l.unacked.find(seq);
          it != l.unacked.end() && it->second.piece && it->second.piece->parent)
        for (const op_context* p : it->second.piece->parent->pieces)
          if (p->tracked) done.push_back(p->seq);
    for (const auto seq : done) acknowledge(m.from, seq);
    resend_given_up(m.from);
    release_held(m.from);
  }

  /// The rails whose link is down (sysfs): given up toward every rank.
  void poll_links() {
    for (std::size_t r = 0; r < rails_.size(); ++r) {
      const std::uint32_t bit = std::uint32_t{1} << r;
      if (links_down_ & bit) continue;
      const std::string state = ringzero::detail::link_down(rail_name(r));
      if (state.empty()) continue;
      links_down_ |= bit;
      for (std::size_t wp = 0; wp < links_.size(); ++wp)
        rail_down(static_cast<int>(wp), r, fmt::format("its link is {}", state));
    }
  }

  /// Delivery's work after the completions were read: control receives to post, statements
  /// to apply, links to look at, acknowledgements to send.
  void tend_delivery() {
    if (!control_unposted_.empty()) {
      auto again = std::move(control_unposted_);
      control_unposted_.clear();
      for (op_context* c : again) post_control(c);
    }
    while (!controls_.empty()) {
      const delivery::control m = std::move(controls_.front());
      controls_.pop_front();
      apply_control(m);
    }
    const auto now = clock::now();
    if (now >= next_link_poll_) {
      next_link_poll_ = now + delivery::limits::link_poll;
      poll_links();
    }
    for (std::size_t i = 0; i < owing_.size();) {
      const int wp = owing_[i];
      link& l = links_[static_cast<std::size_t>(wp)];
      if (l.owed || l.receipts >= delivery::limits::ack_batch ||
          (l.receipts > 0 && now - l.first_receipt >= delivery::limits::ack_delay))
        flush_control(wp);
      if (!l.owed && l.receipts == 0) {
        l.listed = false;
        owing_[i] = owing_.back();
        owing_.pop_back();
      } else {
        ++i;
      }
    }
  }

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
      if (o.state != op_context::status::pending || !o.in_use || o.kind != role::message) continue;
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
    c->in_use = true;
    c->order = made_++;
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

  /// A message in pieces (several rails): cut into one piece per rail (stripe) when striped,
  /// else one piece on its tag's rail; each piece has a tag of its own (piece_tag) and goes to
  /// its rail, or the one that stands in for it (place). The caller holds the message, which no
  /// provider sees; sends are numbered and kept until acknowledged (track).
  [[nodiscard]] op_context* post_pieces(int world_peer, int peer, bool is_send, std::uint64_t tag,
                                        std::byte* buf, std::size_t bytes) {
    const auto parts =
        striping(bytes) ? stripe(bytes, shares(world_peer))
                        : std::vector<piece>{
                              {.rail = rail_for(tag, rails_.size()), .offset = 0, .length = bytes}};
    check_reachable(world_peer, peer);
    op_context* m = make(0, world_peer, peer, is_send, bytes, nullptr);
    m->striped = true;
    m->buffer = buf;
    m->tag = tag;
    // Counted before any is posted: a piece may complete while the next one is submitted.
    m->unsettled = static_cast<std::uint8_t>(parts.size());
    try {
      for (std::size_t i = 0; i < parts.size(); ++i) {
        const auto& part = parts[i];
        const std::size_t ri = place(world_peer, part.rail);
        op_context* c = make(ri, world_peer, peer, is_send, part.length, buf + part.offset);
        c->buffer = buf + part.offset;
        c->address = rails_[ri]->address(world_peer);
        c->tag = tag | piece_tag(i);
        c->parent = m;
        m->pieces.push_back(c);
        if (is_send) {
          track(c, nullptr, true);
          if (holding(world_peer)) {
            hold(world_peer, c->seq);
            continue;
          }
        }
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
    if (c->tracked && static_cast<std::size_t>(c->world_peer) < links_.size()) {
      auto& l = links_[static_cast<std::size_t>(c->world_peer)];
      if (auto it = l.unacked.find(c->seq); it != l.unacked.end() && it->second.piece == c)
        l.unacked.erase(it);
    }
    if (c->mr) rails_[c->rail]->memory().release(c->mr);
    c->mr = nullptr;
    c->error.clear();
    c->own.reset();
    c->tracked = false;
    c->moving = false;
    c->in_use = false;
    free_.push_back(c);
  }

  void progress_locked() {
    const bool outer = !in_progress_;
    in_progress_ = true;
    struct leave {
      bool& flag;
      bool outer;
      ~leave() {
        if (outer) flag = false;
      }
    } guard{in_progress_, outer};
    for (std::size_t ri = 0; ri < rails_.size(); ++ri) poll_rail(ri);
    if (reliable_ && outer) tend_delivery();
  }

  /// Reads rail ri's completions, then posts what waits for room there.
  void poll_rail(std::size_t ri) {
    std::array<fi_cq_tagged_entry, engine_limits::completion_batch> done;
    rail& r = *rails_[ri];
    for (;;) {
      const ssize_t n = watched(dog_.get(), [&] { return r.read(done); });
      if (n > 0) {
        for (ssize_t i = 0; i < n; ++i) complete(done[static_cast<std::size_t>(i)]);
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
    if (in_progress_) return;  // delivery's own posts: the running progress carries them on
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
      if (c->is_send && gone(c->world_peer)) {
        // Into a dead process's region (shm) a send may wait on the lock it died holding.
        queue.pop_front();
        c->state = op_context::status::failed;
        c->peer_loss = true;
        c->error =
            fmt::format("a send to rank {} failed: its process is gone (not posted)", c->peer);
        if (c->kind != role::message) {
          recycle(c);
          continue;
        }
        settle(c);
        continue;
      }
      const ssize_t rc = watched(dog_.get(), [&] { return rails_[ri]->post(c); });
      if (rc == -FI_EAGAIN) return;
      queue.pop_front();
      if (rc != 0) {
        c->state = op_context::status::failed;
        c->error = post_failed(c->is_send ? "send to" : "receive from", c->peer, rc).what();
        if (c->kind != role::message) {
          // Delivery's own sending: what it carried stays owed and goes again.
          if (c->kind == role::control_send)
            links_[static_cast<std::size_t>(c->world_peer)].owed = true;
          recycle(c);
          continue;
        }
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

  void complete(const fi_cq_tagged_entry& entry) {
    auto* c = static_cast<op_context*>(entry.op_context);
    const std::size_t len = entry.len;
    retire(c);
    if (c->orphaned) return release_orphan(c);
    switch (c->kind) {
      case role::control_recv:
        return control_arrived(c, len);
      case role::control_send:
      case role::copy:
        return recycle(c);
      case role::message:
        break;
    }
    if (reliable_ && c->is_send) {
      // Done only once the receiver says so too (acknowledge).
      c->wire_done = true;
      if (!c->acked) return;
    }
    // A message that arrived is acknowledged even when its size was wrong: it was consumed, and
    // its sender completes (the receiver's error names the mismatch).
    if (reliable_ && !c->is_send) {
      if ((entry.flags & FI_REMOTE_CQ_DATA) && len != c->length)
        note_cut(c->world_peer, entry.data);
      else if (entry.flags & FI_REMOTE_CQ_DATA)
        note_receipt(c->world_peer, entry.data);
      else
        log::warn("libfabric: a message from rank {} came without its sequence number", c->peer);
    }
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
    if (c->kind == role::control_recv) {
      --control_posted_;
      if (code == FI_ECANCELED) return recycle(c);
      log::info("libfabric: a control receive on rail {} failed: {}", r.domain_name(), text);
      control_unposted_.push_back(c);
      return;
    }
    if (c->moving) return;  // cancelled to move off a failed rail: rail_down moves it
    // Several rails: an error (or a cancellation nobody asked for) ends the rail toward this
    // peer, not the message: it moves to the rails left. Only when none is left is the peer
    // unreachable, and its operations fail.
    if (reliable_ && code != FI_ETRUNC && (code != FI_ECANCELED || c->parent != nullptr)) {
      const int wp = c->world_peer;
      const std::size_t ri = c->rail;
      const bool piece = c->kind == role::message;
      if (c->kind == role::control_send) links_[static_cast<std::size_t>(wp)].owed = true;
      if (piece && c->is_send) c->wire_done = true;
      if (!piece) recycle(c);  // a copy's or control message's sending: what it sent stays owed
      rail_down(wp, ri, text);
      if (!piece || !c->in_use || c->state != op_context::status::pending) return;
      if (failures_[static_cast<std::size_t>(wp)].empty()) {
        if (!c->is_send && !c->posted &&
            (links_[static_cast<std::size_t>(wp)].dead & (std::uint32_t{1} << c->rail)))
          move_receive(c);
        return;
      }
      c->state = op_context::status::failed;
      c->peer_loss = true;
      c->error =
          fmt::format("{} rank {} failed: its rails failed, the last ({}): {}",
                      c->is_send ? "send to" : "receive from", c->peer, r.domain_name(), text);
      return settle(c);
    }
    if (code == FI_ECANCELED) {
      c->state = op_context::status::cancelled;
      c->error =
          fmt::format("{} rank {} was cancelled", c->is_send ? "send to" : "receive from", c->peer);
      return settle(c);
    }
    c->state = op_context::status::failed;
    // Consumed, if cut short: acknowledged, so that its sender completes. Every message
    // between reliable engines carries its number; ofi_rxm reports it here without setting
    // FI_REMOTE_CQ_DATA in the error's flags.
    if (code == FI_ETRUNC && reliable_ && c->kind == role::message && !c->is_send)
      note_cut(c->world_peer, err.data);
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
  /// Several rails: every message is delivered reliably (delivery.hpp).
  bool reliable_;
  int rank_ = -1;
  int piece_shift_ = 64 - delivery::limits::piece_bits;
  std::vector<link> links_;                 ///< by world rank (several rails)
  std::vector<int> owing_;                  ///< world ranks owed a control message, or soon
  std::deque<delivery::control> controls_;  ///< arrived, not yet applied
  std::vector<op_context*> control_unposted_;
  std::size_t control_posted_ = 0;
  std::uint32_t warned_ = 0;      ///< rails whose failure was warned about
  std::uint32_t links_down_ = 0;  ///< rails whose link was found down
  clock::time_point next_link_poll_{};
  bool in_progress_ = false;  ///< inside progress_locked: submit() only queues
  std::uint64_t made_ = 0;    ///< contexts made (op_context::order)
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
