// ZeRO++ (arXiv 2306.10209) in the sharder, under DeepSpeed's names (zero::config):
//
//   zero_quantized_weights    (qwZ) stage 3 gathers parameters as int8 blocks (options::wire):
//                             about half a bf16 gather's bytes, a quarter of a float one's;
//   zero_quantized_gradients  (qgZ) every gradient bucket is reduced as int4 blocks through the
//                             two-hop all-to-all over the nodes (detail/quantized_call.hpp), and
//                             added in float: an eighth of a float reduce_scatter's bytes, and only
//                             one encoded partial sum per node crosses between nodes;
//   zero_hpz_partition_size   (hpZ) a secondary copy of the parameters, sharded within groups of
//                             that many consecutive ranks (normally a node): the forward gather
//                             fills it, and backward gathers from it inside the group, never
//                             across nodes.
//
// What stays as it was: the master weights, the optimizer state and the gradient shard are full
// precision, the optimizer arithmetic is unchanged, and checkpoints hold the same files. What a
// rank computes with is different: the gathered weights (qwZ) and the reduced gradients (qgZ) are
// within the bounds of reduce/quantize.hpp of the plain ones, and every rank gets the same bits.
// hpZ changes no value: backward gathers the forward's weights from the group.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/collectives.hpp"
#include "ringzero/error.hpp"
#include "ringzero/wire.hpp"
#include "ringzero/zero/options.hpp"
#include "ringzero/zero/plan.hpp"

namespace ringzero::zero {

/// The wire formats of qwZ and qgZ, as ZeRO++ chose them: weights, which every forward uses as
/// they arrive, in int8; gradients, which are summed over ranks and averaged over steps, in int4.
inline constexpr wire_format quantized_weights_format = wire_format::int8;
inline constexpr wire_format quantized_gradients_format = wire_format::int4;

/// Whether hpZ is on (DeepSpeed's 1, and 0, mean off).
[[nodiscard]] constexpr bool hpz_enabled(const config& cfg) noexcept {
  return cfg.zero_hpz_partition_size > 1;
}

/// Throws unsupported where a ZeRO++ option is set on a device space (its collectives take host
/// buffers), or invalid_argument where hpZ's groups do not divide the shard group.
inline void check_zeropp_placement(const config& cfg, bool device, int shard_group_size) {
  if (device && (cfg.zero_quantized_weights || cfg.zero_quantized_gradients || hpz_enabled(cfg)))
    throw unsupported(
        "zero: zero_quantized_weights, zero_quantized_gradients and zero_hpz_partition_size run "
        "on host memory; this sharder's buffers are device memory");
  if (hpz_enabled(cfg) && shard_group_size % cfg.zero_hpz_partition_size != 0)
    throw invalid_argument(fmt::format(
        "zero: zero_hpz_partition_size {} does not divide the {} ranks the state is sharded over",
        cfg.zero_hpz_partition_size, shard_group_size));
}

/// The options of stage 3's parameter gathers: config::collectives.all_gather, in int8 with qwZ.
[[nodiscard]] inline ringzero::options weight_gather_options(const config& cfg) {
  ringzero::options o = cfg.collectives.all_gather;
  if (cfg.zero_quantized_weights) o.wire = quantized_weights_format;
  return o;
}

/// The config the gradient reducer runs with: with qgZ its reduce_scatter and all_reduce options
/// (the buckets' and, with hybrid sharding, the groups') carry int4. Only the reducer gets it:
/// the step's norm and overflow flag go through the configuration's own all_reduce options.
[[nodiscard]] inline config gradient_config(const config& cfg) {
  config g = cfg;
  if (cfg.zero_quantized_gradients) {
    g.collectives.reduce_scatter.wire = quantized_gradients_format;
    g.collectives.all_reduce.wire = quantized_gradients_format;
  }
  return g;
}

/// hpZ's secondary shard: bucket b's full parameters cut into `size` pieces, this rank keeping
/// piece place() of every bucket, filled from what the forward gather delivered and gathered
/// back inside the group by backward. A piece is fresh from the gather that filled it until the
/// parameters change (the step, set_parameter, load: the parameter cache invalidates it).
/// keep() and gather() run on the communication thread, invalidate() on the trainer's.
template <class Comm, class P>
class secondary_shard {
 public:
  /// Collective over `shard` (it splits it into groups of `size` consecutive ranks). `gather`:
  /// the options of the group's all_gathers (the wire is full: this copy costs no accuracy).
  secondary_shard(Comm& shard, const partition_plan& plan, int size,
                  const ringzero::options& gather)
      : group_(split(shard, size)),
        plan_(plan),
        size_(static_cast<std::size_t>(size)),
        place_(static_cast<std::size_t>(shard.rank() % size)),
        gather_(gather),
        data_(plan.padded_size() / static_cast<std::size_t>(size)),
        fresh_(std::make_unique<std::atomic<bool>[]>(plan.buckets().size())) {
    gather_.wire = wire_format::full;
  }

  /// Bytes of the secondary copy (what hpZ adds to a rank's memory).
  [[nodiscard]] std::size_t bytes() const noexcept { return data_.size() * sizeof(P); }
  [[nodiscard]] int size() const noexcept { return static_cast<int>(size_); }

  /// Keeps this rank's piece of bucket b, whose full parameters `full` the global gather made.
  void keep(int b, std::span<const P> full) {
    const auto& bk = plan_.buckets()[static_cast<std::size_t>(b)];
    const std::size_t piece = bk.padded / size_;
    std::copy_n(full.begin() + static_cast<std::ptrdiff_t>(place_ * piece), piece,
                data_.begin() + static_cast<std::ptrdiff_t>(bk.offset / size_));
    fresh_[static_cast<std::size_t>(b)].store(true, std::memory_order_relaxed);
  }

  /// Bucket b's full parameters gathered from the group into `out`, if its pieces are fresh
  /// (then true; every rank of the shard decides alike, having made the same gathers).
  [[nodiscard]] bool gather(int b, std::span<P> out) {
    if (!fresh_[static_cast<std::size_t>(b)].load(std::memory_order_relaxed)) return false;
    const auto& bk = plan_.buckets()[static_cast<std::size_t>(b)];
    const std::size_t piece = bk.padded / size_;
    ringzero::all_gather(group_, std::span<const P>(data_.data() + bk.offset / size_, piece), out,
                         gather_);
    return true;
  }

  /// The parameters changed: every piece must be gathered globally again.
  void invalidate() noexcept {
    for (std::size_t b = 0; b < plan_.buckets().size(); ++b)
      fresh_[b].store(false, std::memory_order_relaxed);
  }

 private:
  [[nodiscard]] static Comm split(Comm& shard, int size) {
    if constexpr (requires(Comm & c) { c.split(0, 0); }) {
      std::optional<Comm> g = shard.split(shard.rank() / size, shard.rank());
      return std::move(*g);
    } else {
      throw invalid_argument(
          "zero: zero_hpz_partition_size needs a communicator that can split(); this one cannot");
    }
  }

  Comm group_;
  const partition_plan& plan_;
  std::size_t size_;
  std::size_t place_;
  ringzero::options gather_;
  std::vector<P> data_;
  std::unique_ptr<std::atomic<bool>[]> fresh_;
};

}  // namespace ringzero::zero
