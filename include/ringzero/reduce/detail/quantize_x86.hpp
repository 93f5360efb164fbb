// The AVX2 loops behind quantize::encode, decode and accumulate (reduce/quantize.hpp), for float,
// bfloat16 and float16 elements. Each lane computes what the scalar functions compute for its
// element, so the bytes and sums do not depend on the path:
//  - a block's largest finite magnitude is a max, exact in any order; the scale is scale_of's;
//  - a code is x · (1 / s) in double rounded to nearest-even (vroundpd), then the exact residual
//    x - c · s moves an odd code at an exact tie to its even neighbour, as code_of does;
//  - a value is code · s (exact in float), NaN for the reserved code, and a sum adds it with
//    kernels::combine's NaN rule (reduction's avx2::fop<sum>);
//  - 16-bit elements widen exactly and narrow as types.hpp rounds (reduction's widen/narrow).
// Runs whole vectors; the caller runs what is left with the scalar functions.
#pragma once

#include "ringzero/reduce/detail/x86.hpp"

#if RINGZERO_X86_SIMD

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ringzero/op.hpp"
#include "ringzero/types.hpp"
#include "ringzero/wire.hpp"

#define RINGZERO_QAVX2_TARGET gnu::target("avx2,f16c")
#define RINGZERO_QAVX2_INLINE [[RINGZERO_QAVX2_TARGET, gnu::always_inline]] inline

namespace ringzero::quantize::detail::avx2 {

namespace rx = ringzero::reduction::detail::x86::avx2;

template <class E>
RINGZERO_QAVX2_INLINE __m256 load8(const E* p) noexcept {
  if constexpr (std::is_same_v<E, float>)
    return _mm256_loadu_ps(p);
  else
    return rx::widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), E{});
}

template <class E>
RINGZERO_QAVX2_INLINE void store8(E* p, __m256 v) noexcept {
  if constexpr (std::is_same_v<E, float>)
    _mm256_storeu_ps(p, v);
  else
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), rx::narrow(v, E{}));
}

/// |x| where x is finite, else 0.
RINGZERO_QAVX2_INLINE __m256 finite_magnitude(__m256 x) noexcept {
  const __m256 m = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  return _mm256_and_ps(m, _mm256_cmp_ps(m, _mm256_set1_ps(INFINITY), _CMP_LT_OQ));
}

/// The largest finite magnitude of in[0, n) over whole vectors (n a multiple of 8), and 0.
template <class E>
[[RINGZERO_QAVX2_TARGET]] float absmax(const E* in, std::size_t n) noexcept {
  __m256 m = _mm256_setzero_ps();
  for (std::size_t i = 0; i < n; i += 8) m = _mm256_max_ps(m, finite_magnitude(load8(in + i)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  const float r = _mm_cvtss_f32(h);
  _mm256_zeroupper();
  return r;
}

/// code_of for four doubles: x · inv to nearest-even, the tie fixed by the exact residual,
/// clamped to [-q, q].
RINGZERO_QAVX2_INLINE __m256d codes4(__m256d x, __m256d s, __m256d inv, __m256d q) noexcept {
  __m256d c = _mm256_round_pd(_mm256_mul_pd(x, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256d r = _mm256_sub_pd(x, _mm256_mul_pd(c, s));
  const __m256d half = _mm256_mul_pd(s, _mm256_set1_pd(0.5));
  const __m256d halved = _mm256_mul_pd(c, _mm256_set1_pd(0.5));
  const __m256d odd = _mm256_cmp_pd(_mm256_round_pd(halved, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC),
                                    halved, _CMP_NEQ_OQ);
  const __m256d one = _mm256_set1_pd(1.0);
  const __m256d up = _mm256_and_pd(_mm256_and_pd(_mm256_cmp_pd(r, half, _CMP_EQ_OQ), odd), one);
  const __m256d down = _mm256_and_pd(
      _mm256_and_pd(_mm256_cmp_pd(r, _mm256_sub_pd(_mm256_setzero_pd(), half), _CMP_EQ_OQ), odd),
      one);
  c = _mm256_sub_pd(_mm256_add_pd(c, up), down);
  return _mm256_min_pd(_mm256_max_pd(c, _mm256_sub_pd(_mm256_setzero_pd(), q)), q);
}

/// Eight codes of code_of as int32 lanes (the reserved -q - 1 for inf and NaN).
RINGZERO_QAVX2_INLINE __m256i codes8(__m256 x, float s, double inv, int q) noexcept {
  const __m256d sd = _mm256_set1_pd(static_cast<double>(s));
  const __m256d id = _mm256_set1_pd(inv);
  const __m256d qd = _mm256_set1_pd(static_cast<double>(q));
  // A non-finite lane is left out of the arithmetic (zero) and gets the reserved code after.
  const __m256 finite = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x),
                                      _mm256_set1_ps(INFINITY), _CMP_LT_OQ);
  const __m256 xs = _mm256_and_ps(x, finite);
  const __m128i lo =
      _mm256_cvtpd_epi32(codes4(_mm256_cvtps_pd(_mm256_castps256_ps128(xs)), sd, id, qd));
  const __m128i hi =
      _mm256_cvtpd_epi32(codes4(_mm256_cvtps_pd(_mm256_extractf128_ps(xs, 1)), sd, id, qd));
  const __m256i c = _mm256_set_m128i(hi, lo);
  return _mm256_blendv_epi8(_mm256_set1_epi32(-q - 1), c, _mm256_castps_si256(finite));
}

/// int8 codes of in[0, n) (n a multiple of 8) into out.
template <class E>
[[RINGZERO_QAVX2_TARGET]] void codes_int8(const E* in, std::size_t n, float s, double inv, int q,
                                          std::uint8_t* out) noexcept {
  for (std::size_t i = 0; i < n; i += 8) {
    const __m256i c = codes8(load8(in + i), s, inv, q);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_packs_epi16(w, w));
  }
  _mm256_zeroupper();
}

/// int4 codes of in[0, n) (n a multiple of 16) into out[0, n / 2), low nibble first.
template <class E>
[[RINGZERO_QAVX2_TARGET]] void codes_int4(const E* in, std::size_t n, float s, double inv, int q,
                                          std::uint8_t* out) noexcept {
  for (std::size_t i = 0; i < n; i += 16) {
    const __m256i a = codes8(load8(in + i), s, inv, q);
    const __m256i b = codes8(load8(in + i + 8), s, inv, q);
    const __m128i wa = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    const __m128i wb = _mm_packs_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    // 16 codes as bytes; each 16-bit pair (even, odd) becomes even | odd << 4.
    const __m128i bytes = _mm_and_si128(_mm_packs_epi16(wa, wb), _mm_set1_epi8(0x0f));
    const __m128i pairs =
        _mm_or_si128(_mm_and_si128(bytes, _mm_set1_epi16(0x000f)),
                     _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi16(0x00f0)));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i / 2), _mm_packus_epi16(pairs, pairs));
  }
  _mm256_zeroupper();
}

/// bf16 codes of in[0, n) (n a multiple of 8) into out, two bytes each, as bf16_code rounds.
template <class E>
[[RINGZERO_QAVX2_TARGET]] void codes_bf16(const E* in, std::size_t n, std::uint8_t* out) noexcept {
  for (std::size_t i = 0; i < n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i),
                     rx::narrow(load8(in + i), bfloat16{}));
  _mm256_zeroupper();
}

/// out[0, n) (or acc) from bf16 codes (n a multiple of 8).
template <class E>
[[RINGZERO_QAVX2_TARGET]] void decode_bf16(const std::uint8_t* codes, std::size_t n,
                                           E* out) noexcept {
  for (std::size_t i = 0; i < n; i += 8)
    store8(out + i,
           rx::widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 2 * i)), bfloat16{}));
  _mm256_zeroupper();
}
[[RINGZERO_QAVX2_TARGET]] inline void accumulate_bf16(const std::uint8_t* codes, std::size_t n,
                                                      float* acc, bool first) noexcept {
  for (std::size_t i = 0; i < n; i += 8) {
    const __m256 v =
        rx::widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 2 * i)), bfloat16{});
    _mm256_storeu_ps(acc + i, first ? v : rx::fop<op::sum>(_mm256_loadu_ps(acc + i), v));
  }
  _mm256_zeroupper();
}

/// Eight values of value_of from int32 codes.
RINGZERO_QAVX2_INLINE __m256 values8(__m256i c, __m256 s, int q) noexcept {
  const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(c), s);
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
  return _mm256_blendv_ps(v, nan,
                          _mm256_castsi256_ps(_mm256_cmpeq_epi32(c, _mm256_set1_epi32(-q - 1))));
}

/// Eight int32 codes of a segment's codes from element i (i even for int4).
RINGZERO_QAVX2_INLINE __m256i load_codes(const std::uint8_t* codes, std::size_t i,
                                         wire_format f) noexcept {
  if (f == wire_format::int8)
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
  std::int32_t four;
  __builtin_memcpy(&four, codes + i / 2, 4);
  const __m128i x = _mm_cvtsi32_si128(four);
  const __m256i e = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(x, x));
  return _mm256_srai_epi32(_mm256_sllv_epi32(e, _mm256_setr_epi32(28, 24, 28, 24, 28, 24, 28, 24)),
                           28);
}

/// out[k] = the values of codes [i, i + n) of a block of scale s, rounded to E. n a multiple of
/// 8, i even for int4.
template <class E>
[[RINGZERO_QAVX2_TARGET]] void decode_block(const std::uint8_t* codes, std::size_t i, std::size_t n,
                                            float s, wire_format f, E* out) noexcept {
  const __m256 sv = _mm256_set1_ps(s);
  const int q = f == wire_format::int4 ? 7 : 127;
  for (std::size_t k = 0; k < n; k += 8)
    store8(out + k, values8(load_codes(codes, i + k, f), sv, q));
  _mm256_zeroupper();
}

/// acc[k] = (first) or += the values of codes [i, i + n) of a block of scale s. n a multiple of
/// 8, i even for int4.
[[RINGZERO_QAVX2_TARGET]] inline void accumulate_block(const std::uint8_t* codes, std::size_t i,
                                                       std::size_t n, float s, wire_format f,
                                                       float* acc, bool first) noexcept {
  const __m256 sv = _mm256_set1_ps(s);
  const int q = f == wire_format::int4 ? 7 : 127;
  for (std::size_t k = 0; k < n; k += 8) {
    const __m256 v = values8(load_codes(codes, i + k, f), sv, q);
    _mm256_storeu_ps(acc + k, first ? v : rx::fop<op::sum>(_mm256_loadu_ps(acc + k), v));
  }
  _mm256_zeroupper();
}

}  // namespace ringzero::quantize::detail::avx2

#undef RINGZERO_QAVX2_TARGET
#undef RINGZERO_QAVX2_INLINE

#endif  // RINGZERO_X86_SIMD
