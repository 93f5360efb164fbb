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
/// time; comparing every pointer of `environ` with the last scan's was still a quarter of what
/// was left. The C library changes the array in three ways only (glibc and musl alike): setenv
/// and putenv of a new name append it (the count changes), of a name already set they replace
/// that entry's pointer in place, and unsetenv removes an entry and moves the later ones down
/// (the count changes). So this thread keeps, from its last scan, the array, its count, its last
/// pointer and the pointers of the two entries it found, and scans again only when one of them
/// differs: an unsetenv followed by a setenv keeps the count but changes the last pointer. What
/// it cannot see is a string passed to putenv and then edited in place, or an array rewritten by
/// hand. The views point into the environment: use them before it changes.
struct call_env {
  std::optional<std::string_view> algo;
  std::optional<std::string_view> check;

  [[nodiscard]] static call_env read() noexcept;

  /// RINGZERO_CHECK as a flag: non-zero turns it on; a value that is no integer raises.
  [[nodiscard]] bool check_on() const { return check && parse_env_int("RINGZERO_CHECK", *check); }
};

/// What call_env::read's last scan saw: enough to tell, in a few loads, that nothing it read
/// has changed since.
struct call_env_snapshot {
  call_env found;
  char** env = nullptr;
  std::size_t count = 0;
  const char* last = nullptr;  ///< env[count - 1]
  /// The entries `found` points into (index, pointer), or count for none.
  std::size_t at[2] = {0, 0};
  const char* was[2] = {nullptr, nullptr};
  bool valid = false;

  [[nodiscard]] bool unchanged() const noexcept {
    if (env == nullptr) return true;
    if (env[count] != nullptr || (count > 0 && env[count - 1] != last)) return false;
    for (int k = 0; k < 2; ++k)
      if (at[k] < count && env[at[k]] != was[k]) return false;
    return true;
  }

  [[nodiscard]] static call_env_snapshot scan(char** env) noexcept {
    call_env_snapshot s;
    s.env = env;
    s.valid = true;
    std::size_t n = 0;
    for (char** p = env; p != nullptr && *p != nullptr; ++p, ++n) {
      const char* v = *p;
      if (v[0] != 'R' || std::strncmp(v, "RINGZERO_", 9) != 0) continue;
      // The first definition wins, as getenv finds it.
      if (!s.found.algo && std::strncmp(v + 9, "ALGO=", 5) == 0) {
        s.found.algo = std::string_view(v + 14);
        s.at[0] = n;
        s.was[0] = v;
      } else if (!s.found.check && std::strncmp(v + 9, "CHECK=", 6) == 0) {
        s.found.check = std::string_view(v + 15);
        s.at[1] = n;
        s.was[1] = v;
      }
    }
    s.count = n;
    if (!s.found.algo) s.at[0] = n;
    if (!s.found.check) s.at[1] = n;
    s.last = n > 0 ? env[n - 1] : nullptr;
    if (s.found.algo && s.found.algo->empty()) s.found.algo.reset();
    if (s.found.check && s.found.check->empty()) s.found.check.reset();
    return s;
  }
};

inline call_env call_env::read() noexcept {
  constinit thread_local call_env_snapshot last;
  char** env = ::environ;
  if (last.valid && env == last.env && last.unchanged()) return last.found;
  last = call_env_snapshot::scan(env);
  return last.found;
}

}  // namespace ringzero::detail
