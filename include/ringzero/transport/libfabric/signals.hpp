// Signal handlers that libfabric's PSM providers install into every program that links it.
//
// Debian's libfabric (and others built with the psm and psm2 providers) links libpsm_infinipath,
// whose libinfinipath installs, from its load-time constructor, handlers for SIGINT, SIGILL,
// SIGABRT, SIGBUS, SIGSEGV and SIGTERM that print a backtrace before the process ends (unless
// IPATH_NO_BACKTRACE is set in the environment before the program starts). The handler is not
// async-signal-safe: a SIGTERM that lands while the process holds malloc's lock (a launcher or
// `timeout` stopping a rank in the middle of a collective) waits on that lock forever with the
// signal blocked, so the rank never ends; a crash is reported by it instead of the default
// action (no core dump). It is there whether or not a PSM device exists, or libfabric is used.
//
// So, once per program at static initialization (after the libraries' constructors have run),
// each of those signals whose handler lives in libinfinipath or libpsm goes back to its default
// action. A handler the program or another library installed is left alone.
#pragma once

#include <dlfcn.h>

#include <csignal>
#include <cstring>
#include <string_view>

namespace ringzero::libfabric::detail {

/// The shared object that holds `handler`'s code, or "" if none does (the main program without
/// exported symbols still has a name; SIG_DFL and SIG_IGN have none).
[[nodiscard]] inline std::string_view object_of(const void* handler) noexcept {
  Dl_info info{};
  if (handler == nullptr || ::dladdr(handler, &info) == 0 || info.dli_fname == nullptr) return {};
  return info.dli_fname;
}

/// Whether `object` (a path as dladdr gives it) is one of the PSM libraries whose handlers hang.
[[nodiscard]] constexpr bool is_psm_library(std::string_view object) noexcept {
  const std::size_t slash = object.rfind('/');
  const std::string_view name = slash == std::string_view::npos ? object : object.substr(slash + 1);
  return name.starts_with("libinfinipath.") || name.starts_with("libpsm_infinipath.") ||
         name.starts_with("libpsm2.");
}

/// The handler installed for `sig`, as an address (nullptr for SIG_DFL, SIG_IGN or an error).
[[nodiscard]] inline const void* handler_of(int sig) noexcept {
  struct sigaction sa {};
  if (::sigaction(sig, nullptr, &sa) != 0) return nullptr;
  if ((sa.sa_flags & SA_SIGINFO) != 0) {
    const void* p = nullptr;
    static_assert(sizeof p == sizeof sa.sa_sigaction);
    std::memcpy(&p, &sa.sa_sigaction, sizeof p);
    return p;
  }
  if (sa.sa_handler == SIG_DFL || sa.sa_handler == SIG_IGN) return nullptr;
  const void* p = nullptr;
  static_assert(sizeof p == sizeof sa.sa_handler);
  std::memcpy(&p, &sa.sa_handler, sizeof p);
  return p;
}

/// The signals libinfinipath takes over.
inline constexpr int psm_signals[] = {SIGINT, SIGILL, SIGABRT, SIGBUS, SIGSEGV, SIGTERM};

/// Restores the default action of every signal in psm_signals whose handler is PSM's; returns
/// how many it restored.
inline int reset_psm_signal_handlers() noexcept {
  int reset = 0;
  for (const int sig : psm_signals) {
    if (!is_psm_library(object_of(handler_of(sig)))) continue;
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    if (::sigaction(sig, &dfl, nullptr) == 0) ++reset;
  }
  return reset;
}

/// Runs reset_psm_signal_handlers() once in every program that includes the libfabric transport.
inline const int psm_signal_handlers_reset = reset_psm_signal_handlers();

}  // namespace ringzero::libfabric::detail
