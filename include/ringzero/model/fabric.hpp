// A two-level machine for the cost model: nodes of G GPUs joined inside by one fabric
// (NVLink/NVSwitch) and between nodes by NICs (EFA, InfiniBand). cost_model.hpp prices an
// algorithm with one set of constants; here each algorithm is priced with the constants of the
// links it actually waits on, through the same cost_model.hpp formulas, so a prediction for N
// nodes describes what ringzero's algorithms would do there:
//
//   - a flat algorithm (ring, tree, rd, rhd) on n = N·G ranks in node order waits, at every
//     step, for a message that crosses a node boundary: the ring has one such hop per node in
//     every step; Rabenseifner's halving starts at distance n/2, so its large steps are the
//     cross-node ones. It is priced on n ranks with the inter-node constants of one rank;
//   - hierarchical all_reduce is reduce_scatter over G (intra-node constants), all_reduce of
//     S/G over N nodes (inter-node constants; the G such all_reduces run side by side, each
//     rank on its own share of the node's NICs), all_gather over G (intra-node constants).
//
// One rank's share of the node's NICs is nics_per_node / gpus_per_node of them: a rank drives
// its own NICs (p5: four per GPU) or shares one with its neighbours (p4d: one per two GPUs).
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <string>

#include "ringzero/algorithm.hpp"
#include "ringzero/base.hpp"
#include "ringzero/collective_table.hpp"
#include "ringzero/model/cost_model.hpp"
#include "ringzero/tuning/thresholds.hpp"
#include "ringzero/wire.hpp"

namespace ringzero::tuning {

/// Link figures of one kind of node. Bandwidths are one direction, in bytes per second; the
/// efficiency turns line rate into the rate a long transfer achieves (protocol headers, flow
/// control) and applies to both levels.
struct fabric {
  std::string name;
  int gpus_per_node = 8;
  double intra_bandwidth = 0;  ///< one GPU to the others of its node (NVLink, NVSwitch)
  double intra_latency = 0;    ///< seconds per message inside the node
  int nics_per_node = 1;
  double nic_bandwidth = 0;     ///< one NIC
  double inter_latency = 0;     ///< seconds per message between nodes
  double efficiency = 1;        ///< achieved / line rate, in (0, 1]
  double reduce_bandwidth = 0;  ///< bytes per second one GPU reduces (gamma = 1 / this)
  std::size_t chunk_bytes = std::size_t{1} << 20;  ///< pipeline chunk of ring and tree
};

/// Constants for messages inside one node.
[[nodiscard]] inline tuning::policy intra_node(const fabric& f) {
  tuning::policy p;
  p.alpha = f.intra_latency;
  p.beta = 1.0 / (f.intra_bandwidth * f.efficiency);
  p.gamma = 1.0 / f.reduce_bandwidth;
  p.chunk_bytes = f.chunk_bytes;
  return p;
}

/// Constants for one rank's messages to another node, on its share of the node's NICs.
[[nodiscard]] inline tuning::policy inter_node(const fabric& f) {
  tuning::policy p = intra_node(f);
  p.alpha = f.inter_latency;
  const double share = static_cast<double>(f.nics_per_node) / f.gpus_per_node;
  p.beta = 1.0 / (share * f.nic_bandwidth * f.efficiency);
  return p;
}

/// Predicted seconds for collective `c` with algorithm `a` over `nodes` full nodes; `bytes` as
/// in tuning::predict. Infinity where `a` does not implement `c` on that many nodes.
[[nodiscard]] inline double predict(const fabric& f, collective c, algorithm a, double bytes,
                                    int nodes) {
  if (!applies(c, a, nodes > 1)) return std::numeric_limits<double>::infinity();
  const int per = f.gpus_per_node;
  if (nodes <= 1) return predict(c, a, bytes, per, intra_node(f));
  const tuning::policy inter = inter_node(f);
  if (a != algorithm::hierarchical) return predict(c, a, bytes, nodes * per, inter);
  const tuning::policy intra = intra_node(f);
  if (c == collective::all_to_all)
    return predict_best(collective::gather, per * bytes, per, intra) +
           predict_best(collective::all_to_all, per * bytes, nodes, inter) +
           predict_best(collective::scatter, per * bytes, per, intra);
  return predict_best(collective::reduce_scatter, bytes, per, intra) +
         predict_best(collective::all_reduce, bytes / per, nodes, inter) +
         predict_best(collective::all_gather, bytes, per, intra);
}

/// The algorithm with the lowest two-level prediction; ties go to the earlier candidate.
[[nodiscard]] inline algorithm select(const fabric& f, collective c, double bytes, int nodes) {
  algorithm best = algorithm::ring;
  double best_t = std::numeric_limits<double>::infinity();
  for (algorithm a : candidates(c, nodes > 1)) {
    const double t = predict(f, c, a, bytes, nodes);
    if (t < best_t) {
      best_t = t;
      best = a;
    }
  }
  return best;
}

/// What algorithm::automatic picks today on a communicator over these nodes whose transport
/// reports the inter-node constants (as a libfabric endpoint on the NIC does): the one-level
/// select() of cost_model.hpp, which prices every level, hierarchical's too, with them.
[[nodiscard]] inline algorithm select_one_level(const fabric& f, collective c, double bytes,
                                                int nodes) {
  const tuning::policy p = nodes > 1 ? inter_node(f) : intra_node(f);
  return select(
      c, bytes, nodes * f.gpus_per_node, p,
      topology{.node = 0, .local_rank = 0, .local_size = f.gpus_per_node, .node_count = nodes});
}

/// A ring striped over every NIC of the node, as NCCL's channels run it (one ring per channel,
/// each entering and leaving every node once): the ring formula of cost_model.hpp with the
/// node's whole NIC bandwidth, or one GPU's intra-node bandwidth where that is lower, and the
/// mean latency of the hops around the ring. NCCL reduces inside the kernel that moves the
/// data, so no separate reduction pass is priced. ringzero's ring runs one channel; this is the
/// yardstick for comparing the model with nccl-tests, not an algorithm ringzero runs.
[[nodiscard]] inline double predict_striped_ring(const fabric& f, collective c, double bytes,
                                                 int nodes) {
  tuning::policy p = intra_node(f);
  p.gamma = 0;
  if (nodes > 1) {
    const double nics = f.nics_per_node * f.nic_bandwidth * f.efficiency;
    p.beta = std::max(p.beta, 1.0 / nics);
    p.alpha = (f.inter_latency + (f.gpus_per_node - 1) * f.intra_latency) / f.gpus_per_node;
  }
  return predict(c, algorithm::ring, bytes, nodes * f.gpus_per_node, p);
}

/// Bytes on the wire per byte of a call's elements (`element_bytes` each) in wire format f with
/// `block` elements per scale (reduce/quantize.hpp): 1 for full.
[[nodiscard]] inline double wire_ratio(wire_format f, std::size_t block, double element_bytes) {
  const double scale = 4.0 / static_cast<double>(block == 0 ? default_wire_block : block);
  switch (f) {
    case wire_format::full:
      return 1.0;
    case wire_format::bf16:
      return 2.0 / element_bytes;
    case wire_format::int8:
      return (1.0 + scale) / element_bytes;
    case wire_format::int4:
      return (0.5 + scale) / element_bytes;
  }
  return 1.0;
}

/// Predicted seconds of all_gather, reduce_scatter or all_reduce over `nodes` full nodes with
/// options::wire = f (detail/quantized_call.hpp), `bytes` the full buffer of `element_bytes`
/// elements as in predict(): the byte collectives on the encoded sizes, each at the two-level
/// model's cheapest, and a pass over the elements at the fabric's reduction rate for each
/// encode, decode and accumulate. all_gather: encode a block, all_gather, decode every block, in
/// pieces that overlap the passes with the transfer as quantized_gather does.
/// reduce_scatter: encode every block; with several nodes of several GPUs two hops (all_to_all
/// inside the node, accumulate, encode the node's partial sums, all_to_all across the nodes,
/// accumulate), else one all_to_all. all_reduce: the two, on 1/n each. full is predict()'s pick.
[[nodiscard]] inline double predict_wire(const fabric& f, collective c, wire_format w,
                                         std::size_t block, double element_bytes, double bytes,
                                         int nodes) {
  if (w == wire_format::full) return predict(f, c, select(f, c, bytes, nodes), bytes, nodes);
  const int per = f.gpus_per_node, n = nodes * per;
  const double r = wire_ratio(w, block, element_bytes), gamma = 1.0 / f.reduce_bandwidth;
  // In P pieces, a helper thread encoding piece k + 1 and decoding piece k - 1 while piece k is
  // on the wire: the first piece's encoding and the last one's decoding (1/P of the passes)
  // come before and after, the rest hides under the transfer or the transfer under it.
  const auto gather = [&](double full) {
    const double wire = full * r;
    const double passes = gamma * full / n + gamma * full;
    const auto pieces = static_cast<double>(
        thresholds::quantized_gather_pieces_of(static_cast<std::size_t>(full / element_bytes / n)));
    const double transfer = predict(f, collective::all_gather,
                                    select(f, collective::all_gather, wire, nodes), wire, nodes);
    return passes / pieces + std::max(transfer, passes * (pieces - 1) / pieces);
  };
  const auto reduce = [&](double full) {
    if (n == 1) return 2 * gamma * full;
    if (nodes > 1 && per > 1)
      return gamma * full + predict_best(collective::all_to_all, full * r, per, intra_node(f)) +
             gamma * full + gamma * full / per +
             predict_best(collective::all_to_all, full / per * r, nodes, inter_node(f)) +
             gamma * full / per;
    return gamma * full +
           predict_best(collective::all_to_all, full * r, n,
                        nodes > 1 ? inter_node(f) : intra_node(f)) +
           gamma * full;
  };
  if (c == collective::all_gather) return gather(bytes);
  if (c == collective::reduce_scatter) return reduce(bytes);
  return reduce(bytes) + gather(bytes);
}

/// nccl-tests' bus bandwidth (bytes per second) of `c` on `ranks` ranks moving `bytes` (the
/// call's full buffer) in `seconds`: the algorithm bandwidth times the collective's factor in
/// its descriptor (collective_table.hpp), the one ringzero-perf reports too. 0 for a collective
/// outside the built-in list.
[[nodiscard]] inline double bus_bandwidth(collective c, double bytes, int ranks, double seconds) {
  const collective_descriptor* d = builtin_collectives::find(c);
  if (seconds <= 0 || d == nullptr) return 0.0;
  return bytes / seconds * d->bus_bandwidth_factor(ranks);
}

}  // namespace ringzero::tuning
