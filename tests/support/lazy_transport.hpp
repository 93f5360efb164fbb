// A transport of N ranks as N threads that is as lazy as transport/concept.hpp allows, so that
// the conformance suite shows the library relies on nothing more than the concept promises:
//
// - nothing moves when a message is posted, only inside test() and progress();
// - a send first waits a random number of its sender's progress calls, then moves in pieces of
//   random size through a small bounded channel, which only the receiver's progress drains;
//   so a message moves only while both of its ranks make progress;
// - a request that finished is reported by a later test(), not by the one that saw it finish;
// - test(req) advances every operation of its rank, which is all the progress rule requires.
//
// options::test_advances_all = false breaks that rule (test(req) then advances req alone), for
// the test that shows the suite would catch a transport that does.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "ringzero/communicator.hpp"
#include "ringzero/error.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/abort_state.hpp"
#include "ringzero/transport/detail/request.hpp"
#include "ringzero/tuning/defaults.hpp"

namespace ringzero::testing::lazy {

struct options {
  /// False: test(req) advances only req, which the progress rule forbids.
  bool test_advances_all = true;
  std::uint64_t seed = 0x5eed;
  /// Pieces are 1 .. max_piece bytes; the channel of a message holds at most channel_bytes.
  std::size_t max_piece = 6000;
  std::size_t channel_bytes = 16384;
  /// A send waits 0 .. max_hold of its sender's progress calls before its first byte moves.
  int max_hold = 3;
  /// 0: RINGZERO_TIMEOUT.
  std::chrono::nanoseconds timeout{0};
};

namespace detail {

/// One posted send or receive. Every field but `reported` is guarded by the mutex of the
/// receiver's mailbox, which both ends of a message lock.
struct op {
  bool is_send = false;
  int owner = -1;  // the rank that posted it
  int peer = -1;
  tag_t tag = 0;
  std::span<const std::byte> out;  // a send's data
  std::span<std::byte> in;         // a receive's buffer
  int hold = 0;
  std::shared_ptr<op> partner;    // the matched other end
  std::deque<std::byte> channel;  // a send's bytes moved by its sender, not yet taken
  std::size_t pushed = 0;         // a send's bytes moved into the channel
  std::size_t taken = 0;          // a receive's bytes taken from the channel
  bool done = false;
  bool mismatch = false;
  std::size_t other_size = 0;
  bool reported = false;  // the owner's test() saw it done once; only the owner touches it

  [[nodiscard]] std::size_t size() const noexcept { return is_send ? out.size() : in.size(); }
};

using key = std::pair<int, tag_t>;  // (source rank, tag)

/// Unmatched operations addressed to one rank, each FIFO in posting order.
struct mailbox {
  std::mutex mutex;
  std::map<key, std::deque<std::shared_ptr<op>>> sends, recvs;
};

inline void erase_from(std::map<key, std::deque<std::shared_ptr<op>>>& queues, const key& k,
                       const op* o) {
  auto it = queues.find(k);
  if (it == queues.end()) return;
  auto& q = it->second;
  q.erase(std::remove_if(q.begin(), q.end(), [&](const auto& e) { return e.get() == o; }), q.end());
  if (q.empty()) queues.erase(it);
}

struct shared_state {
  explicit shared_state(int n) : boxes(static_cast<std::size_t>(n)) {}

  /// A request dropped unfinished: the operation is withdrawn; if it was matched, its partner
  /// goes back to the front of its queue and starts over, so the next match gets the whole
  /// message.
  void abandon(std::shared_ptr<op>& op) noexcept {
    auto& o = *op;
    const int dst = o.is_send ? o.peer : o.owner;
    auto& box = boxes[static_cast<std::size_t>(dst)];
    std::lock_guard lock(box.mutex);
    if (!o.done) {
      const detail::key k{o.is_send ? o.owner : o.peer, o.tag};
      if (!o.partner) {
        detail::erase_from(o.is_send ? box.sends : box.recvs, k, &o);
      } else {
        auto p = std::move(o.partner);
        p->partner.reset();
        auto& send = o.is_send ? o : *p;
        send.channel.clear();
        send.pushed = 0;
        p->taken = 0;
        (p->is_send ? box.sends : box.recvs)[k].push_front(p);
      }
    }
    o.partner.reset();  // breaks the cycle between the two ends
  }

  std::vector<mailbox> boxes;
  std::atomic<int> failed_rank{-1};
  std::mutex failure_mutex;
  std::string failure;
};

/// Pairs the oldest unmatched send and receive of `k` while both exist: matching follows the
/// posting order, whatever order the bytes come in.
inline void match(mailbox& box, const key& k) {
  auto s = box.sends.find(k);
  auto r = box.recvs.find(k);
  while (s != box.sends.end() && r != box.recvs.end()) {
    auto send = s->second.front();
    auto recv = r->second.front();
    s->second.pop_front();
    r->second.pop_front();
    send->partner = recv;
    recv->partner = send;
    if (send->size() != recv->size()) {
      send->mismatch = recv->mismatch = true;
      send->other_size = recv->size();
      recv->other_size = send->size();
      send->done = recv->done = true;
    } else if (send->size() == 0) {
      send->done = recv->done = true;
    }
    if (s->second.empty()) {
      box.sends.erase(s);
      s = box.sends.end();
    }
    if (r->second.empty()) {
      box.recvs.erase(r);
      r = box.recvs.end();
    }
  }
}

}  // namespace detail

class transport {
 public:
  /// The transport kit's handle (transport/detail/request.hpp): destroying it unfinished calls
  /// shared_state::abandon.
  using request = ringzero::detail::transport_request<transport, detail::shared_state,
                                                      std::shared_ptr<detail::op>>;

  transport(std::shared_ptr<detail::shared_state> shared, int rank, const options& opts)
      : shared_(std::move(shared)), rank_(rank), opts_(opts), rng_(opts.seed * 1000003u + rank) {}

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return static_cast<int>(shared_->boxes.size()); }
  [[nodiscard]] ringzero::tuning::policy tuning() const noexcept {
    return ringzero::tuning::defaults::loopback.value;
  }
  [[nodiscard]] std::chrono::nanoseconds default_timeout() const noexcept { return opts_.timeout; }
  /// Every rank on one host: the hierarchy's node level is the whole world.
  [[nodiscard]] int host_of(int) const noexcept { return 0; }

  void abort(const std::string& why) { aborted_->set(why); }
  [[nodiscard]] std::optional<std::string> abort_reason() const {
    return aborted_->reason_if_set();
  }

  [[nodiscard]] request isend(int peer, tag_t tag, std::span<const std::byte> data) {
    auto o = post(true, peer, tag);
    o->out = data;
    o->hold = std::uniform_int_distribution<int>(0, opts_.max_hold)(rng_);
    return enqueue(std::move(o), peer, {rank_, tag}, true);
  }
  [[nodiscard]] request irecv(int peer, tag_t tag, std::span<std::byte> data) {
    auto o = post(false, peer, tag);
    o->in = data;
    return enqueue(std::move(o), rank_, {peer, tag}, false);
  }

  [[nodiscard]] bool test(request& r) {
    if (!r.op_) throw invalid_argument("lazy: test() on an empty request");
    check_aborted();
    if (opts_.test_advances_all)
      progress();
    else
      advance(*r.op_);
    auto& o = *r.op_;
    bool done = false, mismatch = false;
    {
      auto& box = box_of(o);
      std::lock_guard lock(box.mutex);
      done = o.done;
      mismatch = o.mismatch;
    }
    if (done) {
      if (mismatch)
        throw transport_error(fmt::format(
            "lazy: rank {}, {} rank {} (tag {:#x}): {}", rank_,
            o.is_send ? "send to" : "receive from", o.peer, o.tag,
            o.is_send ? fmt::format("this rank sent {} bytes but the peer posted a {} byte receive",
                                    o.size(), o.other_size)
                      : fmt::format("the peer sent {} bytes but this rank posted a {} byte receive",
                                    o.other_size, o.size())));
      if (o.reported) return true;
      o.reported = true;
      return false;
    }
    const int failed = shared_->failed_rank.load(std::memory_order_acquire);
    if (failed >= 0 && failed != rank_) {
      std::lock_guard lock(shared_->failure_mutex);
      throw peer_error(fmt::format("lazy: rank {} failed: {}", failed, shared_->failure), failed);
    }
    return false;
  }

  /// Advances every unfinished operation of this rank by one step.
  void progress() {
    std::erase_if(live_, [](const std::weak_ptr<detail::op>& w) { return w.expired(); });
    for (std::size_t i = 0; i < live_.size(); ++i)
      if (auto o = live_[i].lock()) advance(*o);
  }

  [[nodiscard]] const std::shared_ptr<detail::shared_state>& shared() const noexcept {
    return shared_;
  }

 private:
  std::shared_ptr<detail::op> post(bool is_send, int peer, tag_t tag) {
    check_aborted();
    if (peer < 0 || peer >= size())
      throw invalid_argument(
          fmt::format("lazy: peer {} is not a rank of this {}-rank world", peer, size()));
    auto o = std::make_shared<detail::op>();
    o->is_send = is_send;
    o->owner = rank_;
    o->peer = peer;
    o->tag = tag;
    return o;
  }

  request enqueue(std::shared_ptr<detail::op> o, int dst, const detail::key& k, bool is_send) {
    auto& box = shared_->boxes[static_cast<std::size_t>(dst)];
    {
      std::lock_guard lock(box.mutex);
      (is_send ? box.sends : box.recvs)[k].push_back(o);
    }
    live_.push_back(o);
    request r;
    r.op_ = std::move(o);
    r.eng_ = shared_;
    return r;
  }

  detail::mailbox& box_of(const detail::op& o) {
    return shared_->boxes[static_cast<std::size_t>(o.is_send ? o.peer : o.owner)];
  }

  std::size_t piece() {
    return std::uniform_int_distribution<std::size_t>(1, opts_.max_piece)(rng_);
  }

  // A send moves a piece into its channel once its hold is over; a receive matches, then takes
  // a piece from its partner's channel.
  void advance(detail::op& o) {
    auto& box = box_of(o);
    std::lock_guard lock(box.mutex);
    if (o.done) return;
    if (o.is_send) {
      if (o.hold > 0) {
        --o.hold;
        return;
      }
      const std::size_t room =
          opts_.channel_bytes - std::min(opts_.channel_bytes, o.channel.size());
      const std::size_t k = std::min({piece(), o.out.size() - o.pushed, room});
      o.channel.insert(o.channel.end(), o.out.begin() + static_cast<std::ptrdiff_t>(o.pushed),
                       o.out.begin() + static_cast<std::ptrdiff_t>(o.pushed + k));
      o.pushed += k;
      return;
    }
    if (!o.partner) detail::match(box, {o.peer, o.tag});
    if (!o.partner || o.done) return;
    auto& send = *o.partner;
    const std::size_t k = std::min(piece(), send.channel.size());
    std::copy_n(send.channel.begin(), k, o.in.begin() + static_cast<std::ptrdiff_t>(o.taken));
    send.channel.erase(send.channel.begin(), send.channel.begin() + static_cast<std::ptrdiff_t>(k));
    o.taken += k;
    if (o.taken == o.in.size()) o.done = send.done = true;
  }

  void check_aborted() const {
    if (auto why = abort_reason())
      throw peer_error(fmt::format("lazy: rank {}: the communicator was aborted: {}", rank_, *why),
                       -1);
  }

  std::shared_ptr<detail::shared_state> shared_;
  int rank_;
  options opts_;
  std::mt19937_64 rng_;
  std::vector<std::weak_ptr<detail::op>> live_;
  std::shared_ptr<ringzero::detail::abort_state> aborted_ =
      std::make_shared<ringzero::detail::abort_state>();
};

static_assert(messaging<transport>);
static_assert(ringzero::transport<transport>);

using communicator = ringzero::communicator<transport>;

/// Marks rank r failed: every other rank's waits then fail with a peer_error naming it, as the
/// loopback world does for a rank whose function threw.
inline void fail(detail::shared_state& s, int r, const std::string& why) {
  std::lock_guard lock(s.failure_mutex);
  int expected = -1;
  if (s.failed_rank.load() < 0) {
    s.failure = why;
    s.failed_rank.compare_exchange_strong(expected, r);
  }
}

}  // namespace ringzero::testing::lazy
