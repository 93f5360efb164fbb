// options::reproducible on host buffers: all_reduce, reduce_scatter and reduce of floating
// types with sum or avg, as three ordinary collectives on integers (reduce/reproducible.hpp):
//   windows  int32 max over 2 per block of 64 elements and one flag for inf/NaN;
//   digits   int64 sum over one digit per element for ordinary data (more where a block's
//            values span more than 40 bits), the same collective as the call (all_reduce,
//            reduce_scatter or reduce) with the call's options;
//   specials int64 sum of inf/NaN counts, only when some rank holds one.
// Integer sums are exact, so the words every rank ends with depend on nothing but the terms;
// each rank then rounds them once. The inner calls are counted and traced as what they are.
//
// Small all_reduces (no algorithm forced) skip the window pass: every rank gathers every term (one
// all_gather, the same latency as one all_reduce at these sizes) and sums them exactly itself.
#pragma once

#include <fmt/core.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/reproducible.hpp"

namespace ringzero::detail {

namespace rp = ringzero::reproducible;

/// Below this many bytes of gathered terms (size() * count * sizeof(E)), an all_reduce with no
/// algorithm forced gathers the terms instead of agreeing on windows first: one collective
/// instead of two.
inline constexpr std::size_t reproducible_gather_bytes = 64 * 1024;

/// Windows of the blocks of `in`, plus the special flag at the end: 2 * blocks + 1 int32.
template <class E>
void local_windows(std::span<const E> in, std::vector<std::int32_t>& win) {
  const std::size_t blocks = (in.size() + rp::block_elems - 1) / rp::block_elems;
  win.assign(2 * blocks + 1, rp::empty);
  std::int32_t special = 0;
  for (std::size_t b = 0; b < blocks; ++b) {
    rp::window w;
    const std::size_t end = std::min(in.size(), (b + 1) * rp::block_elems);
    for (std::size_t i = b * rp::block_elems; i < end; ++i) {
      const rp::term t = rp::decompose(in[i]);
      w.add(t);
      special |= t.k != rp::kind::finite && t.k != rp::kind::zero;
    }
    win[2 * b] = w.top;
    win[2 * b + 1] = w.neg_low;
  }
  win.back() = special;
}

[[nodiscard]] inline rp::window window_of(const std::vector<std::int32_t>& win, std::size_t i) {
  const std::size_t b = i / rp::block_elems;
  return rp::window{win[2 * b], win[2 * b + 1]};
}

/// Digits of elements [from, to) of `in`, element after element, into q from q_at.
template <class E>
void write_digits(std::span<const E> in, const std::vector<std::int32_t>& win, std::size_t from,
                  std::size_t to, std::int64_t* q) {
  for (std::size_t i = from; i < to; ++i) {
    const rp::window w = window_of(win, i);
    rp::to_words(rp::decompose(in[i]), w, q);
    q += rp::words(w);
  }
}

template <class E>
void read_digits(const std::int64_t* q, const std::vector<std::int32_t>& win, std::size_t from,
                 std::size_t to, std::uint32_t divisor, E* out) {
  for (std::size_t i = from; i < to; ++i) {
    const rp::window w = window_of(win, i);
    out[i - from] = rp::round_words<E>(q, w, divisor);
    q += rp::words(w);
  }
}

/// Digits elements [from, to) take.
[[nodiscard]] inline std::size_t digits_between(const std::vector<std::int32_t>& win,
                                                std::size_t from, std::size_t to) {
  std::size_t n = 0;
  for (std::size_t i = from; i < to;) {
    const std::size_t b = i / rp::block_elems;
    const std::size_t end = std::min(to, (b + 1) * rp::block_elems);
    n += (end - i) * static_cast<std::size_t>(rp::words(rp::window{win[2 * b], win[2 * b + 1]}));
    i = end;
  }
  return n;
}

template <class E>
void special_codes(std::span<const E> in, std::vector<std::int64_t>& codes) {
  codes.resize(in.size());
  for (std::size_t i = 0; i < in.size(); ++i) codes[i] = rp::special_code(rp::decompose(in[i]));
}

/// Overwrites out[i] with IEEE addition's inf or NaN where the summed codes say so.
template <class E>
void apply_specials(const std::int64_t* codes, std::size_t n, E* out) {
  for (std::size_t i = 0; i < n; ++i) {
    E v{};
    if (rp::special_result(codes[i], v)) out[i] = v;
  }
}

/// Whether a call takes the reproducible path: the option set on a floating type with sum or
/// avg (min and max are exact already, integers too). prod has no exact form and is refused.
template <element E>
[[nodiscard]] bool takes_reproducible_path(const algorithms::call<E>& c, const options& opt) {
  if (!opt.reproducible) return false;
  if (c.kind != collective::all_reduce && c.kind != collective::reduce_scatter &&
      c.kind != collective::reduce)
    return false;  // nothing is added: the result is the same bits whatever the option says
  if constexpr (!rp::supported_v<std::remove_cv_t<E>>) {
    return false;
  } else {
    if (c.reduction == op::prod)
      throw invalid_argument(fmt::format(
          "{}: options::reproducible takes sum or avg (min and max are exact already); prod has "
          "no reproducible form",
          collective_name(c.kind)));
    return c.reduction == op::sum || c.reduction == op::avg;
  }
}

template <class Comm, class E>
void run_reproducible(Comm& comm, const algorithms::call<E>& c, const options& opt) {
  const int n = comm.size();
  options inner = opt;
  inner.reproducible = false;
  // The windows and the gathered terms are exact whatever moves them: their algorithm is the
  // cost model's, while the digits go by the call's (options::algorithm may not implement
  // all_gather or work on int32).
  options aux = inner;
  aux.algorithm = algorithm::automatic;
  const auto divisor = static_cast<std::uint32_t>(c.reduction == op::avg ? n : 1);
  if (static_cast<std::int64_t>(n) > rp::max_terms)
    throw invalid_argument(
        fmt::format("{}: options::reproducible adds at most {} terms; the "
                    "world has {} ranks",
                    collective_name(c.kind), rp::max_terms, n));
  const bool root = comm.rank() == c.root;

  // Small all_reduce: gather the terms, sum them here.
  if (c.kind == collective::all_reduce && n > 1 && opt.algorithm == algorithm::automatic &&
      c.in.size() * static_cast<std::size_t>(n) * sizeof(E) <= reproducible_gather_bytes) {
    const std::size_t count = c.in.size();
    std::vector<E> all(count * static_cast<std::size_t>(n));
    all_gather(comm, c.in, std::span<E>(all), aux);
    std::vector<E> terms(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < count; ++i) {
      for (std::size_t r = 0; r < static_cast<std::size_t>(n); ++r) terms[r] = all[r * count + i];
      c.out[i] = rp::serial_sum(terms.data(), terms.size(), divisor);
    }
    return;
  }

  std::vector<std::int32_t> win;
  local_windows(c.in, win);
  all_reduce(comm, std::span<std::int32_t>(win), op::max, aux);
  const bool special = win.back() != 0;
  std::vector<std::int64_t> codes;
  if (special) special_codes(c.in, codes);

  if (c.kind == collective::reduce_scatter) {
    const std::size_t count = c.out.size();
    // Every rank's segment padded to the longest, so reduce_scatter's equal blocks line up.
    std::size_t seg = 0;
    for (int r = 0; r < n; ++r)
      seg = std::max(seg, digits_between(win, static_cast<std::size_t>(r) * count,
                                         static_cast<std::size_t>(r + 1) * count));
    std::vector<std::int64_t> q(seg * static_cast<std::size_t>(n), 0);
    for (int r = 0; r < n; ++r)
      write_digits(c.in, win, static_cast<std::size_t>(r) * count,
                   static_cast<std::size_t>(r + 1) * count,
                   q.data() + static_cast<std::size_t>(r) * seg);
    std::vector<std::int64_t> mine(seg);
    reduce_scatter(comm, std::span<const std::int64_t>(q), std::span<std::int64_t>(mine), op::sum,
                   inner);
    const std::size_t from = static_cast<std::size_t>(comm.rank()) * count;
    read_digits(mine.data(), win, from, from + count, divisor, c.out.data());
    if (special) {
      std::vector<std::int64_t> mine_codes(count);
      reduce_scatter(comm, std::span<const std::int64_t>(codes),
                     std::span<std::int64_t>(mine_codes), op::sum, inner);
      apply_specials(mine_codes.data(), count, c.out.data());
    }
    return;
  }

  const std::size_t count = c.in.size();
  std::vector<std::int64_t> q(digits_between(win, 0, count));
  write_digits(c.in, win, 0, count, q.data());
  if (c.kind == collective::all_reduce)
    all_reduce(comm, std::span<std::int64_t>(q), op::sum, inner);
  else
    reduce(comm, std::span<std::int64_t>(q), op::sum, c.root, inner);
  if (special) {
    if (c.kind == collective::all_reduce)
      all_reduce(comm, std::span<std::int64_t>(codes), op::sum, inner);
    else
      reduce(comm, std::span<std::int64_t>(codes), op::sum, c.root, inner);
  }
  if (c.kind == collective::reduce && !root) return;
  read_digits(q.data(), win, 0, count, divisor, c.out.data());
  if (special) apply_specials(codes.data(), count, c.out.data());
}

}  // namespace ringzero::detail
