// Host collectives over a device space, and the combine across groups of a device accumulator:
// where reproducible training on a device space (zero/exact_gradients.hpp) leaves the streams for
// host code, to agree on the exact norm and, with hybrid sharding, to combine the accumulators
// across the groups (detail/reproducible_combine.hpp). A stream-ordered backend (NCCL) moves only
// device memory, so those collectives copy their host vectors through device memory of the space.
// Apart from exact_gradients.hpp because it is the one place the host and device memory meet in it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "ringzero/collectives.hpp"
#include "ringzero/detail/reproducible_combine.hpp"
#include "ringzero/reduce/reproducible_compact.hpp"
#include "ringzero/zero/memory_space.hpp"

namespace ringzero::zero::detail {

/// The collectives of a combine on a device space: host vectors copied through device memory
/// of the space, in the communication stream's order (NCCL moves nothing else). `mem` is the
/// staging memory, kept and grown across calls.
template <class Space>
class staged {
 public:
  staged(const Space& space, buffer<std::int64_t>& mem) : space_(space), mem_(mem) {}
  template <class C, class T>
  void all_reduce(C& comm, std::span<T> values, op o, const ringzero::options& opt) const {
    const auto st = space_.comm_stream();
    T* d = staging<T>(values.size());
    space_.upload(st, d, values.data(), values.size());
    space_.run_sync(st,
                    [&] { ringzero::all_reduce(comm, std::span<T>(d, values.size()), o, opt); });
    space_.download(st, values.data(), d, values.size());
  }
  template <class C, class T>
  void reduce_scatter(C& comm, std::span<const T> in, std::span<T> out, op o,
                      const ringzero::options& opt) const {
    const auto st = space_.comm_stream();
    T* d = staging<T>(in.size() + out.size());
    space_.upload(st, d, in.data(), in.size());
    space_.run_sync(st, [&] {
      ringzero::reduce_scatter(comm, std::span<const T>(d, in.size()),
                               std::span<T>(d + in.size(), out.size()), o, opt);
    });
    space_.download(st, out.data(), d + in.size(), out.size());
  }

 private:
  /// Device memory for n elements of T, kept and grown for the staged collectives.
  template <class T>
  [[nodiscard]] T* staging(std::size_t n) const {
    static_assert(alignof(T) <= alignof(std::int64_t));
    const std::size_t words = std::max<std::size_t>(1, (n * sizeof(T) + 7) / 8);
    if (mem_.size() < words) {
      space_.synchronize();
      mem_ = space_.template allocate<std::int64_t>(words + words / 2);
    }
    return reinterpret_cast<T*>(mem_.data());
  }

  const Space& space_;
  buffer<std::int64_t>& mem_;
};

/// A device accumulator `v` read back into a host one, in `st`'s order: its words, its blocks'
/// heads and the part of its spill pool in use (`counts`: the pool's device counters, of at most
/// `records` records and `rows` rows).
template <class G, class Space>
[[nodiscard]] reproducible::compact_accumulator<G> download_accumulator(
    const Space& space, typename Space::stream st, const reproducible::compact_view& v,
    const std::uint32_t* counts_on_device, std::size_t records, std::size_t rows) {
  std::uint32_t counts[3] = {};
  space.download(st, counts, counts_on_device, 3);
  std::vector<std::int64_t> words(v.n);
  std::vector<reproducible::compact_head> heads(reproducible::blocks(v.n));
  std::vector<reproducible::spill_record> spilled(std::min<std::size_t>(counts[0], records));
  std::vector<std::int64_t> spill_rows(std::min<std::size_t>(counts[1], rows) *
                                       reproducible::block_elems);
  space.download(st, words.data(), v.words, words.size());
  space.download(st, heads.data(), v.heads, heads.size());
  space.download(st, spilled.data(), v.pool.records, spilled.size());
  space.download(st, spill_rows.data(), v.pool.rows, spill_rows.size());
  return reproducible::compact_accumulator<G>::adopt(std::move(words), std::move(heads),
                                                     std::move(spilled), std::move(spill_rows));
}

/// Hybrid sharding on a device space: the accumulator `v` (its pool's counters at `counts`, of
/// `records` records and `rows` rows) read back, combined across the groups (`replicate`) on the
/// host, its collectives staged through `mem`, and the sums uploaded to `out`, in the
/// communication stream's order. `host` keeps the sums' host copy between calls.
template <class G, class Space, class Comm>
void combine_across_groups(const Space& space, Comm& replicate, const reproducible::compact_view& v,
                           const std::uint32_t* counts, std::size_t records, std::size_t rows,
                           const ringzero::options& opt, buffer<std::int64_t>& mem,
                           std::vector<G>& host, G* out) {
  const auto st = space.comm_stream();
  auto acc = download_accumulator<G>(space, st, v, counts, records, rows);
  host.resize(v.n);
  ringzero::detail::combine_accumulators(replicate, acc, std::span<G>(host), 1, opt,
                                         staged<Space>(space, mem));
  space.upload(st, out, host.data(), v.n);
}

}  // namespace ringzero::zero::detail
