// Recursive halving and doubling (Rabenseifner, 2004; Thakur, Rabenseifner & Gropp, 2005):
// the butterfly's few steps with the ring's bytes, for mid-sized messages.
//
//   reduce_scatter: log2(p) halving steps (p = the largest power of two <= n): in each a rank
//                   keeps half of its current window, sends the other half to its partner and
//                   reduces the half it receives. (p-1)/p of the buffer sent and reduced.
//   all_reduce:     halving over p blocks of the buffer, then the same steps in reverse as an
//                   all_gather: 2 log2(p) steps, 2(p-1)/p of S sent per rank.
//
// When n is not a power of two the first 2(n-p) ranks fold in pairs first (as in recursive
// doubling): the even one sends its whole input to the odd one and gets its result back at
// the end, S (all_reduce) or n*count (reduce_scatter) extra for those pairs. Every element is
// reduced on exactly one rank, with the partial of the lower participants first, and copied
// from there, so all ranks hold the same bits.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/blocks.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/algorithms/detail/pipeline.hpp"
#include "ringzero/algorithms/recursive_doubling.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms::rabenseifner {

namespace detail {

/// A buffer that holds the elements [origin, origin + its length) of the collective's range.
template <class E>
struct region {
  E* base = nullptr;
  std::size_t origin = 0;
  [[nodiscard]] E* at(std::size_t i) const noexcept { return base + (i - origin); }
};

/// Recursive halving among the fold's p participants over p super-blocks, super-block v being
/// the elements [bounds[v], bounds[v+1]). At distance m = p/2, p/4, ..., 1 a participant pairs
/// with v ^ m; the one with bit m clear keeps the lower half of their common window. After the
/// last step participant v holds super-block v reduced over all ranks, at dest(true).
///
/// `src` holds this rank's partial over the whole range; `theirs` has room for the largest half
/// received; dest(last) says where the kept half goes (it must hold every later window too).
template <collective_comm T, element E, class Dest>
void halve(ringzero::detail::exchange<T>& ex, const algorithms::detail::fold& f,
           const std::vector<std::size_t>& bounds, op o, std::size_t chunk_bytes, int step0,
           region<const E> src, E* theirs, Dest dest) {
  region<const E> cur = src;
  int lo = 0, hi = f.p;
  for (int j = 0, m = f.p / 2; m >= 1; ++j, m /= 2) {
    const int pv = f.vrank ^ m;
    const int peer = f.rank_of(pv);
    const bool lower = (f.vrank & m) == 0;
    const int mid = lo + m;
    const int keep_lo = lower ? lo : mid, keep_hi = lower ? mid : hi;
    const int give_lo = lower ? mid : lo, give_hi = lower ? hi : mid;
    const std::size_t kb = bounds[static_cast<std::size_t>(keep_lo)];
    const std::size_t ke = bounds[static_cast<std::size_t>(keep_hi)];
    const std::size_t gb = bounds[static_cast<std::size_t>(give_lo)];
    const std::size_t ge = bounds[static_cast<std::size_t>(give_hi)];
    const region<E> dst = dest(m == 1);
    algorithms::detail::swap_chunks(
        ex, peer, std::span<const E>(cur.at(gb), ge - gb), peer, std::span<E>(theirs, ke - kb),
        step0 + j, chunk_bytes, false, [&](std::size_t b, std::size_t len) {
          const E* mine = cur.at(kb + b);
          const E* other = theirs + b;
          reduction::combine(o, lower ? mine : other, lower ? other : mine, dst.at(kb + b), len);
        });
    cur = {dst.base, dst.origin};
    lo = keep_lo;
    hi = keep_hi;
  }
}

/// Elements in the larger half of the first halving step: the most any step receives.
[[nodiscard]] inline std::size_t largest_half(const std::vector<std::size_t>& bounds, int p) {
  const std::size_t mid = bounds[static_cast<std::size_t>(p / 2)];
  return std::max(mid - bounds[0], bounds[static_cast<std::size_t>(p)] - mid);
}

/// The range this participant keeps after the first halving step.
[[nodiscard]] inline std::pair<std::size_t, std::size_t> first_kept(
    const std::vector<std::size_t>& bounds, const algorithms::detail::fold& f) {
  const auto h = static_cast<std::size_t>(f.p / 2);
  if ((f.vrank & (f.p / 2)) == 0) return {bounds[0], bounds[h]};
  return {bounds[h], bounds[static_cast<std::size_t>(f.p)]};
}

}  // namespace detail

/// Preconditions (checked by the collectives layer): size() >= 2, in.size() == out.size() > 0;
/// in may equal out.
template <collective_comm T, element E>
void all_reduce(T& comm, std::span<const E> in, std::span<E> out, op o, const options& opt) {
  namespace ad = algorithms::detail;
  ringzero::detail::exchange<T> ex(comm, "all_reduce", "rhd", opt.timeout);
  const int n = comm.size();
  const int r = comm.rank();
  const std::size_t count = out.size();
  const std::size_t cb = ad::chunk_bytes_of(comm, opt);
  const auto f = ad::fold::make(n, r);
  const int steps = f.steps();
  const int last_step = 2 * steps + 1;

  if (f.sits_out()) {
    ad::send_all(ex, r + 1, 0, in, cb);
    ad::recv_all(ex, r + 1, last_step, out, cb);
    return;
  }
  const auto bl = block_layout::even(count, f.p);
  std::vector<std::size_t> bounds(bl.offset);
  bounds.push_back(count);
  const std::span<E> theirs = ad::scratch_of<E>(
      comm, std::max(f.absorbs(r) ? count : 0, detail::largest_half(bounds, f.p)));

  detail::region<const E> src{in.data(), 0};
  if (f.absorbs(r)) {
    ad::swap_chunks(ex, r - 1, std::span<const E>{}, r - 1, theirs.first(count), 0, cb, false,
                    [&](std::size_t b, std::size_t len) {
                      reduction::combine(o, theirs.data() + b, in.data() + b, out.data() + b, len);
                    });
    src = {out.data(), 0};
  }
  const detail::region<E> whole{out.data(), 0};
  detail::halve(ex, f, bounds, o, cb, 1, src, theirs.data(), [&](bool) { return whole; });
  const auto v = static_cast<std::size_t>(f.vrank);
  if (o == op::avg) reduction::finish_avg(out.data() + bounds[v], bounds[v + 1] - bounds[v], n);

  // All-gather: the halving steps backwards, each window doubling.
  using pending = typename ringzero::detail::exchange<T>::pending;
  std::vector<pending> ps;
  for (int j = 0, m = 1; m < f.p; ++j, m *= 2) {
    const int pv = f.vrank ^ m;
    auto window = [&](int member) {
      const auto first = static_cast<std::size_t>(member & ~(m - 1));
      return out.subspan(bounds[first],
                         bounds[first + static_cast<std::size_t>(m)] - bounds[first]);
    };
    ad::post_recvs(ex, f.rank_of(pv), steps + 1 + j, window(pv), cb, ps);
    ad::post_sends(ex, f.rank_of(pv), steps + 1 + j, std::span<const E>(window(f.vrank)), cb, ps);
    ex.wait_all(ps);
    ps.clear();
  }
  if (f.absorbs(r)) ad::send_all(ex, r - 1, last_step, std::span<const E>(out), cb);
}

/// in holds size()*out.size() elements; out receives block rank() reduced over all ranks. out
/// may be in's own block. Scratch: about n*count elements (twice that on folding ranks).
template <collective_comm T, element E>
void reduce_scatter(T& comm, std::span<const E> in, std::span<E> out, op o, const options& opt) {
  namespace ad = algorithms::detail;
  ringzero::detail::exchange<T> ex(comm, "reduce_scatter", "rhd", opt.timeout);
  const int n = comm.size();
  const int r = comm.rank();
  const std::size_t count = out.size();
  const std::size_t total = in.size();
  const std::size_t cb = ad::chunk_bytes_of(comm, opt);
  const auto f = ad::fold::make(n, r);
  const int last_step = f.steps() + 1;

  if (f.sits_out()) {
    ad::send_all(ex, r + 1, 0, in, cb);
    ad::recv_all(ex, r + 1, last_step, out, cb);
    return;
  }
  // Participant v's super-block is the blocks of the ranks it stands for.
  std::vector<std::size_t> bounds(static_cast<std::size_t>(f.p) + 1, total);
  for (int v = 0; v < f.p; ++v)
    bounds[static_cast<std::size_t>(v)] =
        static_cast<std::size_t>(v < f.extra ? 2 * v : v + f.extra) * count;

  const auto [kept_lo, kept_hi] = detail::first_kept(bounds, f);
  const std::size_t folded = f.absorbs(r) ? total : 0;
  const std::size_t half = detail::largest_half(bounds, f.p);
  const std::span<E> scratch = ad::scratch_of<E>(comm, folded + half + (kept_hi - kept_lo));
  E* theirs = scratch.data() + folded;
  const detail::region<E> work{scratch.data() + folded + half, kept_lo};

  detail::region<const E> src{in.data(), 0};
  if (f.absorbs(r)) {
    const std::span<E> sum = scratch.first(total);
    ad::swap_chunks(ex, r - 1, std::span<const E>{}, r - 1, sum, 0, cb, false,
                    [&](std::size_t b, std::size_t len) {
                      reduction::combine(o, sum.data() + b, in.data() + b, sum.data() + b, len);
                    });
    src = {sum.data(), 0};
  }
  const auto v = static_cast<std::size_t>(f.vrank);
  const std::size_t mine = static_cast<std::size_t>(r) * count;
  const bool final_is_mine = bounds[v] == mine && bounds[v + 1] == mine + count;
  auto dest = [&](bool last) {
    return last && final_is_mine ? detail::region<E>{out.data(), mine} : work;
  };
  detail::halve(ex, f, bounds, o, cb, 1, src, theirs, dest);
  const detail::region<E> result = dest(true);
  if (o == op::avg) reduction::finish_avg(result.at(bounds[v]), bounds[v + 1] - bounds[v], n);
  if (f.absorbs(r)) {
    ad::send_all(ex, r - 1, last_step, std::span<const E>(result.at(mine - count), count), cb);
    std::memcpy(out.data(), result.at(mine), out.size_bytes());
  }
}

/// Rabenseifner's all_reduce (recursive halving, then doubling) and its reduce_scatter half.
struct descriptor {
  static constexpr algorithm id = algorithm::recursive_halving_doubling;
  static constexpr std::string_view name = "rhd";
  static constexpr collective_set implements{collective::all_reduce, collective::reduce_scatter};
  static constexpr bool needs_nodes = false;

  template <class Table>
  [[nodiscard]] static double cost(const tuning::cost_query& q) {
    const double al = q.p.alpha, be = q.p.beta, ga = q.p.gamma, s = q.bytes;
    const double lg = q.log2_floor(), fold = q.fold(), frac = q.frac();
    if (q.c == collective::reduce_scatter) return (lg + fold) * al + (frac + fold) * s * (be + ga);
    return 2 * (lg + fold) * al + (2 * frac + 2 * fold) * s * be + (frac + fold) * s * ga;
  }

  template <collective_comm C, element E>
  static void run(C& comm, const call<E>& c, const options& opt) {
    if (c.kind == collective::reduce_scatter)
      return rabenseifner::reduce_scatter(comm, c.in, c.out, c.reduction, opt);
    rabenseifner::all_reduce(comm, c.in, c.out, c.reduction, opt);
  }
};

}  // namespace ringzero::algorithms::rabenseifner
