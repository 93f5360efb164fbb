// Elastic membership: the processes of a job form numbered generations, and a new generation —
// fewer ranks after one died, more after some arrived — is formed in the same processes, with
// no restart. The application decides what state to carry over (the sharder's checkpoint,
// resharded to the new size); this header decides who is in and what rank each one has.
//
//   auto s = ringzero::elastic::session::from_env();   // under ringzero-run --elastic MIN:MAX
//   s.join();
//   for (;;) {
//     auto comm = s.communicator<ringzero::libfabric::communicator>();
//     try { train(comm); break; }                      // resumes from the last checkpoint
//     catch (const ringzero::error& e) { s.shrink(comm.failed_rank()); }
//   }
//
// How a generation forms, through a store that lives outside the ranks (ringzero-run
// --elastic serves it; on a cluster a host that stays up, or RINGZERO_STORE=file:DIR on a shared
// file system), so that any rank may die, rank 0 included:
//   - every member of generation g that is still alive takes a slot in g+1 (an atomic counter)
//     and writes its member id there; a process that arrives (grow) does the same;
//   - the first member to see enough slots filled closes g+1: it writes the member list once
//     (claimed with an atomic counter, so there is exactly one closer). "Enough" is every member
//     of g not known dead (ringzero-run marks the ranks it reaped; the collective's error names
//     one more) plus every arrival waiting, or, after `settle` passed, whatever came, if at least
//     `min` and an allowed size;
//   - ranks are the members' positions in id order, so the survivor with the lowest id is the
//     new rank 0; a process left out (too slow to arrive, or past the size limit) gets an error
//     saying so, or, if it is an arrival, waits for the next generation.
// Communicators of generation g talk through the store under the prefix "g<g>/", so nothing a
// former generation left there satisfies a wait of the next.
//
// While it trains, every member beats a counter in the store (a thread of the session's) and
// watches the beat of the member after it in rank order: one silent for `settle` (a process
// stopped by SIGSTOP or a debugger, or one hung) is declared lost, as the launcher declares a
// rank it reaped, and every member's current communicator is aborted, so that the collectives
// waiting on it fail at once and the survivors form the next generation; a silent member is
// found within `settle` plus a beat. Under ringzero-run every member also watches its launcher:
// when it dies (SIGKILL), the current communicator is aborted and the session's calls fail
// saying so, so that the ranks end cleanly instead of dying of SIGPIPE on their next line.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ringzero/bootstrap/environment.hpp"
#include "ringzero/bootstrap/prefixed_store.hpp"
#include "ringzero/bootstrap/rendezvous.hpp"
#include "ringzero/bootstrap/store.hpp"
#include "ringzero/bootstrap/tcp_store.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/elastic/detail/heartbeat.hpp"
#include "ringzero/elastic/membership.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/detail/process_watch.hpp"

namespace ringzero::elastic {

class session {
 public:
  /// How long an arrival tries to reach the job's store before saying the job is gone.
  static constexpr std::chrono::seconds arrival_connect{10};

  /// Store keys, shared with ringzero-run (tools/run), which serves the store and marks ranks
  /// it reaped as dead. Defined with the watchers that read them (elastic/detail/heartbeat.hpp).
  using keys = detail::keys;

  /// `store`: one that outlives every rank. `id`: this process's member id, unique in the job.
  /// `initial`: members of generation 0 (ids 0..initial-1); an arrival passes 0.
  session(std::shared_ptr<bootstrap::store> store, std::int64_t id, int initial, limits lim,
          std::chrono::nanoseconds settle = std::chrono::seconds(10))
      : store_(std::move(store)),
        id_(id),
        initial_(initial),
        lim_(std::move(lim)),
        settle_(settle) {
    if (!store_) throw invalid_argument("elastic::session: no store");
    if (id < 0) throw invalid_argument(fmt::format("elastic::session: member id {} < 0", id));
    if (initial < 0 || (initial > 0 && id >= initial))
      throw invalid_argument(fmt::format(
          "elastic::session: member id {} is not among the {} initial members", id, initial));
  }

  /// Whether this process runs under an elastic launcher (RINGZERO_ELASTIC is set).
  [[nodiscard]] static bool enabled() {
    return ringzero::detail::getenv_str("RINGZERO_ELASTIC").has_value();
  }

  /// The session ringzero-run --elastic describes: RINGZERO_ELASTIC=MIN:MAX, the store at
  /// MASTER_ADDR:MASTER_PORT (served by the launcher, not by a rank) or RINGZERO_STORE=file:DIR,
  /// RINGZERO_TOKEN, the member id in RINGZERO_ELASTIC_ID, and WORLD_SIZE initial members (an
  /// arrival has RINGZERO_ELASTIC_ARRIVAL=1 and no WORLD_SIZE). RINGZERO_ELASTIC_SETTLE is
  /// `settle` in seconds (default 10).
  [[nodiscard]] static session from_env(std::function<bool(int)> allowed = {}) {
    using ringzero::detail::getenv_str;
    const auto spec = getenv_str("RINGZERO_ELASTIC");
    if (!spec) throw bootstrap_error("elastic::session::from_env: RINGZERO_ELASTIC is not set");
    limits lim = parse_limits(*spec);
    if (allowed) lim.allowed = std::move(allowed);
    const auto int_var = [](const char* name) -> std::optional<std::int64_t> {
      const auto v = getenv_str(name);
      if (!v) return std::nullopt;
      std::int64_t x = 0;
      const auto [p, ec] = std::from_chars(v->data(), v->data() + v->size(), x);
      if (ec != std::errc{} || p != v->data() + v->size() || x < 0)
        throw invalid_argument(fmt::format("{}='{}' is not a non-negative integer", name, *v));
      return x;
    };
    const bool arrival = getenv_str("RINGZERO_ELASTIC_ARRIVAL").value_or("0") == "1";
    const auto id = int_var("RINGZERO_ELASTIC_ID");
    if (!id) throw bootstrap_error("elastic: RINGZERO_ELASTIC_ID is not set");
    const auto initial = arrival ? std::optional<std::int64_t>(0) : int_var("WORLD_SIZE");
    if (!initial) throw bootstrap_error("elastic: WORLD_SIZE is not set");
    const auto settle_s = int_var("RINGZERO_ELASTIC_SETTLE").value_or(10);
    const auto timeout = ringzero::detail::env_timeout();

    bootstrap::launch_info info;
    info.master_addr = getenv_str("MASTER_ADDR").value_or("127.0.0.1");
    info.master_port = static_cast<int>(int_var("MASTER_PORT").value_or(0));
    info.token = getenv_str("RINGZERO_TOKEN").value_or("");
    const std::string kind = getenv_str("RINGZERO_STORE").value_or("tcp");
    std::shared_ptr<bootstrap::store> st;
    if (kind == "tcp") {
      if (info.master_port <= 0)
        throw bootstrap_error(
            "elastic: MASTER_PORT is not set (the store must be served outside the ranks, as "
            "ringzero-run --elastic does)");
      // The launcher serves; no rank does, so rank 0 may die. The world size in the greeting is
      // the job's limit, which every process of the job knows. An arrival finds out at once
      // when the job is gone (its launcher took the store with it), not after the timeout.
      const auto connect =
          arrival ? std::min<std::chrono::nanoseconds>(timeout, arrival_connect) : timeout;
      try {
        st = std::make_shared<bootstrap::tcp_store>(info.master_addr, info.master_port, false,
                                                    store_world(lim), info.token, connect);
      } catch (const timeout_error& e) {
        throw bootstrap_error(fmt::format(
            "elastic: the job's store at {}:{} does not answer (has the job finished?): {}",
            info.master_addr, info.master_port, e.what()));
      }
      if (arrival && connect < timeout)
        st = std::make_shared<bootstrap::tcp_store>(info.master_addr, info.master_port, false,
                                                    store_world(lim), info.token, timeout);
    } else {
      info.rank = static_cast<int>(*id);
      st = bootstrap::detail::open_store(info, timeout);
    }
    session s(std::move(st), *id, static_cast<int>(*initial), std::move(lim),
              std::chrono::seconds(settle_s));
    if (const auto pid = int_var("RINGZERO_LAUNCHER_PID"); pid && *pid > 0) s.watch_launcher(*pid);
    return s;
  }

  /// Watches the launcher with process id `pid` (on this host): when it is gone, the current
  /// communicator is aborted and the session's calls fail saying so. from_env() does this under
  /// ringzero-run (RINGZERO_LAUNCHER_PID). Call before join().
  void watch_launcher(std::int64_t pid) {
    if (const auto st = ringzero::detail::read_process_stat(pid); st && !st->ended())
      launcher_ = {pid, st->start};
  }

  /// Whether the launcher watch_launcher() named is gone (asked of /proc now).
  [[nodiscard]] bool launcher_gone() const noexcept {
    if (launcher_.pid <= 0) return false;
    const auto st = ringzero::detail::read_process_stat(launcher_.pid);
    return !st || st->ended() || st->start != launcher_.start;
  }

  /// The world size the store's greeting carries in an elastic job (the server and every
  /// client pass the same).
  [[nodiscard]] static int store_world(const limits& lim) {
    return lim.max == INT_MAX ? 65536 : lim.max;
  }

  /// Forms the first generation this process is in: generation 0 for an initial member; for an
  /// arrival, the next one the job forms (waiting, up to `wait_limit`, until the job makes room
  /// at a step boundary; fails if the job finishes first).
  const membership& join(std::chrono::nanoseconds wait_limit = std::chrono::hours(24)) {
    if (!heart_)
      heart_ = std::make_shared<detail::heart>(store_, id_, beat_period(), settle_, launcher_);
    if (initial_ > 0) {
      form(0, {}, initial_, false);
      return current_;
    }
    store_->add(keys::waiting(), 1);
    const auto deadline = clock::now() + wait_limit;
    for (;;) {
      const auto g = static_cast<std::uint64_t>(store_->add(keys::formed(), 0));
      tell_why_waiting(g);
      if (form(g, {}, 0, true)) return current_;
      if (clock::now() >= deadline)
        throw timeout_error(
            fmt::format("elastic: member {} waited {} s to be taken into the job", id_,
                        std::chrono::duration_cast<std::chrono::seconds>(wait_limit).count()),
            -1);
    }
  }

  /// After a collective of the current generation failed: forms the next generation of the
  /// members still alive. `failed_rank`: the rank the failure names (communicator::
  /// failed_rank(), or an error's peer()), -1 if none. Throws bootstrap_error naming the lost
  /// members if fewer than the minimum remain, and if this process was left out.
  const membership& shrink(int failed_rank = -1) {
    std::vector<std::int64_t> suspects;
    if (failed_rank >= 0 && failed_rank < current_.size()) {
      const std::int64_t who = current_.members[static_cast<std::size_t>(failed_rank)];
      if (who != id_) {
        suspects.push_back(who);
        if (store_->add(keys::dead(who), 1) == 1) store_->add(keys::deaths(), 1);
      }
    }
    form(current_.generation + 1, suspects, 0, false);
    return current_;
  }

  /// Arrivals the next grow() would take in: those waiting, as many as the size limit and an
  /// allowed size leave room for; 0 when none can be (the job at its maximum), so that a job
  /// that cannot grow is not asked to regroup at every step (ask at step boundaries; every rank
  /// must act on the same answer, so ask on one rank and broadcast it).
  [[nodiscard]] int waiting() {
    const int now = current_.size();
    const int n = largest_allowed(now + arrivals_waiting());
    return n > now ? n - now : 0;
  }

  /// Forms the next generation with every arrival waiting (call on every rank, at the same step).
  const membership& grow() {
    form(current_.generation + 1, {}, 0, false);
    return current_;
  }

  /// Marks the job finished: arrivals still waiting stop waiting.
  void finish() { store_->add(keys::finished(), 1); }

  [[nodiscard]] const membership& current() const noexcept { return current_; }
  [[nodiscard]] std::int64_t id() const noexcept { return id_; }
  [[nodiscard]] const limits& bounds() const noexcept { return lim_; }

  /// The store the current generation's communicators rendezvous in. Its waits give up with
  /// peer_error naming the rank as soon as a member of the generation is marked dead (ringzero-run
  /// marks the ranks it reaps), so that a death during a communicator's rendezvous does not hold
  /// the others until the timeout.
  [[nodiscard]] std::shared_ptr<bootstrap::store> generation_store() const {
    return std::make_shared<detail::watched_store>(
        std::make_shared<bootstrap::prefixed_store>(store_,
                                                    fmt::format("g{}/", current_.generation)),
        store_, current_, settle_);
  }
  /// The job's store itself (for records that outlive generations).
  [[nodiscard]] bootstrap::store& job_store() const noexcept { return *store_; }

  /// A communicator over the current generation. Comm is ringzero::communicator<T> for a
  /// transport T constructible from (store, rank, size, options). Options with a `dead_rank`
  /// callable left empty (nccl::config: NCCL cannot name a dead peer itself) get
  /// dead_rank_probe(), so that a collective waiting on a member the launcher reaped or whose
  /// heartbeat stopped fails at once, naming it.
  template <class Comm, class Options = typename Comm::transport_type::from_env_options>
  [[nodiscard]] Comm communicator(const Options& opt = {}) const {
    using T = typename Comm::transport_type;
    log::detail::process_rank().store(current_.rank);
    auto st = generation_store();
    Options o = opt;
    if constexpr (requires { o.dead_rank = dead_rank_probe(); })
      if (!o.dead_rank) o.dead_rank = dead_rank_probe();
    auto c = [&] {
      if constexpr (std::is_constructible_v<T, std::shared_ptr<bootstrap::store>, int, int,
                                            const Options&>)
        return Comm(T(st, current_.rank, current_.size(), o));
      else
        return Comm(T(*st, current_.rank, current_.size(), o));
    }();
    // The heartbeat's watcher aborts it when a member is declared lost or the launcher dies.
    if constexpr (requires { c.abort_handle(); })
      if (heart_) heart_->watch(current_, c.abort_handle());
    return c;
  }

  /// The rank in the current generation of a member marked dead in the job's store or whose
  /// heartbeat stopped for the settle time, or -1: for a transport to poll while it waits. Holds
  /// what it needs (the job's store, the generation's members), not the session.
  [[nodiscard]] std::function<int()> dead_rank_probe() const {
    auto watch = std::make_shared<detail::member_watch>(store_, current_, settle_);
    return [watch] {
      try {
        if (const auto d = watch->find()) return d->rank;
      } catch (const error&) {
        // A store that does not answer now may answer at the next poll.
      }
      return -1;
    };
  }

  /// Records a line about the current generation in the job's store (ringzero-run's summary
  /// prints it). Best effort.
  void record(std::string_view what) noexcept {
    try {
      store_->set_within(keys::event(current_.generation),
                         std::as_bytes(std::span<const char>(what.data(), what.size())),
                         std::chrono::seconds(2));
      store_->add_within(keys::recorded(current_.generation), 1, std::chrono::seconds(2));
    } catch (...) {
    }
  }

 private:
  using clock = std::chrono::steady_clock;
  // A fifth of the settle time, within [100 ms, 1 s].
  [[nodiscard]] std::chrono::milliseconds beat_period() const {
    return std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(settle_ / 5),
                      std::chrono::milliseconds(100), std::chrono::milliseconds(1000));
  }

  [[nodiscard]] bool is_dead(std::int64_t m) { return store_->add(keys::dead(m), 0) > 0; }

  // Arrivals that asked to join and were not taken in yet.
  [[nodiscard]] int arrivals_waiting() {
    return static_cast<int>(store_->add(keys::waiting(), 0) - store_->add(keys::admitted(), 0));
  }

  // The largest size a generation of up to `present` members may take (the limit and the
  // allowed sizes), or less than `min` when none.
  [[nodiscard]] int largest_allowed(int present) const {
    int n = std::min(present, lim_.max);
    while (n >= lim_.min && !lim_.allowed(n)) --n;
    return n;
  }

  // An arrival that the job cannot take in (at its maximum, or no allowed size with it) says so,
  // once: it waits, without making the job regroup, until a member leaves or the job ends.
  void tell_why_waiting(std::uint64_t g) {
    if (told_ || g == 0) return;
    const std::string list = store_->get_string(keys::members(g - 1));
    const int size = 1 + static_cast<int>(std::count(list.begin(), list.end(), ','));
    if (largest_allowed(size + arrivals_waiting()) > size) return;
    told_ = true;
    log::warn(
        "elastic: member {} waits to be taken in: the job has {} members and cannot grow (its "
        "maximum is {}{}); it is taken in when a member leaves, and told if the job ends first",
        id_, size, lim_.max == INT_MAX ? std::string("unbounded") : std::to_string(lim_.max),
        size < lim_.max ? ", and no larger size is allowed" : "");
  }

  // Throws when the launcher is gone: nothing can form the job's next generation.
  void check_launcher() const {
    if (!heart_) return;
    if (std::string why = heart_->launcher_gone(); !why.empty())
      throw bootstrap_error("elastic: " + why);
  }

  // Takes a slot in generation g and waits for its member list. `initial` > 0: generation 0,
  // closed at that many. Returns false if g closed without this process and it is an arrival
  // (which then tries the next one); a member left out raises.
  bool form(std::uint64_t g, const std::vector<std::int64_t>& suspects, int initial, bool arrival) {
    const auto start = clock::now();
    const std::int64_t slot = store_->add(keys::slots(g), 1);
    store_->set_string(keys::slot(g, slot), fmt::format("{}", id_));
    const auto settle_at = start + settle_;
    const auto deadline =
        start + std::max<std::chrono::nanoseconds>(settle_ * 3, ringzero::detail::env_timeout());
    auto pause = std::chrono::milliseconds(1);
    for (;;) {
      check_launcher();
      if (store_->add(keys::closer(g), 0) > 0) {
        // Closed: the list is written right after the claim.
        const std::string list = store_->get_string(keys::members(g));
        return adopt(g, list, arrival, start);
      }
      if (!arrival) {
        const std::int64_t present = store_->add(keys::slots(g), 0);
        int expected = initial;
        if (initial == 0) {
          expected = 0;
          for (const std::int64_t m : current_.members)
            if (std::find(suspects.begin(), suspects.end(), m) == suspects.end() && !is_dead(m))
              ++expected;
          expected += arrivals_waiting();
        }
        const bool all_came = present >= expected;
        const bool settled = clock::now() >= settle_at;
        if (all_came || settled) {
          const auto outcome = try_close(g, present, initial > 0);
          if (outcome == close_outcome::closed) continue;
          // Too few to go on: once every member that can come came, or at the deadline, every
          // survivor fails alike, naming who was lost; the last good checkpoint is untouched.
          if (all_came || clock::now() >= deadline) {
            if (present >= lim_.min)
              throw bootstrap_error(fmt::format(
                  "elastic: {} members for generation {}, and the job allows no size from {} to "
                  "{} (its `allowed` sizes: a trainer's batch must split evenly over the ranks); "
                  "the job cannot go on",
                  present, g, lim_.min, std::min<std::int64_t>(present, lim_.max)));
            throw bootstrap_error(fmt::format(
                "elastic: only {} members remain for generation {} (lost: {}), below the "
                "minimum of {}; the job cannot go on",
                present, g, fmt::join(lost_members(g, present), ", "), lim_.min));
          }
        }
      } else if (store_->add(keys::finished(), 0) > 0) {
        throw bootstrap_error(
            fmt::format("elastic: the job finished before member {} was taken in{}", id_,
                        told_ ? " (it was at its maximum size all along)" : ""));
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
  }

  enum class close_outcome { closed, too_few };

  // The members of the current generation without a slot in g.
  [[nodiscard]] std::vector<std::int64_t> lost_members(std::uint64_t g, std::int64_t present) {
    std::vector<std::int64_t> here, lost;
    for (std::int64_t i = 1; i <= present; ++i) here.push_back(slot_member(g, i));
    for (const std::int64_t m : current_.members)
      if (std::find(here.begin(), here.end(), m) == here.end()) lost.push_back(m);
    return lost;
  }

  [[nodiscard]] std::int64_t slot_member(std::uint64_t g, std::int64_t i) {
    const std::string s = store_->get_string(keys::slot(g, i));
    std::int64_t m = -1;
    std::from_chars(s.data(), s.data() + s.size(), m);
    return m;
  }

  // Closes generation g with the members present, if enough are and nobody closed it first.
  close_outcome try_close(std::uint64_t g, std::int64_t present, bool first) {
    std::vector<std::int64_t> old, fresh;
    for (std::int64_t i = 1; i <= present; ++i) {
      const std::int64_t m = slot_member(g, i);
      const bool was_member = first ? m < initial_
                                    : std::find(current_.members.begin(), current_.members.end(),
                                                m) != current_.members.end();
      (was_member ? old : fresh).push_back(m);
    }
    std::sort(old.begin(), old.end());
    // Members first, then arrivals in the order they came, up to the largest allowed size.
    std::vector<std::int64_t> in = old;
    in.insert(in.end(), fresh.begin(), fresh.end());
    const int n = largest_allowed(static_cast<int>(in.size()));
    if (n < lim_.min) return close_outcome::too_few;
    if (store_->add(keys::closer(g), 1) != 1) return close_outcome::closed;  // someone else did
    in.resize(static_cast<std::size_t>(n));
    std::sort(in.begin(), in.end());
    store_->set_string(keys::members(g), fmt::format("{}", fmt::join(in, ",")));
    std::int64_t admitted = 0;
    for (const std::int64_t m : in)
      if (std::find(fresh.begin(), fresh.end(), m) != fresh.end()) ++admitted;
    if (admitted > 0) store_->add(keys::admitted(), admitted);
    store_->add(keys::formed(), 1);
    return close_outcome::closed;
  }

  bool adopt(std::uint64_t g, const std::string& list, bool arrival, clock::time_point start) {
    membership next;
    next.generation = g;
    for (std::size_t p = 0; p < list.size();) {
      const std::size_t e = std::min(list.find(',', p), list.size());
      std::int64_t m = 0;
      std::from_chars(list.data() + p, list.data() + e, m);
      next.members.push_back(m);
      p = e + 1;
    }
    const auto me = std::find(next.members.begin(), next.members.end(), id_);
    if (me == next.members.end()) {
      if (arrival) return false;
      throw bootstrap_error(fmt::format(
          "elastic: generation {} formed without member {} (it arrived after the others closed "
          "it, or the job was at its size limit): this process leaves the job",
          g, id_));
    }
    next.rank = static_cast<int>(me - next.members.begin());
    for (const std::int64_t m : current_.members)
      if (std::find(next.members.begin(), next.members.end(), m) == next.members.end())
        next.lost.push_back(m);
    for (const std::int64_t m : next.members)
      if (g > 0 &&
          std::find(current_.members.begin(), current_.members.end(), m) == current_.members.end())
        next.arrived.push_back(m);
    if (arrival) next.arrived = {};  // an arrival never knew the previous members
    next.formed_in = clock::now() - start;
    if (next.size() < lim_.min)
      throw bootstrap_error(fmt::format(
          "elastic: generation {} has {} members, below the minimum {}", g, next.size(), lim_.min));
    current_ = std::move(next);
    if (heart_) heart_->watch(current_, {});
    return true;
  }

  std::shared_ptr<bootstrap::store> store_;
  std::int64_t id_;
  int initial_;
  limits lim_;
  std::chrono::nanoseconds settle_;
  membership current_;
  detail::launcher_id launcher_;
  bool told_ = false;  ///< an arrival said why it waits
  std::shared_ptr<detail::heart> heart_;
};

}  // namespace ringzero::elastic
