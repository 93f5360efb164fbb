// One element of a reduction: the arithmetic of reduce/cpu.hpp (integer sum and product wrap
// modulo 2^bits, 16-bit floats combine in float and round once, min/max keep the first operand
// on ties and NaN, a sum or product carries the first NaN operand's payload), for host loops and
// CUDA kernels alike. `O` is a template argument so a kernel carries no branch on the op per
// element.
#pragma once

#include <type_traits>

#include "ringzero/kernels/element.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::kernels {

/// a (op) b; for op::avg this is the sum (finish_avg divides once at the end).
template <op O, class T>
RINGZERO_HD inline T combine(T a, T b) noexcept {
  if constexpr (is_16bit_float_v<T>) {
    const float x = to_float(a), y = to_float(b);
    if constexpr (O == op::sum || O == op::avg)
      return from_float<T>(propagate_nan(add(x, y), x, y));
    else if constexpr (O == op::prod)
      return from_float<T>(propagate_nan(mul(x, y), x, y));
    else if constexpr (O == op::min)
      return y < x ? b : a;
    else
      return x < y ? b : a;
  } else if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    if constexpr (O == op::sum || O == op::avg) {
      return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    } else if constexpr (O == op::prod) {
      // unsigned char/short promote to int, whose product can overflow: widen explicitly.
      using W = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, U>;
      return static_cast<T>(
          static_cast<W>(static_cast<W>(static_cast<U>(a)) * static_cast<W>(static_cast<U>(b))));
    } else if constexpr (O == op::min) {
      return b < a ? b : a;
    } else {
      return a < b ? b : a;
    }
  } else {
    if constexpr (O == op::sum || O == op::avg)
      return propagate_nan(add(a, b), a, b);
    else if constexpr (O == op::prod)
      return propagate_nan(mul(a, b), a, b);
    else if constexpr (O == op::min)
      return b < a ? b : a;
    else
      return a < b ? b : a;
  }
}

/// A sum over `ranks` contributions turned into their average (integers truncate toward zero).
template <class T>
RINGZERO_HD inline T finish_avg(T x, int ranks) noexcept {
  if constexpr (std::is_integral_v<T>) {
    if constexpr (std::is_signed_v<T>)
      return static_cast<T>(static_cast<long long>(x) / static_cast<long long>(ranks));
    else
      return static_cast<T>(static_cast<unsigned long long>(x) /
                            static_cast<unsigned long long>(ranks));
  } else if constexpr (is_16bit_float_v<T>) {
    return from_float<T>(div(to_float(x), static_cast<float>(ranks)));
  } else {
    return div(x, static_cast<T>(ranks));
  }
}

}  // namespace ringzero::kernels
