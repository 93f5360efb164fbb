// What every transport's split() shares: the communicator ids a process has in use, the
// collective agreement on a new communicator's members and id, and node placement of a member
// list. The id goes into the tag bits above tag_bits, so messages of communicators that share
// an endpoint (or, in loopback, a mailbox) never match each other.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <bitset>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/ring.hpp"
#include "ringzero/error.hpp"
#include "ringzero/transport/concept.hpp"

namespace ringzero::detail {

/// At most 12 bits of communicator id fit above the 52 algorithm tag bits.
inline constexpr std::uint32_t max_comm_ids = 4096;

/// The communicator ids one process (one endpoint) has in use. Id 0 is the world.
class comm_ids {
 public:
  using bitmap = std::array<std::uint8_t, max_comm_ids / 8>;

  /// ids: how many the transport's tag bits allow (a power of two up to max_comm_ids).
  explicit comm_ids(std::uint32_t ids = max_comm_ids) : limit_(std::min(ids, max_comm_ids)) {
    used_.set(0);
  }

  [[nodiscard]] std::uint32_t limit() const noexcept { return limit_; }

  [[nodiscard]] bitmap snapshot() const {
    std::lock_guard lock(mutex_);
    bitmap b{};
    for (std::size_t i = 0; i < max_comm_ids; ++i)
      if (used_.test(i)) b[i / 8] = static_cast<std::uint8_t>(b[i / 8] | (1u << (i % 8)));
    return b;
  }
  void acquire(std::uint32_t id) {
    std::lock_guard lock(mutex_);
    used_.set(id);
  }
  void release(std::uint32_t id) {
    std::lock_guard lock(mutex_);
    used_.reset(id);
  }

 private:
  mutable std::mutex mutex_;
  std::bitset<max_comm_ids> used_;
  std::uint32_t limit_;
};

/// Holds a sub-communicator's id while any copy of the communicator lives.
class comm_id_lease {
 public:
  comm_id_lease(std::shared_ptr<comm_ids> ids, std::uint32_t id) : ids_(std::move(ids)), id_(id) {
    ids_->acquire(id_);
  }
  comm_id_lease(const comm_id_lease&) = delete;
  comm_id_lease& operator=(const comm_id_lease&) = delete;
  ~comm_id_lease() { ids_->release(id_); }

 private:
  std::shared_ptr<comm_ids> ids_;
  std::uint32_t id_;
};

/// The outcome of split() on one rank that is a member of the new communicator.
struct split_plan {
  std::vector<int> members;  ///< parent ranks, in the new communicator's rank order
  int rank = -1;             ///< this rank's place in members
  std::uint32_t id = 0;      ///< communicator id, free on every member's process
};

/// Collective over `parent`, as MPI_Comm_split: ranks with the same color >= 0 form a
/// communicator ordered by (key, parent rank). Returns nullopt on ranks with a negative color.
///
/// The id is the lowest one that no member's process has in use. Groups of different colors
/// may receive the same id: they have no rank in common, so their messages never meet.
template <transport T>
[[nodiscard]] std::optional<split_plan> plan_split(T& parent, int color, int key,
                                                   const comm_ids& ids) {
  struct record {
    std::int32_t color;
    std::int32_t key;
    comm_ids::bitmap used;
  };
  const int n = parent.size();
  const int me = parent.rank();
  std::vector<record> all(static_cast<std::size_t>(n));
  record mine{static_cast<std::int32_t>(color), static_cast<std::int32_t>(key), ids.snapshot()};
  if (n == 1) {
    all[0] = mine;
  } else {
    std::vector<std::uint8_t> in(sizeof(record));
    std::vector<std::uint8_t> out(sizeof(record) * static_cast<std::size_t>(n));
    std::memcpy(in.data(), &mine, sizeof mine);
    algorithms::ring::all_gather(parent, std::span<const std::uint8_t>(in),
                                 std::span<std::uint8_t>(out), options{});
    std::memcpy(all.data(), out.data(), out.size());
  }
  if (color < 0) return std::nullopt;

  split_plan plan;
  for (int r = 0; r < n; ++r)
    if (all[static_cast<std::size_t>(r)].color == color) plan.members.push_back(r);
  std::stable_sort(plan.members.begin(), plan.members.end(), [&](int a, int b) {
    return all[static_cast<std::size_t>(a)].key < all[static_cast<std::size_t>(b)].key;
  });
  plan.rank = static_cast<int>(std::find(plan.members.begin(), plan.members.end(), me) -
                               plan.members.begin());

  comm_ids::bitmap used{};
  for (int r : plan.members)
    for (std::size_t i = 0; i < used.size(); ++i)
      used[i] = static_cast<std::uint8_t>(used[i] | all[static_cast<std::size_t>(r)].used[i]);
  for (std::uint32_t id = 1; id < ids.limit(); ++id)
    if (!(used[id / 8] & (1u << (id % 8)))) {
      plan.id = id;
      return plan;
    }
  throw unsupported(fmt::format(
      "split: all {} communicator ids of this transport are in use on the {} ranks of color {}; "
      "destroy unused sub-communicators first",
      ids.limit() - 1, plan.members.size(), color));
}

/// Placement of member `rank` given each member's host (any value equal for members on one
/// host). Nodes are numbered by the lowest member on them, so every rank computes the same ids.
template <class Host>
[[nodiscard]] topology place(std::span<const Host> host_of_member, int rank) {
  topology t;
  std::vector<Host> hosts;
  for (const Host& h : host_of_member)
    if (std::find(hosts.begin(), hosts.end(), h) == hosts.end()) hosts.push_back(h);
  const Host& mine = host_of_member[static_cast<std::size_t>(rank)];
  t.node = static_cast<int>(std::find(hosts.begin(), hosts.end(), mine) - hosts.begin());
  t.node_count = static_cast<int>(hosts.size());
  t.local_size = 0;
  for (std::size_t r = 0; r < host_of_member.size(); ++r) {
    if (host_of_member[r] != mine) continue;
    if (static_cast<int>(r) == rank) t.local_rank = t.local_size;
    ++t.local_size;
  }
  return t;
}

}  // namespace ringzero::detail
