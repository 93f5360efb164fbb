// The exact sum behind options::reproducible: every term is an integer multiple of a power of
// two, so a floating-point sum can be carried as an integer, added exactly, and rounded once.
//
// A reproducible call has three passes:
//   1. window: each rank describes every block of `block_elems` consecutive elements by the
//      highest and lowest bit any of its terms there has (`window`), and the ranks reduce these
//      descriptions with max, which is exact;
//   2. digits: each term becomes `words(w)` signed 40-bit digits of its value in units of the
//      block's lowest bit, and the ranks add the digits as int64 -- integer addition is exact,
//      associative and commutative, so every algorithm, chunking, world size and arrival order
//      gives the same words (23 bits of headroom: up to 2^23 terms per element);
//   3. round: the words are one exact integer, rounded once to the element type
//      (`round_words`), correctly: the result is the representable value nearest the exact sum
//      of the terms (ties to even), so it depends on nothing but the terms.
// Windows wider than `max_words` digits (only double has them: 2,098 bits of range) keep the top
// `max_words * digit_bits` bits and truncate below, which stays reproducible and bounds the
// error by the number of terms times 2^(top - 320).
//
// Infinities and NaNs carry no digits: a rank that holds one sets the window's `special` flag,
// and the call then adds per-element counts of +inf, -inf and NaN (`special_code`) so each
// element comes back as IEEE addition would give it.
//
// Everything per element is integer arithmetic on the bit patterns, __host__ __device__ under
// nvcc (RINGZERO_HD, kernels/element.hpp), so the CUDA kernels and the host agree bit for bit.
#pragma once

#include <algorithm>
#include <bit>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ringzero/kernels/element.hpp"
#include "ringzero/types.hpp"

namespace ringzero::reproducible {

/// Bits per digit; the other 23 bits of an int64 are the headroom for adding terms.
inline constexpr int digit_bits = 40;
/// Terms one element may add (across ranks, and across micro-batches in training).
inline constexpr std::int64_t max_terms = std::int64_t{1} << (63 - digit_bits);
/// Elements that share one window. A window costs 8 bytes; 64 floats are 256.
inline constexpr std::size_t block_elems = 64;
/// Digits per element at most: 320 bits, every float, bfloat16 and float16 sum exactly.
inline constexpr int max_words = 8;
/// The window of a block with no nonzero finite term.
inline constexpr std::int32_t empty = INT32_MIN / 2;

/// The layout of a floating element type: precision p (with the implicit bit), the exponent of
/// the smallest normal (emin) and of the largest finite (emax), as IEEE 754 names them.
template <class T>
struct format;
template <>
struct format<float> {
  using bits = std::uint32_t;
  static constexpr int p = 24, emin = -126, emax = 127, exp_bits = 8;
};
template <>
struct format<double> {
  using bits = std::uint64_t;
  static constexpr int p = 53, emin = -1022, emax = 1023, exp_bits = 11;
};
template <>
struct format<float16> {
  using bits = std::uint16_t;
  static constexpr int p = 11, emin = -14, emax = 15, exp_bits = 5;
};
template <>
struct format<bfloat16> {
  using bits = std::uint16_t;
  static constexpr int p = 8, emin = -126, emax = 127, exp_bits = 8;
};

template <class T>
inline constexpr bool supported_v = std::is_same_v<T, float> || std::is_same_v<T, double> ||
                                    std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>;

enum class kind : std::uint8_t { zero, finite, pos_inf, neg_inf, nan };

/// A term as sign * mant * 2^exp, exactly.
struct term {
  bool neg = false;
  kind k = kind::zero;
  std::uint64_t mant = 0;
  int exp = 0;
};

// A GCC, Clang and nvcc extension, on host and device alike.
__extension__ using u128 = unsigned __int128;

/// Bit tricks spelled for both sides: nvcc's device code has intrinsics, not <bit>.
RINGZERO_HD inline int bit_width64(std::uint64_t v) noexcept {
#if defined(__CUDA_ARCH__)
  return 64 - __clzll(static_cast<long long>(v));
#else
  return static_cast<int>(std::bit_width(v));
#endif
}
RINGZERO_HD inline int low_zeros64(std::uint64_t v) noexcept {  // v != 0
#if defined(__CUDA_ARCH__)
  return __ffsll(static_cast<long long>(v)) - 1;
#else
  return std::countr_zero(v);
#endif
}
RINGZERO_HD inline int bit_width128(u128 v) noexcept {
  const auto hi = static_cast<std::uint64_t>(v >> 64);
  return hi != 0 ? 64 + bit_width64(hi) : bit_width64(static_cast<std::uint64_t>(v));
}
RINGZERO_HD constexpr int max_int(int a, int b) noexcept {
  return a > b ? a : b;
}

template <class T>
RINGZERO_HD inline typename format<T>::bits bits_of(T x) noexcept {
  if constexpr (std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>) {
    return x.bits;
  } else if constexpr (std::is_same_v<T, float>) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(x);
#else
    return std::bit_cast<std::uint32_t>(x);
#endif
  } else {
#if defined(__CUDA_ARCH__)
    return static_cast<std::uint64_t>(__double_as_longlong(x));
#else
    return std::bit_cast<std::uint64_t>(x);
#endif
  }
}

template <class T>
RINGZERO_HD inline T from_bits(typename format<T>::bits b) noexcept {
  if constexpr (std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>) {
    T r{};  // not T::from_bits: a host function, which device code cannot call
    r.bits = b;
    return r;
  } else if constexpr (std::is_same_v<T, float>) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(b);
#else
    return std::bit_cast<float>(b);
#endif
  } else {
#if defined(__CUDA_ARCH__)
    return __longlong_as_double(static_cast<long long>(b));
#else
    return std::bit_cast<double>(b);
#endif
  }
}

template <class T>
RINGZERO_HD inline term decompose(T x) noexcept {
  using F = format<T>;
  constexpr int frac_bits = F::p - 1;
  constexpr int bias = F::emax;
  const auto b = static_cast<std::uint64_t>(bits_of(x));
  const int width = 1 + F::exp_bits + frac_bits;
  term t;
  t.neg = ((b >> (width - 1)) & 1u) != 0;
  const auto e = static_cast<int>((b >> frac_bits) & ((1u << F::exp_bits) - 1));
  const std::uint64_t f = b & ((std::uint64_t{1} << frac_bits) - 1);
  if (e == (1 << F::exp_bits) - 1) {
    t.k = f != 0 ? kind::nan : (t.neg ? kind::neg_inf : kind::pos_inf);
    return t;
  }
  if (e == 0 && f == 0) return t;
  t.k = kind::finite;
  t.mant = e == 0 ? f : (f | (std::uint64_t{1} << frac_bits));
  t.exp = (e == 0 ? 1 : e) - bias - frac_bits;
  return t;
}

/// A block's description: the sum's bits lie in [low, top) (top = one past the highest bit of
/// any term, low = the lowest set bit of any term), both as powers of two. Stored as `top` and
/// `-low` so that one elementwise max over the ranks combines two windows.
struct window {
  std::int32_t top = empty;
  std::int32_t neg_low = empty;
  [[nodiscard]] RINGZERO_HD inline bool is_empty() const noexcept { return top == empty; }
  [[nodiscard]] RINGZERO_HD inline int low() const noexcept {
    // Past max_words digits the lowest bits are given up (see the header comment).
    return max_int(-neg_low, top - max_words * digit_bits);
  }
  RINGZERO_HD inline void add(const term& t) noexcept {
    if (t.k != kind::finite) return;
    const int hi = t.exp + bit_width64(t.mant);
    const int lo = t.exp + low_zeros64(t.mant);
    top = max_int(top, hi);
    neg_low = max_int(neg_low, -lo);
  }
  RINGZERO_HD inline void merge(const window& o) noexcept {
    top = max_int(top, o.top);
    neg_low = max_int(neg_low, o.neg_low);
  }
};

/// Digits per element for a block with window w.
[[nodiscard]] RINGZERO_HD inline int words(const window& w) noexcept {
  if (w.is_empty()) return 0;
  const int span = w.top - w.low();
  return (span + digit_bits - 1) / digit_bits;
}

/// Digit k of t's magnitude in units of 2^low: bits [40k, 40k+40) of mant * 2^(exp-low), bits
/// below 2^low dropped (only when the window was cut at max_words).
[[nodiscard]] RINGZERO_HD inline std::int64_t digit(const term& t, int low, int k) noexcept {
  constexpr std::uint64_t mask = (std::uint64_t{1} << digit_bits) - 1;
  if (t.k != kind::finite) return 0;
  const int from = digit_bits * k - (t.exp - low);  // bit of mant that lands on the digit's bit 0
  std::uint64_t d = 0;
  if (from >= 64 || from <= -digit_bits)
    d = 0;
  else if (from >= 0)
    d = (t.mant >> from) & mask;
  else
    d = (t.mant << -from) & mask;
  const auto v = static_cast<std::int64_t>(d);
  return t.neg ? -v : v;
}

/// Writes t's digits for a block with window w (words(w) of them).
RINGZERO_HD inline void to_words(const term& t, const window& w, std::int64_t* out) noexcept {
  const int n = words(w), low = w.low();
  for (int k = 0; k < n; ++k) out[k] = digit(t, low, k);
}

/// The count of each kind of non-finite term, packed so that adding codes adds the counts.
[[nodiscard]] RINGZERO_HD inline std::int64_t special_code(const term& t) noexcept {
  switch (t.k) {
    case kind::nan:
      return std::int64_t{1} << 42;
    case kind::pos_inf:
      return std::int64_t{1} << 21;
    case kind::neg_inf:
      return 1;
    default:
      return 0;
  }
}

template <class T>
RINGZERO_HD inline T quiet_nan() noexcept {
  using F = format<T>;
  constexpr int frac_bits = F::p - 1;
  using B = typename F::bits;
  const auto all = static_cast<B>(((std::uint64_t{1} << F::exp_bits) - 1) << frac_bits);
  return from_bits<T>(static_cast<B>(all | (B{1} << (frac_bits - 1))));
}

template <class T>
RINGZERO_HD inline T infinity(bool neg) noexcept {
  using F = format<T>;
  constexpr int frac_bits = F::p - 1;
  using B = typename F::bits;
  const auto all = static_cast<B>(((std::uint64_t{1} << F::exp_bits) - 1) << frac_bits);
  const auto sign = static_cast<B>(neg ? (std::uint64_t{1} << (F::exp_bits + frac_bits)) : 0);
  return from_bits<T>(static_cast<B>(all | sign));
}

/// What the counts of a summed special_code make of an element: IEEE addition's answer, or
/// false when every term was finite.
template <class T>
RINGZERO_HD inline bool special_result(std::int64_t code, T& out) noexcept {
  if (code == 0) return false;
  constexpr std::int64_t m = (std::int64_t{1} << 21) - 1;
  const std::int64_t nans = code >> 42, pos = (code >> 21) & m, neg = code & m;
  out = (nans > 0 || (pos > 0 && neg > 0)) ? quiet_nan<T>() : infinity<T>(neg > 0);
  return true;
}

/// sign * (a * 2^x + something in (0, 2^x) if sticky) rounded to T to nearest, ties to even;
/// divided first by `divisor` (avg) with the same single rounding. a must hold at least p + 2
/// bits whenever sticky is set (round_words makes sure).
template <class T>
RINGZERO_HD inline T round_to(bool neg, u128 a, int x, bool sticky,
                              std::uint32_t divisor = 1) noexcept {
  using F = format<T>;
  using B = typename F::bits;
  constexpr int frac_bits = F::p - 1;
  constexpr int width = 1 + F::exp_bits + frac_bits;
  const B sign = neg ? static_cast<B>(B{1} << (width - 1)) : B{0};
  if (a == 0) return from_bits<T>(sign);
  if (divisor > 1) {
    // Scale a up to 128 bits so the quotient keeps 100+ bits; the remainder joins sticky.
    const int up = 128 - bit_width128(a);
    a <<= up;
    x -= up;
    const u128 q = a / divisor;
    sticky = sticky || (a - q * divisor) != 0;
    a = q;
  }
  const int len = bit_width128(a);
  const int lead_pos = len - 1 + x;  // a * 2^x lies in [2^lead_pos, 2^(lead_pos+1))
  // Bits the result keeps: p for a normal result; fewer below the smallest normal.
  int keep = F::p;
  if (lead_pos < F::emin) keep = F::p - (F::emin - lead_pos);
  const int drop = len - keep;
  std::uint64_t mant = 0;
  int mant_x = x;  // the result is mant * 2^mant_x
  if (drop <= 0) {
    mant = static_cast<std::uint64_t>(a) << -drop;  // exact: len <= keep <= p bits
    mant_x = x + drop;
  } else {
    const bool half = drop <= 128 && ((a >> (drop - 1)) & 1) != 0;
    const bool below =
        sticky ||
        (drop >= 2 && (drop - 1 >= 128 ? a != 0 : (a & ((u128{1} << (drop - 1)) - 1)) != 0));
    mant = drop >= 128 ? 0 : static_cast<std::uint64_t>(a >> drop);
    mant_x = x + drop;
    if (half && (below || (mant & 1u) != 0)) ++mant;
  }
  if (mant == 0) return from_bits<T>(sign);
  // Normalize to the field layout: a rounding carry may have added a bit.
  const int mlen = bit_width64(mant);
  const int e = mlen - 1 + mant_x;
  if (e > F::emax) return infinity<T>(neg);
  if (e < F::emin) {
    // Subnormal: mant is in units of 2^(emin - frac_bits) already.
    return from_bits<T>(static_cast<B>(sign | static_cast<B>(mant)));
  }
  if (mlen > F::p) {
    mant >>= (mlen - F::p);  // the bits shifted out are zero (a carry made them)
  } else if (mlen < F::p) {
    mant <<= (F::p - mlen);
  }
  const auto biased = static_cast<B>(e + F::emax);
  const auto frac = static_cast<B>(mant & ((std::uint64_t{1} << frac_bits) - 1));
  return from_bits<T>(static_cast<B>(sign | static_cast<B>(biased << frac_bits) | frac));
}

/// The words of one element (summed over every term) as the nearest T, divided by `divisor`
/// first for avg. n = words(w).
template <class T>
RINGZERO_HD inline T round_words(const std::int64_t* w, const window& win,
                                 std::uint32_t divisor = 1) noexcept {
  const int n = words(win);
  if (n == 0) return from_bits<T>(0);
  // Carry the words into n digits in [0, 2^40) and a signed top.
  constexpr std::int64_t radix = std::int64_t{1} << digit_bits;
  std::uint64_t d[max_words + 1] = {};
  std::int64_t carry = 0;
  for (int k = 0; k < n; ++k) {
    const std::int64_t s = w[k] + carry;  // |w| < 2^63 - 2^40: no overflow with the carry
    const std::int64_t lo = s & (radix - 1);
    carry = (s - lo) >> digit_bits;
    d[k] = static_cast<std::uint64_t>(lo);
  }
  bool neg = carry < 0;
  if (neg) {
    // magnitude = -(carry * 2^(40n) + digits) = (-carry) * 2^(40n) - digits
    std::int64_t borrow = 0;
    for (int k = 0; k < n; ++k) {
      std::int64_t v = -static_cast<std::int64_t>(d[k]) - borrow;
      borrow = 0;
      if (v < 0) {
        v += radix;
        borrow = 1;
      }
      d[k] = static_cast<std::uint64_t>(v);
    }
    carry = -carry - borrow;
  }
  d[n] = static_cast<std::uint64_t>(carry);  // < 2^23
  int top = n;
  while (top >= 0 && d[top] == 0) --top;
  if (top < 0) return from_bits<T>(0);
  // The top digits into a: at least 88 bits whenever lower digits remain, the rest as sticky.
  u128 a = 0;
  int k = top;
  int bits = 0;
  for (; k >= 0 && bits < 88; --k) {
    a = (a << digit_bits) | d[k];
    bits = bits == 0 ? bit_width64(d[k]) : bits + digit_bits;
  }
  bool sticky = false;
  for (int j = k; j >= 0; --j) sticky = sticky || d[j] != 0;
  return round_to<T>(neg, a, win.low() + (k + 1) * digit_bits, sticky, divisor);
}

// --- the layout of a call's digits ----------------------------------------------------------

/// How many blocks of block_elems elements n elements make (the last may be shorter).
RINGZERO_HD constexpr std::size_t blocks(std::size_t n) noexcept {
  return (n + block_elems - 1) / block_elems;
}

/// Block b's window in a call's windows array (2 int32 per block, the inf/NaN flag last).
RINGZERO_HD inline window window_at(const std::int32_t* win, std::size_t b) noexcept {
  return window{win[2 * b], win[2 * b + 1]};
}

/// Where element i's digits start when blocks lie one after another, each element's
/// words(window) digits in turn: off[b] is where block b starts (an exclusive prefix sum of
/// len(b) * words(b), computed once the windows are agreed).
RINGZERO_HD inline std::uint64_t digit_position(const std::int32_t* win, const std::uint64_t* off,
                                                std::size_t i) noexcept {
  const std::size_t b = i / block_elems;
  return off[b] + (i - b * block_elems) * static_cast<std::uint64_t>(words(window_at(win, b)));
}

/// Block b's share of a call's digits (of n elements): its length times its window's words;
/// the exclusive prefix sum of these over the blocks is `off`.
RINGZERO_HD inline std::uint64_t block_digits(const std::int32_t* win, std::size_t n,
                                              std::size_t b) noexcept {
  const std::size_t len = (b + 1) * block_elems < n ? block_elems : n - b * block_elems;
  return len * static_cast<std::uint64_t>(words(window_at(win, b)));
}

/// digit_position for i in [0, n], where n (one past the last element) is the total: the
/// bounds of a range of elements, as a reduce_scatter's segments need them.
RINGZERO_HD inline std::uint64_t range_position(const std::int32_t* win, const std::uint64_t* off,
                                                std::size_t n, std::size_t i) noexcept {
  // At i == n with n a whole number of blocks, digit_position would read a window past the last.
  return i == n ? off[blocks(n)] : digit_position(win, off, i);
}

/// Where element i's digits go in a reduce_scatter's input: rank r's elements [r*count,
/// (r+1)*count) in segment r, `seg` words each (the longest rank's digits; all_reduce and reduce
/// pass seg = 0: one segment).
RINGZERO_HD inline std::uint64_t segment_position(const std::int32_t* win, const std::uint64_t* off,
                                                  std::size_t i, std::size_t count,
                                                  std::size_t seg) noexcept {
  if (seg == 0) return digit_position(win, off, i);
  const std::size_t r = i / count;
  return r * seg + digit_position(win, off, i) - digit_position(win, off, r * count);
}

// --- the per-element steps of a call, as the kernels and the host stand-ins run them --------

/// Block b of in[0, n): its window, and whether it holds an infinity or NaN.
template <class T>
RINGZERO_HD inline window block_window(const T* in, std::size_t n, std::size_t b,
                                       bool& special) noexcept {
  window w;
  const std::size_t end = (b + 1) * block_elems < n ? (b + 1) * block_elems : n;
  for (std::size_t i = b * block_elems; i < end; ++i) {
    const term t = decompose(in[i]);
    w.add(t);
    special = special || (t.k != kind::finite && t.k != kind::zero);
  }
  return w;
}

/// Element i's digits into q at segment_position.
template <class T>
RINGZERO_HD inline void element_digits(const T* in, std::size_t i, const std::int32_t* win,
                                       const std::uint64_t* off, std::size_t count, std::size_t seg,
                                       std::int64_t* q) noexcept {
  to_words(decompose(in[i]), window_at(win, i / block_elems),
           q + segment_position(win, off, i, count, seg));
}

/// Element i (of a range that starts at `from`) rounded from q, which holds the range's digits.
template <class T>
RINGZERO_HD inline T element_round(const std::int64_t* q, const std::int32_t* win,
                                   const std::uint64_t* off, std::size_t from, std::size_t i,
                                   std::uint32_t divisor) noexcept {
  const std::uint64_t at = digit_position(win, off, i) - digit_position(win, off, from);
  return round_words<T>(q + at, window_at(win, i / block_elems), divisor);
}

// --- serial reference: what every rank must end with -----------------------------------------

/// The reproducible sum of `terms` (one element), as the collective computes it, for tests and
/// ringzero-perf's check. windows and words over a one-element block.
template <class T>
[[nodiscard]] inline T serial_sum(const T* terms, std::size_t n, std::uint32_t divisor = 1) {
  window w;
  std::int64_t special = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const term t = decompose(terms[i]);
    w.add(t);
    special += special_code(t);
  }
  T out{};
  if (special_result(special, out)) return out;
  std::int64_t acc[max_words] = {};
  std::int64_t tmp[max_words] = {};
  for (std::size_t i = 0; i < n; ++i) {
    to_words(decompose(terms[i]), w, tmp);
    for (int k = 0; k < words(w); ++k) acc[k] += tmp[k];
  }
  return round_words<T>(acc, w, divisor);
}

}  // namespace ringzero::reproducible
