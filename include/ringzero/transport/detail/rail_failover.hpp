// The rail engine's delivery over rails that may fail (rail_engine.hpp has the class): each
// message, or piece of a striped one, carries a sequence number per ordered pair of ranks
// (delivery::cq_word) and a piece number of its own; the receiver records the numbers it has
// and sends that statement, whole, to the sender (delivery::control, received by receives kept
// posted on every rail): at once for a message whose sender waits, else after
// delivery::limits::ack_batch messages or ack_delay, or riding with the next small message
// where the rail bundles. A send up to delivery::limits::copy_bytes (host memory) is copied and
// complete on return; a larger one completes when acknowledged. A rail is given up toward a
// peer when its link is found down (link_state, every delivery::limits::link_poll), when an
// operation on it fails or its connection breaks, when the peer's statement says the peer gave
// it up, or when the peer closes it; giving up cancels this rank's receives on the rail (each
// is then either received or moved, never both), moves them and anything still queued to the
// next rail up that is left (delivery::substitute, which both ends compute alike), and tells
// the peer. The sender sends again only what the receiver's statement shows it gave up and does
// not have. Messages with one (peer, tag) keep their order across a failover: from the moment a
// rank gives a rail up until the peer says it has too, new sends to that peer wait, then go in
// order after what goes again; moved receives are posted again in the order they were first
// posted. With no rail left the peer is unreachable and its operations fail naming it.
#pragma once

#include "ringzero/transport/detail/rail_engine.hpp"

namespace ringzero::detail {

template <rail_kind Rail>
void rail_engine<Rail>::fail_rail(std::size_t r, const std::string& why) {
  std::lock_guard lock(mutex_);
  if (!reliable_ || r >= rails_.size() || rails_.size() < 2)
    throw invalid_argument(fmt::format("fail_rail({}): this {} engine has {} rail{}", r, name_,
                                       rails_.size(), rails_.size() == 1 ? "" : "s"));
  for (std::size_t wp = 0; wp < links_.size(); ++wp)
    if (static_cast<int>(wp) != rank_) rail_down(static_cast<int>(wp), r, why);
  progress_locked();
}

template <rail_kind Rail>
bool rail_engine<Rail>::rail_in_use(int peer, std::size_t r) const {
  std::lock_guard lock(mutex_);
  if (!reliable_) return r < rails_.size() && failures_.at(static_cast<std::size_t>(peer)).empty();
  return (links_.at(static_cast<std::size_t>(peer)).dead & (std::uint32_t{1} << r)) == 0;
}

template <rail_kind Rail>
std::size_t rail_engine<Rail>::rails_in_use(int peer) const {
  std::size_t n = 0;
  for (std::size_t r = 0; r < rails_.size(); ++r) n += rail_in_use(peer, r) ? 1 : 0;
  return n;
}

template <rail_kind Rail>
std::size_t rail_engine<Rail>::unacknowledged(int peer) const {
  std::lock_guard lock(mutex_);
  return reliable_ ? links_.at(static_cast<std::size_t>(peer)).unacked.size() : 0;
}

template <rail_kind Rail>
std::vector<std::uint32_t> rail_engine<Rail>::rail_rates(int peer) const {
  std::lock_guard lock(mutex_);
  std::vector<std::uint32_t> out(rails_.size(), 0);
  if (!reliable_) return out;
  const auto& rates = links_.at(static_cast<std::size_t>(peer)).rates;
  for (std::size_t i = 0; i < out.size() && i < rates.size(); ++i) out[i] = rates[i];
  return out;
}

template <rail_kind Rail>
std::vector<std::uint64_t> rail_engine<Rail>::send_shares(int world_peer) const {
  const link& l = links_[static_cast<std::size_t>(world_peer)];
  std::vector<std::uint32_t> rates(rails_.size(), 0);
  if (weigh_by_rate_)
    for (std::size_t i = 0; i < rates.size() && i < l.rates.size(); ++i) rates[i] = l.rates[i];
  return shares_by_rate(rates, l.dead);
}

template <rail_kind Rail>
void rail_engine<Rail>::check_reachable(int world_peer, int peer) const {
  if (delivery::substitute(0, links_[static_cast<std::size_t>(world_peer)].dead, rails_.size()) < 0)
    throw unreachable(world_peer, peer);
}

template <rail_kind Rail>
peer_error rail_engine<Rail>::unreachable(int world_peer, int peer) const {
  const auto& why = failures_[static_cast<std::size_t>(world_peer)];
  // A peer that closed its transport may be a survivor that left after another rank failed:
  // the error names the rank that failed first, as every survivor's does.
  if (const int first = failed_rank(); first >= 0 && first != world_peer)
    return peer_error(fmt::format("rank {} died ({}); then rank {} became unreachable over {}: {}",
                                  first, watch_->failure(), peer, fabric_, why),
                      first);
  return peer_error(fmt::format("rank {} is unreachable over {}: {}", peer, fabric_, why), peer);
}

template <rail_kind Rail>
std::size_t rail_engine<Rail>::place(int world_peer, std::size_t home) const {
  if (!reliable_) return home;
  const int r =
      delivery::substitute(home, links_[static_cast<std::size_t>(world_peer)].dead, rails_.size());
  if (r < 0) throw unreachable(world_peer, world_peer);
  return static_cast<std::size_t>(r);
}

template <rail_kind Rail>
void rail_engine<Rail>::deliver_before_close() noexcept {
  // What this rank sent reaches its peers (a small send completed on return, so only an
  // acknowledgement says it arrived) and what it received is acknowledged, so that a peer still
  // waiting for that is not left to time out. Bounded by close_grace, and skipped once anything
  // failed.
  if (!reliable_ || links_.empty() || aborted() || failed_rank() >= 0) return;
  try {
    std::lock_guard lock(mutex_);
    const auto until = clock::now() + std::min(timeout_, close_grace_);
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
        log::info("{}: closing with {} message{} not acknowledged", name_, waiting,
                  waiting == 1 ? "" : "s");
        break;
      }
      std::this_thread::yield();
    }
    if (told) {
      const auto linger = clock::now() + rail_engine_limits::close_linger;
      while (clock::now() < linger) progress_locked();
    }
  } catch (const std::exception& e) {
    log::info("{}: delivering before close failed: {}", name_, e.what());
  }
}

template <rail_kind Rail>
void rail_engine<Rail>::track(op* c, bool urgent) {
  link& l = links_[static_cast<std::size_t>(c->world_peer)];
  c->seq = l.next_seq++;
  c->with_data = true;
  c->data = delivery::cq_word::make(c->seq, urgent);
  c->tracked = true;
  l.unacked.emplace(c->seq, outstanding{.piece = c,
                                        .rail = c->rail,
                                        .tag = c->tag,
                                        .number = c->piece,
                                        .copy = nullptr,
                                        .length = c->length});
}

template <rail_kind Rail>
auto rail_engine<Rail>::send_reliably(int world_peer, int peer, std::uint64_t tag,
                                      std::span<const std::byte> data) -> op* {
  // A small send (host memory) is copied, sent from the copy and complete on return, as an
  // injected send is, while the peer's unacknowledged copies stay within their bounds; a larger
  // one is held until the receiver acknowledges every piece.
  const link& to = links_[static_cast<std::size_t>(world_peer)];
  const bool copy = !striping(data.size()) && data.size() <= delivery::limits::copy_bytes &&
                    to.copies < delivery::limits::max_copies &&
                    to.copy_bytes + data.size() <= delivery::limits::max_copy_bytes &&
                    host_readable(*rails_.front(), data.data(), data.size());
  if (!copy)
    return post_pieces(world_peer, peer, true, tag, const_cast<std::byte*>(data.data()),
                       data.size());
  check_reachable(world_peer, peer);
  std::shared_ptr<std::byte[]> bytes(new std::byte[std::max<std::size_t>(data.size(), 1)]);
  if (!data.empty()) std::memcpy(bytes.get(), data.data(), data.size());
  link& l = links_[static_cast<std::size_t>(world_peer)];
  const std::uint64_t seq = l.next_seq++;
  ++l.copies;
  l.copy_bytes += data.size();
  auto& e = l.unacked
                .emplace(seq, outstanding{.piece = nullptr,
                                          .rail = rail_for(tag, rails_.size()),
                                          .tag = tag,
                                          .number = 0,
                                          .copy = std::move(bytes),
                                          .length = data.size()})
                .first->second;
  if (holding(world_peer))
    e.held = true;
  else
    transmit_copy(world_peer, seq, e);
  return nullptr;
}

template <rail_kind Rail>
bool rail_engine<Rail>::holding(int world_peer) const noexcept {
  // This rank gave a rail up that the peer has not yet said it gave up: until it has, what that
  // rail held cannot go again (the peer may still take it there), and a new message with the
  // tag of one that must go again would overtake it.
  const link& l = links_[static_cast<std::size_t>(world_peer)];
  return (l.dead & ~l.peer_dead) != 0;
}

template <rail_kind Rail>
void rail_engine<Rail>::hold(int world_peer, std::uint64_t seq) {
  auto& e = links_[static_cast<std::size_t>(world_peer)].unacked.at(seq);
  e.held = true;
  if (e.piece) e.piece->held = true;
}

template <rail_kind Rail>
void rail_engine<Rail>::release_held(int world_peer) {
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

template <rail_kind Rail>
void rail_engine<Rail>::transmit_copy(int world_peer, std::uint64_t seq, outstanding& e) {
  const std::size_t ri = place(world_peer, e.rail);
  e.rail = ri;
  Rail& r = *rails_[ri];
  const std::uint64_t word = delivery::cq_word::make(seq, false);
  const std::span<const std::byte> bytes(e.copy.get(), e.length);
  if (e.length <= traits_[ri].inject_size && lanes_[ri].sends.empty() && !gone(world_peer)) {
    if constexpr (requires { r.inject(rail_message{}); }) {
      // Arrivals the peer is owed a statement for ride with this message where the rail bundles
      // them: one system call for both, as a reply carries its acknowledgement.
      if (traits_[ri].bundles && links_[static_cast<std::size_t>(world_peer)].receipts > 0)
        flush_control(world_peer, ri, true);
      const long rc = r.inject({.peer = world_peer,
                                .bytes = bytes,
                                .tag = e.tag,
                                .piece = e.number,
                                .with_data = true,
                                .data = word,
                                .offset = 0,
                                .total = e.length});
      if (rc == 0) {
        ++lanes_[ri].carried;
        return;
      }
      // Refused or failed: posted instead, where a failure is the rail's to report.
    }
  }
  op* w = make(ri, world_peer, world_peer, true, e.length, e.copy.get());
  w->kind = role::copy;
  w->tag = e.tag;
  w->piece = e.number;
  w->with_data = true;
  w->data = word;
  w->seq = seq;
  w->total = e.length;
  w->own = e.copy;
  submit(w);
}

template <rail_kind Rail>
void rail_engine<Rail>::rehome(op* c, std::size_t ri) {
  if constexpr (requires(Rail & r) { r.release(*c); }) rails_[c->rail]->release(*c);
  c->rail = static_cast<std::uint8_t>(ri);
  if constexpr (requires(Rail & r) { r.prepare(*c); })
    if (c->buffer != nullptr) rails_[ri]->prepare(*c);
}

template <rail_kind Rail>
auto rail_engine<Rail>::replace(op* c) -> op* {
  // A fresh operation standing in for c, which a rail still holds (on a failed rail): c is left
  // to the rail (orphaned, freed if it ever completes), the new one takes its place in its
  // message and among the unacknowledged. A rail that rebuffers sends c's rest from a copy of
  // its own, so that the caller's buffer may go once the message is done.
  op* n = make(c->rail, c->world_peer, c->peer, c->is_send, c->length, nullptr);
  n->buffer = c->buffer;
  n->tag = c->tag;
  n->piece = c->piece;
  n->kind = c->kind;
  n->with_data = c->with_data;
  n->data = c->data;
  n->seq = c->seq;
  n->tracked = c->tracked;
  n->acked = c->acked;
  n->own = c->own;
  n->order = c->order;
  n->held = c->held;
  n->offset = c->offset;
  n->total = c->total;
  n->placed = c->placed;
  n->parent = c->parent;
  if (c->parent) std::replace(c->parent->pieces.begin(), c->parent->pieces.end(), c, n);
  if (c->tracked) {
    auto& l = links_[static_cast<std::size_t>(c->world_peer)];
    if (auto it = l.unacked.find(c->seq); it != l.unacked.end() && it->second.piece == c)
      it->second.piece = n;
  }
  if (c->is_send && traits_[c->rail].rebuffers && c->length > 0) {
    std::shared_ptr<std::byte[]> copy(new std::byte[c->length]);
    std::memcpy(copy.get(), c->buffer, c->length);
    c->buffer = copy.get();
    c->own = std::move(copy);
    rails_[c->rail]->cancel(*c);
  }
  c->parent = nullptr;
  c->tracked = false;
  c->moving = false;
  c->orphaned = true;
  ++held_;
  return n;
}

template <rail_kind Rail>
void rail_engine<Rail>::move_receive(op* c) {
  c->moving = false;
  rehome(c, place(c->world_peer, c->rail));
  submit(c);
}

template <rail_kind Rail>
void rail_engine<Rail>::resend(int world_peer, std::uint64_t seq, outstanding& e) {
  e.held = false;
  if (!e.piece) return transmit_copy(world_peer, seq, e);
  op* c = e.piece;
  c->held = false;
  if (c->posted) c = replace(c);
  dequeue(c);
  rehome(c, place(world_peer, c->rail));
  e.rail = c->rail;
  c->wire_done = false;
  submit(c);
}

template <rail_kind Rail>
void rail_engine<Rail>::resend_given_up(int world_peer) {
  link& l = links_[static_cast<std::size_t>(world_peer)];
  std::vector<std::uint64_t> todo;
  for (const auto& [seq, e] : l.unacked)  // held ones were never sent: release_held sends them
    if (!e.held && (l.peer_dead & (std::uint32_t{1} << e.rail))) todo.push_back(seq);
  if (!todo.empty())
    log::info("{}: {} unacknowledged message{} to rank {} sent again over the rails left", name_,
              todo.size(), todo.size() == 1 ? "" : "s", world_peer);
  for (const auto seq : todo) {
    auto it = l.unacked.find(seq);
    if (it != l.unacked.end() && !it->second.held &&
        (l.peer_dead & (std::uint32_t{1} << it->second.rail)))
      resend(world_peer, seq, it->second);
  }
}

template <rail_kind Rail>
void rail_engine<Rail>::rail_down(int world_peer, std::size_t r, const std::string& why,
                                  bool graceful) {
  link& l = links_[static_cast<std::size_t>(world_peer)];
  const std::uint32_t bit = std::uint32_t{1} << r;
  if (l.dead & bit) return;
  l.dead |= bit;
  const int next = delivery::substitute(r, l.dead, rails_.size());
  if (next < 0) return peer_unreachable(world_peer, r, why, graceful);
  // A peer that closed a rail in order is closing them all, and receives nothing more: none of
  // this rank's messages to it are moved or sent again.
  if (graceful) {
    l.peer_dead |= bit;
    return;
  }
  if ((warned_ & bit) == 0 && world_peer != rank_) {
    warned_ |= bit;
    log::warn("{}: rail {} failed toward rank {} ({}); its messages go over rail {}{}", name_,
              rail_name_locked(r), world_peer, why,
              rail_name_locked(static_cast<std::size_t>(next)),
              std::popcount(~l.dead & ((std::uint32_t{1} << rails_.size()) - 1)) > 1
                  ? " and the others left"
                  : "");
  } else {
    log::info("{}: rail {} given up toward rank {} too ({})", name_, rail_name_locked(r),
              world_peer, why);
  }
  std::vector<op*> queued;
  std::vector<op*> cancelled;
  for (op& o : pool_) {
    if (!o.in_use || o.orphaned || o.striped || o.held || o.kind == role::control_recv ||
        o.world_peer != world_peer || o.rail != r || o.state != status::pending)
      continue;
    if (!o.posted) {
      // Waiting in the engine: never sent, so it may go elsewhere at once (a piece whose rail
      // completion came waits for its acknowledgement, not for a rail).
      if (!o.is_send || !o.wire_done) queued.push_back(&o);
    } else if (!o.is_send) {
      o.moving = true;
      rails_[r]->cancel(o);
      cancelled.push_back(&o);
    }
  }
  // Unsent sends wait (hold) and go, in order, with what must go again; receives move in the
  // order they were posted, so that two with one tag still match in that order.
  std::vector<op*> receives;
  for (op* c : queued) {
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
    // A copy's sending or a statement: the copy is sent again from its entry, a newer statement
    // goes instead (owed below).
    if (c->kind == role::copy && it != l.unacked.end() && it->second.piece == nullptr)
      it->second.held = true;
    recycle(c);
  }
  const auto until = clock::now() + rail_engine_limits::cancel_send_grace;
  const auto unresolved = [&] {
    return std::any_of(cancelled.begin(), cancelled.end(),
                       [](const op* c) { return c->in_use && c->moving && c->posted; });
  };
  while (unresolved() && clock::now() < until) poll_rail(r);
  for (op* c : cancelled) {
    if (!c->in_use || !c->moving) continue;  // it arrived before the cancellation took
    receives.push_back(c->posted ? replace(c) : c);
  }
  std::sort(receives.begin(), receives.end(),
            [](const op* a, const op* b) { return a->order < b->order; });
  for (op* c : receives) move_receive(c);
  l.owed = true;
  note_owing(world_peer);
  resend_given_up(world_peer);
  release_held(world_peer);
}

template <rail_kind Rail>
void rail_engine<Rail>::peer_unreachable(int world_peer, std::size_t r, const std::string& why,
                                         bool graceful) {
  auto& failure = failures_[static_cast<std::size_t>(world_peer)];
  if (!failure.empty()) return;
  if (graceful)
    failure = "it closed its transport";
  else if (rails_.size() > 1)
    failure = fmt::format("its last rail, {}, failed: {}", rail_name_locked(r), why);
  else
    failure = why;
  if (graceful)
    log::info("{}: rank {} closed its transport", name_, world_peer);
  else
    log::warn("{}: rank {} is unreachable: {}", name_, world_peer, failure);
  link& l = links_[static_cast<std::size_t>(world_peer)];
  for (auto& [seq, e] : l.unacked)
    if (e.piece) e.piece->tracked = false;
  l.unacked.clear();
  l.copies = 0;
  l.copy_bytes = 0;
  if (!graceful) watch_->suspect(world_peer, failure);
}

template <rail_kind Rail>
void rail_engine<Rail>::acknowledge(int world_peer, std::uint64_t seq) {
  // The receiver has `seq`: the message is done with (a piece settles once its rail has given
  // it back too).
  link& l = links_[static_cast<std::size_t>(world_peer)];
  auto it = l.unacked.find(seq);
  if (it == l.unacked.end()) return;
  op* c = it->second.piece;
  lanes_[it->second.rail].acknowledged_bytes += it->second.length;
  if (!c) {
    --l.copies;
    l.copy_bytes -= it->second.length;
  }
  l.unacked.erase(it);
  if (!c) return;
  c->tracked = false;
  c->acked = true;
  if (c->posted) return;
  dequeue(c);
  c->state = status::done;
  settle(c);
}

template <rail_kind Rail>
void rail_engine<Rail>::note_owing(int world_peer) {
  link& l = links_[static_cast<std::size_t>(world_peer)];
  if (l.listed) return;
  l.listed = true;
  owing_.push_back(world_peer);
}

template <rail_kind Rail>
void rail_engine<Rail>::note_receipt(int world_peer, std::uint64_t word) {
  link& l = links_[static_cast<std::size_t>(world_peer)];
  l.received.add(l.received.expand(word));
  if (l.receipts++ == 0) l.first_receipt = clock::now();
  if (delivery::cq_word::urgent(word)) l.owed = true;
  note_owing(world_peer);
}

template <rail_kind Rail>
void rail_engine<Rail>::note_cut(int world_peer, std::uint64_t word) {
  // Received, and named to its sender, whose other pieces of it will never be.
  link& l = links_[static_cast<std::size_t>(world_peer)];
  l.cut.push_back(l.received.expand(word));
  if (l.cut.size() > delivery::limits::max_cut) l.cut.erase(l.cut.begin());
  note_receipt(world_peer, word | delivery::cq_word::urgent_bit);
}

template <rail_kind Rail>
void rail_engine<Rail>::flush_control(int world_peer, std::size_t ri, bool more) {
  // This rank's statement (rails given up, messages received, rates measured) to `world_peer`,
  // on rail `ri` (SIZE_MAX: the lowest both still use); stays owed when the rail has no room.
  link& l = links_[static_cast<std::size_t>(world_peer)];
  if (ri == SIZE_MAX) {
    const int lowest = delivery::substitute(0, l.dead, rails_.size());
    if (lowest < 0) {
      l.owed = false;
      l.receipts = 0;
      return;
    }
    ri = static_cast<std::size_t>(lowest);
  }
  std::vector<std::uint32_t> rates(rails_.size(), 0);
  for (std::size_t i = 0; i < rails_.size(); ++i)
    if constexpr (requires(const Rail& r) { r.arrival_rate(0); })
      rates[i] = rails_[i]->arrival_rate(world_peer);
  const auto bytes = delivery::control::encode(rank_, l.dead, l.received, l.cut, rates);
  Rail& r = *rails_[ri];
  long rc = 1;
  if (bytes.size() <= traits_[ri].inject_size && lanes_[ri].sends.empty() && !gone(world_peer)) {
    if constexpr (requires { r.inject(rail_message{}); }) {
      rc = r.inject({.peer = world_peer,
                     .bytes = bytes,
                     .piece = delivery::limits::control_piece,
                     .total = bytes.size(),
                     .more = more});
      if (rc == -EAGAIN) return;
    }
  }
  if (rc != 0) {
    std::shared_ptr<std::byte[]> own(new std::byte[bytes.size()]);
    std::memcpy(own.get(), bytes.data(), bytes.size());
    op* w = make(ri, world_peer, world_peer, true, bytes.size(), own.get());
    w->kind = role::control_send;
    w->piece = delivery::limits::control_piece;
    w->total = bytes.size();
    w->own = std::move(own);
    submit(w);
  }
  l.owed = false;
  l.receipts = 0;
}

template <rail_kind Rail>
void rail_engine<Rail>::post_control(op* c) {
  const long rc = rails_[c->rail]->post(*c);
  if (rc == -EAGAIN) {
    control_unposted_.push_back(c);
    return;
  }
  if (rc != 0) throw post_failed("statement receive from", -1, rc, c->rail);
  c->posted = true;
  ++lanes_[c->rail].posted_recvs;
  ++lanes_[c->rail].statement_recvs;
}

template <rail_kind Rail>
void rail_engine<Rail>::post_control_receive(std::size_t ri) {
  std::shared_ptr<std::byte[]> own(new std::byte[delivery::control::max_bytes()]);
  op* c = make(ri, -1, -1, false, delivery::control::max_bytes(), own.get());
  c->kind = role::control_recv;
  c->piece = delivery::limits::control_piece;
  c->ignore = ~std::uint64_t{0};
  c->total = c->length;
  c->own = std::move(own);
  post_control(c);
}

template <rail_kind Rail>
void rail_engine<Rail>::control_arrived(op* c, std::size_t len) {
  --lanes_[c->rail].statement_recvs;
  if (auto m = delivery::control::decode(
          std::span<const std::byte>(c->own.get(), std::min(len, c->length))))
    controls_.push_back(std::move(*m));
  else
    log::warn("{}: a statement of {} bytes on rail {} is not one; dropped", name_, len,
              rails_[c->rail]->name());
  post_control(c);
}

template <rail_kind Rail>
void rail_engine<Rail>::apply_control(const delivery::control& m) {
  // A peer's statement: rails it gave up are given up here too, what it has is done with, and
  // what it gave up is sent again.
  if (m.from < 0 || static_cast<std::size_t>(m.from) >= links_.size() || m.from == rank_) {
    log::warn("{}: a statement from rank {}, which is no peer of this job; dropped", name_, m.from);
    return;
  }
  link& l = links_[static_cast<std::size_t>(m.from)];
  const std::uint32_t all = (std::uint32_t{1} << rails_.size()) - 1;
  l.peer_dead |= m.dead & all;
  if (!m.rates.empty()) {
    l.rates.assign(rails_.size(), 0);
    for (std::size_t i = 0; i < l.rates.size() && i < m.rates.size(); ++i) l.rates[i] = m.rates[i];
  }
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
      for (const op* p : it->second.piece->parent->pieces)
        if (p->tracked) done.push_back(p->seq);
  for (const auto seq : done) acknowledge(m.from, seq);
  resend_given_up(m.from);
  release_held(m.from);
}

}  // namespace ringzero::detail
