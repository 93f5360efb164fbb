// Binomial-tree schedules (schedule/executor.hpp): the trees of algorithms/binomial.hpp, with
// its combine order, so a reduce on GPU buffers gives the bits ringzero's host tree reduce
// gives. Each step moves one whole message.
//
//   reduce:     ceil(log2 n) levels; a rank receives from each child in turn (smallest subtree
//               first), reducing as it goes, then sends its partial to its parent.
//   broadcast:  ceil(log2 n) levels; a rank receives from its parent, then sends to all its
//               children in one step.
//   all_reduce: reduce to rank 0, then broadcast from it: 2 ceil(log2 n) levels of the whole
//               buffer. Not the double binary tree the host's `tree` all_reduce runs: on GPU
//               buffers it is the simple latency-bound choice for small messages.
//
// A rank combines its own data first, then its children's partials in increasing relative rank:
// a fixed order for a given world size and root, whatever the timing. avg is finished on the
// root, and the result goes down the tree as it is, so every rank ends with the same bits.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "ringzero/algorithms/binomial.hpp"
#include "ringzero/algorithms/blocks.hpp"
#include "ringzero/algorithms/schedule/executor.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms::schedule::tree {

namespace detail {

using schedule::detail::step;

/// Message ids: the edge from `parent` down to `child` is level k (the child's relative rank
/// exceeds the parent's by 2^k); partials going up use k, data coming down down_ids + k.
inline constexpr std::uint32_t down_ids = 32;

[[nodiscard]] inline std::uint32_t edge(int n, int root, int parent, int child) noexcept {
  const int gap = mod(child - root, n) - mod(parent - root, n);
  return static_cast<std::uint32_t>(std::countr_zero(static_cast<unsigned>(gap)));
}

/// Reduces every rank's `in` up the tree rooted at `root`. Partials are made in `into` (which may
/// be in); on the root `into` ends with the complete result, avg finished. `slot` receives one
/// child's partial at a time.
template <element E, executor<E> X>
void reduce_up(X& x, const E* in, E* into, std::size_t count, op o, int root, E* slot) {
  const int n = x.size();
  const int r = x.rank();
  const auto node = binomial::detail::binomial_node(n, r, root, false);
  const E* have = in;
  for (int child : node.children) {
    step<E>(x, {}, {{child, edge(n, root, r, child), slot, count}});
    x.combine(o, have, slot, into, count);
    have = into;
  }
  if (node.parent >= 0) {
    step<E>(x, {{node.parent, edge(n, root, node.parent, r), have, count}}, {});
    return;
  }
  if (have != into) x.copy(into, have, count);
  if (o == op::avg) x.finish_avg(into, count, n);
}

/// Sends the root's `from` down the tree into every other rank's `out`; the root's children get
/// the biggest subtree first, so the deepest branch starts earliest.
template <element E, executor<E> X>
void broadcast_down(X& x, const E* from, E* out, std::size_t count, int root) {
  const int n = x.size();
  const int r = x.rank();
  const auto node = binomial::detail::binomial_node(n, r, root, true);
  const E* have = from;
  if (node.parent >= 0) {
    step<E>(x, {}, {{node.parent, down_ids + edge(n, root, node.parent, r), out, count}});
    have = out;
  }
  std::vector<transfer<const E>> sends;
  for (int child : node.children)
    sends.push_back({child, down_ids + edge(n, root, r, child), have, count});
  step<E>(x, std::move(sends), {});
}

}  // namespace detail

/// Scratch elements reduce needs: a receive slot, and a partial on ranks that are neither root
/// nor leaf.
[[nodiscard]] inline std::size_t reduce_scratch(std::size_t count, int n) {
  return n > 1 ? 2 * count : 0;
}
/// Scratch elements all_reduce needs: a receive slot (partials are made in the output).
[[nodiscard]] inline std::size_t all_reduce_scratch(std::size_t count, int n) {
  return n > 1 ? count : 0;
}

/// out on `root` receives in reduced over all ranks (out may equal in there); out is not
/// touched on other ranks. Needs size() >= 2.
template <element E, executor<E> X>
void reduce(X& x, const E* in, E* out, std::size_t count, op o, int root, std::span<E> scratch) {
  E* into = x.rank() == root ? out : scratch.data() + count;
  detail::reduce_up<E>(x, in, into, count, o, root, scratch.data());
}

/// Every rank's out receives root's in (which may be root's out). Needs size() >= 2.
template <element E, executor<E> X>
void broadcast(X& x, const E* in, E* out, std::size_t count, int root) {
  if (x.rank() == root && in != out) x.copy(out, in, count);
  detail::broadcast_down<E>(x, in, out, count, root);
}

/// out = in reduced over all ranks (in may equal out): reduce to rank 0, broadcast from it.
/// Needs size() >= 2.
template <element E, executor<E> X>
void all_reduce(X& x, const E* in, E* out, std::size_t count, op o, std::span<E> scratch) {
  detail::reduce_up<E>(x, in, out, count, o, 0, scratch.data());
  detail::broadcast_down<E>(x, out, out, count, 0);
}

}  // namespace ringzero::algorithms::schedule::tree
