// A store in a directory on a filesystem every rank sees (NFS, Lustre, a local disk for ranks
// on one host): for clusters where ranks cannot open TCP connections to each other before the
// fabric is up, or where no port is free. One file per key.
//
// - set() writes a temporary file and renames it over the key's file, so a reader sees the
//   old value or the new one, never a torn write.
// - add() holds a lock file (created with O_EXCL, which NFSv3+ implements atomically) while it
//   reads, increments and rewrites the counter.
// - get() and wait() poll (1 ms doubling to 50 ms) until the deadline.
//
// Use one fresh directory per job: files from an earlier job would satisfy this job's get().
// A rank killed inside add() leaves its lock file behind; the next add() on that key fails at
// the deadline naming the file to remove. Keys may be at most 200 bytes (they become names).
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "ringzero/bootstrap/detail/protocol.hpp"
#include "ringzero/bootstrap/detail/socket.hpp"
#include "ringzero/bootstrap/store.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"

namespace ringzero::bootstrap {

class file_store final : public store {
 public:
  static constexpr std::size_t max_key_bytes = 200;

  /// Uses (and creates, if missing) `directory`.
  explicit file_store(std::filesystem::path directory,
                      std::chrono::nanoseconds timeout = ringzero::detail::env_timeout())
      : dir_(std::move(directory)), timeout_(timeout) {
    if (timeout_ <= std::chrono::nanoseconds::zero())
      throw invalid_argument("file_store: the timeout must be positive");
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec || !std::filesystem::is_directory(dir_))
      throw bootstrap_error(fmt::format("file_store: cannot use directory '{}': {}", dir_.string(),
                                        ec ? ec.message() : "not a directory"));
  }

  void set(std::string_view key, std::span<const std::byte> value) override {
    write_atomically(path_of(key), value);
  }

  [[nodiscard]] std::vector<std::byte> get(std::string_view key) override {
    return get_within(key, timeout_);
  }

  [[nodiscard]] std::vector<std::byte> get_within(std::string_view key,
                                                  std::chrono::nanoseconds limit) override {
    const auto path = path_of(key);
    const auto deadline = detail::clock::now() + std::min(limit, timeout_);
    poller p;
    for (;;) {
      if (auto v = read_file(path)) return std::move(*v);
      if (!p.pause(deadline)) throw timed_out(key);
    }
  }

  std::int64_t add(std::string_view key, std::int64_t delta) override {
    const auto path = path_of(key);
    const auto deadline = detail::clock::now() + timeout_;
    const auto lock = lock_path(key);
    lock_guard guard(lock, deadline, key, *this);
    std::int64_t now = 0;
    if (auto v = read_file(path); v && !detail::parse_counter(*v, now))
      throw bootstrap_error(
          fmt::format("file_store: add: the value under '{}' is not an integer", key));
    std::int64_t next = 0;
    if (__builtin_add_overflow(now, delta, &next))
      throw bootstrap_error(fmt::format("file_store: add: the counter '{}' would overflow", key));
    write_atomically(path, detail::counter_bytes(next));
    return next;
  }

  void wait(std::span<const std::string> keys) override {
    const auto deadline = detail::clock::now() + timeout_;
    for (const auto& key : keys) {
      const auto path = path_of(key);
      poller p;
      struct stat st {};
      while (::stat(path.c_str(), &st) != 0)
        if (!p.pause(deadline)) throw timed_out(key);
    }
  }

  [[nodiscard]] const std::filesystem::path& directory() const noexcept { return dir_; }
  [[nodiscard]] std::chrono::nanoseconds timeout() const noexcept { return timeout_; }

 private:
  class poller {
   public:
    // Sleeps before the next attempt; false once the deadline has passed.
    bool pause(detail::clock::time_point deadline) {
      const auto now = detail::clock::now();
      if (now >= deadline) return false;
      std::this_thread::sleep_for(std::min<detail::clock::duration>(delay_, deadline - now));
      delay_ = std::min(delay_ * 2, std::chrono::microseconds(50000));
      return true;
    }

   private:
    std::chrono::microseconds delay_{1000};
  };

  class lock_guard {
   public:
    lock_guard(std::string path, detail::clock::time_point deadline, std::string_view key,
               const file_store& owner)
        : path_(std::move(path)) {
      poller p;
      for (;;) {
        detail::unique_fd fd(::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
        if (fd) return;
        if (errno != EEXIST)
          throw bootstrap_error(fmt::format("file_store: cannot create lock file '{}': {}", path_,
                                            detail::errno_text(errno)));
        if (!p.pause(deadline))
          throw timeout_error(
              fmt::format("file_store: timed out after {} waiting for the lock on key '{}'; if no "
                          "rank of this job is inside add(), remove the stale '{}'",
                          detail::seconds_text(owner.timeout_), key, path_),
              -1);
      }
    }
    lock_guard(const lock_guard&) = delete;
    lock_guard& operator=(const lock_guard&) = delete;
    ~lock_guard() { ::unlink(path_.c_str()); }

   private:
    std::string path_;
  };

  // Key bytes outside [A-Za-z0-9_-] become %XX, so every key is one safe file name.
  [[nodiscard]] std::string encode(std::string_view key) const {
    if (key.empty()) throw invalid_argument("file_store: keys must not be empty");
    if (key.size() > max_key_bytes)
      throw invalid_argument(
          fmt::format("file_store: key '{}' is longer than {} bytes", key, max_key_bytes));
    std::string out;
    for (char ch : key) {
      const auto c = static_cast<unsigned char>(ch);
      if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
          c == '-')
        out += ch;
      else
        out += fmt::format("%{:02X}", c);
    }
    return out;
  }

  [[nodiscard]] std::string path_of(std::string_view key) const {
    return (dir_ / ("k." + encode(key))).string();
  }
  [[nodiscard]] std::string lock_path(std::string_view key) const {
    return (dir_ / ("l." + encode(key))).string();
  }

  [[nodiscard]] timeout_error timed_out(std::string_view key) const {
    return timeout_error(fmt::format("file_store: timed out after {} waiting for key '{}' in '{}' "
                                     "(no rank has set it; RINGZERO_TIMEOUT sets the limit)",
                                     detail::seconds_text(timeout_), key, dir_.string()),
                         -1);
  }

  // The whole file, or nothing if it does not exist (yet).
  [[nodiscard]] static std::optional<std::vector<std::byte>> read_file(const std::string& path) {
    detail::unique_fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) {
      if (errno == ENOENT) return std::nullopt;
      throw bootstrap_error(
          fmt::format("file_store: cannot open '{}': {}", path, detail::errno_text(errno)));
    }
    std::vector<std::byte> data;
    std::byte buf[65536];
    for (;;) {
      const ssize_t n = ::read(fd.get(), buf, sizeof buf);
      if (n > 0) {
        data.insert(data.end(), buf, buf + n);
        continue;
      }
      if (n == 0) return data;
      if (errno == EINTR) continue;
      throw bootstrap_error(
          fmt::format("file_store: cannot read '{}': {}", path, detail::errno_text(errno)));
    }
  }

  void write_atomically(const std::string& path, std::span<const std::byte> value) {
    const std::string tmp = (dir_ / fmt::format(".tmp.{}.{}.{}", log::detail::host_name(),
                                                ::getpid(), next_temp_.fetch_add(1)))
                                .string();
    detail::unique_fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (!fd)
      throw bootstrap_error(
          fmt::format("file_store: cannot create '{}': {}", tmp, detail::errno_text(errno)));
    std::size_t done = 0;
    while (done < value.size()) {
      const ssize_t n = ::write(fd.get(), value.data() + done, value.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = errno;
        ::unlink(tmp.c_str());
        throw bootstrap_error(
            fmt::format("file_store: cannot write '{}': {}", tmp, detail::errno_text(err)));
      }
      done += static_cast<std::size_t>(n);
    }
    // close() is where NFS reports a failed write-back.
    if (::close(fd.release()) != 0) {
      const int err = errno;
      ::unlink(tmp.c_str());
      throw bootstrap_error(
          fmt::format("file_store: cannot write '{}': {}", tmp, detail::errno_text(err)));
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      const int err = errno;
      ::unlink(tmp.c_str());
      throw bootstrap_error(fmt::format("file_store: cannot rename '{}' to '{}': {}", tmp, path,
                                        detail::errno_text(err)));
    }
  }

  std::filesystem::path dir_;
  std::chrono::nanoseconds timeout_;
  std::atomic<std::uint64_t> next_temp_{0};
};

}  // namespace ringzero::bootstrap
