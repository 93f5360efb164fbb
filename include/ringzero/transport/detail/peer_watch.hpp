// Who failed first, as a transport's engine asks it: the rank whose death its waits name, and
// when that became known. A transport decides how it finds out (libfabric's watchdog probes the
// processes of its host and agrees with the other ranks through the store; the socket
// transport believes the first broken connection, or a peer's goodbye naming a rank; a test's
// in-process world keeps one record for all its ranks); the rail engine (rail_engine.hpp) only
// reports what it sees and asks.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace ringzero::detail {

class peer_watch {
 public:
  peer_watch() = default;
  peer_watch(const peer_watch&) = delete;
  peer_watch& operator=(const peer_watch&) = delete;
  virtual ~peer_watch() = default;

  /// The world rank known to have failed, or -1.
  [[nodiscard]] virtual int failed_rank() const noexcept = 0;
  /// How it was found out, once failed_rank() >= 0.
  [[nodiscard]] virtual std::string failure() const = 0;
  /// Milliseconds since failed_rank() became known (0 while none is).
  [[nodiscard]] virtual std::int64_t failure_age_ms() const noexcept = 0;
  /// World ranks that are alive but stopped (SIGSTOP, a debugger): why a wait may stall.
  [[nodiscard]] virtual std::vector<int> stopped_ranks() const { return {}; }
  /// `rank`'s process is known to be gone (where the watch can tell): nothing is sent to it any
  /// more, since a send into a dead process's shared memory may wait on a lock it died holding.
  [[nodiscard]] virtual bool is_gone(int /*rank*/) const { return false; }
  /// A rank whose process is gone or stopped may hold a lock in memory this one shares with it.
  [[nodiscard]] virtual bool any_lost() const { return false; }
  /// `rank` looks dead to this rank (its connection failed): records the failure every rank is
  /// to name, which need not be this one.
  virtual void suspect(int rank, const std::string& why) = 0;
  /// Another rank said `rank` failed first (a goodbye naming it).
  virtual void report(int rank, std::string why) = 0;

 protected:
  [[nodiscard]] static std::int64_t now_ms() noexcept {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
};

/// What one rank sees: the first rank suspected or reported is the one named. `self` is never.
class first_failure : public peer_watch {
 public:
  explicit first_failure(int self) : self_(self) {}

  [[nodiscard]] int failed_rank() const noexcept override {
    return failed_.load(std::memory_order_acquire);
  }
  [[nodiscard]] std::string failure() const override {
    std::lock_guard lock(mutex_);
    return why_;
  }
  [[nodiscard]] std::int64_t failure_age_ms() const noexcept override {
    const std::int64_t at = at_.load(std::memory_order_acquire);
    return at == 0 ? 0 : now_ms() - at;
  }
  void suspect(int rank, const std::string& why) override { report(rank, why); }
  void report(int rank, std::string why) override {
    if (rank < 0 || rank == self_) return;
    std::lock_guard lock(mutex_);
    if (failed_.load(std::memory_order_relaxed) >= 0) return;
    why_ = std::move(why);
    at_.store(now_ms(), std::memory_order_release);
    failed_.store(rank, std::memory_order_release);
  }

 private:
  int self_;
  std::atomic<int> failed_{-1};
  std::atomic<std::int64_t> at_{0};
  mutable std::mutex mutex_;
  std::string why_;
};

}  // namespace ringzero::detail
