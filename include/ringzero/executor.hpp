// The seam between ringzero's algorithms and a transport that moves memory the calling thread may
// not touch (GPU memory): an executor runs one collective call's steps. The schedules
// (algorithms/schedule.hpp) are written once against this concept; each transport that moves
// device memory offers an executor built from its own pieces (NCCL: groups of ncclSend/ncclRecv
// and kernels on the stream, transport/nccl/executor.hpp; a messaging transport with device
// memory such as libfabric with FI_HMEM: tagged messages gated on CUDA events,
// detail/device_executor.hpp), and collectives.hpp picks the schedule and runs it on one. A
// transport names this header, never the algorithms.
//
// An executor X for element type E provides
//   int rank() const, int size() const
//   void exchange(std::span<const transfer<const E>> sends, std::span<const transfer<E>> recvs)
//        every send and receive of one step, started together: a ring where every rank sends to
//        the next while receiving from the previous cannot deadlock. Work after it sees the
//        received data, and a buffer sent may be written again after it.
//   void combine(op o, const E* a, const E* b, E* out, std::size_t n)   out = a (o) b
//   void finish_avg(E* data, std::size_t n, int ranks)                   a sum into an average
//   void copy(E* dst, const E* src, std::size_t n)                        non-overlapping
// Each operation is ordered after the previous one (a stream executor need not finish it before
// returning). Schedules never pass empty transfers or empty ranges.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero {

/// One message of a step: `count` elements at `data`, to or from `peer`. Its sender and its
/// receiver give it the same `id`, unique among the messages between the two in one call (a
/// messaging executor tags with it). The schedules also post the messages between two ranks in
/// the same order on both ends, which is how NCCL matches them.
template <class E>
struct transfer {
  int peer = -1;
  std::uint32_t id = 0;
  E* data = nullptr;
  std::size_t count = 0;
};

/// The most distinct message ids one call uses (they must fit a messaging transport's step
/// bits).
inline constexpr std::uint32_t max_message_ids = 4096;

template <class X, class E>
concept executor = element<E> &&
    requires(X& x, const X& cx, std::span<const transfer<const E>> s,
             std::span<const transfer<E>> r, op o, const E* a, E* out, std::size_t n, int ranks) {
  { cx.rank() } -> std::convertible_to<int>;
  { cx.size() } -> std::convertible_to<int>;
  x.exchange(s, r);
  x.combine(o, a, a, out, n);
  x.finish_avg(out, n, ranks);
  x.copy(out, a, n);
};

}  // namespace ringzero
