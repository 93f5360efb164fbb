// A call on its way through the dispatcher (detail/dispatch.hpp): what every path reads, worked
// out once per call (the call, its descriptor and sizes, the options, RINGZERO_ALGO and
// RINGZERO_CHECK as set at the call, whether options::wire or options::reproducible applies, the
// device its buffers are on), and what starting the call means, once for whichever path runs it:
// RINGZERO_CHECK's agreement, then the count (and trace) of the call. A path that offered the
// call to the transport and was declined leaves the call started for the next one.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/binomial.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/algorithms/pairwise.hpp"
#include "ringzero/algorithms/ring.hpp"
#include "ringzero/algorithms/table.hpp"
#include "ringzero/collective_table.hpp"
#include "ringzero/communicator.hpp"
#include "ringzero/detail/agreement.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/detail/exchange_records.hpp"
#include "ringzero/detail/quantized_call.hpp"
#include "ringzero/detail/trace_scope.hpp"
#include "ringzero/error.hpp"
#include "ringzero/kernels/device_runtime.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/reproducible.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/native.hpp"
#include "ringzero/tuning/cost_terms.hpp"
#include "ringzero/types.hpp"
#include "ringzero/wire.hpp"

namespace ringzero::detail {

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

[[nodiscard]] inline bool check_enabled() {
  return call_env::read().check_on();
}

/// RINGZERO_CHECK=1: every rank's record of the call it is about to run, side by side (the
/// backend's own all_gather where it runs its collectives, else a message to and from each
/// rank); mismatch_error on every rank alike when one differs from rank 0's, naming both.
template <class T>
void check_agreement(communicator<T>& comm, const call_record& mine, const options& opt) {
  const int n = comm.size();
  if (n == 1) return;
  std::vector<call_record> all;
  if constexpr (native_collectives<T>) {
    all.resize(static_cast<std::size_t>(n));
    comm.transport().all_gather_bytes(std::as_bytes(std::span(&mine, 1)),
                                      std::as_writable_bytes(std::span(all)), opt);
  } else {
    all = exchange_records(comm, mine, "RINGZERO_CHECK", opt.timeout);
  }
  const int r =
      first_disagreeing(n, 0, all[0], [&](int q) { return all[static_cast<std::size_t>(q)]; });
  if (r >= 0)
    throw mismatch_error(fmt::format("RINGZERO_CHECK: rank 0 called {} but rank {} called {}",
                                     describe(all[0], &algorithm_name), r,
                                     describe(all[static_cast<std::size_t>(r)], &algorithm_name)));
}

/// RINGZERO_CHECK=1's agreement on a call of `count` elements of E (`enabled`: whether it is
/// set, as the caller read it).
template <class T, element E>
void maybe_check(communicator<T>& comm, collective c, std::size_t count, op o, int root,
                 const options& opt, bool enabled = check_enabled(), bool exact = false) {
  if (!enabled) return;
  call_record s;
  s.kind = static_cast<std::uint8_t>(c);
  s.type = static_cast<std::uint8_t>(dtype_of<E>());
  s.reduction = static_cast<std::uint8_t>(o);
  s.algo = static_cast<std::uint8_t>(opt.algorithm);
  s.reproducible = exact ? 1 : 0;
  if (opt.wire != wire_format::full) {
    s.wire = static_cast<std::uint8_t>(opt.wire);
    s.wire_block = static_cast<std::uint32_t>(wire_block_of(opt));
  }
  s.root = root;
  s.count = count;
  check_agreement(comm, s, opt);
}

/// RINGZERO_CHECK=1 for all_to_allv: what each rank sends a peer must be what that peer
/// expects from it. Every rank learns whether any pair disagreed, so all of them throw.
template <class T>
void check_v_agreement(communicator<T>& comm, const algorithms::block_map& m, const options& opt) {
  if (comm.size() == 1) return;
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

/// The device a call's buffers are memory of on transport T: device_of_call where T moves
/// device memory; -1 on a backend that runs its collectives itself (NCCL: the transport's
/// device is the call's); elsewhere -1, after refusing device buffers (refuse_device_memory).
template <class T, element E>
[[nodiscard]] int device_for(const collective_descriptor& d, const algorithms::call<E>& c,
                             int rank) {
  if constexpr (device_memory_transport<T>) {
    return device_of_call(c, rank);
  } else {
    if constexpr (!native_collectives<T>) {
      const bool in = !c.in.empty() && d.uses_in(rank, c.root);
      const bool out = !c.out.empty() && d.uses_out(rank, c.root);
      refuse_device_memory(d.name, {{"input", in ? c.in.data() : nullptr},
                                    {"output", out ? c.out.data() : nullptr}});
    }
    return -1;
  }
}

/// Whether a call takes options::reproducible's path: the option set on a collective whose
/// descriptor reduces, of a floating type, with sum or avg (min and max are exact already,
/// integers too, and a collective that adds nothing gives the same bits whatever the option
/// says). prod has no exact form and is refused.
template <element E>
[[nodiscard]] bool takes_reproducible_path(const collective_descriptor& d, op o,
                                           const options& opt) {
  if (!opt.reproducible || !d.reduces) return false;
  if constexpr (!reproducible::supported_v<std::remove_cv_t<E>>) {
    return false;
  } else {
    if (o == op::prod)
      throw invalid_argument(fmt::format(
          "{}: options::reproducible takes sum or avg (min and max are exact already); prod has "
          "no reproducible form",
          d.name));
    return o == op::sum || o == op::avg;
  }
}

/// One validated call on its way to the path that runs it. `Table`: the algorithms a path may
/// choose from.
template <class Table, class T, element E>
class call_route {
 public:
  using table = Table;
  using transport_type = T;
  using element_type = E;

  call_route(communicator<T>& comm_, const algorithms::call<E>& c, const options& opt_)
      : comm(comm_),
        call(c),
        d(algorithms::describe(c)),
        opt(opt_),
        size(size_of(c, comm_.size())),
        env(call_env::read()),
        quantized(takes_quantized_path<E>(d, c.reduction, opt_)),
        reproducible(takes_reproducible_path<E>(d, c.reduction, opt_)),
        device(device_for<T>(d, c, comm_.rank())) {}
  call_route(const call_route&) = delete;
  call_route& operator=(const call_route&) = delete;

  communicator<T>& comm;
  const algorithms::call<E>& call;
  const collective_descriptor& d;
  const options& opt;
  const call_size<E> size;
  const call_env env;
  /// options::wire applies (takes_quantized_path: bad wire options were refused).
  const bool quantized;
  /// options::reproducible applies (takes_reproducible_path).
  const bool reproducible;
  /// The CUDA device of the buffers on a transport that moves device memory; -1 elsewhere
  /// (device_for: a host transport refused device buffers on construction).
  const int device;

  /// Starts the call on the path that runs it, under algorithm `a` (automatic: none, or the
  /// backend's own; counters and traces show "-"): RINGZERO_CHECK's agreement and the count,
  /// once; a path that runs the call after another was declined only names its algorithm.
  /// Returns whether the call moves nothing on any rank: the path then returns at once.
  [[nodiscard]] bool start(algorithm a) {
    if (scope_) {
      scope_->set_algorithm(a);
      return size.empty;
    }
    maybe_check<T, E>(comm, call.kind, size.count, call.reduction, call.root, opt, env.check_on());
    if constexpr (!native_collectives<T>)
      if (d.in.size == extent::varies && env.check_on()) check_v_agreement(comm, call.blocks, opt);
    // Counted (and traced, under RINGZERO_TRACE) whatever happens next, empty calls included.
    scope_.emplace(comm, call.kind, a, size.model_bytes, dtype_of<E>(), call.reduction, opt,
                   d.name);
    return size.empty;
  }

  /// The environment's algorithm (RINGZERO_ALGO), if set: invalid_argument where it names none.
  [[nodiscard]] std::optional<algorithm> env_algorithm() const {
    return detail::env_algorithm<Table>(env.algo);
  }

 private:
  std::optional<collective_scope<communicator<T>>> scope_;
};

}  // namespace ringzero::detail
