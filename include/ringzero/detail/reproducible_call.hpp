// options::reproducible on host buffers: a collective whose descriptor reduces (all_reduce,
// reduce_scatter, reduce, or one of the caller's own) on floating types with sum or avg, as
// three ordinary collectives on integers (reduce/reproducible.hpp), each run by the dispatcher:
//   windows  int32 max over 2 per block of 64 elements and one flag for inf/NaN;
//   digits   int64 sum over one digit per element for ordinary data (more where a block's
//            values span more than 40 bits), the same collective as the call with the call's
//            options and algorithms;
//   specials int64 sum of inf/NaN counts, only when some rank holds one.
// Integer sums are exact, so the words every rank ends with depend on nothing but the terms;
// each rank then rounds them once. The inner calls are counted and traced as what they are.
//
// Small all_reduces (no algorithm forced) skip the window pass: every rank gathers every term (one
// all_gather, the same latency as one all_reduce at these sizes) and sums them exactly itself.
//
// The passes over the data are the cost (docs/performance.md, "Reproducible sums: the cost"), so
// the common cases take integer fast paths that give the general functions' bits: one-digit
// blocks write and round a digit without branches on the data (one_digit, round_int64), the
// gathered terms of an element are summed in one int64 where they span few bits, and a thread
// keeps its scratch across calls.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <bit>
#include <cfenv>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/algorithms/table.hpp"
#include "ringzero/collective_table.hpp"
#include "ringzero/communicator.hpp"
#include "ringzero/detail/dispatch_fwd.hpp"
#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/detail/gathered.hpp"
#include "ringzero/reduce/detail/reproducible_x86.hpp"
#include "ringzero/reduce/reproducible.hpp"
#include "ringzero/reduce/simd.hpp"
#include "ringzero/tuning/thresholds.hpp"

namespace ringzero::detail {

namespace rp = ringzero::reproducible;

/// Windows of the blocks of `in`, plus the special flag at the end: 2 * blocks + 1 int32. On a
/// given path of the host loops (floats have AVX-512 loops, reduce/detail/reproducible_x86.hpp;
/// every path gives the same windows), or on active_simd()'s.
template <class E>
void local_windows(reduction::simd path, std::span<const E> in, std::vector<std::int32_t>& win) {
  const std::size_t blocks = rp::blocks(in.size());
  win.resize(2 * blocks + 1);
  bool special = false;
  std::size_t done = 0;
#if RINGZERO_X86_SIMD
  if constexpr (std::is_same_v<E, float>)
    if (path == reduction::simd::avx512)
      done = rp::detail::x86::avx512::windows(in.data(), in.size(), win.data(), special, rp::empty);
#endif
  (void)path;
  for (std::size_t b = done; b < blocks; ++b) {
    rp::window w;
    const std::size_t end = std::min(in.size(), (b + 1) * rp::block_elems);
    for (std::size_t i = b * rp::block_elems; i < end; ++i) {
      const rp::term t = rp::decompose(in[i]);
      w.add(t);
      special = special || (t.k != rp::kind::finite && t.k != rp::kind::zero);
    }
    win[2 * b] = w.top;
    win[2 * b + 1] = w.neg_low;
  }
  win.back() = special ? 1 : 0;
}
template <class E>
void local_windows(std::span<const E> in, std::vector<std::int32_t>& win) {
  local_windows(reduction::active_simd(), in, win);
}

[[nodiscard]] inline rp::window window_of(const std::vector<std::int32_t>& win, std::size_t i) {
  const std::size_t b = i / rp::block_elems;
  return rp::window{win[2 * b], win[2 * b + 1]};
}

/// Calls f(first, last, window) for the runs of [from, to) that share a block.
template <class F>
void for_each_block(const std::vector<std::int32_t>& win, std::size_t from, std::size_t to, F f) {
  for (std::size_t i = from; i < to;) {
    const std::size_t end = std::min(to, (i / rp::block_elems + 1) * rp::block_elems);
    f(i, end, window_of(win, i));
    i = end;
  }
}

/// rp::digit(rp::decompose(x), low, 0) for a block of one digit, without branches: the
/// window guarantees every finite term's bits lie in [low, low + 40), and inf, NaN and zero give
/// 0.
template <class E>
[[nodiscard]] inline std::int64_t one_digit(E x, int low) noexcept {
  using F = rp::format<E>;
  constexpr int frac_bits = F::p - 1;
  constexpr std::uint64_t exp_all = (std::uint64_t{1} << F::exp_bits) - 1;
  const auto b = static_cast<std::uint64_t>(rp::bits_of(x));
  const std::uint64_t e = (b >> frac_bits) & exp_all;
  const std::uint64_t f = b & ((std::uint64_t{1} << frac_bits) - 1);
  const std::uint64_t implicit = e != 0 ? std::uint64_t{1} << frac_bits : 0;
  const std::uint64_t mant = e == exp_all ? 0 : (f | implicit);
  const int exp = static_cast<int>(e != 0 ? e : 1) - F::emax - frac_bits;
  const int shift = std::clamp(exp - low, -63, 63);
  const std::uint64_t v = shift >= 0 ? mant << shift : mant >> -shift;
  const std::uint64_t neg = 0 - (b >> (1 + F::exp_bits + frac_bits - 1));  // all ones if negative
  return static_cast<std::int64_t>((v ^ neg) - neg);
}

/// rp::to_words(rp::decompose(x), w, q) for a block of `words` digits from bit `low`: the
/// mantissa lands on at most three consecutive digits, so those are cut from one 128-bit shift
/// and the rest are zero, instead of each digit being shifted and masked on its own. A term with
/// set bits below `low` (a double window cut at rp::max_words) takes rp::to_words.
template <class E>
inline void many_digits(E x, const rp::window& w, int words, int low, std::int64_t* q) noexcept {
  constexpr std::uint64_t mask = (std::uint64_t{1} << rp::digit_bits) - 1;
  const rp::term t = rp::decompose(x);
  for (int k = 0; k < words; ++k) q[k] = 0;
  if (t.k != rp::kind::finite) return;
  int off = t.exp - low;  // where the mantissa's bit 0 lands in the block's digits
  std::uint64_t mant = t.mant;
  if (off < 0) {
    // The window's low bit is the lowest set bit of any term, so only zeros lie below it,
    // unless the window was cut.
    if (off <= -64 || (mant & ((std::uint64_t{1} << -off) - 1)) != 0) return rp::to_words(t, w, q);
    mant >>= -off;
    off = 0;
  }
  // The window holds every term's top bit, so the last digit written is below `words`.
  rp::u128 v = static_cast<rp::u128>(mant) << (off % rp::digit_bits);
  for (int k = off / rp::digit_bits; v != 0; ++k, v >>= rp::digit_bits) {
    const auto d = static_cast<std::int64_t>(static_cast<std::uint64_t>(v) & mask);
    q[k] = t.neg ? -d : d;
  }
}

/// Digits of elements [from, to) of `in`, element after element, into q from q_at. The window's
/// words and low bit are worked out once per block, and a one-digit block (the usual case) writes
/// rp::digit directly.
template <class E>
void write_digits(reduction::simd path, std::span<const E> in, const std::vector<std::int32_t>& win,
                  std::size_t from, std::size_t to, std::int64_t* q) {
  (void)path;
  for_each_block(win, from, to, [&](std::size_t first, std::size_t last, rp::window w) {
    const int words = rp::words(w);
    if (words == 1) {
      const int low = w.low();
#if RINGZERO_X86_SIMD
      if constexpr (std::is_same_v<E, float>) {
        if (path == reduction::simd::avx512) {
          const std::size_t done =
              rp::detail::x86::avx512::one_digits(in.data() + first, last - first, low, q);
          q += done;
          first += done;
        }
      }
#endif
      for (std::size_t i = first; i < last; ++i) *q++ = one_digit(in[i], low);
      return;
    }
    const int low = w.low();
    for (std::size_t i = first; i < last; ++i) {
      many_digits(in[i], w, words, low, q);
      q += words;
    }
  });
}
template <class E>
void write_digits(std::span<const E> in, const std::vector<std::int32_t>& win, std::size_t from,
                  std::size_t to, std::int64_t* q) {
  write_digits(reduction::active_simd(), in, win, from, to, q);
}

/// rp::round_words for a one-digit block: the word is the sum itself, in units of 2^low.
template <class E>
[[nodiscard]] inline E round_one_word(std::int64_t s, const rp::window& w, int low,
                                      std::uint32_t divisor) {
  E v{};
  if (round_int64(s, low, divisor, v)) return v;
  return rp::round_words<E>(&s, w, divisor);
}

/// A two-digit block's words as one integer, w[0] + w[1] 2^40 in units of 2^low: its magnitude
/// (under 2^104) and sign.
[[nodiscard]] inline rp::u128 joined_words(const std::int64_t* w, bool& neg) noexcept {
  __extension__ using i128 = __int128;
  const i128 s = static_cast<i128>(w[1]) * (i128{1} << rp::digit_bits) + w[0];
  neg = s < 0;
  return neg ? rp::u128{0} - static_cast<rp::u128>(s) : static_cast<rp::u128>(s);
}

/// rp::round_words for a two-digit block (a double's usual case): the words joined in 128 bits
/// and rounded once, without round_words' carries between digits.
template <class E>
[[nodiscard]] inline E round_two_words(const std::int64_t* w, int low, std::uint32_t divisor) {
  bool neg = false;
  const rp::u128 a = joined_words(w, neg);
  return a == 0 ? rp::from_bits<E>(0) : rp::round_to<E>(neg, a, low, false, divisor);
}

/// round_int64 without a divisor through the hardware's int64-to-floating conversion, for float
/// and double, where the thread rounds to nearest (the caller checked fegetround()): the
/// conversion rounds s to p bits, ties to even, as round_u64 does, and scaling the result by
/// 2^low is exact while it stays a normal number, which adding low to its exponent field is.
/// False where it would not be normal (round_one_word decides those). About 2 ns per element
/// where the integer path takes about 10 (bench/reproducible_passes).
template <class E>
[[nodiscard]] inline bool round_int64_nearest(std::int64_t s, int low, E& out) noexcept {
  static_assert(std::is_same_v<E, float> || std::is_same_v<E, double>);
  using F = rp::format<E>;
  using B = typename F::bits;
  constexpr int frac_bits = F::p - 1;
  constexpr int max_biased = (1 << F::exp_bits) - 2;
  if (s == 0) {
    out = rp::from_bits<E>(0);
    return true;
  }
  const B b = rp::bits_of(static_cast<E>(s));
  const int biased = static_cast<int>((b >> frac_bits) & ((B{1} << F::exp_bits) - 1)) + low;
  if (biased < 1 || biased > max_biased) return false;
  // Unsigned arithmetic: a negative low wraps to the subtraction it stands for.
  out = rp::from_bits<E>(static_cast<B>(b + static_cast<B>(static_cast<B>(low) << frac_bits)));
  return true;
}

/// round_two_words without a divisor where the thread rounds to nearest: the 128-bit integer is
/// cut to its top 62 bits with every bit below folded into the lowest (rounding to odd), which
/// rounds to p bits to nearest as the whole integer does, since 62 >= p + 2; then
/// round_int64_nearest. False where the result would not be a normal number.
template <class E>
[[nodiscard]] inline bool round_two_words_nearest(const std::int64_t* w, int low, E& out) noexcept {
  bool neg = false;
  const rp::u128 a = joined_words(w, neg);
  const int shift = std::max(0, rp::bit_width128(a) - 62);
  auto t = static_cast<std::uint64_t>(a >> shift);
  if (shift > 0 && (a & ((rp::u128{1} << shift) - 1)) != 0) t |= 1u;
  const auto st = static_cast<std::int64_t>(t);  // t < 2^62
  return round_int64_nearest<E>(neg ? -st : st, low + shift, out);
}

template <class E>
void read_digits(reduction::simd path, const std::int64_t* q, const std::vector<std::int32_t>& win,
                 std::size_t from, std::size_t to, std::uint32_t divisor, E* out) {
  (void)path;
  // The conversion follows the thread's rounding mode; the integer path does not depend on it.
  constexpr bool convertible = std::is_same_v<E, float> || std::is_same_v<E, double>;
  const bool nearest = convertible && divisor <= 1 && std::fegetround() == FE_TONEAREST;
  for_each_block(win, from, to, [&](std::size_t first, std::size_t last, rp::window w) {
    const int words = rp::words(w);
    E* o = out + (first - from);
    if (words == 1) {
      const int low = w.low();
      if constexpr (convertible) {
        if (nearest) {
          std::size_t i = first;
#if RINGZERO_X86_SIMD
          if constexpr (std::is_same_v<E, float>) {
            if (path == reduction::simd::avx512) {
              // q and o still point at the block's start while the fallback runs.
              const std::size_t done = rp::detail::x86::avx512::round_nearest(
                  q, last - first, low, o,
                  [&](std::size_t j) { o[j] = round_one_word<E>(q[j], w, low, divisor); });
              i += done;
              q += done;
              o += done;
            }
          }
#endif
          for (; i < last; ++i, ++q, ++o)
            if (!round_int64_nearest<E>(*q, low, *o)) *o = round_one_word<E>(*q, w, low, divisor);
          return;
        }
      }
      for (std::size_t i = first; i < last; ++i) *o++ = round_one_word<E>(*q++, w, low, divisor);
      return;
    }
    if (words == 2) {
      const int low = w.low();
      if constexpr (convertible) {
        if (nearest) {
          for (std::size_t i = first; i < last; ++i, q += 2, ++o)
            if (!round_two_words_nearest<E>(q, low, *o)) *o = round_two_words<E>(q, low, divisor);
          return;
        }
      }
      for (std::size_t i = first; i < last; ++i, q += 2) *o++ = round_two_words<E>(q, low, divisor);
      return;
    }
    for (std::size_t i = first; i < last; ++i) {
      *o++ = rp::round_words<E>(q, w, divisor);
      q += words;
    }
  });
}
template <class E>
void read_digits(const std::int64_t* q, const std::vector<std::int32_t>& win, std::size_t from,
                 std::size_t to, std::uint32_t divisor, E* out) {
  read_digits(reduction::active_simd(), q, win, from, to, divisor, out);
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

/// Scratch a thread keeps across its reproducible calls: fresh digits on every call would cost
/// page faults and zeroing (8 bytes per element) that the collective itself does not. It keeps
/// the largest call's until the thread ends.
struct reproducible_scratch {
  std::vector<std::int32_t> win;
  std::vector<std::int64_t> codes;
  /// n words, uninitialized.
  [[nodiscard]] std::int64_t* words(std::size_t n) { return digits.at_least(n); }
  /// n floats, uninitialized.
  [[nodiscard]] float* floats(std::size_t n) { return terms.at_least(n); }

 private:
  /// An array that only grows: the old one is freed before the new one is allocated, so the
  /// largest call's scratch is held once.
  template <class T>
  struct growing {
    std::unique_ptr<T[]> data;
    std::size_t cap = 0;
    [[nodiscard]] T* at_least(std::size_t n) {
      if (n > cap) {
        data.reset();
        data = std::make_unique_for_overwrite<T[]>(n);
        cap = n;
      }
      return data.get();
    }
  };
  growing<std::int64_t> digits;
  growing<float> terms;
};

[[nodiscard]] inline reproducible_scratch& scratch_here() {
  thread_local reproducible_scratch s;
  return s;
}

template <class E>
[[nodiscard]] std::vector<E>& gathered_here() {
  thread_local std::vector<E> v;
  return v;
}

/// Which input element each output element of `d` sums, as the digits carry them: the one at the
/// same place (all_reduce, reduce, a scan: false), or the one at that place of this rank's block
/// (the input is size() blocks of the output, reduce_scatter: true). unsupported for any other
/// shape, before anything is sent.
[[nodiscard]] inline bool sums_one_block(const collective_descriptor& d) {
  if (d.in.size == extent::blocks && d.out.size == extent::one) return true;
  if (d.in.size == extent::one && d.out.size == extent::one) return false;
  throw unsupported(fmt::format(
      "{}: options::reproducible sums collectives whose output holds the input's elements or "
      "one size()-th of them",
      d.name));
}

/// The collectives the passes run, each a validated call of its own: `d`'s, on int64 digits or
/// codes (with the call's table), and built-in ones for the windows and gathered terms.
template <class Table, class T, element E>
void pass(communicator<T>& comm, const collective_descriptor& d, std::span<const E> in,
          std::span<E> out, op o, int root, const options& opt) {
  dispatch<Table>(
      comm,
      algorithms::call<E>{
          .kind = d.id, .in = in, .out = out, .reduction = o, .root = root, .described = &d},
      opt);
}

/// A float all_reduce or reduce_scatter with no algorithm forced and more than
/// tuning::thresholds::reproducible_gather_bytes_of<float>(size()) of gathered terms sends each
/// rank the terms of its block as they are (one all_to_all), sums them there in one pass
/// (gathered_float_sums) and, for all_reduce, gathers the sums (one all_gather): the plain call's
/// bytes (a ring all_reduce moves the same), where the digits would move twice as many and add a
/// window pass before and a rounding pass after. The exact sum rounded once is one value, so both
/// give the same bits (docs/performance.md, "Reproducible sums: the cost").
template <class T>
void run_reproducible_gathered(communicator<T>& comm, const algorithms::call<float>& c,
                               const options& aux, std::uint32_t divisor) {
  namespace bc = builtin_collectives;
  using builtin = algorithms::builtin;
  const auto ranks = static_cast<std::size_t>(comm.size());
  const auto me = static_cast<std::size_t>(comm.rank());
  reproducible_scratch& s = scratch_here();
  if (c.kind == collective::reduce_scatter) {
    const std::size_t count = c.out.size();
    float* t = s.floats(ranks * count);
    pass<builtin>(comm, bc::all_to_all, c.in, std::span<float>(t, ranks * count), op::sum, 0, aux);
    // In place, out is in's block rank(): the terms have left it.
    gathered_float_sums(reduction::active_simd(), t, count, ranks, count, divisor, c.out.data());
    return;
  }
  // all_reduce: block r of ceil(count / ranks) elements is rank r's to sum; a count that does
  // not divide goes through a copy padded with zeros, which add nothing.
  const std::size_t count = c.in.size();
  const std::size_t block = (count + ranks - 1) / ranks;
  const bool even = block * ranks == count;
  float* t = s.floats(ranks * block * (even ? 1 : 2));
  float* padded = even ? nullptr : t + ranks * block;
  if (!even) {
    std::copy(c.in.begin(), c.in.end(), padded);
    std::fill(padded + count, padded + ranks * block, 0.0f);
  }
  const std::span<const float> send = even ? c.in : std::span<const float>(padded, ranks * block);
  pass<builtin>(comm, bc::all_to_all, send, std::span<float>(t, ranks * block), op::sum, 0, aux);
  // The sums go where all_gather takes them in place: c.out's block (in place too, since the
  // terms have left c.in), or the padded copy's.
  float* sums = even ? c.out.data() : padded;
  gathered_float_sums(reduction::active_simd(), t, block, ranks, block, divisor, sums + me * block);
  pass<builtin>(comm, bc::all_gather, std::span<const float>(sums + me * block, block),
                std::span<float>(sums, ranks * block), op::sum, 0, aux);
  if (!even) std::copy(padded, padded + count, c.out.begin());
}

/// options::reproducible on host buffers, for any collective whose descriptor reduces and whose
/// output holds the input's elements (all_reduce, reduce, a scan) or one size()-th of them,
/// this rank's block (reduce_scatter): every output element is an exact sum of input elements at
/// one position, which is what the digits carry. The windows are agreed over every rank's whole
/// input, so they hold whichever ranks' terms the collective adds. all_reduce and reduce_scatter
/// have faster forms at the sizes where they pay.
template <class Table = algorithms::builtin, class T, class E>
void run_reproducible(communicator<T>& comm, const algorithms::call<E>& c, const options& opt) {
  namespace bc = builtin_collectives;
  using builtin = algorithms::builtin;
  const collective_descriptor& d = algorithms::describe(c);
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
                    d.name, rp::max_terms, n));
  const bool one_block = sums_one_block(d);
  const auto ranks = static_cast<std::size_t>(n);
  const bool automatic = opt.algorithm == algorithm::automatic;

  // Small all_reduce: gather the terms, sum them here.
  if (c.kind == collective::all_reduce && n > 1 && automatic &&
      c.in.size() * ranks * sizeof(E) <=
          tuning::thresholds::reproducible_gather_bytes_of<E>(ranks)) {
    const std::size_t count = c.in.size();
    std::vector<E>& all = gathered_here<E>();
    all.resize(count * ranks);
    pass<builtin>(comm, bc::all_gather, c.in, std::span<E>(all.data(), count * ranks), op::sum, 0,
                  aux);
    if constexpr (std::is_same_v<E, float>) {
      gathered_float_sums(reduction::active_simd(), all.data(), count, ranks, count, divisor,
                          c.out.data());
    } else {
      for (std::size_t i = 0; i < count; ++i)
        c.out[i] = gathered_sum(all.data() + i, count, ranks, divisor);
    }
    return;
  }

  if constexpr (std::is_same_v<E, float>) {
    if ((c.kind == collective::all_reduce || c.kind == collective::reduce_scatter) && n > 1 &&
        automatic)
      return run_reproducible_gathered(comm, c, aux, divisor);
  }

  reproducible_scratch& s = scratch_here();
  std::vector<std::int32_t>& win = s.win;
  local_windows(c.in, win);
  pass<builtin>(comm, bc::all_reduce, std::span<const std::int32_t>(win),
                std::span<std::int32_t>(win), op::max, 0, aux);
  const bool special = win.back() != 0;
  std::vector<std::int64_t>& codes = s.codes;
  if (special) special_codes(c.in, codes);

  if (one_block) {
    const std::size_t count = c.out.size();
    // Every rank's segment padded to the longest, so the blocks of the digits line up.
    std::size_t seg = 0;
    for (int r = 0; r < n; ++r)
      seg = std::max(seg, digits_between(win, static_cast<std::size_t>(r) * count,
                                         static_cast<std::size_t>(r + 1) * count));
    std::int64_t* q = s.words(seg * ranks + seg);
    std::int64_t* mine = q + seg * ranks;
    for (std::size_t r = 0; r < ranks; ++r) {
      const std::size_t used = digits_between(win, r * count, (r + 1) * count);
      write_digits(c.in, win, r * count, (r + 1) * count, q + r * seg);
      std::fill(q + r * seg + used, q + (r + 1) * seg, std::int64_t{0});
    }
    pass<Table>(comm, d, std::span<const std::int64_t>(q, seg * ranks),
                std::span<std::int64_t>(mine, seg), op::sum, c.root, inner);
    const std::size_t from = static_cast<std::size_t>(comm.rank()) * count;
    read_digits(mine, win, from, from + count, divisor, c.out.data());
    if (special) {
      std::vector<std::int64_t> mine_codes(count);
      pass<Table>(comm, d, std::span<const std::int64_t>(codes),
                  std::span<std::int64_t>(mine_codes), op::sum, c.root, inner);
      apply_specials(mine_codes.data(), count, c.out.data());
    }
    return;
  }

  // The digits and codes are summed in place, each in the call's collective.
  const std::size_t count = c.in.size();
  const std::size_t words = digits_between(win, 0, count);
  std::int64_t* q = s.words(words);
  write_digits(c.in, win, 0, count, q);
  pass<Table>(comm, d, std::span<const std::int64_t>(q, words), std::span<std::int64_t>(q, words),
              op::sum, c.root, inner);
  if (special)
    pass<Table>(comm, d, std::span<const std::int64_t>(codes), std::span<std::int64_t>(codes),
                op::sum, c.root, inner);
  if (!d.uses_out(comm.rank(), c.root)) return;
  read_digits(q, win, 0, count, divisor, c.out.data());
  if (special) apply_specials(codes.data(), count, c.out.data());
}

}  // namespace ringzero::detail
