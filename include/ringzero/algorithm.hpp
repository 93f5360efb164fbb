// The vocabulary of a collective call: which collective (collective_table.hpp describes each),
// which algorithm, and the per-call options. automatic asks the cost model
// (model/cost_model.hpp); RINGZERO_ALGO forces one for every collective it applies to, and
// options::algorithm forces one for a single call. Each algorithm's name and the collectives it
// implements live in its descriptor (algorithms/table.hpp lists them; algorithm_name() and
// parse_algorithm() are defined there).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ringzero/collective_table.hpp"
#include "ringzero/error.hpp"
#include "ringzero/wire.hpp"

// CUDA's stream type (cudaStream_t is CUstream_st*), named without including a CUDA header.
struct CUstream_st;

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

/// Per-call knobs. Zero means "the default": the communicator's timeout, the transport's chunk.
/// `timeout` bounds the call's progress: it fails once none of its messages has completed for
/// that long (detail/exchange.hpp), however long the whole call takes.
struct options {
  ringzero::algorithm algorithm = ringzero::algorithm::automatic;
  std::chrono::nanoseconds timeout{0};
  std::size_t chunk_bytes = 0;
  /// Stream-ordered backends (NCCL): the CUDA stream to enqueue on; null = the communicator's
  /// own. Declared through CUDA's own opaque type, so cudaStream_t converts without a cast and
  /// the core needs no CUDA header. Host transports run on the calling thread and ignore it.
  CUstream_st* stream = nullptr;
  /// Stream-ordered backends: return once enqueued instead of once complete (the caller orders
  /// later work on `stream` and synchronizes through the transport). Host transports complete
  /// every call before returning and refuse async = true.
  bool async = false;
  /// all_reduce, reduce_scatter and reduce of float, double, bfloat16 and float16 with sum or
  /// avg: the exact sum of the terms, rounded once (reduce/reproducible.hpp). The result is the
  /// same bits for any world size, algorithm, chunk size, transport, placement of the terms and
  /// arrival order, and is the representable value nearest the exact sum. Costs a second
  /// collective and eight bytes per element on the wire (docs/api.md). Ignored by collectives
  /// that add nothing and by integer types (exact already); refused with prod.
  bool reproducible = false;
  /// all_gather, reduce_scatter and all_reduce of float, bfloat16 and float16: what goes on the
  /// wire (wire.hpp). A quantized format sends about a quarter (int8) or an eighth (int4) of a
  /// float's bytes, and the result differs from the exact one by at most the bound
  /// reduce/quantize.hpp states; every rank still gets the same bits. Reductions take sum or avg
  /// and add in float. Host buffers over messaging transports (docs/api.md, "Quantized
  /// collectives").
  wire_format wire = wire_format::full;
  /// Elements per scale of the int8 and int4 formats; 0: default_wire_block (256).
  std::size_t wire_block = 0;
};

}  // namespace ringzero
