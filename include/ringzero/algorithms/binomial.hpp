// Binomial-tree broadcast and reduce (as in MPICH): with ranks renumbered relative to the root,
// rank v's parent is v minus its lowest set bit, so the tree is ceil(log2 n) levels deep and
// the root talks to ceil(log2 n) children. The latency-optimal choice for small rooted
// messages.
//
//   broadcast: ceil(log2 n) steps of S; the root sends ceil(log2 n) * S.
//   reduce:    the same towards the root, reducing S per child received.
//
// Chunks are forwarded as they arrive (the tree pipeline), so a large message is not held up
// a whole message per level. Reduce combines a rank's own data first, then its children's
// partials in increasing relative rank: a fixed order for a given root.
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

namespace ringzero::algorithms::binomial {

namespace detail {

/// Rank r's node in the binomial tree rooted at `root`. Children are listed from the
/// smallest subtree up (the combine order of reduce); broadcast sends the biggest first.
[[nodiscard]] inline algorithms::detail::tree_node binomial_node(int n, int r, int root,
                                                                 bool biggest_first) {
  const int v = mod(r - root, n);
  const int low = v ? v & -v : n;  // the root's subtree spans everything
  algorithms::detail::tree_node node;
  if (v) node.parent = mod(v - low + root, n);
  for (int m = 1; m < low && v + m < n; m *= 2) node.children.push_back(mod(v + m + root, n));
  if (biggest_first) std::reverse(node.children.begin(), node.children.end());
  node.self = 0;
  return node;
}

}  // namespace detail

/// Preconditions (checked by the collectives layer): size() >= 2, data.size() > 0, and the
/// root's data already holds what is broadcast.
template <collective_comm T, element E>
void broadcast(T& comm, std::span<E> data, int root, const options& opt) {
  namespace ad = algorithms::detail;
  ringzero::detail::exchange<T> ex(comm, "broadcast", "binomial", opt.timeout);
  const std::size_t chunk = ad::chunk_elems<E>(data.size(), ad::chunk_bytes_of(comm, opt));
  ad::tree_pipeline<T, E> p(ex, detail::binomial_node(comm.size(), comm.rank(), root, true),
                            ad::flow::broadcast, op::sum, comm.size(), data.data(), data.data(),
                            data.size(), chunk, {}, 0);
  ad::drive(p);
}

/// Preconditions (checked by the collectives layer): size() >= 2, in.size() > 0, and on the
/// root out.size() == in.size() (out may equal in there). out is not touched elsewhere.
template <collective_comm T, element E>
void reduce(T& comm, std::span<const E> in, std::span<E> out, op o, int root, const options& opt) {
  namespace ad = algorithms::detail;
  ringzero::detail::exchange<T> ex(comm, "reduce", "binomial", opt.timeout);
  const std::size_t chunk =
      std::min(in.size(), ad::chunk_elems<E>(in.size(), ad::chunk_bytes_of(comm, opt)));
  auto node = detail::binomial_node(comm.size(), comm.rank(), root, false);
  const std::span<E> scratch = ad::scratch_of<E>(
      comm, ad::tree_pipeline<T, E>::scratch_elems(node, ad::flow::reduce, chunk));
  ad::tree_pipeline<T, E> p(ex, std::move(node), ad::flow::reduce, o, comm.size(), in.data(),
                            comm.rank() == root ? out.data() : nullptr, in.size(), chunk, scratch,
                            0);
  ad::drive(p);
}

}  // namespace ringzero::algorithms::binomial
