#pragma once

#define RINGZERO_VERSION_MAJOR 0
#define RINGZERO_VERSION_MINOR 1
#define RINGZERO_VERSION_PATCH 0

namespace ringzero {
inline constexpr const char* version_string = "0.1.0";
}  // namespace ringzero
