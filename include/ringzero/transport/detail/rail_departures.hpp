// The rail engine's view of links and peers going away (rail_engine.hpp has the class,
// rail_failover.hpp the delivery it serves): links polled for their state, the work left after
// completions were read (statement receives to post again, statements to apply, peers whose
// goodbyes were read), and what the rails report of a connection lost or a peer that left. Each
// ends in rail_down() or in the peer's failure, which rail_failover.hpp carries out.
#pragma once

#include "ringzero/transport/detail/rail_engine.hpp"

namespace ringzero::detail {

template <rail_kind Rail>
void rail_engine<Rail>::poll_links() {
  for (std::size_t r = 0; r < rails_.size(); ++r) {
    const std::uint32_t bit = std::uint32_t{1} << r;
    if (links_down_ & bit) continue;
    const std::string state = rails_[r]->link_state();
    if (state.empty()) continue;
    links_down_ |= bit;
    for (std::size_t wp = 0; wp < links_.size(); ++wp)
      if (static_cast<int>(wp) != rank_)
        rail_down(static_cast<int>(wp), r, fmt::format("its link is {}", state));
  }
}

template <rail_kind Rail>
void rail_engine<Rail>::tend_delivery() {
  // After the completions were read: statement receives to post, statements to apply, links
  // to look at, acknowledgements to send.
  if (!control_unposted_.empty()) {
    auto again = std::move(control_unposted_);
    control_unposted_.clear();
    for (op* c : again) post_control(c);
  }
  while (!controls_.empty()) {
    const delivery::control m = std::move(controls_.front());
    controls_.pop_front();
    apply_control(m);
  }
  // A peer gone once it said goodbye on every rail it kept (tend_delivery reads its statements
  // first: they may acknowledge everything this rank waits for).
  const std::uint32_t every = (std::uint32_t{1} << rails_.size()) - 1;
  for (const int wp : std::exchange(leaving_, {})) {
    const link& l = links_[static_cast<std::size_t>(wp)];
    if ((l.left | l.dead) != every) continue;
    for (std::size_t r = 0; r < rails_.size(); ++r)
      if ((l.left & ~l.dead) & (std::uint32_t{1} << r))
        rail_down(wp, r, "it closed its transport", true);
  }
  const auto now = clock::now();
  if (now >= next_link_poll_) {
    next_link_poll_ = now + delivery::limits::link_poll;
    if (rails_.size() > 1) poll_links();
  }
  for (std::size_t i = 0; i < owing_.size();) {
    const int wp = owing_[i];
    link& l = links_[static_cast<std::size_t>(wp)];
    if (l.owed || l.receipts >= delivery::limits::ack_batch ||
        (l.receipts > 0 && now - l.first_receipt >= delivery::limits::ack_delay))
      flush_control(wp, SIZE_MAX);
    if (!l.owed && l.receipts == 0) {
      l.listed = false;
      owing_[i] = owing_.back();
      owing_.pop_back();
    } else {
      ++i;
    }
  }
}

template <rail_kind Rail>
void rail_engine<Rail>::link_failed(int peer, const std::string& why) {
  if (peer < 0 || static_cast<std::size_t>(peer) >= failures_.size()) return;
  if (!reliable_) {
    if (failures_[static_cast<std::size_t>(peer)].empty()) {
      failures_[static_cast<std::size_t>(peer)] = why;
      watch_->suspect(peer, fmt::format("its connection failed: {}", why));
    }
    return;
  }
  const link& l = links_[static_cast<std::size_t>(peer)];
  rail_down(peer, polling_, why, (l.left & (std::uint32_t{1} << polling_)) != 0);
}

template <rail_kind Rail>
void rail_engine<Rail>::peer_left(int peer, int culprit) {
  if (peer < 0 || static_cast<std::size_t>(peer) >= failures_.size()) return;
  // Every survivor names the rank the leaving one saw fail first, as a board would make it.
  if (culprit >= 0 && culprit != rank_)
    watch_->report(culprit, fmt::format("rank {} reported it", peer));
  if (!reliable_) {
    if (failures_[static_cast<std::size_t>(peer)].empty())
      failures_[static_cast<std::size_t>(peer)] = "it closed its transport";
    return;
  }
  // Given up once it left every rail, and once the statements that arrived before its goodbyes
  // were read (tend_delivery): a rail reports messages it kept for the receives posted again as
  // each statement completes after the goodbye that followed them.
  links_[static_cast<std::size_t>(peer)].left |= std::uint32_t{1} << polling_;
  if (std::find(leaving_.begin(), leaving_.end(), peer) == leaving_.end()) leaving_.push_back(peer);
}

}  // namespace ringzero::detail
