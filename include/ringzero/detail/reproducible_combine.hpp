// Reproducible sums built up before the ranks meet (reduce/reproducible_accumulator.hpp,
// reduce/reproducible_compact.hpp): the ranks' accumulators combined with the passes of
// options::reproducible -- windows agreed by max, digits added as int64, each element rounded
// once. What reproducible training combines the owners of one shard across the groups of hybrid
// sharding with, and its global norm.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/collectives.hpp"
#include "ringzero/detail/reproducible_call.hpp"
#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/reproducible.hpp"
#include "ringzero/reduce/reproducible_accumulator.hpp"
#include "ringzero/reduce/reproducible_compact.hpp"

namespace ringzero::detail {

/// What combine_accumulators reads of an accumulator of E: reproducible::accumulator and
/// reproducible::compact_accumulator.
template <class A>
concept combinable = requires(A& a, const A& c, std::vector<std::int32_t>& win, std::int64_t* q) {
  { c.size() } -> std::convertible_to<std::size_t>;
  { c.max_adds() } -> std::convertible_to<std::int64_t>;
  a.normalize();
  c.windows(win);
  c.write(win, std::size_t{0}, std::size_t{0}, q);
  c.write_specials(std::size_t{0}, std::size_t{0}, q);
};

/// How combine_accumulators and exact_sumsq::agree reach their communicator: the collectives
/// run on the host vectors themselves. A sharder whose communicator moves device memory only
/// (NCCL) passes an object with the same two members that copies the vectors through device
/// memory (zero/detail/staged_collectives.hpp).
struct host_collectives {
  template <class Comm, class T>
  void all_reduce(Comm& comm, std::span<T> values, op o, const options& opt) const {
    ringzero::all_reduce(comm, values, o, opt);
  }
  template <class Comm, class T>
  void reduce_scatter(Comm& comm, std::span<const T> in, std::span<T> out, op o,
                      const options& opt) const {
    ringzero::reduce_scatter(comm, in, out, o, opt);
  }
};

/// The ranks' accumulators summed exactly and rounded once into out, divided by `divisor`
/// first (avg): as all_reduce when out has acc.size() elements, as reduce_scatter (this rank's
/// block of acc.size() / comm.size()) when out is that long. The sum does not depend on how the
/// terms were spread over ranks and over calls to add.
///
/// `across` (hybrid sharding, or null): the ranks that hold the same block as this one in the
/// other groups of `comm`'s kind, so that comm's ranks and across's together are the world.
/// Everything agreed is then agreed over the world (the windows' max and the headroom's sum
/// within comm, then across), the digits are reduce_scattered (or all_reduced) within comm and
/// all_reduced across, and only then rounded: integer sums are exact in any grouping, so the
/// result is the same bits as one combine over the world.
///
/// `via` runs the collectives (host_collectives: on these host vectors); `out` is host memory.
template <class Comm, combinable Acc, class E, class Via = host_collectives>
void combine_accumulators(Comm& comm, Comm* across, Acc& acc, std::span<E> out,
                          std::uint32_t divisor, const options& opt, const Via& via = Via{}) {
  const int n = comm.size();
  const std::size_t total = acc.size();
  const bool scatter = out.size() != total;
  if (out.size() != total && out.size() * static_cast<std::size_t>(n) != total)
    throw invalid_argument(
        fmt::format("combine_accumulators: out holds {} elements; expected {} "
                    "(all_reduce) or {} (reduce_scatter)",
                    out.size(), total, total / static_cast<std::size_t>(n)));
  options inner = opt;
  inner.reproducible = false;
  options aux = inner;
  aux.algorithm = algorithm::automatic;
  // An integer sum or max over the world: within comm, then across the groups.
  const auto agree = [&](auto values, op o, const options& with) {
    via.all_reduce(comm, values, o, with);
    if (across != nullptr) via.all_reduce(*across, values, o, aux);
  };
  // The words must hold every rank's terms at once.
  std::int64_t adds = acc.max_adds();
  agree(std::span<std::int64_t>(&adds, 1), op::sum, aux);
  if (adds >= rp::max_terms) acc.normalize();
  std::vector<std::int32_t> win;
  acc.windows(win);
  agree(std::span<std::int32_t>(win), op::max, aux);
  const bool special = win.back() != 0;
  const std::size_t count = out.size();
  const std::size_t from = scatter ? static_cast<std::size_t>(comm.rank()) * count : 0;
  if (scatter) {
    std::size_t seg = 0;
    for (int r = 0; r < n; ++r)
      seg = std::max(seg, digits_between(win, static_cast<std::size_t>(r) * count,
                                         static_cast<std::size_t>(r + 1) * count));
    std::vector<std::int64_t> q(seg * static_cast<std::size_t>(n), 0);
    for (int r = 0; r < n; ++r)
      acc.write(win, static_cast<std::size_t>(r) * count, static_cast<std::size_t>(r + 1) * count,
                q.data() + static_cast<std::size_t>(r) * seg);
    std::vector<std::int64_t> mine(seg);
    via.reduce_scatter(comm, std::span<const std::int64_t>(q), std::span<std::int64_t>(mine),
                       op::sum, inner);
    if (across != nullptr) via.all_reduce(*across, std::span<std::int64_t>(mine), op::sum, aux);
    read_digits(mine.data(), win, from, from + count, divisor, out.data());
  } else {
    std::vector<std::int64_t> q(digits_between(win, 0, total));
    acc.write(win, 0, total, q.data());
    agree(std::span<std::int64_t>(q), op::sum, inner);
    read_digits(q.data(), win, 0, total, divisor, out.data());
  }
  if (special) {
    std::vector<std::int64_t> codes(total);
    acc.write_specials(0, total, codes.data());
    std::vector<std::int64_t> mine;
    if (scatter) {
      mine.resize(count);
      via.reduce_scatter(comm, std::span<const std::int64_t>(codes), std::span<std::int64_t>(mine),
                         op::sum, aux);
    } else {
      via.all_reduce(comm, std::span<std::int64_t>(codes), op::sum, aux);
      mine = std::move(codes);
    }
    if (across != nullptr) via.all_reduce(*across, std::span<std::int64_t>(mine), op::sum, aux);
    apply_specials(mine.data(), count, out.data());
  }
}

/// combine_accumulators over one group of ranks: the world.
template <class Comm, combinable Acc, class E, class Via = host_collectives>
void combine_accumulators(Comm& comm, Acc& acc, std::span<E> out, std::uint32_t divisor,
                          const options& opt, const Via& via = Via{}) {
  combine_accumulators(comm, static_cast<Comm*>(nullptr), acc, out, divisor, opt, via);
}

}  // namespace ringzero::detail
