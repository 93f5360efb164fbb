// The shared segment of the shm transport: a POSIX shared-memory object mapped by every rank of
// the node, and the liveness of the processes behind the ranks.
//
// Nothing in the segment is guarded by a lock: every field is written by one rank only (its own
// record, the producer side of a channel) and read by the others with acquire loads, so a rank
// killed at any instant leaves nothing another rank must wait to be released.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/core.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>

#include "ringzero/detail/shm_names.hpp"
#include "ringzero/error.hpp"
#include "ringzero/transport/detail/process_watch.hpp"

namespace ringzero::shm::detail {

inline constexpr std::size_t cache_line = 64;

[[nodiscard]] constexpr std::size_t round_up(std::size_t n, std::size_t to) noexcept {
  return (n + to - 1) / to * to;
}

/// A process as the kernel knows it: the pid, and its start time in clock ticks since boot, so
/// that a pid the kernel reused for another process is not mistaken for the rank.
struct process_id {
  std::int64_t pid = 0;
  std::uint64_t start = 0;
  friend bool operator==(const process_id&, const process_id&) = default;
};

/// The process `pid` as /proc shows it; {0, 0} when there is no such process or it is a zombie
/// (killed, not yet reaped: it will never answer again).
[[nodiscard]] inline process_id read_process(std::int64_t pid) noexcept {
  const auto st = ringzero::detail::read_process_stat(pid);
  if (!st || st->ended()) return {};
  return {pid, st->start};
}

[[nodiscard]] inline process_id self_process() {
  return read_process(::getpid());
}

/// Removes the names of shared-memory objects that the process `pid` created and could not
/// remove because it was killed (a segment or symmetric memory it was still handing out): the
/// memory itself goes once the last mapping does.
inline void remove_names_of(std::int64_t pid) noexcept {
  char prefix[64];
  std::snprintf(prefix, sizeof prefix, "ringzero-%lld-", static_cast<long long>(pid));
  ringzero::detail::remove_shm_names(prefix);
}

/// One mapping of a named shared-memory object. The creator picks a fresh name; the name is
/// removed (unlink()) as soon as every rank has mapped it, after which the memory lives exactly
/// as long as some process maps it, whatever way the processes end.
class mapping {
 public:
  mapping() = default;
  mapping(mapping&& o) noexcept
      : base_(std::exchange(o.base_, nullptr)),
        bytes_(std::exchange(o.bytes_, 0)),
        name_(std::move(o.name_)) {}
  mapping& operator=(mapping&& o) noexcept {
    if (this != &o) {
      release();
      base_ = std::exchange(o.base_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
      name_ = std::move(o.name_);
    }
    return *this;
  }
  mapping(const mapping&) = delete;
  mapping& operator=(const mapping&) = delete;
  ~mapping() { release(); }

  /// Creates a zero-filled object of `bytes` under a fresh name and maps it.
  [[nodiscard]] static mapping create(std::size_t bytes) {
    mapping m;
    std::random_device rd;
    for (int attempt = 0; attempt < 16; ++attempt) {
      std::string name = fmt::format("/ringzero-{}-{:08x}{:08x}", ::getpid(), rd(), rd());
      const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
      if (fd < 0 && errno == EEXIST) continue;
      if (fd < 0)
        throw transport_error(
            fmt::format("shm: shm_open({}) failed: {}", name, std::strerror(errno)));
      m.name_ = std::move(name);
      if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
        const int e = errno;
        ::close(fd);
        m.unlink();
        throw transport_error(fmt::format("shm: sizing the {}-byte segment {} failed: {}", bytes,
                                          m.name_, std::strerror(e)));
      }
      m.map(fd, bytes);
      return m;
    }
    throw transport_error("shm: no free shared-memory name after 16 attempts");
  }

  /// Maps the object another rank created.
  [[nodiscard]] static mapping open(const std::string& name, std::size_t bytes) {
    mapping m;
    const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0)
      throw transport_error(fmt::format(
          "shm: cannot open segment {}: {} (are all ranks on one host, sharing /dev/shm?)", name,
          std::strerror(errno)));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) < bytes) {
      ::close(fd);
      throw transport_error(
          fmt::format("shm: segment {} is smaller than the {} bytes expected", name, bytes));
    }
    m.name_ = name;
    m.map(fd, bytes);
    return m;
  }

  /// Removes the name (the mapping stays valid). Harmless when another rank removed it first.
  void unlink() noexcept {
    if (!name_.empty()) ::shm_unlink(name_.c_str());
  }

  [[nodiscard]] std::byte* data() const noexcept { return base_; }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_; }
  [[nodiscard]] const std::string& name() const noexcept { return name_; }

 private:
  void map(int fd, std::size_t bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int e = errno;
    ::close(fd);
    if (p == MAP_FAILED) {
      unlink();
      throw transport_error(
          fmt::format("shm: mapping {} bytes of {} failed: {}", bytes, name_, std::strerror(e)));
    }
    base_ = static_cast<std::byte*>(p);
    bytes_ = bytes;
  }
  void release() noexcept {
    if (base_) ::munmap(base_, bytes_);
    base_ = nullptr;
  }

  std::byte* base_ = nullptr;
  std::size_t bytes_ = 0;
  std::string name_;
};

/// What each rank publishes about itself, one cache line per rank.
struct alignas(cache_line) rank_record {
  std::atomic<std::int64_t> pid;
  std::atomic<std::uint64_t> start;
  /// 0 until the rank mapped the segment, 1 while it runs, 2 once it left in an orderly way.
  std::atomic<std::uint32_t> state;
};

enum : std::uint32_t { rank_absent = 0, rank_running = 1, rank_left = 2 };

static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "the shm transport needs lock-free 64-bit atomics: they are shared across processes");

}  // namespace ringzero::shm::detail
