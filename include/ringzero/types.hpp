// Element types a collective can carry, including the two 16-bit floats ML uses. float16 and
// bfloat16 are storage types: arithmetic happens in float and each result is rounded back to
// nearest-even, which is what NCCL and the CUDA intrinsics do for a single reduction step.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "ringzero/error.hpp"

namespace ringzero {

namespace detail {

[[nodiscard]] constexpr std::uint16_t float_to_half_bits(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // inf stays inf; NaN stays a quiet NaN with its top payload bits
    const std::uint32_t nan = absx > 0x7f800000u ? 0x200u | ((absx >> 13) & 0x3ffu) : 0u;
    return static_cast<std::uint16_t>(sign | 0x7c00u | nan);
  }
  if (absx >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520
  if (absx < 0x38800000u) {  // below 2^-14: a half subnormal (or zero)
    if (absx < 0x33000000u) return static_cast<std::uint16_t>(sign);  // <= 2^-25 rounds to 0
    const std::uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(absx >> 23);  // 14..24
    std::uint32_t q = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return static_cast<std::uint16_t>(sign | q);
  }
  std::uint32_t h = (absx - 0x38000000u) >> 13;
  const std::uint32_t rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return static_cast<std::uint16_t>(sign | h);
}

[[nodiscard]] constexpr float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu;
  const std::uint32_t m = h & 0x3ffu;
  if (e == 0) {
    const float v = static_cast<float>(m) * 0x1p-24f;  // exact: m < 2^10
    return sign ? -v : v;
  }
  if (e == 31) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
  return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}

[[nodiscard]] constexpr std::uint16_t float_to_bf16_bits(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  const std::uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>(rounded >> 16);
}

[[nodiscard]] constexpr float bf16_bits_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

}  // namespace detail

/// IEEE 754 binary16, layout-compatible with CUDA's __half.
struct float16 {
  std::uint16_t bits = 0;
  constexpr float16() = default;
  constexpr explicit float16(float f) noexcept : bits(detail::float_to_half_bits(f)) {}
  constexpr explicit float16(double d) noexcept : float16(static_cast<float>(d)) {}
  [[nodiscard]] static constexpr float16 from_bits(std::uint16_t b) noexcept {
    float16 h;
    h.bits = b;
    return h;
  }
  constexpr operator float() const noexcept { return detail::half_bits_to_float(bits); }
};

/// bfloat16 (8-bit exponent, 7-bit mantissa), layout-compatible with CUDA's __nv_bfloat16.
struct bfloat16 {
  std::uint16_t bits = 0;
  constexpr bfloat16() = default;
  constexpr explicit bfloat16(float f) noexcept : bits(detail::float_to_bf16_bits(f)) {}
  constexpr explicit bfloat16(double d) noexcept : bfloat16(static_cast<float>(d)) {}
  [[nodiscard]] static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 h;
    h.bits = b;
    return h;
  }
  constexpr operator float() const noexcept { return detail::bf16_bits_to_float(bits); }
};

static_assert(sizeof(float16) == 2 && std::is_trivially_copyable_v<float16>);
static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16>);

/// Runtime tag for an element type; names follow nccl-tests' `-d` spelling.
enum class dtype : std::uint8_t {
  int8,
  uint8,
  int32,
  uint32,
  int64,
  uint64,
  float16,
  float32,
  float64,
  bfloat16,
};

inline constexpr dtype all_dtypes[] = {
    dtype::int8,   dtype::uint8,   dtype::int32,   dtype::uint32,  dtype::int64,
    dtype::uint64, dtype::float16, dtype::float32, dtype::float64, dtype::bfloat16};

template <class T>
inline constexpr bool is_element_v =
    std::is_same_v<T, std::int8_t> || std::is_same_v<T, std::uint8_t> ||
    std::is_same_v<T, std::int32_t> || std::is_same_v<T, std::uint32_t> ||
    std::is_same_v<T, std::int64_t> || std::is_same_v<T, std::uint64_t> ||
    std::is_same_v<T, float16> || std::is_same_v<T, float> || std::is_same_v<T, double> ||
    std::is_same_v<T, bfloat16>;

/// An element type a collective accepts (the ten types NCCL supports).
template <class T>
concept element = is_element_v<std::remove_cv_t<T>>;

template <class T>
inline constexpr bool is_floating_element_v =
    std::is_same_v<T, float16> || std::is_same_v<T, bfloat16> || std::is_floating_point_v<T>;

template <element T>
[[nodiscard]] constexpr dtype dtype_of() noexcept {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, std::int8_t>)
    return dtype::int8;
  else if constexpr (std::is_same_v<U, std::uint8_t>)
    return dtype::uint8;
  else if constexpr (std::is_same_v<U, std::int32_t>)
    return dtype::int32;
  else if constexpr (std::is_same_v<U, std::uint32_t>)
    return dtype::uint32;
  else if constexpr (std::is_same_v<U, std::int64_t>)
    return dtype::int64;
  else if constexpr (std::is_same_v<U, std::uint64_t>)
    return dtype::uint64;
  else if constexpr (std::is_same_v<U, float16>)
    return dtype::float16;
  else if constexpr (std::is_same_v<U, float>)
    return dtype::float32;
  else if constexpr (std::is_same_v<U, double>)
    return dtype::float64;
  else
    return dtype::bfloat16;
}

[[nodiscard]] constexpr std::size_t dtype_size(dtype t) noexcept {
  switch (t) {
    case dtype::int8:
    case dtype::uint8:
      return 1;
    case dtype::float16:
    case dtype::bfloat16:
      return 2;
    case dtype::int32:
    case dtype::uint32:
    case dtype::float32:
      return 4;
    case dtype::int64:
    case dtype::uint64:
    case dtype::float64:
      return 8;
  }
  return 0;
}

[[nodiscard]] constexpr std::string_view dtype_name(dtype t) noexcept {
  switch (t) {
    case dtype::int8:
      return "int8";
    case dtype::uint8:
      return "uint8";
    case dtype::int32:
      return "int32";
    case dtype::uint32:
      return "uint32";
    case dtype::int64:
      return "int64";
    case dtype::uint64:
      return "uint64";
    case dtype::float16:
      return "half";
    case dtype::float32:
      return "float";
    case dtype::float64:
      return "double";
    case dtype::bfloat16:
      return "bfloat16";
  }
  return "?";
}

/// Parses nccl-tests spellings (int8, uint8, int32, uint32, int64, uint64, half, float, double,
/// bfloat16) and the common aliases (float16, fp16, float32, fp32, float64, fp64, bf16).
[[nodiscard]] inline dtype parse_dtype(std::string_view s) {
  struct alias {
    std::string_view name;
    dtype type;
  };
  static constexpr alias aliases[] = {
      {"int8", dtype::int8},       {"char", dtype::int8},     {"uint8", dtype::uint8},
      {"int32", dtype::int32},     {"int", dtype::int32},     {"uint32", dtype::uint32},
      {"int64", dtype::int64},     {"uint64", dtype::uint64}, {"half", dtype::float16},
      {"float16", dtype::float16}, {"fp16", dtype::float16},  {"float", dtype::float32},
      {"float32", dtype::float32}, {"fp32", dtype::float32},  {"double", dtype::float64},
      {"float64", dtype::float64}, {"fp64", dtype::float64},  {"bfloat16", dtype::bfloat16},
      {"bf16", dtype::bfloat16}};
  for (const auto& a : aliases)
    if (a.name == s) return a.type;
  throw invalid_argument("unknown element type '" + std::string(s) + "'");
}

/// Calls f(T{}) with the C++ type behind a runtime dtype.
template <class F>
decltype(auto) visit_dtype(dtype t, F&& f) {
  switch (t) {
    case dtype::int8:
      return f(std::int8_t{});
    case dtype::uint8:
      return f(std::uint8_t{});
    case dtype::int32:
      return f(std::int32_t{});
    case dtype::uint32:
      return f(std::uint32_t{});
    case dtype::int64:
      return f(std::int64_t{});
    case dtype::uint64:
      return f(std::uint64_t{});
    case dtype::float16:
      return f(float16{});
    case dtype::float32:
      return f(float{});
    case dtype::float64:
      return f(double{});
    case dtype::bfloat16:
      return f(bfloat16{});
  }
  throw invalid_argument("unknown element type code " + std::to_string(static_cast<int>(t)));
}

}  // namespace ringzero
