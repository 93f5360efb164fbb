// Ring algorithms (Patarasuk & Yuan): the bandwidth-optimal choice for large messages.
//
//   reduce_scatter: n-1 steps; each rank sends (n-1)/n of the data and reduces as much.
//   all_gather:     n-1 steps; each rank sends (n-1)/n of the data.
//   all_reduce:     reduce_scatter then all_gather: 2(n-1) latency steps, 2(n-1)/n of the data
//                   sent per rank, (n-1)/n reduced.
//
// Each block is cut into chunks and chunks are pipelined: chunk c of step s+1 leaves as soon as
// chunk c of step s is reduced, so the network and the reduction overlap. Every element is
// reduced by exactly one chain of ranks and then copied, so all ranks end with identical bits.
#pragma once

#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/blocks.hpp"
#include "ringzero/algorithms/chain.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms::ring {

namespace detail {

using ringzero::detail::exchange;

template <class T>
std::span<const std::byte> bytes_of(const T* p, std::size_t n) {
  return {reinterpret_cast<const std::byte*>(p), n * sizeof(T)};
}
template <class T>
std::span<std::byte> writable_bytes_of(T* p, std::size_t n) {
  return {reinterpret_cast<std::byte*>(p), n * sizeof(T)};
}

/// How the phases below reduce one chunk: out = a (op) b over n elements, then, when `finish`
/// (the last step of op::avg), the division by `ranks`. This one runs the CPU loops on host
/// memory; device buffers pass one that launches kernels (transport/libfabric/cuda.cuh) and
/// returns once the result is in place, since the next step sends it.
struct cpu_reducer {
  template <element E>
  void operator()(op o, const E* a, const E* b, E* out, std::size_t n, bool finish,
                  int ranks) const {
    reduction::combine(o, a, b, out, n);
    if (finish) reduction::finish_avg(out, n, ranks);
  }
};

/// Reduce-scatter over `blocks` of `in`: afterwards block `rank` is fully reduced at
/// dest(rank, n-2). Partial results of step s go to dest(block, s). `rbuf` holds two blocks:
/// receives alternate between them so step s+2 can be posted while step s+1 is in flight.
///
/// The schedule: at step s rank r sends block r-1-s and receives block r-2-s from its left
/// neighbour, so after n-1 steps it holds block r reduced over all ranks.
template <collective_comm T, element E, class Dest, class Reduce = cpu_reducer>
void reduce_scatter_phase(exchange<T>& ex, const block_layout& bl, const E* in, Dest dest, op o,
                          const chunking& ch, E* rbuf, Reduce reduce = {}) {
  using pending = typename exchange<T>::pending;
  const int n = ex.size();
  const int r = ex.rank();
  const int next = mod(r + 1, n);
  const int prev = mod(r - 1, n);
  const int steps = n - 1;
  const std::size_t nc = ch.count;

  auto slot = [&](int s) { return rbuf + static_cast<std::size_t>(s % 2) * bl.max_length; };
  auto block_sent = [&](int s) { return static_cast<std::size_t>(mod(r - 1 - s, n)); };
  auto block_recv = [&](int s) { return static_cast<std::size_t>(mod(r - 2 - s, n)); };

  std::vector<pending> recvs(2 * nc), sends(2 * nc);
  auto idx = [&](int s, std::size_t c) { return static_cast<std::size_t>(s % 2) * nc + c; };

  auto post_recv = [&](int s, std::size_t c) {
    const std::size_t b = block_recv(s);
    const auto rg = ch.of(bl.length[b], c);
    pending& p = recvs[idx(s, c)];
    if (rg.size == 0) {
      p = pending{};
      p.done = true;
      return;
    }
    p = ex.recv(prev, s, static_cast<std::uint32_t>(c),
                writable_bytes_of(slot(s) + rg.begin, rg.size));
  };
  auto post_send = [&](int s, std::size_t c, const E* block_base) {
    const auto rg = ch.of(bl.length[block_sent(s)], c);
    pending& p = sends[idx(s, c)];
    if (rg.size == 0) {
      p = pending{};
      p.done = true;
      return;
    }
    p = ex.send(next, s, static_cast<std::uint32_t>(c), bytes_of(block_base + rg.begin, rg.size));
  };

  for (std::size_t c = 0; c < nc; ++c) {
    post_recv(0, c);
    if (steps > 1) post_recv(1, c);
    post_send(0, c, in + bl.offset[block_sent(0)]);
  }
  for (int s = 0; s < steps; ++s) {
    const std::size_t b = block_recv(s);
    E* d = dest(b, s);
    for (std::size_t c = 0; c < nc; ++c) {
      const auto rg = ch.of(bl.length[b], c);
      // The send two steps back used this chunk's pending slot and, for scratch
      // destinations, the memory we are about to write.
      ex.wait(sends[idx(s + 1, c)]);
      if (rg.size > 0) {
        ex.wait(recvs[idx(s, c)]);
        reduce(o, in + bl.offset[b] + rg.begin, slot(s) + rg.begin, d + rg.begin, rg.size,
               o == op::avg && s == steps - 1, n);
      }
      if (s + 2 < steps) post_recv(s + 2, c);
      if (s + 1 < steps) post_send(s + 1, c, d);
    }
  }
  for (auto& p : sends) ex.wait(p);
}

/// All-gather over `blocks` of `out`, where each rank's own block r is already in place.
template <collective_comm T, element E>
void all_gather_phase(exchange<T>& ex, const block_layout& bl, E* out, const chunking& ch,
                      int step0) {
  using pending = typename exchange<T>::pending;
  const int n = ex.size();
  const int r = ex.rank();
  const int next = mod(r + 1, n);
  const int prev = mod(r - 1, n);
  const int steps = n - 1;
  const std::size_t nc = ch.count;
  auto block_recv = [&](int s) { return static_cast<std::size_t>(mod(r - 1 - s, n)); };

  // Received blocks land in their final place, so receives need no slots; they are posted
  // two steps ahead (in the order the left neighbour sends), which keeps the link busy while
  // bounding the receives a transport must hold to 2 * nc whatever the world size.
  std::vector<pending> recvs(static_cast<std::size_t>(steps) * nc);
  std::vector<pending> sends(static_cast<std::size_t>(steps) * nc);
  auto post_recvs = [&](int s) {
    const std::size_t b = block_recv(s);
    for (std::size_t c = 0; c < nc; ++c) {
      const auto rg = ch.of(bl.length[b], c);
      auto& p = recvs[static_cast<std::size_t>(s) * nc + c];
      if (rg.size == 0) {
        p.done = true;
        continue;
      }
      p = ex.recv(prev, step0 + s, static_cast<std::uint32_t>(c),
                  writable_bytes_of(out + bl.offset[b] + rg.begin, rg.size));
    }
  };
  for (int s = 0; s < std::min(steps, 2); ++s) post_recvs(s);
  auto post_send = [&](int s, std::size_t b) {
    for (std::size_t c = 0; c < nc; ++c) {
      const auto rg = ch.of(bl.length[b], c);
      auto& p = sends[static_cast<std::size_t>(s) * nc + c];
      if (rg.size == 0) {
        p.done = true;
        continue;
      }
      p = ex.send(next, step0 + s, static_cast<std::uint32_t>(c),
                  bytes_of(out + bl.offset[b] + rg.begin, rg.size));
    }
  };
  // Step 0 sends our own block; step s+1 forwards what arrived at step s, chunk by chunk.
  post_send(0, static_cast<std::size_t>(r));
  for (int s = 0; s < steps; ++s) {
    const std::size_t b = block_recv(s);
    for (std::size_t c = 0; c < nc; ++c) {
      ex.wait(recvs[static_cast<std::size_t>(s) * nc + c]);
      if (s + 1 < steps) {
        // Two steps of sends at most: the right neighbour has only two steps of receives
        // posted, and anything further would wait there as an early arrival.
        if (s >= 1) ex.wait(sends[static_cast<std::size_t>(s - 1) * nc + c]);
        const auto rg = ch.of(bl.length[b], c);
        auto& p = sends[static_cast<std::size_t>(s + 1) * nc + c];
        if (rg.size == 0) {
          p.done = true;
          continue;
        }
        p = ex.send(next, step0 + s + 1, static_cast<std::uint32_t>(c),
                    bytes_of(out + bl.offset[b] + rg.begin, rg.size));
      }
    }
    if (s + 2 < steps) post_recvs(s + 2);
  }
  for (auto& p : sends) ex.wait(p);
}

template <class E>
std::size_t chunk_bytes_for(const options& opt, const tuning::policy& cp) {
  return std::max(opt.chunk_bytes ? opt.chunk_bytes : cp.chunk_bytes, cp.min_chunk_bytes);
}

}  // namespace detail

/// Preconditions (checked by the collectives layer): size() >= 2, in.size() == out.size() > 0;
/// in may equal out.
template <collective_comm T, element E>
void all_reduce(T& comm, std::span<const E> in, std::span<E> out, op o, const options& opt) {
  ringzero::detail::exchange<T> ex(comm, "all_reduce", "ring", opt.timeout);
  const int n = comm.size();
  const auto bl = block_layout::even(out.size(), n);
  const auto ch =
      chunking::make(bl.max_length, sizeof(E), detail::chunk_bytes_for<E>(opt, comm.tuning()),
                     comm.tuning().burst);
  E* o_base = out.data();
  E* rbuf = reinterpret_cast<E*>(comm.state().scratch(2 * bl.max_length * sizeof(E)).data());
  detail::reduce_scatter_phase(
      ex, bl, in.data(), [&](std::size_t b, int) { return o_base + bl.offset[b]; }, o, ch, rbuf);
  detail::all_gather_phase(ex, bl, o_base, ch, n - 1);
}

/// in holds size()*out.size() elements; out receives block rank(). out may be in's own block.
template <collective_comm T, element E>
void reduce_scatter(T& comm, std::span<const E> in, std::span<E> out, op o, const options& opt) {
  ringzero::detail::exchange<T> ex(comm, "reduce_scatter", "ring", opt.timeout);
  const int n = comm.size();
  const auto bl = block_layout::uniform(out.size(), n);
  const auto ch =
      chunking::make(bl.max_length, sizeof(E), detail::chunk_bytes_for<E>(opt, comm.tuning()),
                     comm.tuning().burst);
  // Scratch holds two receive slots and two partial-result slots: partials travel through
  // scratch so the input is never written, and the last step reduces straight into out.
  E* rbuf = reinterpret_cast<E*>(comm.state().scratch(4 * bl.max_length * sizeof(E)).data());
  E* partial = rbuf + 2 * bl.max_length;
  E* out_base = out.data();
  detail::reduce_scatter_phase(
      ex, bl, in.data(),
      [&](std::size_t, int s) {
        return s == n - 2 ? out_base : partial + static_cast<std::size_t>(s % 2) * bl.max_length;
      },
      o, ch, rbuf);
}

/// out holds size()*in.size() elements; in may be out's block rank().
template <collective_comm T, element E>
void all_gather(T& comm, std::span<const E> in, std::span<E> out, const options& opt) {
  ringzero::detail::exchange<T> ex(comm, "all_gather", "ring", opt.timeout);
  const int n = comm.size();
  const auto bl = block_layout::uniform(in.size(), n);
  const auto ch =
      chunking::make(bl.max_length, sizeof(E), detail::chunk_bytes_for<E>(opt, comm.tuning()),
                     comm.tuning().burst);
  E* own = out.data() + bl.offset[static_cast<std::size_t>(comm.rank())];
  if (own != in.data()) std::memcpy(own, in.data(), in.size_bytes());
  detail::all_gather_phase(ex, bl, out.data(), ch, 0);
}

/// Ring all_reduce, reduce_scatter and all_gather; for the rooted collectives, the same
/// neighbour-to-neighbour pipeline as a chain (algorithms/chain.hpp).
struct descriptor {
  static constexpr algorithm id = algorithm::ring;
  static constexpr std::string_view name = "ring";
  static constexpr collective_set implements{collective::all_reduce, collective::reduce_scatter,
                                             collective::all_gather, collective::broadcast,
                                             collective::reduce};
  static constexpr bool needs_nodes = false;

  template <class Table>
  [[nodiscard]] static double cost(const tuning::cost_query& q) {
    const double al = q.p.alpha, be = q.p.beta, ga = q.p.gamma, s = q.bytes, n = q.ranks;
    switch (q.c) {
      case collective::all_reduce:
        return 2 * (n - 1) * al + 2 * q.frac() * s * be + q.frac() * s * ga;
      case collective::reduce_scatter:
        return (n - 1) * al + q.frac() * s * (be + ga);
      case collective::all_gather:
        return (n - 1) * al + q.frac() * s * be;
      default: {
        const double g = q.c == collective::reduce ? ga : 0.0;
        const double k = q.chunks();
        return (n - 2 + k) * (al + s / k * (be + g));
      }
    }
  }

  template <collective_comm C, element E>
  static void run(C& comm, const call<E>& c, const options& opt) {
    switch (c.kind) {
      case collective::all_reduce:
        return ring::all_reduce(comm, c.in, c.out, c.reduction, opt);
      case collective::reduce_scatter:
        return ring::reduce_scatter(comm, c.in, c.out, c.reduction, opt);
      case collective::all_gather:
        return ring::all_gather(comm, c.in, c.out, opt);
      case collective::broadcast:
        return chain::broadcast(comm, c.out, c.root, opt);
      default:
        return chain::reduce(comm, c.in, c.out, c.reduction, c.root, opt);
    }
  }
};

}  // namespace ringzero::algorithms::ring
