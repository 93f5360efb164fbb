// Reproducible sums built up before the ranks meet (reduce/reproducible_accumulator.hpp): the
// ranks' accumulators combined with the passes of options::reproducible -- windows agreed by
// max, digits added as int64, each element rounded once. What reproducible training reduces its
// gradients and its global norm with.
#pragma once

#include <fmt/core.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/collectives.hpp"
#include "ringzero/detail/reproducible_call.hpp"
#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/reproducible.hpp"
#include "ringzero/reduce/reproducible_accumulator.hpp"

namespace ringzero::detail {

/// The ranks' accumulators summed exactly and rounded once into out, divided by `divisor`
/// first (avg): as all_reduce when out has acc.size() elements, as reduce_scatter (this rank's
/// block of acc.size() / size()) when out is that long. The sum does not depend on how the
/// terms were spread over ranks and over calls to add.
template <class Comm, class E>
void combine_accumulators(Comm& comm, rp::accumulator<E>& acc, std::span<E> out,
                          std::uint32_t divisor, const options& opt) {
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
  // The words must hold every rank's terms at once.
  std::int64_t adds = acc.max_adds();
  all_reduce(comm, std::span<std::int64_t>(&adds, 1), op::sum, aux);
  if (adds >= rp::max_terms) acc.normalize();
  std::vector<std::int32_t> win;
  acc.windows(win);
  all_reduce(comm, std::span<std::int32_t>(win), op::max, aux);
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
    reduce_scatter(comm, std::span<const std::int64_t>(q), std::span<std::int64_t>(mine), op::sum,
                   inner);
    read_digits(mine.data(), win, from, from + count, divisor, out.data());
  } else {
    std::vector<std::int64_t> q(digits_between(win, 0, total));
    acc.write(win, 0, total, q.data());
    all_reduce(comm, std::span<std::int64_t>(q), op::sum, inner);
    read_digits(q.data(), win, 0, total, divisor, out.data());
  }
  if (special) {
    std::vector<std::int64_t> codes(total);
    acc.write_specials(0, total, codes.data());
    std::vector<std::int64_t> mine(count);
    if (scatter)
      reduce_scatter(comm, std::span<const std::int64_t>(codes), std::span<std::int64_t>(mine),
                     op::sum, aux);
    else
      all_reduce(comm, std::span<const std::int64_t>(codes), std::span<std::int64_t>(mine), op::sum,
                 aux);
    apply_specials(mine.data(), count, out.data());
  }
}

}  // namespace ringzero::detail
