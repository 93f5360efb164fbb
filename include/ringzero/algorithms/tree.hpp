// Double binary tree all_reduce (Sanders, Speck & Träff, 2009; the scheme NCCL calls Tree).
//
// Two binary trees span the ranks, each carrying half of the buffer: chunks are reduced up
// each tree and broadcast back down it, pipelined, and the two trees run at the same time.
// In a binary tree about half the ranks are leaves, which only send; the second tree is built
// so that no rank is a leaf in both, so every rank forwards (about) the same number of bytes.
//
//   latency: 2 * depth + chunks - 1 chunk steps, depth = floor(log2 n) + 1 (+1 in the second
//            tree when n is odd);
//   bytes:   an interior node receives 1.5 S and sends 1.5 S in its tree, a leaf sends and
//            receives S/2 in the other: about 2 S each way per rank (the ring: 2(n-1)/n S),
//            and each rank reduces about S/2.
//
// Partials are combined lower-ranked first (left subtree, own data, right subtree, in rank
// order) and each half is finished on its root and copied down, so every rank ends with the
// same bits.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/binomial.hpp"
#include "ringzero/algorithms/binomial_gather.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/algorithms/detail/pipeline.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms::tree {

namespace detail {

/// The in-order binary tree over positions 1..m: position x with lowest set bit b sits b levels
/// up, its children are x -+ b/2, and the root is the largest power of two <= m. (It is the
/// complete tree over 1..2^k-1 with the positions above m cut away; a cut node's left subtree
/// moves up into its place.) Every even position has a child, so the leaves are exactly the
/// odd positions.
struct inorder_tree {
  int m = 1;

  [[nodiscard]] static int lowbit(int x) noexcept { return x & -x; }
  [[nodiscard]] int root() const noexcept {
    int p = 1;
    while (2 * p <= m) p *= 2;
    return p;
  }
  /// The parent in the complete tree.
  [[nodiscard]] static int up(int x) noexcept {
    const int b = lowbit(x);
    return (x & (2 * b)) ? x - b : x + b;
  }
  /// 0 for the root.
  [[nodiscard]] int parent(int x) const noexcept {
    if (x == root()) return 0;
    int p = up(x);
    while (p > m) p = up(p);
    return p;
  }
  /// Up to two children, 0 where there is none.
  [[nodiscard]] std::pair<int, int> children(int x) const noexcept {
    const int b = lowbit(x);
    if (b == 1) return {0, 0};
    int right = x + b / 2;
    while (right > m && lowbit(right) > 1) right -= lowbit(right) / 2;
    return {x - b / 2, right > m ? 0 : right};
  }
};

/// Node `r` of tree `which` (0 or 1) over n ranks.
///
/// Tree 0 puts rank r at position r+1: its leaves are the even ranks. Tree 1 needs the even
/// ranks inside: for even n it mirrors tree 0 (position n-r, leaves are the odd ranks); for odd
/// n, where a mirror maps even to even, rank 0 becomes a root with one child, the in-order tree
/// over ranks 1..n-1 at positions 1..n-1 (leaves: the odd ranks).
[[nodiscard]] inline algorithms::detail::tree_node double_tree_node(int n, int r, int which) {
  // Each variant is the in-order tree under position = sign * rank + shift.
  int m = n, sign = 1, shift = 1;
  if (which == 1 && n % 2 == 0) {
    sign = -1;
    shift = n;
  } else if (which == 1) {
    m = n - 1;
    shift = 0;
  }
  auto pos_of = [&](int rank) { return sign * rank + shift; };
  auto rank_of = [&](int pos) { return sign * (pos - shift); };
  std::vector<int> kids;
  algorithms::detail::tree_node node;
  const inorder_tree t{m};
  if (which == 1 && n % 2 == 1 && r == 0) {
    kids.push_back(rank_of(t.root()));
  } else {
    const int p = t.parent(pos_of(r));
    node.parent = p ? rank_of(p) : (which == 1 && n % 2 == 1 ? 0 : -1);
    const auto [a, b] = t.children(pos_of(r));
    for (int c : {a, b})
      if (c) kids.push_back(rank_of(c));
  }
  std::sort(kids.begin(), kids.end());
  node.self = static_cast<std::size_t>(
      std::count_if(kids.begin(), kids.end(), [&](int k) { return k < r; }));
  node.children = std::move(kids);
  return node;
}

}  // namespace detail

/// Preconditions (checked by the collectives layer): size() >= 2, in.size() == out.size() > 0;
/// in may equal out.
template <collective_comm T, element E>
void all_reduce(T& comm, std::span<const E> in, std::span<E> out, op o, const options& opt) {
  namespace ad = algorithms::detail;
  ringzero::detail::exchange<T> ex(comm, "all_reduce", "tree", opt.timeout);
  const int n = comm.size();
  const int r = comm.rank();
  const std::size_t count = out.size();
  const std::size_t half[2] = {(count + 1) / 2, count / 2};
  // Both halves are cut alike, so the second never has more chunks (tag ids) than the first.
  const std::size_t chunk =
      std::min(half[0], ad::chunk_elems<E>(half[0], ad::chunk_bytes_of(comm, opt)));

  ad::tree_node nodes[2] = {detail::double_tree_node(n, r, 0), detail::double_tree_node(n, r, 1)};
  const std::size_t need0 =
      ad::tree_pipeline<T, E>::scratch_elems(nodes[0], ad::flow::all_reduce, chunk);
  const std::size_t need1 =
      ad::tree_pipeline<T, E>::scratch_elems(nodes[1], ad::flow::all_reduce, chunk);
  const std::span<E> scratch = ad::scratch_of<E>(comm, need0 + need1);
  ad::tree_pipeline<T, E> first(ex, std::move(nodes[0]), ad::flow::all_reduce, o, n, in.data(),
                                out.data(), half[0], chunk, scratch.first(need0), 0);
  ad::tree_pipeline<T, E> second(ex, std::move(nodes[1]), ad::flow::all_reduce, o, n,
                                 in.data() + half[0], out.data() + half[0], half[1], chunk,
                                 scratch.subspan(need0), 2);
  ad::drive(first, second);
}

/// Double binary tree all_reduce; binomial trees for the rooted collectives
/// (algorithms/binomial.hpp, algorithms/binomial_gather.hpp).
struct descriptor {
  static constexpr algorithm id = algorithm::tree;
  static constexpr std::string_view name = "tree";
  static constexpr collective_set implements{collective::all_reduce, collective::broadcast,
                                             collective::reduce, collective::gather,
                                             collective::scatter};
  static constexpr bool needs_nodes = false;

  template <class Table>
  [[nodiscard]] static double cost(const tuning::cost_query& q) {
    const double al = q.p.alpha, be = q.p.beta, ga = q.p.gamma, s = q.bytes;
    const double depth = tuning::ceil_log2(q.ranks);
    if (q.c == collective::all_reduce) {
      // Two trees, each carrying half; a pipeline of chunks up and down log2(n) levels.
      const double k = q.chunks();
      return 2 * (depth + k - 1) * (al + s / k * be) + s * ga;
    }
    if (q.c == collective::gather || q.c == collective::scatter)
      // Binomial: each level forwards whole subtrees, so the root's link still carries
      // (n-1)/n of its buffer, in ceil(log2 n) messages.
      return depth * al + q.frac() * s * be;
    const double g = q.c == collective::reduce ? ga : 0.0;
    return depth * (al + s * (be + g));
  }

  template <collective_comm C, element E>
  static void run(C& comm, const call<E>& c, const options& opt) {
    switch (c.kind) {
      case collective::all_reduce:
        return tree::all_reduce(comm, c.in, c.out, c.reduction, opt);
      case collective::broadcast:
        return binomial::broadcast(comm, c.out, c.root, opt);
      case collective::gather:
        return binomial::gather(comm, c.in, c.out, c.root, opt);
      case collective::scatter:
        return binomial::scatter(comm, c.in, c.out, c.root, opt);
      default:
        return binomial::reduce(comm, c.in, c.out, c.reduction, c.root, opt);
    }
  }
};

}  // namespace ringzero::algorithms::tree
