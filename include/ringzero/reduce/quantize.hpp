// The wire formats of options::wire (wire.hpp), element by element and as segments of bytes.
//
// int8 and int4 are symmetric block quantization: the elements of a segment are cut into blocks
// of `block` consecutive elements; each block sends one float scale s and one code per element,
// the integer nearest x / s (ties to even) in [-qmax, qmax] (int8: 127, int4: 7), which stands for
// code * s. The scale is the block's largest finite magnitude divided by qmax, rounded up to 16
// significant bits, so that code * s is exact in float (8 + 16 bits), and x / s is computed in
// double, where it is exact enough that the code is the true nearest integer. Hence, for every
// finite element of a block, exactly and on every platform:
//
//     |x - value(code(x))| <= s / 2,   s = scale(max |x| of the block) <= max|x| / qmax · (1 +
//     2^-15)
//
// A block's largest element is sent with code ±qmax. An inf or NaN element gets the reserved code
// -qmax - 1 and arrives as a quiet NaN (its block's other elements are scaled by the finite ones),
// so a reduction over it is NaN, which a training step sees as the overflow it is.
//
// bf16 rounds each element to bfloat16 (nearest, ties to even): |x - bf16(x)| <= 2^-8 |x| for
// normal values, 2^-134 below; inf and NaN arrive as they are.
//
// A segment of `count` elements is laid out as: the blocks' scales (float, 4 bytes each), then
// the codes (int8: one byte each; int4: element 2i in the low nibble of byte i/2, element 2i+1 in
// the high one), then zeros up to a multiple of 8 bytes; bf16: the 2-byte elements, then zeros.
// Every per-element step is __host__ __device__ (RINGZERO_HD), so the CUDA kernels of
// kernels/cuda/quantize.cuh produce the host's bytes; the host loops below have AVX2 versions
// (reduce/detail/quantize_x86.hpp) that give the same bytes and sums.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "ringzero/kernels/element.hpp"
#include "ringzero/kernels/reduce.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/detail/quantize_x86.hpp"
#include "ringzero/reduce/simd.hpp"
#include "ringzero/types.hpp"
#include "ringzero/wire.hpp"

namespace ringzero::quantize {

/// Element types a wire format carries: the floating storage types a trainer moves.
template <class T>
inline constexpr bool supported_v =
    std::is_same_v<T, float> || std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>;

/// The largest code magnitude of int8 (127) and int4 (7); -qmax - 1 marks inf/NaN.
RINGZERO_HD constexpr int qmax(wire_format f) noexcept {
  return f == wire_format::int4 ? 7 : 127;
}

namespace detail {

RINGZERO_HD inline std::uint32_t bits_of(float x) noexcept {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return std::bit_cast<std::uint32_t>(x);
#endif
}
RINGZERO_HD inline float float_of(std::uint32_t u) noexcept {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}
RINGZERO_HD inline int bit_width(std::uint32_t u) noexcept {
#if defined(__CUDA_ARCH__)
  return 32 - __clz(static_cast<int>(u));
#else
  return static_cast<int>(std::bit_width(u));
#endif
}

/// x rounded to the nearest integer, ties to even, for |x| < 2^51: adding 1.5 · 2^52 leaves no
/// fraction bits (one division came before, so nothing can be fused into it).
RINGZERO_HD inline int nearest_int(double x) noexcept {
#if defined(__CUDA_ARCH__)
  return __double2int_rn(x);
#else
  constexpr double shift = 6755399441055744.0;
  return static_cast<int>((x + shift) - shift);
#endif
}

}  // namespace detail

/// A positive finite float rounded up to 16 significant bits (0 stays 0): a code of at most 8
/// bits times it is exact in float.
RINGZERO_HD inline float round_up_16_bits(float s) noexcept {
  std::uint32_t u = detail::bits_of(s);
  if (u == 0) return s;
  if ((u >> 23) != 0) {  // normal: 24 significant bits, 8 to drop
    const std::uint32_t low = u & 0xffu;
    u &= ~0xffu;
    if (low != 0) u += 0x100u;  // a carry into the exponent is right
    return detail::float_of(u);
  }
  const int width = detail::bit_width(u);  // subnormal: as many significant bits as its width
  if (width <= 16) return s;
  const std::uint32_t mask = (std::uint32_t{1} << (width - 16)) - 1u;
  const std::uint32_t low = u & mask;
  u &= ~mask;
  if (low != 0) u += mask + 1u;
  return detail::float_of(u);
}

/// The smallest float at or above x (a finite, non-negative double below FLT_MAX).
RINGZERO_HD inline float float_at_or_above(double x) noexcept {
#if defined(__CUDA_ARCH__)
  return __double2float_ru(x);
#else
  float f = static_cast<float>(x);
  if (static_cast<double>(f) < x) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  return f;
#endif
}

/// The scale of a block whose largest finite magnitude is `absmax`: absmax / q rounded up, to a
/// float and then to 16 significant bits, so that no element's quotient exceeds q even where
/// the scale is subnormal (a float division could round it down by half its last bit).
RINGZERO_HD inline float scale_of(float absmax, int q) noexcept {
  return round_up_16_bits(
      float_at_or_above(kernels::div(static_cast<double>(absmax), static_cast<double>(q))));
}

/// What a block's codes are found with: 1 / s in double (0 for a block of zeros).
RINGZERO_HD inline double inverse_of(float s) noexcept {
  return s == 0.0f ? 0.0 : kernels::div(1.0, static_cast<double>(s));
}

/// The code of x in a block of scale s (inv = inverse_of(s)): the integer nearest x / s, ties to
/// even, in [-q, q]; -q - 1 for inf and NaN. x · inv is within 2^-45 of x / s, and a quotient
/// that is not a tie lies at least 2^-40 from one (s has at most 16 significant bits, x 24), so
/// its nearest integer is the true one except at an exact tie, where the residual x - c · s
/// (exact in double: at most 40 significant bits) picks the even neighbour. Whether the host
/// compiler fuses x · inv into the rounding's add changes no code for the same reason.
RINGZERO_HD inline int code_of(float x, float s, double inv, int q) noexcept {
  if (!kernels::is_finite(x)) return -q - 1;
  const auto xd = static_cast<double>(x);
  int c = detail::nearest_int(kernels::mul(xd, inv));
  const double r = kernels::add(xd, -kernels::mul(static_cast<double>(c), static_cast<double>(s)));
  const double half = 0.5 * static_cast<double>(s);
  const int odd = c & 1;
  c += (r == half ? odd : 0) - (r == -half ? odd : 0);
  return c > q ? q : (c < -q ? -q : c);
}

/// What a code of a block of scale s stands for: code * s (exact), or NaN for -q - 1.
RINGZERO_HD inline float value_of(int code, float s, int q) noexcept {
  const float v = kernels::mul(static_cast<float>(code), s);
  return code == -q - 1 ? detail::float_of(0x7fc00000u) : v;
}

/// The int4 byte holding codes lo (element 2i) and hi (element 2i + 1).
RINGZERO_HD inline std::uint8_t pack4(int lo, int hi) noexcept {
  return static_cast<std::uint8_t>((static_cast<unsigned>(lo) & 0xfu) |
                                   ((static_cast<unsigned>(hi) & 0xfu) << 4));
}
/// Code `half` (0: low nibble, 1: high) of an int4 byte, sign-extended.
RINGZERO_HD inline int unpack4(std::uint8_t b, int half) noexcept {
  const int v = (b >> (4 * half)) & 0xf;
  return v >= 8 ? v - 16 : v;
}

/// |x| for the block's scale: 0 for inf and NaN, which do not take part in it.
RINGZERO_HD inline float finite_magnitude(float x) noexcept {
  return kernels::is_finite(x) ? detail::float_of(detail::bits_of(x) & 0x7fffffffu) : 0.0f;
}

/// bf16's value of x: rounded to nearest, ties to even, NaN kept.
template <class E>
RINGZERO_HD inline std::uint16_t bf16_code(E x) noexcept {
  return kernels::from_float<bfloat16>(kernels::to_float(x)).bits;
}
RINGZERO_HD inline float bf16_value(std::uint16_t bits) noexcept {
  return detail::float_of(static_cast<std::uint32_t>(bits) << 16);
}

/// Where the bytes of one segment of `count` elements lie.
struct segment_layout {
  wire_format format = wire_format::int8;
  std::size_t block = default_wire_block;
  std::size_t count = 0;

  [[nodiscard]] RINGZERO_HD constexpr bool quantized() const noexcept {
    return format == wire_format::int8 || format == wire_format::int4;
  }
  [[nodiscard]] RINGZERO_HD constexpr std::size_t blocks() const noexcept {
    return quantized() ? (count + block - 1) / block : 0;
  }
  [[nodiscard]] RINGZERO_HD constexpr std::size_t scale_bytes() const noexcept {
    return 4 * blocks();
  }
  [[nodiscard]] RINGZERO_HD constexpr std::size_t code_bytes() const noexcept {
    switch (format) {
      case wire_format::int4:
        return (count + 1) / 2;
      case wire_format::int8:
        return count;
      case wire_format::bf16:
        return 2 * count;
      case wire_format::full:
        break;
    }
    return 0;
  }
  /// The segment's bytes, a multiple of 8 (each of several segments starts aligned).
  [[nodiscard]] RINGZERO_HD constexpr std::size_t bytes() const noexcept {
    return (scale_bytes() + code_bytes() + 7) / 8 * 8;
  }
};

/// Element i's code in a segment (int8 or int4).
RINGZERO_HD inline int code_at(const std::uint8_t* codes, std::size_t i, wire_format f) noexcept {
  if (f == wire_format::int4) return unpack4(codes[i / 2], static_cast<int>(i & 1));
  return static_cast<std::int8_t>(codes[i]);
}

/// The scale of block b of a segment starting at `seg`.
RINGZERO_HD inline float scale_at(const std::uint8_t* seg, std::size_t b) noexcept {
  std::uint32_t u = 0;
  for (int k = 0; k < 4; ++k) u |= static_cast<std::uint32_t>(seg[4 * b + k]) << (8 * k);
  return detail::float_of(u);
}

/// Element i's value in a segment laid out as L (its bytes at `seg`).
RINGZERO_HD inline float value_at(const segment_layout& L, const std::uint8_t* seg,
                                  std::size_t i) noexcept {
  if (L.format == wire_format::bf16) {
    const std::uint8_t* p = seg + 2 * i;
    return bf16_value(static_cast<std::uint16_t>(p[0] | (p[1] << 8)));
  }
  const int q = qmax(L.format);
  return value_of(code_at(seg + L.scale_bytes(), i, L.format), scale_at(seg, i / L.block), q);
}

// ---------------------------------------------------------------------------------------------
// Host loops: a segment at a time.

namespace detail {

inline void put_scale(std::uint8_t* seg, std::size_t b, float s) noexcept {
  const std::uint32_t u = bits_of(s);
  for (int k = 0; k < 4; ++k) seg[4 * b + k] = static_cast<std::uint8_t>(u >> (8 * k));
}

}  // namespace detail

/// Whether the host loops run on `path`'s vectors: AVX2 (AVX-512 machines take it too).
[[nodiscard]] inline bool vector_path(reduction::simd path) noexcept {
#if RINGZERO_X86_SIMD
  return path != reduction::simd::scalar;
#else
  (void)path;
  return false;
#endif
}

/// Writes `in` (L.count elements) as segment L at `out` (L.bytes() bytes, padding zeroed), on
/// `path` (every path writes the same bytes).
template <class E>
void encode(const segment_layout& L, const E* in, std::uint8_t* out,
            reduction::simd path = reduction::active_simd()) noexcept {
  if (L.bytes() == 0) return;  // an empty segment may come with a null buffer (memset's UB)
  std::memset(out + L.scale_bytes() + L.code_bytes(), 0,
              L.bytes() - L.scale_bytes() - L.code_bytes());
  const bool vec = vector_path(path);
  if (L.format == wire_format::bf16) {
    std::size_t done = 0;
#if RINGZERO_X86_SIMD
    if (vec) {
      done = L.count / 8 * 8;
      detail::avx2::codes_bf16(in, done, out);
    }
#endif
    for (std::size_t i = done; i < L.count; ++i) {
      const std::uint16_t b = bf16_code(in[i]);
      out[2 * i] = static_cast<std::uint8_t>(b);
      out[2 * i + 1] = static_cast<std::uint8_t>(b >> 8);
    }
    return;
  }
  const int q = qmax(L.format);
  std::uint8_t* codes = out + L.scale_bytes();
  if (L.format == wire_format::int4) std::memset(codes, 0, L.code_bytes());
  for (std::size_t b = 0; b < L.blocks(); ++b) {
    const std::size_t from = b * L.block, to = std::min(L.count, from + L.block);
    float absmax = 0.0f;
    std::size_t i = from;
#if RINGZERO_X86_SIMD
    if (vec) {
      const std::size_t n = (to - from) / 8 * 8;
      absmax = detail::avx2::absmax(in + from, n);
      i += n;
    }
#endif
    for (; i < to; ++i) absmax = std::max(absmax, finite_magnitude(kernels::to_float(in[i])));
    const float s = scale_of(absmax, q);
    const double inv = inverse_of(s);
    detail::put_scale(out, b, s);
    i = from;
    if (L.format == wire_format::int8) {
#if RINGZERO_X86_SIMD
      if (vec) {
        const std::size_t n = (to - from) / 8 * 8;
        detail::avx2::codes_int8(in + from, n, s, inv, q, codes + from);
        i += n;
      }
#endif
      for (; i < to; ++i)
        codes[i] = static_cast<std::uint8_t>(code_of(kernels::to_float(in[i]), s, inv, q));
      continue;
    }
    const auto put4 = [&](std::size_t k) {
      codes[k / 2] |= static_cast<std::uint8_t>(
          (static_cast<unsigned>(code_of(kernels::to_float(in[k]), s, inv, q)) & 0xfu)
          << (4 * (k & 1)));
    };
#if RINGZERO_X86_SIMD
    if (vec) {
      if (i % 2 == 1 && i < to) put4(i++);  // the vectors start on a whole byte
      const std::size_t n = (to - i) / 16 * 16;
      detail::avx2::codes_int4(in + i, n, s, inv, q, codes + i / 2);
      i += n;
    }
#endif
    for (; i < to; ++i) put4(i);
  }
}

/// Calls block(b, from, to, s) for each int8/int4 block of segment L meeting [0, limit), where
/// [from, to) is the part of it below limit and s its scale.
template <class F>
void for_each_block(const segment_layout& L, const std::uint8_t* seg, std::size_t limit, F&& f) {
  for (std::size_t b = 0; b * L.block < limit; ++b)
    f(b * L.block, std::min(limit, (b + 1) * L.block), scale_at(seg, b));
}

/// out[i] = segment L's value of element i, rounded to E, for i < `limit` (<= L.count).
template <class E>
void decode(const segment_layout& L, const std::uint8_t* seg, E* out, std::size_t limit,
            reduction::simd path = reduction::active_simd()) noexcept {
  const bool vec = vector_path(path);
  if (L.format == wire_format::bf16) {
    std::size_t done = 0;
#if RINGZERO_X86_SIMD
    if (vec) {
      done = limit / 8 * 8;
      detail::avx2::decode_bf16(seg, done, out);
    }
#endif
    for (std::size_t i = done; i < limit; ++i) out[i] = kernels::from_float<E>(value_at(L, seg, i));
    return;
  }
  const int q = qmax(L.format);
  const std::uint8_t* codes = seg + L.scale_bytes();
  for_each_block(L, seg, limit, [&](std::size_t from, std::size_t to, float s) {
    std::size_t i = from;
    const auto one = [&](std::size_t k) {
      out[k] = kernels::from_float<E>(value_of(code_at(codes, k, L.format), s, q));
    };
#if RINGZERO_X86_SIMD
    if (vec) {
      if (L.format == wire_format::int4 && i % 2 == 1 && i < to) one(i++);
      const std::size_t n = (to - i) / 8 * 8;
      detail::avx2::decode_block(codes, i, n, s, L.format, out + i);
      i += n;
    }
#endif
    (void)vec;
    for (; i < to; ++i) one(i);
  });
}

/// acc[i] = (first) or += segment L's value of element i, in float, for every element; the sum
/// carries a NaN by kernels::combine's rule, so every path gives the same bits.
inline void accumulate(const segment_layout& L, const std::uint8_t* seg, float* acc, bool first,
                       reduction::simd path = reduction::active_simd()) noexcept {
  const auto add = [&](std::size_t k, float v) {
    acc[k] = first ? v : kernels::combine<op::sum>(acc[k], v);
  };
  const bool vec = vector_path(path);
  if (L.format == wire_format::bf16) {
    std::size_t done = 0;
#if RINGZERO_X86_SIMD
    if (vec) {
      done = L.count / 8 * 8;
      detail::avx2::accumulate_bf16(seg, done, acc, first);
    }
#endif
    for (std::size_t i = done; i < L.count; ++i) add(i, value_at(L, seg, i));
    return;
  }
  const int q = qmax(L.format);
  const std::uint8_t* codes = seg + L.scale_bytes();
  for_each_block(L, seg, L.count, [&](std::size_t from, std::size_t to, float s) {
    std::size_t i = from;
#if RINGZERO_X86_SIMD
    if (vec) {
      if (L.format == wire_format::int4 && i % 2 == 1 && i < to) {
        add(i, value_of(code_at(codes, i, L.format), s, q));
        ++i;
      }
      const std::size_t n = (to - i) / 8 * 8;
      detail::avx2::accumulate_block(codes, i, n, s, L.format, acc + i, first);
      i += n;
    }
#endif
    (void)vec;
    for (; i < to; ++i) add(i, value_of(code_at(codes, i, L.format), s, q));
  });
}

// ---------------------------------------------------------------------------------------------
// Error bounds, for documentation, tests and ringzero-perf's check.

/// The largest |x - value(x)| a finite x of magnitude at most `absmax` can get from format f
/// (one encoding): half the scale of a block whose largest magnitude is absmax (int8, int4), or
/// bf16's half ulp; 0 for full.
[[nodiscard]] inline double element_error(wire_format f, double absmax) noexcept {
  switch (f) {
    case wire_format::full:
      return 0.0;
    case wire_format::bf16:
      return std::ldexp(absmax, -8) + std::ldexp(1.0, -134);
    case wire_format::int8:
    case wire_format::int4:
      break;
  }
  // The block's largest magnitude is at most absmax, and scale_of grows with it.
  const float a = static_cast<float>(std::min(absmax, 3.0e38));
  const float above = std::nextafter(a, std::numeric_limits<float>::max());
  return static_cast<double>(scale_of(above, qmax(f))) / 2.0;
}

/// Relative rounding of a float sum of k terms: |fl(sum) - sum| <= sum_rounding(k) · Σ|term|.
[[nodiscard]] inline double sum_rounding(int k) noexcept {
  const double u = std::ldexp(1.0, -24);
  return k > 1 ? (k - 1) * u / (1 - (k - 1) * u) : 0.0;
}

/// Half an ulp of E at magnitude m (the output's own rounding), and its subnormal floor.
template <class E>
[[nodiscard]] double output_rounding(double m) noexcept {
  if constexpr (std::is_same_v<E, bfloat16>)
    return std::ldexp(m, -8) + std::ldexp(1.0, -134);
  else if constexpr (std::is_same_v<E, float16>)
    return std::ldexp(m, -11) + std::ldexp(1.0, -25);
  else
    return std::ldexp(m, -24) + std::ldexp(1.0, -150);
}

/// What shape of call a bound is for (detail/quantized_call.hpp runs these three).
enum class call_shape : std::uint8_t {
  gather,         ///< all_gather: every block encoded once
  reduce_blocks,  ///< reduce_scatter: sums of encoded terms, then E
  reduce_whole,   ///< all_reduce: reduce_scatter, then the sums all_gathered encoded
};

/// An upper bound on |result - exact| for every element of a call of `shape` on `ranks` ranks,
/// when every input element is finite and at most `a` in magnitude, with the output in E.
/// `per_node`: ranks per node where the reduction takes two hops (every node that size, more
/// than one node and fewer nodes than ranks), else 0. `average`: op::avg. The terms, for a sum:
/// every rank's encoding of its term; with two hops, every node's encoding of its partial sum;
/// the float additions of each hop; for all_reduce the encoding of the sum; the rounding to E.
template <class E>
[[nodiscard]] double error_bound(wire_format f, call_shape shape, int ranks, int per_node, double a,
                                 bool average = false) noexcept {
  const double e1 = element_error(f, a);
  if (shape == call_shape::gather) return e1 + output_rounding<E>(a + e1);
  const int n = std::max(ranks, 1);
  const bool two = per_node > 1 && per_node < n && n % per_node == 0;
  const int first = two ? per_node : n;  // terms the first hop adds on one rank
  const double t1 = a + e1;              // one decoded term, at most
  double sum = first * t1;
  double err = first * e1 + sum_rounding(first) * sum;
  if (two) {
    const int nodes = n / per_node;
    const double e2 = element_error(f, sum * (1 + sum_rounding(first)));
    err += nodes * e2;
    sum = nodes * (sum + e2);
    err += sum_rounding(nodes) * sum;
  }
  if (average) {
    err /= n;
    sum /= n;
    err += output_rounding<float>(sum);
  }
  if (shape == call_shape::reduce_whole) {
    const double e3 = element_error(f, sum);
    err += e3;
    sum += e3;
  }
  return err + output_rounding<E>(sum);
}

}  // namespace ringzero::quantize
