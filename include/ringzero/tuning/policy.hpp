// A network's tuning policy, as data: the prices the cost model compares algorithms with and the
// flow-control limits the algorithms keep to on it. Every transport reports one (`tuning()`), the
// communicator answers with the same name (after a RINGZERO_TUNING file replaced what the machine
// measured), and tuning/defaults.hpp holds each transport's defaults with where they came from.
#pragma once

#include <fmt/core.h>

#include <cmath>
#include <cstddef>
#include <span>
#include <string_view>

#include "ringzero/error.hpp"

namespace ringzero::tuning {

/// The Hockney/Thakur constants, in seconds (a message of m bytes costs alpha + m*beta on the
/// wire, reducing m bytes costs m*gamma), and the flow-control limits of the network.
struct policy {
  double alpha = 5e-6;
  double beta = 1.0 / 5e9;
  double gamma = 1.0 / 10e9;
  /// Pipelining granularity for ring/chain/tree algorithms.
  std::size_t chunk_bytes = std::size_t{1} << 20;
  /// The smallest chunk the transport accepts, whatever options::chunk_bytes asks: above its
  /// eager threshold, so that a send completes only once the receiver has matched it. The
  /// algorithms bound their chunks in flight by waiting for sends; a send that completes on
  /// the sender alone (eager) would let it run ahead and pile early arrivals on the receiver.
  std::size_t min_chunk_bytes = 0;
  /// The most chunks of one message an algorithm posts at once (ring, recursive doubling and
  /// halving, Bruck); past it chunks grow instead. Every posted receive holds a provider
  /// entry, and libfabric's shm provider has 1024 for posted receives and early arrivals
  /// together: 256 MiB in 256 KiB chunks on 4 ranks used them all and deadlocked. 32 chunks in
  /// flight per message keep the pipeline as full as 1024 do.
  std::size_t burst = 32;
  /// Chunks a tree pipeline keeps in flight per direction and per child, whatever the size
  /// (the same provider limit, for pipelines that stream instead of posting a whole message).
  std::size_t inflight = 8;
  /// Shared-memory segments (the native shm transport): all_reduce up to this many bytes runs in
  /// one phase (every rank reduces the whole message from every rank's copy), above it in two
  /// (each rank reduces a block, then copies the others'). Where one stops paying depends on the
  /// machine's caches, so `ringzero-perf --tune` measures it. 0: the transport's own rule.
  std::size_t one_phase_bytes = 0;
  /// The world size one_phase_bytes was measured at and applies to; 0: every world size.
  int one_phase_ranks = 0;

  friend constexpr bool operator==(const policy&, const policy&) = default;
};

/// The one-phase limit `p` sets for a segment of `ranks` ranks, 0 where it leaves the
/// transport's rule.
[[nodiscard]] constexpr std::size_t one_phase_limit(const policy& p, int ranks) noexcept {
  return p.one_phase_ranks == 0 || p.one_phase_ranks == ranks ? p.one_phase_bytes : 0;
}

/// What one rail (one NIC, one interface, one connection set) costs on its own. A transport
/// that drives several rails at once prices itself with over_rails(); a rail's measured figure
/// goes here, not into the transport.
struct rail_price {
  double alpha = 0;  ///< seconds per message on this rail
  double beta = 0;   ///< seconds per byte on this rail alone

  friend constexpr bool operator==(const rail_price&, const rail_price&) = default;
};

/// `base` with the wire price of `rails` striped together: a message pays the slowest rail's
/// latency (every piece must arrive) and moves at the sum of the rails' rates. No rails: `base`.
[[nodiscard]] constexpr policy over_rails(policy base, std::span<const rail_price> rails) {
  if (rails.empty()) return base;
  double alpha = 0;
  double rate = 0;
  for (const rail_price& r : rails) {
    alpha = alpha > r.alpha ? alpha : r.alpha;
    rate += 1.0 / r.beta;
  }
  base.alpha = alpha;
  base.beta = 1.0 / rate;
  return base;
}

/// Throws invalid_argument naming `who` and the field when `p` cannot price anything: a
/// negative or non-finite constant, a zero beta or chunk, a smallest chunk above the chunk, no
/// room for a chunk in flight. The communicator checks what it is given before it selects with it.
inline void check(const policy& p, std::string_view who) {
  const auto fail = [&](std::string_view what) {
    return invalid_argument(fmt::format("{} tuning: {}", who, what));
  };
  const auto price = [&](double v, std::string_view name, bool zero_ok) {
    if (!std::isfinite(v) || v < 0 || (!zero_ok && v == 0))
      throw fail(fmt::format("{} = {} is not a {} number of seconds", name, v,
                             zero_ok ? "finite, non-negative" : "finite, positive"));
  };
  price(p.alpha, "alpha", true);
  price(p.beta, "beta", false);
  price(p.gamma, "gamma", true);
  if (p.chunk_bytes == 0) throw fail("chunk_bytes = 0: a pipeline needs chunks of at least a byte");
  if (p.burst == 0) throw fail("burst = 0: an algorithm must post at least one chunk");
  if (p.inflight == 0) throw fail("inflight = 0: a pipeline must keep at least one chunk moving");
  if (p.one_phase_ranks < 0)
    throw fail(fmt::format("one_phase_ranks = {} is not a world size (or 0, every size)",
                           p.one_phase_ranks));
}

}  // namespace ringzero::tuning

namespace ringzero {

/// The policy's names before 0.3 moved it here.
using cost_params [[deprecated(
    "ringzero::cost_params is ringzero::tuning::policy since 0.3 (tuning/policy.hpp); the alias "
    "goes in 0.5")]] = tuning::policy;
using tuning_policy [[deprecated(
    "ringzero::tuning_policy is ringzero::tuning::policy since 0.3 (tuning/policy.hpp); the alias "
    "goes in 0.5")]] = tuning::policy;

}  // namespace ringzero
