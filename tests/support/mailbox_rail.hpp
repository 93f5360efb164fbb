// A rail kind for tests only, and a transport of it: ranks as threads of one process, a rail as
// an inbox per rank that the other ranks' sends drop letters into. All there is to it is the
// rail (post, poll, cancel, link state, price: transport/detail/rail.hpp) and a handshake that
// hands every rank its rails; the kit's engine (transport/detail/rail_engine.hpp) gives it
// striping, acknowledgements, resending and failover, as it gives them to libfabric and to the
// socket transport. Faults are injected by the test:
//   - post_office::cut(rail, why): the rail's link goes down for every rank, as a pulled cable:
//     letters on their way vanish, later ones too, and link_state() says so;
//   - post_office::sever(rail, a, b): the link between two ranks breaks, as a reset connection:
//     both ends report it from their next poll().
// options::places_pieces chooses which kind of rail it stands in for: one whose pieces carry
// their offset (the socket rail: the sender may cut by measured rate; the rail reports each
// peer's arrival rate as a letter count) or one whose receives take exact pieces (libfabric:
// both ends cut by agreed shares).
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "ringzero/communicator.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/peer_watch.hpp"
#include "ringzero/transport/detail/rail.hpp"
#include "ringzero/transport/detail/rail_engine.hpp"
#include "ringzero/transport/detail/request.hpp"
#include "ringzero/transport/detail/tag_matching.hpp"
#include "ringzero/tuning/defaults.hpp"

namespace ringzero::testing::mailbox {

struct options {
  int rails = 1;
  /// Pieces carry their offset (as the socket rail's frames do), or receives take exact pieces
  /// (as libfabric's do).
  bool places_pieces = true;
  /// Messages of at least this many bytes are striped over the rails.
  std::size_t stripe_bytes = 1024;
  /// Acknowledge every message even on one rail (several rails always do).
  bool acknowledge = true;
  /// Operations one rail takes at once, each way: more wait in the engine.
  std::size_t limit = 16;
  /// The rate each rail reports for the letters it takes from a peer (KiB/s, by rail; empty:
  /// alike), once one arrived: what a sender over rails that place pieces weighs them by.
  std::vector<std::uint32_t> rates{};
  /// 0: RINGZERO_TIMEOUT.
  std::chrono::nanoseconds timeout{0};
};

/// One message, or piece of one, on its way.
struct letter {
  enum class kind : std::uint8_t { data, bye };
  kind what = kind::data;
  int from = -1;
  std::uint8_t piece = 0;
  std::uint64_t tag = 0;
  bool with_data = false;
  std::uint64_t data = 0;
  std::size_t offset = 0;
  std::size_t total = 0;
  int culprit = -1;  ///< a goodbye: the rank its sender saw fail first
  std::vector<std::byte> bytes{};
};

/// The ranks that died, one record for the whole world (its ranks are threads of one process):
/// what the tests' harness writes when a rank's thread ends by an exception.
class world_record {
 public:
  void died(int rank, std::string why) {
    std::lock_guard lock(mutex_);
    if (rank < 0 || failed_.load(std::memory_order_relaxed) >= 0) return;
    why_ = std::move(why);
    at_ = std::chrono::steady_clock::now();
    failed_.store(rank, std::memory_order_release);
  }
  [[nodiscard]] int failed_rank() const noexcept { return failed_.load(std::memory_order_acquire); }
  [[nodiscard]] std::pair<std::string, std::chrono::steady_clock::time_point> failure() const {
    std::lock_guard lock(mutex_);
    return {why_, at_};
  }

 private:
  std::atomic<int> failed_{-1};
  mutable std::mutex mutex_;
  std::string why_;
  std::chrono::steady_clock::time_point at_{};
};

/// One rank's view: a death the world recorded, else the first failure it saw itself (a link
/// lost, a peer's word).
class rank_watch : public ringzero::detail::peer_watch {
 public:
  rank_watch(std::shared_ptr<world_record> world, int rank)
      : world_(std::move(world)), own_(rank) {}

  [[nodiscard]] int failed_rank() const noexcept override {
    const int dead = world_->failed_rank();
    return dead >= 0 ? dead : own_.failed_rank();
  }
  [[nodiscard]] std::string failure() const override {
    return world_->failed_rank() >= 0 ? world_->failure().first : own_.failure();
  }
  [[nodiscard]] std::int64_t failure_age_ms() const noexcept override {
    if (world_->failed_rank() < 0) return own_.failure_age_ms();
    try {
      return std::chrono::duration_cast<std::chrono::milliseconds>(
                 std::chrono::steady_clock::now() - world_->failure().second)
          .count();
    } catch (...) {
      return 0;
    }
  }
  void suspect(int rank, const std::string& why) override { own_.suspect(rank, why); }
  void report(int rank, std::string why) override { own_.report(rank, std::move(why)); }

 private:
  std::shared_ptr<world_record> world_;
  ringzero::detail::first_failure own_;
};

/// The world: an inbox per (rail, rank), the faults injected, and the failure record.
class post_office {
 public:
  post_office(int size, int rails)
      : size_(size),
        rails_(rails),
        boxes_(static_cast<std::size_t>(size * rails)),
        cuts_(static_cast<std::size_t>(rails)) {}

  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] int rails() const noexcept { return rails_; }
  [[nodiscard]] const std::shared_ptr<world_record>& deaths() const noexcept { return deaths_; }

  /// Drops `l` into rank `to`'s inbox on `rail`; it vanishes where the link is cut or severed.
  void deliver(int rail, int to, letter l) {
    if (!cut(rail).empty() || severed(rail, l.from, to)) return;
    auto& b = box(rail, to);
    std::lock_guard lock(b.mutex);
    b.letters.push_back(std::move(l));
  }
  [[nodiscard]] std::deque<letter> collect(int rail, int rank) {
    auto& b = box(rail, rank);
    std::lock_guard lock(b.mutex);
    return std::exchange(b.letters, {});
  }

  /// The rail's link goes down for every rank: what is on its way on it vanishes.
  void cut(int rail, std::string why) {
    {
      std::lock_guard lock(mutex_);
      cuts_[static_cast<std::size_t>(rail)] = std::move(why);
    }
    for (int r = 0; r < size_; ++r) (void)collect(rail, r);
  }
  [[nodiscard]] std::string cut(int rail) const {
    std::lock_guard lock(mutex_);
    return cuts_[static_cast<std::size_t>(rail)];
  }

  /// The link between ranks a and b on `rail` breaks: both learn it from their next poll.
  void sever(int rail, int a, int b) {
    std::lock_guard lock(mutex_);
    severed_.push_back({rail, std::min(a, b), std::max(a, b)});
  }
  [[nodiscard]] bool severed(int rail, int a, int b) const {
    std::lock_guard lock(mutex_);
    const auto k = std::tuple{rail, std::min(a, b), std::max(a, b)};
    return std::find(severed_.begin(), severed_.end(), k) != severed_.end();
  }

 private:
  struct inbox {
    std::mutex mutex;
    std::deque<letter> letters;
  };
  [[nodiscard]] inbox& box(int rail, int rank) {
    return boxes_[static_cast<std::size_t>(rail * size_ + rank)];
  }

  int size_;
  int rails_;
  std::vector<inbox> boxes_;
  mutable std::mutex mutex_;
  std::vector<std::string> cuts_;
  std::vector<std::tuple<int, int, int>> severed_;
  std::shared_ptr<world_record> deaths_ = std::make_shared<world_record>();
};

/// One rank's end of one rail.
class rail {
 public:
  struct scratch {};
  using op = ringzero::detail::rail_op<scratch>;

  rail(std::shared_ptr<post_office> office, int index, int rank, const options& opt)
      : office_(std::move(office)),
        index_(index),
        rank_(rank),
        name_(fmt::format("mail{}", index)),
        traits_{.send_limit = opt.limit,
                .receive_limit = opt.limit,
                .inject_size = 256,
                .places_pieces = opt.places_pieces,
                .rebuffers = true,
                .bundles = false},
        rate_(static_cast<std::size_t>(index) < opt.rates.size()
                  ? opt.rates[static_cast<std::size_t>(index)]
                  : 1000),
        arrived_(static_cast<std::size_t>(office_->size()), 0),
        broken_(static_cast<std::size_t>(office_->size()), false) {}

  [[nodiscard]] long post(op& o) noexcept {
    try {
      if (o.is_send) {
        if (const auto why = broken(o.world_peer)) {
          ended_.push_back({&o, ringzero::detail::rail_fault::peer_lost, *why});
          return 0;
        }
        send({.peer = o.world_peer,
              .bytes = std::span<const std::byte>(o.buffer, o.length),
              .tag = o.tag,
              .piece = o.piece,
              .with_data = o.with_data,
              .data = o.data,
              .offset = o.offset,
              .total = o.total});
        ended_.push_back({&o, std::nullopt, {}, o.length});
        return 0;
      }
      if (auto kept = matcher_.claim(o)) {
        take(o, kept->second);
        return 0;
      }
      if (o.world_peer >= 0)
        if (const auto why = broken(o.world_peer)) {
          ended_.push_back({&o, ringzero::detail::rail_fault::peer_lost, *why});
          return 0;
        }
      matcher_.post(&o);
      return 0;
    } catch (...) {
      return -ENOMEM;
    }
  }

  [[nodiscard]] long inject(const ringzero::detail::rail_message& m) {
    if (broken(m.peer)) return -ECONNRESET;
    send(m);
    return 0;
  }

  void cancel(op& o) noexcept {
    if (!o.is_send && matcher_.withdraw(&o))
      ended_.push_back({&o, ringzero::detail::rail_fault::cancelled, "cancelled"});
  }

  void poll(ringzero::detail::rail_events<op>& events) {
    for (letter& l : office_->collect(index_, rank_)) arrive(std::move(l));
    for (int p = 0; p < office_->size(); ++p)
      if (!broken_[static_cast<std::size_t>(p)] && p != rank_ &&
          office_->severed(index_, rank_, p)) {
        broken_[static_cast<std::size_t>(p)] = true;
        ended_.push_back({.fault = ringzero::detail::rail_fault::peer_lost,
                          .why = "the link was severed",
                          .peer = p});
        for (op* o : matcher_.withdraw_peer(p))
          ended_.push_back({o, ringzero::detail::rail_fault::peer_lost, "the link was severed"});
      }
    // One at a time, taken off first: the engine may poll again from inside an event.
    while (!ended_.empty()) {
      const ending e = std::move(ended_.front());
      ended_.pop_front();
      if (!e.o && e.fault)
        events.link_failed(e.peer, e.why);
      else if (!e.o)
        events.peer_left(e.peer, e.culprit);
      else if (e.fault)
        events.failed(*e.o, *e.fault, e.why, e.sent, e.data, e.with_data);
      else
        events.done(*e.o, e.len, e.data, e.with_data);
    }
  }

  [[nodiscard]] std::string link_state() const {
    const auto why = office_->cut(index_);
    return why.empty() ? why : "down (" + why + ")";
  }
  [[nodiscard]] ringzero::tuning::rail_price price() const noexcept {
    return ringzero::tuning::defaults::socket_rail.value;
  }
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] ringzero::detail::rail_traits traits() const noexcept { return traits_; }
  [[nodiscard]] std::string error_text(long rc) const {
    return std::strerror(static_cast<int>(-rc));
  }
  /// A stand-in for the rate `peer`'s letters arrive at: options::rates, once one arrived.
  [[nodiscard]] std::uint32_t arrival_rate(int peer) const noexcept {
    return arrived_[static_cast<std::size_t>(peer)] > 0 ? rate_ : 0;
  }

  /// A goodbye to every peer, once.
  [[nodiscard]] bool close_step(int culprit) noexcept {
    if (said_bye_) return true;
    said_bye_ = true;
    try {
      for (int p = 0; p < office_->size(); ++p)
        if (p != rank_)
          office_->deliver(index_, p,
                           {.what = letter::kind::bye, .from = rank_, .culprit = culprit});
    } catch (...) {
      // Only a courtesy: peers also learn of a closed rank from their deadlines.
    }
    return true;
  }

 private:
  /// What poll() reports, in the order it happened: an operation that ended (`o`), or else a
  /// link lost (`fault` peer_lost) or a peer's goodbye, from `peer`.
  struct ending {
    op* o = nullptr;
    std::optional<ringzero::detail::rail_fault> fault{};
    std::string why{};
    std::size_t len = 0;
    std::size_t sent = 0;
    std::uint64_t data = 0;
    bool with_data = false;
    int peer = -1;
    int culprit = -1;
  };

  [[nodiscard]] std::optional<std::string> broken(int peer) const {
    if (peer < 0 || !broken_[static_cast<std::size_t>(peer)]) return std::nullopt;
    return std::string("the link was severed");
  }

  void send(const ringzero::detail::rail_message& m) {
    letter l{.from = rank_,
             .piece = m.piece,
             .tag = m.tag,
             .with_data = m.with_data,
             .data = m.data,
             .offset = m.offset,
             .total = m.total,
             .bytes = std::vector<std::byte>(m.bytes.begin(), m.bytes.end())};
    office_->deliver(index_, m.peer, std::move(l));
  }

  void arrive(letter l) {
    if (l.what == letter::kind::bye) {
      ended_.push_back({.peer = l.from, .culprit = l.culprit});
      return;
    }
    ++arrived_[static_cast<std::size_t>(l.from)];
    const int from = l.from;
    if (op* o = matcher_.match(from, l.piece, l.tag)) return take(*o, l);
    const std::uint8_t piece = l.piece;
    const std::uint64_t tag = l.tag;
    matcher_.keep(from, piece, tag, std::move(l));
  }

  /// Letter `l` goes into receive `o`.
  void take(op& o, const letter& l) {
    ending e{.o = &o, .len = l.bytes.size(), .data = l.data, .with_data = l.with_data};
    if (o.placed ? l.total != o.length : l.bytes.size() > o.length) {
      e.fault = ringzero::detail::rail_fault::truncated;
      e.why = "the message does not fit";
      e.sent = o.placed ? l.total : l.bytes.size();
    } else if (!l.bytes.empty()) {
      std::memcpy(o.buffer + (o.placed ? l.offset : 0), l.bytes.data(), l.bytes.size());
    }
    ended_.push_back(std::move(e));
  }

  std::shared_ptr<post_office> office_;
  int index_;
  int rank_;
  std::string name_;
  ringzero::detail::rail_traits traits_;
  std::uint32_t rate_;
  ringzero::detail::tag_matcher<op, letter> matcher_;
  std::deque<ending> ended_;
  std::vector<std::uint64_t> arrived_;
  std::vector<bool> broken_;
  bool said_bye_ = false;
};
static_assert(ringzero::detail::rail_kind<rail>);

/// The messaging concept over mailbox rails: the kit's engine, and the handshake (each rank's
/// rails, opened on the world's post office).
class transport {
 public:
  using rail_engine = ringzero::detail::rail_engine<rail>;
  using request = ringzero::detail::transport_request<transport, rail_engine, rail::op*>;

  transport(std::shared_ptr<post_office> office, int rank, const options& opt)
      : size_(office->size()), rank_(rank) {
    std::vector<std::unique_ptr<rail>> rails;
    for (int i = 0; i < office->rails(); ++i)
      rails.push_back(std::make_unique<rail>(office, i, rank, opt));
    eng_ = std::make_shared<rail_engine>(
        ringzero::detail::rail_engine_config{
            .rank = rank,
            .size = size_,
            .name = "mailbox",
            .fabric = "mailboxes",
            .timeout = opt.timeout.count() > 0 ? opt.timeout : ringzero::detail::env_timeout(),
            .stripe_bytes = opt.stripe_bytes,
            .acknowledge = opt.acknowledge,
            .watch = std::make_shared<rank_watch>(office->deaths(), rank)},
        std::move(rails));
    timeout_ = opt.timeout;
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] ringzero::tuning::policy tuning() const noexcept {
    return ringzero::tuning::defaults::loopback.value;
  }
  [[nodiscard]] std::chrono::nanoseconds default_timeout() const noexcept { return timeout_; }
  [[nodiscard]] int host_of(int) const noexcept { return 0; }
  [[nodiscard]] int failed_rank() const noexcept { return eng_->failed_rank(); }

  void abort(const std::string& why) { eng_->abort(why); }
  [[nodiscard]] std::optional<std::string> abort_reason() const {
    if (!eng_->aborted()) return std::nullopt;
    return eng_->abort_reason();
  }

  [[nodiscard]] request isend(int peer, tag_t tag, std::span<const std::byte> data) {
    check_peer(peer, "isend");
    request r;
    r.eng_ = eng_;
    r.op_ = eng_->send(peer, peer, tag, data);
    r.done_ = r.op_ == nullptr;
    return r;
  }
  [[nodiscard]] request irecv(int peer, tag_t tag, std::span<std::byte> data) {
    check_peer(peer, "irecv");
    request r;
    r.eng_ = eng_;
    r.op_ = eng_->recv(peer, peer, tag, data);
    return r;
  }
  [[nodiscard]] bool test(request& r) {
    if (r.done_) return true;
    if (!r.op_) throw invalid_argument("mailbox: test() on an empty request");
    auto* c = std::exchange(r.op_, nullptr);
    if (!eng_->test(c)) {
      r.op_ = c;
      return false;
    }
    r.done_ = true;
    return true;
  }
  void progress() { eng_->progress(); }

  /// The kit's hook: gives rail `r` up toward every rank, as a link found down would.
  void fail_rail(std::size_t r, const std::string& why) { eng_->fail_rail(r, why); }
  [[nodiscard]] const rail_engine& engine() const noexcept { return *eng_; }

 private:
  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= size_ || peer == rank_)
      throw invalid_argument(fmt::format(
          "mailbox transport: {} to peer {}: peers are the other ranks of [0, {}), not {}", what,
          peer, size_, rank_));
  }

  std::shared_ptr<rail_engine> eng_;
  int size_;
  int rank_;
  std::chrono::nanoseconds timeout_{0};
};

}  // namespace ringzero::testing::mailbox
