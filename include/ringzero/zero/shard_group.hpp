// Hybrid sharding (FSDP2's HSDP, ZeRO++'s hpZ): the model state is sharded within a group of G
// consecutive ranks (a node, as ringzero-run numbers ranks) and replicated across the N / G
// groups. The world communicator is split twice: `shard`, the G ranks of this rank's group,
// which every reduce_scatter and all_gather of the sharder uses (so stage-3 gathers never leave
// the node), and `replicate`, the N / G ranks holding the same shard in every group, over which
// each reduced gradient shard is all_reduced (the only traffic between nodes, 1/G of the
// gradients). Without hybrid sharding there is no split and `shard` is the world itself.
#pragma once

#include <fmt/format.h>

#include <optional>

#include "ringzero/error.hpp"

namespace ringzero::zero {

/// The size of the groups config::shard_group_size asks for on `world` ranks: `world` for 0,
/// else `group_size`, which must divide `world` (invalid_argument naming both otherwise).
[[nodiscard]] inline int shard_group_size_for(int group_size, int world) {
  if (group_size == 0) return world;
  if (group_size < 0 || group_size > world || world % group_size != 0)
    throw invalid_argument(fmt::format(
        "zero: shard_group_size {} does not divide the world size {} (expected 0 or a divisor)",
        group_size, world));
  return group_size;
}

/// The communicators of one rank under hybrid sharding, split from `world` once.
template <class Comm>
class shard_groups {
 public:
  /// Collective over `world` when 1 <= group_size < world (it splits `world`); otherwise
  /// nothing is split and shard() is `world`. `world` must outlive this object.
  shard_groups(Comm& world, int group_size)
      : world_(world), size_(shard_group_size_for(group_size, world.size())) {
    if (size_ == world.size()) return;
    if constexpr (requires(Comm & c) { c.split(0, 0); }) {
      const int r = world.rank();
      shard_ = world.split(r / size_, r);
      replicate_ = world.split(r % size_, r);
    } else {
      throw invalid_argument(
          "zero: shard_group_size needs a communicator that can split(); this one cannot");
    }
  }

  shard_groups(const shard_groups&) = delete;
  shard_groups& operator=(const shard_groups&) = delete;

  /// Whether the state is replicated over several groups.
  [[nodiscard]] bool hybrid() const noexcept { return replicate_.has_value(); }
  /// Ranks in a group: what the state is sharded over.
  [[nodiscard]] int size() const noexcept { return size_; }
  /// Groups: how many copies of the sharded state there are.
  [[nodiscard]] int groups() const noexcept { return world_.size() / size_; }
  /// This rank's group (0 for the one group of a run without hybrid sharding).
  [[nodiscard]] int group() const noexcept { return world_.rank() / size_; }
  /// The ranks of this group, ranked as in the world.
  [[nodiscard]] Comm& shard() noexcept { return shard_ ? *shard_ : world_; }
  /// The ranks with this rank's place in every group, ranked by group; null unless hybrid().
  [[nodiscard]] Comm* replicate() noexcept { return replicate_ ? &*replicate_ : nullptr; }

 private:
  Comm& world_;
  int size_;
  std::optional<Comm> shard_;
  std::optional<Comm> replicate_;
};

}  // namespace ringzero::zero
