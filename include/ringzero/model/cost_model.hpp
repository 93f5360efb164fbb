// The alpha-beta-gamma cost model (Thakur, Rabenseifner & Gropp, 2005) that algorithm::automatic
// consults. Each transport supplies alpha (per-message latency), beta (seconds per byte on the
// wire) and gamma (seconds per byte reduced); each algorithm prices itself in its descriptor
// (algorithms/table.hpp); the model compares the prices and picks the cheapest. The prediction
// depends only on (collective, bytes, ranks, nodes, the constants), so every rank of a
// communicator picks the same algorithm without talking.
#pragma once

#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/table.hpp"
#include "ringzero/base.hpp"
#include "ringzero/tuning/cost_terms.hpp"

namespace ringzero::tuning {

using algorithm_table = algorithms::builtin;

/// Algorithms that implement `c` (node-aware ones only where the caller says nodes exist).
[[nodiscard]] inline std::vector<algorithm> candidates(collective c, bool multi_node) {
  return algorithm_table::candidates(c, multi_node);
}

[[nodiscard]] inline bool applies(collective c, algorithm a, bool multi_node = true) {
  return algorithm_table::implements(c, a) && (multi_node || !algorithm_table::needs_nodes(a));
}

/// Predicted seconds for `c` with algorithm `a` on `n` ranks of one node. `bytes` is the size of
/// one rank's full buffer (cost_query says which).
[[nodiscard]] inline double predict(collective c, algorithm a, double bytes, int n,
                                    const tuning::policy& p) {
  return algorithm_table::predict(a, cost_query{c, bytes, n, p, 1});
}

/// The cheapest single-level algorithm; ties go to the earlier one in the table.
[[nodiscard]] inline algorithm select(collective c, double bytes, int n, const tuning::policy& p) {
  return algorithm_table::select(cost_query{c, bytes, n, p, 1});
}

/// The prediction for the algorithm select() would pick among the single-level ones.
[[nodiscard]] inline double predict_best(collective c, double bytes, int n,
                                         const tuning::policy& p) {
  return algorithm_table::predict_best(cost_query{c, bytes, n, p, 1});
}

/// Hierarchical all_reduce of `bytes` on n ranks spread over `nodes` nodes
/// (algorithms/hierarchical.hpp prices it); infinity on one node or one rank per node.
[[nodiscard]] inline double predict_hierarchical(double bytes, int n, int nodes,
                                                 const tuning::policy& p) {
  return algorithm_table::predict(algorithm::hierarchical,
                                  cost_query{collective::all_reduce, bytes, n, p, nodes});
}

/// select() for a communicator whose placement is known: node-aware algorithms compete when the
/// ranks span more than one node.
[[nodiscard]] inline algorithm select(collective c, double bytes, int n, const tuning::policy& p,
                                      const topology& t) {
  return algorithm_table::select(cost_query{c, bytes, n, p, t.node_count});
}

}  // namespace ringzero::tuning
