// Durable file writes for checkpoints: write a temporary name of its own, fsync it, rename it
// over the final name, fsync the directory. A reader therefore sees either the old file or the
// complete new one, even across a crash or power loss. Every failure is a checkpoint_error
// naming the path. Temporary names are unique (`<name>.tmp-<random>`, created with O_EXCL), so
// two writers never share one and a leftover of a killed writer is never reopened.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/core.h>

#include <sys/types.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/zero/detail/crc32c.hpp"

namespace ringzero::zero::detail {

[[nodiscard]] inline checkpoint_error file_error(const std::filesystem::path& path,
                                                 const char* what, int err) {
  return checkpoint_error(
      fmt::format("checkpoint file {}: {} failed: {}", path.string(), what, std::strerror(err)));
}

/// Owns a POSIX file descriptor.
class fd_guard {
 public:
  explicit fd_guard(int fd) noexcept : fd_(fd) {}
  fd_guard(const fd_guard&) = delete;
  fd_guard& operator=(const fd_guard&) = delete;
  ~fd_guard() {
    if (fd_ >= 0) ::close(fd_);
  }
  [[nodiscard]] int get() const noexcept { return fd_; }
  int release() noexcept {
    const int f = fd_;
    fd_ = -1;
    return f;
  }

 private:
  int fd_;
};

inline void fsync_directory(const std::filesystem::path& dir) {
  fd_guard fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) throw file_error(dir, "open (directory)", errno);
  if (::fsync(fd.get()) != 0) throw file_error(dir, "fsync (directory)", errno);
}

/// A fresh 64-bit value for names that must not repeat across saves, processes or hosts. Drawn
/// anew from the system's entropy each time: a generator kept in memory would repeat its
/// sequence in every process forked from the one that seeded it.
[[nodiscard]] inline std::uint64_t unique_id() {
  std::random_device rd;
  const auto t =
      static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  const std::uint64_t r = (std::uint64_t{rd()} << 32) ^ rd();
  return r ^ (t * 0x9e3779b97f4a7c15ull) ^ (static_cast<std::uint64_t>(::getpid()) << 17);
}

/// Marker in the names of temporary files: what a cleanup may remove.
inline constexpr const char* temporary_marker = ".tmp-";

/// Creates `dir` and any missing parents, fsyncing the parent of each directory it creates so
/// the new entries survive a crash. Another rank creating the same directory at once is fine.
inline void create_directories_durable(const std::filesystem::path& dir) {
  std::error_code ec;
  if (std::filesystem::is_directory(dir, ec)) return;
  const auto abs = std::filesystem::absolute(dir, ec);
  if (ec)
    throw checkpoint_error(
        fmt::format("cannot create the checkpoint directory {}: {}", dir.string(), ec.message()));
  std::vector<std::filesystem::path> missing;
  for (auto p = abs; !p.empty() && !std::filesystem::exists(p, ec); p = p.parent_path()) {
    missing.push_back(p);
    if (p == p.parent_path()) break;
  }
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    if (::mkdir(it->c_str(), 0755) != 0 && errno != EEXIST)
      throw checkpoint_error(fmt::format("cannot create the checkpoint directory {}: mkdir {}: {}",
                                         dir.string(), it->string(), std::strerror(errno)));
    if (!std::filesystem::is_directory(*it, ec))
      throw checkpoint_error(
          fmt::format("cannot create the checkpoint directory {}: {} exists and is not a directory",
                      dir.string(), it->string()));
    fsync_directory(it->parent_path());
  }
  if (!std::filesystem::is_directory(abs, ec))
    throw checkpoint_error(fmt::format(
        "cannot create the checkpoint directory {}: a path component is not a directory",
        dir.string()));
}

struct written_file {
  std::uint64_t bytes = 0;
  std::uint32_t crc = 0;
};

/// Writes the concatenation of `parts` to `path` atomically and returns its size and CRC-32C.
inline written_file write_file_atomic(const std::filesystem::path& path,
                                      std::span<const std::span<const std::byte>> parts) {
  const std::filesystem::path tmp =
      fmt::format("{}{}{:016x}", path.string(), temporary_marker, unique_id());
  // A failed write leaves no temporary behind (a killed one does; the next commit removes it).
  struct remove_unless_renamed {
    const std::filesystem::path& p;
    bool renamed = false;
    ~remove_unless_renamed() {
      if (!renamed) ::unlink(p.c_str());
    }
  } guard{tmp};
  written_file result;
  {
    fd_guard fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (fd.get() < 0) throw file_error(tmp, "open", errno);
    for (auto part : parts) {
      result.crc = crc32c_update(result.crc, part);
      std::size_t done = 0;
      while (done < part.size()) {
        const ssize_t w = ::write(fd.get(), part.data() + done, part.size() - done);
        if (w < 0) {
          if (errno == EINTR) continue;
          throw file_error(tmp, "write", errno);
        }
        done += static_cast<std::size_t>(w);
      }
      result.bytes += part.size();
    }
    if (::fsync(fd.get()) != 0) throw file_error(tmp, "fsync", errno);
    if (::close(fd.release()) != 0) throw file_error(tmp, "close", errno);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw file_error(path, "rename", errno);
  guard.renamed = true;
  fsync_directory(path.has_parent_path() ? path.parent_path() : std::filesystem::path("."));
  return result;
}

inline written_file write_file_atomic(const std::filesystem::path& path,
                                      std::initializer_list<std::span<const std::byte>> parts) {
  return write_file_atomic(path, std::span(parts.begin(), parts.size()));
}

/// The whole file; a missing file is reported as such so an incomplete checkpoint is obvious.
[[nodiscard]] inline std::vector<std::byte> read_file(const std::filesystem::path& path) {
  fd_guard fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT)
      throw checkpoint_error(fmt::format("checkpoint file {} is missing", path.string()));
    throw file_error(path, "open", errno);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw file_error(path, "stat", errno);
  std::vector<std::byte> data(static_cast<std::size_t>(st.st_size));
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t r = ::read(fd.get(), data.data() + done, data.size() - done);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw file_error(path, "read", errno);
    }
    if (r == 0) break;
    done += static_cast<std::size_t>(r);
  }
  if (done != data.size())
    throw checkpoint_error(
        fmt::format("checkpoint file {} shrank while being read ({} of {} bytes)", path.string(),
                    done, data.size()));
  return data;
}

}  // namespace ringzero::zero::detail
