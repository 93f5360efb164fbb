// What a collective's output should be, computed the slow, obvious way: deterministic inputs
// any rank (or a checker holding no data) can regenerate from (seed, rank, index), a serial
// reduction over the ranks with the semantics NCCL defines, and for floating types the error
// a correct but reassociated reduction may make.
//
// Integers: sum and prod wrap modulo 2^bits, min/max are exact, and avg is the wrapped sum
// divided by the number of ranks, truncating toward zero. All are exact whatever the order.
//
// Floats: min/max are exact (no NaNs or signed zeros are generated). Any summation order of
// k+1 terms in which each addition rounds once, with unit roundoff u, is within
// gamma_k * sum|x_i| of the exact sum, gamma_k = k u / (1 - k u) (Higham, Accuracy and
// Stability of Numerical Algorithms, 2nd ed., §4.2); a product of k+1 factors is within
// gamma_k * |prod x_i|. float16 and bfloat16 compute each step in float and round to the
// 16-bit type, so u is theirs plus float's (two roundings). avg divides the computed sum once
// more: |fl(S'/n) - S/n| <= (gamma_(n-1) A + u (|S| + gamma_(n-1) A)) / n <= gamma_n A / n with
// A = sum|x_i|. The reference itself is summed in long double and rounded to double, which
// adds ((n+1) u_ld + 2^-53) of the same magnitude.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <type_traits>

#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::testing {

/// splitmix64's finaliser: a cheap, well-mixed hash of one word.
[[nodiscard]] constexpr std::uint64_t mix(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Element `i` of rank `rank`'s input in the case named by `seed`. Integers use all their bits
/// (so sums wrap), odd for prod (a product of odd numbers never wraps to zero). Floats are
/// +-[0.75, 1.25], rounded to the type: products of a few dozen stay finite and normal, and
/// mixed signs make sums cancel.
template <element E>
[[nodiscard]] E input_value(std::uint64_t seed, int rank, std::size_t i, op o) noexcept {
  const std::uint64_t h = mix(seed ^ (static_cast<std::uint64_t>(rank) << 40) ^ i);
  if constexpr (std::is_integral_v<E>) {
    const auto v = static_cast<E>(h);
    return o == op::prod ? static_cast<E>(v | 1) : v;
  } else {
    const double mag = 0.75 + 0.5 * static_cast<double>(h >> 11) * 0x1p-53;
    const double v = (h & 1) ? -mag : mag;
    if constexpr (std::is_same_v<E, double>)
      return v;
    else
      return E(static_cast<float>(v));
  }
}

template <element E>
[[nodiscard]] constexpr double unit_roundoff() noexcept {
  if constexpr (std::is_same_v<E, float16>)
    return 0x1p-11 + 0x1p-24;
  else if constexpr (std::is_same_v<E, bfloat16>)
    return 0x1p-8 + 0x1p-24;
  else if constexpr (std::is_same_v<E, float>)
    return 0x1p-24;
  else
    return 0x1p-53;
}

[[nodiscard]] inline double gamma(int k, double u) noexcept {
  return k * u / (1.0 - k * u);
}

template <element E>
[[nodiscard]] double to_double(E v) noexcept {
  if constexpr (std::is_same_v<E, double>)
    return v;
  else
    return static_cast<double>(static_cast<float>(v));
}

/// One output element: exact for integers; for floats a value and how far a correct result
/// may be from it.
template <element E>
struct reduced {
  E exact{};
  double value = 0;
  double tolerance = 0;
};

/// The serial reduction over `ranks` contributions x(0), ..., x(ranks-1).
template <element E, class Input>
[[nodiscard]] reduced<E> reduce_serial(op o, int ranks, Input&& x) {
  reduced<E> r;
  if constexpr (std::is_integral_v<E>) {
    using U = std::make_unsigned_t<E>;
    U acc = static_cast<U>(x(0));
    for (int j = 1; j < ranks; ++j) {
      const U v = static_cast<U>(x(j));
      switch (o) {
        case op::sum:
        case op::avg:
          acc = static_cast<U>(static_cast<unsigned long long>(acc) + v);
          break;
        case op::prod:
          acc = static_cast<U>(static_cast<unsigned long long>(acc) * v);
          break;
        case op::min:
          acc = static_cast<U>(std::min(static_cast<E>(acc), static_cast<E>(v)));
          break;
        case op::max:
          acc = static_cast<U>(std::max(static_cast<E>(acc), static_cast<E>(v)));
          break;
      }
    }
    r.exact = static_cast<E>(acc);
    if (o == op::avg) {
      if constexpr (std::is_signed_v<E>)
        r.exact = static_cast<E>(static_cast<long long>(r.exact) / ranks);
      else
        r.exact = static_cast<E>(static_cast<unsigned long long>(r.exact) /
                                 static_cast<unsigned long long>(ranks));
    }
    r.value = static_cast<double>(r.exact);
  } else {
    long double acc = to_double(x(0)), mag = std::fabs(acc);
    for (int j = 1; j < ranks; ++j) {
      const long double v = to_double(x(j));
      switch (o) {
        case op::sum:
        case op::avg:
          acc += v;
          mag += std::fabs(v);
          break;
        case op::prod:
          acc *= v;
          break;
        case op::min:
          acc = std::min(acc, v);
          break;
        case op::max:
          acc = std::max(acc, v);
          break;
      }
    }
    if (o == op::prod) mag = std::fabs(acc);
    const double u = unit_roundoff<E>();
    const double u_ref = (ranks + 1) * std::numeric_limits<long double>::epsilon() / 2 + 0x1p-53;
    switch (o) {
      case op::sum:
      case op::prod:
        r.tolerance = (gamma(ranks - 1, u) + u_ref) * static_cast<double>(mag);
        break;
      case op::avg:
        acc /= ranks;
        r.tolerance = (gamma(ranks, u) + u_ref) * static_cast<double>(mag) / ranks;
        break;
      case op::min:
      case op::max:
        r.tolerance = 0;
        break;
    }
    r.value = static_cast<double>(acc);
    if constexpr (std::is_same_v<E, double>)
      r.exact = r.value;
    else
      r.exact = E(static_cast<float>(r.value));
  }
  return r;
}

template <element E>
[[nodiscard]] bool matches(const reduced<E>& want, E got) noexcept {
  if constexpr (std::is_integral_v<E>)
    return got == want.exact;
  else
    return std::fabs(to_double(got) - want.value) <= want.tolerance;
}

template <element E>
[[nodiscard]] std::string show(E v) {
  if constexpr (std::is_integral_v<E>)
    return fmt::format("{}", static_cast<long long>(v));
  else if constexpr (std::is_same_v<E, double>)
    return fmt::format("{:.17g}", v);
  else
    return fmt::format("{:.9g}", static_cast<double>(static_cast<float>(v)));
}

template <element E>
[[nodiscard]] std::string show(const reduced<E>& r) {
  if constexpr (std::is_integral_v<E>)
    return show(r.exact);
  else
    return fmt::format("{:.17g} +- {:.3g}", r.value, r.tolerance);
}

/// Bitwise complement of `v`: a poison guaranteed to differ from v in every bit.
template <element E>
[[nodiscard]] E complement(E v) noexcept {
  unsigned char b[sizeof(E)];
  std::memcpy(b, &v, sizeof b);
  for (auto& c : b) c = static_cast<unsigned char>(~c);
  E out;
  std::memcpy(&out, b, sizeof b);
  return out;
}

/// How many elements rank `from` sends rank `to` in the all_to_allv case named by `seed`, on a
/// scale of `base`: about a quarter of the pairs exchange nothing, the rest 1, base/2, base or
/// base plus a few, so blocks are uneven and some are empty. Both ends compute the same.
[[nodiscard]] constexpr std::size_t v_count(std::uint64_t seed, int from, int to,
                                            std::size_t base) noexcept {
  const std::uint64_t h = mix(seed ^ (static_cast<std::uint64_t>(from) << 32) ^
                              (static_cast<std::uint64_t>(to) << 8) ^ 0x5bd1e995u);
  switch (h % 8) {
    case 0:
    case 1:
      return 0;
    case 2:
      return 1;
    case 3:
      return base / 2;
    case 4:
    case 5:
      return base;
    default:
      return base + (h >> 8) % 7;
  }
}

/// A 64-bit digest of a buffer's bytes, for comparing outputs across ranks cheaply. Each word
/// goes through one multiply and a rotation in one of four independent chains, and the chains
/// meet in mix() at the end: every step is a bijection of its chain's state, so one changed word
/// changes the digest. The conformance suites digest every output of every call: with
/// mix() on every word, in one chain (12 cycles a word), this was a third of their CPU time.
[[nodiscard]] inline std::uint64_t digest(std::span<const std::byte> bytes) noexcept {
  constexpr std::uint64_t k = 0x9e3779b97f4a7c15ull;
  const auto step = [](std::uint64_t h, std::uint64_t w) {
    const std::uint64_t x = (h ^ w) * k;
    return (x << 31) | (x >> 33);
  };
  std::uint64_t h[4] = {0x243f6a8885a308d3ull ^ bytes.size(), 0x13198a2e03707344ull,
                        0xa4093822299f31d0ull, 0x082efa98ec4e6c89ull};
  const std::byte* p = bytes.data();
  std::size_t i = 0;
  for (; i + 32 <= bytes.size(); i += 32) {
    for (std::size_t l = 0; l < 4; ++l) {
      std::uint64_t w;
      std::memcpy(&w, p + i + 8 * l, 8);
      h[l] = step(h[l], w);
    }
  }
  for (; i + 8 <= bytes.size(); i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    h[0] = step(h[0], w);
  }
  std::uint64_t tail = 0;
  if (i < bytes.size()) std::memcpy(&tail, p + i, bytes.size() - i);
  return mix(mix(mix(mix(h[0] ^ tail) ^ h[1]) ^ h[2]) ^ h[3]);
}

}  // namespace ringzero::testing
