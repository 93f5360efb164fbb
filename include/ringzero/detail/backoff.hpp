// How a rank waits: spin, then yield, then sleep (RINGZERO_WAIT_MODE says how much of each). Every
// wait in the library backs off this way: the algorithms' (detail/exchange.hpp), the
// transports' own (the shm segment's phases, NCCL's stream polls, setup), so it sits below all
// of them.
#pragma once

#include <sched.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <string_view>
#include <thread>

#include "ringzero/error.hpp"

namespace ringzero::detail {

/// How a waiting rank spends its time (RINGZERO_WAIT_MODE, read once per process).
///   poll  (default): spin, then yield, then sleep — the lowest latency when every rank has a CPU
///          of its own, as on a training node.
///   sleep: a few yields, then short sleeps — for a node shared with other work (CI runners,
///          several jobs on one host, more ranks than CPUs): a rank that yields in a loop keeps
///          its CPU from the other programs as surely as one that spins, since the scheduler
///          hands the CPU straight back to it. Intel MPI's I_MPI_WAIT_MODE makes the same trade.
enum class wait_mode { poll, sleep };

[[nodiscard]] inline wait_mode parse_wait_mode(std::string_view v) {
  if (v.empty() || v == "poll") return wait_mode::poll;
  if (v == "sleep") return wait_mode::sleep;
  throw invalid_argument("RINGZERO_WAIT_MODE='" + std::string(v) + "' is not poll or sleep");
}

/// RINGZERO_WAIT_MODE, read once per process; invalid_argument naming it when it is neither. The
/// communicator reads it when it is made, so a typo fails there, before any wait.
[[nodiscard]] inline wait_mode env_wait_mode() {
  static const wait_mode mode = [] {
    const char* v = std::getenv("RINGZERO_WAIT_MODE");
    return parse_wait_mode(v == nullptr ? std::string_view{} : std::string_view{v});
  }();
  return mode;
}

/// env_wait_mode() for a wait, which must not throw: some run in destructors (an NCCL
/// communicator flushing its work). A value the communicator has already refused reads as poll.
[[nodiscard]] inline wait_mode wait_mode_for_waits() noexcept {
  try {
    return env_wait_mode();
  } catch (...) {
    return wait_mode::poll;
  }
}

/// Spin first (a peer on the same node answers in well under a microsecond), then yield, then
/// sleep briefly: a blocking sleep/wake costs tens of microseconds, so sleeping is the last
/// resort for long waits, not the first. Where ranks outnumber CPUs, spinning only keeps the
/// rank being waited for off a CPU: construct with spins = 0 (see oversubscribed()). Under
/// wait_mode::sleep nothing spins and the yields are few.
class backoff {
 public:
  static constexpr unsigned default_spins = 255;
  static constexpr unsigned poll_yields = 3840;
  static constexpr unsigned sleep_yields = 16;

  backoff() noexcept : backoff(default_spins) {}
  explicit backoff(unsigned spins) noexcept : backoff(spins, wait_mode_for_waits()) {}
  backoff(unsigned spins, wait_mode mode) noexcept
      : spins_(mode == wait_mode::sleep ? 0 : spins),
        yields_(mode == wait_mode::sleep ? sleep_yields : poll_yields) {}

  void pause() {
    ++n_;
    if (n_ <= spins_) return;
    if (n_ <= spins_ + yields_) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  void reset() noexcept { n_ = 0; }

 private:
  unsigned spins_ = default_spins;
  unsigned yields_ = poll_yields;
  unsigned n_ = 0;
};

/// Whether `ranks_here` processes on this node outnumber the CPUs this process may run on
/// (its affinity mask, read once). Open MPI yields at once when oversubscribed for the same
/// reason: with 4 ranks on 2 CPUs a spinning waiter holds a CPU its peer needs.
[[nodiscard]] inline bool oversubscribed(int ranks_here) {
  static const int cpus = [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (::sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
    return static_cast<int>(std::thread::hardware_concurrency());
  }();
  return cpus > 0 && ranks_here > cpus;
}

/// The backoff for a wait among `ranks_here` ranks of one node.
[[nodiscard]] inline backoff backoff_for(int ranks_here) {
  return backoff(oversubscribed(ranks_here) ? 0 : backoff::default_spins);
}

}  // namespace ringzero::detail
