// Per-element arithmetic shared by the host and the CUDA kernels (kernels/cuda/*.cuh). Under nvcc
// every function here is __host__ __device__; a host compiler sees plain inline functions, so the
// host tests run exactly the code the GPU runs.
//
// Bitwise agreement with host code needs two things on the device. nvcc contracts a multiply
// feeding an add into one FMA (one rounding instead of two) unless told otherwise, so device
// code goes through the _rn intrinsics, which are never contracted. And the 16-bit conversions
// use the hardware's round-to-nearest-even, which matches types.hpp for every finite value and
// infinity; a NaN keeps the payload types.hpp gives it. The host side is the plain C++
// expression; it matches the device only where the host compiler does not contract either
// (GCC contracts with -ffp-contract=fast when the target has FMA: -march=haswell, aarch64).
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ringzero/types.hpp"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define RINGZERO_HD __host__ __device__
#else
#define RINGZERO_HD
#endif

namespace ringzero::kernels {

/// Float arithmetic rounded after every operation, on either side.
RINGZERO_HD inline float add(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
RINGZERO_HD inline float sub(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
RINGZERO_HD inline float mul(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
RINGZERO_HD inline float div(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
RINGZERO_HD inline float sqrt(float a) noexcept {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
RINGZERO_HD inline double add(double a, double b) noexcept {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
RINGZERO_HD inline double mul(double a, double b) noexcept {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
RINGZERO_HD inline double div(double a, double b) noexcept {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
RINGZERO_HD inline bool is_finite(float x) noexcept {
#if defined(__CUDA_ARCH__)
  return isfinite(x);
#else
  return std::isfinite(x);
#endif
}

/// x with its quiet bit set: what an arithmetic operation returns for a NaN operand x.
RINGZERO_HD inline float quieted(float x) noexcept {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(__float_as_uint(x) | 0x400000u);
#else
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(x) | 0x400000u);
#endif
}
RINGZERO_HD inline double quieted(double x) noexcept {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(__double_as_longlong(x) | 0x8000000000000ll);
#else
  return std::bit_cast<double>(std::bit_cast<std::uint64_t>(x) | 0x8000000000000ull);
#endif
}

/// r = x (op) y for a commutative op, with a NaN operand's payload carried by rule: x's NaN if x
/// is one, else y's, quietened. Hardware returns the NaN of whichever operand comes first in the
/// instruction (x86) or a canonical NaN (CUDA), and compilers order the operands of a commutative
/// op as they like, so without this the payload would depend on the code path. A NaN made from
/// numbers (inf - inf) is the hardware's default NaN.
template <class F>
RINGZERO_HD inline F propagate_nan(F r, F x, F y) noexcept {
  if (r == r) return r;
  if (x != x) return quieted(x);
  if (y != y) return quieted(y);
  return r;
}

template <class T>
inline constexpr bool is_16bit_float_v = std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>;

/// The element widened to float: exact for all three floating storage types.
RINGZERO_HD inline float to_float(float x) noexcept {
  return x;
}
RINGZERO_HD inline float to_float(bfloat16 x) noexcept {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(static_cast<std::uint32_t>(x.bits) << 16);
#else
  return static_cast<float>(x);
#endif
}
RINGZERO_HD inline float to_float(float16 x) noexcept {
#if defined(__CUDA_ARCH__)
  const std::uint32_t b = x.bits;
  if ((b & 0x7c00u) == 0x7c00u && (b & 0x3ffu) != 0)  // NaN: types.hpp's payload
    return __uint_as_float(((b & 0x8000u) << 16) | 0x7f800000u | ((b & 0x3ffu) << 13));
  return __half2float(__ushort_as_half(x.bits));
#else
  return static_cast<float>(x);
#endif
}

/// A float rounded to nearest-even into T (float: unchanged).
template <class T>
RINGZERO_HD inline T from_float(float x) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
#if defined(__CUDA_ARCH__)
    const std::uint32_t u = __float_as_uint(x);
    T r;
    if constexpr (std::is_same_v<T, bfloat16>) {
      r.bits = (u & 0x7fffffffu) > 0x7f800000u ? static_cast<std::uint16_t>((u >> 16) | 0x40u)
                                               : __bfloat16_as_ushort(__float2bfloat16_rn(x));
    } else {
      const std::uint32_t a = u & 0x7fffffffu;
      r.bits =
          a > 0x7f800000u
              ? static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u | ((a >> 13) & 0x3ffu))
              : __half_as_ushort(__float2half_rn(x));
    }
    return r;
#else
    return T(x);
#endif
  }
}

/// The last of `size` segments starting at or before `chunk`, where segment i's chunks begin at
/// first_chunk[i] (ascending, first_chunk[0] = 0): where a block of a multi-tensor kernel
/// (the optimizer step, the gradient statistics) starts its run of chunks.
RINGZERO_HD inline int segment_of(const std::size_t* first_chunk, int size,
                                  std::size_t chunk) noexcept {
  int si = 0;
  for (int hi = size - 1; si < hi;) {
    const int mid = (si + hi + 1) / 2;
    if (first_chunk[mid] <= chunk)
      si = mid;
    else
      hi = mid - 1;
  }
  return si;
}

}  // namespace ringzero::kernels
