// The arithmetic behind ringzero-model's ZeRO and architecture tables: bytes each GPU sends per
// training step and the time the fabric model gives them, for a model of psi parameters with
// 16-bit parameters and gradients and AdamW state in fp32 (K = 12 bytes per parameter), as
// docs/zero.md defines the stages.
#pragma once

#include <algorithm>
#include <cmath>
#include <string_view>

#include "ringzero/model/fabric.hpp"
#include "ringzero/wire.hpp"

namespace ringzero::model {

inline constexpr double grad_bytes_per_param = 2;        // bf16 parameters and gradients
inline constexpr double optimizer_bytes_per_param = 12;  // fp32 master + two fp32 moments

enum class sharding { stage0, stage1, stage2, stage3, hybrid };

[[nodiscard]] constexpr std::string_view sharding_name(sharding s) noexcept {
  switch (s) {
    case sharding::stage0:
      return "0 (replicated)";
    case sharding::stage1:
      return "1";
    case sharding::stage2:
      return "2";
    case sharding::stage3:
      return "3";
    case sharding::hybrid:
      return "3 in node, replicated across";
  }
  return "?";
}

/// Model state per GPU in bytes (docs/zero.md, "Memory"): 2Ψ parameters, 2Ψ gradients and 12Ψ
/// optimizer state, each divided by the ranks that shard it. Hybrid sharding shards as stage 3
/// inside a node of g GPUs and replicates across nodes.
[[nodiscard]] inline double memory_per_gpu(sharding s, double psi, int n, int g) {
  const double p = grad_bytes_per_param * psi, k = optimizer_bytes_per_param * psi;
  switch (s) {
    case sharding::stage0:
      return p + p + k;
    case sharding::stage1:
      return p + p + k / n;
    case sharding::stage2:
      return p + (p + k) / n;
    case sharding::stage3:
      return (p + p + k) / n;
    case sharding::hybrid:
      return (p + p + k) / g;
  }
  return 0;
}

/// Per step: bytes a GPU sends inside its node and to other nodes (mean over the GPUs), and
/// the predicted time.
struct step_cost {
  double intra_bytes = 0;
  double inter_bytes = 0;
  double seconds = 0;
};

/// Which collectives price a step: ringzero's own algorithms (the two-level pick), or rings
/// striped over every NIC as NCCL runs them (what a ringzero communicator on the NCCL
/// transport gets, since it hands collectives to NCCL).
enum class pricing { ringzero, striped };

namespace detail {

/// The predicted time of `c` on `bytes` over `nodes` nodes under `how`.
[[nodiscard]] inline double best(const tuning::fabric& f, collective c, double bytes, int nodes,
                                 pricing how = pricing::ringzero) {
  if (how == pricing::striped) return tuning::predict_striped_ring(f, c, bytes, nodes);
  return tuning::predict(f, c, tuning::select(f, c, bytes, nodes), bytes, nodes);
}

}  // namespace detail

/// One step's gradient and parameter traffic (no overlap with compute): stage 0 all_reduces
/// the gradients; stages 1 and 2 reduce_scatter them and all_gather the updated parameters;
/// stage 3 also all_gathers the parameters for the forward and again for the backward pass;
/// hybrid does stage 3's collectives inside the node and all_reduces each GPU's 1/g shard of
/// the gradients across nodes.
[[nodiscard]] inline step_cost zero_step(const tuning::fabric& f, sharding s, double psi, int nodes,
                                         pricing how = pricing::ringzero) {
  const int g = f.gpus_per_node, n = nodes * g;
  const double bytes = grad_bytes_per_param * psi;
  const double frac = static_cast<double>(n - 1) / n;
  // One hop in g of a ring leaves the node; hierarchical sends the same 1/g across.
  const double leaves = nodes > 1 ? 1.0 / g : 0.0;
  auto split = [&](double sent) { return step_cost{sent * (1 - leaves), sent * leaves, 0.0}; };
  step_cost out;
  switch (s) {
    case sharding::stage0:
      out = split(2 * frac * bytes);
      out.seconds = detail::best(f, collective::all_reduce, bytes, nodes, how);
      break;
    case sharding::stage1:
    case sharding::stage2:
      out = split(2 * frac * bytes);
      out.seconds = detail::best(f, collective::reduce_scatter, bytes, nodes, how) +
                    detail::best(f, collective::all_gather, bytes, nodes, how);
      break;
    case sharding::stage3:
      out = split(3 * frac * bytes);
      out.seconds = detail::best(f, collective::reduce_scatter, bytes, nodes, how) +
                    2 * detail::best(f, collective::all_gather, bytes, nodes, how);
      break;
    case sharding::hybrid: {
      const double local = static_cast<double>(g - 1) / g;
      const double across = static_cast<double>(nodes - 1) / nodes;
      out.intra_bytes = 3 * local * bytes;
      out.inter_bytes = 2 * across * bytes / g;
      out.seconds = detail::best(f, collective::reduce_scatter, bytes, 1, how) +
                    2 * detail::best(f, collective::all_gather, bytes, 1, how);
      if (nodes > 1)
        out.seconds +=
            tuning::predict_best(collective::all_reduce, bytes / g, nodes, tuning::inter_node(f));
      break;
    }
  }
  return out;
}

/// ZeRO++'s options on stage 3 (zero/zeropp.hpp), as ringzero's sharder runs them.
struct zeropp {
  bool weights = false;    ///< qwZ: parameter all_gathers as int8 blocks
  bool hpz = false;        ///< hpZ: the backward all_gather inside the node
  bool gradients = false;  ///< qgZ: the gradients' reduce_scatter as int4 blocks, two hops
};

/// Stage 3's step with ZeRO++'s options: the forward all_gather (int8 with qwZ), the backward
/// one (from the node's secondary shard with hpZ, else as the forward's), the gradients'
/// reduce_scatter (int4 through two hops with qgZ); parameters and gradients in bf16, 256
/// elements per scale. Bytes sent per GPU: a ring's hops leave the node one in g as
/// zero_step counts them; two hops send (g-1)/g of the encoded gradients inside the node and
/// (N-1)/N of a node's 1/g across.
[[nodiscard]] inline step_cost zeropp_step(const tuning::fabric& f, double psi, int nodes,
                                           zeropp o) {
  const int g = f.gpus_per_node, n = nodes * g;
  const double bytes = grad_bytes_per_param * psi;
  const double frac = static_cast<double>(n - 1) / n;
  const double leaves = nodes > 1 ? 1.0 / g : 0.0;
  const double qw = tuning::wire_ratio(wire_format::int8, 0, grad_bytes_per_param);
  const double qg = tuning::wire_ratio(wire_format::int4, 0, grad_bytes_per_param);
  step_cost out;
  const auto ring = [&](double sent) {
    out.intra_bytes += sent * (1 - leaves);
    out.inter_bytes += sent * leaves;
  };
  const auto gather = [&] {
    return o.weights ? tuning::predict_wire(f, collective::all_gather, wire_format::int8, 0,
                                            grad_bytes_per_param, bytes, nodes)
                     : detail::best(f, collective::all_gather, bytes, nodes);
  };
  ring(frac * bytes * (o.weights ? qw : 1.0));
  out.seconds += gather();
  if (o.hpz) {
    out.intra_bytes += static_cast<double>(g - 1) / g * bytes;
    out.seconds += detail::best(f, collective::all_gather, bytes, 1);
  } else {
    ring(frac * bytes * (o.weights ? qw : 1.0));
    out.seconds += gather();
  }
  if (o.gradients && nodes > 1 && g > 1) {
    out.intra_bytes += static_cast<double>(g - 1) / g * bytes * qg;
    out.inter_bytes += static_cast<double>(nodes - 1) / nodes * bytes / g * qg;
  } else {
    ring(frac * bytes * (o.gradients ? qg : 1.0));
  }
  out.seconds += o.gradients
                     ? tuning::predict_wire(f, collective::reduce_scatter, wire_format::int4, 0,
                                            grad_bytes_per_param, bytes, nodes)
                     : detail::best(f, collective::reduce_scatter, bytes, nodes);
  return out;
}

/// A data-parallel gradient exchange as another architecture does it, per step.
struct exchange_cost {
  double link_bytes = 0;  ///< bytes the busiest link carries in one direction
  double seconds = 0;
};

/// The node's NICs together, achieved rate.
[[nodiscard]] inline double node_nic_bandwidth(const tuning::fabric& f) {
  return f.nics_per_node * f.nic_bandwidth * f.efficiency;
}

/// Summing a gradient inside the node first and spreading the result afterwards (best
/// reduce_scatter and all_gather over NVLink): what lets a node talk to servers as one worker.
[[nodiscard]] inline double in_node(const tuning::fabric& f, double bytes) {
  return detail::best(f, collective::reduce_scatter, bytes, 1) +
         detail::best(f, collective::all_gather, bytes, 1);
}

/// One parameter server node: every node sums its gradient inside, pushes it and pulls the
/// parameters back, so the server's NICs carry nodes × the gradient each way.
[[nodiscard]] inline exchange_cost central_server(const tuning::fabric& f, double psi, int nodes) {
  const double bytes = grad_bytes_per_param * psi;
  const double link = nodes * bytes;
  return {link, in_node(f, bytes) + f.inter_latency + link / node_nic_bandwidth(f)};
}

/// Parameter servers sharded over every node (BytePS-style, one shard per node): each node sums
/// its gradient inside, then pushes and pulls (nodes-1)/nodes of the gradient and serves as much
/// for its own shard, the same 2(N-1)/N of the gradient per direction a node-level ring moves.
[[nodiscard]] inline exchange_cost sharded_servers(const tuning::fabric& f, double psi, int nodes) {
  const double bytes = grad_bytes_per_param * psi;
  const double link = 2.0 * (nodes - 1) / nodes * bytes;
  return {link, in_node(f, bytes) + 2 * f.inter_latency + link / node_nic_bandwidth(f)};
}

/// Horovod-style: gradients fused into `fusion` -byte buffers, each all_reduced by one flat ring
/// over every GPU (one channel, so one GPU's share of the NICs), buffers one after another.
[[nodiscard]] inline exchange_cost fused_ring(const tuning::fabric& f, double psi, int nodes,
                                              double fusion) {
  const double bytes = grad_bytes_per_param * psi;
  const int n = nodes * f.gpus_per_node;
  const double buffers = std::ceil(bytes / fusion);
  const double each = bytes / buffers;
  const tuning::policy p = nodes > 1 ? tuning::inter_node(f) : tuning::intra_node(f);
  return {2.0 * (n - 1) / n * bytes,
          buffers * tuning::predict(collective::all_reduce, algorithm::ring, each, n, p)};
}

}  // namespace ringzero::model
