// Reading RINGZERO_* variables. Malformed values raise instead of being ignored: a typo in a
// job script should fail the first call, not silently change behaviour.
#pragma once

#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>  // environ

#include "ringzero/error.hpp"

namespace ringzero::detail {

[[nodiscard]] inline std::optional<std::string> getenv_str(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

/// A comma-separated variable's items; nullopt when unset (or empty). An empty item (a doubled,
/// leading or trailing comma) is an invalid_argument naming the variable and the item.
[[nodiscard]] inline std::optional<std::vector<std::string>> getenv_list(const char* name) {
  auto v = getenv_str(name);
  if (!v) return std::nullopt;
  std::vector<std::string> out;
  std::string_view s = *v;
  for (;;) {
    const auto comma = s.find(',');
    const auto item = s.substr(0, comma);
    // A doubled, leading or trailing comma is a typo, not a wish for fewer items.
    if (item.empty())
      throw invalid_argument(std::string(name) + "='" + *v + "': item " +
                             std::to_string(out.size() + 1) +
                             " is empty (a doubled, leading or trailing comma?)");
    out.emplace_back(item);
    if (comma == std::string_view::npos) break;
    s.remove_prefix(comma + 1);
  }
  return out;
}

/// An integer variable's value; `name` is for the message.
[[nodiscard]] inline long long parse_env_int(const char* name, std::string_view s) {
  long long v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || p != s.data() + s.size())
    throw invalid_argument(std::string(name) + "='" + std::string(s) + "' is not an integer");
  return v;
}

[[nodiscard]] inline std::optional<long long> getenv_int(const char* name) {
  auto s = getenv_str(name);
  if (!s) return std::nullopt;
  return parse_env_int(name, *s);
}

/// RINGZERO_RAIL_SHARES, for every transport with rails: "measured" (or unset) weighs a striped
/// message's pieces by the rails' rates, "equal" does not.
[[nodiscard]] inline bool weigh_rails_from_env() {
  const auto v = getenv_str("RINGZERO_RAIL_SHARES");
  if (!v || *v == "measured") return true;
  if (*v == "equal") return false;
  throw invalid_argument("RINGZERO_RAIL_SHARES=" + *v + ": expected 'measured' or 'equal'");
}

/// RINGZERO_STRIPE_BYTES, for every transport with rails: messages of at least this many bytes
/// are striped over them; unset: `fallback` (the transport's option).
[[nodiscard]] inline std::size_t stripe_bytes_from_env(std::size_t fallback) {
  const auto v = getenv_int("RINGZERO_STRIPE_BYTES");
  if (!v) return fallback;
  if (*v < 0)
    throw invalid_argument("RINGZERO_STRIPE_BYTES=" + std::to_string(*v) +
                           " is negative: give a size in bytes");
  return static_cast<std::size_t>(*v);
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

/// The variables every collective reads, RINGZERO_ALGO and RINGZERO_CHECK, as set at the call
/// (empty counts as unset, as for getenv_str). Reading them must cost next to nothing: a small
/// shared-memory all_reduce takes a few hundred nanoseconds, and two getenv calls, each a scan
/// of every variable's text (a cluster job has a hundred or more), were a quarter of its host
/// time. setenv, unsetenv and putenv each change a pointer in `environ` (glibc never rewrites a
/// string it handed out), so this thread remembers the pointers it last scanned and scans the
/// text again only when one differs; a string passed to putenv and then edited in place is the
/// one change it cannot see. The views point into the environment: use them before it changes.
struct call_env {
  std::optional<std::string_view> algo;
  std::optional<std::string_view> check;

  [[nodiscard]] static call_env read() noexcept {
    thread_local std::vector<const char*> seen;
    thread_local call_env found;
    thread_local bool valid = false;
    char** env = ::environ;
    if (valid && env != nullptr && same_pointers(env, seen)) return found;
    found = scan(env);
    valid = false;
    try {
      seen.clear();
      for (char** p = env; p != nullptr && *p != nullptr; ++p) seen.push_back(*p);
      valid = true;
    } catch (...) {
      // Out of memory: scan again on the next call.
    }
    return found;
  }

  /// RINGZERO_CHECK as a flag: non-zero turns it on; a value that is no integer raises.
  [[nodiscard]] bool check_on() const { return check && parse_env_int("RINGZERO_CHECK", *check); }

 private:
  [[nodiscard]] static bool same_pointers(char** env, const std::vector<const char*>& seen) {
    for (std::size_t i = 0; i < seen.size(); ++i)
      if (env[i] != seen[i]) return false;  // a null env[i] (a shorter environment) differs too
    return env[seen.size()] == nullptr;
  }

  [[nodiscard]] static call_env scan(char** env) noexcept {
    call_env e;
    for (char** p = env; p != nullptr && *p != nullptr; ++p) {
      const char* v = *p;
      if (v[0] != 'R' || std::strncmp(v, "RINGZERO_", 9) != 0) continue;
      // The first definition wins, as getenv finds it.
      if (!e.algo && std::strncmp(v + 9, "ALGO=", 5) == 0)
        e.algo = std::string_view(v + 14);
      else if (!e.check && std::strncmp(v + 9, "CHECK=", 6) == 0)
        e.check = std::string_view(v + 15);
    }
    if (e.algo && e.algo->empty()) e.algo.reset();
    if (e.check && e.check->empty()) e.check.reset();
    return e;
  }
};

}  // namespace ringzero::detail
