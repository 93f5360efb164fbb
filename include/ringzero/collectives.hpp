// The collectives API: what a trainer calls, the same for every backend. Every function
//   - validates its arguments on the calling rank and throws ringzero::invalid_argument before
//     anything is sent (sizes, overlapping out-of-place buffers, root range, op);
//   - hands the call to the dispatcher (detail/dispatch.hpp), whose table of paths runs it: the
//     transport's own collective where it has one (NCCL; shm in its segment where that path
//     applies, transport/native.hpp); on GPU buffers one of ringzero's algorithms as a schedule
//     (algorithms/schedule.hpp) on the executor the transport offers (on NCCL when
//     options::algorithm names ring or tree; on libfabric opened with options::device_memory);
//     else one of ringzero's algorithms over messages (options::algorithm, else RINGZERO_ALGO,
//     else the cost model, all from the one algorithm table, algorithms/table.hpp);
//     options::reproducible's exact sums on any collective whose descriptor reduces;
//   - leaves bitwise identical results on every rank that receives them;
//   - fails with timeout_error naming the step and peer if a peer stops answering.
//
// In place is expressed as NCCL expresses it: all_reduce/broadcast/reduce with in.data() ==
// out.data(); reduce_scatter with out being in's block rank(); all_gather with in being out's
// block rank(). As MPI_IN_PLACE: all_to_all with in.data() == out.data(); gather with in being
// the root's block of out, scatter with out being the root's block of in. all_to_allv has no
// in-place form. Any other overlap between in and out is an error.
#pragma once

#include <fmt/core.h>

#include <cstddef>
#include <span>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/algorithms/table.hpp"
#include "ringzero/collective_table.hpp"
#include "ringzero/communicator.hpp"
#include "ringzero/detail/dispatch.hpp"
#include "ringzero/detail/validate.hpp"
#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero {

/// Runs collective `d` (collective_table.hpp) with the algorithms of `Table`: the buffers, op
/// and root are checked by its descriptor, the call is dispatched as every collective is. The
/// named entry points below are this with a built-in descriptor; a collective outside the
/// built-in list runs through it with a table that holds its algorithms
/// (tests/core/collective_table_test.cpp). `o` is ignored where d does not reduce, `root`
/// where it has none. all_to_allv (per-rank counts), barrier and send_recv have their own.
template <class Table = algorithms::builtin, class T, element E>
void run_collective(communicator<T>& comm, const collective_descriptor& d, std::span<const E> in,
                    std::span<E> out, op o, int root, const options& opt = {}) {
  comm.check_usable(d.name);
  detail::check_options(d.name, opt);
  if (d.in.size == extent::none || d.in.size == extent::varies || d.out.size == extent::none ||
      d.out.size == extent::varies || d.id == collective::send_recv)
    throw invalid_argument(fmt::format(
        "{}: run_collective takes collectives whose buffers are count-sized or size() blocks of "
        "it; call {} itself",
        d.name, d.name));
  detail::check_call(d, comm.rank(), comm.size(), in, out, o, root);
  detail::dispatch<Table>(comm,
                          algorithms::call<E>{.kind = d.id,
                                              .in = in,
                                              .out = out,
                                              .reduction = d.reduces ? o : op::sum,
                                              .root = d.rooted ? root : 0,
                                              .described = &d},
                          opt);
}

/// out[i] = in[i] reduced over all ranks. Cost (ring, large messages): 2(n-1) steps, each rank
/// sends and receives 2(n-1)/n of the buffer and reduces (n-1)/n of it.
template <class T, element E>
void all_reduce(communicator<T>& comm, std::span<const E> in, std::span<E> out, op o,
                const options& opt = {}) {
  run_collective(comm, builtin_collectives::all_reduce, in, out, o, 0, opt);
}

/// In-place all_reduce.
template <class T, element E>
void all_reduce(communicator<T>& comm, std::span<E> data, op o, const options& opt = {}) {
  all_reduce(comm, std::span<const E>(data), data, o, opt);
}

template <class T, element E>
void all_reduce(communicator<T>& comm, std::span<E> in, std::span<E> out, op o,
                const options& opt = {}) {
  all_reduce(comm, std::span<const E>(in), out, o, opt);
}

/// in holds size()*out.size() elements, block r for rank r; out receives this rank's block
/// reduced over all ranks. Cost (ring): n-1 steps, (n-1)/n of the input sent and reduced.
template <class T, element E>
void reduce_scatter(communicator<T>& comm, std::span<const E> in, std::span<E> out, op o,
                    const options& opt = {}) {
  run_collective(comm, builtin_collectives::reduce_scatter, in, out, o, 0, opt);
}

template <class T, element E>
void reduce_scatter(communicator<T>& comm, std::span<E> in, std::span<E> out, op o,
                    const options& opt = {}) {
  reduce_scatter(comm, std::span<const E>(in), out, o, opt);
}

/// out (size()*in.size() elements) receives every rank's in, block r from rank r.
/// Cost (ring): n-1 steps, (n-1)/n of the output received.
template <class T, element E>
void all_gather(communicator<T>& comm, std::span<const E> in, std::span<E> out,
                const options& opt = {}) {
  run_collective(comm, builtin_collectives::all_gather, in, out, op::sum, 0, opt);
}

template <class T, element E>
void all_gather(communicator<T>& comm, std::span<E> in, std::span<E> out, const options& opt = {}) {
  all_gather(comm, std::span<const E>(in), out, opt);
}

/// Copies root's in to every rank's out. in is read only on root. Cost: pipelined chain
/// (ring) n-2+k chunk steps; binomial tree (tree) ceil(log2 n) whole-message steps.
template <class T, element E>
void broadcast(communicator<T>& comm, std::span<const E> in, std::span<E> out, int root,
               const options& opt = {}) {
  run_collective(comm, builtin_collectives::broadcast, in, out, op::sum, root, opt);
}

/// In-place broadcast.
template <class T, element E>
void broadcast(communicator<T>& comm, std::span<E> data, int root, const options& opt = {}) {
  broadcast(comm, std::span<const E>(data), data, root, opt);
}

template <class T, element E>
void broadcast(communicator<T>& comm, std::span<E> in, std::span<E> out, int root,
               const options& opt = {}) {
  broadcast(comm, std::span<const E>(in), out, root, opt);
}

/// out on root receives in reduced over all ranks; out is not touched elsewhere (it may be
/// empty there). Cost: as broadcast, plus reducing the buffer once per hop.
template <class T, element E>
void reduce(communicator<T>& comm, std::span<const E> in, std::span<E> out, op o, int root,
            const options& opt = {}) {
  run_collective(comm, builtin_collectives::reduce, in, out, o, root, opt);
}

template <class T, element E>
void reduce(communicator<T>& comm, std::span<E> in, std::span<E> out, op o, int root,
            const options& opt = {}) {
  reduce(comm, std::span<const E>(in), out, o, root, opt);
}

/// In-place reduce: data on root is replaced by the reduction.
template <class T, element E>
void reduce(communicator<T>& comm, std::span<E> data, op o, int root, const options& opt = {}) {
  reduce(comm, std::span<const E>(data), data, o, root, opt);
}

/// Block r of in (in.size() / size() elements) goes to rank r; block r of out comes from rank r.
/// In place when in.data() == out.data(). Cost: pairwise exchange n-1 steps, (n-1)/n of the
/// buffer sent and received per rank; Bruck (small blocks) ceil(log2 n) steps of about half the
/// buffer; hierarchical (several nodes) gathers to node leaders, which exchange per-node bundles.
template <class T, element E>
void all_to_all(communicator<T>& comm, std::span<const E> in, std::span<E> out,
                const options& opt = {}) {
  run_collective(comm, builtin_collectives::all_to_all, in, out, op::sum, 0, opt);
}

/// In-place all_to_all.
template <class T, element E>
void all_to_all(communicator<T>& comm, std::span<E> data, const options& opt = {}) {
  all_to_all(comm, std::span<const E>(data), data, opt);
}

template <class T, element E>
void all_to_all(communicator<T>& comm, std::span<E> in, std::span<E> out, const options& opt = {}) {
  all_to_all(comm, std::span<const E>(in), out, opt);
}

/// As MPI_Alltoallv: the send_counts[r] elements at in[send_displs[r]] go to rank r, and the
/// recv_counts[r] elements from rank r land at out[recv_displs[r]]. Counts may be zero and
/// differ per peer, but what rank i sends rank j must be what j expects from i (RINGZERO_CHECK=1
/// verifies it). Send blocks may overlap, receive blocks may not; in and out may not overlap.
/// Cost: pairwise exchange, n-1 steps.
template <class T, element E>
void all_to_allv(communicator<T>& comm, std::span<const E> in,
                 std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                 std::span<E> out, std::span<const std::size_t> recv_counts,
                 std::span<const std::size_t> recv_displs, const options& opt = {}) {
  comm.check_usable("all_to_allv");
  detail::check_options("all_to_allv", opt);
  detail::check_all_to_allv(comm.rank(), comm.size(), in, send_counts, send_displs, out,
                            recv_counts, recv_displs);
  detail::dispatch<algorithms::builtin>(
      comm,
      algorithms::call<E>{collective::all_to_allv,
                          in,
                          out,
                          op::sum,
                          0,
                          {send_counts, send_displs, recv_counts, recv_displs}},
      opt);
}

template <class T, element E>
void all_to_allv(communicator<T>& comm, std::span<E> in, std::span<const std::size_t> send_counts,
                 std::span<const std::size_t> send_displs, std::span<E> out,
                 std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs,
                 const options& opt = {}) {
  all_to_allv(comm, std::span<const E>(in), send_counts, send_displs, out, recv_counts, recv_displs,
              opt);
}

/// out on root (size()*in.size() elements) receives every rank's in, block r from rank r; out
/// is not touched elsewhere (it may be empty there). In place when in is the root's block of
/// out. Cost: linear n-1 messages into the root; binomial tree (tree) ceil(log2 n) steps; both
/// carry (n-1)/n of the root's buffer over its link.
template <class T, element E>
void gather(communicator<T>& comm, std::span<const E> in, std::span<E> out, int root,
            const options& opt = {}) {
  run_collective(comm, builtin_collectives::gather, in, out, op::sum, root, opt);
}

template <class T, element E>
void gather(communicator<T>& comm, std::span<E> in, std::span<E> out, int root,
            const options& opt = {}) {
  gather(comm, std::span<const E>(in), out, root, opt);
}

/// Block r of root's in (size()*out.size() elements) goes to rank r's out; in is read only on
/// root (it may be empty elsewhere). In place when out is the root's block of in. Cost: as
/// gather, the other way.
template <class T, element E>
void scatter(communicator<T>& comm, std::span<const E> in, std::span<E> out, int root,
             const options& opt = {}) {
  run_collective(comm, builtin_collectives::scatter, in, out, op::sum, root, opt);
}

template <class T, element E>
void scatter(communicator<T>& comm, std::span<E> in, std::span<E> out, int root,
             const options& opt = {}) {
  scatter(comm, std::span<const E>(in), out, root, opt);
}

/// Returns once every rank has entered. Cost: ceil(log2 n) zero-byte steps (dissemination).
template <class T>
void barrier(communicator<T>& comm, const options& opt = {}) {
  comm.check_usable("barrier");
  detail::check_options("barrier", opt);
  if (opt.algorithm != algorithm::automatic)
    throw invalid_argument(fmt::format("barrier: algorithm '{}' does not implement this collective",
                                       algorithm_name(opt.algorithm)));
  detail::dispatch_barrier(comm, opt);
}

/// Blocking point-to-point send; matched with recv() on `peer` in posting order.
template <class T, element E>
void send(communicator<T>& comm, std::span<const E> data, int peer, const options& opt = {}) {
  comm.check_usable("send");
  detail::check_peer("send", comm.rank(), comm.size(), peer);
  detail::check_p2p("send", opt, data, std::span<E>{});
  detail::dispatch_p2p(comm, "send", data, peer, std::span<E>{}, -1, opt);
}

template <class T, element E>
void send(communicator<T>& comm, std::span<E> data, int peer, const options& opt = {}) {
  send(comm, std::span<const E>(data), peer, opt);
}

/// Blocking point-to-point receive of exactly data.size() elements from `peer`.
template <class T, element E>
void recv(communicator<T>& comm, std::span<E> data, int peer, const options& opt = {}) {
  comm.check_usable("recv");
  detail::check_peer("recv", comm.rank(), comm.size(), peer);
  detail::check_p2p("recv", opt, std::span<const E>{}, data);
  detail::dispatch_p2p(comm, "recv", std::span<const E>{}, -1, data, peer, opt);
}

/// Sends `out` to `to` while receiving `in` from `from` (both may be the same peer); the
/// building block of nccl-tests' sendrecv.
template <class T, element E>
void send_recv(communicator<T>& comm, std::span<const E> out, int to, std::span<E> in, int from,
               const options& opt = {}) {
  comm.check_usable("send_recv");
  for (int peer : {to, from}) detail::check_peer("send_recv", comm.rank(), comm.size(), peer);
  detail::check_p2p("send_recv", opt, out, in);
  detail::dispatch_p2p(comm, "send_recv", out, to, in, from, opt);
}

template <class T, element E>
void send_recv(communicator<T>& comm, std::span<E> out, int to, std::span<E> in, int from,
               const options& opt = {}) {
  send_recv(comm, std::span<const E>(out), to, in, from, opt);
}

}  // namespace ringzero
