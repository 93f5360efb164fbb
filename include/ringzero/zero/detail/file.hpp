// Durable file writes for checkpoints: write a temporary name, fsync it, rename it over the final
// name, fsync the directory. A reader therefore sees either the old file or the complete new
// one, even across a crash or power loss. Every failure is a checkpoint_error naming the path.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/core.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <initializer_list>
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

struct written_file {
  std::uint64_t bytes = 0;
  std::uint32_t crc = 0;
};

/// Writes the concatenation of `parts` to `path` atomically and returns its size and CRC-32C.
inline written_file write_file_atomic(const std::filesystem::path& path,
                                      std::span<const std::span<const std::byte>> parts) {
  const std::filesystem::path tmp = path.string() + ".tmp";
  written_file result;
  {
    fd_guard fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
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
