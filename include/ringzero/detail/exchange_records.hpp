// Every rank's copy of a small record, over messages: how the ranks of a messaging communicator
// put side by side what each is about to do, so that they can agree on it (detail/agreement.hpp).
#pragma once

#include <chrono>
#include <cstddef>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/exchange.hpp"

namespace ringzero::detail {

/// Rank r's `mine` at [r], on every rank: one message to and one from every other rank, all
/// posted at once, under one collective sequence number of `comm`. Collective.
template <collective_comm C, class R>
[[nodiscard]] std::vector<R> exchange_records(C& comm, const R& mine, std::string_view what,
                                              std::chrono::nanoseconds timeout = {}) {
  static_assert(std::is_trivially_copyable_v<R>);
  const int n = comm.size();
  const int me = comm.rank();
  std::vector<R> all(static_cast<std::size_t>(n));
  all[static_cast<std::size_t>(me)] = mine;
  if (n == 1) return all;
  exchange<C> ex(comm, what, "direct", timeout);
  std::vector<typename exchange<C>::pending> ps;
  ps.reserve(2 * static_cast<std::size_t>(n - 1));
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    ps.push_back(
        ex.recv(r, 0, 0, std::as_writable_bytes(std::span(&all[static_cast<std::size_t>(r)], 1))));
    ps.push_back(ex.send(r, 0, 0, std::as_bytes(std::span(&mine, 1))));
  }
  ex.wait_all(ps);
  return all;
}

}  // namespace ringzero::detail
