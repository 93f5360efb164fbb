// Deprecated: moved to ringzero/model/cost_model.hpp in 0.4 (the predictions over the algorithm
// table sit above the algorithms; tuning/ holds the constants below them). Removed in 0.5.
#pragma once

#pragma message( \
    "ringzero/tuning/cost_model.hpp is deprecated: include ringzero/model/cost_model.hpp")
#include "ringzero/model/cost_model.hpp"
