// The rail engine's operations: construction and closing, posting with flow control, the
// completions its rails report, cancel on destroy and the verdict a failed wait throws. The
// class is rail_engine.hpp's; delivery and failover are rail_failover.hpp's.
#pragma once

#include "ringzero/transport/detail/rail_engine.hpp"

namespace ringzero::detail {

/// Operation pools of engines closed while a rail still held some of their operations: kept,
/// and reachable, for the life of the process (a rail may still write into them).
[[nodiscard]] inline std::vector<std::shared_ptr<void>>& pools_left_open() {
  static auto* kept = new std::vector<std::shared_ptr<void>>();
  return *kept;
}
[[nodiscard]] inline std::mutex& pools_left_open_mutex() {
  static std::mutex m;
  return m;
}

template <rail_kind Rail>
rail_engine<Rail>::rail_engine(config cfg, std::vector<std::unique_ptr<Rail>> rails)
    : name_(std::move(cfg.name)),
      fabric_(std::move(cfg.fabric)),
      timeout_(cfg.timeout),
      close_grace_(cfg.close_grace),
      leave_open_after_loss_(cfg.leave_open_after_loss),
      stripe_bytes_(cfg.stripe_bytes),
      weigh_by_rate_(cfg.weigh_by_rate),
      reliable_(cfg.acknowledge || rails.size() > 1),
      placed_(false),
      rank_(cfg.rank),
      rails_(std::move(rails)),
      watch_(cfg.watch ? std::move(cfg.watch) : std::make_shared<first_failure>(cfg.rank)) {
  const std::size_t most = reliable_ ? delivery::limits::max_rails : rail_engine_limits::max_rails;
  if (rails_.empty() || rails_.size() > most)
    throw invalid_argument(
        fmt::format("{} rails asked for; a {} engine drives 1 to {}", rails_.size(), name_, most));
  const auto size = static_cast<std::size_t>(cfg.size);
  if (cfg.size < 1 || cfg.rank < 0 || cfg.rank >= cfg.size)
    throw invalid_argument(
        fmt::format("{} engine: rank {} is not in [0, {})", name_, cfg.rank, cfg.size));
  placed_ = true;
  for (const auto& r : rails_) {
    traits_.push_back(r->traits());
    max_msg_size_ = std::min(max_msg_size_, traits_.back().max_message_size);
    placed_ = placed_ && traits_.back().places_pieces;
  }
  lanes_.resize(rails_.size());
  shares_ = std::move(cfg.shares);
  if (shares_.empty()) shares_.assign(size, std::vector<std::uint64_t>(rails_.size(), 1));
  if (shares_.size() != size || std::any_of(shares_.begin(), shares_.end(), [&](const auto& s) {
        return s.size() != rails_.size();
      }))
    throw invalid_argument(fmt::format("{} engine: shares for {} ranks, {} rails expected", name_,
                                       size, rails_.size()));
  failures_.assign(size, std::string());
  if (reliable_) {
    links_.assign(size, link{});
    for (std::size_t r = 0; r < rails_.size(); ++r)
      for (std::size_t i = 0; i < rail_engine_limits::control_receives; ++i)
        post_control_receive(r);
    next_link_poll_ = clock::now() + delivery::limits::link_poll;
  }
}

template <rail_kind Rail>
rail_engine<Rail>::~rail_engine() {
  deliver_before_close();
  // After a rank died or stopped, closing may wait on a lock in its memory for good (libfabric's
  // shm), and an elastic job's survivors close in the middle of forming the next generation:
  // libfabric's watchdog would end them. Left open, the rails cost their memory until exit.
  const bool lock_risk = leave_open_after_loss_ && watch_->any_lost();
  // A rail that cannot be left open (sockets: nothing of it outlives its connections) closes as
  // always, goodbyes first, so that its peers learn which rank failed first rather than blaming
  // this one; what it held was promised its buffers until the communicator is destroyed.
  constexpr bool leaves_open = requires(Rail & r) {
    r.leave_open();
  };
  if (leaves_open && (held_ > 0 || lock_risk)) {
    // Operations a rail never gave back (abandoned after a failure) still point into buffers
    // the caller has likely freed, and at a peer that may never answer: closing the rail then
    // makes its provider finish them, and ofi_rxm, tearing down a rendezvous with a stopped
    // peer, read a context of its own it had already freed (SIGSEGV in fi_close). Nothing here
    // drives progress any more, so the rails keep what they hold and the operations stay where
    // they are: an engine that failed is not closed, and its process is usually about to exit.
    if (held_ > 0)
      log::info("{}: {} operation{} still held by the rails: they are left open", name_, held_,
                held_ == 1 ? "" : "s");
    else
      log::info("{}: a rank of this host died or is stopped: the {} endpoints are left open", name_,
                fabric_);
    for (auto& r : rails_)
      if constexpr (leaves_open) r->leave_open();
    {
      std::lock_guard lock(pools_left_open_mutex());
      // A deque moves its blocks: the operations keep their addresses.
      pools_left_open().push_back(std::make_shared<std::deque<op>>(std::move(pool_)));
    }
    rails_.clear();
    watch_.reset();
    return;
  }
  if constexpr (requires(Rail & r) {
                  { r.close_step(0) } -> std::same_as<bool>;
                }) {
    // Every rail together: a peer closing its rails one by one could wait on this rank's reads
    // of another.
    const int culprit = failed_rank();
    const auto until =
        clock::now() + std::min<std::chrono::nanoseconds>(timeout_, std::chrono::seconds(2));
    for (;;) {
      bool closed = true;
      for (auto& r : rails_) closed = r->close_step(culprit) && closed;
      if (closed || clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  rails_.clear();
  watch_.reset();
}

template <rail_kind Rail>
bool rail_engine<Rail>::test(op* c) {
  std::lock_guard lock(mutex_);
  if (c->state == status::pending) progress_locked();
  const auto direction = [](const op* o) { return o->is_send ? "send to" : "receive from"; };
  switch (c->state) {
    case status::pending: {
      if (aborted()) {
        const std::string what =
            fmt::format("the communicator was aborted ({}) while a {} rank {} was pending",
                        abort_reason(), direction(c), c->peer);
        abandon_locked(c);
        throw peer_error(what, -1);
      }
      // Waits on live ranks fail too: a collective with a dead member cannot finish. A short
      // delay first lets completions a rank sent just before it exited arrive.
      const int wp = c->world_peer;
      if (const int dead = failed_rank();
          dead >= 0 && watch_->failure_age_ms() >= rail_engine_limits::settle_ms && dead != wp) {
        const std::string what =
            fmt::format("rank {} died ({}); this rank was waiting for a {} rank {} over {}", dead,
                        watch_->failure(), direction(c), c->peer, fabric_);
        abandon_locked(c);
        throw peer_error(what, dead);
      }
      const auto& gone = failures_[static_cast<std::size_t>(wp)];
      if (gone.empty() &&
          !(failed_rank() == wp && watch_->failure_age_ms() >= rail_engine_limits::settle_ms))
        return false;
      const int peer = c->peer;
      std::string what;
      int named = peer;
      if (gone.empty()) {
        what = fmt::format("rank {} died ({}) during a {} it over {}", peer, watch_->failure(),
                           direction(c), fabric_);
      } else if (const int first = failed_rank(); first >= 0 && first != wp) {
        // The ranks' verdict names who failed first; this peer may only have gone after it.
        what = fmt::format("rank {} died ({}); then this rank's {} rank {} failed over {}: {}",
                           first, watch_->failure(), direction(c), peer, fabric_, gone);
        named = first;
      } else {
        what = fmt::format("rank {} is unreachable over {}: {}", peer, fabric_, gone);
      }
      abandon_locked(c);
      throw peer_error(what, named);
    }
    case status::done:
      recycle(c);
      return true;
    case status::failed:
    case status::cancelled:
      break;
  }
  const std::string what = c->error;
  const bool lost = c->peer_loss;
  const bool cancelled = c->state == status::cancelled;
  const int peer = c->peer;
  const int world_peer = c->world_peer;
  recycle(c);
  if (cancelled) {
    // Only abandon() cancels, and it never hands the operation back: the rail cancelled it, as
    // rxm does when a connection closes. The closing is this rank's news of a death somewhere;
    // the watch says whose.
    const int dead = await_culprit();
    if (dead >= 0)
      throw peer_error(fmt::format("rank {} died ({}); {} then cancelled a pending operation ({})",
                                   dead, watch_->failure(), fabric_, what),
                       dead);
    throw peer_error(fmt::format("{} by {} (its connection to rank {} closed: has it died?)", what,
                                 fabric_, peer),
                     peer);
  }
  if (lost) {
    // The ranks' verdict names who failed first: this peer may be a survivor that raised and
    // exited after it, resetting its connections.
    if (const int first = failed_rank(); first >= 0 && first != world_peer)
      throw peer_error(
          fmt::format("rank {} died ({}); then this rank's {}", first, watch_->failure(), what),
          first);
    throw peer_error(what, peer);
  }
  throw transport_error(what);
}

template <rail_kind Rail>
int rail_engine<Rail>::await_culprit() const {
  const auto until = clock::now() + std::chrono::milliseconds(500);
  int dead = failed_rank();
  while (dead < 0 && clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    dead = failed_rank();
  }
  return dead;
}

template <rail_kind Rail>
void rail_engine<Rail>::log_pending() const {
  if (!log::enabled(log::level::info)) return;
  pending_report report;
  for (const op& o : pool_) {
    if (o.state != status::pending || !o.in_use || o.kind != role::message || o.parent) continue;
    std::string where;
    if (o.striped) {
      for (const op* p : o.pieces)
        where += fmt::format(" {}piece {} on rail {}{}", where.empty() ? "(" : "", p->piece,
                             rails_[p->rail]->name(), p->posted ? "" : " (queued)");
      if (!where.empty()) where += ")";
    } else {
      where = o.posted ? "" : " (queued in the engine)";
      if (rails_.size() > 1) where += fmt::format(" on rail {}", rails_[o.rail]->name());
    }
    report.add(o.is_send, o.peer, o.length, o.tag, o.world_peer, where);
  }
  log::info("{}: {} pending operations when a wait gave up:{}", name_, report.count(),
            report.lines());
}

template <rail_kind Rail>
void rail_engine<Rail>::abandon_locked(op* c) noexcept {
  const bool rebuffers =
      std::all_of(traits_.begin(), traits_.end(), [](const rail_traits& t) { return t.rebuffers; });
  if (c->is_send && c->state == status::pending && rebuffers && !c->parent && detach(c)) return;
  if (c->striped) {
    recycle(c);  // abandons the pieces still held
    return;
  }
  if (c->state == status::pending && !c->posted) {
    // Still waiting in the engine: no rail saw it.
    dequeue(c);
    recycle(c);
    return;
  }
  if (c->state == status::pending) {
    if (!logged_pending_) {
      logged_pending_ = true;
      try {
        log_pending();
      } catch (...) {
        // Only a diagnostic: the cancellation below matters more.
      }
    }
    rails_[c->rail]->cancel(*c);
    // Once a rank is dead or stopped, the communicator aborted, or an operation was already
    // given up on, operations that have not finished will not: drain briefly, so that the
    // error reaches the caller in time (a receive from a stopped peer that the provider had
    // matched, a rendezvous under way, cannot be cancelled, and waiting out the deadline once
    // for each would keep the caller for as many timeouts).
    const bool failing =
        aborted() || failed_rank() >= 0 || held_ > 0 || !watch_->stopped_ranks().empty() ||
        (c->world_peer >= 0 && !failures_[static_cast<std::size_t>(c->world_peer)].empty());
    const auto limit = c->is_send || failing
                           ? std::min(timeout_, rail_engine_limits::cancel_send_grace)
                           : timeout_;
    const auto deadline = clock::now() + limit;
    try {
      while (c->state == status::pending && clock::now() < deadline) progress_locked();
    } catch (const std::exception& e) {
      log::warn("{}: draining a cancelled operation failed: {}", name_, e.what());
    }
    if (c->state == status::pending) {
      // One warning per engine: after a failure, every pending operation ends up here.
      if (orphans_++ == 0)
        log::warn(
            "{}: a {} rank {} could not be cancelled; its buffer, and those of any further "
            "operations that cannot be cancelled, must stay valid until the communicator is "
            "destroyed",
            name_, c->is_send ? "send to" : "receive from", c->peer);
      else
        log::info("{}: a {} rank {} could not be cancelled either", name_,
                  c->is_send ? "send to" : "receive from", c->peer);
      c->orphaned = true;
      ++held_;
      return;
    }
  }
  recycle(c);
}

template <rail_kind Rail>
bool rail_engine<Rail>::detach(op* m) noexcept {
  std::shared_ptr<std::byte[]> copy;
  try {
    copy.reset(new std::byte[std::max<std::size_t>(m->length, 1)]);
  } catch (...) {
    return false;  // out of memory: withdrawn instead, as where the rails take no copy
  }
  if (m->length > 0) std::memcpy(copy.get(), m->buffer, m->length);
  m->buffer = copy.get();
  for (op* p : m->pieces) p->buffer = copy.get() + p->offset;
  m->own = std::move(copy);
  m->detached = true;
  return true;
}

template <rail_kind Rail>
auto rail_engine<Rail>::make(std::size_t ri, int world_peer, int peer, bool is_send,
                             std::size_t length, std::byte* buf) -> op* {
  op* c;
  if (free_.empty()) {
    pool_.emplace_back();
    c = &pool_.back();
  } else {
    c = free_.back();
    free_.pop_back();
    *c = op{};
  }
  c->rail = static_cast<std::uint8_t>(ri);
  c->world_peer = world_peer;
  c->peer = peer;
  c->is_send = is_send;
  c->length = length;
  c->buffer = buf;
  c->in_use = true;
  c->order = made_++;
  if constexpr (requires(Rail & r) { r.prepare(*c); }) {
    if (buf != nullptr) {
      try {
        rails_[ri]->prepare(*c);
      } catch (...) {
        c->in_use = false;
        free_.push_back(c);
        throw;
      }
    }
  }
  return c;
}

template <rail_kind Rail>
auto rail_engine<Rail>::post_pieces(int world_peer, int peer, bool is_send, std::uint64_t tag,
                                    std::byte* buf, std::size_t bytes) -> op* {
  const std::size_t k = rails_.size();
  const std::size_t home = rail_for(tag, k);
  // A placed receive takes any cut: one whole-buffer receive per rail, the sender says where
  // each piece goes. Else both ends cut alike, by shares they agreed.
  const bool placed_receive = placed_ && !is_send;
  std::vector<stripe_piece> parts;
  if (!striping(bytes)) {
    parts.push_back({.rail = home, .offset = 0, .length = bytes});
  } else if (placed_receive) {
    for (std::size_t r = 0; r < k; ++r) parts.push_back({.rail = r, .offset = 0, .length = bytes});
  } else if (placed_) {
    parts = stripe(bytes, send_shares(world_peer), true);
  } else {
    parts = stripe(bytes, shares(world_peer));
  }
  check_reachable(world_peer, peer);
  op* m = make(0, world_peer, peer, is_send, bytes, nullptr);
  m->striped = true;
  m->buffer = buf;
  m->tag = tag;
  m->placed = placed_receive;
  m->total = bytes;
  // Counted before any is posted: a piece may complete while the next one is submitted.
  m->unsettled = static_cast<std::uint8_t>(parts.size());
  try {
    for (const auto& part : parts) {
      const std::size_t ri = place(world_peer, part.rail);
      op* c = make(ri, world_peer, peer, is_send, part.length, buf + part.offset);
      c->tag = tag;
      c->piece = static_cast<std::uint8_t>(piece_number(part.rail, home, k));
      c->offset = part.offset;
      c->total = bytes;
      c->placed = placed_receive;
      c->parent = m;
      m->pieces.push_back(c);
      if (is_send) {
        track(c, true);
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

template <rail_kind Rail>
void rail_engine<Rail>::settle(op* c) noexcept {
  op* m = c->parent;
  if (!m) {
    if (c->detached && c->state != status::pending) recycle(c);
    return;
  }
  if (c->state != status::done && m->state == status::pending) {
    m->state = c->state;
    m->peer_loss = c->peer_loss;
    m->error = std::move(c->error);  // a move: nothing here may throw
  }
  m->got += c->got;
  if (--m->unsettled == 0 && m->state == status::pending) {
    if (m->placed && m->got != m->length) {
      m->state = status::failed;
      m->error = "the pieces of a message from rank " + std::to_string(m->peer) + " brought " +
                 std::to_string(m->got) + " of its " + std::to_string(m->length) + " bytes";
    } else {
      m->state = status::done;
    }
  }
  recycle(c);
  // A detached send is nobody's once its last piece is done with.
  if (m->detached && m->unsettled == 0) recycle(m);
}

template <rail_kind Rail>
void rail_engine<Rail>::drop_pieces(op* m) noexcept {
  std::vector<op*> pieces = std::move(m->pieces);
  m->pieces.clear();
  // Unlinked first: a piece that completes while another is drained must not reach m.
  for (op* c : pieces) c->parent = nullptr;
  for (op* c : pieces) abandon_locked(c);
}

template <rail_kind Rail>
void rail_engine<Rail>::dequeue(op* c) noexcept {
  if (c->posted) return;
  auto& queue = lanes_[c->rail].queue(c->is_send);
  queue.erase(std::remove(queue.begin(), queue.end(), c), queue.end());
}

template <rail_kind Rail>
void rail_engine<Rail>::recycle(op* c) noexcept {
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
  if constexpr (requires(Rail & r) { r.release(*c); }) rails_[c->rail]->release(*c);
  c->error.clear();
  c->own.reset();
  c->tracked = false;
  c->moving = false;
  c->in_use = false;
  free_.push_back(c);
}

template <rail_kind Rail>
void rail_engine<Rail>::progress_locked() {
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

template <rail_kind Rail>
void rail_engine<Rail>::poll_rail(std::size_t ri) {
  const std::size_t before = polling_;
  polling_ = ri;
  struct restore {
    std::size_t& at;
    std::size_t was;
    ~restore() { at = was; }
  } back{polling_, before};
  rails_[ri]->poll(static_cast<rail_events<op>&>(*this));
  drain(ri, false);
  drain(ri, true);
}

template <rail_kind Rail>
void rail_engine<Rail>::submit(op* c) {
  lane& l = lanes_[c->rail];
  auto& queue = l.queue(c->is_send);
  queue.push_back(c);
  drain(c->rail, c->is_send);
  // When c is first in line and only the rail refuses it (-EAGAIN: shm maps a peer's region
  // on the first message, rxm sets up a connection), progress and retry briefly before leaving
  // it queued: a caller that posts a send and then waits elsewhere (on the store, say) expects
  // the message to be on its way. The engine's own posts, inside progress, leave it queued.
  if (in_progress_) return;
  const std::size_t cap = c->is_send ? traits_[c->rail].send_limit : traits_[c->rail].receive_limit;
  const std::size_t own = c->is_send ? 0 : l.statement_recvs;
  if (queue.size() != 1 || queue.front() != c || l.posted(c->is_send) - own >= cap) return;
  const auto until = clock::now() + rail_engine_limits::post_progress_window;
  const bool piece = c->parent != nullptr;
  try {
    while (!c->posted && c->state == status::pending && clock::now() < until) progress_locked();
  } catch (...) {
    // Nobody holds c yet: the caller gets the exception, not a request. (A piece that finished
    // was freed when it settled.)
    if (!c->posted && !(piece && c->state != status::pending)) {
      dequeue(c);
      recycle(c);
    }
    throw;
  }
}

template <rail_kind Rail>
void rail_engine<Rail>::drain(std::size_t ri, bool sends) {
  lane& l = lanes_[ri];
  auto& queue = l.queue(sends);
  std::size_t& posted = l.posted(sends);
  const std::size_t cap = sends ? traits_[ri].send_limit : traits_[ri].receive_limit;
  const std::size_t own = sends ? 0 : l.statement_recvs;
  while (!queue.empty() && posted - own < cap) {
    op* c = queue.front();
    if (c->is_send && gone(c->world_peer)) {
      // Into a dead process's shared memory a send may wait on the lock it died holding.
      queue.pop_front();
      c->state = status::failed;
      c->peer_loss = true;
      c->error = fmt::format("a send to rank {} failed: its process is gone (not posted)", c->peer);
      if (c->kind != role::message) {
        recycle(c);
        continue;
      }
      settle(c);
      continue;
    }
    const long rc = rails_[ri]->post(*c);
    if (rc == -EAGAIN) return;
    queue.pop_front();
    if (rc != 0) {
      // A failure of that operation alone: its test() reports it.
      c->state = status::failed;
      c->error = post_failed(c->is_send ? "send to" : "receive from", c->peer, rc, ri).what();
      if (c->kind != role::message) {
        // The engine's own sending: what it carried stays owed and goes again.
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

template <rail_kind Rail>
void rail_engine<Rail>::done(op& o, std::size_t len, std::uint64_t data, bool has_data) {
  op* c = &o;
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
  const bool cut = !c->is_send && !c->placed && len != c->length;
  // A message that arrived is acknowledged even when its size was wrong: it was consumed, and
  // its sender completes (the receiver's error names the mismatch).
  if (reliable_ && !c->is_send) {
    if (has_data && cut)
      note_cut(c->world_peer, data);
    else if (has_data)
      note_receipt(c->world_peer, data);
    else
      log::warn("{}: a message from rank {} came without its sequence number", name_, c->peer);
  }
  if (cut) {
    c->state = status::failed;
    c->error = fmt::format(
        "message size mismatch with rank {}: posted a {} byte receive{}, the peer sent {} bytes "
        "(ranks disagree on the collective's count or type?)",
        c->peer, c->length, piece_note(c), len);
  } else {
    c->got = len;
    c->state = status::done;
  }
  settle(c);
}

template <rail_kind Rail>
void rail_engine<Rail>::failed(op& o, rail_fault fault, const std::string& why, std::size_t sent,
                               std::uint64_t data, bool has_data) {
  op* c = &o;
  retire(c);
  if (c->orphaned) return release_orphan(c);
  const std::size_t ri = c->rail;
  const std::string& rail = rails_[ri]->name();
  if (c->kind == role::control_recv) {
    --lanes_[ri].statement_recvs;
    if (fault == rail_fault::cancelled) return recycle(c);
    log::info("{}: a statement receive on rail {} failed: {}", name_, rail, why);
    control_unposted_.push_back(c);
    return;
  }
  if (c->moving) return;  // cancelled to move off a failed rail: rail_down moves it
  const auto direction = c->is_send ? "send to" : "receive from";
  // With acknowledgements, an error (or a cancellation nobody asked for) ends the rail toward
  // this peer, not the message: it moves to the rails left. Only when none is left is the peer
  // unreachable, and its operations fail.
  if (reliable_ && fault != rail_fault::truncated &&
      (fault != rail_fault::cancelled || c->parent != nullptr)) {
    const int wp = c->world_peer;
    const bool piece = c->kind == role::message;
    if (c->kind == role::control_send) links_[static_cast<std::size_t>(wp)].owed = true;
    if (piece && c->is_send) c->wire_done = true;
    if (!piece) recycle(c);  // a copy's or a statement's sending: what it sent stays owed
    const link& l = links_[static_cast<std::size_t>(wp)];
    rail_down(wp, ri, why, (l.left & (std::uint32_t{1} << ri)) != 0);
    if (!piece || !c->in_use || c->state != status::pending) return;
    if (failures_[static_cast<std::size_t>(wp)].empty()) {
      if (!c->is_send && !c->posted && (l.dead & (std::uint32_t{1} << c->rail))) move_receive(c);
      return;
    }
    c->state = status::failed;
    c->peer_loss = true;
    c->error = fmt::format("{} rank {} failed: {}", direction, c->peer,
                           failures_[static_cast<std::size_t>(wp)]);
    return settle(c);
  }
  if (fault == rail_fault::cancelled) {
    c->state = status::cancelled;
    c->error = fmt::format("{} rank {} was cancelled", direction, c->peer);
    return settle(c);
  }
  c->state = status::failed;
  if (fault == rail_fault::truncated) {
    // Consumed, if cut short: acknowledged, so that its sender completes.
    if (reliable_ && c->kind == role::message && !c->is_send && has_data)
      note_cut(c->world_peer, data);
    c->error = fmt::format(
        "message size mismatch with rank {}: posted a {} byte receive{}, the peer sent {} "
        "(ranks disagree on the collective's count or type?): {}",
        c->peer, c->placed ? c->total : c->length, piece_note(c),
        sent ? fmt::format("{} bytes", sent) : std::string("more"), why);
    return settle(c);
  }
  c->peer_loss = true;
  c->error = fmt::format("{} rank {} failed over {}{}: {}", direction, c->peer, fabric_,
                         rails_.size() > 1 ? fmt::format(" rail {}", rail) : "", why);
  if (fault == rail_fault::peer_lost && c->world_peer >= 0) {
    failures_[static_cast<std::size_t>(c->world_peer)] = why;
    watch_->suspect(c->world_peer, fmt::format("its connection failed: {}", why));
  }
  settle(c);
}

}  // namespace ringzero::detail
