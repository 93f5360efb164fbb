// The capability of a transport that runs whole collectives itself (NCCL): the communicator
// validates a call once, then hands it over as a native_call instead of running one of
// ringzero's algorithms over messages.
#pragma once

#include <concepts>
#include <cstddef>
#include <span>
#include <string_view>

#include "ringzero/algorithm.hpp"
#include "ringzero/op.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/types.hpp"

namespace ringzero {

/// One validated collective in the transport's own rank numbering. Counts are elements of
/// `type`: all_reduce/broadcast/reduce the buffer, reduce_scatter the output block, all_gather
/// the input block, all_to_all/gather/scatter one rank's block, send_recv what goes to `peer`
/// (send_count) and comes from `from`.
struct native_call {
  collective kind = collective::all_reduce;
  dtype type = dtype::float32;
  op reduction = op::sum;
  const void* in = nullptr;
  void* out = nullptr;
  std::size_t count = 0;
  int root = 0;
  int peer = -1;  ///< send_recv: destination of `in` (-1: nothing to send)
  int from = -1;  ///< send_recv: source of `out` (-1: nothing to receive)
  std::size_t recv_count = 0;
  /// options::reproducible on a float all_reduce or reduce_scatter with sum or avg: the result
  /// must be each element's exact sum rounded once (reduce/detail/gathered.hpp), the same bits
  /// at any world size. Only a transport with reproducible_native_collectives gets such a call.
  bool reproducible = false;
  /// The communicator's collective sequence number, for the transport's diagnostics.
  std::uint32_t sequence = 0;
  /// The communicator's tuning::one_phase_limit for its size: a transport that reduces in a
  /// shared segment runs all_reduce up to this many bytes in one phase. 0: its own rule. Alike on
  /// every rank, since the ranks agreed on their tuning (tuning::agree_tuning).
  std::size_t one_phase_bytes = 0;
  /// all_to_allv: per-rank counts and displacements in elements (send_* index `in`, recv_*
  /// `out`); all_to_all, gather and scatter use `count` as the block each rank sends or receives.
  std::span<const std::size_t> send_counts{};
  std::span<const std::size_t> send_displs{};
  std::span<const std::size_t> recv_counts{};
  std::span<const std::size_t> recv_displs{};
};

/// A transport that runs collectives itself. run_native() performs one call with the options'
/// stream, async flag and deadline; all_gather_bytes() exchanges a few host bytes per rank (the
/// communicator's RINGZERO_CHECK agreement).
template <class T>
concept native_collectives = transport<T> &&
    requires(T& t, const native_call& c, const options& o, std::span<const std::byte> mine,
             std::span<std::byte> all) {
  {t.run_native(c, o)};
  {t.all_gather_bytes(mine, all, o)};
};

namespace detail {

/// What with_device_executor() hands its executor to, for the concept below to name.
struct executor_body_archetype {
  template <class X>
  void operator()(X&, std::span<float>) const {}
};

}  // namespace detail

/// A transport with native collectives that can also run ringzero's own algorithms on its
/// buffers: it offers an executor (ringzero/executor.hpp; NCCL: groups of ncclSend/ncclRecv and
/// ringzero's kernels on the stream). with_device_executor<E>(c, o, name, scratch_elems, body)
/// calls body(executor, scratch) once, for a validated call, with `scratch_elems` elements of
/// scratch the executor can address, and keeps the transport's promises around it (the options'
/// stream, async flag and deadline; what a failure partway does). The communicator runs a schedule
/// (algorithms/schedule.hpp) inside when options::algorithm names one that implements the
/// collective; automatic stays with run_native(). The transport sees only the algorithm's name,
/// for its errors.
template <class T>
concept scheduled_collectives = native_collectives<T> &&
    requires(T& t, const native_call& c, const options& o, std::string_view name, std::size_t n) {
  {t.template with_device_executor<float>(c, o, name, n, detail::executor_body_archetype{})};
};

/// A transport that runs some collectives itself where it has a faster path than messages
/// (shm: in the shared segment). try_native() returns false to leave a call to ringzero's
/// algorithms, and must decide alike on every rank. The communicator offers it only calls of the
/// world communicator (ranks are the transport's) with the algorithm left automatic and no
/// RINGZERO_ALGO, after validation and the trivial cases, with options::timeout resolved.
template <class T>
concept some_native_collectives = transport<T> &&
    requires(T& t, const native_call& c, const options& o) {
  { t.try_native(c, o) } -> std::convertible_to<bool>;
};

/// A transport that can run options::reproducible's float sums itself (shm: in the segment,
/// where every rank's terms meet). runs_reproducible(c) says, before anything is sent and alike
/// on every rank, whether try_native(c, o) will run the call `c` (reproducible set); the
/// communicator asks first, so that a call the transport leaves to ringzero's reproducible path
/// is counted and traced only as that path's collectives.
template <class T>
concept reproducible_native_collectives = some_native_collectives<T> &&
    requires(const T& t, const native_call& c) {
  { t.runs_reproducible(c) } -> std::convertible_to<bool>;
};

}  // namespace ringzero
