// ADAPTER, until the library-owned communicator<Transport> exists: what today's collectives
// ask of a communicator (cost(), timeout(), state(), topo(), split()), over the thin
// ringzero::shm::transport, in the pattern of libfabric::communicator. It holds no messaging
// logic of its own: tags get the communicator id above the algorithm's 52 bits and ranks are
// mapped to the transport's; everything else is the transport's.
#pragma once

#include <fmt/core.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "ringzero/bootstrap/environment.hpp"
#include "ringzero/bootstrap/rendezvous.hpp"
#include "ringzero/bootstrap/store.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/split.hpp"
#include "ringzero/transport/shm.hpp"

namespace ringzero::shm {

/// Memory of n elements of T per rank that every rank of the node addresses.
template <class T>
class symmetric_buffer {
 public:
  symmetric_buffer() = default;
  symmetric_buffer(symmetric_memory m, std::size_t n) : mem_(std::move(m)), n_(n) {}

  /// This rank's elements.
  [[nodiscard]] std::span<T> local() const noexcept { return peer(mem_.rank()); }
  /// Rank r's elements, read and written in place.
  [[nodiscard]] std::span<T> peer(int r) const noexcept {
    return {reinterpret_cast<T*>(mem_.peer(r).data()), n_};
  }
  [[nodiscard]] std::size_t size() const noexcept { return n_; }
  [[nodiscard]] const symmetric_memory& memory() const noexcept { return mem_; }

 private:
  symmetric_memory mem_;
  std::size_t n_ = 0;
};

class communicator {
 public:
  using request = transport::request;

  /// Joins the job the environment describes (ringzero-run, torchrun, Slurm, Open MPI
  /// variables): opens the store, builds the transport, closes the store again.
  [[nodiscard]] static communicator from_env(const options& opt = {}) {
    const bootstrap::launch_info info = bootstrap::detect_launch();
    log::detail::process_rank().store(info.rank);
    const auto timeout = opt.timeout.count() > 0 ? opt.timeout : ringzero::detail::env_timeout();
    const std::unique_ptr<bootstrap::store> store = bootstrap::make_store(info, timeout);
    return communicator(*store, info.rank, info.world_size, opt);
  }

  communicator(bootstrap::store& store, int rank, int size, const options& opt = {})
      : tp_(std::make_shared<transport>(store, rank, size, opt)),
        ids_(std::make_shared<ringzero::detail::comm_ids>(ids_below_internal)),
        rank_(rank),
        timeout_(tp_->timeout()),
        topo_(tp_->topo()) {
    members_.resize(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) members_[static_cast<std::size_t>(r)] = r;
  }

  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  ~communicator() = default;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return static_cast<int>(members_.size()); }
  [[nodiscard]] cost_params cost() const noexcept { return tp_->tune().cost(); }
  [[nodiscard]] std::chrono::nanoseconds timeout() const noexcept { return timeout_; }
  [[nodiscard]] ringzero::detail::comm_state& state() noexcept { return state_; }
  [[nodiscard]] topology topo() const noexcept { return topo_; }
  [[nodiscard]] std::uint32_t comm_id() const noexcept { return comm_id_; }
  [[nodiscard]] transport& base() noexcept { return *tp_; }

  [[nodiscard]] request isend(int peer, tag_t tag, std::span<const std::byte> data) {
    check_peer(peer, "isend");
    return tp_->isend(world_of(peer), full_tag(tag), data);
  }
  [[nodiscard]] request irecv(int peer, tag_t tag, std::span<std::byte> data) {
    check_peer(peer, "irecv");
    return tp_->irecv(world_of(peer), full_tag(tag), data);
  }
  [[nodiscard]] bool test(request& r) {
    try {
      return tp_->test(r);
    } catch (const peer_error& e) {
      if (comm_id_ == 0) throw;
      const int local = local_of(e.peer());
      throw peer_error(fmt::format("{} (rank {} of this communicator)", e.what(), local), local);
    }
  }
  void progress() { tp_->progress(); }

  /// Collective over this communicator, which must span the whole transport: n elements of T
  /// per rank, addressed by every rank.
  template <class T>
  [[nodiscard]] symmetric_buffer<T> allocate(std::size_t n) {
    if (size() != tp_->size())
      throw unsupported(
          "shm: symmetric memory is allocated over the whole transport, not a "
          "sub-communicator");
    return {tp_->allocate(n * sizeof(T)), n};
  }

  /// As MPI_Comm_split: ranks passing the same color >= 0 form a communicator ordered by
  /// (key, rank here); a negative color returns nullopt. Shares this one's transport.
  [[nodiscard]] std::optional<communicator> split(int color, int key) {
    auto plan = ringzero::detail::plan_split(*this, color, key, *ids_);
    if (!plan) return std::nullopt;
    communicator sub;
    sub.tp_ = tp_;
    sub.ids_ = ids_;
    sub.members_.reserve(plan->members.size());
    for (int p : plan->members) sub.members_.push_back(members_[static_cast<std::size_t>(p)]);
    sub.rank_ = plan->rank;
    sub.comm_id_ = plan->id;
    sub.lease_ = std::make_shared<ringzero::detail::comm_id_lease>(ids_, plan->id);
    sub.timeout_ = timeout_;
    sub.topo_ = {0, sub.rank_, sub.size(), 1};
    return std::optional<communicator>(std::move(sub));
  }

 private:
  /// Ids whose tag bits stay below the transport's internal ones.
  static constexpr std::uint32_t ids_below_internal = ringzero::detail::max_comm_ids / 2;

  communicator() = default;

  [[nodiscard]] int world_of(int peer) const noexcept {
    return members_[static_cast<std::size_t>(peer)];
  }
  [[nodiscard]] int local_of(int world) const noexcept {
    for (std::size_t i = 0; i < members_.size(); ++i)
      if (members_[i] == world) return static_cast<int>(i);
    return -1;
  }
  [[nodiscard]] std::uint64_t full_tag(tag_t tag) const noexcept {
    return (static_cast<std::uint64_t>(comm_id_) << tag_bits) | tag;
  }
  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= size() || peer == rank_)
      throw invalid_argument(fmt::format(
          "{}: peer {} is not another rank of this {}-rank communicator (this is rank {})", what,
          peer, size(), rank_));
  }

  // The hierarchy cache in state_ (sub-communicators sharing tp_) is destroyed first.
  std::shared_ptr<transport> tp_;
  std::shared_ptr<ringzero::detail::comm_ids> ids_;
  std::vector<int> members_;
  int rank_ = 0;
  std::uint32_t comm_id_ = 0;
  std::shared_ptr<ringzero::detail::comm_id_lease> lease_;
  std::chrono::nanoseconds timeout_{0};
  topology topo_{};
  ringzero::detail::comm_state state_;
};

}  // namespace ringzero::shm
