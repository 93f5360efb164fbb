// Whether cross-memory attach pays on this machine: the rate at which one process copies another's
// memory with process_vm_readv (the shm transport's detail::read_process_memory, as its
// all_gather, all_to_all and opt-in all_reduce use it), beside memcpy within one process, at a
// size that stays in the cache and one that does not, in the pieces those paths read.
// A cross-process read saves the copy through the shared segment, so it pays where it runs near
// memcpy's rate; on a virtual machine pinning each page costs more (docs/performance.md,
// "all_reduce by cross-memory attach").
//
//   cross_memory [MiB, default 64]    prints "# cma <bytes> <piece> <GB/s>" and
//                                     "# memcpy <bytes> <GB/s>" lines
#include <fmt/core.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ringzero/transport/shm/detail/cross_memory.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

/// Seconds per call of f, over enough calls to take about a fifth of a second.
template <class F>
double seconds_per_call(F&& f) {
  f();  // warm: pages faulted, caches as in a steady loop
  int calls = 1;
  for (;;) {
    const auto t0 = clock_type::now();
    for (int i = 0; i < calls; ++i) f();
    const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    if (s > 0.2 || calls > (1 << 20)) return s / calls;
    calls *= 2;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t large = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 64) << 20;
  if (large == 0) {
    fmt::print(stderr, "usage: cross_memory [MiB, default 64]\n");
    return 2;
  }
  // A child holds the buffer the parent reads, as a peer rank holds its input.
  int to_parent[2];
  if (::pipe(to_parent) != 0) return 1;
  const pid_t child = ::fork();
  if (child < 0) return 1;
  if (child == 0) {
    std::vector<std::byte> theirs(large, std::byte{7});
    const auto address = reinterpret_cast<std::uintptr_t>(theirs.data());
    if (::write(to_parent[1], &address, sizeof address) != sizeof address) ::_exit(1);
    ::pause();
    ::_exit(0);
  }
  std::uintptr_t remote = 0;
  if (::read(to_parent[0], &remote, sizeof remote) != sizeof remote) return 1;
  std::vector<std::byte> mine(large), source(large, std::byte{3});
  int status = 0;
  for (const std::size_t bytes : {std::size_t{1} << 20, large}) {
    for (const std::size_t piece : {std::size_t{64} << 10, bytes}) {
      const double s = seconds_per_call([&] {
        for (std::size_t at = 0; at < bytes && status == 0; at += piece)
          status = ringzero::shm::detail::read_process_memory(child, remote + at, mine.data() + at,
                                                              std::min(piece, bytes - at));
      });
      if (status != 0) {
        fmt::print(stderr, "process_vm_readv: {}\n", std::strerror(status));
        break;
      }
      fmt::print("# cma {} {} {:.2f}\n", bytes, piece, static_cast<double>(bytes) / s / 1e9);
    }
    const double s = seconds_per_call([&] {
      std::memcpy(mine.data(), source.data(), bytes);
      asm volatile("" ::: "memory");
    });
    fmt::print("# memcpy {} {:.2f}\n", bytes, static_cast<double>(bytes) / s / 1e9);
  }
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  return status == 0 ? 0 : 1;
}
