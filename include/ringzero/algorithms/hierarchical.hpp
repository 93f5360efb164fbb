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
// communicator and kept by it (communicator::hierarchy()).
#pragma once

#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <utility>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/communicator.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms {

namespace detail {

// The public collectives are found by argument-dependent lookup (ringzero::options is an
// argument) when this template is instantiated: collectives.hpp includes this header before it
// defines them.
template <class C>
node_communicators<C>& nodes_of(C& comm) {
  if (auto* cached = comm.hierarchy()) return *cached;
  const topology t = comm.topo();
  // Agreeing on uniformity needs every rank's node size. A forced ring keeps RINGZERO_ALGO=hier
  // from recursing into this very function.
  int sizes[2] = {t.local_size, -t.local_size};
  all_reduce(comm, std::span<int>(sizes), op::max, options{.algorithm = algorithm::ring});
  auto local = comm.split(t.node, comm.rank());
  auto cross = comm.split(t.local_rank, t.node);
  return comm.set_hierarchy(
      node_communicators<C>{std::move(*local), std::move(*cross), sizes[0] == -sizes[1]});
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
    // One level only: nothing to decompose. The cost model picks a flat algorithm (the
    // hierarchical one does not apply on one level, so RINGZERO_ALGO=hier cannot send this
    // call straight back here).
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

namespace hierarchical {

/// Node-aware all_reduce; competes only when the ranks span more than one node and fewer nodes
/// than ranks. Priced as the three levels it runs, each as the algorithm it will pick (only
/// (ranks, nodes) enter, never a rank's own node size, so every rank predicts the same). With L
/// = n / nodes ranks per node: reduce_scatter(S over L) + all_reduce(S/L over nodes) +
/// all_gather(S over L). When nodes cannot be equal the leader scheme is priced: reduce(S over
/// ceil L) + all_reduce(S over nodes) + broadcast(S over ceil L).
struct descriptor {
  static constexpr algorithm id = algorithm::hierarchical;
  static constexpr std::string_view name = "hier";
  static constexpr collective_set implements{collective::all_reduce};
  static constexpr bool needs_nodes = true;

  template <class Table>
  [[nodiscard]] static double cost(const tuning::cost_query& q) {
    const int n = q.ranks, nodes = q.nodes;
    if (nodes <= 1 || nodes >= n) return std::numeric_limits<double>::infinity();
    const auto best = [&](collective c, double bytes, int ranks) {
      return Table::predict_best(tuning::cost_query{c, bytes, ranks, q.p, 1});
    };
    if (n % nodes == 0) {
      const int per = n / nodes;
      return best(collective::reduce_scatter, q.bytes, per) +
             best(collective::all_reduce, q.bytes / per, nodes) +
             best(collective::all_gather, q.bytes, per);
    }
    const int per = (n + nodes - 1) / nodes;
    return best(collective::reduce, q.bytes, per) + best(collective::all_reduce, q.bytes, nodes) +
           best(collective::broadcast, q.bytes, per);
  }

  template <class C, element E>
  static void run(C& comm, const call<E>& c, const options& opt) {
    hierarchical_all_reduce(comm, c.in, c.out, c.reduction, opt);
  }
};

}  // namespace hierarchical

}  // namespace ringzero::algorithms
