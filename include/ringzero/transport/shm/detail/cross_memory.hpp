// The shm transport's reads across processes (Linux's cross-memory attach, process_vm_readv):
// all_gather and all_to_all of large blocks read each peer's input straight from its address
// space, one copy per block, and all_reduce may read its peers' parts of a block the same way
// (segment_options::cross_memory_bytes, cross_memory_all_reduce_bytes). The ranks publish their
// buffers' addresses in the workspace (shm/workspace.hpp) and agree there on every read's
// outcome, so a kernel that refuses such reads turns the path off on every rank alike.
#pragma once

#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include <fmt/core.h>

#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <span>
#include <vector>

#include "ringzero/detail/agreement.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/native.hpp"
#include "ringzero/transport/shm/detail/collectives.hpp"
#include "ringzero/types.hpp"

namespace ringzero::shm::detail {

/// Reads `bytes` at `remote` in process `pid` into `local` with process_vm_readv (Linux's
/// cross-memory attach), in as many calls as the kernel needs: 0, or the errno that stopped it.
[[nodiscard]] inline int read_process_memory(std::int64_t pid, std::uint64_t remote,
                                             std::byte* local, std::size_t bytes) noexcept {
  while (bytes > 0) {
    iovec to{local, bytes};
    iovec from{reinterpret_cast<void*>(static_cast<std::uintptr_t>(remote)), bytes};
    const ssize_t got = ::process_vm_readv(static_cast<pid_t>(pid), &to, 1, &from, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return errno;
    if (got == 0) return EFAULT;
    local += got;
    remote += static_cast<std::uint64_t>(got);
    bytes -= static_cast<std::size_t>(got);
  }
  return 0;
}

/// Why a cross-memory collective did not complete: the lowest rank whose reads failed, the
/// rank it read from and the errno.
struct cross_memory_failure {
  int rank = -1;
  int peer = -1;
  int error = 0;
};

/// Every rank's outcome of its reads in one phase: the lowest failing rank's, or none.
template <class W>
[[nodiscard]] bool agree_reads(W& ws, cross_memory_failure mine, segment_call& call,
                               cross_memory_failure& failed) {
  struct outcome {
    std::int32_t error;
    std::int32_t peer;
  };
  static_assert(sizeof(outcome) <= 64);
  const outcome result{mine.error, mine.peer};
  const std::uint64_t p = ws.next_phase();
  std::memcpy(ws.buffer(ws.rank(), p), &result, sizeof result);
  ws.phase(call);
  for (int r = 0; r < ws.size(); ++r) {
    outcome theirs;
    std::memcpy(&theirs, ws.buffer(r, p), sizeof theirs);
    if (theirs.error != 0) {
      failed = {r, theirs.peer, theirs.error};
      return false;
    }
  }
  return true;
}

/// Block q of `out` (`block` bytes each) receives `block` bytes of rank q's buffer `base`, from
/// offset rank() * stride: all_gather (stride 0: each rank's whole input) and all_to_all
/// (stride block: the slice of each peer's input addressed to this rank). Each rank publishes
/// where its buffer lies in its own address space; every rank reads its peers' parts from there
/// straight into its output (process_vm_readv, Linux's cross-memory attach: the single copy
/// Open MPI's vader makes for large messages), and a second phase tells each rank that its
/// buffer has been read and may change. One copy per block and two phases whatever the size,
/// where the workspace's paths copy every block in and out (about 2 S + 2 S / n bytes of
/// traffic for an output of S) in one phase per workspace-full, and larger calls go over
/// messages. `base` must not be written by this rank before the call returns, nor lie in
/// `out` where a peer's block lands (the caller copies an in-place all_to_all's input first).
/// Returns false, on every rank alike, when some rank's reads failed (a kernel or a container
/// that refuses process_vm_readv to the job's own processes: EPERM, ENOSYS; a peer's process
/// gone: ESRCH): `failed` says which; out is then incomplete.
template <class W>
[[nodiscard]] bool exchange_across_processes(W& ws, const std::byte* base, std::size_t stride,
                                             std::size_t block, std::byte* out, segment_call& call,
                                             cross_memory_failure& failed) {
  struct published {
    std::int64_t pid;
    std::uint64_t address;
  };
  // A workspace buffer is at least a cache line (workspace::capacity rounds up to one).
  static_assert(sizeof(published) <= 64);
  const int n = ws.size();
  const int me = ws.rank();
  const std::size_t from = static_cast<std::size_t>(me) * stride;
  const std::uint64_t p = ws.next_phase();
  const published mine{static_cast<std::int64_t>(::getpid()),
                       static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(base))};
  std::memcpy(ws.buffer(me, p), &mine, sizeof mine);
  ws.phase(call);
  cross_memory_failure result;
  for (int k = 1; k < n && result.error == 0; ++k) {
    // Each rank starts with its next peer, so that the n readers spread over the n buffers.
    const int q = (me + k) % n;
    published theirs;
    std::memcpy(&theirs, ws.buffer(q, p), sizeof theirs);
    const int e = read_process_memory(theirs.pid, theirs.address + from,
                                      out + static_cast<std::size_t>(q) * block, block);
    if (e != 0) result = {me, q, e};
  }
  std::byte* own = out + static_cast<std::size_t>(me) * block;
  if (own != base + from) std::memcpy(own, base + from, block);
  return agree_reads(ws, result, call, failed);
}

/// all_reduce by cross-memory attach: rank r reduces block r of the count elements, reading
/// the peers' parts of it from their inputs in their own address spaces (process_vm_readv) in
/// pieces that stay in the L2 cache, straight into its output; then every rank reads the other
/// blocks from their owners' outputs. For S bytes a rank moves about 2.5 S to and from memory
/// (its peers' block and its own read, its block written; the other blocks read and written),
/// where the workspace's path copies every input in and every block out (about 5 S), the
/// copy Open MPI's vader saves on large messages the same way. Three phases: addresses
/// published, blocks reduced, outputs read (after which a rank may change its output). The
/// same block partition and rank order as the workspace's path, so the same bits.
/// Returns false, on every rank alike, when some rank's reads failed (`failed` says which);
/// in place, that rank's block of its buffer may then hold its reduction already, so the
/// caller cannot retry another way; transport::probe_cross_memory finds a kernel that refuses
/// such reads before the first call.
template <element E, class W, class Combine>
[[nodiscard]] bool all_reduce_across_processes(W& ws, const E* in, E* out, std::size_t count,
                                               const Combine& combine, segment_call& call,
                                               cross_memory_failure& failed) {
  struct published {
    std::int64_t pid;
    std::uint64_t in;
    std::uint64_t out;
  };
  static_assert(sizeof(published) <= 64);
  const int n = ws.size();
  const int me = ws.rank();
  const auto block = [&](int r) {
    return std::array<std::size_t, 2>{
        count * static_cast<std::size_t>(r) / static_cast<std::size_t>(n),
        count * static_cast<std::size_t>(r + 1) / static_cast<std::size_t>(n)};
  };
  const std::uint64_t p = ws.next_phase();
  const published mine{static_cast<std::int64_t>(::getpid()),
                       static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(in)),
                       static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(out))};
  std::memcpy(ws.buffer(me, p), &mine, sizeof mine);
  ws.phase(call);
  std::vector<published> peers(static_cast<std::size_t>(n));
  for (int q = 0; q < n; ++q)
    std::memcpy(&peers[static_cast<std::size_t>(q)], ws.buffer(q, p), sizeof(published));

  // The peers' pieces side by side, and the reduced piece where it cannot go to out at once:
  // in place on a rank other than 0, whose own input is not the combine's first (it writes
  // over its first input only).
  constexpr std::size_t piece_bytes = std::size_t{64} << 10;
  const std::size_t piece = std::max<std::size_t>(1, piece_bytes / sizeof(E));
  thread_local std::vector<E> pieces;
  thread_local std::vector<E> reduced;
  pieces.resize(piece * static_cast<std::size_t>(n));
  const bool via_reduced = in == out && me != 0;
  if (via_reduced) reduced.resize(piece);
  cross_memory_failure error;
  const auto [lo, hi] = block(me);
  for (std::size_t first = lo; first < hi && error.error == 0; first += piece) {
    const std::size_t len = std::min(piece, hi - first);
    for (int k = 1; k < n && error.error == 0; ++k) {
      const int q = (me + k) % n;
      const int e = read_process_memory(
          peers[static_cast<std::size_t>(q)].pid,
          peers[static_cast<std::size_t>(q)].in + first * sizeof(E),
          reinterpret_cast<std::byte*>(pieces.data() + static_cast<std::size_t>(q) * piece),
          len * sizeof(E));
      if (e != 0) error = {me, q, e};
    }
    if (error.error != 0) break;
    const auto input = [&](int q) {
      return q == me ? in + first
                     : static_cast<const E*>(pieces.data() + static_cast<std::size_t>(q) * piece);
    };
    if (!via_reduced) {
      combine(n, input, out + first, len);
    } else {
      combine(n, input, reduced.data(), len);
      std::memcpy(out + first, reduced.data(), len * sizeof(E));
    }
  }
  if (!agree_reads(ws, error, call, failed)) return false;
  for (int k = 1; k < n && error.error == 0; ++k) {
    const int q = (me + k) % n;
    const auto [a, b] = block(q);
    const int e = read_process_memory(peers[static_cast<std::size_t>(q)].pid,
                                      peers[static_cast<std::size_t>(q)].out + a * sizeof(E),
                                      reinterpret_cast<std::byte*>(out + a), (b - a) * sizeof(E));
    if (e != 0) error = {me, q, e};
  }
  return agree_reads(ws, error, call, failed);
}

/// The transport's part that reads across processes (a base of shm::transport, which it reaches
/// as T: its workspace, segment options, engine and size): whether the reads are on, and the
/// collectives that use them.
template <class T>
class cross_memory_reads {
 public:
  /// RINGZERO_SHM_CMA: 0 keeps all_reduce, all_gather and all_to_all off cross-memory attach
  /// (segment_options::cross_memory_bytes, cross_memory_all_reduce_bytes). On, it lets the
  /// job's other processes read this one's memory where Yama restricts that to ancestors
  /// (kernel.yama.ptrace_scope = 1, Ubuntu's default; ranks are siblings), as Open MPI's vader
  /// does: any process of this user may then, which scope 0 allows anyway.
  [[nodiscard]] static bool from_env() {
    const auto v = ringzero::detail::getenv_int("RINGZERO_SHM_CMA");
    const bool on = !v || *v != 0;
    if (on) {
      std::ifstream scope("/proc/sys/kernel/yama/ptrace_scope");
      int level = 0;
      if (scope >> level && level == 1)
        static_cast<void>(::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY));
    }
    return on;
  }

 protected:
  cross_memory_reads() : on_(from_env()) {}

  /// all_gather and all_to_all by cross-memory attach (exchange_across_processes) where
  /// it is on and the blocks are large enough: true when the call ran so. False leaves it to
  /// the other paths: below the threshold, or when some rank's reads were refused, in which
  /// case this call and every later one take them (decided alike on every rank).
  [[nodiscard]] bool across_processes(const std::byte* base, std::size_t stride, std::size_t block,
                                      std::byte* out, segment_call& call) {
    if (!on_ || block < self().segment().cross_memory_bytes) return false;
    // Ranks that differ here (RINGZERO_SHM_CMA, segment_options) differ in the call's
    // descriptor, so they fail alike at its first phase instead of waiting on each other.
    call.desc.path = ringzero::detail::call_path::cross_memory;
    cross_memory_failure failed;
    if (exchange_across_processes(self().workspace(), base, stride, block, out, call, failed))
      return true;
    on_ = false;
    throw_if_dead(failed, call);
    log::warn(
        "shm: rank {} could not read rank {}'s input across processes ({}); all_gather and "
        "all_to_all take the shared segment and messages from now on (RINGZERO_SHM_CMA=0 "
        "skips the attempt)",
        failed.rank, failed.peer, std::strerror(failed.error));
    return false;
  }

  /// A read across processes that found its peer gone: the engine's words for a dead peer, as
  /// every other wait of this transport says them, and where this rank found out. Other
  /// failures are the caller's to handle.
  void throw_if_dead(const cross_memory_failure& failed, const segment_call& call) const {
    if (failed.error != ESRCH) return;
    throw peer_error(fmt::format("{} (shm {}: rank {} found no process of it when it read "
                                 "across processes)",
                                 self().engine().dead_message(failed.peer), call.what, failed.rank),
                     failed.peer);
  }

  /// all_reduce by cross-memory attach (all_reduce_across_processes) where it is on and
  /// the call large enough: true when the call ran so. The first such call makes sure the
  /// kernel allows the reads (probe_cross_memory), since a failure in the middle of an in-place
  /// call leaves buffers no other path can start from; a failure after that is an error.
  template <element E, class Combine>
  [[nodiscard]] bool reduce_across_processes(const native_call& c, segment_call& call,
                                             const Combine& combine) {
    if (!on_ || self().size() < 2 ||
        c.count * sizeof(E) < self().segment().cross_memory_all_reduce_bytes)
      return false;
    call.desc.path = ringzero::detail::call_path::cross_memory;
    if (!probe_cross_memory(call)) {
      call.desc.path = ringzero::detail::call_path::segment;
      return false;
    }
    cross_memory_failure failed;
    if (all_reduce_across_processes<E>(self().workspace(), static_cast<const E*>(c.in),
                                       static_cast<E*>(c.out), c.count, combine, call, failed))
      return true;
    on_ = false;
    throw_if_dead(failed, call);
    throw transport_error(fmt::format(
        "shm {}: rank {} could not read rank {}'s buffers across processes ({}); the output is "
        "incomplete (RINGZERO_SHM_CMA=0 keeps all_reduce in the shared segment)",
        call.what, failed.rank, failed.peer, std::strerror(failed.error)));
  }

  /// Whether the ranks can read each other's memory (process_vm_readv), found out once on
  /// every rank alike: each reads a word from every peer. Where the kernel refuses (EPERM
  /// under a restrictive ptrace scope or seccomp profile, ENOSYS), warns once and turns
  /// cross-memory attach off for every collective.
  [[nodiscard]] bool probe_cross_memory(segment_call& call) {
    if (probed_) return on_;
    probed_ = true;
    const std::uint64_t word = 0x72696e677a65726full;  // "ringzero"
    std::vector<std::byte> words(sizeof word * static_cast<std::size_t>(self().size()));
    cross_memory_failure failed;
    if (exchange_across_processes(self().workspace(), reinterpret_cast<const std::byte*>(&word), 0,
                                  sizeof word, words.data(), call, failed))
      return true;
    on_ = false;
    throw_if_dead(failed, call);
    log::warn(
        "shm: rank {} could not read rank {}'s memory across processes ({}); collectives take "
        "the shared segment and messages from now on (RINGZERO_SHM_CMA=0 skips the attempt)",
        failed.rank, failed.peer, std::strerror(failed.error));
    return false;
  }

  /// Whether all_gather and all_to_all may read peers' inputs across processes
  /// (segment_options::cross_memory_bytes).
  bool on_ = true;
  bool probed_ = false;  ///< probe_cross_memory ran
  /// An in-place all_to_all's input, published in its place (across_processes); kept between
  /// calls, so that its pages are not faulted in again each time.
  std::vector<std::byte> staged_;

 private:
  [[nodiscard]] T& self() noexcept { return static_cast<T&>(*this); }
  [[nodiscard]] const T& self() const noexcept { return static_cast<const T&>(*this); }
};

}  // namespace ringzero::shm::detail
