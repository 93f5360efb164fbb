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
// Each level is a collective on a sub-communicator, run by the dispatcher with
// algorithm::automatic, so it picks its own algorithm for its size. The two sub-communicators are
// split once per communicator and kept by it (communicator::nodes()). Where the transport
// advertises one for the ranks of a host (libfabric: node_transport = shm), the node levels run
// over it: one shared-memory communicator per node, set up collectively with the split; the
// cross-node level stays on the parent's transport. RINGZERO_NODE_SHM=0 keeps every level on the
// parent's. With two ranks per node each block is reduced from two operands, so the result is
// bitwise the same over either transport; with more, the node level may add its operands in another
// order than the parent's algorithms would (each rank still ends bitwise identical to the others).
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/bruck.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/algorithms/detail/pipeline.hpp"
#include "ringzero/algorithms/pairwise.hpp"
#include "ringzero/communicator.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/dispatch_fwd.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms {

namespace detail {

// Runs f on the node level: the node's shared-memory communicator where it has one, else the
// split of the parent. A rank that fails there is named as the parent numbers it, with the
// parent transport's wording, so a caller sees one kind of error whichever level found it.
template <class C, class F>
void on_node(C& comm, node_communicators<C>& nodes, F&& f) {
  if constexpr (requires { nodes.node->rank(); }) {
    if (nodes.node) {
      const auto parent_of = [&](int local_rank) {
        if (local_rank < 0 || local_rank >= nodes.local.size()) return -1;
        const int world = nodes.local.members()[static_cast<std::size_t>(local_rank)];
        const auto& m = comm.members();
        const auto it = std::find(m.begin(), m.end(), world);
        return it == m.end() ? -1 : static_cast<int>(it - m.begin());
      };
      // what() starts with "ringzero: ", which the rethrown error adds again.
      const auto text = [](const error& e) { return std::string_view(e.what()).substr(10); };
      try {
        f(*nodes.node);
      } catch (const peer_error& e) {
        const int peer = parent_of(e.peer());
        if (peer < 0) throw;
        throw peer_error(fmt::format("rank {} died or failed (node level over shm, where it is "
                                     "local rank {}): {}",
                                     peer, e.peer(), text(e)),
                         peer);
      } catch (const timeout_error& e) {
        const int peer = parent_of(e.peer());
        if (peer < 0) throw;
        throw timeout_error(fmt::format("{} (local rank {} of the node level over shm is rank {})",
                                        text(e), e.peer(), peer),
                            peer);
      }
      return;
    }
  }
  f(nodes.local);
}

/// One level's collective on `comm` (a node's or the leaders' communicator), through the
/// dispatcher: its buffers are parts of the checked call's.
template <class C, element E>
void level(C& comm, collective k, std::span<const E> in, std::span<E> out, op o, int root,
           const options& opt) {
  ringzero::detail::dispatch_builtin(
      comm, call<E>{.kind = k, .in = in, .out = out, .reduction = o, .root = root}, opt);
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
    detail::level(comm, collective::all_reduce, in, out, o, 0, level);
    return;
  }
  auto& nodes = comm.nodes();
  // avg divides once, by the world size, after the last sum: dividing per level would round
  // (and, for integers, truncate) twice.
  const op sum_op = o == op::avg ? op::sum : o;
  const int n = comm.size();

  if (!nodes.uniform) {
    const bool leader = nodes.local.rank() == 0;
    detail::on_node(comm, nodes, [&](auto& node) {
      detail::level(node, collective::reduce, in, out, sum_op, 0, level);
    });
    if (leader) {
      detail::level(nodes.cross, collective::all_reduce, std::span<const E>(out), out, sum_op, 0,
                    level);
      if (o == op::avg) reduction::finish_avg(out.data(), out.size(), n);
    }
    detail::on_node(comm, nodes, [&](auto& node) {
      detail::level(node, collective::broadcast, std::span<const E>(out), out, op::sum, 0, level);
    });
    return;
  }

  const auto local_size = static_cast<std::size_t>(nodes.local.size());
  const auto local_rank = static_cast<std::size_t>(nodes.local.rank());
  const std::size_t count = out.size();
  const std::size_t block = (count + local_size - 1) / local_size;
  auto levels = [&](std::span<const E> src, std::span<E> dst) {
    std::span<E> mine = dst.subspan(local_rank * block, block);
    detail::on_node(comm, nodes, [&](auto& node) {
      detail::level(node, collective::reduce_scatter, src, mine, sum_op, 0, level);
    });
    detail::level(nodes.cross, collective::all_reduce, std::span<const E>(mine), mine, sum_op, 0,
                  level);
    if (o == op::avg) reduction::finish_avg(mine.data(), mine.size(), n);
    detail::on_node(comm, nodes, [&](auto& node) {
      detail::level(node, collective::all_gather, std::span<const E>(mine), dst, op::sum, 0, level);
    });
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

// Hierarchical all_to_all, for many ranks per node: only the node leaders (local rank 0) cross
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
// Each level is a collective on the sub-communicators, run by the dispatcher with
// algorithm::automatic. Nodes of unequal size (or a single level) fall back to the best flat
// algorithm. In place is free: every input is gathered before any output is written.

/// Preconditions (checked by the collectives layer): size() >= 2, in.size() == out.size() > 0
/// and a multiple of size(); in may equal out.
template <class T, element E>
void hierarchical_all_to_all(T& comm, std::span<const E> in, std::span<E> out, const options& opt) {
  const topology t = comm.topo();
  options level = opt;
  level.algorithm = algorithm::automatic;
  const bool one_level = t.node_count == 1 || t.node_count == comm.size();
  if (one_level || !comm.nodes().uniform) {
    // The cheaper flat algorithm, run directly: with unequal nodes automatic could pick this
    // one again.
    const tuning::cost_query q{collective::all_to_all, static_cast<double>(in.size_bytes()),
                               comm.size(), comm.tuning(), 1};
    if (bruck::descriptor::cost<void>(q) < pairwise::descriptor::cost<void>(q))
      return bruck::all_to_all(comm, in, out, opt);
    return pairwise::all_to_all(comm, in, out, opt);
  }
  auto& nodes = comm.nodes();
  const auto n = static_cast<std::size_t>(comm.size());
  const auto l = static_cast<std::size_t>(nodes.local.size());
  const std::size_t nodes_count = n / l;
  const std::size_t b = in.size() / n;
  const std::size_t per_rank = n * b;  // one rank's whole buffer

  if (nodes.local.rank() != 0) {
    detail::on_node(comm, nodes, [&](auto& node) {
      detail::level(node, collective::gather, in, std::span<E>{}, op::sum, 0, level);
    });
    detail::on_node(comm, nodes, [&](auto& node) {
      detail::level(node, collective::scatter, std::span<const E>{}, out, op::sum, 0, level);
    });
    return;
  }
  // gathered[s][g]: local rank s's block for rank g. bundles[c][s][d]: that block when g is
  // local rank d of node c, the order the leaders exchange; exchanged[c][s][d]: node c's local
  // rank s's block for this node's local rank d.
  const std::span<E> scratch = algorithms::detail::scratch_of<E>(comm, 3 * l * per_rank);
  const std::span<E> gathered = scratch.subspan(0, l * per_rank);
  const std::span<E> bundles = scratch.subspan(l * per_rank, l * per_rank);
  const std::span<E> exchanged = scratch.subspan(2 * l * per_rank, l * per_rank);
  detail::on_node(comm, nodes, [&](auto& node) {
    detail::level(node, collective::gather, in, gathered, op::sum, 0, level);
  });
  const auto& rank_of = nodes.parent_rank;
  for (std::size_t c = 0; c < nodes_count; ++c)
    for (std::size_t s = 0; s < l; ++s)
      for (std::size_t d = 0; d < l; ++d) {
        const auto g = static_cast<std::size_t>(rank_of[c * l + d]);
        std::memcpy(bundles.data() + ((c * l + s) * l + d) * b, gathered.data() + (s * n + g) * b,
                    b * sizeof(E));
      }
  detail::level(nodes.cross, collective::all_to_all, std::span<const E>(bundles), exchanged,
                op::sum, 0, level);
  // The scatter's input reuses `gathered`: local rank d's n blocks, in source rank order.
  for (std::size_t c = 0; c < nodes_count; ++c)
    for (std::size_t s = 0; s < l; ++s) {
      const auto g = static_cast<std::size_t>(rank_of[c * l + s]);
      for (std::size_t d = 0; d < l; ++d)
        std::memcpy(gathered.data() + (d * n + g) * b, exchanged.data() + ((c * l + s) * l + d) * b,
                    b * sizeof(E));
    }
  detail::on_node(comm, nodes, [&](auto& node) {
    detail::level(node, collective::scatter, std::span<const E>(gathered), out, op::sum, 0, level);
  });
}

namespace hierarchical {

/// Node-aware all_reduce and all_to_all; competes only when the ranks span more than one node
/// and fewer nodes than ranks. Priced as the three levels it runs, each as the algorithm it will
/// pick (only (ranks, nodes) enter, never a rank's own node size, so every rank predicts the same).
/// With L = n / nodes ranks per node: reduce_scatter(S over L) + all_reduce(S/L over nodes) +
/// all_gather(S over L). When nodes cannot be equal the leader scheme is priced: reduce(S over
/// ceil L) + all_reduce(S over nodes) + broadcast(S over ceil L). all_to_all (equal nodes only):
/// gather(L·S over L) + all_to_all(L·S over nodes) + scatter(L·S over L).
struct descriptor {
  static constexpr algorithm id = algorithm::hierarchical;
  static constexpr std::string_view name = "hier";
  static constexpr collective_set implements{collective::all_reduce, collective::all_to_all};
  static constexpr bool needs_nodes = true;

  template <class Table>
  [[nodiscard]] static double cost(const tuning::cost_query& q) {
    const int n = q.ranks, nodes = q.nodes;
    if (nodes <= 1 || nodes >= n) return std::numeric_limits<double>::infinity();
    const auto best = [&](collective c, double bytes, int ranks) {
      return Table::predict_best(tuning::cost_query{c, bytes, ranks, q.p, 1});
    };
    if (q.c == collective::all_to_all) {
      if (n % nodes != 0) return std::numeric_limits<double>::infinity();
      const int per = n / nodes;
      return best(collective::gather, per * q.bytes, per) +
             best(collective::all_to_all, per * q.bytes, nodes) +
             best(collective::scatter, per * q.bytes, per);
    }
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
    if (c.kind == collective::all_to_all) return hierarchical_all_to_all(comm, c.in, c.out, opt);
    hierarchical_all_reduce(comm, c.in, c.out, c.reduction, opt);
  }
};

}  // namespace hierarchical

}  // namespace ringzero::algorithms
