// CPU reduction loops. Every combine takes its operands in a fixed order (the lower-ranked
// contribution first) so that all ranks computing the same partial get the same bits.
//
// Integer sum and product wrap modulo 2^bits, as NCCL's do: the arithmetic is done in the
// unsigned type of the same width, where overflow is defined.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <type_traits>

#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::reduction {

namespace detail {

template <class T>
struct arith {
  static T sum(T a, T b) noexcept {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    } else {
      return a + b;
    }
  }
  static T prod(T a, T b) noexcept {
    if constexpr (std::is_integral_v<T>) {
      // unsigned short/char promote to int, whose product can overflow; widen explicitly.
      using U =
          std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;
      return static_cast<T>(
          static_cast<U>(static_cast<U>(static_cast<std::make_unsigned_t<T>>(a)) *
                         static_cast<U>(static_cast<std::make_unsigned_t<T>>(b))));
    } else {
      return a * b;
    }
  }
  static T min(T a, T b) noexcept { return b < a ? b : a; }
  static T max(T a, T b) noexcept { return a < b ? b : a; }
};

template <class H>
struct half_arith {
  static H sum(H a, H b) noexcept { return H(float(a) + float(b)); }
  static H prod(H a, H b) noexcept { return H(float(a) * float(b)); }
  static H min(H a, H b) noexcept { return float(b) < float(a) ? b : a; }
  static H max(H a, H b) noexcept { return float(a) < float(b) ? b : a; }
};

template <class T>
using arith_for = std::conditional_t<std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>,
                                     half_arith<T>, arith<T>>;

template <class T, class F>
void loop(const T* a, const T* b, T* out, std::size_t n, F f) noexcept {
  for (std::size_t i = 0; i < n; ++i) out[i] = f(a[i], b[i]);
}

}  // namespace detail

/// out[i] = a[i] (op) b[i]; out may alias a or b. For op::avg this is the sum: call
/// finish_avg once on the fully summed result.
template <element T>
void combine(op o, const T* a, const T* b, T* out, std::size_t n) {
  using A = detail::arith_for<T>;
  switch (o) {
    case op::sum:
    case op::avg:
      detail::loop(a, b, out, n, [](T x, T y) { return A::sum(x, y); });
      return;
    case op::prod:
      detail::loop(a, b, out, n, [](T x, T y) { return A::prod(x, y); });
      return;
    case op::min:
      detail::loop(a, b, out, n, [](T x, T y) { return A::min(x, y); });
      return;
    case op::max:
      detail::loop(a, b, out, n, [](T x, T y) { return A::max(x, y); });
      return;
  }
  throw invalid_argument("unknown reduction op code " + std::to_string(static_cast<int>(o)));
}

template <element T>
void combine(op o, std::span<const T> a, std::span<const T> b, std::span<T> out) {
  combine(o, a.data(), b.data(), out.data(), std::min({a.size(), b.size(), out.size()}));
}

/// Turns a sum over `ranks` contributions into their average (truncating for integers).
template <element T>
void finish_avg(T* data, std::size_t n, int ranks) noexcept {
  if (ranks <= 1) return;
  if constexpr (std::is_integral_v<T>) {
    // Divide in a wider type: int8 cannot hold a world size above 127.
    if constexpr (std::is_signed_v<T>) {
      for (std::size_t i = 0; i < n; ++i)
        data[i] = static_cast<T>(static_cast<long long>(data[i]) / static_cast<long long>(ranks));
    } else {
      for (std::size_t i = 0; i < n; ++i)
        data[i] = static_cast<T>(static_cast<unsigned long long>(data[i]) /
                                 static_cast<unsigned long long>(ranks));
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    const T d = static_cast<T>(ranks);
    for (std::size_t i = 0; i < n; ++i) data[i] = data[i] / d;
  } else {
    const float d = static_cast<float>(ranks);
    for (std::size_t i = 0; i < n; ++i) data[i] = T(float(data[i]) / d);
  }
}

}  // namespace ringzero::reduction
