// What a communicator keeps for observability (detail::comm_state::trace): counters per
// (collective, algorithm), always on, and while RINGZERO_TRACE is set the file its events go to.
// The collectives layer fills it through detail::collective_scope (trace_scope.hpp); the one
// hook below lets detail::exchange mark when a call's first message arrived.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "ringzero/algorithm.hpp"
#include "ringzero/detail/tick_clock.hpp"
#include "ringzero/detail/trace_writer.hpp"
#include "ringzero/log.hpp"

namespace ringzero::detail {

/// The counters hold a cell for every (collective, algorithm) pair, so they grow with the
/// lists: every built-in collective (builtin_collectives::all), every algorithm enumerator. A
/// collective outside the list (a test's own) is counted in the unlisted cell.
inline constexpr std::size_t traced_collectives = builtin_collectives::all.size();
inline constexpr std::size_t traced_algorithms = static_cast<std::size_t>(algorithm::linear) + 1;

/// nccl-tests' bus bandwidth factor (the descriptor's), with the buffer sizes of
/// collective_scope's `bytes` (the full buffer for reduce_scatter, all_gather and the rest).
[[nodiscard]] constexpr double busbw_factor(collective c, int n) noexcept {
  const collective_descriptor* d = builtin_collectives::find(c);
  return d != nullptr ? d->bus_bandwidth_factor(n) : 0.0;
}

struct counter_cell {
  std::uint64_t calls = 0;
  std::uint64_t bytes = 0;
  std::int64_t ticks = 0;  ///< of tick_clock

  [[nodiscard]] double seconds() const { return tick_clock::seconds(ticks); }
};

/// One open traced call on this thread: a collective or a caller's phase. Nested calls (a
/// hierarchical all_reduce's sub-collectives, collectives inside a sharder phase) point at the
/// enclosing one, whose file they share.
struct trace_record {
  trace_record* parent = nullptr;
  trace_writer* writer = nullptr;
  std::chrono::steady_clock::time_point first_receive{};
  bool received = false;

  void on_receive(std::chrono::steady_clock::time_point now) noexcept {
    for (trace_record* r = this; r != nullptr && !r->received; r = r->parent) {
      r->received = true;
      r->first_receive = now;
    }
  }
};

/// Per-communicator observability state: one member of comm_state. Counters, `open` and the
/// writer's creation belong to the thread running the communicator's collectives; a phase
/// (trace::scope) may run on another thread (the sharder's caller, while its communication
/// thread runs collectives), so what it reads, `mode` and `published`, is atomic.
struct trace_state {
  std::array<counter_cell, traced_collectives * traced_algorithms> cells{};
  /// -1: RINGZERO_TRACE not read yet; 0: off; 1: on. Read at the first call, so the fast path
  /// is one (relaxed: a plain load) compare against 0.
  std::atomic<int> mode{-1};
  int rank = -1;
  int size = 0;
  /// The names of the algorithm table the calls ran from (algorithms/table.hpp, which sits
  /// above this header): set by the first counted call, used to print the counters.
  std::string_view (*algorithm_name)(algorithm) noexcept = nullptr;
  trace_record* open = nullptr;
  std::unique_ptr<trace_writer> writer;
  /// writer.get() once the file is open and its header written.
  std::atomic<trace_writer*> published{nullptr};

  trace_state() = default;
  trace_state(const trace_state&) = delete;
  trace_state& operator=(const trace_state&) = delete;
  // A moved-from communicator has made no calls: its destructor must not print them again.
  trace_state(trace_state&& o) noexcept
      : cells(std::exchange(o.cells, {})),
        mode(o.mode.load()),
        rank(o.rank),
        size(o.size),
        algorithm_name(o.algorithm_name),
        open(std::exchange(o.open, nullptr)),
        writer(std::move(o.writer)),
        published(o.published.exchange(nullptr)) {}
  trace_state& operator=(trace_state&& o) noexcept {
    cells = std::exchange(o.cells, {});
    mode = o.mode.load();
    rank = o.rank;
    size = o.size;
    algorithm_name = o.algorithm_name;
    open = std::exchange(o.open, nullptr);
    writer = std::move(o.writer);
    published = o.published.exchange(nullptr);
    return *this;
  }

  [[nodiscard]] int current_mode() const noexcept { return mode.load(std::memory_order_relaxed); }
  ~trace_state();

  [[nodiscard]] counter_cell& cell(collective c, algorithm a) noexcept {
    const auto ci = static_cast<std::size_t>(c), ai = static_cast<std::size_t>(a);
    if (ci >= traced_collectives || ai >= traced_algorithms) return unlisted;
    return cells[ci * traced_algorithms + ai];
  }

  /// Calls of algorithms outside the built-in table (a table extended with its own, as
  /// algorithms::table::with allows) are counted here and not printed: the table's rows are
  /// the built-in algorithms.
  counter_cell unlisted{};
};

/// The hook in detail::exchange: a completed receive ends the open call's wait at entry.
inline void trace_receive(trace_state& t, bool is_send) noexcept {
  if (t.open != nullptr && !is_send) [[unlikely]]
    t.open->on_receive(std::chrono::steady_clock::now());
}

[[nodiscard]] inline std::string format_bytes(double b) {
  if (b >= 1e9) return fmt::format("{:.2f} GB", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.2f} MB", b / 1e6);
  if (b >= 1e3) return fmt::format("{:.2f} kB", b / 1e3);
  return fmt::format("{:.0f} B", b);
}

/// The counters as a table, one line per (collective, algorithm) that was called.
[[nodiscard]] inline std::vector<std::string> counter_lines(const trace_state& t, int size) {
  std::vector<std::string> out;
  out.push_back(fmt::format("{:<15}{:<10}{:>9}{:>13}{:>12}{:>11}{:>12}", "collective", "algorithm",
                            "calls", "bytes", "total ms", "mean us", "busbw GB/s"));
  for (std::size_t c = 0; c < traced_collectives; ++c)
    for (std::size_t a = 0; a < traced_algorithms; ++a) {
      const counter_cell& x = t.cells[c * traced_algorithms + a];
      if (x.calls == 0) continue;
      const auto kind = static_cast<collective>(c);
      const double secs = x.seconds();
      const double busbw =
          secs > 0 ? static_cast<double>(x.bytes) / secs * busbw_factor(kind, size) / 1e9 : 0.0;
      out.push_back(fmt::format("{:<15}{:<10}{:>9}{:>13}{:>12.3f}{:>11.2f}{:>12.3f}",
                                collective_name(kind),
                                a == 0             ? std::string_view("-")
                                : t.algorithm_name ? t.algorithm_name(static_cast<algorithm>(a))
                                                   : std::string_view("?"),
                                x.calls, format_bytes(static_cast<double>(x.bytes)), secs * 1e3,
                                secs * 1e6 / static_cast<double>(x.calls), busbw));
    }
  return out;
}

inline trace_state::~trace_state() {
  if (!log::enabled(log::level::info)) return;
  bool any = false;
  for (const auto& x : cells) any = any || x.calls > 0;
  if (!any) return;
  try {
    log::info("collective counters of rank {} of {} (communicator destroyed):", rank, size);
    for (const auto& line : counter_lines(*this, size)) log::info("  {}", line);
  } catch (...) {
    // A destructor must not throw; a failed log line loses only the table.
  }
}

}  // namespace ringzero::detail
