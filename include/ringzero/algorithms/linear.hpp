// Linear gather and scatter: the root exchanges one block with every other rank directly, all
// at once. No rank but the root needs scratch or forwards anything, and every block crosses one
// link exactly once.
//
//   gather, scatter: (n-1)α + (n-1)/n·Sβ with S the root's whole buffer.
//
// Bounded in flight: the root's messages are cut so that it has at most inflight·burst chunks
// (the transport's tuning::policy) outstanding in all (each peer's block is one message of larger
// chunks when n is large).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/blocks.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/algorithms/detail/pipeline.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms::linear {

namespace detail {

/// Chunk length of one peer's block: both ends compute it from (count, n) and the transport's
/// limits alone. The root has at most inflight·burst chunks posted at once, summed over its peers.
template <element E>
[[nodiscard]] std::size_t chunk_of(std::size_t count, int n, std::size_t chunk_bytes,
                                   const tuning::policy& p) {
  const std::size_t burst = std::max<std::size_t>(1, p.burst);
  const std::size_t root_inflight = std::max<std::size_t>(1, p.inflight) * burst;
  const std::size_t per_peer =
      std::max<std::size_t>(1, root_inflight / static_cast<std::size_t>(n - 1));
  return chunking::make(count, sizeof(E), chunk_bytes, std::min(per_peer, burst)).chunk;
}

template <class E, class Post>
void each_chunk(std::span<E> block, std::size_t c, Post&& post) {
  for (std::size_t i = 0, id = 0; i < block.size(); i += c, ++id)
    post(static_cast<std::uint32_t>(id), block.subspan(i, std::min(c, block.size() - i)));
}

}  // namespace detail

/// Preconditions (checked by the collectives layer): size() >= 2, in.size() > 0, and on the
/// root out.size() == size() * in.size() (in may be the root's block of out).
template <collective_comm T, element E>
void gather(T& comm, std::span<const E> in, std::span<E> out, int root, const options& opt) {
  namespace ad = algorithms::detail;
  using pending = typename ringzero::detail::exchange<T>::pending;
  ringzero::detail::exchange<T> ex(comm, "gather", "linear", opt.timeout);
  const int n = comm.size();
  const std::size_t count = in.size();
  const std::size_t c = detail::chunk_of<E>(count, n, ad::chunk_bytes_of(comm, opt), comm.tuning());
  std::vector<pending> ps;
  if (comm.rank() != root) {
    detail::each_chunk<const E>(in, c, [&](std::uint32_t id, std::span<const E> s) {
      ps.push_back(ex.send(root, 0, id, std::as_bytes(s)));
    });
    ex.wait_all(ps);
    return;
  }
  for (int p = 0; p < n; ++p) {
    if (p == root) continue;
    detail::each_chunk<E>(out.subspan(static_cast<std::size_t>(p) * count, count), c,
                          [&](std::uint32_t id, std::span<E> s) {
                            ps.push_back(ex.recv(p, 0, id, std::as_writable_bytes(s)));
                          });
  }
  E* own = out.data() + static_cast<std::size_t>(root) * count;
  if (own != in.data()) std::memcpy(own, in.data(), in.size_bytes());
  ex.wait_all(ps);
}

/// Preconditions (checked by the collectives layer): size() >= 2, out.size() > 0, and on the
/// root in.size() == size() * out.size() (out may be the root's block of in).
template <collective_comm T, element E>
void scatter(T& comm, std::span<const E> in, std::span<E> out, int root, const options& opt) {
  namespace ad = algorithms::detail;
  using pending = typename ringzero::detail::exchange<T>::pending;
  ringzero::detail::exchange<T> ex(comm, "scatter", "linear", opt.timeout);
  const int n = comm.size();
  const std::size_t count = out.size();
  const std::size_t c = detail::chunk_of<E>(count, n, ad::chunk_bytes_of(comm, opt), comm.tuning());
  std::vector<pending> ps;
  if (comm.rank() != root) {
    detail::each_chunk<E>(out, c, [&](std::uint32_t id, std::span<E> s) {
      ps.push_back(ex.recv(root, 0, id, std::as_writable_bytes(s)));
    });
    ex.wait_all(ps);
    return;
  }
  for (int p = 0; p < n; ++p) {
    if (p == root) continue;
    detail::each_chunk<const E>(in.subspan(static_cast<std::size_t>(p) * count, count), c,
                                [&](std::uint32_t id, std::span<const E> s) {
                                  ps.push_back(ex.send(p, 0, id, std::as_bytes(s)));
                                });
  }
  const E* own = in.data() + static_cast<std::size_t>(root) * count;
  if (own != out.data()) std::memcpy(out.data(), own, out.size_bytes());
  ex.wait_all(ps);
}

/// gather and scatter: n-1 messages through the root's link, at once.
struct descriptor {
  static constexpr algorithm id = algorithm::linear;
  static constexpr std::string_view name = "linear";
  static constexpr collective_set implements{collective::gather, collective::scatter};
  static constexpr bool needs_nodes = false;

  template <class Table>
  [[nodiscard]] static double cost(const tuning::cost_query& q) {
    return (q.ranks - 1) * q.p.alpha + q.frac() * q.bytes * q.p.beta;
  }

  template <collective_comm C, element E>
  static void run(C& comm, const call<E>& c, const options& opt) {
    if (c.kind == collective::gather) return linear::gather(comm, c.in, c.out, c.root, opt);
    linear::scatter(comm, c.in, c.out, c.root, opt);
  }
};

}  // namespace ringzero::algorithms::linear
