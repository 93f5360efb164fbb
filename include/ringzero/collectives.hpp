// The collectives API: what a trainer calls, the same for every backend. Every function
//   - validates its arguments on the calling rank and throws ringzero::invalid_argument before
//     anything is sent (sizes, overlapping out-of-place buffers, root range, op);
//   - hands the call to the transport's own collective where it has one (NCCL; shm in its
//     segment where that path applies, transport/native.hpp), else picks one of ringzero's
//     algorithms (options::algorithm, else RINGZERO_ALGO, else the cost model, all from the
//     one algorithm table, algorithms/table.hpp) and runs it over messages;
//   - on GPU buffers runs ringzero's algorithms as schedules (algorithms/schedule.hpp) on the
//     executor the transport offers (ringzero/executor.hpp): on NCCL when options::algorithm
//     names ring or tree, on a messaging transport that moves device memory (libfabric opened
//     with options::device_memory) whenever the buffers are device memory;
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

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/barrier.hpp"
#include "ringzero/algorithms/binomial.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/algorithms/pairwise.hpp"
#include "ringzero/algorithms/ring.hpp"
#include "ringzero/algorithms/schedule.hpp"
#include "ringzero/algorithms/table.hpp"
#include "ringzero/communicator.hpp"
#include "ringzero/detail/device_executor.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/detail/quantized_call.hpp"
#include "ringzero/detail/reproducible_call.hpp"
#include "ringzero/detail/reproducible_device.hpp"
#include "ringzero/detail/trace_scope.hpp"
#include "ringzero/detail/validate.hpp"
#include "ringzero/error.hpp"
#include "ringzero/kernels/device_reduction.hpp"
#include "ringzero/kernels/device_reproducible.hpp"
#include "ringzero/kernels/device_runtime.hpp"
#include "ringzero/log.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/native.hpp"
#include "ringzero/tuning/policy.hpp"
#include "ringzero/types.hpp"

namespace ringzero {

namespace detail {

// RINGZERO_ALGO and RINGZERO_CHECK are read on every call, not cached, since a program (or a
// test) may change them between calls; call_env finds both in one pass over the environment.
// `s`: RINGZERO_ALGO's value, if set.
template <class Table>
[[nodiscard]] std::optional<algorithm> env_algorithm(std::optional<std::string_view> s) {
  if (!s) return std::nullopt;
  try {
    return Table::parse(*s);
  } catch (const invalid_argument& e) {
    // The table's message names the algorithm; the user must also learn where it came from.
    throw invalid_argument(fmt::format("RINGZERO_ALGO='{}': {}", std::string(*s),
                                       std::string_view(e.what()).substr(sizeof "ringzero: " - 1)));
  }
}

/// Whether the node-aware algorithm has anything to decompose on this communicator: more than
/// one node, and fewer nodes than ranks. Where it has not, RINGZERO_ALGO=hier does not apply
/// (so the hierarchical algorithm's own one-level fallback cannot come back to it).
template <class T>
[[nodiscard]] bool spans_nodes(const communicator<T>& comm) {
  if constexpr (!has_hosts<T>) {
    return false;
  } else {
    const topology t = comm.topo();
    return t.node_count > 1 && t.node_count < comm.size();
  }
}

/// options::algorithm wins and must implement the collective; RINGZERO_ALGO (`from_env`, as
/// env_algorithm read it) applies where it can (as NCCL_ALGO); otherwise the cost model decides.
template <class Table, class T>
[[nodiscard]] algorithm choose(communicator<T>& comm, const collective_descriptor& d,
                               std::size_t bytes, const options& opt,
                               std::optional<algorithm> from_env) {
  const collective c = d.id;
  if (opt.algorithm != algorithm::automatic) {
    if (!Table::known(opt.algorithm))
      throw invalid_argument(
          fmt::format("{}: options::algorithm holds {}, which names no algorithm", d.name,
                      static_cast<int>(opt.algorithm)));
    if (!Table::implements(c, opt.algorithm))
      throw invalid_argument(fmt::format("{}: algorithm '{}' does not implement this collective",
                                         d.name, Table::name(opt.algorithm)));
    if (Table::needs_nodes(opt.algorithm) && !has_hosts<T>)
      throw unsupported(fmt::format("{}: this transport has no node topology for algorithm '{}'",
                                    d.name, Table::name(opt.algorithm)));
    return opt.algorithm;
  }
  if (from_env && *from_env != algorithm::automatic && Table::implements(c, *from_env) &&
      (!Table::needs_nodes(*from_env) || spans_nodes(comm)))
    return *from_env;
  const int nodes = spans_nodes(comm) ? comm.topo().node_count : 1;
  return Table::select(
      tuning::cost_query{c, static_cast<double>(bytes), comm.size(), comm.tuning(), nodes});
}

/// What RINGZERO_CHECK=1 compares across ranks before each collective.
struct call_signature {
  std::uint8_t kind = 0;
  std::uint8_t type = 0;
  std::uint8_t reduction = 0;
  std::uint8_t algo = 0;
  std::int32_t root = 0;
  std::uint32_t wire = 0;        ///< options::wire
  std::uint32_t wire_block = 0;  ///< options::wire_block, where wire is not full
  std::uint64_t count = 0;
};

[[nodiscard]] inline bool check_enabled() {
  return call_env::read().check_on();
}

template <class T>
void check_agreement(communicator<T>& comm, const call_signature& mine, const options& opt) {
  const int n = comm.size();
  if (n == 1) return;
  std::vector<call_signature> all(static_cast<std::size_t>(n));
  const auto mine_bytes = std::as_bytes(std::span(&mine, 1));
  const auto all_bytes = std::as_writable_bytes(std::span(all));
  if constexpr (native_collectives<T>) {
    comm.transport().all_gather_bytes(mine_bytes, all_bytes, opt);
  } else {
    algorithms::ring::all_gather(
        comm,
        std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(mine_bytes.data()),
                                      mine_bytes.size()),
        std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(all_bytes.data()),
                                all_bytes.size()),
        options{.timeout = opt.timeout});
  }
  const auto describe = [](const call_signature& s) {
    return fmt::format(
        "{} (count {}, type {}, op {}, root {}, algorithm {}{})",
        collective_name(static_cast<collective>(s.kind)), s.count,
        dtype_name(static_cast<dtype>(s.type)), op_name(static_cast<op>(s.reduction)), s.root,
        algorithm_name(static_cast<algorithm>(s.algo)),
        s.wire == 0
            ? std::string()
            : fmt::format(", wire {} in blocks of {}",
                          wire_format_name(static_cast<wire_format>(s.wire)), s.wire_block));
  };
  for (int r = 1; r < n; ++r)
    if (std::memcmp(&all[static_cast<std::size_t>(r)], &all[0], sizeof mine) != 0)
      throw mismatch_error(fmt::format("RINGZERO_CHECK: rank 0 called {} but rank {} called {}",
                                       describe(all[0]), r,
                                       describe(all[static_cast<std::size_t>(r)])));
}

template <class T, element E>
void maybe_check(communicator<T>& comm, collective c, std::size_t count, op o, int root,
                 const options& opt, bool enabled = check_enabled()) {
  if (!enabled) return;
  call_signature s;
  s.kind = static_cast<std::uint8_t>(c);
  s.type = static_cast<std::uint8_t>(dtype_of<E>());
  s.reduction = static_cast<std::uint8_t>(o);
  s.algo = static_cast<std::uint8_t>(opt.algorithm);
  s.root = root;
  if (opt.wire != wire_format::full) {
    s.wire = static_cast<std::uint32_t>(opt.wire);
    s.wire_block = static_cast<std::uint32_t>(wire_block_of(opt));
  }
  s.count = count;
  check_agreement(comm, s, opt);
}

template <element E>
void copy_if_distinct(std::span<const E> in, std::span<E> out) {
  if (in.data() != out.data() && !in.empty()) std::memcpy(out.data(), in.data(), in.size_bytes());
}

/// The sizes a call is described by: the element count RINGZERO_CHECK compares, the bytes the
/// cost model prices, and whether the call moves nothing on any rank (then it returns at once),
/// all from its descriptor's extents. all_to_allv's counts differ per rank, so it compares none,
/// and it is never skipped: whether anything moves depends on every rank's counts, which no
/// rank knows on its own.
template <element E>
struct call_size {
  std::size_t count;
  std::size_t model_bytes;
  bool empty;
};

template <element E>
[[nodiscard]] call_size<E> size_of(const algorithms::call<E>& c, int ranks) {
  const collective_descriptor& d = algorithms::describe(c);
  if (d.in.size == extent::varies) return {0, c.in.size_bytes(), false};
  const std::size_t count = d.count(c.in.size(), c.out.size(), ranks);
  return {count, d.full_elems(count, ranks) * sizeof(E), count == 0};
}

/// The transport's view of a validated call of `count` elements (native_call's counts).
template <element E>
[[nodiscard]] native_call native_call_of(const algorithms::call<E>& c, std::size_t count,
                                         std::uint32_t sequence) {
  native_call nc;
  nc.kind = c.kind;
  nc.type = dtype_of<E>();
  nc.reduction = c.reduction;
  nc.in = c.in.data();
  nc.out = c.out.data();
  nc.count = count;
  nc.root = c.root;
  nc.sequence = sequence;
  nc.send_counts = c.blocks.send_counts;
  nc.send_displs = c.blocks.send_displs;
  nc.recv_counts = c.blocks.recv_counts;
  nc.recv_displs = c.blocks.recv_displs;
  return nc;
}

/// A call on one rank: what it sends itself.
template <element E>
void run_alone(const algorithms::call<E>& c) {
  if (c.kind != collective::all_to_allv) return copy_if_distinct(c.in, c.out);
  const algorithms::block_map& m = c.blocks;
  if (m.recv_counts[0] > 0)
    std::memcpy(c.out.data() + m.recv_displs[0], c.in.data() + m.send_displs[0],
                m.recv_counts[0] * sizeof(E));
}

/// RINGZERO_CHECK=1 for all_to_allv: what each rank sends a peer must be what that peer
/// expects from it. Every rank learns whether any pair disagreed, so all of them throw.
template <class T>
void check_v_agreement(communicator<T>& comm, const algorithms::block_map& m, const options& opt) {
  if (!check_enabled() || comm.size() == 1) return;
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::uint64_t> mine(m.send_counts.begin(), m.send_counts.end()), theirs(n);
  const options plain{.timeout = opt.timeout};
  algorithms::pairwise::all_to_all(comm, std::span<const std::uint64_t>(mine),
                                   std::span<std::uint64_t>(theirs), plain);
  std::int64_t bad[3] = {-1, 0, 0};  // (sender, sent, expected) of the first disagreement
  for (std::size_t r = 0; r < n && bad[0] < 0; ++r) {
    if (theirs[r] == m.recv_counts[r]) continue;
    bad[0] = static_cast<std::int64_t>(r);
    bad[1] = static_cast<std::int64_t>(theirs[r]);
    bad[2] = static_cast<std::int64_t>(m.recv_counts[r]);
  }
  std::int64_t finder[1] = {bad[0] >= 0 ? comm.rank() : -1};
  algorithms::ring::all_reduce(comm, std::span<const std::int64_t>(finder),
                               std::span<std::int64_t>(finder), op::max, plain);
  if (finder[0] < 0) return;
  algorithms::binomial::broadcast(comm, std::span<std::int64_t>(bad), static_cast<int>(finder[0]),
                                  plain);
  throw mismatch_error(
      fmt::format("RINGZERO_CHECK: all_to_allv: rank {} sends {} elements to rank {}, which "
                  "expects {} from it",
                  bad[0], bad[1], finder[0], bad[2]));
}

/// Offers a validated call (more than one rank, not empty) to a transport that runs some
/// collectives itself; true if it ran it. `algo_env`: whether RINGZERO_ALGO is set (it sends
/// every call to ringzero's algorithms).
template <class T, element E>
[[nodiscard]] bool try_native(communicator<T>& comm, const algorithms::call<E>& c,
                              std::size_t count, const options& opt, bool algo_env) {
  if constexpr (some_native_collectives<T>) {
    if (comm.comm_id() != 0 || opt.algorithm != algorithm::automatic || algo_env) return false;
    native_call nc = native_call_of(c, count, comm.state().collective_seq);
    nc.one_phase_bytes = tuning::one_phase_limit(comm.tuning(), comm.size());
    options resolved = opt;
    if (resolved.timeout.count() <= 0) resolved.timeout = comm.timeout();
    // A call the transport ran takes a sequence number, as one over messages does.
    if (!comm.transport().try_native(nc, resolved)) return false;
    ++comm.state().collective_seq;
    return true;
  } else {
    return false;
  }
}

/// Whether a native transport can run options::algorithm for collective `c`: as a schedule
/// where it runs ringzero's schedules and one implements `c` (NCCL), never otherwise. Checked
/// before anything is sent, alike on every rank.
template <class T>
void check_forced_native(collective c, algorithm a) {
  const std::string_view what = collective_name(c);
  if constexpr (!scheduled_collectives<T>) {
    throw unsupported(fmt::format(
        "{}: this backend runs its own collectives; algorithm '{}' cannot be forced on it", what,
        algorithm_name(a)));
  } else {
    if (!algorithms::builtin::known(a))
      throw invalid_argument(fmt::format(
          "{}: options::algorithm holds {}, which names no algorithm", what, static_cast<int>(a)));
    if (!algorithms::schedule::has_schedule(a, c))
      throw unsupported(fmt::format(
          "{}: algorithm '{}' does not run on this backend's buffers; ringzero's algorithms "
          "there are {}; leave options::algorithm automatic for the backend's own collective",
          what, algorithm_name(a), algorithms::schedule::summary));
  }
}

/// Runs one of ringzero's schedules (options::algorithm names it; check_forced_native checked
/// it exists) on the executor a native transport offers for the call.
template <class T, element E>
void run_schedule_native(T& t, const native_call& nc, const options& opt) {
  const algorithms::call<E> k = algorithms::schedule::call_of<E>(nc, t.rank(), t.size());
  const std::size_t elems = algorithms::schedule::scratch_elems(opt.algorithm, k, t.size());
  t.template with_device_executor<E>(nc, opt, algorithm_name(opt.algorithm), elems,
                                     [&](auto& x, std::span<E> scratch) {
                                       algorithms::schedule::run(x, opt.algorithm, k, scratch);
                                     });
}

/// The transport's own collective for a validated call, or with options::algorithm set, one of
/// ringzero's schedules on the transport's executor.
template <class T, element E>
void run_native(communicator<T>& comm, const algorithms::call<E>& c, const options& opt) {
  const bool scheduled = opt.algorithm != algorithm::automatic;
  if (scheduled) check_forced_native<T>(c.kind, opt.algorithm);
  const call_size<E> sz = size_of(c, comm.size());
  maybe_check<T, E>(comm, c.kind, sz.count, c.reduction, c.root, opt);
  // Counted and traced as every call is (the algorithm "-" unless one was forced). A
  // stream-ordered call (options::async) is timed to its enqueue, not to its completion.
  collective_scope<communicator<T>> scope(comm, c.kind, opt.algorithm, sz.model_bytes,
                                          dtype_of<E>(), c.reduction, opt);
  if (sz.empty) return;
  const native_call nc = native_call_of(c, sz.count, comm.state().collective_seq);
  if constexpr (scheduled_collectives<T>)
    if (scheduled) return run_schedule_native<T, E>(comm.transport(), nc, opt);
  comm.transport().run_native(nc, opt);
}

/// The CUDA device a call's buffers are memory of, or -1 for any other memory (always, in a
/// program that registered no CUDA runtime: it has no device buffers to pass). The buffers a
/// rank does not use (broadcast's in and reduce's out off the root) are not asked about.
template <element E>
[[nodiscard]] int device_of_call(const algorithms::call<E>& c, int rank) {
  const kernels::device_runtime* rt = kernels::registered_device_runtime();
  if (rt == nullptr) return -1;
  const collective_descriptor& d = algorithms::describe(c);
  const bool reads_in = !c.in.empty() && d.uses_in(rank, c.root);
  const bool writes_out = !c.out.empty() && d.uses_out(rank, c.root);
  const int in = reads_in ? rt->device_of(c.in.data()) : -2;
  const int out = writes_out ? rt->device_of(c.out.data()) : -2;
  if (in == -2 || out == -2 || in == out) return std::max({in, out, -1});
  const auto where = [](int dev) {
    return dev < 0 ? std::string("host memory") : fmt::format("memory of CUDA device {}", dev);
  };
  throw invalid_argument(
      fmt::format("{}: the input is {} and the output {}; both must be host "
                  "memory, or both memory of one CUDA device",
                  d.name, where(in), where(out)));
}

/// Refuses device memory on a transport that moves host memory only (loopback, shm, sockets):
/// its algorithms would read it on the host, where a GPU's memory is not mapped. `buffers` are
/// (name, pointer) pairs, null for a buffer the call does not use. Free in a program that
/// registered no CUDA runtime (one atomic load); otherwise device_of per buffer, which the CUDA
/// table answers from the few pointers it remembers per thread for the buffers a loop passes
/// call after call (kernels/cuda/device_reduction.cuh), not with cudaPointerGetAttributes.
inline void refuse_device_memory(
    std::string_view what,
    std::initializer_list<std::pair<std::string_view, const void*>> buffers) {
  const kernels::device_runtime* rt = kernels::registered_device_runtime();
  if (rt == nullptr) return;
  for (const auto& [name, p] : buffers)
    if (p != nullptr)
      if (const int device = rt->device_of(p); device >= 0)
        throw invalid_argument(fmt::format(
            "{}: the {} is memory of CUDA device {}, and this transport moves host memory only: "
            "use the NCCL transport or libfabric opened with options::device_memory, or copy it "
            "to host memory",
            what, name, device));
}

template <element E>
void refuse_device_buffers(const algorithms::call<E>& c, int rank) {
  const collective_descriptor& d = algorithms::describe(c);
  const bool in = !c.in.empty() && d.uses_in(rank, c.root);
  const bool out = !c.out.empty() && d.uses_out(rank, c.root);
  refuse_device_memory(
      d.name, {{"input", in ? c.in.data() : nullptr}, {"output", out ? c.out.data() : nullptr}});
}

/// The schedule a call on device buffers runs: options::algorithm (refused where it has no
/// schedule for the collective), else RINGZERO_ALGO where it has one, else the ring, else the
/// tree.
template <class Table>
[[nodiscard]] algorithm device_algorithm(collective c, const options& opt, const call_env& env) {
  const std::string_view what = collective_name(c);
  const auto refuse = [&](std::string_view why) {
    return unsupported(fmt::format("{}: {} on device buffers; ringzero's algorithms there are {}",
                                   what, why, algorithms::schedule::summary));
  };
  if (opt.algorithm != algorithm::automatic) {
    if (!algorithms::schedule::has_schedule(opt.algorithm, c))
      throw refuse(fmt::format("algorithm '{}' does not run", algorithm_name(opt.algorithm)));
    return opt.algorithm;
  }
  // RINGZERO_ALGO applies to every call: one without a schedule here keeps the default.
  if (const std::optional<algorithm> a = env_algorithm<Table>(env.algo);
      a && algorithms::schedule::has_schedule(*a, c))
    return *a;
  for (const algorithm a : {algorithm::ring, algorithm::tree})
    if (algorithms::schedule::has_schedule(a, c)) return a;
  throw refuse("no algorithm runs it");
}

/// Runs a validated call on device buffers of `device` over a messaging transport that moves
/// device memory: one of ringzero's schedules on the messaging executor
/// (detail/device_executor.hpp), its kernels on the communicator's stream, complete on return.
template <class Table, class T, element E>
void run_on_device(communicator<T>& comm, const algorithms::call<E>& c, const call_size<E>& sz,
                   const options& opt, const call_env& env, int device) {
  const std::string_view what = collective_name(c.kind);
  T& t = comm.transport();
  if (!t.device_memory()) throw unsupported(fmt::format("{}: {}", what, t.device_memory_refusal()));
  const algorithm a = device_algorithm<Table>(c.kind, opt, env);
  const kernels::device_reduction* reductions =
      algorithms::schedule::reduces(c.kind)
          ? &kernels::required_device_reduction(what, algorithm_name(a))
          : kernels::registered_device_reduction();
  maybe_check<T, E>(comm, c.kind, sz.count, c.reduction, c.root, opt, env.check_on());
  collective_scope<communicator<T>> scope(comm, c.kind, a, sz.model_bytes, dtype_of<E>(),
                                          c.reduction, opt);
  if (sz.empty) return;
  const kernels::device_runtime& rt = *kernels::registered_device_runtime();
  const device_scope current(rt, device);
  // Registered whole, the allocation a buffer lies in: a registration covers later calls on
  // other parts of it, and its id tells a new allocation at a freed one's addresses from the old,
  // which must not be reached through the old registration.
  const auto adopt = [&](const void* p, std::size_t bytes) {
    if (bytes == 0) return;
    if (const kernels::device_allocation a = rt.allocation_of(p); a.base != nullptr)
      t.register_device_buffer(a.base, a.bytes, device, a.id);
    else
      t.register_device_buffer(p, bytes, device, 0);
  };
  const collective_descriptor& d = algorithms::describe(c);
  if (d.uses_in(comm.rank(), c.root)) adopt(c.in.data(), c.in.size_bytes());
  if (d.uses_out(comm.rank(), c.root)) adopt(c.out.data(), c.out.size_bytes());
  device_cache& cache = device_cache_of(comm, rt, device);
  const std::size_t elems = algorithms::schedule::scratch_elems(a, c, comm.size());
  E* scratch = elems > 0 ? reinterpret_cast<E*>(cache.scratch(elems * sizeof(E), adopt)) : nullptr;
  device_executor<communicator<T>, E> x(comm, cache, reductions, what, algorithm_name(a),
                                        opt.timeout);
  algorithms::schedule::run(x, a, c, std::span<E>(scratch, elems));
  x.finish();
}

/// options::reproducible's float sum offered to a transport that sums exactly itself (shm: in
/// the segment, at the plain call's phases and bytes); true if it ran it. As the plain native
/// path: the world communicator, the algorithm automatic and no RINGZERO_ALGO. The transport says
/// first whether it will run the call, so that one it leaves is counted only as the
/// reproducible path's collectives.
template <class Table, class T>
[[nodiscard]] bool try_reproducible_native(communicator<T>& comm, const algorithms::call<float>& c,
                                           const options& opt) {
  if constexpr (reproducible_native_collectives<T>) {
    if (comm.size() == 1 || comm.comm_id() != 0 || opt.algorithm != algorithm::automatic ||
        (c.kind != collective::all_reduce && c.kind != collective::reduce_scatter))
      return false;
    const call_env env = call_env::read();
    if (env_algorithm<Table>(env.algo)) return false;
    const call_size<float> sz = size_of(c, comm.size());
    native_call nc = native_call_of(c, sz.count, comm.state().collective_seq);
    nc.reproducible = true;
    if (!comm.transport().runs_reproducible(nc)) return false;
    maybe_check<T, float>(comm, c.kind, sz.count, c.reduction, c.root, opt, env.check_on());
    collective_scope<communicator<T>> scope(comm, c.kind, algorithm::automatic, sz.model_bytes,
                                            dtype::float32, c.reduction, opt,
                                            algorithms::describe(c).name);
    if (sz.empty) return true;
    options resolved = opt;
    if (resolved.timeout.count() <= 0) resolved.timeout = comm.timeout();
    if (!comm.transport().try_native(nc, resolved))
      throw transport_error(
          fmt::format("{}: the transport said it would sum this call exactly, "
                      "then declined it",
                      algorithms::describe(c).name));
    ++comm.state().collective_seq;
    return true;
  } else {
    return false;
  }
}

/// A validated call with options::wire set (detail/quantized_call.hpp): host buffers over a
/// messaging transport; a backend that runs its own collectives and device buffers are refused.
template <class T, element E>
void run_wire(communicator<T>& comm, const algorithms::call<E>& c, const options& opt) {
  const collective_descriptor& d = algorithms::describe(c);
  if constexpr (native_collectives<T>) {
    throw unsupported(fmt::format(
        "{}: options::wire {}: this backend runs its own collectives, on the elements as they are",
        d.name, wire_format_name(opt.wire)));
  } else {
    if (opt.async)
      throw invalid_argument(
          fmt::format("{}: options::async needs a stream-ordered backend (NCCL); this transport "
                      "completes every call before returning",
                      d.name));
    if constexpr (device_memory_transport<T>) {
      if (device_of_call(c, comm.rank()) >= 0)
        throw unsupported(
            fmt::format("{}: options::wire {} runs on host buffers; these are device memory",
                        d.name, wire_format_name(opt.wire)));
    }
    const call_size<E> sz = size_of(c, comm.size());
    maybe_check<T, E>(comm, c.kind, sz.count, c.reduction, c.root, opt);
    // takes_quantized_path() refused the other element types.
    if constexpr (quantize::supported_v<std::remove_cv_t<E>>)
      if (!sz.empty) run_quantized(comm, d, c.in, c.out, c.reduction, opt);
  }
}

/// Runs a validated call: the transport's own collective, or the chosen algorithm from Table.
template <class Table = algorithms::builtin, class T, element E>
void run(communicator<T>& comm, const algorithms::call<E>& c, const options& opt) {
  const collective_descriptor& d = algorithms::describe(c);
  const std::string_view what = d.name;
  comm.check_usable(what);
  check_options(what, opt);
  if (takes_quantized_path<E>(d, c.reduction, opt)) return run_wire(comm, c, opt);
  if constexpr (reproducible::supported_v<std::remove_cv_t<E>>) {
    if (takes_reproducible_path(c, opt)) {
      // The device the passes run on: the transport's where it has one (NCCL), else the
      // buffers'; never merely the calling thread's.
      int device = -1;
      if constexpr (requires { comm.transport().device(); })
        device = comm.transport().device();
      else if constexpr (device_memory_transport<T>)
        device = device_of_call(c, comm.rank());
      if (device >= 0) {
        const kernels::device_reproducible& k = kernels::required_device_reproducible(what);
        const kernels::device_runtime* rt = kernels::registered_device_runtime();
        if (rt == nullptr)  // registered with k by the same header: only a test can split them
          throw unsupported(fmt::format("{}: no CUDA runtime table", what));
        return run_reproducible_device(comm, c, opt, *rt, k, device);
      }
      if constexpr (!device_memory_transport<T>) refuse_device_buffers(c, comm.rank());
      if constexpr (std::is_same_v<E, float>) {
        if (try_reproducible_native<Table>(comm, c, opt)) return;
      }
      return run_reproducible(comm, c, opt);
    }
  }
  if constexpr (native_collectives<T>) {
    return run_native(comm, c, opt);
  } else {
    if (opt.async)
      throw invalid_argument(
          fmt::format("{}: options::async needs a stream-ordered backend (NCCL); this transport "
                      "completes every call before returning",
                      what));
    const call_size<E> sz = size_of(c, comm.size());
    const call_env env = call_env::read();
    if constexpr (device_memory_transport<T>) {
      if (const int device = device_of_call(c, comm.rank()); device >= 0)
        return run_on_device<Table>(comm, c, sz, opt, env, device);
    } else {
      refuse_device_buffers(c, comm.rank());
    }
    const std::optional<algorithm> from_env = env_algorithm<Table>(env.algo);
    // A call the transport may run itself is offered to it before the cost model prices the
    // algorithms: a sub-microsecond shared-memory call should not pay for a choice it does not
    // use. Counters and traces show such a call under no algorithm ("-").
    const bool native_first = some_native_collectives<T> && comm.size() > 1 &&
                              opt.algorithm == algorithm::automatic && !from_env;
    algorithm a =
        native_first ? algorithm::automatic : choose<Table>(comm, d, sz.model_bytes, opt, from_env);
    maybe_check<T, E>(comm, c.kind, sz.count, c.reduction, c.root, opt, env.check_on());
    if (d.in.size == extent::varies) check_v_agreement(comm, c.blocks, opt);
    // Counted (and traced, under RINGZERO_TRACE) whatever happens next, empty calls included.
    collective_scope<communicator<T>> scope(comm, c.kind, a, sz.model_bytes, dtype_of<E>(),
                                            c.reduction, opt, what);
    if (sz.empty) return;
    if (native_first) {
      if (try_native(comm, c, sz.count, opt, false)) return;
      a = choose<Table>(comm, d, sz.model_bytes, opt, from_env);
      scope.set_algorithm(a);
    }
    const bool root = comm.rank() == c.root;
    if (c.kind == collective::broadcast) {
      if (root) copy_if_distinct(c.in, c.out);
      if (comm.size() == 1) return;
    } else if (comm.size() == 1) {
      return run_alone(c);
    }
    options chosen = opt;
    chosen.algorithm = a;
    Table::run(a, comm, c, chosen);
  }
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------

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
  if (d.in.size == extent::none || d.in.size == extent::varies || d.out.size == extent::none ||
      d.out.size == extent::varies || d.id == collective::send_recv)
    throw invalid_argument(fmt::format(
        "{}: run_collective takes collectives whose buffers are count-sized or size() blocks of "
        "it; call {} itself",
        d.name, d.name));
  detail::check_call(d, comm.rank(), comm.size(), in, out, o, root);
  detail::run<Table>(comm,
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
  detail::check_all_to_allv(comm.rank(), comm.size(), in, send_counts, send_displs, out,
                            recv_counts, recv_displs);
  detail::run(comm,
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
  const detail::call_env env = detail::call_env::read();
  // RINGZERO_CHECK compares a barrier too: a rank in a barrier while another is in a collective
  // would otherwise see only messages of the wrong size, or none.
  detail::maybe_check<T, std::uint8_t>(comm, collective::barrier, 0, op::sum, 0, opt,
                                       env.check_on());
  detail::collective_scope<communicator<T>> scope(comm, collective::barrier, algorithm::automatic,
                                                  0, dtype::uint8, op::sum, opt);
  if constexpr (native_collectives<T>) {
    if (comm.size() > 1) comm.transport().run_native(native_call{.kind = collective::barrier}, opt);
  } else {
    if (comm.size() == 1) return;
    algorithms::call<std::uint8_t> c;
    c.kind = collective::barrier;
    if (detail::try_native(comm, c, 0, opt, env.algo.has_value())) return;
    algorithms::barrier(comm, opt);
  }
}

namespace detail {

/// Point-to-point traffic. Host transports stamp each message with a per-peer sequence number
/// (so messages match in posting order); native transports order them themselves.
template <class T, element E>
void p2p(communicator<T>& comm, std::string_view what, std::span<const E> out, int to,
         std::span<E> in, int from, const options& opt) {
  comm.check_usable(what);
  check_options(what, opt);
  check_buffer(what, "send buffer", out);
  check_buffer(what, "receive buffer", in);
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

}  // namespace detail

/// Blocking point-to-point send; matched with recv() on `peer` in posting order.
template <class T, element E>
void send(communicator<T>& comm, std::span<const E> data, int peer, const options& opt = {}) {
  comm.check_usable("send");
  detail::check_peer("send", comm.rank(), comm.size(), peer);
  detail::p2p(comm, "send", data, peer, std::span<E>{}, -1, opt);
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
  detail::p2p(comm, "recv", std::span<const E>{}, -1, data, peer, opt);
}

/// Sends `out` to `to` while receiving `in` from `from` (both may be the same peer); the
/// building block of nccl-tests' sendrecv.
template <class T, element E>
void send_recv(communicator<T>& comm, std::span<const E> out, int to, std::span<E> in, int from,
               const options& opt = {}) {
  comm.check_usable("send_recv");
  for (int peer : {to, from}) detail::check_peer("send_recv", comm.rank(), comm.size(), peer);
  detail::p2p(comm, "send_recv", out, to, in, from, opt);
}

template <class T, element E>
void send_recv(communicator<T>& comm, std::span<E> out, int to, std::span<E> in, int from,
               const options& opt = {}) {
  send_recv(comm, std::span<const E>(out), to, in, from, opt);
}

}  // namespace ringzero
