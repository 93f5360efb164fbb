// What ringzero's algorithms look like when written once for buffers the calling thread may not
// touch (GPU memory): a schedule is a sequence of steps, each one exchange of whole messages
// followed by local work, run by an executor. The NCCL backend's executor turns a step into one
// NCCL group of ncclSend/ncclRecv and the local work into kernels on the stream
// (transport/nccl/executor.hpp); host_executor.hpp runs the same schedules over a ringzero
// messaging transport on host memory, which is how they are tested without a GPU.
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
#include <utility>
#include <vector>

#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms::schedule {

/// One message of a step: `count` elements at `data`, to or from `peer`. Its sender and its
/// receiver give it the same `id`, unique among the messages between the two in one call (a host
/// executor tags with it). The schedules also post the messages between two ranks in the same
/// order on both ends, which is how NCCL matches them.
template <class E>
struct transfer {
  int peer = -1;
  std::uint32_t id = 0;
  E* data = nullptr;
  std::size_t count = 0;
};

/// The most distinct message ids one call uses (they must fit a host transport's step bits).
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

namespace detail {

/// One step with its empty messages dropped. Sender and receiver compute the same lengths, so
/// both drop the same ones; a step left with nothing is not handed to the executor at all.
template <element E, executor<E> X>
void step(X& x, std::vector<transfer<const E>> sends, std::vector<transfer<E>> recvs) {
  std::erase_if(sends, [](const auto& t) { return t.count == 0; });
  std::erase_if(recvs, [](const auto& t) { return t.count == 0; });
  if (sends.empty() && recvs.empty()) return;
  x.exchange(std::span<const transfer<const E>>(sends), std::span<const transfer<E>>(recvs));
}

}  // namespace detail

}  // namespace ringzero::algorithms::schedule
