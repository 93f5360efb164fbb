// options::wire on host buffers: all_gather, reduce_scatter and all_reduce of float, bfloat16 and
// float16 with their data on the wire in a format of reduce/quantize.hpp, as ordinary collectives
// on bytes. Which of the three a call is comes from its descriptor's shape (call_shape), so any
// collective of one of those shapes runs here.
//
//   gather          encode this rank's block; all_gather the segments; decode every block, this
//                   rank's too (every rank holds the same bits).
//   reduce_blocks   qgZ's reduction. One hop: encode each rank's block, all_to_all, decode and
//                   add in float in rank order. Two hops, where the ranks span nodes of equal size
//                   (ZeRO++'s hierarchical all-to-all): encode; all_to_all inside the node, where
//                   local rank l receives every node peer's blocks for the ranks of local rank l on
//                   every node; decode and add them in local rank order; encode those partial sums;
//                   all_to_all across the nodes among the ranks of one local rank; decode and add
//                   in node order. Only the encoded partial sums leave a node: (N-1)/N of one block
//                   per rank against (n-L)/n of all of them in one hop. The sum is rounded to E
//                   once (avg divides it first).
//   reduce_whole    reduce_blocks over size() equal parts (zero padded), then the sums, in
//                   float, all_gathered as gather does.
//
// The inner collectives run through the dispatcher (detail/dispatch_fwd.hpp) with the call's
// timeout and chunk, the wire format full and the algorithm automatic (an all_gather takes
// options::algorithm where it implements all_gather); each is counted and traced as what it is.
// RINGZERO_CHECK compares the wire format and block too. The node level of two hops runs on the
// node's shared-memory communicator where it has one (communicator::nodes(), as the hierarchical
// algorithm).
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <future>
#include <span>
#include <type_traits>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/algorithms/hierarchical.hpp"
#include "ringzero/algorithms/table.hpp"
#include "ringzero/collective_table.hpp"
#include "ringzero/communicator.hpp"
#include "ringzero/detail/dispatch_fwd.hpp"
#include "ringzero/error.hpp"
#include "ringzero/kernels/element.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/quantize.hpp"
#include "ringzero/tuning/thresholds.hpp"
#include "ringzero/types.hpp"
#include "ringzero/wire.hpp"

namespace ringzero::detail {

/// The shape of a collective a wire format applies to, from its descriptor; false where none.
[[nodiscard]] constexpr bool wire_shape(const collective_descriptor& d,
                                        quantize::call_shape& shape) noexcept {
  if (d.rooted) return false;
  if (!d.reduces && d.in.size == extent::one && d.out.size == extent::blocks)
    shape = quantize::call_shape::gather;
  else if (d.reduces && d.in.size == extent::blocks && d.out.size == extent::one)
    shape = quantize::call_shape::reduce_blocks;
  else if (d.reduces && d.in.size == extent::one && d.out.size == extent::one)
    shape = quantize::call_shape::reduce_whole;
  else
    return false;
  return true;
}

/// Elements per scale of a call's options.
[[nodiscard]] inline std::size_t wire_block_of(const options& opt) noexcept {
  return opt.wire_block == 0 ? default_wire_block : opt.wire_block;
}

/// Whether a call goes to run_quantized: options::wire is not full. Throws invalid_argument,
/// before anything is sent, for what no wire format can do: an unknown format or a block out
/// of range, a collective of another shape, an element type other than float, bfloat16 and
/// float16, a reduction other than sum and avg, options::reproducible too.
template <element E>
[[nodiscard]] bool takes_quantized_path(const collective_descriptor& d, op o, const options& opt) {
  if (opt.wire == wire_format::full) return false;
  if (static_cast<int>(opt.wire) > static_cast<int>(wire_format::int4))
    throw invalid_argument(fmt::format("{}: options::wire holds {}, which names no wire format",
                                       d.name, static_cast<int>(opt.wire)));
  if (opt.wire_block > max_wire_block)
    throw invalid_argument(fmt::format("{}: options::wire_block {} (at most {})", d.name,
                                       opt.wire_block, max_wire_block));
  quantize::call_shape shape{};
  if (!wire_shape(d, shape))
    throw invalid_argument(fmt::format(
        "{}: options::wire applies to all_gather, reduce_scatter and all_reduce", d.name));
  if constexpr (!quantize::supported_v<std::remove_cv_t<E>>) {
    throw invalid_argument(
        fmt::format("{}: options::wire {} carries float, bfloat16 or float16, not {}", d.name,
                    wire_format_name(opt.wire), dtype_name(dtype_of<E>())));
  }
  if (d.reduces && o != op::sum && o != op::avg)
    throw invalid_argument(fmt::format("{}: options::wire {} reduces with sum or avg, not {}",
                                       d.name, wire_format_name(opt.wire), op_name(o)));
  if (opt.reproducible && d.reduces)
    throw invalid_argument(fmt::format(
        "{}: options::reproducible and options::wire {} exclude each other (an exact sum of "
        "quantized terms is not the exact sum of the terms)",
        d.name, wire_format_name(opt.wire)));
  return true;
}

/// Bytes and floats a thread keeps across its quantized calls, as the reproducible path does.
struct quantized_scratch {
  std::vector<std::uint8_t> send, recv, mid;
  std::vector<float> partial, sums;

  [[nodiscard]] static quantized_scratch& get() {
    thread_local quantized_scratch s;
    return s;
  }
};

template <class V>
[[nodiscard]] auto* sized(V& v, std::size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

/// The inner collectives' options: the call's deadline and chunk, automatic, full wire.
[[nodiscard]] inline options inner_options(const options& opt) {
  options o;
  o.timeout = opt.timeout;
  o.chunk_bytes = opt.chunk_bytes;
  return o;
}

/// One of the collectives on bytes a quantized call runs (all_gather, all_to_all), on `comm` or
/// one of its node levels: through the dispatcher, as the hierarchical algorithm's levels.
template <class C>
void bytes_call(C& comm, collective k, std::span<const std::uint8_t> in,
                std::span<std::uint8_t> out, const options& opt) {
  dispatch_builtin(comm, algorithms::call<std::uint8_t>{.kind = k, .in = in, .out = out}, opt);
}

/// Every rank's `in` (L.count elements), encoded as L, decoded into out's blocks: block r holds
/// up to L.count elements starting at r * stride, cut at `total` (all_reduce's padding dropped).
/// A large block goes in pieces, each starting on a scale block (so every value is the one the
/// whole segment gives): while the calling thread all_gathers piece k and drives the transport,
/// a helper thread encodes piece k + 1 and decodes piece k - 1, so the passes over the elements
/// take their CPU time under the transfer's instead of after it.
template <class C, class S, class E>
void quantized_gather(C& comm, const quantize::segment_layout& L, const S* in, E* out,
                      std::size_t stride, std::size_t total, const options& opt) {
  auto& s = quantized_scratch::get();
  const auto n = static_cast<std::size_t>(comm.size());
  const std::size_t pieces = tuning::thresholds::quantized_gather_pieces_of(L.count);
  const std::size_t per =  // whole scale blocks
      ((L.count + pieces - 1) / pieces + L.block - 1) / L.block * L.block;
  struct piece {
    quantize::segment_layout layout;
    std::size_t first, at;  // first element; offset of its bytes in the send buffer
  };
  std::vector<piece> parts;
  std::size_t bytes = 0;
  for (std::size_t first = 0; first < L.count || parts.empty(); first += per) {
    const quantize::segment_layout p{L.format, L.block, std::min(per, L.count - first)};
    parts.push_back({p, first, bytes});
    bytes += p.bytes();
  }
  std::uint8_t* mine = sized(s.send, bytes);
  std::uint8_t* all = sized(s.recv, n * bytes);
  options inner = inner_options(opt);
  if (algorithms::builtin::implements(collective::all_gather, opt.algorithm))
    inner.algorithm = opt.algorithm;
  const auto encode = [&](const piece& p) {
    quantize::encode(p.layout, in + p.first, mine + p.at);
  };
  // Piece k of every rank lies at n * at (rank r's at n * at + r * its bytes).
  const auto decode = [&](const piece& p) {
    for (std::size_t r = 0; r < n; ++r) {
      const std::size_t from = r * stride + p.first;
      if (from >= total) continue;
      quantize::decode(p.layout, all + n * p.at + r * p.layout.bytes(), out + from,
                       std::min(p.layout.count, total - from));
    }
  };
  encode(parts.front());
  for (std::size_t k = 0; k < parts.size(); ++k) {
    const piece& p = parts[k];
    std::future<void> helper;  // joined before this iteration ends, however it ends
    if (parts.size() > 1)
      helper = std::async(std::launch::async, [&, k] {
        if (k + 1 < parts.size()) encode(parts[k + 1]);
        if (k > 0) decode(parts[k - 1]);
      });
    bytes_call(comm, collective::all_gather,
               std::span<const std::uint8_t>(mine + p.at, p.layout.bytes()),
               std::span<std::uint8_t>(all + n * p.at, n * p.layout.bytes()), inner);
    if (helper.valid()) helper.get();
  }
  decode(parts.back());
}

/// The float sum over every rank of block rank() of `in` (size() blocks of `count`), each term
/// through the wire format (two hops over the hierarchy where it is uniform), into `sums`.
template <class C, class E>
void quantized_sums(C& comm, const E* in, std::size_t count, float* sums, const options& opt) {
  auto& s = quantized_scratch::get();
  const quantize::segment_layout L{opt.wire, wire_block_of(opt), count};
  const std::size_t seg = L.bytes();
  const auto n = static_cast<std::size_t>(comm.size());
  const options inner = inner_options(opt);
  bool two_hops = false;
  if constexpr (has_hosts<typename C::transport_type>) {
    const topology t = comm.topo();
    two_hops = t.node_count > 1 && t.node_count < comm.size() && comm.nodes().uniform;
  }
  if (!two_hops) {
    std::uint8_t* send = sized(s.send, n * seg);
    std::uint8_t* recv = sized(s.recv, n * seg);
    for (std::size_t r = 0; r < n; ++r) quantize::encode(L, in + r * count, send + r * seg);
    bytes_call(comm, collective::all_to_all, std::span<const std::uint8_t>(send, n * seg),
               std::span<std::uint8_t>(recv, n * seg), inner);
    for (std::size_t r = 0; r < n; ++r) quantize::accumulate(L, recv + r * seg, sums, r == 0);
    return;
  }
  if constexpr (has_hosts<typename C::transport_type>) {
    auto& h = comm.nodes();
    const auto local = static_cast<std::size_t>(h.local.size());
    const std::size_t nodes = n / local;
    std::uint8_t* send = sized(s.send, n * seg);
    std::uint8_t* recv = sized(s.recv, n * seg);
    // For local rank d: the blocks of the ranks of local rank d, node by node.
    for (std::size_t d = 0; d < local; ++d)
      for (std::size_t c = 0; c < nodes; ++c) {
        const auto g = static_cast<std::size_t>(h.parent_rank[c * local + d]);
        quantize::encode(L, in + g * count, send + (d * nodes + c) * seg);
      }
    algorithms::detail::on_node(comm, h, [&](auto& node) {
      bytes_call(node, collective::all_to_all, std::span<const std::uint8_t>(send, n * seg),
                 std::span<std::uint8_t>(recv, n * seg), inner);
    });
    float* partial = sized(s.partial, nodes * count);
    for (std::size_t src = 0; src < local; ++src)
      for (std::size_t c = 0; c < nodes; ++c)
        quantize::accumulate(L, recv + (src * nodes + c) * seg, partial + c * count, src == 0);
    std::uint8_t* across = sized(s.mid, 2 * nodes * seg);
    for (std::size_t c = 0; c < nodes; ++c)
      quantize::encode(L, partial + c * count, across + c * seg);
    bytes_call(h.cross, collective::all_to_all, std::span<const std::uint8_t>(across, nodes * seg),
               std::span<std::uint8_t>(across + nodes * seg, nodes * seg), inner);
    for (std::size_t c = 0; c < nodes; ++c)
      quantize::accumulate(L, across + (nodes + c) * seg, sums, c == 0);
  }
}

/// Divides float sums by the world size (op::avg), rounded once each.
inline void average(float* sums, std::size_t count, int n) noexcept {
  const auto d = static_cast<float>(n);
  for (std::size_t i = 0; i < count; ++i) sums[i] = kernels::div(sums[i], d);
}

/// Runs a validated call whose takes_quantized_path() said yes, on host buffers of a messaging
/// transport. `sum_op`: the call's op (sum or avg).
template <class C, element E>
void run_quantized(C& comm, const collective_descriptor& d, std::span<const E> in, std::span<E> out,
                   op reduction, const options& opt) {
  quantize::call_shape shape{};
  (void)wire_shape(d, shape);
  const auto n = static_cast<std::size_t>(comm.size());
  const std::size_t block = wire_block_of(opt);
  auto& s = quantized_scratch::get();
  switch (shape) {
    case quantize::call_shape::gather: {
      const quantize::segment_layout L{opt.wire, block, in.size()};
      quantized_gather(comm, L, in.data(), out.data(), in.size(), out.size(), opt);
      return;
    }
    case quantize::call_shape::reduce_blocks: {
      const std::size_t count = out.size();
      // Every input block is read (encoded) before `out`, which may be one of them, is written.
      float* sums = sized(s.sums, count);
      quantized_sums(comm, in.data(), count, sums, opt);
      if (reduction == op::avg) average(sums, count, comm.size());
      for (std::size_t i = 0; i < count; ++i) out[i] = kernels::from_float<E>(sums[i]);
      return;
    }
    case quantize::call_shape::reduce_whole: {
      const std::size_t count = in.size();
      const std::size_t part = (count + n - 1) / n;
      const E* src = in.data();
      std::vector<E> padded;
      if (part * n != count) {
        padded.assign(part * n, E{});
        std::copy(in.begin(), in.end(), padded.begin());
        src = padded.data();
      }
      float* sums = sized(s.sums, part);
      quantized_sums(comm, src, part, sums, opt);
      if (reduction == op::avg) average(sums, part, comm.size());
      const quantize::segment_layout L{opt.wire, block, part};
      quantized_gather(comm, L, static_cast<const float*>(sums), out.data(), part, count, opt);
      return;
    }
  }
}

}  // namespace ringzero::detail
