// A ZeRO stage as data: which of the model state a rank holds whole and which only as its shard,
// and whether the updated parameters are all_gathered after the optimizer step. The sharder and
// its components read this table instead of comparing stage numbers.
#pragma once

#include <fmt/format.h>

#include <array>

#include "ringzero/error.hpp"

namespace ringzero::zero {

struct stage_layout {
  int stage = 0;
  bool sharded_parameters = false;  ///< a shard of the parameters (gathered per bucket when used)
  bool sharded_gradients = false;   ///< a gradient shard, filled by reduce_scatter
  bool sharded_optimizer = false;   ///< master weights and moments of this rank's shard only
  bool gather_after_step = false;   ///< all_gather every bucket's updated parameters after step()
};

/// Rajbhandari et al.'s stages: 0 plain data parallel, 1 optimizer state, 2 plus gradients,
/// 3 plus parameters.
inline constexpr std::array<stage_layout, 4> stage_table{{
    {0, false, false, false, false},
    {1, false, false, true, true},
    {2, false, true, true, true},
    {3, true, true, true, false},
}};

[[nodiscard]] inline const stage_layout& stage_of(int stage) {
  if (stage < 0 || stage >= static_cast<int>(stage_table.size()))
    throw invalid_argument(fmt::format("zero: stage {} (expected 0, 1, 2 or 3)", stage));
  return stage_table[static_cast<std::size_t>(stage)];
}

}  // namespace ringzero::zero
