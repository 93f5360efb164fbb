// Algorithm names and per-call options. automatic asks the cost model (tuning/cost_model.hpp);
// RINGZERO_ALGO forces one for every collective it applies to, and options::algorithm forces
// one for a single call.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "ringzero/error.hpp"

namespace ringzero {

enum class algorithm : std::uint8_t {
  automatic,
  ring,  ///< ring (all_reduce, reduce_scatter, all_gather); pipelined chain (broadcast, reduce)
  tree,  ///< double binary tree (all_reduce); binomial tree (broadcast, reduce, gather, scatter)
  recursive_doubling,          ///< all_reduce, all_gather: log2(n) exchanges of the whole message
  recursive_halving_doubling,  ///< Rabenseifner all_reduce; recursive halving reduce_scatter
  hierarchical,                ///< intra-node, then inter-node, then intra-node (needs node info)
  pairwise,  ///< all_to_all(v): n-1 rounds, round k sends to r+k and receives from r-k
  bruck,     ///< all_to_all: Bruck's ceil(log2 n) rounds of half the blocks (small blocks)
  linear,    ///< gather, scatter: the root exchanges with every rank directly
};

enum class collective : std::uint8_t {
  all_reduce,
  reduce_scatter,
  all_gather,
  broadcast,
  reduce,
  barrier,
  send_recv,
  all_to_all,
  all_to_allv,
  gather,
  scatter
};

[[nodiscard]] constexpr std::string_view collective_name(collective c) noexcept {
  switch (c) {
    case collective::all_reduce:
      return "all_reduce";
    case collective::reduce_scatter:
      return "reduce_scatter";
    case collective::all_gather:
      return "all_gather";
    case collective::broadcast:
      return "broadcast";
    case collective::reduce:
      return "reduce";
    case collective::barrier:
      return "barrier";
    case collective::send_recv:
      return "send_recv";
    case collective::all_to_all:
      return "all_to_all";
    case collective::all_to_allv:
      return "all_to_allv";
    case collective::gather:
      return "gather";
    case collective::scatter:
      return "scatter";
  }
  return "?";
}

/// Short names as RINGZERO_ALGO and ringzero-perf -A spell them.
[[nodiscard]] constexpr std::string_view algorithm_name(algorithm a) noexcept {
  switch (a) {
    case algorithm::automatic:
      return "auto";
    case algorithm::ring:
      return "ring";
    case algorithm::tree:
      return "tree";
    case algorithm::recursive_doubling:
      return "rd";
    case algorithm::recursive_halving_doubling:
      return "rhd";
    case algorithm::hierarchical:
      return "hier";
    case algorithm::pairwise:
      return "pairwise";
    case algorithm::bruck:
      return "bruck";
    case algorithm::linear:
      return "linear";
  }
  return "?";
}

[[nodiscard]] inline algorithm parse_algorithm(std::string_view s) {
  for (algorithm a :
       {algorithm::automatic, algorithm::ring, algorithm::tree, algorithm::recursive_doubling,
        algorithm::recursive_halving_doubling, algorithm::hierarchical, algorithm::pairwise,
        algorithm::bruck, algorithm::linear})
    if (algorithm_name(a) == s) return a;
  if (s == "automatic") return algorithm::automatic;
  throw invalid_argument("unknown algorithm '" + std::string(s) +
                         "' (expected auto, ring, tree, rd, rhd, hier, pairwise, bruck or linear)");
}

/// Per-call knobs. Zero means "the default": the communicator's timeout, the transport's chunk.
struct options {
  ringzero::algorithm algorithm = ringzero::algorithm::automatic;
  std::chrono::nanoseconds timeout{0};
  std::size_t chunk_bytes = 0;
};

}  // namespace ringzero
