// The shm transport's options: the segment's geometry and the sizes up to which collectives
// run in it, the cost model's constants and the deadline.
#pragma once

#include <chrono>
#include <cstddef>
#include <limits>

#include "ringzero/transport/shm/detail/engine.hpp"
#include "ringzero/tuning/defaults.hpp"
#include "ringzero/tuning/policy.hpp"
#include "ringzero/tuning/thresholds.hpp"

namespace ringzero::shm {

/// The segment's geometry and the sizes up to which collectives run in it. Must be the same on
/// every rank (rank 0's geometry is the one the segment gets). The cost model's constants are
/// options::tuning (tuning::defaults::shm).
struct segment_options {
  /// Bytes per rank of the workspace that collectives in the segment use
  /// (shm/detail/collectives.hpp): two buffers of this size each.
  std::size_t workspace_bytes = std::size_t{1} << 20;
  /// broadcast, all_gather and reduce_scatter up to this many bytes run in the segment's
  /// workspace rather than over messages (shm/detail/collectives.hpp), when the caller leaves
  /// the algorithm to ringzero.
  std::size_t segment_bytes = std::size_t{4} << 20;
  /// The same for all_reduce on host buffers, in pieces of the workspace: unbounded, since the
  /// segment beat every algorithm over messages at every size measured (busbw, 2 ranks: 5.2
  /// against 2.7 GB/s at 16 MiB, 3.6 against 1.9 at 64 MiB; 4 ranks: 2.6 against 1.0 at
  /// 64 MiB).
  std::size_t all_reduce_segment_bytes = std::numeric_limits<std::size_t>::max();
  /// The same for all_to_all (its whole buffer, size() blocks): one phase instead of a message
  /// per peer. Against pairwise over messages, float, 2 and 4 ranks: 1.7-5.3x faster below
  /// 8 KiB, 1.2-2.3x up to 2 MiB but for 2 ranks at 512 KiB (0.89x); docs/performance.md.
  std::size_t all_to_all_segment_bytes = std::size_t{4} << 20;
  /// all_gather and all_to_all blocks of at least this many bytes are read from the peers'
  /// inputs by cross-memory attach (tuning/thresholds.hpp says why this size).
  /// RINGZERO_SHM_CMA=0 turns it off; where the kernel refuses such reads, the first call finds
  /// out on every rank alike, warns once and takes the other paths from then on.
  std::size_t cross_memory_bytes = tuning::thresholds::shm_cross_memory_bytes;
  /// all_reduce (not options::reproducible's sum) of at least this many bytes on buffers that
  /// are not symmetric memory: each rank reduces its block reading the peers' inputs by
  /// cross-memory attach, and reads the other blocks from their owners' outputs. Off by default
  /// (tuning/thresholds.hpp says why). Under RINGZERO_SHM_CMA as above.
  std::size_t cross_memory_all_reduce_bytes = tuning::thresholds::shm_cross_memory_all_reduce_bytes;
  /// Outputs of at least this many bytes are written with streaming stores that bypass the
  /// cache (the output would not stay in it, and reading it for ownership costs a third more
  /// memory traffic).
  std::size_t streaming_bytes = std::size_t{8} << 20;
  /// Slots per ordered pair of ranks and bytes per slot (a 32-byte header, then payload): a
  /// message of up to slot_bytes - 32 bytes takes one slot, the eager limit. 64 x 8 KiB keeps a
  /// pair's ring (512 KiB) inside the L2 cache of the two cores that share it.
  std::size_t slots = 64;
  std::size_t slot_bytes = 8192;

  [[nodiscard]] std::size_t eager_limit() const noexcept {
    return slot_bytes - detail::slot_header_bytes;
  }
};

struct options {
  /// 0: RINGZERO_TIMEOUT (default 300 s). Bounds the setup and every wait of the transport.
  std::chrono::nanoseconds timeout{0};
  /// The cost model's constants and the algorithms' flow control on this transport.
  ringzero::tuning::policy tuning = ringzero::tuning::defaults::shm.value;
  segment_options segment{};
};

}  // namespace ringzero::shm
