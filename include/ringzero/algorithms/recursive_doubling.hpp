// Recursive doubling (butterfly): the latency-optimal choice for small messages.
//
//   all_reduce: log2(p) steps, each exchanging and reducing the whole buffer S with the rank
//               whose number differs in one bit (p = the largest power of two <= n). When n is
//               not a power of two, the first 2(n-p) ranks pair up before and after: the even
//               one of each pair hands its data to the odd one and gets the result back (two
//               more steps of S for them).
//   all_gather: log2(n) steps for a power of two, the data held doubling each step; otherwise
//               Bruck's scheme, ceil(log2 n) steps (blocks kept in their final places, so no
//               rotation at the end). Each rank receives (n-1)/n of the output either way.
//
// Partners combine the same two operands in the same order (the lower ranks' partial first),
// so every rank ends with the same bits without copying from one owner.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/blocks.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/algorithms/detail/pipeline.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms {

namespace detail {

/// Folding n ranks onto p, the largest power of two <= n: the first 2*extra ranks (extra =
/// n - p) pair up as (2i, 2i+1), and the even one of each pair sits out. Participants are
/// numbered 0..p-1 in rank order, so each stands for a contiguous range of ranks and a lower
/// participant number still means lower ranks.
struct fold {
  int p = 1;
  int extra = 0;
  int vrank = -1;  ///< this rank's participant number; -1 if it sits out

  [[nodiscard]] static fold make(int n, int r) {
    fold f;
    while (2 * f.p <= n) f.p *= 2;
    f.extra = n - f.p;
    if (r >= 2 * f.extra)
      f.vrank = r - f.extra;
    else if (r % 2 == 1)
      f.vrank = r / 2;
    return f;
  }
  [[nodiscard]] bool sits_out() const noexcept { return vrank < 0; }
  /// This rank absorbs the rank below it (and hands it the result at the end).
  [[nodiscard]] bool absorbs(int r) const noexcept { return vrank >= 0 && r < 2 * extra; }
  [[nodiscard]] int rank_of(int v) const noexcept { return v < extra ? 2 * v + 1 : v + extra; }
  [[nodiscard]] int steps() const noexcept {
    int s = 0;
    while ((1 << s) < p) ++s;
    return s;
  }
};

}  // namespace detail

namespace recursive_doubling {

/// Preconditions (checked by the collectives layer): size() >= 2, in.size() == out.size() > 0;
/// in may equal out.
template <collective_comm T, element E>
void all_reduce(T& comm, std::span<const E> in, std::span<E> out, op o, const options& opt) {
  namespace ad = algorithms::detail;
  ringzero::detail::exchange<T> ex(comm, "all_reduce", "rd", opt.timeout);
  const int n = comm.size();
  const int r = comm.rank();
  const std::size_t count = out.size();
  const std::size_t cb = ad::chunk_bytes_of(comm, opt);
  const auto f = ad::fold::make(n, r);
  const int last_step = f.steps() + 1;

  if (f.sits_out()) {
    ad::send_all(ex, r + 1, 0, in, cb);
    ad::recv_all(ex, r + 1, last_step, out, cb);
    return;
  }
  const std::span<E> theirs = ad::scratch_of<E>(comm, count);
  std::span<const E> mine = in;  // this rank's partial so far
  if (f.absorbs(r)) {
    ad::swap_chunks(ex, r - 1, std::span<const E>{}, r - 1, theirs, 0, cb, false,
                    [&](std::size_t b, std::size_t len) {
                      reduction::combine(o, theirs.data() + b, in.data() + b, out.data() + b, len);
                    });
    mine = out;
  }
  for (int s = 0; s < f.steps(); ++s) {
    const int pv = f.vrank ^ (1 << s);
    const int peer = f.rank_of(pv);
    const bool lower = f.vrank < pv;
    ad::swap_chunks(ex, peer, mine, peer, theirs, s + 1, cb, mine.data() == out.data(),
                    [&](std::size_t b, std::size_t len) {
                      const E* a = mine.data() + b;
                      const E* t = theirs.data() + b;
                      reduction::combine(o, lower ? a : t, lower ? t : a, out.data() + b, len);
                    });
    mine = out;
  }
  if (o == op::avg) reduction::finish_avg(out.data(), count, n);
  if (f.absorbs(r)) ad::send_all(ex, r - 1, last_step, std::span<const E>(out), cb);
}

/// out holds size()*in.size() elements; in may be out's block rank().
template <collective_comm T, element E>
void all_gather(T& comm, std::span<const E> in, std::span<E> out, const options& opt) {
  namespace ad = algorithms::detail;
  using pending = typename ringzero::detail::exchange<T>::pending;
  const int n = comm.size();
  const int r = comm.rank();
  const bool pow2 = (n & (n - 1)) == 0;
  ringzero::detail::exchange<T> ex(comm, "all_gather", pow2 ? "rd" : "bruck", opt.timeout);
  const std::size_t count = in.size();
  const std::size_t cb = ad::chunk_bytes_of(comm, opt);
  auto blocks = [&](int first, int k) {
    return out.subspan(static_cast<std::size_t>(first) * count,
                       static_cast<std::size_t>(k) * count);
  };
  E* own = out.data() + static_cast<std::size_t>(r) * count;
  if (own != in.data()) std::memcpy(own, in.data(), in.size_bytes());

  std::vector<pending> ps;
  if (pow2) {
    // Before step s a rank holds the 2^s blocks of its aligned group; it swaps them with the
    // neighbouring group's.
    for (int s = 0, m = 1; m < n; ++s, m *= 2) {
      const int peer = r ^ m;
      ad::post_recvs(ex, peer, s, blocks(peer & ~(m - 1), m), cb, ps);
      ad::post_sends(ex, peer, s, std::span<const E>(blocks(r & ~(m - 1), m)), cb, ps);
      ex.wait_all(ps);
      ps.clear();
    }
    return;
  }
  // Bruck: before the step with distance d a rank holds blocks r, r+1, ..., r+d-1 (mod n). It
  // sends the first min(d, n-d) of them to r-d and receives as many from r+d, each straight to
  // its final place: a cyclic range that splits in two where it wraps, hence two tag steps.
  auto cyclic = [&](int first, int k, auto&& post) {
    const int head = std::min(k, n - first);
    post(blocks(first, head), 0);
    if (head < k) post(blocks(0, k - head), 1);
  };
  for (int s = 0, d = 1; d < n; ++s, d *= 2) {
    const int k = std::min(d, n - d);
    const int to = mod(r - d, n);
    const int from = mod(r + d, n);
    cyclic(from, k,
           [&](std::span<E> b, int piece) { ad::post_recvs(ex, from, 2 * s + piece, b, cb, ps); });
    cyclic(r, k, [&](std::span<E> b, int piece) {
      ad::post_sends(ex, to, 2 * s + piece, std::span<const E>(b), cb, ps);
    });
    ex.wait_all(ps);
    ps.clear();
  }
}

/// Recursive doubling all_reduce and all_gather (Bruck's all_gather off powers of two).
struct descriptor {
  static constexpr algorithm id = algorithm::recursive_doubling;
  static constexpr std::string_view name = "rd";
  static constexpr collective_set implements{collective::all_reduce, collective::all_gather};
  static constexpr bool needs_nodes = false;

  template <class Table>
  [[nodiscard]] static double cost(const tuning::cost_query& q) {
    const double al = q.p.alpha, be = q.p.beta, ga = q.p.gamma, s = q.bytes;
    if (q.c == collective::all_gather) return tuning::ceil_log2(q.ranks) * al + q.frac() * s * be;
    const double lg = q.log2_floor(), fold = q.fold();
    return (lg + 2 * fold) * (al + s * be) + (lg + fold) * s * ga;
  }

  template <collective_comm C, element E>
  static void run(C& comm, const call<E>& c, const options& opt) {
    if (c.kind == collective::all_gather)
      return recursive_doubling::all_gather(comm, c.in, c.out, opt);
    recursive_doubling::all_reduce(comm, c.in, c.out, c.reduction, opt);
  }
};

}  // namespace recursive_doubling

}  // namespace ringzero::algorithms
