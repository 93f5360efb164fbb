// What an elastic session deals in: a generation's members and this process's rank among them,
// and the sizes a generation may take. Apart from elastic.hpp so that the heartbeat's watchers
// (elastic/detail/heartbeat.hpp), which elastic::session holds, can name a generation.
#pragma once

#include <fmt/format.h>

#include <charconv>
#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>
#include <string_view>
#include <system_error>
#include <vector>

#include "ringzero/error.hpp"

namespace ringzero::elastic {

/// One generation of the job.
struct membership {
  std::uint64_t generation = 0;
  int rank = 0;                                     ///< this process's rank in the generation
  std::vector<std::int64_t> members;                ///< member ids, in rank order
  std::vector<std::int64_t> lost;                   ///< members of the previous generation left out
  std::vector<std::int64_t> arrived;                ///< members new in this generation
  std::chrono::steady_clock::duration formed_in{};  ///< from asking to form it to its list
  [[nodiscard]] int size() const noexcept { return static_cast<int>(members.size()); }
};

struct limits {
  int min = 1;
  int max = INT_MAX;
  /// Sizes a generation may take (the trainer's batch must split over them); the closer takes
  /// the largest allowed count of those present. Must give the same answers on every process.
  std::function<bool(int)> allowed = [](int) { return true; };
};

/// "MIN:MAX", "N" (MIN = MAX = N) or "MIN:" (no maximum).
[[nodiscard]] inline limits parse_limits(std::string_view s) {
  const auto num = [&](std::string_view t) {
    int v = 0;
    const auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    if (ec != std::errc{} || p != t.data() + t.size() || v < 1)
      throw invalid_argument(
          fmt::format("elastic limits '{}': expected MIN:MAX with positive integers", s));
    return v;
  };
  limits l;
  const auto colon = s.find(':');
  if (colon == std::string_view::npos) {
    l.min = l.max = num(s);
  } else {
    l.min = num(s.substr(0, colon));
    l.max = colon + 1 == s.size() ? INT_MAX : num(s.substr(colon + 1));
  }
  if (l.min > l.max)
    throw invalid_argument(fmt::format("elastic limits '{}': MIN is above MAX", s));
  return l;
}

}  // namespace ringzero::elastic
