// Observability: what each collective cost, and a timeline a person can open.
//
// Counters (always on): per collective kind and algorithm, the calls, bytes, total time and
// achieved bus bandwidth of one communicator. Read them with trace::counters(comm); at
// RINGZERO_DEBUG=INFO the communicator prints them as a table when it is destroyed.
//
// Timeline (RINGZERO_TRACE=<dir>, set on every rank): each rank writes <dir>/rank<R>.json, a
// Chrome-trace / Perfetto JSON file with one event per collective (name, bytes, type, op,
// algorithm, chunks, start, duration, and wait_us: how long the rank waited at entry for its
// first message) and per trace::scope. A value containing %r is a file pattern instead (%r
// rank, %p process id, %h host). Files are written line by line as events end, so a killed
// job leaves readable files. `ringzero-trace merge <dir>` aligns the ranks' clocks (measured
// against rank 0 when the file is opened, at the communicator's first collective) into one
// timeline with a track per rank; `ringzero-trace report <dir>` names the rank that arrived
// last most often, per collective kind, and by how much.
//
// Cost: with RINGZERO_TRACE unset, two clock reads and one predictable branch per collective;
// with it set, one line formatted and written per collective (docs/observability.md has the
// figures). Defining RINGZERO_DISABLE_TRACE compiles counters and tracing out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/trace_scope.hpp"
#include "ringzero/detail/trace_state.hpp"

namespace ringzero::trace {

/// The variable that turns the timeline on.
inline constexpr std::string_view env_var = "RINGZERO_TRACE";

/// One row of the counters: a (collective, algorithm) pair that was called at least once.
/// Barriers and point-to-point calls (send, recv, send_recv, counted as send_recv) have no
/// algorithm.
struct counter {
  collective kind = collective::all_reduce;
  ringzero::algorithm algo = ringzero::algorithm::automatic;
  std::uint64_t calls = 0;
  std::uint64_t bytes = 0;
  double seconds = 0;
  /// nccl-tests' bus bandwidth of all the calls together, GB/s (1e9 bytes).
  double busbw_gbps = 0;
};

/// comm's counters, one entry per (collective, algorithm) called, in enum order.
template <detail::counted_comm T>
[[nodiscard]] std::vector<counter> counters(T& comm) {
  std::vector<counter> out;
  const auto& t = comm.state().trace;
  for (std::size_t c = 0; c < detail::traced_collectives; ++c)
    for (std::size_t a = 0; a < detail::traced_algorithms; ++a) {
      const auto& x = t.cells[c * detail::traced_algorithms + a];
      if (x.calls == 0) continue;
      counter k;
      k.kind = static_cast<collective>(c);
      k.algo = static_cast<ringzero::algorithm>(a);
      k.calls = x.calls;
      k.bytes = x.bytes;
      k.seconds = x.seconds();
      k.busbw_gbps = k.seconds > 0 ? static_cast<double>(x.bytes) / k.seconds *
                                         detail::busbw_factor(k.kind, comm.size()) / 1e9
                                   : 0.0;
      out.push_back(k);
    }
  return out;
}

/// Starts comm's counters again from zero (e.g. after warm-up iterations).
template <detail::counted_comm T>
void reset_counters(T& comm) {
  comm.state().trace.cells = {};
}

/// comm's counters as the table RINGZERO_DEBUG=INFO prints, one line per row after a header.
template <detail::counted_comm T>
[[nodiscard]] std::string counters_table(T& comm) {
  std::string s;
  for (const auto& line : detail::counter_lines(comm.state().trace, comm.size())) {
    s += line;
    s += '\n';
  }
  return s;
}

/// A named span on comm's timeline, for code around the collectives: the sharder's gather,
/// reduce, step and checkpoint, a trainer's forward pass. Collectives run inside it nest under
/// it. It never communicates (a phase only rank 0 enters is fine) and costs one branch with
/// RINGZERO_TRACE unset. `name` must outlive the scope; `bytes` is shown in the event.
///
///   { ringzero::trace::scope s(comm, "gather", bytes); /* collectives */ }
template <class T>
class scope {
 public:
  scope(T& comm, std::string_view name, std::size_t bytes = 0) : impl_(comm, name, bytes) {}
  /// For a phase whose size is known only at its end (what a checkpoint wrote).
  void set_bytes(std::size_t bytes) noexcept { impl_.set_bytes(bytes); }

 private:
  // A communicator whose backend runs its own collectives (NCCL) has no ringzero timeline;
  // code written for any communicator (the sharder) still compiles, and its scopes are empty.
  struct untraced {
    untraced(T&, std::string_view, std::size_t) noexcept {}
    void set_bytes(std::size_t) noexcept {}
  };
  template <class U, bool = collective_comm<U>>
  struct pick {
    using type = untraced;
  };
  template <class U>
  struct pick<U, true> {
    using type = detail::phase_scope<U>;
  };
  typename pick<T>::type impl_;
};

}  // namespace ringzero::trace
