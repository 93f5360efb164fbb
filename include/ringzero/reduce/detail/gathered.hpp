// The exact sum of each element's terms where every rank's terms lie side by side, rounded once:
// what options::reproducible's float calls compute where the terms meet (the gathered small
// all_reduce, the all_to_all path of detail/reproducible_call.hpp, and the shm transport's
// segment, shm/detail/collectives.hpp). It sits below both, in the reduction layer, so that a
// transport can sum exactly without including the collectives.
//
// gathered_sum is the general form (one int64 where the terms' bits span little, serial_sum
// otherwise); gathered_float_sums is the fast one for float, in double where that is exact,
// 16 or 8 elements at a time (reduce/detail/reproducible_x86.hpp). Both give serial_sum's bits.
#pragma once

#include <algorithm>
#include <bit>
#include <cfenv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ringzero/reduce/detail/reproducible_x86.hpp"
#include "ringzero/reduce/reproducible.hpp"
#include "ringzero/reduce/simd.hpp"

namespace ringzero::detail {

namespace rp = ringzero::reproducible;

/// a * 2^x (plus something in (0, 2^x) when sticky), 0 < a < 2^63, rounded to the nearest E,
/// ties to even, in integer arithmetic without data-dependent branches (and without the
/// floating-point rounding mode). Returns false, leaving out alone, where the result is not a
/// normal number or sticky lies among the kept bits: rp::round_to decides those.
template <class E>
[[nodiscard]] inline bool round_u64(bool neg, std::uint64_t a, int x, bool sticky, E& out) {
  using F = rp::format<E>;
  using B = typename F::bits;
  constexpr int p = F::p;
  const int len = static_cast<int>(std::bit_width(a));
  std::uint64_t mant = 0;
  int e = x;  // the result is mant * 2^e
  if (len > p) {
    // One more bit below holds sticky; adding half - 1 plus the kept lowest bit, then shifting,
    // rounds to nearest with ties to even.
    const std::uint64_t a2 = (a << 1) | (sticky ? 1u : 0u);
    const int drop = len - p + 1;
    mant = (a2 + ((std::uint64_t{1} << (drop - 1)) - 1) + ((a2 >> drop) & 1u)) >> drop;
    e += drop - 1;
    const int carry = static_cast<int>(mant >> p);  // rounding made 2^p
    mant >>= carry;
    e += carry;
  } else {
    if (sticky) return false;
    mant = a << (p - len);
    e -= p - len;
  }
  const int lead = e + p - 1;
  if (lead < F::emin || lead > F::emax) return false;
  constexpr int width = 1 + F::exp_bits + p - 1;
  const B sign = static_cast<B>(static_cast<B>(neg ? 1u : 0u) << (width - 1));
  const auto biased = static_cast<B>(lead + F::emax);
  const auto frac = static_cast<B>(mant & ((std::uint64_t{1} << (p - 1)) - 1));
  out = rp::from_bits<E>(static_cast<B>(sign | static_cast<B>(biased << (p - 1)) | frac));
  return true;
}

/// s * 2^low (divided by `divisor` first) rounded to the nearest E where round_u64 can; false
/// where the result is subnormal or past the largest finite.
template <class E>
[[nodiscard]] inline bool round_int64(std::int64_t s, int low, std::uint32_t divisor, E& out) {
  if (s == 0) {
    out = rp::from_bits<E>(0);
    return true;
  }
  if (s == INT64_MIN) return false;
  const bool neg = s < 0;
  const std::uint64_t m = neg ? ~std::uint64_t{0} : 0;
  std::uint64_t a = (static_cast<std::uint64_t>(s) ^ m) - m;
  if (divisor <= 1) return round_u64(neg, a, low, false, out);
  // Scaled up to 63 bits first, the quotient keeps 39 or more; the remainder is sticky.
  const int up = std::countl_zero(a) - 1;
  a <<= up;
  return round_u64(neg, a / divisor, low - up, a % divisor != 0, out);
}

/// The exact sum of n terms of one element, as rp::serial_sum gives it, summed in one int64
/// where the terms' bits span few enough (every float, bfloat16 and float16 sum of a few ranks
/// of ordinary data) and by serial_sum otherwise.
template <class E>
[[nodiscard]] E gathered_sum(const E* terms, std::size_t stride, std::size_t n,
                             std::uint32_t divisor) {
  rp::window w;
  bool other = false;
  for (std::size_t r = 0; r < n; ++r) {
    const rp::term t = rp::decompose(terms[r * stride]);
    w.add(t);
    other = other || (t.k != rp::kind::finite && t.k != rp::kind::zero);
  }
  const int headroom = static_cast<int>(std::bit_width(n));
  if (!other && (w.is_empty() || w.top + w.neg_low + headroom <= 62)) {
    if (w.is_empty()) return rp::from_bits<E>(0);
    const int low = -w.neg_low;
    std::int64_t acc = 0;
    for (std::size_t r = 0; r < n; ++r) {
      const rp::term t = rp::decompose(terms[r * stride]);
      if (t.k != rp::kind::finite) continue;
      const int shift = t.exp - low;  // negative only over trailing zeros of mant
      const auto m = static_cast<std::int64_t>(shift >= 0 ? t.mant << shift : t.mant >> -shift);
      acc += t.neg ? -m : m;
    }
    E v{};
    if (round_int64(acc, low, divisor, v)) return v;
  }
  std::vector<E> copy(n);
  for (std::size_t r = 0; r < n; ++r) copy[r] = terms[r * stride];
  return rp::serial_sum(copy.data(), n, divisor);
}

/// Whether this thread's floating-point environment lets the gathered float sums below use the
/// hardware: rounding to nearest, and subnormals kept when converted (no denormals-are-zero or
/// flush-to-zero mode, which -ffast-math and some libraries set). Asked once per call; where it
/// says no, every element takes gathered_sum's integer path, which depends on neither.
[[nodiscard]] inline bool float_environment_exact() noexcept {
  if (std::fegetround() != FE_TONEAREST) return false;
  volatile float tiny = 0x1p-149f;
  volatile double wide = tiny;
  volatile double back_in = 0x1p-149;
  volatile float narrow = static_cast<float>(back_in);
  return wide == 0x1p-149 && narrow == 0x1p-149f;
}

/// The exact sum of `ranks` float terms t[r * stride] (divided by `divisor`), rounded once to
/// the nearest float, where the double additions are exact: every nonzero term is an integer
/// multiple of the last bit of the smallest exponent among them, under 2^(24 + span) of those
/// where the exponents lie within `span` of each other, and `ranks` of them sum under 2^53 (what
/// a double holds exactly) while span <= 29 - ceil(log2(ranks)). The
/// conversion to float then rounds once. A quotient by a divisor that is not a power of two is
/// rounded to double first, which gives the nearest float unless it lands on a midpoint between
/// two floats. Infinities and NaN give IEEE addition's answer, as rp::special_result makes it.
/// False (out untouched) for a wider span, such a midpoint or such a quotient below the normal
/// range: gathered_sum decides those. Needs float_environment_exact(). The AVX-512 and AVX2
/// loops (gathered_sums) are this, 16 and 8 elements at a time.
[[nodiscard]] inline bool gathered_float_sum(const float* t, std::size_t stride, std::size_t ranks,
                                             int span, std::uint32_t divisor, float& out) noexcept {
  double s = 0;
  int top = 0;
  int bottom = 0xff;
  std::int64_t special = 0;
  for (std::size_t r = 0; r < ranks; ++r) {
    const float x = t[r * stride];
    const std::uint32_t b = std::bit_cast<std::uint32_t>(x);
    const int e = static_cast<int>((b >> 23) & 0xffu);
    if (e == 0xff) {
      special |= rp::special_code(rp::decompose(x));  // one bit per kind is enough here
      continue;
    }
    if ((b & 0x7fffffffu) != 0) {
      top = std::max(top, std::max(e, 1));
      bottom = std::min(bottom, std::max(e, 1));
    }
    s += static_cast<double>(x);
  }
  if (rp::special_result(special, out)) return true;
  if (top - bottom > span) return false;
  if (divisor > 1) {
    s /= static_cast<double>(divisor);
    if ((divisor & (divisor - 1)) != 0 && s != 0) {
      const auto b = std::bit_cast<std::uint64_t>(s);
      if ((b & 0x1fffffffu) == 0x10000000u || std::fabs(s) < 0x1p-126) return false;
    }
  }
  const auto f = static_cast<float>(s);
  out = f == 0 ? 0.0f : f;
  return true;
}

/// The widest exponent span gathered_float_sum adds exactly for `ranks` terms.
[[nodiscard]] constexpr int gathered_float_span(std::size_t ranks) noexcept {
  return 29 - static_cast<int>(std::bit_width(ranks > 0 ? ranks - 1 : 0));
}

/// out[i] for i in [0, n): the reproducible sum of `ranks` terms t[r * stride + i], divided by
/// `divisor`, on a given path of the host loops (every path gives gathered_sum's bits): one
/// pass, in double where that is exact, in integers where it is not.
inline void gathered_float_sums(reduction::simd path, const float* t, std::size_t stride,
                                std::size_t ranks, std::size_t n, std::uint32_t divisor,
                                float* out) {
  const auto general = [&](std::size_t i) { out[i] = gathered_sum(t + i, stride, ranks, divisor); };
  if (!float_environment_exact()) {
    for (std::size_t i = 0; i < n; ++i) general(i);
    return;
  }
  const int span = gathered_float_span(ranks);
  std::size_t i = 0;
#if RINGZERO_X86_SIMD
  // Two terms need no exponent test (x86::avx512::gathered_pair_sums says why): the common
  // case of two ranks costs about a plain add's loads and stores.
  if (ranks == 2 && divisor <= 2) {
    if (path == reduction::simd::avx512)
      i = rp::detail::x86::avx512::gathered_pair_sums(t, t + stride, n, divisor == 2, out);
    else if (path == reduction::simd::avx2)
      i = rp::detail::x86::avx2::gathered_pair_sums(t, t + stride, n, divisor == 2, out);
  } else if (path == reduction::simd::avx512)
    i = rp::detail::x86::avx512::gathered_sums(t, stride, ranks, n, span, divisor, out, general);
  else if (path == reduction::simd::avx2)
    i = rp::detail::x86::avx2::gathered_sums(t, stride, ranks, n, span, divisor, out, general);
#endif
  (void)path;
  for (; i < n; ++i)
    if (!gathered_float_sum(t + i, stride, ranks, span, divisor, out[i])) general(i);
}

}  // namespace ringzero::detail
