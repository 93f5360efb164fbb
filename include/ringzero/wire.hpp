// What a collective puts on the wire for floating-point data (options::wire): the elements as
// they are, or fewer bytes standing for them (ZeRO++'s quantized communication, arXiv
// 2306.10209). reduce/quantize.hpp says what each format is and what it costs in accuracy;
// detail/quantized_call.hpp how the collectives that take one run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "ringzero/error.hpp"

namespace ringzero {

/// The wire format of all_gather, reduce_scatter and all_reduce on float, bfloat16 and float16.
enum class wire_format : std::uint8_t {
  full,  ///< the elements themselves (the default)
  bf16,  ///< each element rounded to bfloat16 (2 bytes); reductions add in float
  int8,  ///< symmetric int8 codes, one float scale per block (about 1 byte per element)
  int4,  ///< symmetric int4 codes, two per byte, one float scale per block (about 1/2 byte)
};

/// Elements that share one scale when options::wire_block is 0: a scale costs 4 bytes, 1.6% of
/// an int8 block's bytes and 3.1% of an int4 one's, and a smaller block follows the data's
/// magnitude more closely (the error bound is half the block's scale).
inline constexpr std::size_t default_wire_block = 256;

/// The largest block options::wire_block accepts.
inline constexpr std::size_t max_wire_block = std::size_t{1} << 24;

[[nodiscard]] constexpr std::string_view wire_format_name(wire_format f) noexcept {
  switch (f) {
    case wire_format::full:
      return "full";
    case wire_format::bf16:
      return "bf16";
    case wire_format::int8:
      return "int8";
    case wire_format::int4:
      return "int4";
  }
  return "?";
}

/// The format named `s` (full, bf16, int8, int4; "none" and "bfloat16" too).
[[nodiscard]] inline wire_format parse_wire_format(std::string_view s) {
  for (const wire_format f :
       {wire_format::full, wire_format::bf16, wire_format::int8, wire_format::int4})
    if (s == wire_format_name(f)) return f;
  if (s == "none") return wire_format::full;
  if (s == "bfloat16") return wire_format::bf16;
  throw invalid_argument("unknown wire format '" + std::string(s) +
                         "' (expected full, bf16, int8 or int4)");
}

}  // namespace ringzero
