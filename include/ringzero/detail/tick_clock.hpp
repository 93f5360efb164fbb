// The counters' clock (detail/trace_scope.hpp): every collective is timed, so a sub-microsecond
// call pays for two readings of it. steady_clock::now() took 16 ns of CPU a reading on the
// machines measured, the time-stamp counter 7 ns. So the counters count time-stamp counter ticks
// where the kernel itself keeps time by them (its clocksource is "tsc": the counter runs at one
// rate on every CPU, stopped or not), and turn ticks into seconds when they are read, at the
// rate measured against steady_clock since the clock's first use. Anywhere else, and off x86-64,
// a tick is a nanosecond of steady_clock.
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <string>
#include <thread>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace ringzero::detail {

class tick_clock {
 public:
  /// Now, in ticks.
  [[nodiscard]] static std::int64_t now() noexcept {
#if defined(__x86_64__)
    if (origin().tsc) return static_cast<std::int64_t>(__rdtsc());
#endif
    return steady_ns();
  }

  /// Seconds in `ticks` of now()'s.
  [[nodiscard]] static double seconds(std::int64_t ticks) {
    return static_cast<double>(ticks) * ns_per_tick() * 1e-9;
  }

  /// Nanoseconds per tick: 1 without the time-stamp counter; with it, ticks over nanoseconds
  /// since the first use, at least a millisecond apart (waited for, the first time, by a read of
  /// the counters that soon after the first call), within a few parts in ten thousand.
  [[nodiscard]] static double ns_per_tick() {
    const start& o = origin();
    if (!o.tsc) return 1.0;
    std::int64_t ns = steady_ns() - o.ns;
    while (ns < 1'000'000) {
      std::this_thread::sleep_for(std::chrono::nanoseconds(1'000'000 - ns));
      ns = steady_ns() - o.ns;
    }
    return static_cast<double>(ns) / static_cast<double>(now() - o.ticks);
  }

 private:
  struct start {
    bool tsc = false;
    std::int64_t ticks = 0;
    std::int64_t ns = 0;
  };

  [[nodiscard]] static std::int64_t steady_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  [[nodiscard]] static const start& origin() noexcept {
    static const start o = [] {
      start s;
#if defined(__x86_64__)
      try {
        std::ifstream f("/sys/devices/system/clocksource/clocksource0/current_clocksource");
        std::string source;
        s.tsc = static_cast<bool>(f >> source) && source == "tsc";
      } catch (...) {
        s.tsc = false;
      }
      if (s.tsc) s.ticks = static_cast<std::int64_t>(__rdtsc());
#endif
      s.ns = steady_ns();
      return s;
    }();
    return o;
  }
};

}  // namespace ringzero::detail
