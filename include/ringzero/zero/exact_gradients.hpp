// Reproducible training's gradients (config::reproducible): exact sums kept by the ranks that own
// them, sharded as the gradients are.
//
// Each rank keeps an exact accumulator (reduce/reproducible_compact.hpp: one int64 word per
// element, spilled rows for the rare block whose terms span more than 62 bits) for its slice of
// every bucket only: Ψ/N words. A micro-batch's gradients are collected in a bucket buffer as
// plain G values (the terms) and, once the bucket is complete, exchanged pairwise in place: in
// round k rank r sends its block for rank r+k and receives rank r-k's block for it into the block
// it sent the round before, then adds it. Every term reaches its owner as it is -- G's own bytes
// are the most compact exact form, and no window has to be agreed first -- so a micro-batch moves
// (N-1)/N of the bucket in G per rank, what a plain reduce_scatter moves, and the bucket buffer
// is the only memory in flight. The owner adds the N blocks exactly, in whatever order.
//
// On the last micro-batch each slice is rounded once, into the bucket buffer's own block and from
// there (stages 2-3) over the slice's own words: the step's gradient shard lies where its
// accumulator was, so reproducible mode holds no G shard besides the words. Stages 0-1 round into
// the flat gradients and all_gather them in the group. With hybrid sharding the owners of a slice
// in the other groups combine their accumulators first (detail/reproducible_combine.hpp: windows
// agreed by max, grid digits all_reduced), then round. The result is every micro-batch's every
// term, summed exactly and rounded once: the same bits at every world size, grouping and stage.
//
// A parameter several layers use (uses > 1) may arrive several times a micro-batch; each arrival
// is a term of its own (summed in G it would be rounded), so a bucket holding one has that many
// layers: the bucket buffer and uses - 1 buffers of its size, every layer exchanged every
// micro-batch (every rank must make the same exchanges).
//
// On a device space the same runs in stream order: words, heads and spill pool lie in device
// memory, the exchange is enqueued on the communication stream and the adds are kernels
// (detail/exact_device.hpp), and the exact norm's squares are binned there too, so no gradient
// comes back to the host: a step reads 4 KiB of bins. The device's spill pool has a fixed size
// within a step; the step reads its use with the bins and grows it, and a step in which it ran
// full fails. With hybrid sharding the accumulators come back to the host once per step for the
// combine across groups.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <span>
#include <vector>

#include "ringzero/collectives.hpp"
#include "ringzero/detail/reproducible_combine.hpp"
#include "ringzero/error.hpp"
#include "ringzero/reduce/reproducible_compact.hpp"
#include "ringzero/trace.hpp"
#include "ringzero/zero/detail/buffer_meter.hpp"
#include "ringzero/zero/detail/exact_device.hpp"
#include "ringzero/zero/detail/exact_sumsq.hpp"
#include "ringzero/zero/detail/staged_collectives.hpp"
#include "ringzero/zero/detail/worker.hpp"
#include "ringzero/zero/device_space.hpp"
#include "ringzero/zero/memory_space.hpp"
#include "ringzero/zero/options.hpp"
#include "ringzero/zero/plan.hpp"

namespace ringzero::zero {

template <class Comm, class G, memory_space Space = host_space>
class exact_gradients {
 public:
  static constexpr bool device = on_device<Space>;
  /// What a bucket's reduction leaves to wait on: a worker ticket, or a point of the
  /// communication stream.
  using done_type =
      std::conditional_t<device, typename device_traits<Space>::event, detail::worker::ticket>;

  /// `flat`: the flat gradients of stages 0-1 (null in stages 2-3). Everything passed must
  /// outlive this. Throws invalid_argument when an element could take more terms in a step than
  /// an accumulator's inf/NaN counts hold.
  exact_gradients(Comm& comm, Comm* replicate, const partition_plan& plan, bool sharded,
                  const config& cfg, detail::worker& work, detail::buffer_meter& meter, G* flat,
                  const Space& space)
      : comm_(comm),
        replicate_(replicate),
        plan_(plan),
        sharded_(sharded),
        all_reduce_(cfg.collectives.all_reduce),
        all_gather_(cfg.collectives.all_gather),
        work_(work),
        meter_(meter),
        flat_(flat),
        space_(space) {
    p2p_.timeout = cfg.collectives.reduce_scatter.timeout;
    const auto& buckets = plan_.buckets();
    int most_uses = 1;
    for (const auto& pi : plan_.params()) most_uses = std::max(most_uses, pi.uses);
    const std::int64_t terms = std::int64_t{comm.size()} * cfg.accumulation_steps * most_uses;
    if (terms >= reproducible::max_compact_terms)
      throw invalid_argument(
          fmt::format("zero: reproducible: an element would take {} terms a step ({} ranks x {} "
                      "micro-batches x {} uses); at most {}",
                      terms, comm.size(), cfg.accumulation_steps, most_uses,
                      reproducible::max_compact_terms - 1));
    // Stages 2-3: the gradient shard lies over the words, so they take its collective allocation.
    words_ = sharded_ ? space_.template allocate<std::int64_t>(plan_.shard_size())
                      : space_.template allocate_local<std::int64_t>(plan_.shard_size());
    layers_.resize(buckets.size());
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      int uses = 1;
      for (int p = buckets[b].first_param; p < buckets[b].first_param + buckets[b].param_count; ++p)
        uses = std::max(uses, plan_.params()[static_cast<std::size_t>(p)].uses);
      for (int l = 1; l < uses; ++l) {
        layers_[b].push_back(space_.template allocate_local<G>(buckets[b].padded));
        meter_.add(layers_[b].back().bytes());
      }
    }
    if constexpr (device) {
      std::size_t blocks = 0;
      for (const auto& bk : buckets) {
        head_at_.push_back(blocks);
        blocks += reproducible::blocks(bk.slice);
      }
      heads_ = space_.template allocate_local<reproducible::compact_head>(
          std::max<std::size_t>(1, blocks));
      counts_ = space_.template allocate_local<std::uint32_t>(3);
      // The norm's bins, then room for the pool's counts: one read a step; and the staging of
      // the norm's words (exact_sumsq::digits), so that no step waits to allocate it.
      norm_ = space_.template allocate_local<std::uint64_t>(detail::device_bins + 2);
      staging_ = space_.template allocate<std::int64_t>(detail::exact_sumsq::digits);
      grow_pool(blocks / 128 + 64);
    } else {
      for (const auto& bk : buckets)
        accs_.emplace_back(std::span<std::int64_t>(words_.data() + bk.shard_offset, bk.slice));
    }
    used_.assign(plan_.params().size(), 0);
    slot_.assign(plan_.params().size(), -1);
    taken_.assign(buckets.size(), 0);
    last_.resize(buckets.size());
  }

  exact_gradients(const exact_gradients&) = delete;
  exact_gradients& operator=(const exact_gradients&) = delete;

  /// Stages 2-3: the step's gradient of segment s, over its slice's words.
  [[nodiscard]] const G* gradient(const segment& s) const noexcept {
    const auto& bk = bucket_of(s.param);
    return shard_values(bk) + (s.shard_offset - bk.shard_offset);
  }

  /// Where parameter id's gradient_slot lies this micro-batch (a layer of its own, taken now),
  /// given `layer0`, its place in the bucket buffer.
  [[nodiscard]] G* slot(int id, G* layer0) {
    auto& k = slot_[static_cast<std::size_t>(id)];
    if (k >= 0) return region(id, k, layer0);
    k = used_[static_cast<std::size_t>(id)]++;
    G* at = region(id, k, layer0);
    // The host's bucket buffers come unzeroed (submit zeroes what no gradient overwrote).
    if constexpr (!device)
      if (k == 0) std::fill_n(at, plan_.params()[static_cast<std::size_t>(id)].numel, G{});
    return at;
  }
  /// The slot slot() gave this micro-batch, or null.
  [[nodiscard]] G* given_slot(int id, G* layer0) {
    const int k = slot_[static_cast<std::size_t>(id)];
    return k < 0 ? nullptr : region(id, k, layer0);
  }
  /// Where a copy of parameter id's gradient goes: a layer of its own, each arrival a term.
  [[nodiscard]] G* copy_target(int id, G* layer0) {
    return region(id, used_[static_cast<std::size_t>(id)]++, layer0);
  }
  /// The next micro-batch takes its layers afresh.
  void start_micro_batch() {
    std::fill(used_.begin(), used_.end(), 0);
    std::fill(slot_.begin(), slot_.end(), -1);
    std::fill(taken_.begin(), taken_.end(), 0);
  }

  /// Bucket b is complete for this micro-batch, its terms in `layer0` (a bucket buffer) and its
  /// other layers: queues their exchange and adds, and on the last micro-batch the rounding.
  /// `layer0` is free again once what this returns is done.
  done_type submit(int b, G* layer0, bool first, bool last) {
    const auto ub = static_cast<std::size_t>(b);
    take_layers(b, static_cast<int>(layers_[ub].size()));  // untaken layers must be zeros
    if constexpr (!device) zero_unwritten(b, layer0);
    if constexpr (device) {
      const auto st = space_.comm_stream();
      space_.wait(st, space_.record(space_.compute_stream()));
      reduce_device(b, layer0, first, last);
      last_[ub] = space_.record(st);
    } else {
      last_[ub] = work_.submit([this, b, layer0, first, last] {
        const auto& bk = plan_.buckets()[static_cast<std::size_t>(b)];
        const trace::scope phase(comm_, "reduce", bk.padded * sizeof(G));
        auto& acc = accs_[static_cast<std::size_t>(b)];
        if (first) {
          // The words may hold last step's gradients (G objects, stages 2-3): words again.
          if (sharded_) start_lifetime<std::int64_t>(words_.data() + bk.shard_offset, bk.slice);
          acc.clear();
        }
        exchange_host(bk, layer0, acc);
        for (auto& layer : layers_[static_cast<std::size_t>(b)])
          exchange_host(bk, layer.data(), acc);
        if (last) finish_host(bk, layer0, acc);
      });
    }
    return last_[ub];
  }

  /// Device spaces: the exact sum of squares of this rank's gradients (its slice of every
  /// bucket: its segments and the padding's zeros) times scale^2, and whether one is inf or NaN,
  /// agreed over this rank's group. The squares are binned on the device (exact_sumsq's bins);
  /// the host reads the bins and the spill pool's use in one copy, grows the pool or fails if it
  /// ran full, and agrees on the sum through staged collectives.
  [[nodiscard]] gradient_stats agree_stats(float scale,
                                           const ringzero::options& o) requires device {
    using ops = detail::exact_ops<Space>;
    const auto st = space_.comm_stream();
    constexpr std::size_t bins = detail::device_bins;
    space_.zero(st, norm_.data(), norm_.size());
    const auto r = static_cast<std::size_t>(comm_.rank());
    for (const auto& bk : plan_.buckets())
      ops::sumsq(space_, st, sharded_ ? shard_values(bk) : flat_ + bk.offset + r * bk.slice,
                 bk.slice, norm_.data());
    ops::copy(space_, st, reinterpret_cast<std::uint32_t*>(norm_.data() + bins), counts_.data(), 3);
    std::vector<std::uint64_t> host(norm_.size());
    space_.download(st, host.data(), norm_.data(), host.size());
    std::uint32_t counts[3] = {};
    std::memcpy(counts, host.data() + bins, sizeof counts);
    if (counts[2] != 0)
      throw unsupported(fmt::format(
          "zero: reproducible: this step's gradients span more than 62 bits in more blocks of 64 "
          "than the device's spill pool holds ({} blocks, {} rows); it grows after each step",
          pool_records_, pool_rows_));
    if (2 * counts[0] > pool_records_ || 2 * counts[1] > pool_rows_)
      grow_pool(2 * std::max<std::size_t>(pool_records_, counts[0]));
    space_.zero(st, counts_.data(), 3);
    detail::exact_sumsq sq;
    sq.add_bins(host.data());
    const auto [sum, bad] = sq.agree(comm_, o, detail::staged<Space>(space_, staging_));
    gradient_stats stats;
    stats.sumsq = sum * static_cast<double>(scale) * static_cast<double>(scale);
    stats.nonfinite = bad;
    return stats;
  }

  /// Bytes of the accumulators: the words (and, in stages 2-3, the gradient shard over them),
  /// the block heads, the spill pool, the device's staging for its host collectives.
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t b = words_.bytes() + staging_.bytes();
    if constexpr (device) {
      b += heads_.bytes() + counts_.bytes() + norm_.bytes() + records_.bytes() + rows_.bytes();
    } else {
      for (const auto& a : accs_) b += a.bytes();
    }
    return b;
  }

 private:
  template <class T>
  static T* start_lifetime(void* p, std::size_t n) noexcept {
    // The bytes are the objects' (memmove creates objects implicitly, as C++23's
    // start_lifetime_as_array says).
    return std::launder(static_cast<T*>(std::memmove(p, p, n * sizeof(T))));
  }

  [[nodiscard]] const bucket_info& bucket_of(int param) const noexcept {
    const int b = plan_.params()[static_cast<std::size_t>(param)].bucket;
    return plan_.buckets()[static_cast<std::size_t>(b)];
  }
  /// Stages 2-3: a slice's rounded gradients, at the start of its words.
  [[nodiscard]] G* shard_values(const bucket_info& bk) const noexcept {
    auto* p = reinterpret_cast<G*>(words_.data() + bk.shard_offset);
    if constexpr (device)
      return p;
    else
      return std::launder(p);
  }

  [[nodiscard]] G* region(int id, int k, G* layer0) {
    if (k == 0) return layer0;
    const auto& pi = plan_.params()[static_cast<std::size_t>(id)];
    const auto& bk = plan_.buckets()[static_cast<std::size_t>(pi.bucket)];
    take_layers(pi.bucket, k);
    return layers_[static_cast<std::size_t>(pi.bucket)][static_cast<std::size_t>(k - 1)].data() +
           (pi.offset - bk.offset);
  }
  /// Zeroes bucket b's extra layers up to the k-th for this micro-batch, once its last exchange
  /// is done with them.
  void take_layers(int b, int k) {
    const auto ub = static_cast<std::size_t>(b);
    for (; taken_[ub] < k; ++taken_[ub]) {
      auto& layer = layers_[ub][static_cast<std::size_t>(taken_[ub])];
      if constexpr (device) {
        space_.wait(space_.compute_stream(), last_[ub]);
        space_.zero(space_.compute_stream(), layer.data(), layer.size());
      } else {
        work_.wait(last_[ub]);
        std::fill_n(layer.data(), layer.size(), G{});
      }
    }
  }

  /// Zeroes the places in a host bucket buffer that no gradient wrote this micro-batch: the
  /// parameters none came for, the alignment gaps and the padding. (Zeroing the whole buffer
  /// for each micro-batch was 5 % of a reproducible run's time, the adds 4 %.)
  void zero_unwritten(int b, G* layer0) {
    const auto& bk = plan_.buckets()[static_cast<std::size_t>(b)];
    std::size_t at = bk.offset;  // flat position up to which the buffer is accounted for
    for (int p = bk.first_param; p < bk.first_param + bk.param_count; ++p) {
      const auto& pi = plan_.params()[static_cast<std::size_t>(p)];
      std::fill(layer0 + (at - bk.offset), layer0 + (pi.offset - bk.offset), G{});
      if (used_[static_cast<std::size_t>(p)] == 0)
        std::fill_n(layer0 + (pi.offset - bk.offset), pi.numel, G{});
      at = pi.offset + pi.numel;
    }
    std::fill(layer0 + (at - bk.offset), layer0 + bk.padded, G{});
  }

  /// The pairwise in-place exchange of a layer (see the header comment), each block added into
  /// the accumulator as it comes.
  void exchange_host(const bucket_info& bk, G* data, reproducible::compact_accumulator<G>& acc) {
    const int n = comm_.size(), r = comm_.rank();
    const std::size_t slice = bk.slice;
    acc.add(std::span<const G>(data + static_cast<std::size_t>(r) * slice, slice));
    auto freed = static_cast<std::size_t>(r);
    for (int k = 1; k < n; ++k) {
      const auto to = static_cast<std::size_t>((r + k) % n);
      const int from = (r - k + n) % n;
      ringzero::send_recv(comm_, std::span<const G>(data + to * slice, slice), static_cast<int>(to),
                          std::span<G>(data + freed * slice, slice), from, p2p_);
      acc.add(std::span<const G>(data + freed * slice, slice));
      freed = to;
    }
  }

  /// The last micro-batch: the slice rounded (after the combine across groups) into its place.
  void finish_host(const bucket_info& bk, G* layer0, reproducible::compact_accumulator<G>& acc) {
    const auto r = static_cast<std::size_t>(comm_.rank());
    // The bucket buffer's own block is free once exchanged; stages 0-1 round in place.
    G* out = sharded_ ? layer0 + r * bk.slice : flat_ + bk.offset + r * bk.slice;
    if (replicate_ != nullptr)
      ringzero::detail::combine_accumulators(*replicate_, acc, std::span<G>(out, bk.slice), 1,
                                             all_reduce_);
    else
      acc.round(0, std::span<G>(out, bk.slice));
    if (sharded_) {
      std::memcpy(words_.data() + bk.shard_offset, out, bk.slice * sizeof(G));
      return;
    }
    ringzero::all_gather(comm_, std::span<const G>(out, bk.slice),
                         std::span<G>(flat_ + bk.offset, bk.padded), all_gather_);
  }

  [[nodiscard]] reproducible::compact_view view(std::size_t b) const noexcept requires device {
    const auto& bk = plan_.buckets()[b];
    reproducible::compact_view v;
    v.words = words_.data() + bk.shard_offset;
    v.heads = heads_.data() + head_at_[b];
    v.n = bk.slice;
    v.pool = {records_.data(), rows_.data(), static_cast<std::uint32_t>(pool_records_),
              static_cast<std::uint32_t>(pool_rows_), counts_.data()};
    return v;
  }

  /// submit() on a device space: the same exchange, adds and rounding, enqueued.
  void reduce_device(int b, G* layer0, bool first, bool last) requires device {
    using ops = detail::exact_ops<Space>;
    const auto ub = static_cast<std::size_t>(b);
    const auto& bk = plan_.buckets()[ub];
    const auto st = space_.comm_stream();
    const reproducible::compact_view v = view(ub);
    const int n = comm_.size(), r = comm_.rank();
    const std::size_t slice = bk.slice;
    if (first) ops::clear(space_, st, v);
    const auto exchange = [&](G* data) {
      ops::add(space_, st, v, data + static_cast<std::size_t>(r) * slice);
      auto freed = static_cast<std::size_t>(r);
      for (int k = 1; k < n; ++k) {
        const auto to = static_cast<std::size_t>((r + k) % n);
        const int from = (r - k + n) % n;
        space_.enqueue(st, [this, data, to, from, freed, slice](auto on) {
          ringzero::send_recv(comm_, std::span<const G>(data + to * slice, slice),
                              static_cast<int>(to), std::span<G>(data + freed * slice, slice), from,
                              on(p2p_));
        });
        ops::add(space_, st, v, data + freed * slice);
        freed = to;
      }
    };
    exchange(layer0);
    for (auto& layer : layers_[ub]) exchange(layer.data());
    if (!last) return;
    G* out = sharded_ ? layer0 + static_cast<std::size_t>(r) * slice
                      : flat_ + bk.offset + static_cast<std::size_t>(r) * slice;
    if (replicate_ != nullptr)
      detail::combine_across_groups(space_, *replicate_, v, counts_.data(), pool_records_,
                                    pool_rows_, all_reduce_, staging_, host_out_, out);
    else
      ops::round(space_, st, v, out);
    if (sharded_) {
      ops::copy(space_, st, reinterpret_cast<G*>(words_.data() + bk.shard_offset), out, slice);
      return;
    }
    space_.enqueue(st, [this, out, &bk](auto on) {
      ringzero::all_gather(comm_, std::span<const G>(out, bk.slice),
                           std::span<G>(flat_ + bk.offset, bk.padded), on(all_gather_));
    });
  }

  /// A spill pool of `records` blocks and three rows per block.
  void grow_pool(std::size_t records) requires device {
    space_.synchronize();  // the old pool may still be read by a stream
    pool_records_ = records;
    pool_rows_ = 3 * records;
    records_ = space_.template allocate_local<reproducible::spill_record>(pool_records_);
    rows_ = space_.template allocate_local<std::int64_t>(pool_rows_ * reproducible::block_elems);
  }

  Comm& comm_;
  Comm* replicate_;
  const partition_plan& plan_;
  bool sharded_;
  ringzero::options all_reduce_;
  ringzero::options all_gather_;
  ringzero::options p2p_;
  detail::worker& work_;
  detail::buffer_meter& meter_;
  G* flat_;
  Space space_;
  buffer<std::int64_t> words_;                  // this rank's slices, bucket after bucket
  std::vector<std::vector<buffer<G>>> layers_;  // each bucket's layers past the bucket buffer
  std::vector<reproducible::compact_accumulator<G>> accs_;  // host: each bucket's slice
  // Device spaces: the heads of every slice's blocks, the spill pool, the staged collectives'
  // memory and the host copies a combine or the norm reads.
  std::vector<std::size_t> head_at_;
  buffer<reproducible::compact_head> heads_;
  buffer<std::uint32_t> counts_;
  buffer<std::uint64_t> norm_;
  buffer<reproducible::spill_record> records_;
  buffer<std::int64_t> rows_;
  std::size_t pool_records_ = 0;
  std::size_t pool_rows_ = 0;
  buffer<std::int64_t> staging_;
  std::vector<G> host_out_;
  std::vector<int> used_;        // layers each parameter filled this micro-batch
  std::vector<int> slot_;        // the layer of each parameter's slot this micro-batch, or -1
  std::vector<int> taken_;       // extra layers of each bucket zeroed for this micro-batch
  std::vector<done_type> last_;  // each bucket's last reduction
};

}  // namespace ringzero::zero
