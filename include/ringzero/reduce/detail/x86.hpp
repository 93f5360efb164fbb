// The AVX2 and AVX-512 loops behind reduction::combine and finish_avg (reduce/cpu.hpp). Each
// vector step computes exactly what kernels::combine computes for each of its elements, so the
// result does not depend on the path:
//  - sum/prod: a NaN result takes the first NaN operand's payload (kernels::propagate_nan),
//    whichever operand order the compiler gave the commutative instruction;
//  - min/max: x86's minps/maxps return their SECOND operand on ties and NaN, so min(a, b) is
//    _mm_min(b, a) (= b < a ? b : a); the 16-bit floats compare in float and select the stored
//    bits, which keeps a signalling NaN operand as it was, as the scalar code does;
//  - no multiply feeds an add, so nothing can be contracted into an FMA, whatever -ffp-contract
//    and -march say;
//  - float16 converts with F16C under round-to-nearest-even: exact widening, and narrowing that
//    matches types.hpp for every value incl. NaN (quiet, top payload bits kept). bfloat16 narrows
//    with the integer round-to-nearest-even of types.hpp rather than AVX512-BF16's vcvtneps2bf16,
//    which flushes float denormals to zero where the scalar conversion rounds them;
//  - integers wrap; the 8-bit and 64-bit products, which x86 has no instruction for (before
//    AVX512-DQ for 64-bit), are built from 16-bit and 32x32->64-bit multiplies.
// The remainder of a count that does not fill a vector runs through kernels::combine.
#pragma once

#include "ringzero/reduce/simd.hpp"

#if RINGZERO_X86_SIMD

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ringzero/kernels/reduce.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

// Every helper is inlined into a loop compiled for the same target: intrinsics need their target
// enabled in the function they end up in.
#define RINGZERO_AVX2_TARGET gnu::target("avx2,f16c")
#define RINGZERO_AVX512_TARGET gnu::target("avx512f,avx512bw,avx512vl,avx512dq,f16c")
#define RINGZERO_AVX2_INLINE [[RINGZERO_AVX2_TARGET, gnu::always_inline]] inline
#define RINGZERO_AVX512_INLINE [[RINGZERO_AVX512_TARGET, gnu::always_inline]] inline

// Leaving a vector loop: each loop ends with vzeroupper. With the upper halves of the vector
// registers left dirty, every legacy-SSE instruction the caller runs afterwards (the baseline
// x86-64 code around ringzero, libm's scalar paths) pays a merge penalty. GCC emits vzeroupper
// itself only with -fexpensive-optimizations (-O2 and up); at -O1 the missing one made the
// floating-point code after a reproducible training step several times slower.
namespace ringzero::reduction::detail::x86 {

template <op O>
inline constexpr bool is_sum = O == op::sum || O == op::avg;

// ---------------------------------------------------------------------------------------------
// AVX2: 256-bit vectors.

namespace avx2 {

// kernels::propagate_nan per lane; the blends run only for a vector that holds a NaN.
RINGZERO_AVX2_INLINE __m256 propagate_nan(__m256 r, __m256 a, __m256 b) noexcept {
  const __m256 r_nan = _mm256_cmp_ps(r, r, _CMP_UNORD_Q);
  if (_mm256_testz_ps(r_nan, r_nan)) return r;
  const __m256 quiet = _mm256_castsi256_ps(_mm256_set1_epi32(0x400000));
  r = _mm256_blendv_ps(r, _mm256_or_ps(b, quiet), _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
  return _mm256_blendv_ps(r, _mm256_or_ps(a, quiet), _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}
RINGZERO_AVX2_INLINE __m256d propagate_nan(__m256d r, __m256d a, __m256d b) noexcept {
  const __m256d r_nan = _mm256_cmp_pd(r, r, _CMP_UNORD_Q);
  if (_mm256_testz_pd(r_nan, r_nan)) return r;
  const __m256d quiet = _mm256_castsi256_pd(_mm256_set1_epi64x(0x8000000000000ll));
  r = _mm256_blendv_pd(r, _mm256_or_pd(b, quiet), _mm256_cmp_pd(b, b, _CMP_UNORD_Q));
  return _mm256_blendv_pd(r, _mm256_or_pd(a, quiet), _mm256_cmp_pd(a, a, _CMP_UNORD_Q));
}

template <op O>
RINGZERO_AVX2_INLINE __m256 fop(__m256 a, __m256 b) noexcept {
  if constexpr (is_sum<O>)
    return propagate_nan(_mm256_add_ps(a, b), a, b);
  else if constexpr (O == op::prod)
    return propagate_nan(_mm256_mul_ps(a, b), a, b);
  else if constexpr (O == op::min)
    return _mm256_min_ps(b, a);
  else
    return _mm256_max_ps(b, a);
}

template <op O>
RINGZERO_AVX2_INLINE __m256d fop(__m256d a, __m256d b) noexcept {
  if constexpr (is_sum<O>)
    return propagate_nan(_mm256_add_pd(a, b), a, b);
  else if constexpr (O == op::prod)
    return propagate_nan(_mm256_mul_pd(a, b), a, b);
  else if constexpr (O == op::min)
    return _mm256_min_pd(b, a);
  else
    return _mm256_max_pd(b, a);
}

RINGZERO_AVX2_INLINE __m256 widen(__m128i h, float16) noexcept {
  return _mm256_cvtph_ps(h);
}
RINGZERO_AVX2_INLINE __m256 widen(__m128i h, bfloat16) noexcept {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
RINGZERO_AVX2_INLINE __m128i narrow(__m256 f, float16) noexcept {
  return _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT);
}
/// f rounded to bfloat16 as types.hpp does (nearest-even; a NaN quietened), in the high 16 bits
/// of each 32-bit lane.
RINGZERO_AVX2_INLINE __m256i round_high(__m256 f) noexcept {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i rounded =
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                       _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
  return _mm256_blendv_epi8(rounded, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)),
                            _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
}
RINGZERO_AVX2_INLINE __m128i narrow(__m256 f, bfloat16) noexcept {
  const __m256i r = _mm256_srli_epi32(round_high(f), 16);
  // Every lane holds 0..0xffff, so the saturating pack is a plain narrowing.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <op O, class T>
RINGZERO_AVX2_INLINE __m256i iop(__m256i a, __m256i b) noexcept {
  constexpr bool is_signed = std::is_signed_v<T>;
  if constexpr (sizeof(T) == 1) {
    if constexpr (is_sum<O>) {
      return _mm256_add_epi8(a, b);
    } else if constexpr (O == op::prod) {
      // The low byte of a 16-bit product depends only on the operands' low bytes.
      const __m256i even = _mm256_mullo_epi16(a, b);
      const __m256i odd = _mm256_mullo_epi16(_mm256_srli_epi16(a, 8), _mm256_srli_epi16(b, 8));
      return _mm256_or_si256(_mm256_and_si256(even, _mm256_set1_epi16(0xff)),
                             _mm256_slli_epi16(odd, 8));
    } else if constexpr (O == op::min) {
      return is_signed ? _mm256_min_epi8(a, b) : _mm256_min_epu8(a, b);
    } else {
      return is_signed ? _mm256_max_epi8(a, b) : _mm256_max_epu8(a, b);
    }
  } else if constexpr (sizeof(T) == 4) {
    if constexpr (is_sum<O>)
      return _mm256_add_epi32(a, b);
    else if constexpr (O == op::prod)
      return _mm256_mullo_epi32(a, b);
    else if constexpr (O == op::min)
      return is_signed ? _mm256_min_epi32(a, b) : _mm256_min_epu32(a, b);
    else
      return is_signed ? _mm256_max_epi32(a, b) : _mm256_max_epu32(a, b);
  } else {
    if constexpr (is_sum<O>) {
      return _mm256_add_epi64(a, b);
    } else if constexpr (O == op::prod) {
      // lo(a) lo(b) + ((hi(a) lo(b) + lo(a) hi(b)) << 32), modulo 2^64.
      const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b),
                                             _mm256_mul_epu32(a, _mm256_srli_epi64(b, 32)));
      return _mm256_add_epi64(_mm256_mul_epu32(a, b), _mm256_slli_epi64(cross, 32));
    } else {
      // Only a signed 64-bit compare exists: unsigned values compare as signed once their top
      // bits are flipped.
      const __m256i bias = _mm256_set1_epi64x(is_signed ? 0 : INT64_MIN);
      const __m256i x = _mm256_xor_si256(a, bias), y = _mm256_xor_si256(b, bias);
      const __m256i take_b = O == op::min ? _mm256_cmpgt_epi64(x, y) : _mm256_cmpgt_epi64(y, x);
      return _mm256_blendv_epi8(a, b, take_b);
    }
  }
}

/// bfloat16 sum and product without shuffles: a 32-bit lane holds two elements, and each is a
/// float once the other's bits are cleared (the even one after a shift).
template <op O>
RINGZERO_AVX2_INLINE __m256i bf16_pairs(__m256i a, __m256i b) noexcept {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256i e =
      _mm256_srli_epi32(round_high(fop<O>(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                                          _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)))),
                        16);
  const __m256i o = round_high(fop<O>(_mm256_castsi256_ps(_mm256_and_si256(a, high)),
                                      _mm256_castsi256_ps(_mm256_and_si256(b, high))));
  return _mm256_blend_epi16(e, o, 0xaa);
}

template <op O, class T>
RINGZERO_AVX2_INLINE void step(const T* a, const T* b, T* out) noexcept {
  if constexpr (std::is_same_v<T, bfloat16> && (is_sum<O> || O == op::prod)) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        bf16_pairs<O>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)),
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))));
  } else if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(out, fop<O>(_mm256_loadu_ps(a), _mm256_loadu_ps(b)));
  } else if constexpr (std::is_same_v<T, double>) {
    _mm256_storeu_pd(out, fop<O>(_mm256_loadu_pd(a), _mm256_loadu_pd(b)));
  } else if constexpr (kernels::is_16bit_float_v<T>) {
    const __m128i ha = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
    const __m128i hb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    const __m256 x = widen(ha, T{}), y = widen(hb, T{});
    __m128i r;
    if constexpr (is_sum<O> || O == op::prod) {
      r = narrow(fop<O>(x, y), T{});
    } else {
      const __m256 take_b =
          O == op::min ? _mm256_cmp_ps(y, x, _CMP_LT_OQ) : _mm256_cmp_ps(x, y, _CMP_LT_OQ);
      const __m256i m = _mm256_castps_si256(take_b);
      r = _mm_blendv_epi8(
          ha, hb, _mm_packs_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1)));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), r);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        iop<O, T>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)),
                                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))));
  }
}

template <class T>
RINGZERO_AVX2_INLINE void divide(T* p, int ranks) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(p,
                     _mm256_div_ps(_mm256_loadu_ps(p), _mm256_set1_ps(static_cast<float>(ranks))));
  } else if constexpr (std::is_same_v<T, double>) {
    _mm256_storeu_pd(p,
                     _mm256_div_pd(_mm256_loadu_pd(p), _mm256_set1_pd(static_cast<double>(ranks))));
  } else {
    auto* v = reinterpret_cast<__m128i*>(p);
    _mm_storeu_si128(v, narrow(_mm256_div_ps(widen(_mm_loadu_si128(v), T{}),
                                             _mm256_set1_ps(static_cast<float>(ranks))),
                               T{}));
  }
}

/// Elements one step handles: a 256-bit vector of T, or 8 16-bit floats (8 floats wide).
template <class T>
inline constexpr std::size_t lanes = kernels::is_16bit_float_v<T> ? 8 : 32 / sizeof(T);
/// The same for combine with op O (bfloat16 sums and products take a 256-bit vector).
template <op O, class T>
inline constexpr std::size_t combine_lanes = std::is_same_v<T, bfloat16> &&
                                                     (is_sum<O> || O == op::prod)
                                                 ? 16
                                                 : lanes<T>;

template <op O, class T>
[[RINGZERO_AVX2_TARGET]] void combine(const T* a, const T* b, T* out, std::size_t n) noexcept {
  constexpr std::size_t w = combine_lanes<O, T>;
  std::size_t i = 0;
  for (; i + w <= n; i += w) step<O, T>(a + i, b + i, out + i);
  for (; i < n; ++i) out[i] = kernels::combine<O>(a[i], b[i]);
  _mm256_zeroupper();  // see "Leaving a vector loop" above
}

template <class T>
[[RINGZERO_AVX2_TARGET]] void finish_avg(T* p, std::size_t n, int ranks) noexcept {
  std::size_t i = 0;
  for (; i + lanes<T> <= n; i += lanes<T>) divide(p + i, ranks);
  for (; i < n; ++i) p[i] = kernels::finish_avg(p[i], ranks);
  _mm256_zeroupper();
}

}  // namespace avx2

// ---------------------------------------------------------------------------------------------
// AVX-512: 512-bit vectors and mask registers.

namespace avx512 {

// Every lane selected. GCC 12's plain forms of several intrinsics (shifts, min/max, the
// conversions) start from a self-initialised "undefined" vector that -Wmaybe-uninitialized
// reports once they are inlined (a false positive, GCC bug 105593), and a `#pragma GCC
// diagnostic` around them is lost when the header is precompiled (tests/CMakeLists.txt). Their
// zero-masked forms start from zero and, with every lane selected, compile to the same unmasked
// instruction, so this code needs no pragma in any build.
inline constexpr __mmask16 all16 = 0xffff;
inline constexpr __mmask8 all8 = 0xff;

// kernels::propagate_nan per lane; the blends run only for a vector that holds a NaN.
RINGZERO_AVX512_INLINE __m512 propagate_nan(__m512 r, __m512 a, __m512 b) noexcept {
  if (_mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q) == 0) return r;
  const __m512i quiet = _mm512_set1_epi32(0x400000);
  __m512i x = _mm512_castps_si512(r);
  x = _mm512_mask_or_epi32(x, _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q), _mm512_castps_si512(b),
                           quiet);
  x = _mm512_mask_or_epi32(x, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_castps_si512(a),
                           quiet);
  return _mm512_castsi512_ps(x);
}
RINGZERO_AVX512_INLINE __m512d propagate_nan(__m512d r, __m512d a, __m512d b) noexcept {
  if (_mm512_cmp_pd_mask(r, r, _CMP_UNORD_Q) == 0) return r;
  const __m512i quiet = _mm512_set1_epi64(0x8000000000000ll);
  __m512i x = _mm512_castpd_si512(r);
  x = _mm512_mask_or_epi64(x, _mm512_cmp_pd_mask(b, b, _CMP_UNORD_Q), _mm512_castpd_si512(b),
                           quiet);
  x = _mm512_mask_or_epi64(x, _mm512_cmp_pd_mask(a, a, _CMP_UNORD_Q), _mm512_castpd_si512(a),
                           quiet);
  return _mm512_castsi512_pd(x);
}

template <op O>
RINGZERO_AVX512_INLINE __m512 fop(__m512 a, __m512 b) noexcept {
  if constexpr (is_sum<O>)
    return propagate_nan(_mm512_add_ps(a, b), a, b);
  else if constexpr (O == op::prod)
    return propagate_nan(_mm512_mul_ps(a, b), a, b);
  else if constexpr (O == op::min)
    return _mm512_maskz_min_ps(all16, b, a);
  else
    return _mm512_maskz_max_ps(all16, b, a);
}

template <op O>
RINGZERO_AVX512_INLINE __m512d fop(__m512d a, __m512d b) noexcept {
  if constexpr (is_sum<O>)
    return propagate_nan(_mm512_add_pd(a, b), a, b);
  else if constexpr (O == op::prod)
    return propagate_nan(_mm512_mul_pd(a, b), a, b);
  else if constexpr (O == op::min)
    return _mm512_maskz_min_pd(all8, b, a);
  else
    return _mm512_maskz_max_pd(all8, b, a);
}

RINGZERO_AVX512_INLINE __m512 widen(__m256i h, float16) noexcept {
  return _mm512_maskz_cvtph_ps(all16, h);
}
RINGZERO_AVX512_INLINE __m512 widen(__m256i h, bfloat16) noexcept {
  return _mm512_castsi512_ps(
      _mm512_maskz_slli_epi32(all16, _mm512_maskz_cvtepu16_epi32(all16, h), 16));
}
RINGZERO_AVX512_INLINE __m256i narrow(__m512 f, float16) noexcept {
  return _mm512_maskz_cvtps_ph(all16, f, _MM_FROUND_TO_NEAREST_INT);
}
/// f rounded to bfloat16 as types.hpp does (nearest-even; a NaN quietened), in the high 16 bits
/// of each 32-bit lane.
RINGZERO_AVX512_INLINE __m512i round_high(__m512 f) noexcept {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i rounded = _mm512_add_epi32(
      _mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
      _mm512_and_si512(_mm512_maskz_srli_epi32(all16, u, 16), _mm512_set1_epi32(1)));
  return _mm512_mask_or_epi32(rounded, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), u,
                              _mm512_set1_epi32(0x400000));
}
RINGZERO_AVX512_INLINE __m256i narrow(__m512 f, bfloat16) noexcept {
  return _mm512_maskz_cvtepi32_epi16(all16, _mm512_maskz_srli_epi32(all16, round_high(f), 16));
}

template <op O, class T>
RINGZERO_AVX512_INLINE __m512i iop(__m512i a, __m512i b) noexcept {
  constexpr bool is_signed = std::is_signed_v<T>;
  if constexpr (sizeof(T) == 1) {
    if constexpr (is_sum<O>) {
      return _mm512_add_epi8(a, b);
    } else if constexpr (O == op::prod) {
      const __m512i even = _mm512_mullo_epi16(a, b);
      const __m512i odd = _mm512_mullo_epi16(_mm512_srli_epi16(a, 8), _mm512_srli_epi16(b, 8));
      return _mm512_or_si512(_mm512_and_si512(even, _mm512_set1_epi16(0xff)),
                             _mm512_slli_epi16(odd, 8));
    } else if constexpr (O == op::min) {
      return is_signed ? _mm512_min_epi8(a, b) : _mm512_min_epu8(a, b);
    } else {
      return is_signed ? _mm512_max_epi8(a, b) : _mm512_max_epu8(a, b);
    }
  } else if constexpr (sizeof(T) == 4) {
    if constexpr (is_sum<O>)
      return _mm512_add_epi32(a, b);
    else if constexpr (O == op::prod)
      return _mm512_mullo_epi32(a, b);
    else if constexpr (O == op::min)
      return is_signed ? _mm512_maskz_min_epi32(all16, a, b) : _mm512_maskz_min_epu32(all16, a, b);
    else
      return is_signed ? _mm512_maskz_max_epi32(all16, a, b) : _mm512_maskz_max_epu32(all16, a, b);
  } else {
    if constexpr (is_sum<O>)
      return _mm512_add_epi64(a, b);
    else if constexpr (O == op::prod)
      return _mm512_mullo_epi64(a, b);
    else if constexpr (O == op::min)
      return is_signed ? _mm512_maskz_min_epi64(all8, a, b) : _mm512_maskz_min_epu64(all8, a, b);
    else
      return is_signed ? _mm512_maskz_max_epi64(all8, a, b) : _mm512_maskz_max_epu64(all8, a, b);
  }
}

/// bfloat16 sum and product without shuffles: a 32-bit lane holds two elements, and each is a
/// float once the other's bits are cleared (the even one after a shift).
template <op O>
RINGZERO_AVX512_INLINE __m512i bf16_pairs(__m512i a, __m512i b) noexcept {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __m512i e = _mm512_maskz_srli_epi32(
      all16,
      round_high(fop<O>(_mm512_castsi512_ps(_mm512_maskz_slli_epi32(all16, a, 16)),
                        _mm512_castsi512_ps(_mm512_maskz_slli_epi32(all16, b, 16)))),
      16);
  const __m512i o = round_high(fop<O>(_mm512_castsi512_ps(_mm512_and_si512(a, high)),
                                      _mm512_castsi512_ps(_mm512_and_si512(b, high))));
  return _mm512_mask_blend_epi16(0xaaaaaaaau, e, o);
}

template <op O, class T>
RINGZERO_AVX512_INLINE void step(const T* a, const T* b, T* out) noexcept {
  if constexpr (std::is_same_v<T, bfloat16> && (is_sum<O> || O == op::prod)) {
    _mm512_storeu_si512(out, bf16_pairs<O>(_mm512_loadu_si512(a), _mm512_loadu_si512(b)));
  } else if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(out, fop<O>(_mm512_loadu_ps(a), _mm512_loadu_ps(b)));
  } else if constexpr (std::is_same_v<T, double>) {
    _mm512_storeu_pd(out, fop<O>(_mm512_loadu_pd(a), _mm512_loadu_pd(b)));
  } else if constexpr (kernels::is_16bit_float_v<T>) {
    const __m256i ha = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    const __m512 x = widen(ha, T{}), y = widen(hb, T{});
    __m256i r;
    if constexpr (is_sum<O> || O == op::prod) {
      r = narrow(fop<O>(x, y), T{});
    } else {
      const __mmask16 take_b = O == op::min ? _mm512_cmp_ps_mask(y, x, _CMP_LT_OQ)
                                            : _mm512_cmp_ps_mask(x, y, _CMP_LT_OQ);
      r = _mm256_mask_blend_epi16(take_b, ha, hb);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), r);
  } else {
    _mm512_storeu_si512(out, iop<O, T>(_mm512_loadu_si512(a), _mm512_loadu_si512(b)));
  }
}

template <class T>
RINGZERO_AVX512_INLINE void divide(T* p, int ranks) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(p,
                     _mm512_div_ps(_mm512_loadu_ps(p), _mm512_set1_ps(static_cast<float>(ranks))));
  } else if constexpr (std::is_same_v<T, double>) {
    _mm512_storeu_pd(p,
                     _mm512_div_pd(_mm512_loadu_pd(p), _mm512_set1_pd(static_cast<double>(ranks))));
  } else {
    auto* v = reinterpret_cast<__m256i*>(p);
    _mm256_storeu_si256(v, narrow(_mm512_div_ps(widen(_mm256_loadu_si256(v), T{}),
                                                _mm512_set1_ps(static_cast<float>(ranks))),
                                  T{}));
  }
}

/// Elements one step handles: a 512-bit vector of T, or 16 16-bit floats (16 floats wide).
template <class T>
inline constexpr std::size_t lanes = kernels::is_16bit_float_v<T> ? 16 : 64 / sizeof(T);
/// The same for combine with op O (bfloat16 sums and products take a 512-bit vector).
template <op O, class T>
inline constexpr std::size_t combine_lanes = std::is_same_v<T, bfloat16> &&
                                                     (is_sum<O> || O == op::prod)
                                                 ? 32
                                                 : lanes<T>;

template <op O, class T>
[[RINGZERO_AVX512_TARGET]] void combine(const T* a, const T* b, T* out, std::size_t n) noexcept {
  constexpr std::size_t w = combine_lanes<O, T>;
  std::size_t i = 0;
  for (; i + w <= n; i += w) step<O, T>(a + i, b + i, out + i);
  for (; i < n; ++i) out[i] = kernels::combine<O>(a[i], b[i]);
  _mm256_zeroupper();  // see "Leaving a vector loop" above
}

template <class T>
[[RINGZERO_AVX512_TARGET]] void finish_avg(T* p, std::size_t n, int ranks) noexcept {
  std::size_t i = 0;
  for (; i + lanes<T> <= n; i += lanes<T>) divide(p + i, ranks);
  for (; i < n; ++i) p[i] = kernels::finish_avg(p[i], ranks);
  _mm256_zeroupper();
}

}  // namespace avx512

}  // namespace ringzero::reduction::detail::x86

#undef RINGZERO_AVX2_TARGET
#undef RINGZERO_AVX512_TARGET
#undef RINGZERO_AVX2_INLINE
#undef RINGZERO_AVX512_INLINE

#endif  // RINGZERO_X86_SIMD
