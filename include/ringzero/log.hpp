// Logging through fmt, NCCL-style: RINGZERO_DEBUG=WARN (default) | INFO | TRACE, each line
// prefixed "host:pid:rank" so interleaved output from many ranks can be told apart. ERROR lines
// (a process ending on purpose) are printed at every level but NONE.
#pragma once

#include <fmt/core.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <string>
#include <string_view>

#include "ringzero/detail/env.hpp"

// ringzero::ringzero defines this for CUDA sources (see CMakeLists.txt); without it fmt < 10.1
// fails on every format string under nvcc, with errors that do not name the cause.
#if defined(__NVCC__) && defined(FMT_USE_CONSTEXPR) && !FMT_USE_CONSTEXPR
#error "ringzero under nvcc needs fmt's constexpr: compile with -DFMT_USE_CONSTEXPR=1 (fmt < 10.1)"
#endif

namespace ringzero::log {

enum class level : int { none = 0, error = 1, warn = 2, info = 3, trace = 4 };

namespace detail {

[[nodiscard]] inline level parse_level(std::string_view s) {
  if (s == "NONE" || s == "none") return level::none;
  if (s == "ERROR" || s == "error") return level::error;
  if (s == "WARN" || s == "warn") return level::warn;
  if (s == "INFO" || s == "info") return level::info;
  if (s == "TRACE" || s == "trace") return level::trace;
  throw invalid_argument("RINGZERO_DEBUG='" + std::string(s) +
                         "' is not one of NONE, ERROR, WARN, INFO, TRACE");
}

inline std::atomic<int>& current_level() {
  static std::atomic<int> lvl{[] {
    auto s = ringzero::detail::getenv_str("RINGZERO_DEBUG");
    return static_cast<int>(s ? parse_level(*s) : level::warn);
  }()};
  return lvl;
}

/// The rank this process reports as; set by communicators built from the environment.
inline std::atomic<int>& process_rank() {
  static std::atomic<int> r{-1};
  return r;
}

inline const std::string& host_name() {
  static const std::string name = [] {
    char buf[256] = {};
    if (::gethostname(buf, sizeof buf - 1) != 0) return std::string("?");
    return std::string(buf);
  }();
  return name;
}

inline void write(level lvl, std::string_view msg) {
  static constexpr const char* tags[] = {"", "ERROR", "WARN", "INFO", "TRACE"};
  const std::string line = fmt::format("{}:{}:{} ringzero {} {}\n", host_name(), ::getpid(),
                                       process_rank().load(), tags[static_cast<int>(lvl)], msg);
  std::fputs(line.c_str(), stderr);
}

}  // namespace detail

[[nodiscard]] inline bool enabled(level lvl) noexcept {
  return static_cast<int>(lvl) <= detail::current_level().load(std::memory_order_relaxed);
}

inline void set_level(level lvl) noexcept {
  detail::current_level().store(static_cast<int>(lvl));
}

/// What ends the process or the job: printed at every level but NONE.
template <class... Args>
void error(fmt::format_string<Args...> f, Args&&... args) {
  if (enabled(level::error))
    detail::write(level::error, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void warn(fmt::format_string<Args...> f, Args&&... args) {
  if (enabled(level::warn)) detail::write(level::warn, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void info(fmt::format_string<Args...> f, Args&&... args) {
  if (enabled(level::info)) detail::write(level::info, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void trace(fmt::format_string<Args...> f, Args&&... args) {
  if (enabled(level::trace))
    detail::write(level::trace, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace ringzero::log
