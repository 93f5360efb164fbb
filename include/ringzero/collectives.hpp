// The collectives API: what a trainer calls. Every function
//   - validates its arguments on the calling rank and throws ringzero::invalid_argument before
//     anything is sent (sizes, overlapping out-of-place buffers, root range, op);
//   - picks an algorithm (options::algorithm, else RINGZERO_ALGO, else the cost model);
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
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/barrier.hpp"
#include "ringzero/algorithms/binomial.hpp"
#include "ringzero/algorithms/binomial_gather.hpp"
#include "ringzero/algorithms/bruck.hpp"
#include "ringzero/algorithms/chain.hpp"
#include "ringzero/algorithms/hierarchical.hpp"
#include "ringzero/algorithms/hierarchical_all_to_all.hpp"
#include "ringzero/algorithms/linear.hpp"
#include "ringzero/algorithms/pairwise.hpp"
#include "ringzero/algorithms/rabenseifner.hpp"
#include "ringzero/algorithms/recursive_doubling.hpp"
#include "ringzero/algorithms/ring.hpp"
#include "ringzero/algorithms/tree.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/tuning/cost_model.hpp"
#include "ringzero/types.hpp"

namespace ringzero {

namespace detail {

/// A transport that knows node placement and can build sub-communicators supports
/// algorithm::hierarchical: split(color, key) as MPI_Comm_split, nullopt for a negative color.
template <class T>
concept hierarchical_transport = transport<T> && requires(T& t, int color, int key) {
  { t.topo() } -> std::convertible_to<topology>;
  { t.split(color, key) } -> std::same_as<std::optional<T>>;
};

[[nodiscard]] inline bool overlaps(const void* a, std::size_t an, const void* b,
                                   std::size_t bn) noexcept {
  if (an == 0 || bn == 0) return false;
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + bn && y < x + an;
}

inline void check_op(op o, std::string_view what) {
  if (!is_valid(o))
    throw invalid_argument(
        fmt::format("{}: unknown reduction op code {}", what, static_cast<int>(o)));
}

inline void check_root(int root, int n, std::string_view what) {
  if (root < 0 || root >= n)
    throw invalid_argument(
        fmt::format("{}: root {} is out of range for a {}-rank communicator", what, root, n));
}

// RINGZERO_ALGO and RINGZERO_CHECK are read on every call, not cached: a getenv costs nothing
// next to a collective, and a program (or a test) may change them between calls.
[[nodiscard]] inline std::optional<algorithm> env_algorithm() {
  auto s = getenv_str("RINGZERO_ALGO");
  if (!s) return std::nullopt;
  return parse_algorithm(*s);
}

/// options::algorithm wins and must apply; RINGZERO_ALGO applies where it can (as NCCL_ALGO);
/// otherwise the cost model decides.
template <transport T>
[[nodiscard]] algorithm choose(T& comm, collective c, std::size_t bytes, const options& opt) {
  topology topo{};
  if constexpr (hierarchical_transport<T>) topo = comm.topo();
  if (opt.algorithm != algorithm::automatic) {
    if (!tuning::applies(c, opt.algorithm, true))
      throw invalid_argument(fmt::format("{}: algorithm '{}' does not implement this collective",
                                         collective_name(c), algorithm_name(opt.algorithm)));
    if (opt.algorithm == algorithm::hierarchical && !hierarchical_transport<T>)
      throw unsupported(fmt::format("{}: this transport has no node topology for algorithm 'hier'",
                                    collective_name(c)));
    return opt.algorithm;
  }
  if (auto forced = env_algorithm(); forced && *forced != algorithm::automatic &&
                                     tuning::applies(c, *forced, hierarchical_transport<T>))
    return *forced;
  return tuning::select(c, static_cast<double>(bytes), comm.size(), comm.cost(), topo);
}

/// What RINGZERO_CHECK=1 compares across ranks before each collective.
struct call_signature {
  std::uint8_t kind = 0;
  std::uint8_t type = 0;
  std::uint8_t reduction = 0;
  std::uint8_t algo = 0;
  std::int32_t root = 0;
  std::uint64_t count = 0;
};

[[nodiscard]] inline bool check_enabled() {
  return env_flag("RINGZERO_CHECK");
}

template <transport T>
void check_agreement(T& comm, const call_signature& mine) {
  const int n = comm.size();
  if (n == 1) return;
  std::vector<call_signature> all(static_cast<std::size_t>(n));
  algorithms::ring::all_gather(
      comm,
      std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(&mine), sizeof mine),
      std::span<std::uint8_t>(reinterpret_cast<std::uint8_t*>(all.data()),
                              all.size() * sizeof(call_signature)),
      options{});
  for (int r = 0; r < n; ++r) {
    const auto& o = all[static_cast<std::size_t>(r)];
    if (std::memcmp(&o, &all[0], sizeof o) != 0)
      throw mismatch_error(fmt::format(
          "RINGZERO_CHECK: rank {} called {} (count {}, type {}, op {}, root {}, algorithm {}) but "
          "rank {} called {} (count {}, type {}, op {}, root {}, algorithm {})",
          0, collective_name(static_cast<collective>(all[0].kind)), all[0].count,
          dtype_name(static_cast<dtype>(all[0].type)), op_name(static_cast<op>(all[0].reduction)),
          all[0].root, algorithm_name(static_cast<algorithm>(all[0].algo)), r,
          collective_name(static_cast<collective>(o.kind)), o.count,
          dtype_name(static_cast<dtype>(o.type)), op_name(static_cast<op>(o.reduction)), o.root,
          algorithm_name(static_cast<algorithm>(o.algo))));
  }
}

template <transport T, element E>
void maybe_check(T& comm, collective c, std::size_t count, op o, int root, const options& opt) {
  if (!check_enabled()) return;
  call_signature s;
  s.kind = static_cast<std::uint8_t>(c);
  s.type = static_cast<std::uint8_t>(dtype_of<E>());
  s.reduction = static_cast<std::uint8_t>(o);
  s.algo = static_cast<std::uint8_t>(opt.algorithm);
  s.root = root;
  s.count = count;
  check_agreement(comm, s);
}

template <element E>
void copy_if_distinct(std::span<const E> in, std::span<E> out) {
  if (in.data() != out.data() && !in.empty()) std::memcpy(out.data(), in.data(), in.size_bytes());
}

// Argument checks of the collectives below, shared with the NCCL backend so that a caller sees
// one message per mistake whichever backend runs the call.

template <element E>
void check_all_to_all(int size, std::span<const E> in, std::span<E> out) {
  const auto n = static_cast<std::size_t>(size);
  if (in.size() != out.size())
    throw invalid_argument(
        fmt::format("all_to_all: input has {} elements but output has {}", in.size(), out.size()));
  if (in.size() % n != 0)
    throw invalid_argument(fmt::format(
        "all_to_all: {} elements do not split into {} equal blocks, one per rank", in.size(), n));
  if (in.data() != out.data() && overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("all_to_all: input and output overlap without being the same buffer");
}

/// One side (send or receive) of an all_to_allv: a count and a displacement per rank, every
/// block inside a buffer of `len` elements.
inline void check_v_blocks(std::string_view side, int size, std::span<const std::size_t> counts,
                           std::span<const std::size_t> displs, std::size_t len) {
  const auto n = static_cast<std::size_t>(size);
  if (counts.size() != n)
    throw invalid_argument(
        fmt::format("all_to_allv: {} counts has {} entries, expected one per rank ({})", side,
                    counts.size(), n));
  if (displs.size() != n)
    throw invalid_argument(
        fmt::format("all_to_allv: {} displacements has {} entries, expected one per rank ({})",
                    side, displs.size(), n));
  for (std::size_t r = 0; r < n; ++r)
    if (displs[r] > len || counts[r] > len - displs[r])
      throw invalid_argument(fmt::format(
          "all_to_allv: {} block of rank {} (displacement {}, count {}) ends past the {} "
          "buffer's {} elements",
          side, r, displs[r], counts[r], side == "send" ? "input" : "output", len));
}

template <element E>
void check_all_to_allv(int rank, int size, std::span<const E> in,
                       std::span<const std::size_t> send_counts,
                       std::span<const std::size_t> send_displs, std::span<E> out,
                       std::span<const std::size_t> recv_counts,
                       std::span<const std::size_t> recv_displs) {
  check_v_blocks("send", size, send_counts, send_displs, in.size());
  check_v_blocks("receive", size, recv_counts, recv_displs, out.size());
  const auto me = static_cast<std::size_t>(rank);
  if (send_counts[me] != recv_counts[me])
    throw invalid_argument(
        fmt::format("all_to_allv: rank {} sends itself {} elements but receives {} from itself",
                    rank, send_counts[me], recv_counts[me]));
  if (overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument(
        "all_to_allv: input and output overlap (all_to_allv has no in-place form)");
  // Receive blocks must not overlap: sorted by displacement, each ends before the next begins.
  std::vector<std::size_t> order;
  for (std::size_t r = 0; r < recv_counts.size(); ++r)
    if (recv_counts[r] > 0) order.push_back(r);
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return recv_displs[a] < recv_displs[b]; });
  for (std::size_t i = 1; i < order.size(); ++i) {
    const std::size_t a = order[i - 1], b = order[i];
    if (recv_displs[a] + recv_counts[a] > recv_displs[b])
      throw invalid_argument(fmt::format(
          "all_to_allv: receive blocks of ranks {} and {} overlap (elements {}..{} and {}..{})",
          std::min(a, b), std::max(a, b), recv_displs[a], recv_displs[a] + recv_counts[a],
          recv_displs[b], recv_displs[b] + recv_counts[b]));
  }
}

template <element E>
void check_gather(int rank, int size, std::span<const E> in, std::span<E> out, int root) {
  check_root(root, size, "gather");
  if (rank != root) return;
  const auto n = static_cast<std::size_t>(size);
  if (out.size() != in.size() * n)
    throw invalid_argument(fmt::format(
        "gather: root's output must hold size() * input elements ({} * {} = {}), got {}", n,
        in.size(), n * in.size(), out.size()));
  const E* own_block = out.data() + in.size() * static_cast<std::size_t>(root);
  if (in.data() != own_block && overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("gather: input overlaps the root's output but is not the root's block");
}

template <element E>
void check_scatter(int rank, int size, std::span<const E> in, std::span<E> out, int root) {
  check_root(root, size, "scatter");
  if (rank != root) return;
  const auto n = static_cast<std::size_t>(size);
  if (in.size() != out.size() * n)
    throw invalid_argument(fmt::format(
        "scatter: root's input must hold size() * output elements ({} * {} = {}), got {}", n,
        out.size(), n * out.size(), in.size()));
  const E* own_block = in.data() + out.size() * static_cast<std::size_t>(root);
  if (out.data() != own_block && overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("scatter: output overlaps the root's input but is not the root's block");
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------

/// out[i] = in[i] reduced over all ranks. Cost (ring, large messages): 2(n-1) steps, each rank
/// sends and receives 2(n-1)/n of the buffer and reduces (n-1)/n of it.
template <transport T, element E>
void all_reduce(T& comm, std::span<const E> in, std::span<E> out, op o, const options& opt = {}) {
  constexpr std::string_view what = "all_reduce";
  detail::check_op(o, what);
  if (in.size() != out.size())
    throw invalid_argument(
        fmt::format("all_reduce: input has {} elements but output has {}", in.size(), out.size()));
  if (in.data() != out.data() &&
      detail::overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("all_reduce: input and output overlap without being the same buffer");
  const algorithm a = detail::choose(comm, collective::all_reduce, out.size_bytes(), opt);
  detail::maybe_check<T, E>(comm, collective::all_reduce, out.size(), o, 0, opt);
  if (out.empty()) return;
  if (comm.size() == 1) return detail::copy_if_distinct(in, out);
  options o2 = opt;
  o2.algorithm = a;
  switch (a) {
    case algorithm::ring:
      return algorithms::ring::all_reduce(comm, in, out, o, o2);
    case algorithm::tree:
      return algorithms::tree::all_reduce(comm, in, out, o, o2);
    case algorithm::recursive_doubling:
      return algorithms::recursive_doubling::all_reduce(comm, in, out, o, o2);
    case algorithm::recursive_halving_doubling:
      return algorithms::rabenseifner::all_reduce(comm, in, out, o, o2);
    case algorithm::hierarchical:
      if constexpr (detail::hierarchical_transport<T>)
        return algorithms::hierarchical_all_reduce(comm, in, out, o, o2);
      [[fallthrough]];
    default:
      throw unsupported(fmt::format("all_reduce: algorithm '{}' unavailable", algorithm_name(a)));
  }
}

/// In-place all_reduce.
template <transport T, element E>
void all_reduce(T& comm, std::span<E> data, op o, const options& opt = {}) {
  all_reduce(comm, std::span<const E>(data), data, o, opt);
}

template <transport T, element E>
void all_reduce(T& comm, std::span<E> in, std::span<E> out, op o, const options& opt = {}) {
  all_reduce(comm, std::span<const E>(in), out, o, opt);
}

/// in holds size()*out.size() elements, block r for rank r; out receives this rank's block
/// reduced over all ranks. Cost (ring): n-1 steps, (n-1)/n of the input sent and reduced.
template <transport T, element E>
void reduce_scatter(T& comm, std::span<const E> in, std::span<E> out, op o,
                    const options& opt = {}) {
  detail::check_op(o, "reduce_scatter");
  const auto n = static_cast<std::size_t>(comm.size());
  if (in.size() != out.size() * n)
    throw invalid_argument(fmt::format(
        "reduce_scatter: input must hold size() * output elements ({} * {} = {}), got {}", n,
        out.size(), n * out.size(), in.size()));
  const E* own_block = in.data() + out.size() * static_cast<std::size_t>(comm.rank());
  if (out.data() != own_block &&
      detail::overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument(
        "reduce_scatter: output overlaps the input but is not this rank's block of it");
  const algorithm a = detail::choose(comm, collective::reduce_scatter, in.size_bytes(), opt);
  detail::maybe_check<T, E>(comm, collective::reduce_scatter, out.size(), o, 0, opt);
  if (out.empty()) return;
  if (n == 1) return detail::copy_if_distinct(in, out);
  options o2 = opt;
  o2.algorithm = a;
  switch (a) {
    case algorithm::ring:
      return algorithms::ring::reduce_scatter(comm, in, out, o, o2);
    case algorithm::recursive_halving_doubling:
      return algorithms::rabenseifner::reduce_scatter(comm, in, out, o, o2);
    default:
      throw unsupported(
          fmt::format("reduce_scatter: algorithm '{}' unavailable", algorithm_name(a)));
  }
}

template <transport T, element E>
void reduce_scatter(T& comm, std::span<E> in, std::span<E> out, op o, const options& opt = {}) {
  reduce_scatter(comm, std::span<const E>(in), out, o, opt);
}

/// out (size()*in.size() elements) receives every rank's in, block r from rank r.
/// Cost (ring): n-1 steps, (n-1)/n of the output received.
template <transport T, element E>
void all_gather(T& comm, std::span<const E> in, std::span<E> out, const options& opt = {}) {
  const auto n = static_cast<std::size_t>(comm.size());
  if (out.size() != in.size() * n)
    throw invalid_argument(
        fmt::format("all_gather: output must hold size() * input elements ({} * {} = {}), got {}",
                    n, in.size(), n * in.size(), out.size()));
  const E* own_block = out.data() + in.size() * static_cast<std::size_t>(comm.rank());
  if (in.data() != own_block &&
      detail::overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("all_gather: input overlaps the output but is not this rank's block");
  const algorithm a = detail::choose(comm, collective::all_gather, out.size_bytes(), opt);
  detail::maybe_check<T, E>(comm, collective::all_gather, in.size(), op::sum, 0, opt);
  if (in.empty()) return;
  if (n == 1) return detail::copy_if_distinct(in, out);
  options o2 = opt;
  o2.algorithm = a;
  switch (a) {
    case algorithm::ring:
      return algorithms::ring::all_gather(comm, in, out, o2);
    case algorithm::recursive_doubling:
      return algorithms::recursive_doubling::all_gather(comm, in, out, o2);
    default:
      throw unsupported(fmt::format("all_gather: algorithm '{}' unavailable", algorithm_name(a)));
  }
}

template <transport T, element E>
void all_gather(T& comm, std::span<E> in, std::span<E> out, const options& opt = {}) {
  all_gather(comm, std::span<const E>(in), out, opt);
}

/// Copies root's in to every rank's out. in is read only on root. Cost: pipelined chain
/// (ring) n-2+k chunk steps; binomial tree (tree) ceil(log2 n) whole-message steps.
template <transport T, element E>
void broadcast(T& comm, std::span<const E> in, std::span<E> out, int root,
               const options& opt = {}) {
  detail::check_root(root, comm.size(), "broadcast");
  const bool is_root = comm.rank() == root;
  if (is_root && in.size() != out.size())
    throw invalid_argument(fmt::format("broadcast: root's input has {} elements but output has {}",
                                       in.size(), out.size()));
  if (is_root && in.data() != out.data() &&
      detail::overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("broadcast: input and output overlap without being the same buffer");
  const algorithm a = detail::choose(comm, collective::broadcast, out.size_bytes(), opt);
  detail::maybe_check<T, E>(comm, collective::broadcast, out.size(), op::sum, root, opt);
  if (out.empty()) return;
  if (is_root) detail::copy_if_distinct(in, out);
  if (comm.size() == 1) return;
  options o2 = opt;
  o2.algorithm = a;
  switch (a) {
    case algorithm::ring:
      return algorithms::chain::broadcast(comm, out, root, o2);
    case algorithm::tree:
      return algorithms::binomial::broadcast(comm, out, root, o2);
    default:
      throw unsupported(fmt::format("broadcast: algorithm '{}' unavailable", algorithm_name(a)));
  }
}

/// In-place broadcast.
template <transport T, element E>
void broadcast(T& comm, std::span<E> data, int root, const options& opt = {}) {
  broadcast(comm, std::span<const E>(data), data, root, opt);
}

template <transport T, element E>
void broadcast(T& comm, std::span<E> in, std::span<E> out, int root, const options& opt = {}) {
  broadcast(comm, std::span<const E>(in), out, root, opt);
}

/// out on root receives in reduced over all ranks; out is not touched elsewhere (it may be
/// empty there). Cost: as broadcast, plus reducing the buffer once per hop.
template <transport T, element E>
void reduce(T& comm, std::span<const E> in, std::span<E> out, op o, int root,
            const options& opt = {}) {
  detail::check_op(o, "reduce");
  detail::check_root(root, comm.size(), "reduce");
  const bool is_root = comm.rank() == root;
  if (is_root && in.size() != out.size())
    throw invalid_argument(fmt::format("reduce: root's input has {} elements but output has {}",
                                       in.size(), out.size()));
  if (is_root && in.data() != out.data() &&
      detail::overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("reduce: input and output overlap without being the same buffer");
  const algorithm a = detail::choose(comm, collective::reduce, in.size_bytes(), opt);
  detail::maybe_check<T, E>(comm, collective::reduce, in.size(), o, root, opt);
  if (in.empty()) return;
  if (comm.size() == 1) return detail::copy_if_distinct(in, out);
  options o2 = opt;
  o2.algorithm = a;
  switch (a) {
    case algorithm::ring:
      return algorithms::chain::reduce(comm, in, out, o, root, o2);
    case algorithm::tree:
      return algorithms::binomial::reduce(comm, in, out, o, root, o2);
    default:
      throw unsupported(fmt::format("reduce: algorithm '{}' unavailable", algorithm_name(a)));
  }
}

template <transport T, element E>
void reduce(T& comm, std::span<E> in, std::span<E> out, op o, int root, const options& opt = {}) {
  reduce(comm, std::span<const E>(in), out, o, root, opt);
}

/// In-place reduce: data on root is replaced by the reduction.
template <transport T, element E>
void reduce(T& comm, std::span<E> data, op o, int root, const options& opt = {}) {
  reduce(comm, std::span<const E>(data), data, o, root, opt);
}

/// Block r of in (in.size() / size() elements) goes to rank r; block r of out comes from rank r.
/// In place when in.data() == out.data(). Cost: pairwise exchange n-1 steps, (n-1)/n of the
/// buffer sent and received per rank; Bruck (small blocks) ceil(log2 n) steps of about half the
/// buffer; hierarchical (several nodes) gathers to node leaders, which exchange per-node bundles.
template <transport T, element E>
void all_to_all(T& comm, std::span<const E> in, std::span<E> out, const options& opt = {}) {
  detail::check_all_to_all(comm.size(), in, out);
  const algorithm a = detail::choose(comm, collective::all_to_all, in.size_bytes(), opt);
  const auto n = static_cast<std::size_t>(comm.size());
  detail::maybe_check<T, E>(comm, collective::all_to_all, in.size() / n, op::sum, 0, opt);
  if (in.empty()) return;
  if (n == 1) return detail::copy_if_distinct(in, out);
  options o2 = opt;
  o2.algorithm = a;
  switch (a) {
    case algorithm::pairwise:
      return algorithms::pairwise::all_to_all(comm, in, out, o2);
    case algorithm::bruck:
      return algorithms::bruck::all_to_all(comm, in, out, o2);
    case algorithm::hierarchical:
      if constexpr (detail::hierarchical_transport<T>)
        return algorithms::hierarchical_all_to_all(comm, in, out, o2);
      [[fallthrough]];
    default:
      throw unsupported(fmt::format("all_to_all: algorithm '{}' unavailable", algorithm_name(a)));
  }
}

/// In-place all_to_all.
template <transport T, element E>
void all_to_all(T& comm, std::span<E> data, const options& opt = {}) {
  all_to_all(comm, std::span<const E>(data), data, opt);
}

template <transport T, element E>
void all_to_all(T& comm, std::span<E> in, std::span<E> out, const options& opt = {}) {
  all_to_all(comm, std::span<const E>(in), out, opt);
}

namespace detail {

/// RINGZERO_CHECK=1 for all_to_allv: what each rank sends a peer must be what that peer
/// expects from it. Every rank learns whether any pair disagreed, so all of them throw.
template <transport T>
void check_v_agreement(T& comm, std::span<const std::size_t> send_counts,
                       std::span<const std::size_t> recv_counts) {
  if (!check_enabled() || comm.size() == 1) return;
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::uint64_t> mine(send_counts.begin(), send_counts.end()), theirs(n);
  const options plain{.algorithm = algorithm::pairwise};
  algorithms::pairwise::all_to_all(comm, std::span<const std::uint64_t>(mine),
                                   std::span<std::uint64_t>(theirs), plain);
  std::int64_t bad[3] = {-1, 0, 0};  // (sender, sent, expected) of the first disagreement
  for (std::size_t r = 0; r < n && bad[0] < 0; ++r) {
    if (theirs[r] == recv_counts[r]) continue;
    bad[0] = static_cast<std::int64_t>(r);
    bad[1] = static_cast<std::int64_t>(theirs[r]);
    bad[2] = static_cast<std::int64_t>(recv_counts[r]);
  }
  std::int64_t finder[1] = {bad[0] >= 0 ? comm.rank() : -1};
  all_reduce(comm, std::span<std::int64_t>(finder), op::max, options{.algorithm = algorithm::ring});
  if (finder[0] < 0) return;
  broadcast(comm, std::span<std::int64_t>(bad), static_cast<int>(finder[0]),
            options{.algorithm = algorithm::ring});
  throw mismatch_error(
      fmt::format("RINGZERO_CHECK: all_to_allv: rank {} sends {} elements to rank {}, which "
                  "expects {} from it",
                  bad[0], bad[1], finder[0], bad[2]));
}

}  // namespace detail

/// As MPI_Alltoallv: the send_counts[r] elements at in[send_displs[r]] go to rank r, and the
/// recv_counts[r] elements from rank r land at out[recv_displs[r]]. Counts may be zero and
/// differ per peer, but what rank i sends rank j must be what j expects from i (RINGZERO_CHECK=1
/// verifies it). Send blocks may overlap, receive blocks may not; in and out may not overlap.
/// Cost: pairwise exchange, n-1 steps.
template <transport T, element E>
void all_to_allv(T& comm, std::span<const E> in, std::span<const std::size_t> send_counts,
                 std::span<const std::size_t> send_displs, std::span<E> out,
                 std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs,
                 const options& opt = {}) {
  detail::check_all_to_allv(comm.rank(), comm.size(), in, send_counts, send_displs, out,
                            recv_counts, recv_displs);
  const algorithm a = detail::choose(comm, collective::all_to_allv, in.size_bytes(), opt);
  detail::maybe_check<T, E>(comm, collective::all_to_allv, 0, op::sum, 0, opt);
  detail::check_v_agreement(comm, send_counts, recv_counts);
  const algorithms::pairwise::block_map m{send_counts, send_displs, recv_counts, recv_displs};
  if (comm.size() == 1) {
    if (recv_counts[0] > 0)
      std::memcpy(out.data() + recv_displs[0], in.data() + send_displs[0],
                  recv_counts[0] * sizeof(E));
    return;
  }
  options o2 = opt;
  o2.algorithm = a;
  switch (a) {
    case algorithm::pairwise:
      return algorithms::pairwise::all_to_allv(comm, in, out, m, o2);
    default:
      throw unsupported(fmt::format("all_to_allv: algorithm '{}' unavailable", algorithm_name(a)));
  }
}

template <transport T, element E>
void all_to_allv(T& comm, std::span<E> in, std::span<const std::size_t> send_counts,
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
template <transport T, element E>
void gather(T& comm, std::span<const E> in, std::span<E> out, int root, const options& opt = {}) {
  detail::check_gather(comm.rank(), comm.size(), in, out, root);
  const auto n = static_cast<std::size_t>(comm.size());
  const algorithm a = detail::choose(comm, collective::gather, in.size_bytes() * n, opt);
  detail::maybe_check<T, E>(comm, collective::gather, in.size(), op::sum, root, opt);
  if (in.empty()) return;
  if (n == 1) return detail::copy_if_distinct(in, out);
  options o2 = opt;
  o2.algorithm = a;
  switch (a) {
    case algorithm::linear:
      return algorithms::linear::gather(comm, in, out, root, o2);
    case algorithm::tree:
      return algorithms::binomial::gather(comm, in, out, root, o2);
    default:
      throw unsupported(fmt::format("gather: algorithm '{}' unavailable", algorithm_name(a)));
  }
}

template <transport T, element E>
void gather(T& comm, std::span<E> in, std::span<E> out, int root, const options& opt = {}) {
  gather(comm, std::span<const E>(in), out, root, opt);
}

/// Block r of root's in (size()*out.size() elements) goes to rank r's out; in is read only on
/// root (it may be empty elsewhere). In place when out is the root's block of in. Cost: as
/// gather, the other way.
template <transport T, element E>
void scatter(T& comm, std::span<const E> in, std::span<E> out, int root, const options& opt = {}) {
  detail::check_scatter(comm.rank(), comm.size(), in, out, root);
  const auto n = static_cast<std::size_t>(comm.size());
  const algorithm a = detail::choose(comm, collective::scatter, out.size_bytes() * n, opt);
  detail::maybe_check<T, E>(comm, collective::scatter, out.size(), op::sum, root, opt);
  if (out.empty()) return;
  if (n == 1) return detail::copy_if_distinct(in, out);
  options o2 = opt;
  o2.algorithm = a;
  switch (a) {
    case algorithm::linear:
      return algorithms::linear::scatter(comm, in, out, root, o2);
    case algorithm::tree:
      return algorithms::binomial::scatter(comm, in, out, root, o2);
    default:
      throw unsupported(fmt::format("scatter: algorithm '{}' unavailable", algorithm_name(a)));
  }
}

template <transport T, element E>
void scatter(T& comm, std::span<E> in, std::span<E> out, int root, const options& opt = {}) {
  scatter(comm, std::span<const E>(in), out, root, opt);
}

/// Returns once every rank has entered. Cost: ceil(log2 n) zero-byte steps (dissemination).
template <transport T>
void barrier(T& comm, const options& opt = {}) {
  if (opt.algorithm != algorithm::automatic)
    throw invalid_argument(fmt::format("barrier: algorithm '{}' does not implement this collective",
                                       algorithm_name(opt.algorithm)));
  if (comm.size() == 1) return;
  algorithms::barrier(comm, opt);
}

/// Blocking point-to-point send; matched with recv() on `peer` in posting order.
template <transport T, element E>
void send(T& comm, std::span<const E> data, int peer, const options& opt = {}) {
  if (peer < 0 || peer >= comm.size() || peer == comm.rank())
    throw invalid_argument(
        fmt::format("send: peer {} is not another rank of this {}-rank "
                    "communicator (this is rank {})",
                    peer, comm.size(), comm.rank()));
  auto& st = comm.state();
  st.p2p_send_seq.resize(static_cast<std::size_t>(comm.size()));
  detail::exchange<T> ex(comm, "send", "p2p", opt.timeout, true,
                         st.p2p_send_seq[static_cast<std::size_t>(peer)]++);
  auto p = ex.send(peer, 0, 0, std::as_bytes(data));
  ex.wait(p);
}

template <transport T, element E>
void send(T& comm, std::span<E> data, int peer, const options& opt = {}) {
  send(comm, std::span<const E>(data), peer, opt);
}

/// Blocking point-to-point receive of exactly data.size() elements from `peer`.
template <transport T, element E>
void recv(T& comm, std::span<E> data, int peer, const options& opt = {}) {
  if (peer < 0 || peer >= comm.size() || peer == comm.rank())
    throw invalid_argument(
        fmt::format("recv: peer {} is not another rank of this {}-rank "
                    "communicator (this is rank {})",
                    peer, comm.size(), comm.rank()));
  auto& st = comm.state();
  st.p2p_recv_seq.resize(static_cast<std::size_t>(comm.size()));
  detail::exchange<T> ex(comm, "recv", "p2p", opt.timeout, true,
                         st.p2p_recv_seq[static_cast<std::size_t>(peer)]++);
  auto p = ex.recv(peer, 0, 0, std::as_writable_bytes(data));
  ex.wait(p);
}

/// Sends `out` to `to` while receiving `in` from `from` (both may be the same peer); the
/// building block of nccl-tests' sendrecv.
template <transport T, element E>
void send_recv(T& comm, std::span<const E> out, int to, std::span<E> in, int from,
               const options& opt = {}) {
  for (int peer : {to, from})
    if (peer < 0 || peer >= comm.size() || peer == comm.rank())
      throw invalid_argument(
          fmt::format("send_recv: peer {} is not another rank of this "
                      "{}-rank communicator (this is rank {})",
                      peer, comm.size(), comm.rank()));
  auto& st = comm.state();
  st.p2p_send_seq.resize(static_cast<std::size_t>(comm.size()));
  st.p2p_recv_seq.resize(static_cast<std::size_t>(comm.size()));
  detail::exchange<T> rx(comm, "send_recv", "p2p", opt.timeout, true,
                         st.p2p_recv_seq[static_cast<std::size_t>(from)]++);
  detail::exchange<T> tx(comm, "send_recv", "p2p", opt.timeout, true,
                         st.p2p_send_seq[static_cast<std::size_t>(to)]++);
  auto r = rx.recv(from, 0, 0, std::as_writable_bytes(in));
  auto s = tx.send(to, 0, 0, std::as_bytes(out));
  rx.wait(r);
  tx.wait(s);
}

}  // namespace ringzero
