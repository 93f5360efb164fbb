// The vocabulary of the alpha-beta-gamma cost model (Thakur, Rabenseifner & Gropp, 2005): what an
// algorithm's cost formula is given, and the step counts the formulas share. Each algorithm
// header prices itself with these in its descriptor; model/cost_model.hpp compares the prices.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "ringzero/algorithm.hpp"
#include "ringzero/tuning/policy.hpp"

namespace ringzero::tuning {

[[nodiscard]] constexpr bool is_pow2(int n) noexcept {
  return n > 0 && (n & (n - 1)) == 0;
}

/// floor(log2 n) for n >= 1.
[[nodiscard]] constexpr int floor_log2(int n) noexcept {
  int p = 0;
  while ((2 << p) <= n) ++p;
  return p;
}

/// ceil(log2 n) for n >= 1.
[[nodiscard]] constexpr int ceil_log2(int n) noexcept {
  return is_pow2(n) ? floor_log2(n) : floor_log2(n) + 1;
}

/// One question to the cost model. `bytes` is the size of one rank's full buffer: the
/// all_reduce vector, the reduce_scatter input, the all_gather output, the broadcast/reduce
/// buffer. The answer depends only on these fields, so every rank of a communicator predicts
/// (and picks) the same.
struct cost_query {
  collective c = collective::all_reduce;
  double bytes = 0;
  int ranks = 1;
  tuning::policy p{};
  /// Nodes the ranks span (hierarchical algorithms); 1 = one node.
  int nodes = 1;

  [[nodiscard]] double frac() const noexcept { return static_cast<double>(ranks - 1) / ranks; }
  [[nodiscard]] double log2_floor() const noexcept { return floor_log2(ranks); }
  /// Non-powers of two fold the extra ranks in and out: two more whole-message steps.
  [[nodiscard]] double fold() const noexcept { return is_pow2(ranks) ? 0.0 : 1.0; }
  [[nodiscard]] double chunks() const noexcept {
    return std::max(1.0, std::ceil(bytes / static_cast<double>(p.chunk_bytes)));
  }
};

}  // namespace ringzero::tuning
