// Hierarchical all_to_all for many ranks per node: only the node leaders (local rank 0) cross
// node boundaries, each with one aggregated message per other node instead of L² small ones.
// With N nodes of L ranks and S = n blocks of b elements per rank:
//
//   1. gather the L inputs to the node's leader                (L·S at the leader)
//   2. the leaders all_to_all, one L·L-block bundle per node    (N-1 messages of L²·b per leader)
//   3. the leader scatters to each local rank its n blocks      (L·S at the leader)
//
//   cost: gather(L·S over L) + all_to_all(L·S over N) + scatter(L·S over L). Cross-node
//   latency is N-1 messages per leader instead of n-1 per rank, at the price of the leader's
//   link carrying L times a rank's share: it wins for small blocks on many ranks per node.
//
// Each level is a public collective on the sub-communicators of hierarchical.hpp with
// algorithm::automatic. Nodes of unequal size (or a single level) fall back to the best flat
// algorithm. In place is free: every input is gathered before any output is written.
#pragma once

#include <cstddef>
#include <cstring>
#include <span>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/detail/pipeline.hpp"
#include "ringzero/algorithms/hierarchical.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/tuning/cost_model.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms {

/// Preconditions (checked by the collectives layer): size() >= 2, in.size() == out.size() > 0
/// and a multiple of size(); in may equal out.
template <class T, element E>
void hierarchical_all_to_all(T& comm, std::span<const E> in, std::span<E> out, const options& opt) {
  const topology t = comm.topo();
  options level = opt;
  level.algorithm = algorithm::automatic;
  const bool one_level = t.node_count == 1 || t.node_count == comm.size();
  if (one_level || !detail::nodes_of(comm).uniform) {
    level.algorithm = tuning::select(collective::all_to_all, static_cast<double>(in.size_bytes()),
                                     comm.size(), comm.cost(), false);
    all_to_all(comm, in, out, level);
    return;
  }
  auto& nodes = detail::nodes_of(comm);
  const auto n = static_cast<std::size_t>(comm.size());
  const auto l = static_cast<std::size_t>(nodes.local.size());
  const std::size_t nodes_count = n / l;
  const std::size_t b = in.size() / n;
  const std::size_t per_rank = n * b;  // one rank's whole buffer

  if (nodes.local.rank() != 0) {
    gather(nodes.local, in, std::span<E>{}, 0, level);
    scatter(nodes.local, std::span<const E>{}, out, 0, level);
    return;
  }
  // gathered[s][g]: local rank s's block for rank g. bundles[c][s][d]: that block when g is
  // local rank d of node c, the order the leaders exchange; exchanged[c][s][d]: node c's local
  // rank s's block for this node's local rank d.
  const std::span<E> scratch = detail::scratch_of<E>(comm, 3 * l * per_rank);
  const std::span<E> gathered = scratch.subspan(0, l * per_rank);
  const std::span<E> bundles = scratch.subspan(l * per_rank, l * per_rank);
  const std::span<E> exchanged = scratch.subspan(2 * l * per_rank, l * per_rank);
  gather(nodes.local, in, gathered, 0, level);
  const auto& rank_of = nodes.parent_rank;
  for (std::size_t c = 0; c < nodes_count; ++c)
    for (std::size_t s = 0; s < l; ++s)
      for (std::size_t d = 0; d < l; ++d) {
        const auto g = static_cast<std::size_t>(rank_of[c * l + d]);
        std::memcpy(bundles.data() + ((c * l + s) * l + d) * b, gathered.data() + (s * n + g) * b,
                    b * sizeof(E));
      }
  all_to_all(nodes.cross, std::span<const E>(bundles), exchanged, level);
  // The scatter's input reuses `gathered`: local rank d's n blocks, in source rank order.
  for (std::size_t c = 0; c < nodes_count; ++c)
    for (std::size_t s = 0; s < l; ++s) {
      const auto g = static_cast<std::size_t>(rank_of[c * l + s]);
      for (std::size_t d = 0; d < l; ++d)
        std::memcpy(gathered.data() + (d * n + g) * b, exchanged.data() + ((c * l + s) * l + d) * b,
                    b * sizeof(E));
    }
  scatter(nodes.local, std::span<const E>(gathered), out, 0, level);
}

}  // namespace ringzero::algorithms
