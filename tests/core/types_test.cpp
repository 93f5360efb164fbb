#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "ringzero/types.hpp"

using ringzero::bfloat16;
using ringzero::float16;

namespace {

// Round-to-nearest-even of a double to half, computed independently: scale to an integer grid
// and let nearbyint (default rounding mode is to nearest, ties to even) do the work.
double reference_half(double x) {
  const double a = std::fabs(x);
  if (a >= 65520.0) return std::copysign(INFINITY, x);
  int e = 0;
  std::frexp(a, &e);                     // a = m * 2^e, m in [0.5, 1)
  const int exp = std::max(e - 1, -14);  // half has 10 fraction bits; subnormals below 2^-14
  const double ulp = std::ldexp(1.0, exp - 10);
  return std::copysign(std::nearbyint(a / ulp) * ulp, x);
}

}  // namespace

TEST_CASE("float16 round-trips every finite half exactly") {
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const auto h = float16::from_bits(static_cast<std::uint16_t>(b));
    const float f = h;
    if (std::isnan(f)) continue;
    CHECK(float16(f).bits == h.bits);
  }
}

TEST_CASE("float16 rounds to nearest even, including subnormals and overflow") {
  // Halfway points between neighbours, just above and below them, across the whole range.
  for (std::uint32_t b = 0; b < 0x7bffu; b += 7) {
    const double lo = float16::from_bits(static_cast<std::uint16_t>(b));
    const double hi = float16::from_bits(static_cast<std::uint16_t>(b + 1));
    for (double x : {(lo + hi) / 2, lo + (hi - lo) * 0.49, lo + (hi - lo) * 0.51}) {
      const auto xf = static_cast<float>(x);
      CHECK(static_cast<double>(float(float16(xf))) == reference_half(static_cast<double>(xf)));
      CHECK(static_cast<double>(float(float16(-xf))) == reference_half(-static_cast<double>(xf)));
    }
  }
  CHECK(float(float16(65519.0f)) == 65504.0f);
  CHECK(std::isinf(float(float16(65520.0f))));
  CHECK(float(float16(0x1p-25f)) == 0.0f);  // tie with zero goes to even (zero)
  CHECK(float(float16(0x1.8p-25f)) == 0x1p-24f);
  CHECK(std::isnan(float(float16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST_CASE("bfloat16 rounds to nearest even") {
  CHECK(bfloat16(1.0f).bits == 0x3f80);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (1.0).
  CHECK(float(bfloat16(1.0f + 0x1p-8f)) == 1.0f);
  CHECK(float(bfloat16(1.0f + 0x1p-8f + 0x1p-20f)) == 1.0f + 0x1p-7f);
  CHECK(float(bfloat16(1.0f + 3 * 0x1p-8f)) == 1.0f + 0x1p-6f);  // tie, odd below: rounds up
  CHECK(std::isnan(float(bfloat16(std::numeric_limits<float>::quiet_NaN()))));
  for (std::uint32_t b = 0; b < 0x7f80u; ++b) {
    const auto h = bfloat16::from_bits(static_cast<std::uint16_t>(b));
    CHECK(bfloat16(float(h)).bits == h.bits);
  }
}

TEST_CASE("dtype names parse back and report sizes") {
  for (auto t : ringzero::all_dtypes) {
    CHECK(ringzero::parse_dtype(ringzero::dtype_name(t)) == t);
    ringzero::visit_dtype(t, [&](auto x) { CHECK(sizeof(x) == ringzero::dtype_size(t)); });
  }
  CHECK_THROWS_AS((void)ringzero::parse_dtype("float128"), ringzero::invalid_argument);
}
