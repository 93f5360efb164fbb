// The ring algorithms of algorithms/ring.hpp as schedules (schedule/executor.hpp): the same
// blocks (blocks.hpp), the same neighbours and the same operand order, so a ring all_reduce or
// reduce_scatter on GPU buffers gives the bits ringzero's host ring gives. Each step moves one
// whole block; the executor's transport pipelines it (NCCL cuts a message into chunks itself).
//
//   reduce_scatter: n-1 steps, each sending and receiving one block and reducing it.
//   all_gather:     n-1 steps, each sending and receiving one block.
//   all_reduce:     both, 2(n-1) steps; 2(n-1)/n of the buffer sent per rank, (n-1)/n reduced.
//
// Each element is reduced along one chain of ranks, in the same order on every call of the
// same world size and count, and then copied: every rank ends with the same bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "ringzero/algorithms/blocks.hpp"
#include "ringzero/algorithms/schedule/executor.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms::schedule::ring {

namespace detail {

using schedule::detail::step;

/// Reduce-scatter over the blocks of `bl`: at step s rank r sends block r-1-s (its own input at
/// step 0, the partial it made at step s-1 after) to the next rank and receives block r-2-s
/// from the previous one into `slot`, then reduces (own input first, the received partial
/// second) into dest(block, s). After n-1 steps block r is complete at dest(r, n-2).
template <element E, executor<E> X, class Dest>
void reduce_scatter_phase(X& x, const block_layout& bl, const E* in, E* slot, Dest dest, op o) {
  const int n = x.size();
  const int r = x.rank();
  const int next = mod(r + 1, n);
  const int prev = mod(r - 1, n);
  const E* sending = nullptr;
  for (int s = 0; s < n - 1; ++s) {
    const auto sb = static_cast<std::size_t>(mod(r - 1 - s, n));
    const auto rb = static_cast<std::size_t>(mod(r - 2 - s, n));
    if (s == 0) sending = in + bl.offset[sb];
    const auto id = static_cast<std::uint32_t>(s);
    step<E>(x, {{next, id, sending, bl.length[sb]}}, {{prev, id, slot, bl.length[rb]}});
    E* d = dest(rb, s);
    if (bl.length[rb] > 0) {
      x.combine(o, in + bl.offset[rb], slot, d, bl.length[rb]);
      if (o == op::avg && s == n - 2) x.finish_avg(d, bl.length[rb], n);
    }
    sending = d;
  }
}

/// All-gather over the blocks of `bl` in `out`, where this rank's block is in place: at step s
/// rank r sends block r-s and receives block r-1-s straight into its place. Message ids start
/// at `id0`.
template <element E, executor<E> X>
void all_gather_phase(X& x, const block_layout& bl, E* out, std::uint32_t id0) {
  const int n = x.size();
  const int r = x.rank();
  const int next = mod(r + 1, n);
  const int prev = mod(r - 1, n);
  for (int s = 0; s < n - 1; ++s) {
    const auto sb = static_cast<std::size_t>(mod(r - s, n));
    const auto rb = static_cast<std::size_t>(mod(r - 1 - s, n));
    const auto id = id0 + static_cast<std::uint32_t>(s);
    step<E>(x, {{next, id, out + bl.offset[sb], bl.length[sb]}},
            {{prev, id, out + bl.offset[rb], bl.length[rb]}});
  }
}

}  // namespace detail

/// Scratch elements all_reduce needs: one receive slot of the largest block.
[[nodiscard]] inline std::size_t all_reduce_scratch(std::size_t count, int n) {
  return n > 1 ? block_layout::even(count, n).max_length : 0;
}
/// Scratch elements reduce_scatter needs: a receive slot and a partial, one block each.
[[nodiscard]] inline std::size_t reduce_scatter_scratch(std::size_t count, int n) {
  return n > 1 ? 2 * count : 0;
}

/// out = in reduced over all ranks (in may equal out); `count` elements cut into n near-equal
/// blocks, the first count % n one element longer. Needs size() >= 2.
template <element E, executor<E> X>
void all_reduce(X& x, const E* in, E* out, std::size_t count, op o, std::span<E> scratch) {
  const auto bl = block_layout::even(count, x.size());
  detail::reduce_scatter_phase<E>(
      x, bl, in, scratch.data(), [&](std::size_t b, int) { return out + bl.offset[b]; }, o);
  detail::all_gather_phase<E>(x, bl, out, static_cast<std::uint32_t>(x.size() - 1));
}

/// in holds size() blocks of `count`; out (count elements, possibly in's block rank()) receives
/// block rank() reduced over all ranks. in is never written. Needs size() >= 2.
template <element E, executor<E> X>
void reduce_scatter(X& x, const E* in, E* out, std::size_t count, op o, std::span<E> scratch) {
  const int n = x.size();
  const auto bl = block_layout::uniform(count, n);
  E* slot = scratch.data();
  E* partial = slot + count;
  // Partials travel through scratch so the input is never written; the last step reduces
  // straight into out. One partial suffices: a step's exchange has sent it before the step's
  // reduction overwrites it.
  detail::reduce_scatter_phase<E>(
      x, bl, in, slot, [&](std::size_t, int s) { return s == n - 2 ? out : partial; }, o);
}

/// out holds size() blocks of `count`; block rank() comes from in (which may already be it).
/// Needs size() >= 2.
template <element E, executor<E> X>
void all_gather(X& x, const E* in, E* out, std::size_t count) {
  const auto bl = block_layout::uniform(count, x.size());
  E* own = out + bl.offset[static_cast<std::size_t>(x.rank())];
  if (own != in && count > 0) x.copy(own, in, count);
  detail::all_gather_phase<E>(x, bl, out, 0);
}

}  // namespace ringzero::algorithms::schedule::ring
