// Reading RINGZERO_* variables. Malformed values raise instead of being ignored: a typo in a
// job script should fail the first call, not silently change behaviour.
#pragma once

#include <charconv>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "ringzero/error.hpp"

namespace ringzero::detail {

[[nodiscard]] inline std::optional<std::string> getenv_str(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

[[nodiscard]] inline std::optional<long long> getenv_int(const char* name) {
  auto s = getenv_str(name);
  if (!s) return std::nullopt;
  long long v = 0;
  auto [p, ec] = std::from_chars(s->data(), s->data() + s->size(), v);
  if (ec != std::errc{} || p != s->data() + s->size())
    throw invalid_argument(std::string(name) + "='" + *s + "' is not an integer");
  return v;
}

/// The longest deadline ringzero accepts (about 31 years): far beyond any job, and far enough
/// below the clock's range that now() + timeout cannot overflow.
inline constexpr std::chrono::seconds max_timeout{1'000'000'000};

/// Throws invalid_argument naming `what` when a deadline is longer than max_timeout.
inline void check_timeout(const std::string& what, std::chrono::nanoseconds t) {
  if (t > max_timeout)
    throw invalid_argument(what + " is " + std::to_string(t.count()) +
                           " ns, longer than the longest deadline ringzero accepts (" +
                           std::to_string(max_timeout.count()) + " s)");
}

/// RINGZERO_TIMEOUT in seconds (fractions allowed), default 300.
[[nodiscard]] inline std::chrono::nanoseconds env_timeout() {
  auto s = getenv_str("RINGZERO_TIMEOUT");
  if (!s) return std::chrono::seconds(300);
  char* end = nullptr;
  const double secs = std::strtod(s->c_str(), &end);
  // !(x >= 1e-9) also refuses NaN; the upper bound refuses inf and keeps the cast defined.
  if (end == s->c_str() || *end != '\0' || !(secs >= 1e-9) ||
      secs > static_cast<double>(max_timeout.count()))
    throw invalid_argument("RINGZERO_TIMEOUT='" + *s +
                           "' is not a number of seconds from 0.000000001 to " +
                           std::to_string(max_timeout.count()));
  return std::chrono::nanoseconds(static_cast<long long>(secs * 1e9));
}

[[nodiscard]] inline bool env_flag(const char* name) {
  auto v = getenv_int(name);
  return v && *v != 0;
}

}  // namespace ringzero::detail
