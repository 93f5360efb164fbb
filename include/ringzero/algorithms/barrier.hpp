// Dissemination barrier (Hensgen, Finkel & Manber, 1988): in round k every rank signals rank
// r + 2^k and waits for rank r - 2^k. After ceil(log2 n) rounds each rank has heard, directly
// or through others, from every rank, so none leaves before all have arrived.
//
//   latency: ceil(log2 n) steps of zero-byte messages; no data moves.
#pragma once

#include <cstddef>
#include <span>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/blocks.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/exchange.hpp"

namespace ringzero::algorithms {

/// Precondition (checked by the collectives layer): size() >= 2.
template <collective_comm T>
void barrier(T& comm, const options& opt) {
  ringzero::detail::exchange<T> ex(comm, "barrier", "dissemination", opt.timeout);
  const int n = comm.size();
  const int r = comm.rank();
  for (int dist = 1, step = 0; dist < n; dist *= 2, ++step)
    ex.sendrecv(mod(r + dist, n), std::span<const std::byte>{}, mod(r - dist, n),
                std::span<std::byte>{}, step);
}

}  // namespace ringzero::algorithms
