// Sizes that choose a code path, with the measurements behind them: a transport's options and
// the reproducible path default to these, as the cost model's constants default to
// tuning/defaults.hpp. Each is alike on every rank (the paths must be), so none is measured at
// run time.
#pragma once

#include <cstddef>
#include <limits>
#include <type_traits>

namespace ringzero::tuning::thresholds {

/// shm: all_gather and all_to_all blocks (each rank's input; the part of it for one peer) of at
/// least this many bytes are read from the peers' inputs in their own address spaces by
/// cross-memory attach (process_vm_readv), one copy per block, instead of through the
/// workspace or over messages (shm::segment_options::cross_memory_bytes).
inline constexpr std::size_t shm_cross_memory_bytes = std::size_t{16} << 10;

/// shm: all_reduce (not options::reproducible's sum) of at least this many bytes on buffers
/// that are not symmetric memory reads the peers' inputs by cross-memory attach, about half the
/// memory traffic of the workspace's path (shm::segment_options::cross_memory_all_reduce_bytes).
/// Off: it pays only where the kernel's cross-process copy runs near memcpy's speed, and on the
/// virtual machines measured it ran at a quarter of it in cache and half out of it, so the path
/// took 1.6-4.2x the workspace's time (docs/performance.md, "all_reduce by cross-memory
/// attach"; bench/cross_memory measures a machine).
inline constexpr std::size_t shm_cross_memory_all_reduce_bytes =
    std::numeric_limits<std::size_t>::max();

/// socket: messages of at least this many bytes are striped over the rails
/// (socket::options::stripe_bytes, RINGZERO_STRIPE_BYTES).
inline constexpr std::size_t socket_stripe_bytes = std::size_t{64} << 10;

/// options::reproducible: below this many bytes of gathered terms (size() * count * sizeof(E)),
/// an all_reduce with no algorithm forced gathers the terms instead of agreeing on windows first:
/// one collective instead of two, but every rank then sums every rank's terms exactly itself, at
/// about 18 ns a term. At 64 KiB that made 1-16 KiB calls on native shm 1.4-4x slower than the
/// two collectives (docs/performance.md, "Reproducible sums: the cost").
inline constexpr std::size_t reproducible_gather_bytes = 1024;

/// reproducible_gather_bytes for element type E on `ranks` ranks. float's terms are summed by
/// gathered_float_sums, in under a nanosecond a term: gathering pays up to 8 KiB of terms,
/// against the all_to_all and all_gather that larger calls take (measured side by side on native
/// shm, 2 and 4 ranks; docs/performance.md). On two ranks an all_gather moves the bytes a ring
/// all_reduce does, in one step instead of two, and the pass sums two terms at a plain add's
/// speed: there it pays up to 128 KiB (over libfabric shm and tcp;ofi_rxm at 16 KiB, 11-13 us
/// against 17-24; level at 64 KiB; behind at 1 MiB).
template <class E>
[[nodiscard]] constexpr std::size_t reproducible_gather_bytes_of(std::size_t ranks) noexcept {
  if constexpr (std::is_same_v<E, float>)
    return ranks == 2 ? std::size_t{128} << 10 : std::size_t{8} << 10;
  else
    return reproducible_gather_bytes;
}

/// options::wire's all_gather goes in pieces of at least this many elements of a rank's block,
/// at most quantized_gather_pieces of them, so that encoding and decoding run under the transfer
/// (detail/quantized_call.hpp): below a million elements the passes take less than a piece's
/// fill and drain cost, and eight pieces hide all but an eighth of them.
inline constexpr std::size_t quantized_gather_piece_elems = std::size_t{1} << 20;
inline constexpr std::size_t quantized_gather_pieces = 8;

/// Pieces of a quantized all_gather of `count` elements per rank.
[[nodiscard]] constexpr std::size_t quantized_gather_pieces_of(std::size_t count) noexcept {
  const std::size_t p = count / quantized_gather_piece_elems;
  return p < 1 ? 1 : (p > quantized_gather_pieces ? quantized_gather_pieces : p);
}

}  // namespace ringzero::tuning::thresholds
