// The AVX2 and AVX-512 loops behind reproducible::accumulator<float>::add, the hot loop of
// reproducible training (a float gradient added to its exact running sum, once per micro-batch).
//
// Each term is what the accumulator's scalar code makes of it: mant * 2^exp from the bit
// pattern (zero, infinity and NaN give mant 0), placed at bit `off = exp - base` of its block's
// digit grid, which lands it on digit off / 40 and, shifted by off % 40, possibly on the next
// one. A vector step does that for 8 or 16 terms at once; the scalar code runs the remainder, so
// the words are the scalar ones whatever the path (tests/core/reproducible_test.cpp compares
// them). Integer additions only: the result cannot depend on the path's order.
//
// Words are digit-major: digit j of element e at words[j * len + e], so each digit of a vector of
// elements is one contiguous load and store.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>

#include "ringzero/reduce/simd.hpp"

namespace ringzero::reproducible::detail {

/// off / 40 as (off * 1639) >> 16, exact for every off below this (checked below); a float block
/// spans at most 9 digits (277 bits of range and one for a carry), off < 360.
inline constexpr int max_offset = 1024;
constexpr bool div40_exact() {
  for (int off = 0; off < max_offset; ++off)
    if (((off * 1639) >> 16) != off / 40) return false;
  return true;
}
static_assert(div40_exact());

/// What a vector path did with a block's terms: how many it took (a multiple of its width; the
/// caller does the rest) and, over those, the lowest and highest bit of a nonzero finite term
/// (INT_MAX and INT_MIN when none) and whether any was an infinity or NaN.
struct narrow_range {
  std::size_t done = 0;
  int lo = INT_MAX;
  int hi = INT_MIN;
  bool special = false;
};

}  // namespace ringzero::reproducible::detail

#if RINGZERO_X86_SIMD

#include <immintrin.h>

#define RINGZERO_RP_AVX2_TARGET gnu::target("avx2")
#define RINGZERO_RP_AVX512_TARGET gnu::target("avx512f,avx512bw,avx512vl,avx512dq")
#define RINGZERO_RP_AVX2_INLINE [[RINGZERO_RP_AVX2_TARGET, gnu::always_inline]] inline
#define RINGZERO_RP_AVX512_INLINE [[RINGZERO_RP_AVX512_TARGET, gnu::always_inline]] inline

namespace ringzero::reproducible::detail::x86 {

/// A float's exponent bias plus its fraction bits: a term is mant * 2^(max(e, 1) - 150).
inline constexpr int float_bias = 150;

/// The smallest and largest of 8 int32 lanes.
RINGZERO_RP_AVX2_INLINE int reduce_min(__m256i v) noexcept {
  __m128i m = _mm_min_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_min_epi32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_min_epi32(m, _mm_shuffle_epi32(m, 0xb1));
  return _mm_cvtsi128_si32(m);
}
RINGZERO_RP_AVX2_INLINE int reduce_max(__m256i v) noexcept {
  __m128i m = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xb1));
  return _mm_cvtsi128_si32(m);
}

/// Calls fallback(i + lane) for each lane set in `lanes`, after leaving the vector state: the
/// fallback is the caller's scalar code.
template <class Fallback>
[[RINGZERO_RP_AVX2_TARGET]] inline void fallback_lanes(std::size_t i, unsigned lanes,
                                                       Fallback& fallback) {
  if (lanes != 0) _mm256_zeroupper();
  while (lanes != 0) {
    fallback(i + static_cast<std::size_t>(__builtin_ctz(lanes)));
    lanes &= lanes - 1;
  }
}

namespace avx512 {

// Every lane selected, for the zero-masked forms of the intrinsics whose plain forms GCC 12
// reports as reading an uninitialised vector (reduce/detail/x86.hpp says why).
inline constexpr __mmask16 all16 = 0xffff;
inline constexpr __mmask8 all8 = 0xff;

// The halves through the zero-masked extract, for the same reason: GCC 12's
// _mm512_extracti64x4_epi64 and _mm512_castsi512_si256 (and the _mm512_reduce_* built on them)
// are reported too, as -Wuninitialized (the low half costs an extract where the cast cost
// nothing).
RINGZERO_RP_AVX512_INLINE __m256i low_half(__m512i v) noexcept {
  return _mm512_maskz_extracti64x4_epi64(0xf, v, 0);
}
RINGZERO_RP_AVX512_INLINE __m256i high_half(__m512i v) noexcept {
  return _mm512_maskz_extracti64x4_epi64(0xf, v, 1);
}
RINGZERO_RP_AVX512_INLINE int reduce_min16(__m512i v) noexcept {
  return reduce_min(_mm256_min_epi32(low_half(v), high_half(v)));
}
RINGZERO_RP_AVX512_INLINE int reduce_max16(__m512i v) noexcept {
  return reduce_max(_mm256_max_epi32(low_half(v), high_half(v)));
}

/// mant and exp of 16 terms, and which are infinities or NaNs.
RINGZERO_RP_AVX512_INLINE void split(__m512i bits, __m512i& mant, __m512i& exp,
                                     __mmask16& special) noexcept {
  const __m512i e =
      _mm512_and_si512(_mm512_maskz_srli_epi32(all16, bits, 23), _mm512_set1_epi32(0xff));
  const __m512i f = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffff));
  special = _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(0xff));
  const __mmask16 normal = _mm512_cmpneq_epi32_mask(e, _mm512_setzero_si512());
  mant = _mm512_mask_or_epi32(f, normal, f, _mm512_set1_epi32(1 << 23));
  mant = _mm512_mask_mov_epi32(mant, special, _mm512_setzero_si512());
  exp = _mm512_sub_epi32(_mm512_maskz_max_epi32(all16, e, _mm512_set1_epi32(1)),
                         _mm512_set1_epi32(float_bias));
}

/// The bits the terms x[0, n) span, over whole vectors of 16.
[[RINGZERO_RP_AVX512_TARGET]] inline narrow_range range(const float* x, std::size_t n) noexcept {
  narrow_range r;
  __m512i lo = _mm512_set1_epi32(INT_MAX), hi = _mm512_set1_epi32(INT_MIN);
  __mmask16 special = 0;
  for (; r.done + 16 <= n; r.done += 16) {
    __m512i mant, exp;
    __mmask16 s;
    split(_mm512_loadu_si512(x + r.done), mant, exp, s);
    special |= s;
    const __mmask16 live = _mm512_test_epi32_mask(mant, mant);
    // The top bit of mant (< 2^24, so exact as a float) is its float's unbiased exponent.
    const __m512i top =
        _mm512_sub_epi32(_mm512_maskz_srli_epi32(
                             all16, _mm512_castps_si512(_mm512_maskz_cvtepi32_ps(all16, mant)), 23),
                         _mm512_set1_epi32(127));
    lo = _mm512_mask_min_epi32(lo, live, lo, exp);
    hi = _mm512_mask_max_epi32(hi, live, hi, _mm512_add_epi32(exp, top));
  }
  r.lo = reduce_min16(lo);
  r.hi = reduce_max16(hi);
  r.special = special != 0;
  _mm256_zeroupper();  // as reduce/detail/x86.hpp's loops, for the caller's SSE code
  return r;
}

/// 8 terms' digits (lo_part on digit d, hi_part on d + 1) added to words[j * len], j < k.
RINGZERO_RP_AVX512_INLINE void add8(__m512i d, __m512i lo_part, __m512i hi_part,
                                    std::int64_t* words, std::size_t len, int k) noexcept {
  for (int j = 0; j < k; ++j) {
    const __m512i jv = _mm512_set1_epi64(j);
    const __mmask8 on_lo = _mm512_cmpeq_epi64_mask(d, jv);
    const __mmask8 on_hi = _mm512_cmpeq_epi64_mask(_mm512_add_epi64(d, _mm512_set1_epi64(1)), jv);
    const __m512i add = _mm512_add_epi64(_mm512_maskz_mov_epi64(on_lo, lo_part),
                                         _mm512_maskz_mov_epi64(on_hi, hi_part));
    std::int64_t* w = words + static_cast<std::size_t>(j) * len;
    _mm512_storeu_si512(w, _mm512_add_epi64(_mm512_loadu_si512(w), add));
  }
}

/// 8 terms' parts: mant (zero-extended) shifted by r, cut at bit 40, signed by neg.
RINGZERO_RP_AVX512_INLINE void parts(__m256i mant, __m256i r, __mmask8 neg, __m512i& lo_part,
                                     __m512i& hi_part) noexcept {
  const __m512i v = _mm512_maskz_sllv_epi64(all8, _mm512_maskz_cvtepu32_epi64(all8, mant),
                                            _mm512_maskz_cvtepu32_epi64(all8, r));
  const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi64((std::int64_t{1} << 40) - 1));
  const __m512i hi = _mm512_maskz_srli_epi64(all8, v, 40);
  lo_part = _mm512_mask_sub_epi64(lo, neg, _mm512_setzero_si512(), lo);
  hi_part = _mm512_mask_sub_epi64(hi, neg, _mm512_setzero_si512(), hi);
}

/// Adds the terms x[0, n) to elements [0, n) of a block of `len` elements and k digits from
/// bit `base` (every nonzero term's bits lie in the block's digits). Whole vectors of 16 only;
/// returns how many it took.
[[RINGZERO_RP_AVX512_TARGET]] inline std::size_t add(const float* x, std::size_t n, int base, int k,
                                                     std::int64_t* words,
                                                     std::size_t len) noexcept {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i bits = _mm512_loadu_si512(x + i);
    __m512i mant, exp;
    __mmask16 special;
    split(bits, mant, exp, special);
    const __mmask16 live = _mm512_test_epi32_mask(mant, mant);
    const __m512i off = _mm512_maskz_sub_epi32(live, exp, _mm512_set1_epi32(base));
    const __m512i d =
        _mm512_maskz_srli_epi32(all16, _mm512_mullo_epi32(off, _mm512_set1_epi32(1639)), 16);
    const __m512i r = _mm512_sub_epi32(off, _mm512_mullo_epi32(d, _mm512_set1_epi32(40)));
    const __mmask16 neg = _mm512_movepi32_mask(bits);
    __m512i lo_part, hi_part;
    parts(low_half(mant), low_half(r), static_cast<__mmask8>(neg), lo_part, hi_part);
    add8(_mm512_maskz_cvtepu32_epi64(all8, low_half(d)), lo_part, hi_part, words + i, len, k);
    parts(high_half(mant), high_half(r), static_cast<__mmask8>(neg >> 8), lo_part, hi_part);
    add8(_mm512_maskz_cvtepu32_epi64(all8, high_half(d)), lo_part, hi_part, words + i + 8, len, k);
  }
  _mm256_zeroupper();
  return i;
}

// --- the passes of a reproducible collective on float (detail/reproducible_call.hpp) ---------

/// Bit width less one of each lane's mant (< 2^24, exact as a float): its float's exponent.
RINGZERO_RP_AVX512_INLINE __m512i top_bit(__m512i mant) noexcept {
  return _mm512_sub_epi32(
      _mm512_maskz_srli_epi32(all16, _mm512_castps_si512(_mm512_maskz_cvtepi32_ps(all16, mant)),
                              23),
      _mm512_set1_epi32(127));
}

/// The windows of the whole blocks of 64 in x[0, n) (window::add over each block's terms, as
/// local_windows stores them: top, then -low) into win; returns how many blocks, and sets
/// `special` where a term is an infinity or NaN.
[[RINGZERO_RP_AVX512_TARGET]] inline std::size_t windows(const float* x, std::size_t n,
                                                         std::int32_t* win, bool& special,
                                                         std::int32_t empty) noexcept {
  const std::size_t blocks = n / 64;
  __mmask16 any_special = 0;
  for (std::size_t b = 0; b < blocks; ++b) {
    __m512i top = _mm512_set1_epi32(INT_MIN), low = _mm512_set1_epi32(INT_MAX);
    for (std::size_t v = 0; v < 64; v += 16) {
      __m512i mant, exp;
      __mmask16 s;
      split(_mm512_loadu_si512(x + 64 * b + v), mant, exp, s);
      any_special |= s;
      const __mmask16 live = _mm512_test_epi32_mask(mant, mant);
      // The lowest set bit, isolated (mant & -mant), is a power of two: its exponent is the
      // count of trailing zeros.
      const __m512i lowest = _mm512_and_si512(mant, _mm512_sub_epi32(_mm512_setzero_si512(), mant));
      top = _mm512_mask_max_epi32(
          top, live, top,
          _mm512_add_epi32(_mm512_add_epi32(exp, top_bit(mant)), _mm512_set1_epi32(1)));
      low = _mm512_mask_min_epi32(low, live, low, _mm512_add_epi32(exp, top_bit(lowest)));
    }
    const int t = reduce_max16(top);
    const bool none = t == INT_MIN;
    win[2 * b] = none ? empty : t;
    win[2 * b + 1] = none ? empty : -reduce_min16(low);
  }
  special = special || any_special != 0;
  _mm256_zeroupper();
  return blocks;
}

/// 8 terms' one-digit values (detail::one_digit): mant shifted by exp - low, clamped to +-63,
/// signed.
RINGZERO_RP_AVX512_INLINE __m512i one_digit8(__m256i mant, __m256i shift, __mmask8 neg) noexcept {
  const __m512i m = _mm512_maskz_cvtepu32_epi64(all8, mant);
  const __m512i sh = _mm512_maskz_cvtepi32_epi64(all8, shift);
  const __mmask8 left = _mm512_cmpge_epi64_mask(sh, _mm512_setzero_si512());
  const __m512i v = _mm512_mask_sllv_epi64(
      _mm512_maskz_srlv_epi64(all8, m, _mm512_sub_epi64(_mm512_setzero_si512(), sh)), left, m, sh);
  return _mm512_mask_sub_epi64(v, neg, _mm512_setzero_si512(), v);
}

/// q[i] = one_digit(x[i], low) over whole vectors of 16 in x[0, n); returns how many.
[[RINGZERO_RP_AVX512_TARGET]] inline std::size_t one_digits(const float* x, std::size_t n, int low,
                                                            std::int64_t* q) noexcept {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i bits = _mm512_loadu_si512(x + i);
    __m512i mant, exp;
    __mmask16 special;
    split(bits, mant, exp, special);
    const __m512i shift = _mm512_maskz_min_epi32(
        all16,
        _mm512_maskz_max_epi32(all16, _mm512_sub_epi32(exp, _mm512_set1_epi32(low)),
                               _mm512_set1_epi32(-63)),
        _mm512_set1_epi32(63));
    const __mmask16 neg = _mm512_movepi32_mask(bits);
    _mm512_storeu_si512(q + i,
                        one_digit8(low_half(mant), low_half(shift), static_cast<__mmask8>(neg)));
    _mm512_storeu_si512(
        q + i + 8, one_digit8(high_half(mant), high_half(shift), static_cast<__mmask8>(neg >> 8)));
  }
  _mm256_zeroupper();
  return i;
}

/// out[i] = q[i] * 2^low rounded to the nearest float through the hardware's conversion, as
/// detail::round_int64_nearest does, 8 at a time over q[0, n); the caller rounds to nearest.
/// Lanes whose result would not be a normal number are left to `fallback(i)` (the general
/// rounding), called after the vector's store.
template <class Fallback>
[[RINGZERO_RP_AVX512_TARGET]] inline std::size_t round_nearest(const std::int64_t* q, std::size_t n,
                                                               int low, float* out,
                                                               Fallback&& fallback) {
  std::size_t i = 0;
  const __m256i low_v = _mm256_set1_epi32(low);
  const __m256i scale = _mm256_slli_epi32(low_v, 23);  // low in the exponent field, wrapping
  for (; i + 8 <= n; i += 8) {
    const __m512i s = _mm512_loadu_si512(q + i);
    const __mmask8 nonzero = _mm512_test_epi64_mask(s, s);
    const __m256i b = _mm256_castps_si256(_mm512_cvtepi64_ps(s));
    const __m256i biased = _mm256_add_epi32(
        _mm256_and_si256(_mm256_srli_epi32(b, 23), _mm256_set1_epi32(0xff)), low_v);
    const __mmask8 normal = _mm256_cmpge_epi32_mask(biased, _mm256_set1_epi32(1)) &
                            _mm256_cmple_epi32_mask(biased, _mm256_set1_epi32(254));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_maskz_add_epi32(nonzero, b, scale));
    fallback_lanes(i, static_cast<unsigned>(nonzero & static_cast<__mmask8>(~normal)), fallback);
  }
  _mm256_zeroupper();
  return i;
}

/// The lanes of 8 quotients, rounded to double, whose conversion to float could round a second
/// time the wrong way: a double on a midpoint between two normal floats (29 bits below a normal
/// float's last: 1 then 28 zeros), or a nonzero one below the normal range, whose floats have
/// other midpoints.
RINGZERO_RP_AVX512_INLINE __mmask8 twice_rounded(__m512d q) noexcept {
  const __m512i b = _mm512_castpd_si512(q);
  const __m512d a = _mm512_and_pd(q, _mm512_castsi512_pd(_mm512_set1_epi64(0x7fffffffffffffff)));
  return static_cast<__mmask8>(
      _mm512_cmpeq_epi64_mask(_mm512_and_si512(b, _mm512_set1_epi64(0x1fffffff)),
                              _mm512_set1_epi64(0x10000000)) |
      (_mm512_cmp_pd_mask(a, _mm512_set1_pd(0x1p-126), _CMP_LT_OQ) &
       _mm512_cmp_pd_mask(a, _mm512_setzero_pd(), _CMP_NEQ_OQ)));
}

/// out[i] = the nearest float to the sum of `ranks` terms t[r * stride + i] (divided by
/// `divisor`), 16 elements at a time over [0, n), as detail::gathered_float_sum does: the terms
/// added in double, which is exact where their exponents lie within `span` of each other, then
/// rounded once by the conversion; the caller has checked that the thread rounds to nearest and
/// keeps subnormals. Infinities and NaN give IEEE addition's answer. Lanes that need more (a
/// wider span, an average that lands on a float's midpoint or below the normal range) are left
/// to `fallback(i)`, called after the vector's store.
template <class Fallback>
[[RINGZERO_RP_AVX512_TARGET]] inline std::size_t gathered_sums(const float* t, std::size_t stride,
                                                               std::size_t ranks, std::size_t n,
                                                               int span, std::uint32_t divisor,
                                                               float* out, Fallback&& fallback) {
  const bool divide = divisor > 1;
  // Dividing an exact double by a power of two is exact: only other divisors round twice.
  const bool twice = divide && (divisor & (divisor - 1)) != 0;
  const __m512d div = _mm512_set1_pd(static_cast<double>(divisor));
  std::size_t i = 0;
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  for (; i + 16 <= n; i += 16) {
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    // The largest and the smallest nonzero magnitude among each element's terms, as bits: for
    // floats of one sign the integer order is the numbers' order, and infinities and NaNs come
    // above every finite one. Their exponents, worked out once after the loop, give the span.
    __m512i top = _mm512_setzero_si512(), bottom = magnitude;
    for (std::size_t r = 0; r < ranks; ++r) {
      const float* p = t + r * stride + i;
      const __m512i bits = _mm512_loadu_si512(p);
      const __m512i m = _mm512_and_si512(bits, magnitude);
      top = _mm512_maskz_max_epu32(all16, top, m);
      bottom = _mm512_mask_min_epu32(bottom, _mm512_test_epi32_mask(m, m), bottom, m);
      lo = _mm512_add_pd(lo, _mm512_maskz_cvtps_pd(all8, _mm256_loadu_ps(p)));
      hi = _mm512_add_pd(hi, _mm512_maskz_cvtps_pd(all8, _mm256_loadu_ps(p + 8)));
    }
    // Exponent fields, a subnormal's as 1 (its bits are placed as exponent field 1's).
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i e_top =
        _mm512_maskz_max_epi32(all16, _mm512_maskz_srli_epi32(all16, top, 23), one);
    const __m512i e_bottom =
        _mm512_maskz_max_epi32(all16, _mm512_maskz_srli_epi32(all16, bottom, 23), one);
    // Infinities and NaN, rare: each rank's terms are looked at again only where one occurs.
    const __mmask16 special = _mm512_cmpeq_epi32_mask(e_top, _mm512_set1_epi32(0xff));
    __mmask16 nan = 0, pos_inf = 0, neg_inf = 0;
    if (special != 0) {
      for (std::size_t r = 0; r < ranks; ++r) {
        const __m512i bits = _mm512_loadu_si512(t + r * stride + i);
        const __mmask16 e_special = _mm512_cmpeq_epi32_mask(
            _mm512_and_si512(bits, _mm512_set1_epi32(0x7f800000)), _mm512_set1_epi32(0x7f800000));
        const __mmask16 fraction = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x7fffff));
        const __mmask16 negative = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(INT_MIN));
        nan |= e_special & fraction;
        pos_inf |= e_special & static_cast<__mmask16>(~fraction & ~negative);
        neg_inf |= e_special & static_cast<__mmask16>(~fraction & negative);
      }
    }
    // An element without a nonzero term has exponents 1 and 255: within any span, sum +0.
    __mmask16 ok =
        static_cast<__mmask16>(~special & _mm512_cmple_epi32_mask(_mm512_sub_epi32(e_top, e_bottom),
                                                                  _mm512_set1_epi32(span)));
    if (divide) {
      lo = _mm512_div_pd(lo, div);
      hi = _mm512_div_pd(hi, div);
      if (twice) {
        // The quotient was rounded to double: converting it rounds again, which gives the
        // nearest float unless the double landed on a midpoint.
        const auto bad16 = static_cast<__mmask16>(twice_rounded(lo) |
                                                  (static_cast<unsigned>(twice_rounded(hi)) << 8));
        ok = static_cast<__mmask16>(ok & ~bad16);
      }
    }
    // An exact zero is +0 (x + -x is +0 in double too, but -0 + -0 is not).
    const __m256 flo = _mm512_maskz_cvtpd_ps(all8, lo), fhi = _mm512_maskz_cvtpd_ps(all8, hi);
    const __mmask8 ok_lo = static_cast<__mmask8>(ok), ok_hi = static_cast<__mmask8>(ok >> 8);
    const __mmask8 nz_lo = _mm256_cmp_ps_mask(flo, _mm256_setzero_ps(), _CMP_NEQ_UQ);
    const __mmask8 nz_hi = _mm256_cmp_ps_mask(fhi, _mm256_setzero_ps(), _CMP_NEQ_UQ);
    _mm256_mask_storeu_ps(out + i, ok_lo, _mm256_maskz_mov_ps(nz_lo, flo));
    _mm256_mask_storeu_ps(out + i + 8, ok_hi, _mm256_maskz_mov_ps(nz_hi, fhi));
    // IEEE addition's answer where a term was an infinity or NaN: NaN for any NaN or for
    // infinities of both signs (reproducible::quiet_nan's bits, whatever the NaNs held), else
    // the infinity.
    if (special != 0) {
      const auto make_nan = static_cast<__mmask16>(nan | (pos_inf & neg_inf));
      __m512i v = _mm512_mask_mov_epi32(_mm512_set1_epi32(0x7f800000), neg_inf,
                                        _mm512_set1_epi32(static_cast<int>(0xff800000u)));
      v = _mm512_mask_mov_epi32(v, make_nan, _mm512_set1_epi32(0x7fc00000));
      _mm512_mask_storeu_epi32(out + i, special, v);
    }
    // The special lanes are done: only the others that failed the test fall back.
    fallback_lanes(i, static_cast<unsigned>(static_cast<__mmask16>(~(ok | special))), fallback);
  }
  _mm256_zeroupper();
  return i;
}

/// out[i] = the nearest float to (a[i] + b[i]) / (halve ? 2 : 1), 8 elements at a time over
/// [0, n): gathered_sums for two terms, without its exponent test. The sum of two floats rounded
/// to double, then to float, is their sum rounded once (a double's 53 bits are more than twice
/// a float's 24 plus one, which makes the second rounding innocuous), halving in double is exact,
/// and a sum that lands below the normal range was exact in double already: every lane is
/// right, so none falls back. Infinities come out of the addition as IEEE gives them; a NaN
/// takes reproducible::quiet_nan's bits and a zero is +0, as in gathered_sums. The caller has
/// checked that the thread rounds to nearest and keeps subnormals.
[[RINGZERO_RP_AVX512_TARGET]] inline std::size_t gathered_pair_sums(const float* a, const float* b,
                                                                    std::size_t n, bool halve,
                                                                    float* out) noexcept {
  const __m512d scale = _mm512_set1_pd(halve ? 0.5 : 1.0);
  const __m256 quiet_nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m512d s =
        _mm512_mul_pd(_mm512_add_pd(_mm512_maskz_cvtps_pd(all8, _mm256_loadu_ps(a + i)),
                                    _mm512_maskz_cvtps_pd(all8, _mm256_loadu_ps(b + i))),
                      scale);
    const __m256 f = _mm512_maskz_cvtpd_ps(all8, s);
    const __mmask8 nonzero = _mm256_cmp_ps_mask(f, _mm256_setzero_ps(), _CMP_NEQ_UQ);
    const __mmask8 nan = _mm256_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    _mm256_storeu_ps(out + i, _mm256_mask_mov_ps(_mm256_maskz_mov_ps(nonzero, f), nan, quiet_nan));
  }
  _mm256_zeroupper();
  return i;
}

}  // namespace avx512

namespace avx2 {

/// mant and exp of 8 terms, and a mask of the infinities and NaNs.
RINGZERO_RP_AVX2_INLINE void split(__m256i bits, __m256i& mant, __m256i& exp,
                                   __m256i& special) noexcept {
  const __m256i e = _mm256_and_si256(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(0xff));
  const __m256i f = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffff));
  special = _mm256_cmpeq_epi32(e, _mm256_set1_epi32(0xff));
  const __m256i subnormal = _mm256_cmpeq_epi32(e, _mm256_setzero_si256());
  mant = _mm256_or_si256(f, _mm256_andnot_si256(subnormal, _mm256_set1_epi32(1 << 23)));
  mant = _mm256_andnot_si256(special, mant);
  exp = _mm256_sub_epi32(_mm256_max_epi32(e, _mm256_set1_epi32(1)), _mm256_set1_epi32(float_bias));
}

[[RINGZERO_RP_AVX2_TARGET]] inline narrow_range range(const float* x, std::size_t n) noexcept {
  narrow_range r;
  __m256i lo = _mm256_set1_epi32(INT_MAX), hi = _mm256_set1_epi32(INT_MIN);
  __m256i special = _mm256_setzero_si256();
  for (; r.done + 8 <= n; r.done += 8) {
    __m256i mant, exp, s;
    split(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r.done)), mant, exp, s);
    special = _mm256_or_si256(special, s);
    const __m256i dead = _mm256_cmpeq_epi32(mant, _mm256_setzero_si256());
    const __m256i top =
        _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(mant)), 23),
                         _mm256_set1_epi32(127));
    lo = _mm256_min_epi32(lo, _mm256_blendv_epi8(exp, _mm256_set1_epi32(INT_MAX), dead));
    hi = _mm256_max_epi32(
        hi, _mm256_blendv_epi8(_mm256_add_epi32(exp, top), _mm256_set1_epi32(INT_MIN), dead));
  }
  r.lo = reduce_min(lo);
  r.hi = reduce_max(hi);
  r.special = _mm256_testz_si256(special, special) == 0;
  _mm256_zeroupper();
  return r;
}

/// 4 terms' parts (see avx512::parts); neg: all ones in a negative term's 64-bit lane.
RINGZERO_RP_AVX2_INLINE void parts(__m128i mant, __m128i r, __m128i sign, __m256i& lo_part,
                                   __m256i& hi_part) noexcept {
  const __m256i v = _mm256_sllv_epi64(_mm256_cvtepu32_epi64(mant), _mm256_cvtepu32_epi64(r));
  const __m256i neg = _mm256_cvtepi32_epi64(sign);
  const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi64x((std::int64_t{1} << 40) - 1));
  const __m256i hi = _mm256_srli_epi64(v, 40);
  lo_part = _mm256_sub_epi64(_mm256_xor_si256(lo, neg), neg);
  hi_part = _mm256_sub_epi64(_mm256_xor_si256(hi, neg), neg);
}

RINGZERO_RP_AVX2_INLINE void add4(__m256i d, __m256i lo_part, __m256i hi_part, std::int64_t* words,
                                  std::size_t len, int k) noexcept {
  for (int j = 0; j < k; ++j) {
    const __m256i jv = _mm256_set1_epi64x(j);
    const __m256i on_lo = _mm256_cmpeq_epi64(d, jv);
    const __m256i on_hi = _mm256_cmpeq_epi64(_mm256_add_epi64(d, _mm256_set1_epi64x(1)), jv);
    const __m256i add =
        _mm256_add_epi64(_mm256_and_si256(on_lo, lo_part), _mm256_and_si256(on_hi, hi_part));
    auto* w = reinterpret_cast<__m256i*>(words + static_cast<std::size_t>(j) * len);
    _mm256_storeu_si256(w, _mm256_add_epi64(_mm256_loadu_si256(w), add));
  }
}

[[RINGZERO_RP_AVX2_TARGET]] inline std::size_t add(const float* x, std::size_t n, int base, int k,
                                                   std::int64_t* words, std::size_t len) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    __m256i mant, exp, special;
    split(bits, mant, exp, special);
    const __m256i live =
        _mm256_xor_si256(_mm256_cmpeq_epi32(mant, _mm256_setzero_si256()), _mm256_set1_epi32(-1));
    const __m256i off = _mm256_and_si256(live, _mm256_sub_epi32(exp, _mm256_set1_epi32(base)));
    const __m256i d = _mm256_srli_epi32(_mm256_mullo_epi32(off, _mm256_set1_epi32(1639)), 16);
    const __m256i r = _mm256_sub_epi32(off, _mm256_mullo_epi32(d, _mm256_set1_epi32(40)));
    const __m256i sign = _mm256_srai_epi32(bits, 31);
    __m256i lo_part, hi_part;
    parts(_mm256_castsi256_si128(mant), _mm256_castsi256_si128(r), _mm256_castsi256_si128(sign),
          lo_part, hi_part);
    add4(_mm256_cvtepu32_epi64(_mm256_castsi256_si128(d)), lo_part, hi_part, words + i, len, k);
    parts(_mm256_extracti128_si256(mant, 1), _mm256_extracti128_si256(r, 1),
          _mm256_extracti128_si256(sign, 1), lo_part, hi_part);
    add4(_mm256_cvtepu32_epi64(_mm256_extracti128_si256(d, 1)), lo_part, hi_part, words + i + 4,
         len, k);
  }
  _mm256_zeroupper();
  return i;
}

/// avx512::twice_rounded for 4 quotients, as the low 4 bits of an int.
RINGZERO_RP_AVX2_INLINE int twice_rounded(__m256d q) noexcept {
  const __m256i b = _mm256_castpd_si256(q);
  const __m256d a = _mm256_and_pd(q, _mm256_castsi256_pd(_mm256_set1_epi64x(INT64_MAX)));
  const __m256i mid = _mm256_cmpeq_epi64(_mm256_and_si256(b, _mm256_set1_epi64x(0x1fffffff)),
                                         _mm256_set1_epi64x(0x10000000));
  const __m256d small = _mm256_and_pd(_mm256_cmp_pd(a, _mm256_set1_pd(0x1p-126), _CMP_LT_OQ),
                                      _mm256_cmp_pd(a, _mm256_setzero_pd(), _CMP_NEQ_OQ));
  return _mm256_movemask_pd(_mm256_or_pd(_mm256_castsi256_pd(mid), small));
}

/// avx512::gathered_sums, 8 elements at a time: the same test of each lane, the same fallback,
/// the same bits.
template <class Fallback>
[[RINGZERO_RP_AVX2_TARGET]] inline std::size_t gathered_sums(const float* t, std::size_t stride,
                                                             std::size_t ranks, std::size_t n,
                                                             int span, std::uint32_t divisor,
                                                             float* out, Fallback&& fallback) {
  const bool divide = divisor > 1;
  const bool twice = divide && (divisor & (divisor - 1)) != 0;
  const __m256d div = _mm256_set1_pd(static_cast<double>(divisor));
  const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    // As avx512::gathered_sums: the largest and the smallest nonzero magnitude as bits, their
    // exponents worked out once after the loop (a zero term becomes the largest magnitude, so
    // the minimum passes over it).
    __m256i top = _mm256_setzero_si256(), bottom = magnitude;
    for (std::size_t r = 0; r < ranks; ++r) {
      const float* p = t + r * stride + i;
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i m = _mm256_and_si256(bits, magnitude);
      top = _mm256_max_epu32(top, m);
      const __m256i zero = _mm256_cmpeq_epi32(m, _mm256_setzero_si256());
      bottom = _mm256_min_epu32(bottom, _mm256_or_si256(m, _mm256_and_si256(zero, magnitude)));
      const __m256 x = _mm256_castsi256_ps(bits);
      lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
      hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
    }
    // Exponent fields, a subnormal's as 1.
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i e_top = _mm256_max_epi32(_mm256_srli_epi32(top, 23), one);
    const __m256i e_bottom = _mm256_max_epi32(_mm256_srli_epi32(bottom, 23), one);
    // Infinities and NaN, rare: each rank's terms are looked at again only where one occurs.
    __m256i nan = _mm256_setzero_si256(), pos_inf = nan, neg_inf = nan;
    if (_mm256_movemask_ps(
            _mm256_castsi256_ps(_mm256_cmpeq_epi32(e_top, _mm256_set1_epi32(0xff)))) != 0) {
      const __m256i ones = _mm256_set1_epi32(-1);
      for (std::size_t r = 0; r < ranks; ++r) {
        const __m256i bits =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + r * stride + i));
        const __m256i special = _mm256_cmpeq_epi32(
            _mm256_and_si256(bits, _mm256_set1_epi32(0x7f800000)), _mm256_set1_epi32(0x7f800000));
        const __m256i fraction =
            _mm256_xor_si256(_mm256_cmpeq_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffff)),
                                                _mm256_setzero_si256()),
                             ones);
        const __m256i negative = _mm256_srai_epi32(bits, 31);
        nan = _mm256_or_si256(nan, _mm256_and_si256(special, fraction));
        const __m256i inf = _mm256_andnot_si256(fraction, special);
        pos_inf = _mm256_or_si256(pos_inf, _mm256_andnot_si256(negative, inf));
        neg_inf = _mm256_or_si256(neg_inf, _mm256_and_si256(negative, inf));
      }
    }
    const __m256i special = _mm256_or_si256(nan, _mm256_or_si256(pos_inf, neg_inf));
    const int special_bits = _mm256_movemask_ps(_mm256_castsi256_ps(special));
    int ok_bits = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(
                      _mm256_set1_epi32(span + 1), _mm256_sub_epi32(e_top, e_bottom)))) &
                  ~special_bits;
    if (divide) {
      lo = _mm256_div_pd(lo, div);
      hi = _mm256_div_pd(hi, div);
      if (twice) ok_bits &= ~(twice_rounded(lo) | (twice_rounded(hi) << 4));
    }
    __m256 f =
        _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(lo)), _mm256_cvtpd_ps(hi), 1);
    f = _mm256_and_ps(f, _mm256_cmp_ps(f, _mm256_setzero_ps(), _CMP_NEQ_UQ));  // +0 for zero
    const __m256i make_nan = _mm256_or_si256(nan, _mm256_and_si256(pos_inf, neg_inf));
    __m256i v = _mm256_blendv_epi8(_mm256_set1_epi32(0x7f800000),
                                   _mm256_set1_epi32(static_cast<int>(0xff800000u)), neg_inf);
    v = _mm256_blendv_epi8(v, _mm256_set1_epi32(0x7fc00000), make_nan);
    f = _mm256_blendv_ps(f, _mm256_castsi256_ps(v), _mm256_castsi256_ps(special));
    const __m256i store = _mm256_cmpeq_epi32(
        _mm256_and_si256(_mm256_set1_epi32(ok_bits | special_bits), lane_bits), lane_bits);
    _mm256_maskstore_ps(out + i, store, f);
    fallback_lanes(i, static_cast<unsigned>(~(ok_bits | special_bits)) & 0xffu, fallback);
  }
  _mm256_zeroupper();
  return i;
}

/// avx512::gathered_pair_sums, 4 elements at a time: the same bits.
[[RINGZERO_RP_AVX2_TARGET]] inline std::size_t gathered_pair_sums(const float* a, const float* b,
                                                                  std::size_t n, bool halve,
                                                                  float* out) noexcept {
  const __m256d scale = _mm256_set1_pd(halve ? 0.5 : 1.0);
  const __m128 quiet_nan = _mm_castsi128_ps(_mm_set1_epi32(0x7fc00000));
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d s = _mm256_mul_pd(
        _mm256_add_pd(_mm256_cvtps_pd(_mm_loadu_ps(a + i)), _mm256_cvtps_pd(_mm_loadu_ps(b + i))),
        scale);
    __m128 f = _mm256_cvtpd_ps(s);
    f = _mm_and_ps(f, _mm_cmpneq_ps(f, _mm_setzero_ps()));  // +0 for zero; NaN stays
    _mm_storeu_ps(out + i, _mm_blendv_ps(f, quiet_nan, _mm_cmpunord_ps(f, f)));
  }
  _mm256_zeroupper();
  return i;
}

}  // namespace avx2

}  // namespace ringzero::reproducible::detail::x86

#undef RINGZERO_RP_AVX2_TARGET
#undef RINGZERO_RP_AVX512_TARGET
#undef RINGZERO_RP_AVX2_INLINE
#undef RINGZERO_RP_AVX512_INLINE

#endif  // RINGZERO_X86_SIMD
