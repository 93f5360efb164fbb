// The shm transport's own collectives: they run in the shared segment rather than over
// messages, in a workspace of symmetric memory (shm::workspace: every rank addresses every
// rank's buffers, and phases order the ranks). The transport offers them to the communicator
// through try_native() (transport/native.hpp) where they apply.
//
// Small and medium all_reduce: every rank copies its input into its buffer once; then each rank
// reduces the contributions of all ranks in rank order, so every rank's result is bitwise
// identical without any further exchange. Up to one_shot_bytes(n) every rank reduces everything
// (one phase); above, rank r reduces block r and the others copy it (two phases), in pieces of
// the workspace's capacity. Broadcast, all_gather, reduce_scatter and barrier follow the same
// pattern. On buffers that are themselves symmetric memory, all_reduce reads the peers' inputs
// in place and writes each reduced block into every rank's output, with streaming stores once
// the output outgrows the cache: about 2 S bytes of memory traffic per rank. all_gather and
// all_to_all of large blocks read the peers' inputs from their address spaces (cross-memory
// attach, shm/detail/cross_memory.hpp), one copy per block.
//
// How the ranks' contributions combine is the collectives' parameter: in rank order with the op
// (in_rank_order), or, for options::reproducible's float sums, exactly (exact_float_sum): each
// element's terms already lie side by side in the ranks' buffers, one stride apart, which is
// what the exact pass reads, so the reproducible call costs the plain call's phases and bytes.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#endif

#include "ringzero/detail/agreement.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/reduce/detail/gathered.hpp"
#include "ringzero/reduce/simd.hpp"
#include "ringzero/types.hpp"

namespace ringzero::shm::detail {

/// Up to this many bytes every rank reduces the whole message (one phase, n S bytes read);
/// above, each reduces a block and copies the others' (two phases, about 3 S). With two ranks one
/// phase wins far longer: a rank reads its one peer's buffer once and copies nothing back
/// (measured, 2 ranks: 7.0 against 4.4 GB/s busbw at 64 KiB, 8.4 against 7.4 at 256 KiB, 5.4
/// against 5.7 at 1 MiB). Another machine of the same kind had two phases ahead from 4 KiB: this
/// is the rule where the communicator's tuning sets no limit (tuning::policy::one_phase_bytes,
/// which `ringzero-perf --tune` measures).
[[nodiscard]] constexpr std::size_t one_shot_bytes(int ranks) noexcept {
  return ranks == 2 ? std::size_t{256} << 10 : std::size_t{16} << 10;
}

/// From this size up, all_reduce on symmetric buffers reads the peers' inputs in place (two
/// phases, no copies); below, the one-phase copy through the workspace is faster even there:
/// measured on 2 ranks, 0.55 µs against 0.46 µs at 256 B, level at 512 B, 0.54 against 0.73 µs
/// at 1 KiB.
inline constexpr std::size_t symmetric_min_bytes = 512;

/// Copies with non-temporal stores: the destination lines are written without being read for
/// ownership first and do not evict the working set. Ends with a store fence, so a release store
/// that follows (the phase post) orders after them.
inline void stream_copy(std::byte* dst, const std::byte* src, std::size_t n) noexcept {
#if defined(__x86_64__) || defined(__i386__)
  const std::size_t head = std::min(n, (16 - reinterpret_cast<std::uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  for (; n >= 64; n -= 64, dst += 64, src += 64) {
    const auto* s = reinterpret_cast<const __m128i*>(src);
    auto* d = reinterpret_cast<__m128i*>(dst);
    _mm_stream_si128(d, _mm_loadu_si128(s));
    _mm_stream_si128(d + 1, _mm_loadu_si128(s + 1));
    _mm_stream_si128(d + 2, _mm_loadu_si128(s + 2));
    _mm_stream_si128(d + 3, _mm_loadu_si128(s + 3));
  }
  std::memcpy(dst, src, n);
  _mm_sfence();
#else
  std::memcpy(dst, src, n);
#endif
}

/// One collective run in the segment, as its waits report it.
struct segment_call {
  std::string_view what;
  /// What this rank is about to run, published in its workspace line before it posts the call's
  /// first phase and compared with every other rank's once all have posted it: ranks that
  /// disagree stop there, before any of them reads a peer's buffer by its own idea of the size.
  /// `path`: how the call reads its peers (all_reduce on symmetric buffers in place, all_gather
  /// and all_to_all from their address spaces); `reproducible`: the sum is exact_float_sum, and a
  /// rank that asked for the plain sum would combine other bits.
  ringzero::detail::call_record desc;
  /// The communicator's collective sequence number.
  std::uint32_t sequence = 0;
  std::chrono::nanoseconds timeout{0};
  /// `timeout` after the call first waited long enough to read the clock (workspace::phase):
  /// a call whose waits all end within a few hundred polls, as small ones do, reads none.
  std::chrono::steady_clock::time_point deadline{};
  /// Phases this call posted so far.
  int step = 0;
};

/// out = in[0] (op) in[1] (op) ... in rank order, over n elements; out may be one of the inputs
/// only if it is in[0].
template <element E, class In>
void reduce_in_order(ringzero::op o, int ranks, In in, E* out, std::size_t n) {
  if (ranks == 1) {
    if (out != in(0)) std::memcpy(out, in(0), n * sizeof(E));
  } else {
    reduction::combine(o, in(0), in(1), out, n);
    for (int q = 2; q < ranks; ++q) reduction::combine(o, out, in(q), out, n);
  }
  if (o == ringzero::op::avg) reduction::finish_avg(out, n, ranks);
}

/// Combines the ranks' contributions with the op, in rank order: every rank gets the same bits,
/// which depend on the number of ranks.
template <element E>
struct in_rank_order {
  ringzero::op o = ringzero::op::sum;
  /// The one-phase limit the communicator's tuning sets (tuning::one_phase_limit), 0 for
  /// one_shot_bytes' rule. Either way every rank gets the same bits: a block reduced by one rank
  /// in rank order is what every rank computes in one phase.
  std::size_t one_phase = 0;
  /// out[i] = in(0)[i] (op) in(1)[i] (op) ..., i < n; out may be in(0) only.
  template <class In>
  void operator()(int ranks, In in, E* out, std::size_t n) const {
    reduce_in_order<E>(o, ranks, in, out, n);
  }
  [[nodiscard]] std::size_t one_shot(int ranks) const noexcept {
    return one_phase != 0 ? one_phase : one_shot_bytes(ranks);
  }
};

/// options::reproducible's float sum (or average: divisor = ranks): each element's terms summed
/// exactly and rounded once (ringzero::detail::gathered_float_sums), so the bits depend on the
/// terms alone, not on how many ranks held them.
struct exact_float_sum {
  std::uint32_t divisor = 1;

  /// out[i] = the exact sum of in(0)[i], in(1)[i], ... rounded once, i < n; out may be in(0).
  /// The ranks' buffers lie one stride apart in the segment's mapping, so the pass reads the
  /// terms in place; anything else is copied side by side first.
  template <class In>
  void operator()(int ranks, In in, float* out, std::size_t n) const {
    const auto at = [&](int q) { return reinterpret_cast<std::uintptr_t>(in(q)); };
    const std::uintptr_t stride = ranks > 1 ? at(1) - at(0) : 0;
    bool regular = ranks == 1 || (at(1) > at(0) && stride % sizeof(float) == 0);
    for (int q = 2; q < ranks && regular; ++q)
      regular = at(q) == at(0) + static_cast<std::uintptr_t>(q) * stride;
    const auto ur = static_cast<std::size_t>(ranks);
    if (regular) {
      ringzero::detail::gathered_float_sums(reduction::active_simd(), in(0),
                                            ranks > 1 ? stride / sizeof(float) : n, ur, n, divisor,
                                            out);
      return;
    }
    thread_local std::vector<float> side_by_side;
    side_by_side.resize(ur * n);
    for (int q = 0; q < ranks; ++q)
      std::memcpy(side_by_side.data() + static_cast<std::size_t>(q) * n, in(q), n * sizeof(float));
    ringzero::detail::gathered_float_sums(reduction::active_simd(), side_by_side.data(), n, ur, n,
                                          divisor, out);
  }
  /// The pass costs more per term than a plain add, and in one phase every rank sums every
  /// rank's terms: one phase pays only while the second would cost more. Measured side by side,
  /// µs per call in one phase and in two: 2 ranks 0.29 and 0.33 at 1 KiB, 0.71-0.81 and
  /// 0.56-0.58 at 4 KiB; 4 ranks 3.1 and 5.0 at 1 KiB, 10.7-13.3 and 7.5 at 16 KiB
  /// (docs/performance.md, "The sums in the segment").
  [[nodiscard]] std::size_t one_shot(int ranks) const noexcept {
    return ranks == 2 ? std::size_t{1} << 10 : std::size_t{4} << 10;
  }
};

/// all_reduce through the workspace; in may equal out.
template <element E, class W, class Combine>
void all_reduce(W& ws, std::span<const E> in, std::span<E> out, const Combine& combine,
                segment_call& call) {
  const int n = ws.size();
  const int me = ws.rank();
  const std::size_t piece = ws.capacity() / sizeof(E);
  const bool one_shot = in.size_bytes() <= combine.one_shot(n);
  for (std::size_t first = 0; first < in.size(); first += piece) {
    const std::size_t count = std::min(piece, in.size() - first);
    const std::uint64_t p = ws.next_phase();
    std::memcpy(ws.buffer(me, p), in.data() + first, count * sizeof(E));
    ws.phase(call);
    auto input = [&](int q) { return reinterpret_cast<const E*>(ws.buffer(q, p)); };
    if (one_shot) {
      combine(n, input, out.data() + first, count);
      continue;
    }
    // Rank r reduces block r into the next phase's buffer; everyone then copies every block.
    const auto block = [&](int r) {
      const std::size_t lo = count * static_cast<std::size_t>(r) / static_cast<std::size_t>(n);
      const std::size_t hi = count * static_cast<std::size_t>(r + 1) / static_cast<std::size_t>(n);
      return std::array<std::size_t, 2>{lo, hi};
    };
    // Named variables, not a structured binding: the lambda below captures lo, and Clang before
    // 16 cannot capture a binding.
    const auto mine_block = block(me);
    const std::size_t lo = mine_block[0];
    const std::size_t hi = mine_block[1];
    E* mine = reinterpret_cast<E*>(ws.buffer(me, p + 1)) + lo;
    combine(
        n, [&](int q) { return input(q) + lo; }, mine, hi - lo);
    ws.phase(call);
    for (int q = 0; q < n; ++q) {
      const auto [a, b] = block(q);
      std::memcpy(out.data() + first + a, reinterpret_cast<const E*>(ws.buffer(q, p + 1)) + a,
                  (b - a) * sizeof(E));
    }
  }
}

/// all_reduce on symmetric buffers: in_of(q) and out_of(q) are rank q's input and output as this
/// process addresses them (equal for in place).
template <element E, class W, class In, class Out, class Combine>
void all_reduce_symmetric(W& ws, In in_of, Out out_of, std::size_t count, const Combine& combine,
                          segment_call& call) {
  const int n = ws.size();
  const int me = ws.rank();
  ws.phase(call);  // every input is written
  const std::size_t lo = count * static_cast<std::size_t>(me) / static_cast<std::size_t>(n);
  const std::size_t hi = count * static_cast<std::size_t>(me + 1) / static_cast<std::size_t>(n);
  const bool streaming = count * sizeof(E) >= ws.streaming_bytes();
  // Reduced in pieces that stay in the L1 cache, then copied to every rank's output.
  constexpr std::size_t piece_bytes = 16 << 10;
  alignas(64) static thread_local std::byte tmp[piece_bytes];
  const std::size_t piece = piece_bytes / sizeof(E);
  for (std::size_t first = lo; first < hi; first += piece) {
    const std::size_t len = std::min(piece, hi - first);
    E* t = reinterpret_cast<E*>(tmp);
    combine(
        n, [&](int q) { return in_of(q) + first; }, t, len);
    for (int k = 0; k < n; ++k) {
      const int q = (me + k) % n;  // ranks write each output in a different order
      auto* dst = reinterpret_cast<std::byte*>(out_of(q) + first);
      if (streaming)
        stream_copy(dst, tmp, len * sizeof(E));
      else
        std::memcpy(dst, tmp, len * sizeof(E));
    }
  }
  ws.phase(call);  // every output is complete, no input is read any more
}

/// Copies root's in (read on root only) into every rank's out, through root's buffer.
template <element E, class W>
void broadcast(W& ws, std::span<const E> in, std::span<E> out, int root, segment_call& call) {
  const std::size_t piece = ws.capacity() / sizeof(E);
  const bool is_root = ws.rank() == root;
  for (std::size_t first = 0; first < out.size(); first += piece) {
    const std::size_t count = std::min(piece, out.size() - first);
    const std::uint64_t p = ws.next_phase();
    if (is_root) std::memcpy(ws.buffer(root, p), in.data() + first, count * sizeof(E));
    ws.phase(call);
    if (!is_root) std::memcpy(out.data() + first, ws.buffer(root, p), count * sizeof(E));
  }
  if (is_root && in.data() != out.data()) std::memcpy(out.data(), in.data(), out.size_bytes());
}

/// out (n * in.size() elements) receives every rank's in, block r from rank r.
template <element E, class W>
void all_gather(W& ws, std::span<const E> in, std::span<E> out, segment_call& call) {
  const std::size_t piece = ws.capacity() / sizeof(E);
  const int n = ws.size();
  for (std::size_t first = 0; first < in.size(); first += piece) {
    const std::size_t count = std::min(piece, in.size() - first);
    const std::uint64_t p = ws.next_phase();
    std::memcpy(ws.buffer(ws.rank(), p), in.data() + first, count * sizeof(E));
    ws.phase(call);
    for (int q = 0; q < n; ++q)
      std::memcpy(out.data() + static_cast<std::size_t>(q) * in.size() + first, ws.buffer(q, p),
                  count * sizeof(E));
  }
}

/// out receives block rank() of in (n * out.size() elements) reduced over all ranks, in rank
/// order.
template <element E, class W, class Combine>
void reduce_scatter(W& ws, std::span<const E> in, std::span<E> out, const Combine& combine,
                    segment_call& call) {
  const int n = ws.size();
  const std::size_t block = out.size();
  // Each piece holds the same slice of every block: n slices of `piece` elements.
  const std::size_t piece = ws.capacity() / sizeof(E) / static_cast<std::size_t>(n);
  for (std::size_t first = 0; first < block; first += piece) {
    const std::size_t count = std::min(piece, block - first);
    const std::uint64_t p = ws.next_phase();
    for (int b = 0; b < n; ++b)
      std::memcpy(
          reinterpret_cast<E*>(ws.buffer(ws.rank(), p)) + static_cast<std::size_t>(b) * count,
          in.data() + static_cast<std::size_t>(b) * block + first, count * sizeof(E));
    ws.phase(call);
    const std::size_t at = static_cast<std::size_t>(ws.rank()) * count;
    E* dst = out.data() + first;
    // In place, dst is this rank's block of in, already copied to the workspace.
    combine(
        n, [&](int q) { return reinterpret_cast<const E*>(ws.buffer(q, p)) + at; }, dst, count);
  }
}

/// Block q of out receives block rank() of rank q's in (both size() blocks of `block`
/// elements); in may equal out. The same layout as reduce_scatter's: each rank writes a slice
/// of every block of its in to its buffer, then copies its own slice from every buffer. One
/// phase per piece, where a call over messages takes a step per peer.
template <element E, class W>
void all_to_all(W& ws, std::span<const E> in, std::span<E> out, segment_call& call) {
  const int n = ws.size();
  const std::size_t block = out.size() / static_cast<std::size_t>(n);
  const std::size_t piece = ws.capacity() / sizeof(E) / static_cast<std::size_t>(n);
  const std::size_t at_me = static_cast<std::size_t>(ws.rank());
  for (std::size_t first = 0; first < block; first += piece) {
    const std::size_t count = std::min(piece, block - first);
    const std::uint64_t p = ws.next_phase();
    E* staged = reinterpret_cast<E*>(ws.buffer(ws.rank(), p));
    for (int b = 0; b < n; ++b)
      std::memcpy(staged + static_cast<std::size_t>(b) * count,
                  in.data() + static_cast<std::size_t>(b) * block + first, count * sizeof(E));
    ws.phase(call);
    // In place, out's slices of this piece were copied above; later pieces read in beyond them.
    for (int q = 0; q < n; ++q)
      std::memcpy(out.data() + static_cast<std::size_t>(q) * block + first,
                  reinterpret_cast<const E*>(ws.buffer(q, p)) + at_me * count, count * sizeof(E));
  }
}

template <class W>
void barrier(W& ws, segment_call& call) {
  ws.phase(call);
}

}  // namespace ringzero::shm::detail
