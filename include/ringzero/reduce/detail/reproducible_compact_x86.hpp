// The AVX-512 loops behind reproducible::compact_accumulator<float>::add's common case (a
// compact block of 64 terms, no infinity or NaN, room in its words): the block's range, the
// shift to a lower base bit and the adds, 16 terms or 8 words at a time. They
// compute what the scalar code computes from the same bit fields (the words are the same,
// tests/core/reproducible_compact_test.cpp compares them), with integer operations only.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>

#include "ringzero/reduce/detail/reproducible_x86.hpp"

#if RINGZERO_X86_SIMD

#include <immintrin.h>

#define RINGZERO_RP_AVX512_TARGET gnu::target("avx512f,avx512bw,avx512vl,avx512dq")
#define RINGZERO_RP_AVX512_INLINE [[RINGZERO_RP_AVX512_TARGET, gnu::always_inline]] inline

namespace ringzero::reproducible::detail::x86::avx512 {

/// What 64 terms span: the lowest set bit and one past the highest of the nonzero finite ones
/// (INT_MAX and INT_MIN when none), and whether one is an infinity or NaN.
struct block_range {
  int lo = INT_MAX;
  int top = INT_MIN;
  bool special = false;
};

[[RINGZERO_RP_AVX512_TARGET]] inline block_range range64(const float* x) noexcept {
  __m512i top = _mm512_set1_epi32(INT_MIN), low = _mm512_set1_epi32(INT_MAX);
  __mmask16 special = 0;
  for (std::size_t v = 0; v < 64; v += 16) {
    __m512i mant, exp;
    __mmask16 s;
    split(_mm512_loadu_si512(x + v), mant, exp, s);
    special |= s;
    const __mmask16 live = _mm512_test_epi32_mask(mant, mant);
    // The lowest set bit, isolated (mant & -mant), is a power of two: its exponent is the count
    // of trailing zeros.
    const __m512i lowest = _mm512_and_si512(mant, _mm512_sub_epi32(_mm512_setzero_si512(), mant));
    top = _mm512_mask_max_epi32(
        top, live, top,
        _mm512_add_epi32(_mm512_add_epi32(exp, top_bit(mant)), _mm512_set1_epi32(1)));
    low = _mm512_mask_min_epi32(low, live, low, _mm512_add_epi32(exp, top_bit(lowest)));
  }
  block_range r;
  r.lo = reduce_min16(low);
  r.top = reduce_max16(top);
  r.special = special != 0;
  _mm256_zeroupper();
  return r;
}

/// w[0, 64) times 2^shift (the caller made room).
[[RINGZERO_RP_AVX512_TARGET]] inline void shift64(std::int64_t* w, int shift) noexcept {
  const __m512i s = _mm512_set1_epi64(shift);
  for (std::size_t v = 0; v < 64; v += 8)
    _mm512_storeu_si512(w + v, _mm512_maskz_sllv_epi64(all8, _mm512_loadu_si512(w + v), s));
  _mm256_zeroupper();
}

/// 8 terms (mant zero-extended, its shift from `lo`) added to or subtracted from w[0, 8).
RINGZERO_RP_AVX512_INLINE void add_words8(std::int64_t* w, __m256i mant, __m256i shift,
                                          __mmask8 neg) noexcept {
  const __m512i m = _mm512_maskz_cvtepu32_epi64(all8, mant);
  const __m512i s = _mm512_maskz_cvtepi32_epi64(all8, shift);
  const __m512i zero = _mm512_setzero_si512();
  // A term below lo has as many trailing zeros: shifting it right is exact.
  const __m512i right = _mm512_maskz_max_epi64(all8, _mm512_sub_epi64(zero, s), zero);
  const __m512i left = _mm512_maskz_max_epi64(all8, s, zero);
  const __m512i v = _mm512_maskz_sllv_epi64(all8, _mm512_maskz_srlv_epi64(all8, m, right), left);
  const __m512i x = _mm512_loadu_si512(w);
  _mm512_storeu_si512(w, _mm512_mask_sub_epi64(_mm512_add_epi64(x, v), neg, x, v));
}

/// The 64 terms x[0, 64) added to w[0, 64) in units of 2^lo (lo at most every nonzero term's
/// lowest set bit; zeros add nothing).
[[RINGZERO_RP_AVX512_TARGET]] inline void add64(const float* x, int lo, std::int64_t* w) noexcept {
  for (std::size_t v = 0; v < 64; v += 16) {
    const __m512i bits = _mm512_loadu_si512(x + v);
    __m512i mant, exp;
    __mmask16 special;
    split(bits, mant, exp, special);
    const __m512i shift = _mm512_sub_epi32(exp, _mm512_set1_epi32(lo));
    const __mmask16 neg = _mm512_movepi32_mask(bits);
    add_words8(w + v, low_half(mant), low_half(shift), static_cast<__mmask8>(neg));
    add_words8(w + v + 8, high_half(mant), high_half(shift), static_cast<__mmask8>(neg >> 8));
  }
  _mm256_zeroupper();
}

}  // namespace ringzero::reproducible::detail::x86::avx512

#undef RINGZERO_RP_AVX512_TARGET
#undef RINGZERO_RP_AVX512_INLINE

#endif  // RINGZERO_X86_SIMD
