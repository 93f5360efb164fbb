// Binomial-tree gather and scatter (as in MPICH): the tree of binomial.hpp, with ranks
// renumbered relative to the root. Relative rank v owns the contiguous range of blocks
// [v, v + subtree(v)), so a rank forwards its whole subtree's blocks in one message.
//
//   gather:  a rank receives its children's ranges (smallest subtree first), then sends its
//            range to its parent; scatter runs the same tree the other way, biggest first.
//   ceil(log2 n) rounds; the root's link carries (n-1)/n·S: ceil(log2 n)α + (n-1)/n·Sβ.
//
// Ranks that forward (inner nodes) hold their subtree's blocks in the communicator's scratch;
// a root other than rank 0 also rotates the buffer between relative and rank order there.
// Each message is cut into at most the transport's tuning::policy::burst chunks and a rank talks to
// at most ceil(log2 n) + 1 peers, so the messages in flight stay bounded.
#pragma once

#include <cstddef>
#include <cstring>
#include <span>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/blocks.hpp"
#include "ringzero/algorithms/detail/pipeline.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms::binomial {

namespace detail {

/// Relative rank v's place in the tree over n ranks: its subtree size (in ranks), its parent
/// (relative; -1 at the root), and the relative offsets m of its children (child v + m owns
/// min(m, n - v - m) ranks).
struct subtree {
  int size = 1;
  int parent = -1;
  std::vector<int> child_offsets;  ///< increasing
};

[[nodiscard]] inline subtree subtree_of(int v, int n) {
  subtree s;
  int low = 1;
  if (v == 0)
    while (low < n) low *= 2;
  else
    low = v & -v;
  s.size = std::min(low, n - v);
  if (v) s.parent = v - low;
  for (int m = 1; m < low && v + m < n; m *= 2) s.child_offsets.push_back(m);
  return s;
}

/// Copies between relative order (block j belongs to rank root + j) and rank order.
template <element E>
void rotate(const E* from, E* to, std::size_t count, int n, int shift) {
  const auto head = static_cast<std::size_t>(n - shift) * count;
  const auto tail = static_cast<std::size_t>(shift) * count;
  std::memcpy(to, from + tail, head * sizeof(E));
  std::memcpy(to + head, from, tail * sizeof(E));
}

}  // namespace detail

/// Preconditions (checked by the collectives layer): size() >= 2, in.size() > 0, and on the
/// root out.size() == size() * in.size() (in may be the root's block of out).
template <collective_comm T, element E>
void gather(T& comm, std::span<const E> in, std::span<E> out, int root, const options& opt) {
  namespace ad = algorithms::detail;
  using pending = typename ringzero::detail::exchange<T>::pending;
  ringzero::detail::exchange<T> ex(comm, "gather", "binomial", opt.timeout);
  const int n = comm.size();
  const int v = mod(comm.rank() - root, n);
  const std::size_t count = in.size();
  const std::size_t chunk_bytes = ad::chunk_bytes_of(comm, opt);
  const detail::subtree t = detail::subtree_of(v, n);
  const auto range = static_cast<std::size_t>(t.size) * count;
  // Where this rank's range is assembled: in itself for a leaf, out itself on root 0.
  const E* mine = in.data();
  E* buf = nullptr;
  if (t.size > 1) {
    buf = v == 0 && root == 0 ? out.data() : ad::scratch_of<E>(comm, range).data();
    if (buf != in.data()) std::memcpy(buf, in.data(), in.size_bytes());
    mine = buf;
  }
  std::vector<pending> ps;
  for (int m : t.child_offsets) {
    const int child_size = std::min(m, n - v - m);
    ad::post_recvs(ex, mod(v + m + root, n), 0,
                   std::span<E>(buf + static_cast<std::size_t>(m) * count,
                                static_cast<std::size_t>(child_size) * count),
                   chunk_bytes, ps);
  }
  ex.wait_all(ps);
  if (v != 0) {
    ad::send_all(ex, mod(t.parent + root, n), 0, std::span<const E>(mine, range), chunk_bytes);
    return;
  }
  if (root != 0) detail::rotate(buf, out.data(), count, n, n - root);
}

/// Preconditions (checked by the collectives layer): size() >= 2, out.size() > 0, and on the
/// root in.size() == size() * out.size() (out may be the root's block of in).
template <collective_comm T, element E>
void scatter(T& comm, std::span<const E> in, std::span<E> out, int root, const options& opt) {
  namespace ad = algorithms::detail;
  using pending = typename ringzero::detail::exchange<T>::pending;
  ringzero::detail::exchange<T> ex(comm, "scatter", "binomial", opt.timeout);
  const int n = comm.size();
  const int v = mod(comm.rank() - root, n);
  const std::size_t count = out.size();
  const std::size_t chunk_bytes = ad::chunk_bytes_of(comm, opt);
  const detail::subtree t = detail::subtree_of(v, n);
  const auto range = static_cast<std::size_t>(t.size) * count;
  const E* src = nullptr;  // this rank's range, relative order
  if (v == 0) {
    if (root == 0) {
      src = in.data();
    } else {
      const std::span<E> rotated = ad::scratch_of<E>(comm, range);
      detail::rotate(in.data(), rotated.data(), count, n, root);
      src = rotated.data();
    }
  } else if (t.size == 1) {
    ad::recv_all(ex, mod(t.parent + root, n), 0, out, chunk_bytes);
    return;
  } else {
    const std::span<E> received = ad::scratch_of<E>(comm, range);
    ad::recv_all(ex, mod(t.parent + root, n), 0, received, chunk_bytes);
    src = received.data();
  }
  std::vector<pending> ps;
  for (auto it = t.child_offsets.rbegin(); it != t.child_offsets.rend(); ++it) {
    const int m = *it;
    const int child_size = std::min(m, n - v - m);
    ad::post_sends(ex, mod(v + m + root, n), 0,
                   std::span<const E>(src + static_cast<std::size_t>(m) * count,
                                      static_cast<std::size_t>(child_size) * count),
                   chunk_bytes, ps);
  }
  if (src != out.data()) std::memcpy(out.data(), src, out.size_bytes());
  ex.wait_all(ps);
}

}  // namespace ringzero::algorithms::binomial
