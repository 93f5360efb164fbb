// Deprecated: moved to ringzero/model/fabric.hpp in 0.4 (the predictions over the algorithm table
// sit above the algorithms; tuning/ holds the constants below them). Removed in 0.5.
#pragma once

#pragma message("ringzero/tuning/fabric.hpp is deprecated: include ringzero/model/fabric.hpp")
#include "ringzero/model/fabric.hpp"
