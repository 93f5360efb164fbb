// The reliable multi-rail engine, written once for every network transport: a transport is a
// rail kind (rail.hpp: post, poll, cancel, link state, price) and a handshake that connects its
// rails; this engine does the rest, whatever the rails are. It is shared by a communicator and
// every sub-communicator split from it. This file holds the operations' side:
//   - the pool of operations and their flow control (a queue per rail and direction: a rail
//     takes at most its traits' limits, the rest wait here in order, -EAGAIN waits likewise);
//   - placing messages: whole on their tag's rail (rail_for), or from stripe_bytes cut into a
//     piece per rail (stripe), by shares both ends agreed or, where a rail's pieces carry their
//     own offset, by the rates the receiver measures and reports (shares_by_rate);
//   - completions, cancel on destroy (an abandoned send finishes from a copy where the rail
//     allows it), deadlines' verdicts naming the rank that failed first (peer_watch), abort and
//     the pending report.
// rail_failover.hpp holds the delivery side: with several rails, or where the transport asks
// for it (config::acknowledge), every message is numbered, acknowledged by the receiver in
// idempotent statements, sent again over the rails left when its rail fails, and kept in order
// across a failover (delivery.hpp has the bookkeeping, architecture.md the protocol).
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
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
#include "ringzero/transport/detail/delivery.hpp"
#include "ringzero/transport/detail/peer_watch.hpp"
#include "ringzero/transport/detail/pending_report.hpp"
#include "ringzero/transport/detail/rail.hpp"
#include "ringzero/transport/detail/striping.hpp"

namespace ringzero::detail {

/// The engine's own limits, named once.
struct rail_engine_limits {
  /// How long a cancelled send may take to leave: a send a rail cannot cancel is usually already
  /// on the wire and completes within microseconds; one that has not after 10 ms will not, and
  /// its buffer is kept instead (the communicator outlives it).
  static constexpr std::chrono::nanoseconds cancel_send_grace{10'000'000};
  /// How long submit() drives progress for the first queued operation before returning it to
  /// the caller's own wait loop: long enough to post behind a momentarily full queue, short
  /// enough that the caller's deadline is looked at again.
  static constexpr std::chrono::milliseconds post_progress_window{100};
  /// How long closing lets its own acknowledgements leave after it waited for its peers'.
  static constexpr std::chrono::milliseconds close_linger{5};
  /// How long a rank that has seen another die lets completions already on their way arrive
  /// before its other waits fail too.
  static constexpr std::int64_t settle_ms = 200;
  /// Statement receives kept posted on each rail: statements from many peers at once wait as
  /// unexpected messages until one is posted again.
  static constexpr std::size_t control_receives = 4;
  /// Rails one engine drives: an operation's rail is a byte, a rail a bit of a link's masks.
  static constexpr std::size_t max_rails = 32;
};

struct rail_engine_config {
  int rank = 0;
  int size = 1;
  std::string name = "rails";  ///< what its log lines start with ("libfabric", "socket")
  /// What its errors say messages went over ("tcp;ofi_rxm", "sockets").
  std::string fabric = "its rails";
  std::chrono::nanoseconds timeout{std::chrono::seconds(300)};
  /// With several rails, messages of at least this many bytes are cut into a piece per rail.
  std::size_t stripe_bytes = SIZE_MAX;
  /// Number, acknowledge and send again every message even on one rail (a send over
  /// delivery::limits::copy_bytes then completes once the receiver has it). Several rails
  /// always do.
  bool acknowledge = false;
  /// Rails that place pieces: cut by the rates the receiver measures (else equal shares).
  bool weigh_by_rate = true;
  /// Rails that do not: by world rank, each rail's share of a striped message, as both ends
  /// agreed at the handshake (empty: equal).
  std::vector<std::vector<std::uint64_t>> shares{};
  /// Who failed first; null: what this rank sees (first_failure).
  std::shared_ptr<peer_watch> watch{};
  /// With acknowledgements, how long closing waits for its last messages to be acknowledged.
  std::chrono::nanoseconds close_grace{std::chrono::seconds(10)};
  /// Leave the rails open at destruction once the watch lost a rank (peer_watch::any_lost):
  /// where closing may wait on a lock in a dead or stopped rank's memory (libfabric's shm).
  bool leave_open_after_loss = false;
};

template <rail_kind Rail>
class rail_engine : private rail_events<typename Rail::op> {
 public:
  using op = typename Rail::op;
  using config = rail_engine_config;

  rail_engine(config cfg, std::vector<std::unique_ptr<Rail>> rails);
  rail_engine(const rail_engine&) = delete;
  rail_engine& operator=(const rail_engine&) = delete;
  ~rail_engine();

  /// Posts a tagged send to world rank `world_peer` (`peer` as the caller's communicator numbers
  /// it, for errors); nullptr when it is complete on return (injected, or copied).
  [[nodiscard]] op* send(int world_peer, int peer, std::uint64_t tag,
                         std::span<const std::byte> data) {
    std::lock_guard lock(mutex_);
    check_aborted();
    check_size(data.size(), peer, "send to");
    if (reliable_) return send_reliably(world_peer, peer, tag, data);
    const std::size_t ri = rail_for(tag, rails_.size());
    Rail& r = *rails_[ri];
    // Injecting past queued sends could reorder two messages with one tag.
    if (data.size() <= traits_[ri].inject_size && lanes_[ri].sends.empty() &&
        host_readable(r, data.data(), data.size()) && !gone(world_peer)) {
      if constexpr (requires { r.inject(rail_message{}); }) {
        const long rc = r.inject({.peer = world_peer, .bytes = data, .tag = tag});
        if (rc == 0) {
          ++lanes_[ri].carried;
          return nullptr;
        }
        if (rc != -EAGAIN) throw post_failed("send to", peer, rc, ri);
      }
    }
    op* c = make(ri, world_peer, peer, true, data.size(), const_cast<std::byte*>(data.data()));
    c->tag = tag;
    c->total = data.size();
    submit(c);
    return c;
  }

  [[nodiscard]] op* recv(int world_peer, int peer, std::uint64_t tag, std::span<std::byte> data) {
    std::lock_guard lock(mutex_);
    check_aborted();
    check_size(data.size(), peer, "receive from");
    if (reliable_) return post_pieces(world_peer, peer, false, tag, data.data(), data.size());
    const std::size_t ri = rail_for(tag, rails_.size());
    op* c = make(ri, world_peer, peer, false, data.size(), data.data());
    c->tag = tag;
    c->placed = traits_[ri].places_pieces;
    c->total = data.size();
    submit(c);
    return c;
  }

  /// Reads completions; true once c finished, and c is freed. When it throws, c is freed (or, if
  /// it could not be cancelled, left to the engine) too.
  [[nodiscard]] bool test(op* c);

  void progress() {
    std::lock_guard lock(mutex_);
    progress_locked();
  }

  /// The request for c was destroyed before it completed. A send finishes from a copy where the
  /// rails allow it; otherwise, and for a receive, c is cancelled and the rail waited for until
  /// it lets go of the buffer (a receive until the deadline: it is the one that would write into
  /// freed memory; a send briefly). An operation still pending after that is left to the
  /// engine, which frees it when its completion arrives or the engine closes.
  void abandon(op* c) noexcept {
    std::lock_guard lock(mutex_);
    abandon_locked(c);
  }

  /// Fails every operation waiting on this engine, now and from now on, with `why`. Safe to call
  /// from any thread, without waiting for a thread that is inside a call.
  void abort(const std::string& why) { abort_.set(why); }
  [[nodiscard]] bool aborted() const noexcept { return abort_.is_set(); }
  [[nodiscard]] std::string abort_reason() const { return abort_.reason(); }

  /// The world rank known to have failed first, or -1.
  [[nodiscard]] int failed_rank() const noexcept { return watch_->failed_rank(); }
  /// World ranks alive but stopped (SIGSTOP, a debugger), where the watch can tell.
  [[nodiscard]] std::vector<int> stopped_ranks() const { return watch_->stopped_ranks(); }
  [[nodiscard]] const peer_watch& watch() const noexcept { return *watch_; }
  /// `world_peer`'s process is known gone: nothing is posted to it any more.
  [[nodiscard]] bool gone(int world_peer) const {
    return world_peer >= 0 && watch_->is_gone(world_peer);
  }

  /// The rails, in the order the transport opened them.
  [[nodiscard]] std::size_t rails() const noexcept { return rails_.size(); }
  [[nodiscard]] const std::string& rail_name(std::size_t i) const { return rails_.at(i)->name(); }
  /// Messages (and pieces) each rail has carried: how a caller sees the traffic spread.
  [[nodiscard]] std::uint64_t rail_messages(std::size_t i) const {
    std::lock_guard lock(mutex_);
    return lanes_.at(i).carried;
  }
  /// Payload bytes each rail delivered and had acknowledged (0 without acknowledgements).
  [[nodiscard]] std::uint64_t rail_bytes(std::size_t i) const {
    std::lock_guard lock(mutex_);
    return lanes_.at(i).acknowledged_bytes;
  }
  [[nodiscard]] std::size_t stripe_bytes() const noexcept { return stripe_bytes_; }
  [[nodiscard]] std::size_t max_message_size() const noexcept { return max_msg_size_; }
  [[nodiscard]] bool acknowledges() const noexcept { return reliable_; }

  /// Operations handed to the rails and not yet complete, and those waiting to be.
  [[nodiscard]] std::size_t posted_operations() const {
    std::lock_guard lock(mutex_);
    std::size_t n = 0;
    for (const auto& l : lanes_) n += l.posted_sends + l.posted_recvs;
    for (const auto& l : lanes_) n -= l.statement_recvs;  // the engine's own are not the caller's
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
    for (const auto& t : traits_) n += t.send_limit;
    return n;
  }
  [[nodiscard]] std::size_t receive_limit() const noexcept {
    std::size_t n = 0;
    for (const auto& t : traits_) n += t.receive_limit;
    return n;
  }

  /// Gives rail `r` up toward every rank, as when its link is found down (a test's stand-in for
  /// pulling a cable): its messages move to the other rails, and the peers do the same.
  void fail_rail(std::size_t r, const std::string& why);
  /// Whether messages to and from world rank `peer` still use rail `r`.
  [[nodiscard]] bool rail_in_use(int peer, std::size_t r) const;
  /// Rails still in use toward world rank `peer`.
  [[nodiscard]] std::size_t rails_in_use(int peer) const;
  /// Messages to world rank `peer` not yet acknowledged (0 without acknowledgements).
  [[nodiscard]] std::size_t unacknowledged(int peer) const;
  /// The rate each rail carries toward `peer`, in KiB/s, as the peer last reported it (0: not
  /// measured, or rails that do not measure).
  [[nodiscard]] std::vector<std::uint32_t> rail_rates(int peer) const;
  /// The shares a striped message to or from world rank `peer` is cut by where both ends agreed
  /// them (rails that do not place pieces), one per rail.
  [[nodiscard]] std::span<const std::uint64_t> shares(int peer) const {
    return shares_.at(static_cast<std::size_t>(peer));
  }

  /// Runs f(rails) under the engine's lock: for what only the transport knows how to do with
  /// its rails (memory registrations, a test's broken connection).
  template <class F>
  decltype(auto) with_rails(F&& f) {
    std::lock_guard lock(mutex_);
    return std::forward<F>(f)(rails_);
  }
  template <class F>
  decltype(auto) with_rails(F&& f) const {
    std::lock_guard lock(mutex_);
    return std::forward<F>(f)(rails_);
  }

 private:
  using role = op_role;
  using status = op_status;
  using clock = std::chrono::steady_clock;

  /// One rail's flow control: operations waiting for room, and how many are posted.
  struct lane {
    std::deque<op*> sends;
    std::deque<op*> recvs;
    std::size_t posted_sends = 0;
    std::size_t posted_recvs = 0;
    std::size_t statement_recvs = 0;       ///< of those, the engine's own (never held back)
    std::uint64_t carried = 0;             ///< messages posted or injected on this rail
    std::uint64_t acknowledged_bytes = 0;  ///< payload its peers acknowledged
    [[nodiscard]] std::deque<op*>& queue(bool is_send) noexcept { return is_send ? sends : recvs; }
    [[nodiscard]] std::size_t& posted(bool is_send) noexcept {
      return is_send ? posted_sends : posted_recvs;
    }
  };

  /// A send not yet acknowledged: a piece the caller waits for, or a copied send that completed
  /// at once.
  struct outstanding {
    op* piece = nullptr;
    std::size_t rail = 0;  ///< where it was last sent
    std::uint64_t tag = 0;
    std::uint8_t number = 0;  ///< its piece number
    std::shared_ptr<std::byte[]> copy{};
    std::size_t length = 0;
    bool held = false;  ///< not sent yet (holding)
  };
  /// Delivery to and from one world rank (acknowledgements on).
  struct link {
    std::uint32_t dead = 0;       ///< rails this rank gave up toward the peer
    std::uint32_t peer_dead = 0;  ///< rails the peer gave up: its receives there are gone
    std::uint32_t left = 0;       ///< rails the peer closed in order (its goodbye)
    std::uint64_t next_seq = 0;
    std::map<std::uint64_t, outstanding> unacked{};
    delivery::received_set received{};
    std::size_t receipts = 0;  ///< arrivals not yet acknowledged
    clock::time_point first_receipt{};
    bool owed = false;  ///< a statement must go now
    bool listed = false;
    std::vector<std::uint64_t> cut{};    ///< the latest arrivals cut short (delivery::control)
    std::vector<std::uint32_t> rates{};  ///< each rail's rate toward the peer, as it reported
    std::size_t copies = 0;              ///< unacknowledged copied sends, and their bytes
    std::size_t copy_bytes = 0;
  };

  // rail_events: what the rails report from poll().
  void done(op& o, std::size_t len, std::uint64_t data, bool has_data) override;
  void failed(op& o, rail_fault fault, const std::string& why, std::size_t sent, std::uint64_t data,
              bool has_data) override;
  void link_failed(int peer, const std::string& why) override;
  void peer_left(int peer, int culprit) override;

  // Delivery and failover (rail_failover.hpp).
  void check_reachable(int world_peer, int peer) const;
  [[nodiscard]] peer_error unreachable(int world_peer, int peer) const;
  [[nodiscard]] std::size_t place(int world_peer, std::size_t home) const;
  void deliver_before_close() noexcept;
  void track(op* c, bool urgent);
  [[nodiscard]] op* send_reliably(int world_peer, int peer, std::uint64_t tag,
                                  std::span<const std::byte> data);
  [[nodiscard]] bool holding(int world_peer) const noexcept;
  void hold(int world_peer, std::uint64_t seq);
  void release_held(int world_peer);
  void transmit_copy(int world_peer, std::uint64_t seq, outstanding& e);
  void rehome(op* c, std::size_t ri);
  [[nodiscard]] op* replace(op* c);
  void move_receive(op* c);
  void resend(int world_peer, std::uint64_t seq, outstanding& e);
  void resend_given_up(int world_peer);
  void rail_down(int world_peer, std::size_t r, const std::string& why, bool graceful = false);
  void peer_unreachable(int world_peer, std::size_t r, const std::string& why, bool graceful);
  void acknowledge(int world_peer, std::uint64_t seq);
  void note_owing(int world_peer);
  void note_receipt(int world_peer, std::uint64_t word);
  void note_cut(int world_peer, std::uint64_t word);
  void flush_control(int world_peer, std::size_t ri, bool more = false);
  void post_control(op* c);
  void post_control_receive(std::size_t ri);
  void control_arrived(op* c, std::size_t len);
  void apply_control(const delivery::control& m);
  void poll_links();
  void tend_delivery();
  [[nodiscard]] std::vector<std::uint64_t> send_shares(int world_peer) const;

  // The operations' side (this file, below the class).
  [[nodiscard]] int await_culprit() const;
  void check_aborted() const {
    if (aborted())
      throw peer_error(fmt::format("the communicator was aborted: {}", abort_reason()), -1);
  }
  void check_size(std::size_t bytes, int peer, const char* what) const {
    if (bytes > max_msg_size_)
      throw unsupported(fmt::format(
          "a {} rank {} of {} bytes exceeds {}'s largest message ({} bytes); use a smaller "
          "chunk_bytes",
          what, peer, bytes, fabric_, max_msg_size_));
  }
  void log_pending() const;
  void abandon_locked(op* c) noexcept;
  [[nodiscard]] bool detach(op* m) noexcept;
  [[nodiscard]] op* make(std::size_t ri, int world_peer, int peer, bool is_send, std::size_t length,
                         std::byte* buf);
  [[nodiscard]] bool striping(std::size_t bytes) const noexcept {
    return rails_.size() > 1 && bytes >= stripe_bytes_ && bytes > 0;
  }
  [[nodiscard]] op* post_pieces(int world_peer, int peer, bool is_send, std::uint64_t tag,
                                std::byte* buf, std::size_t bytes);
  void settle(op* c) noexcept;
  void drop_pieces(op* m) noexcept;
  void dequeue(op* c) noexcept;
  void recycle(op* c) noexcept;
  void progress_locked();
  void poll_rail(std::size_t ri);
  void submit(op* c);
  void drain(std::size_t ri, bool sends);
  [[nodiscard]] transport_error post_failed(const char* what, int peer, long rc,
                                            std::size_t ri) const {
    return transport_error(fmt::format("posting a {} rank {} on {} rail {} failed: {}", what, peer,
                                       fabric_, rails_[ri]->name(), rails_[ri]->error_text(rc)));
  }
  void retire(op* c) noexcept {
    if (!c->posted) return;
    c->posted = false;
    --lanes_[c->rail].posted(c->is_send);
  }
  void release_orphan(op* c) noexcept {
    --held_;
    recycle(c);
  }
  [[nodiscard]] std::string piece_note(const op* c) const {
    if (!c->parent || c->parent->pieces.size() + c->parent->unsettled <= 1) return {};
    return fmt::format(" (a piece, on rail {}, of a {} byte message striped over the rails)",
                       rails_[c->rail]->name(), c->parent->length);
  }
  [[nodiscard]] static bool host_readable(const Rail& r, const void* p, std::size_t n) {
    if constexpr (requires { r.host_readable(p, n); })
      return r.host_readable(p, n);
    else
      return true;
  }
  [[nodiscard]] const std::string& rail_name_locked(std::size_t r) const {
    return rails_[r]->name();
  }

  std::string name_;
  std::string fabric_;
  std::chrono::nanoseconds timeout_;
  std::chrono::nanoseconds close_grace_;
  bool leave_open_after_loss_;
  std::size_t stripe_bytes_;
  bool weigh_by_rate_;
  bool reliable_;  ///< every message numbered and acknowledged (rail_failover.hpp)
  bool placed_;    ///< every rail places pieces (rail_traits::places_pieces)
  int rank_;
  std::vector<std::unique_ptr<Rail>> rails_;
  std::vector<rail_traits> traits_;  ///< by rail
  std::vector<lane> lanes_;          ///< by rail
  std::size_t max_msg_size_ = SIZE_MAX;
  /// By world rank: the shares a message to or from that rank is striped by (agreed rails).
  std::vector<std::vector<std::uint64_t>> shares_;
  std::vector<link> links_;                 ///< by world rank (acknowledgements on)
  std::vector<int> owing_;                  ///< world ranks owed a statement, or soon
  std::vector<int> leaving_;                ///< world ranks that said goodbye on some rail
  std::deque<delivery::control> controls_;  ///< arrived, not yet applied
  std::vector<op*> control_unposted_;
  std::uint32_t warned_ = 0;      ///< rails whose failure was warned about
  std::uint32_t links_down_ = 0;  ///< rails whose link was found down
  clock::time_point next_link_poll_{};
  bool in_progress_ = false;           ///< inside progress_locked: submit() only queues
  std::size_t polling_ = 0;            ///< the rail whose events are being reported
  std::uint64_t made_ = 0;             ///< operations made (op::order)
  std::vector<std::string> failures_;  ///< why a world rank is known unreachable, or empty
  mutable std::mutex mutex_;
  std::deque<op> pool_;  ///< stable addresses: rails hold pointers
  std::vector<op*> free_;
  bool logged_pending_ = false;
  std::size_t orphans_ = 0;
  std::size_t held_ = 0;  ///< orphaned operations a rail has not given back
  abort_state abort_;
  std::shared_ptr<peer_watch> watch_;
};

}  // namespace ringzero::detail

#include "ringzero/transport/detail/rail_departures.hpp"
#include "ringzero/transport/detail/rail_failover.hpp"
#include "ringzero/transport/detail/rail_operations.hpp"
