// How the members of an elastic job find a lost one while they train: each beats a counter in
// the job's store and watches the next member's (heart), a silent or reaped member is declared
// lost for everyone (member_watch), and a generation's rendezvous gives up naming it
// (watched_store). elastic::session holds these; apart from it because the formation of
// generations (elastic.hpp) and the watching are separate jobs that share only the store's keys.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "ringzero/bootstrap/store.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/elastic/membership.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/detail/process_watch.hpp"

namespace ringzero::elastic::detail {

/// Where a job keeps its membership in its store: session forms generations there, the
/// watchers below read the beats and deaths, and ringzero-run (tools/run) serves the store
/// and marks the ranks it reaped as dead.
struct keys {
  static std::string formed() { return "elastic/formed"; }  ///< generations formed so far
  static std::string next_id() { return "elastic/next-id"; }
  static std::string waiting() { return "elastic/waiting"; }    ///< arrivals that asked
  static std::string admitted() { return "elastic/admitted"; }  ///< arrivals taken in
  static std::string finished() { return "elastic/finished"; }
  static std::string dead(std::int64_t id) { return fmt::format("elastic/dead/{}", id); }
  /// Members declared lost so far, by anyone: what the watchers poll instead of every mark.
  static std::string deaths() { return "elastic/deaths"; }
  static std::string beat(std::int64_t id) { return fmt::format("elastic/beat/{}", id); }
  static std::string slots(std::uint64_t g) { return fmt::format("elastic/{}/slots", g); }
  static std::string slot(std::uint64_t g, std::int64_t i) {
    return fmt::format("elastic/{}/slot/{}", g, i);
  }
  static std::string closer(std::uint64_t g) { return fmt::format("elastic/{}/closer", g); }
  static std::string members(std::uint64_t g) { return fmt::format("elastic/{}/members", g); }
  static std::string event(std::uint64_t g) { return fmt::format("elastic/{}/event", g); }
  /// 1 once event(g) is written: read without waiting, unlike the event itself.
  static std::string recorded(std::uint64_t g) { return fmt::format("elastic/{}/recorded", g); }
};

// The launcher a member watches: its pid and start time (0: none).
struct launcher_id {
  std::int64_t pid = 0;
  std::uint64_t start = 0;
};

// Which member of a generation is dead: marked so in the job's store (ringzero-run marks the
// ranks it reaps), or silent (its heartbeat, heart below, has not moved for `silence`; it is
// then marked dead, for the others). Without a launcher to reap processes, the heartbeat is how
// a death is found, on any host. Thread-safe: transports may ask from several threads.
class member_watch {
  using clock = std::chrono::steady_clock;

 public:
  struct death {
    int rank;
    std::int64_t id;
    std::string why;
  };

  member_watch(std::shared_ptr<bootstrap::store> job, membership m,
               std::chrono::nanoseconds silence)
      : job_(std::move(job)),
        m_(std::move(m)),
        silence_(silence),
        beats_(m_.members.size(), {-1, clock::now()}) {}

  [[nodiscard]] const membership& members() const noexcept { return m_; }

  /// The first member other than this process found dead, if any.
  [[nodiscard]] std::optional<death> find() {
    std::lock_guard lock(mutex_);
    const auto now = clock::now();
    for (int r = 0; r < m_.size(); ++r) {
      if (r == m_.rank) continue;
      const std::int64_t id = m_.members[static_cast<std::size_t>(r)];
      if (job_->add_within(keys::dead(id), 0, std::chrono::seconds(2)) > 0)
        return death{r, id, "was declared lost (it died, or its heartbeat stopped)"};
      auto& [last, moved] = beats_[static_cast<std::size_t>(r)];
      const std::int64_t beat = job_->add_within(keys::beat(id), 0, std::chrono::seconds(2));
      if (beat != last) {
        last = beat;
        moved = now;
      } else if (now - moved >= silence_) {
        if (job_->add_within(keys::dead(id), 1, std::chrono::seconds(2)) == 1)
          job_->add_within(keys::deaths(), 1, std::chrono::seconds(2));
        return death{r, id,
                     fmt::format("stopped its heartbeat {:.1f} s ago",
                                 std::chrono::duration<double>(now - moved).count())};
      }
    }
    return std::nullopt;
  }

 private:
  std::shared_ptr<bootstrap::store> job_;
  membership m_;
  std::chrono::nanoseconds silence_;
  std::mutex mutex_;
  std::vector<std::pair<std::int64_t, clock::time_point>> beats_;
};

// A generation's store whose blocking waits look, between short slices, for members found
// dead (member_watch), and give up naming one.
class watched_store final : public bootstrap::store {
  using clock = std::chrono::steady_clock;

 public:
  watched_store(std::shared_ptr<bootstrap::store> gen, std::shared_ptr<bootstrap::store> job,
                membership m, std::chrono::nanoseconds silence)
      : gen_(std::move(gen)), watch_(std::move(job), std::move(m), silence) {}

  void set(std::string_view key, std::span<const std::byte> value) override {
    gen_->set(key, value);
  }
  [[nodiscard]] std::vector<std::byte> get(std::string_view key) override {
    return get_within(key, ringzero::detail::env_timeout());
  }
  std::int64_t add(std::string_view key, std::int64_t delta) override {
    return gen_->add(key, delta);
  }
  void wait(std::span<const std::string> keys) override {
    for (const auto& k : keys) static_cast<void>(get(k));
  }
  std::int64_t add_within(std::string_view key, std::int64_t delta,
                          std::chrono::nanoseconds limit) override {
    return gen_->add_within(key, delta, limit);
  }
  void set_within(std::string_view key, std::span<const std::byte> value,
                  std::chrono::nanoseconds limit) override {
    gen_->set_within(key, value, limit);
  }
  [[nodiscard]] std::vector<std::byte> get_within(std::string_view key,
                                                  std::chrono::nanoseconds limit) override {
    const auto deadline = clock::now() + limit;
    for (;;) {
      const auto left = deadline - clock::now();
      const auto slice = std::min<std::chrono::nanoseconds>(
          std::chrono::milliseconds(250), std::max<std::chrono::nanoseconds>(left, {}));
      try {
        return gen_->get_within(key, slice);
      } catch (const timeout_error&) {
        if (clock::now() >= deadline) throw;
      }
      if (const auto d = watch_.find())
        throw peer_error(fmt::format("elastic: rank {} (member {}) of generation {} {} while "
                                     "the ranks met in the store (waiting for '{}')",
                                     d->rank, d->id, watch_.members().generation, d->why, key),
                         d->rank);
    }
  }

 private:
  std::shared_ptr<bootstrap::store> gen_;
  member_watch watch_;
};

// The session's thread, while the session lives: beats this member's counter in the job's
// store every `period`; watches the beat of the next member of the current generation and
// declares it lost after `silence` without one; aborts the current communicator once a member
// of its generation is declared lost (by anyone: the job's count of deaths moved) or the
// launcher is gone (checked every 100 ms).
class heart {
 public:
  heart(std::shared_ptr<bootstrap::store> st, std::int64_t id, std::chrono::milliseconds period,
        std::chrono::nanoseconds silence, launcher_id launcher)
      : st_(std::move(st)),
        id_(id),
        period_(period),
        silence_(silence),
        launcher_(launcher),
        thread_([this] { run(); }) {}
  heart(const heart&) = delete;
  heart& operator=(const heart&) = delete;
  ~heart() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  /// The generation now trained in, and how to abort its communicator.
  void watch(const membership& m, std::function<void(const std::string&)> abort) {
    std::lock_guard lock(mutex_);
    if (m.generation != current_.generation || current_.members.empty()) {
      current_ = m;
      next_beat_ = -1;
      // Deaths counted while the previous generation was watched may be of this one's members.
      deaths_seen_ = -1;
      aborted_ = false;
      why_ = launcher_why_;  // a loss in the generation before is no reason to abort this one
    }
    abort_ = std::move(abort);
    if (!why_.empty() && !aborted_) fire_locked();
  }

  /// Why the launcher is gone, or empty.
  [[nodiscard]] std::string launcher_gone() const {
    std::lock_guard lock(mutex_);
    return launcher_why_;
  }

 private:
  using clock = std::chrono::steady_clock;

  void run() {
    const auto tick = std::min<std::chrono::milliseconds>(period_, std::chrono::milliseconds(100));
    auto next_beat = clock::now();
    std::unique_lock lock(mutex_);
    while (!stop_) {
      lock.unlock();
      check_launcher();
      if (clock::now() >= next_beat) {
        next_beat = clock::now() + period_;
        try {
          st_->add_within(keys::beat(id_), 1, std::chrono::seconds(2));
          check_members();
        } catch (const std::exception&) {
          // A store that does not answer now may answer at the next beat.
        }
      }
      lock.lock();
      cv_.wait_for(lock, tick, [this] { return stop_; });
    }
  }

  void check_launcher() {
    if (launcher_.pid <= 0) return;
    const auto st = ringzero::detail::read_process_stat(launcher_.pid);
    if (st && !st->ended() && st->start == launcher_.start) return;
    std::lock_guard lock(mutex_);
    if (!launcher_why_.empty()) return;
    launcher_why_ =
        fmt::format("the job's launcher (pid {}), which serves its store, is gone: the job ends",
                    launcher_.pid);
    launcher_.pid = 0;
    why_ = launcher_why_;
    fire_locked();
  }

  // The next member's beat, and the job's count of deaths.
  void check_members() {
    membership m;
    {
      std::lock_guard lock(mutex_);
      if (current_.members.size() < 2 || aborted_) return;
      m = current_;
    }
    const auto next = m.members[static_cast<std::size_t>((m.rank + 1) % m.size())];
    const std::int64_t beat = st_->add_within(keys::beat(next), 0, std::chrono::seconds(2));
    const auto now = clock::now();
    double silent = 0;
    {
      std::lock_guard lock(mutex_);
      if (beat != next_beat_) {
        next_beat_ = beat;
        next_moved_ = now;
      } else if (now - next_moved_ >= silence_ && m.generation == current_.generation) {
        silent = std::chrono::duration<double>(now - next_moved_).count();
        next_moved_ = now;  // once per silence, while the others catch up
      }
    }
    if (silent > 0) {
      // The store calls outside the lock: watch() is not held up by a slow store.
      log::warn(
          "elastic: member {} (rank {} of generation {}) has not beaten for {:.1f} s: "
          "declaring it lost",
          next, (m.rank + 1) % m.size(), m.generation, silent);
      if (st_->add_within(keys::dead(next), 1, std::chrono::seconds(2)) == 1)
        st_->add_within(keys::deaths(), 1, std::chrono::seconds(2));
    }
    const std::int64_t deaths = st_->add_within(keys::deaths(), 0, std::chrono::seconds(2));
    {
      std::lock_guard lock(mutex_);
      if (deaths == deaths_seen_ || m.generation != current_.generation) return;
      deaths_seen_ = deaths;
    }
    for (int r = 0; r < m.size(); ++r) {
      const std::int64_t who = m.members[static_cast<std::size_t>(r)];
      if (r == m.rank || st_->add_within(keys::dead(who), 0, std::chrono::seconds(2)) == 0)
        continue;
      std::lock_guard lock(mutex_);
      if (m.generation != current_.generation || aborted_) return;
      why_ = fmt::format("elastic: rank {} (member {}) of generation {} was declared lost", r, who,
                         m.generation);
      fire_locked();
      return;
    }
  }

  void fire_locked() {
    if (!abort_) return;
    aborted_ = true;
    try {
      abort_(why_);
    } catch (...) {
      // The communicator may be closing: it fails its waits by itself then.
    }
  }

  std::shared_ptr<bootstrap::store> st_;
  std::int64_t id_;
  std::chrono::milliseconds period_;
  std::chrono::nanoseconds silence_;
  launcher_id launcher_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  membership current_;
  std::function<void(const std::string&)> abort_;
  bool aborted_ = false;
  std::string why_;           ///< what the next abort says: a loss, or the launcher gone
  std::string launcher_why_;  ///< set once the launcher is gone
  std::int64_t next_beat_ = -1;
  clock::time_point next_moved_{};
  std::int64_t deaths_seen_ = -1;  ///< the job's count of deaths last read; -1: read again
  std::thread thread_;             // last: starts once the members above exist
};

}  // namespace ringzero::elastic::detail
