// Bruck's all_to_all (Bruck, Ho, Kipnis, Upfal & Weathersby, 1997), the latency-optimal choice
// for small blocks: ceil(log2 n) rounds instead of pairwise exchange's n-1.
//
//   1. rotate: block i of a scratch copy holds the block for rank r+i;
//   2. round j (k = 2^j): send every block whose index has bit k set to rank r+k, receive the
//      same-indexed blocks from rank r-k into their places;
//   3. rotate back: block i now holds rank r-i's block for this rank.
//
//   ceil(log2 n) rounds of about half the buffer: ceil(log2 n)·(α + S/2·β), plus three local
//   copies of S (the rotations and the packing).
//
// Every block moves through at most ceil(log2 n) ranks, so large blocks cost more than they
// save; the cost model keeps it to small ones. In place is free: the input is read once, into
// the rotated copy, before the output is written.
#pragma once

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

namespace ringzero::algorithms::bruck {

/// Preconditions (checked by the collectives layer): size() >= 2, in.size() == out.size() > 0
/// and a multiple of size(); in may equal out.
template <collective_comm T, element E>
void all_to_all(T& comm, std::span<const E> in, std::span<E> out, const options& opt) {
  namespace ad = algorithms::detail;
  using pending = typename ringzero::detail::exchange<T>::pending;
  ringzero::detail::exchange<T> ex(comm, "all_to_all", "bruck", opt.timeout);
  const int n = comm.size();
  const int r = comm.rank();
  const auto un = static_cast<std::size_t>(n);
  const std::size_t b = in.size() / un;
  const std::size_t chunk_bytes = ad::chunk_bytes_of(comm, opt);
  // No round sends more than half the blocks, rounded up.
  const std::size_t most = (un + 1) / 2;
  const std::span<E> scratch = ad::scratch_of<E>(comm, (un + 2 * most) * b);
  E* rotated = scratch.data();
  E* packed = rotated + un * b;
  E* arrived = packed + most * b;
  for (std::size_t i = 0; i < un; ++i)
    std::memcpy(rotated + i * b,
                in.data() + static_cast<std::size_t>(mod(r + static_cast<int>(i), n)) * b,
                b * sizeof(E));
  std::vector<pending> ps;
  int step = 0;
  for (std::size_t k = 1; k < un; k <<= 1, ++step) {
    std::size_t m = 0;
    for (std::size_t i = 0; i < un; ++i)
      if (i & k) std::memcpy(packed + (m++) * b, rotated + i * b, b * sizeof(E));
    const int kk = static_cast<int>(k);
    ps.clear();
    ad::post_recvs(ex, mod(r - kk, n), step, std::span<E>(arrived, m * b), chunk_bytes, ps);
    ad::post_sends(ex, mod(r + kk, n), step, std::span<const E>(packed, m * b), chunk_bytes, ps);
    ex.wait_all(ps);
    m = 0;
    for (std::size_t i = 0; i < un; ++i)
      if (i & k) std::memcpy(rotated + i * b, arrived + (m++) * b, b * sizeof(E));
  }
  for (std::size_t i = 0; i < un; ++i)
    std::memcpy(out.data() + static_cast<std::size_t>(mod(r - static_cast<int>(i), n)) * b,
                rotated + i * b, b * sizeof(E));
}

/// all_to_all for small blocks. About half the blocks move in each round, and the buffer is
/// copied three times (priced as a pass of gamma each).
struct descriptor {
  static constexpr algorithm id = algorithm::bruck;
  static constexpr std::string_view name = "bruck";
  static constexpr collective_set implements{collective::all_to_all};
  static constexpr bool needs_nodes = false;

  template <class Table>
  [[nodiscard]] static double cost(const tuning::cost_query& q) {
    return tuning::ceil_log2(q.ranks) * (q.p.alpha + q.bytes / 2 * q.p.beta) +
           3 * q.bytes * q.p.gamma;
  }

  template <collective_comm C, element E>
  static void run(C& comm, const call<E>& c, const options& opt) {
    bruck::all_to_all(comm, c.in, c.out, opt);
  }
};

}  // namespace ringzero::algorithms::bruck
