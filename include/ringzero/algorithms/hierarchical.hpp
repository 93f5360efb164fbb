// Hierarchical all_reduce: the node-aware decomposition for machines whose ranks share hosts.
//
//   1. reduce_scatter among the L ranks of each node      (L-1 steps, (L-1)/L of S per rank)
//   2. all_reduce of the 1/L block among the N ranks that have the same local rank, one per
//      node                                                (cross-node: only S/L per rank)
//   3. all_gather among the L ranks of each node          (L-1 steps, (L-1)/L of S per rank)
//
// Bytes sent per rank add up to the ring's 2(n-1)/n of S, but only 2(N-1)/N of S/L crosses
// node boundaries and the latency is 2(L-1) + (cross-node steps) instead of 2(n-1).
// When nodes hold different numbers of ranks the blocks of step 1 would not line up across
// nodes, so each node reduces to its first rank, those leaders all_reduce, and each leader
// broadcasts to its node.
//
// Each level is a public collective on a sub-communicator with algorithm::automatic, so it
// picks its own algorithm for its size. The two sub-communicators are split once per
// communicator and kept in its state.
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/tuning/cost_model.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms {

namespace detail {

/// The pair of sub-communicators one communicator's hierarchical collectives use.
template <class T>
struct node_communicators {
  T local;       ///< the ranks of this node, in parent rank order
  T cross;       ///< the ranks with this local rank, one per node, in node order
  bool uniform;  ///< every node holds the same number of ranks
  /// With uniform nodes, the rank in the parent of local rank l on node c (cross rank c) at
  /// c * local.size() + l; empty otherwise (hierarchical all_to_all needs it).
  std::vector<int> parent_rank;
};

// The public collectives are found by argument-dependent lookup (ringzero::options is an
// argument) when this template is instantiated: collectives.hpp includes this header before it
// defines them.
template <class T>
node_communicators<T>& nodes_of(T& comm) {
  auto& cache = comm.state().hierarchy;
  if (!cache) {
    const topology t = comm.topo();
    // Agreeing on uniformity needs every rank's node size. A forced ring keeps RINGZERO_ALGO=hier
    // from recursing into this very function.
    int sizes[2] = {t.local_size, -t.local_size};
    all_reduce(comm, std::span<int>(sizes), op::max, options{.algorithm = algorithm::ring});
    auto local = comm.split(t.node, comm.rank());
    auto cross = comm.split(t.local_rank, t.node);
    const bool uniform = sizes[0] == -sizes[1];
    const auto n = static_cast<std::size_t>(comm.size());
    std::vector<int> where(2 * n), parent_rank;
    const int mine[2] = {cross->rank(), local->rank()};
    all_gather(comm, std::span<const int>(mine), std::span<int>(where),
               options{.algorithm = algorithm::ring});
    if (uniform) {
      parent_rank.resize(n);
      for (std::size_t g = 0; g < n; ++g)
        parent_rank[static_cast<std::size_t>(where[2 * g] * local->size() + where[2 * g + 1])] =
            static_cast<int>(g);
    }
    cache = std::make_shared<node_communicators<T>>(node_communicators<T>{
        std::move(*local), std::move(*cross), uniform, std::move(parent_rank)});
  }
  return *static_cast<node_communicators<T>*>(cache.get());
}

}  // namespace detail

/// Preconditions (checked by the collectives layer): size() >= 2, in.size() == out.size() > 0;
/// in may equal out. Results are bitwise identical on every rank: each element is reduced by
/// exactly one cross-node all_reduce and then copied.
template <class T, element E>
void hierarchical_all_reduce(T& comm, std::span<const E> in, std::span<E> out, op o,
                             const options& opt) {
  const topology t = comm.topo();
  options level = opt;
  level.algorithm = algorithm::automatic;
  if (t.node_count == 1 || t.node_count == comm.size()) {
    // One level only: nothing to decompose. Pick the best flat algorithm, so a forced
    // RINGZERO_ALGO=hier does not send this call straight back here.
    level.algorithm = tuning::select(collective::all_reduce, static_cast<double>(out.size_bytes()),
                                     comm.size(), comm.cost(), false);
    all_reduce(comm, in, out, o, level);
    return;
  }
  auto& nodes = detail::nodes_of(comm);
  // avg divides once, by the world size, after the last sum: dividing per level would round
  // (and, for integers, truncate) twice.
  const op sum_op = o == op::avg ? op::sum : o;
  const int n = comm.size();

  if (!nodes.uniform) {
    const bool leader = nodes.local.rank() == 0;
    reduce(nodes.local, in, out, sum_op, 0, level);
    if (leader) {
      all_reduce(nodes.cross, out, sum_op, level);
      if (o == op::avg) reduction::finish_avg(out.data(), out.size(), n);
    }
    broadcast(nodes.local, out, 0, level);
    return;
  }

  const auto local_size = static_cast<std::size_t>(nodes.local.size());
  const auto local_rank = static_cast<std::size_t>(nodes.local.rank());
  const std::size_t count = out.size();
  const std::size_t block = (count + local_size - 1) / local_size;
  auto levels = [&](std::span<const E> src, std::span<E> dst) {
    std::span<E> mine = dst.subspan(local_rank * block, block);
    reduce_scatter(nodes.local, src, mine, sum_op, level);
    all_reduce(nodes.cross, mine, sum_op, level);
    if (o == op::avg) reduction::finish_avg(mine.data(), mine.size(), n);
    all_gather(nodes.local, std::span<const E>(mine), dst, level);
  };
  if (block * local_size == count) {
    levels(in, out);
    return;
  }
  // Pad to local_size equal blocks in this communicator's scratch; the padding is reduced
  // along with the data and dropped.
  const std::size_t padded = block * local_size;
  auto raw = comm.state().scratch(padded * sizeof(E));
  std::span<E> buf(reinterpret_cast<E*>(raw.data()), padded);
  std::memcpy(buf.data(), in.data(), in.size_bytes());
  std::memset(static_cast<void*>(buf.data() + count), 0, (padded - count) * sizeof(E));
  levels(std::span<const E>(buf), buf);
  std::memcpy(out.data(), buf.data(), out.size_bytes());
}

}  // namespace ringzero::algorithms
