// Pipelined chain broadcast and reduce: the ranks in ring order starting at the root form a
// line, and the buffer moves along it in chunks, so every link is busy once the pipe is full.
// The bandwidth-optimal choice for large rooted messages.
//
//   broadcast: n - 2 + k chunk steps for k chunks; every rank but the last sends S once.
//   reduce:    the same steps towards the root; every rank but the last sends S and all but the
//              last reduce S. out is written only on the root.
//
// A chain is a tree in which each rank has one child, so both run on the tree pipeline.
// Each rank combines its own data with the partial from its successor, lower rank first.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <utility>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/blocks.hpp"
#include "ringzero/algorithms/detail/pipeline.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms::chain {

namespace detail {

/// Rank r's place in the chain root, root+1, ..., root-1 (mod n).
[[nodiscard]] inline algorithms::detail::tree_node chain_node(int n, int r, int root) {
  const int pos = mod(r - root, n);
  algorithms::detail::tree_node node;
  if (pos > 0) node.parent = mod(r - 1, n);
  if (pos < n - 1) {
    const int next = mod(r + 1, n);
    node.children = {next};
    node.self = next < r ? 1 : 0;
  }
  return node;
}

}  // namespace detail

/// Preconditions (checked by the collectives layer): size() >= 2, data.size() > 0, and the
/// root's data already holds what is broadcast.
template <collective_comm T, element E>
void broadcast(T& comm, std::span<E> data, int root, const options& opt) {
  namespace ad = algorithms::detail;
  ringzero::detail::exchange<T> ex(comm, "broadcast", "chain", opt.timeout);
  const std::size_t chunk = ad::chunk_elems<E>(data.size(), ad::chunk_bytes_of(comm, opt));
  ad::tree_pipeline<T, E> p(ex, detail::chain_node(comm.size(), comm.rank(), root),
                            ad::flow::broadcast, op::sum, comm.size(), data.data(), data.data(),
                            data.size(), chunk, {}, 0);
  ad::drive(p);
}

/// Preconditions (checked by the collectives layer): size() >= 2, in.size() > 0, and on the
/// root out.size() == in.size() (out may equal in there). out is not touched elsewhere.
template <collective_comm T, element E>
void reduce(T& comm, std::span<const E> in, std::span<E> out, op o, int root, const options& opt) {
  namespace ad = algorithms::detail;
  ringzero::detail::exchange<T> ex(comm, "reduce", "chain", opt.timeout);
  const std::size_t chunk =
      std::min(in.size(), ad::chunk_elems<E>(in.size(), ad::chunk_bytes_of(comm, opt)));
  auto node = detail::chain_node(comm.size(), comm.rank(), root);
  const std::span<E> scratch = ad::scratch_of<E>(
      comm, ad::tree_pipeline<T, E>::scratch_elems(node, ad::flow::reduce, chunk));
  ad::tree_pipeline<T, E> p(ex, std::move(node), ad::flow::reduce, o, comm.size(), in.data(),
                            comm.rank() == root ? out.data() : nullptr, in.size(), chunk, scratch,
                            0);
  ad::drive(p);
}

}  // namespace ringzero::algorithms::chain
