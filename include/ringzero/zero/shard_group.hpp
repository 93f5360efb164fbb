// Hybrid sharding (FSDP2's HSDP, ZeRO++'s hpZ): the model state is sharded within a group of G
// consecutive ranks (a node, as ringzero-run numbers ranks) and replicated across the N / G
// groups. The world communicator is split twice: `shard`, the G ranks of this rank's group,
// which every reduce_scatter and all_gather of the sharder uses (so stage-3 gathers never leave
// the node), and `replicate`, the N / G ranks holding the same shard in every group, over which
// each reduced gradient shard is all_reduced (the only traffic between nodes, 1/G of the
// gradients). Without hybrid sharding there is no split and `shard` is the world itself.
//
// shard_group_per_node groups the ranks by node instead, where the communicator knows node
// placement (ringzero::knows_nodes): every node must hold as many ranks, in any order.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <optional>
#include <span>

#include "ringzero/collectives.hpp"
#include "ringzero/communicator.hpp"
#include "ringzero/error.hpp"
#include "ringzero/op.hpp"

namespace ringzero::zero {

/// config::shard_group_size for one group per node.
inline constexpr int shard_group_per_node = -1;

/// The size of the groups config::shard_group_size asks for on `world` ranks: `world` for 0,
/// else `group_size`, which must divide `world` (invalid_argument naming both otherwise).
/// shard_group_per_node is resolved by shard_groups, which knows the nodes.
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
  /// Collective over `world` when the groups are smaller than the world (it splits `world`)
  /// or are one per node (it checks the nodes' sizes); otherwise nothing is split and shard()
  /// is `world`. `world` must outlive this object.
  shard_groups(Comm& world, int group_size) : world_(world) {
    if (group_size == shard_group_per_node) {
      const topology node = node_of(world);
      size_ = node.local_size;
      group_ = node.node;
      place_ = node.local_rank;
    } else {
      size_ = shard_group_size_for(group_size, world.size());
      group_ = world.rank() / size_;
      place_ = world.rank() % size_;
    }
    if (size_ == world.size()) return;
    if constexpr (requires(Comm & c) { c.split(0, 0); }) {
      shard_ = world.split(group_, place_);
      replicate_ = world.split(place_, group_);
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
  [[nodiscard]] int group() const noexcept { return group_; }
  /// This rank's place in its group: its rank in shard().
  [[nodiscard]] int place() const noexcept { return place_; }
  /// The ranks of this group, by their place in it.
  [[nodiscard]] Comm& shard() noexcept { return shard_ ? *shard_ : world_; }
  /// The ranks with this rank's place in every group, ranked by group; null unless hybrid().
  [[nodiscard]] Comm* replicate() noexcept { return replicate_ ? &*replicate_ : nullptr; }

 private:
  /// This rank's node, after checking (collectively, so every rank agrees) that every node
  /// holds as many ranks.
  [[nodiscard]] static topology node_of(Comm& world) {
    if constexpr (ringzero::knows_nodes<Comm>) {
      const topology t = world.topo();
      std::int32_t sizes[2] = {t.local_size, -t.local_size};
      ringzero::all_reduce(world, std::span<std::int32_t>(sizes), op::max);
      if (sizes[0] != -sizes[1])
        throw invalid_argument(fmt::format(
            "zero: shard_group_per_node: the nodes hold between {} and {} ranks; one group per "
            "node needs as many ranks on every node",
            -sizes[1], sizes[0]));
      return t;
    } else {
      (void)world;
      throw invalid_argument(
          "zero: shard_group_per_node needs a communicator that knows node placement");
    }
  }

  Comm& world_;
  int size_ = 0;
  int group_ = 0;
  int place_ = 0;
  std::optional<Comm> shard_;
  std::optional<Comm> replicate_;
};

}  // namespace ringzero::zero
