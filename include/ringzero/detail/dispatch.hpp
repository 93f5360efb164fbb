// The dispatcher: how a validated call finds what runs it. One ordered table of paths, walked
// the way algorithms/table.hpp walks its algorithms: each path says whether it takes the call
// (applies) and runs it (run); the first that takes it and does not decline it runs it.
//
//   path                   takes                                             detail/paths/
//   quantized              options::wire (bf16, int8 or int4 on the wire)    quantized.hpp
//   reproducible_device    options::reproducible on device buffers           reproducible.hpp
//   reproducible_native    ... float sums a transport makes exactly (shm)    reproducible.hpp
//   reproducible_host      ... anywhere else                                 reproducible.hpp
//   native                 a backend's own collectives (NCCL; shm's segment) native.hpp
//   device_schedule        ringzero's schedules on a device executor         device.hpp
//   host                   ringzero's algorithms over messages               host.hpp
//
// Every path reads the call through its call_route (detail/call_route.hpp): the descriptor, the
// sizes, the options and environment, worked out once. A path starts the call (RINGZERO_CHECK,
// the count) only once it runs it; a transport that declines a call it was offered leaves it
// started for the next path. Adding a path: a struct with static applies(route) and run(route)
// (returning false to decline), and a place in `builtin_paths`.
#pragma once

#include <fmt/core.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/barrier.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/algorithms/table.hpp"
#include "ringzero/communicator.hpp"
#include "ringzero/detail/call_route.hpp"
#include "ringzero/detail/dispatch_fwd.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/detail/paths/device.hpp"
#include "ringzero/detail/paths/host.hpp"
#include "ringzero/detail/paths/native.hpp"
#include "ringzero/detail/paths/quantized.hpp"
#include "ringzero/detail/paths/reproducible.hpp"
#include "ringzero/detail/trace_scope.hpp"
#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/transport/native.hpp"
#include "ringzero/types.hpp"

namespace ringzero::detail {

/// Paths in the order they are offered a call (earlier wins).
template <class... P>
struct path_table {
  /// The same list with more paths at the end.
  template <class... X>
  using with = path_table<P..., X...>;

  template <class R>
  static void run(R& x) {
    if (!((P::applies(x) && P::run(x)) || ...))
      throw unsupported(fmt::format("{}: no path of this backend runs the call", x.d.name));
  }
};

using builtin_paths =
    path_table<paths::quantized, paths::reproducible_device, paths::reproducible_native,
               paths::reproducible_host, paths::native, paths::device_schedule, paths::host>;

template <class Table, class T, element E>
void dispatch(communicator<T>& comm, const algorithms::call<E>& c, const options& opt) {
  call_route<Table, T, E> x(comm, c, opt);
  builtin_paths::run(x);
}

template <class T, element E>
void dispatch_builtin(communicator<T>& comm, const algorithms::call<E>& c, const options& opt) {
  dispatch<algorithms::builtin>(comm, c, opt);
}

/// barrier(), checked: every rank entered once it returns. It moves nothing, so it is never a
/// path's "empty" call: the backend's own barrier (NCCL; shm's segment), else dissemination.
template <class T>
void dispatch_barrier(communicator<T>& comm, const options& opt) {
  const call_env env = call_env::read();
  // RINGZERO_CHECK compares a barrier too: a rank in a barrier while another is in a collective
  // would otherwise see only messages of the wrong size, or none.
  maybe_check<T, std::uint8_t>(comm, collective::barrier, 0, op::sum, 0, opt, env.check_on());
  collective_scope<communicator<T>> scope(comm, collective::barrier, algorithm::automatic, 0,
                                          dtype::uint8, op::sum, opt);
  if (comm.size() == 1) return;
  native_call nc{.kind = collective::barrier, .sequence = comm.state().collective_seq};
  if constexpr (native_collectives<T>) {
    comm.transport().run_native(nc, opt);
  } else {
    if constexpr (some_native_collectives<T>)
      if (comm.comm_id() == 0 && !env.algo && offer_native(comm, nc, opt)) return;
    algorithms::barrier(comm, opt);
  }
}

/// Point-to-point traffic, checked (check_peer, check_p2p). Host transports stamp each message
/// with a per-peer sequence number (so messages match in posting order); native transports order
/// them themselves.
template <class T, element E>
void dispatch_p2p(communicator<T>& comm, std::string_view what, std::span<const E> out, int to,
                  std::span<E> in, int from, const options& opt) {
  collective_scope<communicator<T>> scope(comm, collective::send_recv, algorithm::automatic,
                                          out.size_bytes() + in.size_bytes(), dtype_of<E>(),
                                          op::sum, opt, what);
  if constexpr (native_collectives<T>) {
    native_call nc;
    nc.kind = collective::send_recv;
    nc.type = dtype_of<E>();
    nc.in = out.data();
    nc.count = out.size();
    nc.peer = to;
    nc.out = in.data();
    nc.recv_count = in.size();
    nc.from = from;
    comm.transport().run_native(nc, opt);
  } else {
    if constexpr (!device_memory_transport<T>)
      refuse_device_memory(what, {{"send buffer", out.empty() ? nullptr : out.data()},
                                  {"receive buffer", in.empty() ? nullptr : in.data()}});
    auto& st = comm.state();
    st.p2p_send_seq.resize(static_cast<std::size_t>(comm.size()));
    st.p2p_recv_seq.resize(static_cast<std::size_t>(comm.size()));
    std::optional<exchange<communicator<T>>> rx, tx;
    typename exchange<communicator<T>>::pending r, s;
    if (from >= 0) {
      rx.emplace(comm, what, "p2p", opt.timeout, true,
                 st.p2p_recv_seq[static_cast<std::size_t>(from)]++);
      r = rx->recv(from, 0, 0, std::as_writable_bytes(in));
    }
    if (to >= 0) {
      tx.emplace(comm, what, "p2p", opt.timeout, true,
                 st.p2p_send_seq[static_cast<std::size_t>(to)]++);
      s = tx->send(to, 0, 0, std::as_bytes(out));
    }
    if (rx) rx->wait(r);
    if (tx) tx->wait(s);
  }
}

}  // namespace ringzero::detail
