// The libfabric transport: ranks as processes, on one host or many, over any FI_EP_RDM
// provider with tagged messages (efa on AWS, shm inside a node, tcp;ofi_rxm or verbs;ofi_rxm
// anywhere, sockets as a fallback). Link ringzero::libfabric.
//
//   auto comm = ringzero::libfabric::communicator::from_env();  // torchrun, Slurm, Open MPI,
//   ringzero::all_reduce(comm, std::span<float>(grads), ringzero::op::sum);  // ringzero-run
//
// Provider: options::provider, else FI_PROVIDER, else efa where present, else shm when every
// rank is on one host, else tcp;ofi_rxm. Rank 0 decides and the others follow, so all ranks
// use the same one.
//
// A communicator is used from one thread at a time; it and the communicators split from it
// share one endpoint and may be used from different threads (calls are serialized).
// Progress is manual: messages move while some rank's thread is inside test() or progress(),
// which every blocking collective calls.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ringzero/bootstrap/environment.hpp"
#include "ringzero/bootstrap/rendezvous.hpp"
#include "ringzero/bootstrap/store.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/split.hpp"
#include "ringzero/transport/libfabric/endpoint.hpp"
#include "ringzero/transport/libfabric/provider.hpp"
#include "ringzero/transport/libfabric/rendezvous.hpp"

namespace ringzero::libfabric {

struct options {
  /// A provider name as fi_info prints it ("shm", "tcp;ofi_rxm", "efa"); empty: see above.
  std::string provider{};
  /// 0: RINGZERO_TIMEOUT (default 300 s). Bounds every collective and the rendezvous.
  std::chrono::nanoseconds timeout{0};
  /// Cost-model constants; unset: the provider's (libfabric/provider.hpp). Must be the same on
  /// every rank.
  std::optional<cost_params> cost{};
  /// Register buffers and pass descriptors even where the provider does not ask for them
  /// (FI_MR_LOCAL unset).
  bool register_memory = false;
};

using from_env_options = options;

class communicator {
 public:
  /// Handle to one posted send or receive. Destroying it before completion cancels the
  /// operation and waits for the provider to release the buffer.
  class request {
   public:
    request() = default;
    request(request&& o) noexcept
        : ep_(std::move(o.ep_)), ctx_(std::exchange(o.ctx_, nullptr)), done_(o.done_) {}
    request& operator=(request&& o) noexcept {
      if (this != &o) {
        abandon();
        ep_ = std::move(o.ep_);
        ctx_ = std::exchange(o.ctx_, nullptr);
        done_ = o.done_;
      }
      return *this;
    }
    request(const request&) = delete;
    request& operator=(const request&) = delete;
    ~request() { abandon(); }

   private:
    friend class communicator;
    void abandon() noexcept {
      if (ctx_) ep_->abandon(ctx_);
      ctx_ = nullptr;
    }
    std::shared_ptr<detail::endpoint> ep_;
    detail::op_context* ctx_ = nullptr;
    bool done_ = false;
  };

  /// Joins the job the environment describes (torchrun, Slurm, Open MPI or ringzero-run
  /// variables, see bootstrap/environment.hpp): opens the store (rank 0 serves the TCP store),
  /// picks the provider, opens the endpoint, exchanges addresses, and tags this process's log
  /// lines with its rank. The store is closed again before this returns.
  [[nodiscard]] static communicator from_env(const from_env_options& opt = {}) {
    const bootstrap::launch_info info = bootstrap::detect_launch();
    log::detail::process_rank().store(info.rank);
    const auto timeout = opt.timeout.count() > 0 ? opt.timeout : ringzero::detail::env_timeout();
    const std::unique_ptr<bootstrap::store> store = bootstrap::make_store(info, timeout);
    return communicator(*store, info.rank, info.world_size, opt);
  }

  /// Collective over `size` processes that share `store`: rank r of size. The store is only
  /// used while constructing; it must be the same logical store on every rank.
  communicator(bootstrap::store& store, int rank, int size, const options& opt = {})
      : rank_(rank),
        timeout_(opt.timeout.count() > 0 ? opt.timeout : ringzero::detail::env_timeout()) {
    if (size < 1 || rank < 0 || rank >= size)
      throw invalid_argument(
          fmt::format("libfabric communicator: rank {} is not in [0, {})", rank, size));
    auto world = detail::rendezvous(store, rank, size, opt.provider, opt.register_memory, timeout_);
    ep_ = std::move(world.ep);
    hosts_ = std::move(world.hosts);
    members_.resize(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) members_[static_cast<std::size_t>(r)] = r;
    cost_ = opt.cost ? *opt.cost : detail::provider_cost(ep_->provider());
    topo_ = place();
    log::info("libfabric: rank {} of {} on {} (node {} of {}, local rank {} of {})", rank, size,
              ep_->provider(), topo_.node, topo_.node_count, topo_.local_rank, topo_.local_size);
  }

  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  ~communicator() = default;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return static_cast<int>(members_.size()); }
  [[nodiscard]] cost_params cost() const noexcept { return cost_; }
  [[nodiscard]] std::chrono::nanoseconds timeout() const noexcept { return timeout_; }
  [[nodiscard]] ringzero::detail::comm_state& state() noexcept { return state_; }
  [[nodiscard]] topology topo() const noexcept { return topo_; }
  /// The provider every rank uses, as fi_info names it.
  [[nodiscard]] const std::string& provider() const noexcept { return ep_->provider(); }
  /// World ranks of this communicator's ranks (the identity for the world communicator).
  [[nodiscard]] const std::vector<int>& members() const noexcept { return members_; }
  [[nodiscard]] std::uint32_t comm_id() const noexcept { return comm_id_; }
  /// The shared endpoint, for diagnostics (registrations, provider limits).
  [[nodiscard]] const detail::endpoint& endpoint() const noexcept { return *ep_; }

  /// Drops cached registrations of [p, p+n): call before unmapping memory that collectives
  /// used, when the provider registers memory (FI_MR_LOCAL, or options::register_memory).
  void forget_memory(const void* p, std::size_t n) { ep_->forget_memory(p, n); }

  [[nodiscard]] request isend(int peer, tag_t tag, std::span<const std::byte> data) {
    check_live("isend");
    check_peer(peer, "isend");
    request r;
    r.ep_ = ep_;
    r.ctx_ = ep_->send(world_of(peer), peer, full_tag(tag), data);
    r.done_ = r.ctx_ == nullptr;
    return r;
  }

  [[nodiscard]] request irecv(int peer, tag_t tag, std::span<std::byte> data) {
    check_live("irecv");
    check_peer(peer, "irecv");
    request r;
    r.ep_ = ep_;
    r.ctx_ = ep_->recv(world_of(peer), peer, full_tag(tag), data);
    return r;
  }

  /// Reads completions; true once r finished. Throws peer_error if the peer is gone or the
  /// operation failed, transport_error on a size mismatch or a provider failure.
  [[nodiscard]] bool test(request& r) {
    if (r.done_) return true;
    if (!r.ctx_) throw invalid_argument("test() on an empty request");
    // Once the endpoint reports an outcome, finished or thrown, it has taken the context back.
    auto* c = std::exchange(r.ctx_, nullptr);
    if (!ep_->test(c)) {
      r.ctx_ = c;
      return false;
    }
    r.done_ = true;
    return true;
  }

  void progress() { ep_->progress(); }

  /// The rank (numbered as in this communicator) the watchdog found dead, or -1: none known,
  /// or the dead rank is not a member. Waits on this communicator fail naming it.
  [[nodiscard]] int failed_rank() const noexcept {
    if (!ep_) return -1;
    const int world = ep_->failed_rank();
    if (world < 0) return -1;
    const auto it = std::find(members_.begin(), members_.end(), world);
    return it == members_.end() ? -1 : static_cast<int>(it - members_.begin());
  }

  /// Fails every wait on this communicator, and on every communicator sharing its endpoint
  /// (split ones, the world), with peer_error carrying `why`: now, including waits blocked in
  /// another thread, and every call after. For a thread that must stop a collective another
  /// thread is blocked in (a failure found elsewhere, a signal handler's flag). Thread-safe.
  void abort(const std::string& why = "abort() was called") {
    if (ep_) ep_->abort(why);
  }

  /// Collective over this communicator, as MPI_Comm_split / ncclCommSplit: ranks passing the
  /// same color >= 0 form a communicator ranked by (key, rank here); a negative color returns
  /// nullopt. The new communicator shares this one's endpoint under a communicator id that no
  /// member's process has in use, carried in the tag bits above the algorithm's 52. Two splits
  /// of communicators sharing an endpoint must not run at the same time on different threads:
  /// both could settle on the same free id.
  [[nodiscard]] std::optional<communicator> split(int color, int key) {
    auto plan = ringzero::detail::plan_split(*this, color, key, *ep_->ids());
    if (!plan) return std::nullopt;
    communicator sub;
    sub.ep_ = ep_;
    sub.hosts_ = hosts_;
    sub.members_.reserve(plan->members.size());
    for (int p : plan->members) sub.members_.push_back(members_[static_cast<std::size_t>(p)]);
    sub.rank_ = plan->rank;
    sub.comm_id_ = plan->id;
    sub.lease_ = std::make_shared<ringzero::detail::comm_id_lease>(ep_->ids(), plan->id);
    sub.cost_ = cost_;
    sub.timeout_ = timeout_;
    sub.topo_ = sub.place();
    return std::optional<communicator>(std::move(sub));
  }

 private:
  communicator() = default;

  [[nodiscard]] topology place() const {
    std::vector<std::string> host_of(members_.size());
    for (std::size_t i = 0; i < members_.size(); ++i)
      host_of[i] = hosts_[static_cast<std::size_t>(members_[i])];
    return ringzero::detail::place(std::span<const std::string>(host_of), rank_);
  }
  [[nodiscard]] int world_of(int peer) const noexcept {
    return members_[static_cast<std::size_t>(peer)];
  }
  [[nodiscard]] std::uint64_t full_tag(tag_t tag) const noexcept {
    return (static_cast<std::uint64_t>(comm_id_) << tag_bits) | tag;
  }
  void check_live(const char* what) const {
    if (!ep_)
      throw invalid_argument(fmt::format(
          "{}: this libfabric communicator was moved from; use the one it was moved to", what));
  }
  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= size() || peer == rank_)
      throw invalid_argument(
          fmt::format("{}: peer {} is not another rank of this {}-rank "
                      "communicator (this is rank {})",
                      what, peer, size(), rank_));
  }

  // Members are destroyed last to first: the hierarchy cache in state_, which holds
  // sub-communicators sharing ep_, goes first.
  std::shared_ptr<detail::endpoint> ep_;
  std::vector<std::string> hosts_;  ///< host name of every world rank
  std::vector<int> members_;
  int rank_ = 0;
  std::uint32_t comm_id_ = 0;
  std::shared_ptr<ringzero::detail::comm_id_lease> lease_;
  cost_params cost_{};
  std::chrono::nanoseconds timeout_{0};
  topology topo_{};
  ringzero::detail::comm_state state_;
};

}  // namespace ringzero::libfabric
