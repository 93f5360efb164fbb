// One rank's trace file, written as Chrome's "JSON array" trace format one event per line:
//
//   [{"name":"process_name",...}
//   ,{"name":"all_reduce","ph":"X",...}
//   ]
//
// Each line goes to the kernel in one write(2) as soon as its event ends, so a process that is
// killed (SIGKILL included) leaves every finished event on disk; only the closing bracket is
// missing, which the trace format allows and ringzero-trace tolerates.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <fmt/compile.h>
#include <fmt/format.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>
#include <string>
#include <string_view>

#include "ringzero/error.hpp"
#include "ringzero/log.hpp"

namespace ringzero::detail {

/// Appends s to out as the inside of a JSON string.
inline void json_escape(fmt::memory_buffer& out, std::string_view s) {
  for (char c : s) {
    switch (c) {
      case '"':
        out.append(std::string_view("\\\""));
        break;
      case '\\':
        out.append(std::string_view("\\\\"));
        break;
      case '\n':
        out.append(std::string_view("\\n"));
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20)
          fmt::format_to(std::back_inserter(out), "\\u{:04x}", static_cast<unsigned>(c));
        else
          out.push_back(c);
    }
  }
}

/// Appends a non-negative count of nanoseconds as microseconds with three decimals; integer
/// formatting, because a float's costs a noticeable share of a traced 8-byte collective.
inline void append_us(fmt::memory_buffer& out, std::int64_t ns) {
  if (ns < 0) ns = 0;
  fmt::format_to(std::back_inserter(out), FMT_COMPILE("{}.{:03}"), ns / 1000, ns % 1000);
}

/// Where RINGZERO_TRACE=<value> puts a rank's file: %r, %p and %h in value stand for the rank,
/// the process id and the host name; without %r, value is a directory that receives
/// rank<R>.json. A second communicator of the same rank in one process gets rank<R>-<k>.json,
/// so that a split or a second world never overwrites the first one's events.
class trace_paths {
 public:
  /// The path for rank `rank` and the instance number k (0 for the first file of that path).
  static std::pair<std::string, int> claim(std::string_view value, int rank) {
    std::string base;
    const bool pattern = value.find("%r") != std::string_view::npos;
    for (std::size_t i = 0; i < value.size(); ++i) {
      if (value[i] == '%' && i + 1 < value.size()) {
        const char f = value[i + 1];
        if (f == 'r' || f == 'p' || f == 'h') {
          base += f == 'r'   ? std::to_string(rank)
                  : f == 'p' ? std::to_string(::getpid())
                             : log::detail::host_name();
          ++i;
          continue;
        }
      }
      base += value[i];
    }
    std::filesystem::path p(base);
    if (!pattern) {
      std::error_code ec;
      std::filesystem::create_directories(p, ec);
      if (ec)
        throw invalid_argument(fmt::format("RINGZERO_TRACE={}: cannot create the directory ({})",
                                           value, ec.message()));
      p /= fmt::format("rank{}.json", rank);
    }
    static std::mutex m;
    static std::set<std::string> taken;
    const std::lock_guard<std::mutex> lock(m);
    for (int k = 0;; ++k) {
      std::filesystem::path candidate = p;
      if (k > 0)
        candidate.replace_filename(
            fmt::format("{}-{}{}", p.stem().string(), k, p.extension().string()));
      if (taken.insert(candidate.string()).second) return {candidate.string(), k};
    }
  }
};

class trace_writer {
 public:
  trace_writer(std::string path, int rank, int instance)
      : path_(std::move(path)), rank_(rank), instance_(instance) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0)
      throw invalid_argument(
          fmt::format("RINGZERO_TRACE: cannot write {} ({})", path_, std::strerror(errno)));
  }
  trace_writer(const trace_writer&) = delete;
  trace_writer& operator=(const trace_writer&) = delete;
  ~trace_writer() {
    const std::lock_guard<std::mutex> lock(mutex_);
    write_all("]\n", 2);
    ::close(fd_);
  }

  /// Writes one event as its own line: format(buffer) appends the JSON object. Thread-safe: a
  /// phase may end on another thread than the collectives.
  template <class F>
  void event_with(F&& format) {
    const std::lock_guard<std::mutex> lock(mutex_);
    line_.clear();
    line_.push_back(first_ ? '[' : ',');
    first_ = false;
    format(line_);
    line_.push_back('\n');
    write_all(line_.data(), line_.size());
  }
  void event(std::string_view object) {
    event_with([&](fmt::memory_buffer& b) { b.append(object); });
  }

  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  /// The rank whose file this is: the track its events, nested ones included, belong to.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int instance() const noexcept { return instance_; }
  /// Chrome-trace thread ids of this file's two tracks: collectives, and phases above them
  /// (phases may run on another thread, so they do not nest with the collectives' slices).
  [[nodiscard]] int collective_tid() const noexcept { return 2 * instance_ + 1; }
  [[nodiscard]] int phase_tid() const noexcept { return 2 * instance_; }
  /// Numbers the collectives in the order this rank started them; every rank starts the same
  /// collectives in the same order, so (instance, seq) names one collective across the files.
  [[nodiscard]] std::uint64_t next_seq() noexcept { return seq_++; }

 private:
  void write_all(const char* p, std::size_t left) {
    while (left > 0) {
      const ssize_t w = ::write(fd_, p, left);
      if (w < 0 && errno == EINTR) continue;
      // A full disk loses the trace, not the training run.
      if (w <= 0) {
        if (!failed_)
          log::warn("RINGZERO_TRACE: writing {} failed: {}", path_, std::strerror(errno));
        failed_ = true;
        return;
      }
      p += w;
      left -= static_cast<std::size_t>(w);
    }
  }

  std::mutex mutex_;
  fmt::memory_buffer line_;
  std::string path_;
  int rank_ = 0;
  int instance_ = 0;
  int fd_ = -1;
  bool first_ = true;
  bool failed_ = false;
  std::uint64_t seq_ = 0;
};

}  // namespace ringzero::detail
