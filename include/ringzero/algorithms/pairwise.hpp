// Pairwise exchange all_to_all and all_to_allv (as MPICH and Open MPI run them for large
// blocks): in round k = 1..n-1 rank r sends its block for rank r+k and receives rank r-k's block
// for it, so every rank talks to one peer in each direction per round and every link of a
// full-duplex network is busy in every round.
//
//   n-1 rounds; each rank sends and receives (n-1)/n of its buffer: (n-1)α + (n-1)/n·Sβ.
//
// Bounded in flight: a block is cut into at most tuning::policy::burst chunks and at most `window`
// rounds are posted at once, so a rank has at most 2·window·burst messages outstanding whatever
// the world size and the block size.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
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

namespace ringzero::algorithms::pairwise {

namespace detail {

/// Rounds posted at once: enough to keep a link busy while the previous round's last chunks
/// land, few enough that the messages in flight stay bounded.
inline constexpr int window = 4;

/// Preconditions (checked by the collectives layer): in and out do not overlap, every block
/// lies inside its buffer, receive blocks do not overlap, and the own block's send and receive
/// counts are equal.
template <collective_comm T, element E>
void exchange_blocks(T& comm, std::string_view what, const E* in, E* out, const block_map& m,
                     const options& opt) {
  namespace ad = algorithms::detail;
  using pending = typename ringzero::detail::exchange<T>::pending;
  ringzero::detail::exchange<T> ex(comm, what, "pairwise", opt.timeout);
  const int n = comm.size();
  const int r = comm.rank();
  const auto ur = static_cast<std::size_t>(r);
  const std::size_t chunk_bytes = ad::chunk_bytes_of(comm, opt);
  if (m.recv_counts[ur] > 0)
    std::memcpy(out + m.recv_displs[ur], in + m.send_displs[ur], m.recv_counts[ur] * sizeof(E));
  // Round k reuses the slot of round k - window, which it waits for first: only `window` rounds
  // are ever in flight, so only that many lists are kept, whatever the world size.
  std::array<std::vector<pending>, window> rounds;
  auto slot = [&](int k) -> std::vector<pending>& {
    return rounds[static_cast<std::size_t>(k % window)];
  };
  for (int k = 1; k < n; ++k) {
    auto& ps = slot(k);
    if (k > window) {
      ex.wait_all(ps);
      ps.clear();
    }
    const auto to = static_cast<std::size_t>(mod(r + k, n));
    const auto from = static_cast<std::size_t>(mod(r - k, n));
    ad::post_recvs(ex, static_cast<int>(from), k,
                   std::span<E>(out + m.recv_displs[from], m.recv_counts[from]), chunk_bytes, ps);
    ad::post_sends(ex, static_cast<int>(to), k,
                   std::span<const E>(in + m.send_displs[to], m.send_counts[to]), chunk_bytes, ps);
  }
  for (int k = std::max(1, n - window); k < n; ++k) ex.wait_all(slot(k));
}

}  // namespace detail

/// Preconditions (checked by the collectives layer): size() >= 2, in.size() == out.size() > 0
/// and a multiple of size(); in may equal out (then the input is first copied to the
/// communicator's scratch, one extra pass over S).
template <collective_comm T, element E>
void all_to_all(T& comm, std::span<const E> in, std::span<E> out, const options& opt) {
  const auto n = static_cast<std::size_t>(comm.size());
  const std::size_t block = in.size() / n;
  std::vector<std::size_t> counts(n, block), displs(n);
  for (std::size_t i = 0; i < n; ++i) displs[i] = i * block;
  const E* src = in.data();
  if (src == out.data()) {
    const std::span<E> copy = algorithms::detail::scratch_of<E>(comm, in.size());
    std::memcpy(copy.data(), in.data(), in.size_bytes());
    src = copy.data();
  }
  detail::exchange_blocks(comm, "all_to_all", src, out.data(),
                          block_map{counts, displs, counts, displs}, opt);
}

/// Preconditions (checked by the collectives layer): size() >= 2 and those of exchange_blocks.
template <collective_comm T, element E>
void all_to_allv(T& comm, std::span<const E> in, std::span<E> out, const block_map& m,
                 const options& opt) {
  detail::exchange_blocks(comm, "all_to_allv", in.data(), out.data(), m, opt);
}

/// all_to_all and all_to_allv, the bandwidth choice: every block crosses one link once.
struct descriptor {
  static constexpr algorithm id = algorithm::pairwise;
  static constexpr std::string_view name = "pairwise";
  static constexpr collective_set implements{collective::all_to_all, collective::all_to_allv};
  static constexpr bool needs_nodes = false;

  template <class Table>
  [[nodiscard]] static double cost(const tuning::cost_query& q) {
    return (q.ranks - 1) * q.p.alpha + q.frac() * q.bytes * q.p.beta;
  }

  template <collective_comm C, element E>
  static void run(C& comm, const call<E>& c, const options& opt) {
    if (c.kind == collective::all_to_allv)
      return pairwise::all_to_allv(comm, c.in, c.out, c.blocks, opt);
    pairwise::all_to_all(comm, c.in, c.out, opt);
  }
};

}  // namespace ringzero::algorithms::pairwise
