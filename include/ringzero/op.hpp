// Reduction operators, with NCCL's meanings: avg is a sum divided by the number of ranks, and on
// integers that division truncates toward zero.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "ringzero/error.hpp"

namespace ringzero {

enum class op : std::uint8_t { sum, prod, min, max, avg };

inline constexpr op all_ops[] = {op::sum, op::prod, op::min, op::max, op::avg};

[[nodiscard]] constexpr std::string_view op_name(op o) noexcept {
  switch (o) {
    case op::sum:
      return "sum";
    case op::prod:
      return "prod";
    case op::min:
      return "min";
    case op::max:
      return "max";
    case op::avg:
      return "avg";
  }
  return "?";
}

[[nodiscard]] constexpr bool is_valid(op o) noexcept {
  return static_cast<std::uint8_t>(o) <= static_cast<std::uint8_t>(op::avg);
}

[[nodiscard]] inline op parse_op(std::string_view s) {
  for (op o : all_ops)
    if (op_name(o) == s) return o;
  throw invalid_argument("unknown reduction op '" + std::string(s) +
                         "' (expected sum, prod, min, max or avg)");
}

}  // namespace ringzero
