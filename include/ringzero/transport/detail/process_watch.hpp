// How a transport tells a live peer process from a dead one on its own host, written once: the
// kernel's /proc/<pid>/stat, read without allocating (the watchers run on their own threads and
// inside waits), with the start time that tells a reused pid apart from the rank that had it.
// libfabric's watchdog and the shm engine both take their reading from here; libfabric's
// watchdog and the socket transport name their peers by process_id, published at setup.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <fmt/core.h>

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

#include "ringzero/log.hpp"

namespace ringzero::detail {

/// What /proc/<pid>/stat says of a process: its state letter (R, S, D, T, t, Z, X...) and its
/// start time in clock ticks since boot.
struct process_stat {
  char state = '?';
  std::uint64_t start = 0;

  /// Gone for good: a zombie (killed, not yet reaped) or dead; it will never answer again.
  [[nodiscard]] constexpr bool ended() const noexcept {
    return state == 'Z' || state == 'X' || state == 'x';
  }
  /// Stopped by a signal or a debugger: alive, but not running.
  [[nodiscard]] constexpr bool stopped() const noexcept { return state == 'T' || state == 't'; }
};

/// Parses the text of /proc/<pid>/stat. The command name (field 2, in parentheses) may hold
/// spaces and parentheses itself, so fields are counted from its last ')': field 3 is the state,
/// field 22 the start time.
[[nodiscard]] constexpr std::optional<process_stat> parse_process_stat(
    std::string_view line) noexcept {
  const auto close = line.rfind(')');
  if (close == std::string_view::npos) return std::nullopt;
  std::string_view rest = line.substr(close + 1);
  const auto next_field = [&rest]() -> std::string_view {
    const auto b = rest.find_first_not_of(' ');
    if (b == std::string_view::npos) return {};
    rest.remove_prefix(b);
    const auto e = rest.find_first_of(" \n");
    const std::string_view f = rest.substr(0, e);
    rest.remove_prefix(e == std::string_view::npos ? rest.size() : e);
    return f;
  };
  process_stat s;
  for (int field = 3; field <= 22; ++field) {
    const std::string_view f = next_field();
    if (f.empty()) return std::nullopt;
    if (field == 3) s.state = f[0];
    if (field == 22) {
      std::uint64_t v = 0;
      for (const char c : f) {
        if (c < '0' || c > '9') return std::nullopt;
        v = v * 10 + static_cast<std::uint64_t>(c - '0');
      }
      s.start = v;
    }
  }
  return s;
}

/// /proc/<pid>/stat of a process on this host; nothing when there is no such process (or /proc
/// cannot be read). No allocation: a fixed buffer holds the line, whose command name is at most
/// 16 bytes.
[[nodiscard]] inline std::optional<process_stat> read_process_stat(std::int64_t pid) noexcept {
  char path[48];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", static_cast<long long>(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  char buf[1024];
  const ssize_t got = ::read(fd, buf, sizeof buf);
  ::close(fd);
  if (got <= 0) return std::nullopt;
  return parse_process_stat(std::string_view(buf, static_cast<std::size_t>(got)));
}

/// Who a process is, as other processes on its host can check it: published at rendezvous.
struct process_id {
  std::string host;  ///< host name and pid namespace: pids mean the same only where both match
  long pid = 0;
  std::uint64_t start = 0;  ///< start time in clock ticks since boot: tells a reused pid apart

  [[nodiscard]] std::string text() const { return fmt::format("{} {} {}", pid, start, host); }

  [[nodiscard]] static std::optional<process_id> parse(std::string_view s) {
    process_id p;
    const auto sp1 = s.find(' ');
    if (sp1 == std::string_view::npos) return std::nullopt;
    const auto sp2 = s.find(' ', sp1 + 1);
    if (sp2 == std::string_view::npos) return std::nullopt;
    const char* b = s.data();
    if (std::from_chars(b, b + sp1, p.pid).ec != std::errc{} || p.pid <= 0) return std::nullopt;
    if (std::from_chars(b + sp1 + 1, b + sp2, p.start).ec != std::errc{}) return std::nullopt;
    p.host = std::string(s.substr(sp2 + 1));
    return p;
  }
};

enum class process_state { alive, stopped, gone, unknown };

[[nodiscard]] inline process_id self_process() {
  process_id p;
  p.pid = static_cast<long>(::getpid());
  const auto st = ringzero::detail::read_process_stat(p.pid);
  p.start = st ? st->start : 0;
  std::string ns = "?";
  char buf[64] = {};
  if (const ssize_t n = ::readlink("/proc/self/ns/pid", buf, sizeof buf - 1); n > 0)
    ns.assign(buf, static_cast<std::size_t>(n));
  p.host = fmt::format("{}/{}", log::detail::host_name(), ns);
  return p;
}

/// How `p` is doing, seen from a process on the same host (`unknown` from elsewhere).
[[nodiscard]] inline process_state probe(const process_id& p, const process_id& self) {
  if (p.host != self.host || p.start == 0) return process_state::unknown;
  const auto st = ringzero::detail::read_process_stat(p.pid);
  if (!st || st->start != p.start || st->ended()) return process_state::gone;
  return st->stopped() ? process_state::stopped : process_state::alive;
}

}  // namespace ringzero::detail
