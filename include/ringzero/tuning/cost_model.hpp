// The alpha-beta-gamma cost model (Thakur, Rabenseifner & Gropp, 2005) that algorithm::automatic
// consults. Each transport supplies alpha (per-message latency), beta (seconds per byte on the
// wire) and gamma (seconds per byte reduced); the model predicts each applicable algorithm's
// time and picks the cheapest. The prediction depends only on (collective, bytes, ranks, the
// constants), so every rank of a communicator picks the same algorithm without talking.
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/transport/concept.hpp"

namespace ringzero::tuning {

[[nodiscard]] constexpr bool is_pow2(int n) noexcept {
  return n > 0 && (n & (n - 1)) == 0;
}

/// floor(log2 n) for n >= 1.
[[nodiscard]] constexpr int floor_log2(int n) noexcept {
  int p = 0;
  while ((2 << p) <= n) ++p;
  return p;
}

/// ceil(log2 n) for n >= 1.
[[nodiscard]] constexpr int ceil_log2(int n) noexcept {
  return is_pow2(n) ? floor_log2(n) : floor_log2(n) + 1;
}

/// Algorithms that implement `c` (hierarchical only where the caller says nodes exist).
[[nodiscard]] inline std::vector<algorithm> candidates(collective c, bool multi_node) {
  switch (c) {
    case collective::all_reduce:
      if (multi_node)
        return {algorithm::ring, algorithm::tree, algorithm::recursive_doubling,
                algorithm::recursive_halving_doubling, algorithm::hierarchical};
      return {algorithm::ring, algorithm::tree, algorithm::recursive_doubling,
              algorithm::recursive_halving_doubling};
    case collective::reduce_scatter:
      return {algorithm::ring, algorithm::recursive_halving_doubling};
    case collective::all_gather:
      return {algorithm::ring, algorithm::recursive_doubling};
    case collective::broadcast:
    case collective::reduce:
      return {algorithm::ring, algorithm::tree};
    case collective::all_to_all:
      if (multi_node) return {algorithm::pairwise, algorithm::bruck, algorithm::hierarchical};
      return {algorithm::pairwise, algorithm::bruck};
    case collective::all_to_allv:
      return {algorithm::pairwise};
    case collective::gather:
    case collective::scatter:
      return {algorithm::linear, algorithm::tree};
    case collective::barrier:
    case collective::send_recv:
      return {};
  }
  return {};
}

[[nodiscard]] inline bool applies(collective c, algorithm a, bool multi_node = true) {
  for (algorithm x : candidates(c, multi_node))
    if (x == a) return true;
  return false;
}

/// Predicted seconds for `c` with algorithm `a` on `n` ranks. `bytes` is the size of one
/// rank's full buffer: the all_reduce vector, the reduce_scatter input, the all_gather output,
/// the broadcast/reduce buffer, the all_to_all(v) input, the gather/scatter root's n blocks.
[[nodiscard]] inline double predict(collective c, algorithm a, double bytes, int n,
                                    const cost_params& p) {
  if (n <= 1) return 0.0;
  const double al = p.alpha, be = p.beta, ga = p.gamma;
  const double frac = static_cast<double>(n - 1) / n;
  const double lg = floor_log2(n);
  // Non-powers of two fold the extra ranks in and out: two more whole-message steps.
  const double fold = is_pow2(n) ? 0.0 : 1.0;
  const double chunks = std::max(1.0, std::ceil(bytes / static_cast<double>(p.chunk_bytes)));
  switch (c) {
    case collective::all_reduce:
      switch (a) {
        case algorithm::ring:
          return 2 * (n - 1) * al + 2 * frac * bytes * be + frac * bytes * ga;
        case algorithm::recursive_doubling:
          return (lg + 2 * fold) * (al + bytes * be) + (lg + fold) * bytes * ga;
        case algorithm::recursive_halving_doubling:
          return 2 * (lg + fold) * al + (2 * frac + 2 * fold) * bytes * be +
                 (frac + fold) * bytes * ga;
        case algorithm::tree: {
          // Two trees, each carrying half; a pipeline of chunks up and down log2(n) levels.
          const double depth = ceil_log2(n);
          const double per_chunk = bytes / chunks;
          return 2 * (depth + chunks - 1) * (al + per_chunk * be) + bytes * ga;
        }
        default:
          return std::numeric_limits<double>::infinity();
      }
    case collective::reduce_scatter:
      switch (a) {
        case algorithm::ring:
          return (n - 1) * al + frac * bytes * (be + ga);
        case algorithm::recursive_halving_doubling:
          return (lg + fold) * al + (frac + fold) * bytes * (be + ga);
        default:
          return std::numeric_limits<double>::infinity();
      }
    case collective::all_gather:
      switch (a) {
        case algorithm::ring:
          return (n - 1) * al + frac * bytes * be;
        case algorithm::recursive_doubling:
          return ceil_log2(n) * al + frac * bytes * be;
        default:
          return std::numeric_limits<double>::infinity();
      }
    case collective::broadcast:
    case collective::reduce: {
      const double g = c == collective::reduce ? ga : 0.0;
      switch (a) {
        case algorithm::ring:
          return (n - 2 + chunks) * (al + bytes / chunks * (be + g));
        case algorithm::tree:
          return ceil_log2(n) * (al + bytes * (be + g));
        default:
          return std::numeric_limits<double>::infinity();
      }
    }
    case collective::all_to_all:
    case collective::all_to_allv:
      switch (a) {
        case algorithm::pairwise:
          return (n - 1) * al + frac * bytes * be;
        case algorithm::bruck:
          // About half the blocks move in each round, and the buffer is copied three times.
          return c == collective::all_to_all ? ceil_log2(n) * (al + bytes / 2 * be) + 3 * bytes * ga
                                             : std::numeric_limits<double>::infinity();
        default:
          return std::numeric_limits<double>::infinity();
      }
    case collective::gather:
    case collective::scatter:
      switch (a) {
        case algorithm::linear:
          return (n - 1) * al + frac * bytes * be;
        case algorithm::tree:
          return ceil_log2(n) * al + frac * bytes * be;
        default:
          return std::numeric_limits<double>::infinity();
      }
    case collective::barrier:
    case collective::send_recv:
      return 0.0;
  }
  return std::numeric_limits<double>::infinity();
}

/// The cheapest applicable algorithm; ties go to the earlier candidate.
[[nodiscard]] inline algorithm select(collective c, double bytes, int n, const cost_params& p,
                                      bool multi_node = false) {
  algorithm best = algorithm::ring;
  double best_t = std::numeric_limits<double>::infinity();
  for (algorithm a : candidates(c, multi_node)) {
    const double t = predict(c, a, bytes, n, p);
    if (t < best_t) {
      best_t = t;
      best = a;
    }
  }
  return best;
}

/// The prediction for the algorithm select() would pick among the single-level ones.
[[nodiscard]] inline double predict_best(collective c, double bytes, int n, const cost_params& p) {
  return predict(c, select(c, bytes, n, p, false), bytes, n, p);
}

/// Hierarchical all_reduce of `bytes` on n ranks spread over `nodes` nodes, each level costed
/// as the algorithm it will pick. Only (n, nodes) enter, never a rank's own node size, so every
/// rank predicts the same. With L = n / nodes ranks per node:
///   reduce_scatter(S over L) + all_reduce(S/L over nodes) + all_gather(S over L),
/// which moves the ring's 2(n-1)/n of S per rank in 2(L-1) + (cross-node) steps instead of
/// 2(n-1); with one set of constants for all links it therefore never loses to the ring on
/// bandwidth and wins on latency. When nodes cannot be equal (n % nodes != 0) the leader
/// scheme is costed: reduce(S over ceil L) + all_reduce(S over nodes) + broadcast(S over ceil L).
/// One rank per node, or a single node, leaves nothing to decompose: never chosen.
[[nodiscard]] inline double predict_hierarchical(double bytes, int n, int nodes,
                                                 const cost_params& p) {
  if (nodes <= 1 || nodes >= n) return std::numeric_limits<double>::infinity();
  if (n % nodes == 0) {
    const int per = n / nodes;
    return predict_best(collective::reduce_scatter, bytes, per, p) +
           predict_best(collective::all_reduce, bytes / per, nodes, p) +
           predict_best(collective::all_gather, bytes, per, p);
  }
  const int per = (n + nodes - 1) / nodes;
  return predict_best(collective::reduce, bytes, per, p) +
         predict_best(collective::all_reduce, bytes, nodes, p) +
         predict_best(collective::broadcast, bytes, per, p);
}

/// Hierarchical all_to_all of `bytes` per rank on n ranks over `nodes` equal nodes of L = n /
/// nodes ranks: gather(L·S over L) + all_to_all(L·S over nodes) + scatter(L·S over L), each
/// level costed as the algorithm it will pick. Unequal nodes (and one level) are never chosen.
[[nodiscard]] inline double predict_hierarchical_all_to_all(double bytes, int n, int nodes,
                                                            const cost_params& p) {
  if (nodes <= 1 || nodes >= n || n % nodes != 0) return std::numeric_limits<double>::infinity();
  const int per = n / nodes;
  return predict_best(collective::gather, per * bytes, per, p) +
         predict_best(collective::all_to_all, per * bytes, nodes, p) +
         predict_best(collective::scatter, per * bytes, per, p);
}

/// select() for a communicator whose placement is known: hierarchical competes when the ranks
/// span more than one node.
[[nodiscard]] inline algorithm select(collective c, double bytes, int n, const cost_params& p,
                                      const topology& t) {
  algorithm best = algorithm::ring;
  double best_t = std::numeric_limits<double>::infinity();
  for (algorithm a : candidates(c, t.node_count > 1)) {
    const double time = a != algorithm::hierarchical ? predict(c, a, bytes, n, p)
                        : c == collective::all_to_all
                            ? predict_hierarchical_all_to_all(bytes, n, t.node_count, p)
                            : predict_hierarchical(bytes, n, t.node_count, p);
    if (time < best_t) {
      best_t = time;
      best = a;
    }
  }
  return best;
}

}  // namespace ringzero::tuning
