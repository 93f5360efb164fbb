// ringzero's algorithms for buffers the host does not touch: which (algorithm, collective) pairs
// exist as schedules, the scratch each needs, and one entry point that runs a validated call on
// an executor (schedule/executor.hpp). The NCCL backend runs them when options::algorithm asks
// for one (transport/nccl/executor.hpp); schedule/host_executor.hpp runs them on host memory.
//
//   ring: all_reduce, reduce_scatter, all_gather   (schedule/ring.hpp; the host ring's order)
//   tree: all_reduce, broadcast, reduce            (schedule/tree.hpp; binomial trees)
//
// Unlike NCCL's own collectives, every schedule reduces in one fixed order for a given world
// size, count and root: the same bits on every run.
#pragma once

#include <fmt/core.h>

#include <cstddef>
#include <span>
#include <string_view>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/algorithms/schedule/executor.hpp"
#include "ringzero/algorithms/schedule/ring.hpp"
#include "ringzero/algorithms/schedule/tree.hpp"
#include "ringzero/algorithms/table.hpp"
#include "ringzero/error.hpp"
#include "ringzero/transport/native.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms::schedule {

/// The algorithms that exist as schedules, and for which collectives.
struct entry {
  algorithm id;
  collective_set implements;
};

inline constexpr entry schedules[] = {
    {algorithm::ring, {collective::all_reduce, collective::reduce_scatter, collective::all_gather}},
    {algorithm::tree, {collective::all_reduce, collective::broadcast, collective::reduce}},
};

/// The table above in words, for refusals to list.
inline constexpr std::string_view summary =
    "ring (all_reduce, reduce_scatter, all_gather) and tree (all_reduce, broadcast, reduce)";

[[nodiscard]] constexpr bool has_schedule(algorithm a, collective c) noexcept {
  for (const entry& e : schedules)
    if (e.id == a) return e.implements.contains(c);
  return false;
}

/// Whether the schedule reduces (and so needs the executor's combine).
[[nodiscard]] constexpr bool reduces(collective c) noexcept {
  const collective_descriptor* d = builtin_collectives::find(c);
  return d != nullptr && d->reduces;
}

/// The one validated call in element terms, its buffers sized by the descriptor's extents from
/// native_call's count. Buffers a rank does not use (broadcast's in and reduce's out off the
/// root) are empty.
template <element E>
[[nodiscard]] call<E> call_of(const native_call& c, int rank, int size) {
  // Only built-in collectives have schedules.
  const collective_descriptor& d = *builtin_collectives::find(c.kind);
  return {c.kind,
          std::span<const E>(static_cast<const E*>(c.in), d.in_elems(c.count, size, rank, c.root)),
          std::span<E>(static_cast<E*>(c.out), d.out_elems(c.count, size, rank, c.root)),
          c.reduction, c.root};
}

/// The element count of a call as native_call counts it.
template <element E>
[[nodiscard]] std::size_t elements_of(const call<E>& c, int size) {
  return describe(c).count(c.in.size(), c.out.size(), size);
}

/// Scratch elements algorithm `a` needs for `c` on `size` ranks (0 for a pair without schedule).
template <element E>
[[nodiscard]] std::size_t scratch_elems(algorithm a, const call<E>& c, int size) {
  const std::size_t count = elements_of(c, size);
  if (a == algorithm::ring && c.kind == collective::all_reduce)
    return ring::all_reduce_scratch(count, size);
  if (a == algorithm::ring && c.kind == collective::reduce_scatter)
    return ring::reduce_scatter_scratch(count, size);
  if (a == algorithm::tree && c.kind == collective::all_reduce)
    return tree::all_reduce_scratch(count, size);
  if (a == algorithm::tree && c.kind == collective::reduce)
    return tree::reduce_scratch(count, size);
  return 0;
}

/// Runs validated call `c` with algorithm `a` on executor `x`; `scratch` holds at least
/// scratch_elems(a, c, x.size()) elements the executor can address. In place means what it
/// means in collectives.hpp. A world of one copies in to out where they differ.
template <element E, executor<E> X>
void run(X& x, algorithm a, const call<E>& c, std::span<E> scratch) {
  if (!has_schedule(a, c.kind))
    throw unsupported(fmt::format("{}: algorithm '{}' has no schedule for this collective",
                                  collective_name(c.kind), algorithm_name(a)));
  const int n = x.size();
  const std::size_t count = elements_of(c, n);
  if (count == 0) return;
  const E* in = c.in.data();
  E* out = c.out.data();
  if (n == 1) {
    // Nothing to exchange; avg over one rank is the value itself.
    const bool writes = describe(c).uses_out(x.rank(), c.root);
    if (writes && in != out) x.copy(out, in, count);
    return;
  }
  switch (c.kind) {
    case collective::all_reduce:
      return a == algorithm::ring ? ring::all_reduce<E>(x, in, out, count, c.reduction, scratch)
                                  : tree::all_reduce<E>(x, in, out, count, c.reduction, scratch);
    case collective::reduce_scatter:
      return ring::reduce_scatter<E>(x, in, out, count, c.reduction, scratch);
    case collective::all_gather:
      return ring::all_gather<E>(x, in, out, count);
    case collective::broadcast:
      return tree::broadcast<E>(x, in, out, count, c.root);
    default:
      return tree::reduce<E>(x, in, out, count, c.reduction, c.root, scratch);
  }
}

}  // namespace ringzero::algorithms::schedule
