// ringzero::communicator<Transport>: everything collective about a group of ranks, written once
// for every transport. A transport moves bytes between its ranks (transport/concept.hpp); the
// communicator adds what collectives need on top:
//   - its own rank numbering over a subset of the transport's ranks (the world, or a split());
//   - a communicator id in the top tag bits, so communicators sharing a transport never match
//     each other's messages (tag_layout);
//   - sequence numbers and scratch space (detail::comm_state), the deadline, the tuning policy;
//   - node topology from the transport's host_of(), and the cached sub-communicators the
//     hierarchical algorithm uses.
//
//   auto comm = ringzero::libfabric::communicator::from_env();   // =
//   communicator<libfabric::transport> ringzero::all_reduce(comm, std::span<float>(grads),
//   ringzero::op::sum);
//
// A communicator is used by one thread at a time; communicators split from one another share
// the transport and may be used from different threads when the transport allows it.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <bitset>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/detail/exchange_records.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/op.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/native.hpp"
#include "ringzero/tuning/tuning_file.hpp"

namespace ringzero {

namespace detail {

/// The communicator ids one transport instance has in use. Id 0 is the world.
class comm_ids {
 public:
  using bitmap = std::array<std::uint8_t, tag_layout::max_comm_ids / 8>;

  /// ids: how many the transport's tag bits allow (a power of two up to tag_layout's).
  explicit comm_ids(std::uint32_t ids = tag_layout::max_comm_ids)
      : limit_(std::min(ids, tag_layout::max_comm_ids)) {
    used_.set(0);
  }

  [[nodiscard]] std::uint32_t limit() const noexcept { return limit_; }

  [[nodiscard]] bitmap snapshot() const {
    std::lock_guard lock(mutex_);
    bitmap b{};
    for (std::size_t i = 0; i < tag_layout::max_comm_ids; ++i)
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
  std::bitset<tag_layout::max_comm_ids> used_;
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
  std::uint32_t id = 0;      ///< communicator id, free on every member's transport
};

/// Collective over `parent`, as MPI_Comm_split: ranks with the same color >= 0 form a
/// communicator ordered by (key, parent rank). Returns nullopt on ranks with a negative color.
///
/// The id is the lowest one that no member's transport has in use. Groups of different colors
/// may receive the same id: they have no rank in common, so their messages never meet.
template <collective_comm C>
[[nodiscard]] std::optional<split_plan> plan_split(C& parent, int color, int key,
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
  all[static_cast<std::size_t>(me)] = mine;
  {
    // Every rank sends its record to every other: a split is rare and its records small, so
    // the n-1 messages each way cost less than depending on an algorithm from here.
    exchange<C> ex(parent, "split", "direct");
    std::vector<typename exchange<C>::pending> ps;
    for (int r = 0; r < n; ++r) {
      if (r == me) continue;
      ps.push_back(ex.recv(
          r, 0, 0, std::as_writable_bytes(std::span(&all[static_cast<std::size_t>(r)], 1))));
      ps.push_back(ex.send(r, 0, 0, std::as_bytes(std::span(&mine, 1))));
    }
    ex.wait_all(ps);
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

/// The transport's request type, or a placeholder for a transport without messaging.
template <class T, bool = messaging<T>>
struct request_of {
  struct none {};
  using type = none;
};
template <class T>
struct request_of<T, true> {
  using type = typename T::request;
};

}  // namespace detail

template <transport T>
class communicator;

namespace detail {

/// The communicator type of a node level over the transport that T advertises for the ranks of
/// one host (T::node_transport: libfabric's is shm); `none` where T advertises none.
template <class C>
struct node_level {
  struct none {};
  using type = none;
};
template <class T>
requires requires {
  typename T::node_transport;
}
struct node_level<communicator<T>> {
  using type = communicator<typename T::node_transport>;
};

/// What a node transport's join() asks of the communicator of the node's ranks
/// (shm::transport::join): rank 0's bytes shared with every rank, and whether every rank said
/// yes, in that communicator's own messages within its deadline.
template <class Comm>
class node_messages {
 public:
  explicit node_messages(Comm& node) : node_(node) {}

  [[nodiscard]] int rank() const { return node_.rank(); }
  [[nodiscard]] int size() const { return node_.size(); }
  [[nodiscard]] std::chrono::nanoseconds timeout() const { return node_.timeout(); }

  /// Rank 0's `bytes` into every other rank's (all pass the same size).
  void share(std::span<char> bytes) {
    exchange<Comm> ex(node_, "node setup", "direct");
    std::vector<typename exchange<Comm>::pending> ps;
    if (rank() == 0) {
      for (int r = 1; r < size(); ++r)
        ps.push_back(ex.send(r, 0, 0, std::as_bytes(std::span<const char>(bytes))));
    } else {
      ps.push_back(ex.recv(0, 0, 0, std::as_writable_bytes(bytes)));
    }
    ex.wait_all(ps);
  }

  /// True on every rank when every rank passed true: rank 0 gathers the answers and tells all.
  [[nodiscard]] bool every(bool mine) {
    const std::vector<std::uint8_t> all =
        exchange_records(node_, static_cast<std::uint8_t>(mine ? 1 : 0), "node setup");
    return std::all_of(all.begin(), all.end(), [](std::uint8_t a) { return a != 0; });
  }

 private:
  Comm& node_;
};

}  // namespace detail

/// The sub-communicators one communicator's hierarchical collectives use, split once and kept.
template <class Comm>
struct node_communicators {
  Comm local;    ///< the ranks of this node, in parent rank order
  Comm cross;    ///< the ranks with this local rank, one per node, in node order
  bool uniform;  ///< every node holds the same number of ranks
  /// With uniform nodes, the rank in the parent of local rank l on node c (cross rank c) at
  /// c * local.size() + l; empty otherwise (hierarchical all_to_all needs it).
  std::vector<int> parent_rank;
  /// The ranks of `local` again, in its order, over the transport the parent's transport
  /// advertises for one host (node_transport), when every rank of the node could join it;
  /// null otherwise. The node level of the hierarchical algorithm runs on it.
  std::unique_ptr<typename detail::node_level<Comm>::type> node{};
};

namespace detail {

/// A transport without messaging that makes a communicator of some of its ranks itself (NCCL:
/// ncclCommSplit); over messaging, communicator::split() does it for every transport.
template <class T>
concept splits_itself = !messaging<T> && requires(T & t, int color, int key) {
  { t.split(color, key) } -> std::same_as<std::optional<T>>;
};

}  // namespace detail

template <transport T>
class communicator {
 public:
  using transport_type = T;

  /// The world: every rank of `t`, in its order.
  explicit communicator(T t, std::chrono::nanoseconds timeout = std::chrono::nanoseconds{0})
      : transport_(std::make_shared<T>(std::move(t))),
        rank_(transport_->rank()),
        tuning_(transport_->tuning()) {
    members_.resize(static_cast<std::size_t>(transport_->size()));
    std::iota(members_.begin(), members_.end(), 0);
    timeout_ = resolve_timeout(timeout);
    // Read here, where an error can be raised: the waits themselves must not throw.
    static_cast<void>(detail::env_wait_mode());
    if constexpr (messaging<T>) ids_ = std::make_shared<detail::comm_ids>(id_limit());
    topo_ = place();
    apply_tuning_file();
    // A price the model cannot compare (a zero beta, a NaN) would make ranks pick differently.
    tuning::check(tuning_, "communicator");
  }

  /// Opens the transport from the job's environment (torchrun, Slurm, Open MPI or ringzero-run
  /// variables) and returns the world communicator over it.
  template <class U = T>
  requires requires { typename U::from_env_options; }
  [[nodiscard]] static communicator from_env(const typename U::from_env_options& opt = {}) {
    return communicator(U::from_env(opt));
  }

  /// A world of one rank in this process, where the transport offers one (NCCL: one GPU).
  template <class U = T>
  requires requires { U::single(); }
  [[nodiscard]] static communicator single() { return communicator(U::single()); }

  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  ~communicator() = default;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return static_cast<int>(members_.size()); }
  /// The tuning policy the cost model and the algorithms' flow control use.
  [[nodiscard]] const tuning::policy& tuning() const noexcept { return tuning_; }
  /// tuning()'s name until 0.3.
  [[deprecated("0.3 renamed it tuning(); cost() goes in 0.5")]] [[nodiscard]] const tuning::policy&
  cost() const noexcept {
    return tuning_;
  }
  /// Replaces the tuning policy, as a RINGZERO_TUNING file does when the communicator is made
  /// (`ringzero-perf --tune` tries settings this way). Every rank must pass the same policy
  /// before its next collective: ranks that price differently pick different algorithms. Throws
  /// invalid_argument, and keeps the old policy, when `p` cannot price anything (tuning::check).
  void set_tuning(const tuning::policy& p) {
    tuning::check(p, "communicator::set_tuning");
    tuning_ = p;
  }
  /// The deadline of every blocking call that does not set options::timeout.
  [[nodiscard]] std::chrono::nanoseconds timeout() const noexcept { return timeout_; }
  [[nodiscard]] topology topo() const noexcept { return topo_; }
  [[nodiscard]] detail::comm_state& state() noexcept { return state_; }
  /// The transport, shared with every communicator split from this one.
  [[nodiscard]] T& transport() {
    check_moved("transport()");
    return *transport_;
  }
  [[nodiscard]] const T& transport() const {
    check_moved("transport()");
    return *transport_;
  }
  /// False once moved from: every collective then refuses to run.
  [[nodiscard]] bool valid() const noexcept { return transport_ != nullptr; }
  /// Throws invalid_argument naming `what` when this communicator was moved from, and
  /// peer_error when its transport says it was aborted (so that a call with nothing to send
  /// fails as every other call does).
  void check_usable(std::string_view what) const {
    check_moved(what);
    if constexpr (requires(const T& x) {
                    { x.abort_reason() } -> std::convertible_to<std::optional<std::string>>;
                  }) {
      if (auto why = transport_->abort_reason())
        throw peer_error(fmt::format("{}: this communicator was aborted: {}", what, *why), -1);
    }
  }
  /// Transport ranks of this communicator's ranks (the identity for the world).
  [[nodiscard]] const std::vector<int>& members() const noexcept { return members_; }
  /// -1 once moved from.
  [[nodiscard]] int world_rank() const noexcept {
    return members_.empty() ? -1 : members_[static_cast<std::size_t>(rank_)];
  }
  [[nodiscard]] std::uint32_t comm_id() const noexcept { return comm_id_; }

  /// The algorithm to name for collective `c` where every call of it must add an element's
  /// terms in one order whatever the message size: the sharder's default, so that stages 0-1
  /// (all_reduce) and 2-3 (reduce_scatter) give the same bits. automatic where the transport
  /// runs the call itself, in an order of its own that does not follow the cost model (NCCL;
  /// the native shm transport on its world of more than one rank); else the ring, whose order
  /// depends only on the number of ranks; automatic for a collective the ring does not run.
  [[nodiscard]] algorithm fixed_order_algorithm(collective c) const noexcept {
    bool transport_runs_it = false;
    if constexpr (native_collectives<T>)
      transport_runs_it = true;
    else if constexpr (some_native_collectives<T>)
      transport_runs_it = comm_id_ == 0 && size() > 1;
    // The ring descriptor's collectives (algorithms/ring.hpp), named here so that the
    // communicator does not depend on an algorithm; tests/zero/sharder_test.cpp checks the two
    // lists agree.
    const bool ring_runs_it = c == collective::all_reduce || c == collective::reduce_scatter ||
                              c == collective::all_gather || c == collective::broadcast ||
                              c == collective::reduce;
    return transport_runs_it || !ring_runs_it ? algorithm::automatic : algorithm::ring;
  }

  // Messaging in this communicator's numbering, for the algorithms (detail::exchange).
  using request = typename detail::request_of<T>::type;

  [[nodiscard]] request isend(int peer, tag_t tag,
                              std::span<const std::byte> data) requires messaging<T> {
    check_moved("isend");
    check_peer(peer, "isend");
    return transport_->isend(world_of(peer), tag_layout::with_comm_id(comm_id_, tag), data);
  }
  [[nodiscard]] request irecv(int peer, tag_t tag,
                              std::span<std::byte> data) requires messaging<T> {
    check_moved("irecv");
    check_peer(peer, "irecv");
    return transport_->irecv(world_of(peer), tag_layout::with_comm_id(comm_id_, tag), data);
  }
  [[nodiscard]] bool test(request& r) requires messaging<T> {
    check_moved("test");
    return transport_->test(r);
  }
  void progress() requires messaging<T> {
    check_moved("progress");
    transport_->progress();
  }

  /// Collective over this communicator, as MPI_Comm_split / ncclCommSplit: ranks passing the
  /// same color >= 0 form a communicator ranked by (key, rank here); a negative color returns
  /// nullopt. The new communicator shares this one's transport under a communicator id no
  /// member's transport has in use. Two splits of communicators sharing a transport must not run
  /// at the same time on different threads: both could settle on the same free id.
  [[nodiscard]] std::optional<communicator> split(int color, int key) requires messaging<T> {
    check_usable("split");
    auto plan = detail::plan_split(*this, color, key, *ids_);
    if (!plan) return std::nullopt;
    communicator sub(*this, plan->rank, plan->id);
    sub.members_.clear();
    sub.members_.reserve(plan->members.size());
    for (int p : plan->members) sub.members_.push_back(members_[static_cast<std::size_t>(p)]);
    sub.lease_ = std::make_shared<detail::comm_id_lease>(ids_, plan->id);
    sub.topo_ = sub.place();
    return std::optional<communicator>(std::move(sub));
  }

  /// The same over a transport that makes communicators itself (NCCL: ncclCommSplit): the new
  /// communicator is the world of the transport split() returns, with this one's deadline and
  /// tuning; a negative color takes part and returns nullopt.
  [[nodiscard]] std::optional<communicator> split(int color,
                                                  int key) requires detail::splits_itself<T> {
    check_usable("split");
    std::optional<T> t = transport_->split(color, key);
    if (!t) return std::nullopt;
    communicator sub(std::move(*t), timeout_);
    sub.tuning_ = tuning_;
    return std::optional<communicator>(std::move(sub));
  }

  /// Collective over the world communicator, where the transport offers symmetric memory (shm):
  /// n elements of U per rank in memory every rank addresses, as ncclMemAlloc plus window
  /// registration give. Collectives on such buffers may read the peers' data in place.
  template <class U>
  [[nodiscard]] auto allocate(std::size_t n) requires requires(T& t, std::size_t k) {
    t.template allocate<U>(k);
  }
  {
    check_usable("allocate");
    if (comm_id_ != 0)
      throw unsupported(
          "allocate: symmetric memory spans every rank of the transport; allocate it on the "
          "world communicator, not on one split from it");
    return transport_->template allocate<U>(n);
  }

  /// The rank, numbered as in this communicator, that the transport found dead (libfabric's
  /// watchdog), or -1: none known, or the dead rank is not a member. Timeouts name it.
  [[nodiscard]] int failed_rank() const noexcept requires requires(const T& x) {
    { x.failed_rank() } -> std::convertible_to<int>;
  }
  {
    if (!transport_) return -1;
    const int dead = transport_->failed_rank();
    if (dead < 0) return -1;
    const auto it = std::find(members_.begin(), members_.end(), dead);
    return it == members_.end() ? -1 : static_cast<int>(it - members_.begin());
  }

  /// The first rank, numbered as in this communicator, that the transport finds stopped
  /// (libfabric's watchdog: SIGSTOP or a debugger, on this host), or -1. A timeout names it:
  /// the rank a wait was blocked on is often only waiting for it in turn.
  [[nodiscard]] int stopped_rank() const requires requires(const T& x) {
    { x.stopped_ranks() } -> std::convertible_to<std::vector<int>>;
  }
  {
    if (!transport_) return -1;
    const std::vector<int> stopped = transport_->stopped_ranks();
    for (std::size_t i = 0; i < members_.size(); ++i)
      if (std::find(stopped.begin(), stopped.end(), members_[i]) != stopped.end())
        return static_cast<int>(i);
    return -1;
  }

  /// Fails every wait on this communicator, and on every communicator sharing its transport
  /// (the world, those split from it), with peer_error carrying `why`: now, including waits
  /// blocked in another thread, and every call after. Thread-safe: for a thread that must stop a
  /// collective another thread is blocked in (a failure found elsewhere, a signal's flag). The
  /// node level of this communicator's hierarchical collectives (its own shm transport, where
  /// it has one) is aborted too, once built: call abort() after the first hierarchical
  /// collective has returned, not while it may still be setting that level up.
  void abort(const std::string& why = "abort() was called") requires requires(T& x) {
    x.abort(std::string());
  }
  {
    check_moved("abort()");
    transport_->abort(why);
    if constexpr (requires { hierarchy_->node->abort(why); })
      if (hierarchy_ && hierarchy_->node) hierarchy_->node->abort(why);
  }

  /// abort(), as a function that holds the transport weakly: for a watcher on another thread
  /// (elastic::session's heartbeat) that may outlive this communicator, after which calling it
  /// does nothing. It aborts the transport, and so every communicator sharing it; not the node
  /// level of hierarchical collectives, which abort() reaches too.
  [[nodiscard]] std::function<void(const std::string&)> abort_handle() const requires
      requires(T& x) {
    x.abort(std::string());
  }
  {
    check_moved("abort_handle()");
    return [t = std::weak_ptr<T>(transport_)](const std::string& why) {
      if (const auto p = t.lock()) p->abort(why);
    };
  }

  /// The levels the hierarchical collectives run on: this node's ranks (split by node), one rank
  /// per node (split by local rank) and, where the transport advertises one for the ranks of a
  /// host (`node_transport`: shm under libfabric and sockets), this node's ranks again over it,
  /// unless RINGZERO_NODE_SHM=0. Built on first use and kept, as split()'s results are the
  /// caller's: the first call is collective over this communicator (every rank calls it at the
  /// same point; the hierarchical algorithm does so in its first collective).
  node_communicators<communicator>& nodes() requires messaging<T> {
    check_usable("nodes");
    if (!hierarchy_) hierarchy_ = std::make_unique<node_communicators<communicator>>(build_nodes());
    return *hierarchy_;
  }

  /// The levels nodes() built, or null before its first call.
  [[nodiscard]] node_communicators<communicator>* hierarchy() noexcept { return hierarchy_.get(); }
  /// Installs levels built elsewhere, as 0.2's hierarchical algorithm did.
  [[deprecated(
      "0.3 builds the levels in nodes(); set_hierarchy() goes in 0.5")]] node_communicators<communicator>&
  set_hierarchy(node_communicators<communicator> h) {
    hierarchy_ = std::make_unique<node_communicators<communicator>>(std::move(h));
    return *hierarchy_;
  }

 private:
  // nodes()'s first call. Its exchanges are the communicator's own (detail::exchange_records),
  // not collectives: those sit above it, and RINGZERO_ALGO=hier must not recurse into nodes().
  node_communicators<communicator> build_nodes() {
    const topology t = topo_;
    // Agreeing on uniformity needs every rank's node size.
    const std::vector<int> sizes = detail::exchange_records(*this, t.local_size, "hierarchy");
    auto local = split(t.node, rank());
    auto cross = split(t.local_rank, t.node);
    const bool uniform =
        std::all_of(sizes.begin(), sizes.end(), [&](int s) { return s == t.local_size; });
    const auto n = static_cast<std::size_t>(size());
    const std::vector<std::array<int, 2>> where = detail::exchange_records(
        *this, std::array<int, 2>{cross->rank(), local->rank()}, "hierarchy");
    std::vector<int> parent_rank;
    if (uniform) {
      parent_rank.resize(n);
      for (std::size_t g = 0; g < n; ++g)
        parent_rank[static_cast<std::size_t>(where[g][0] * local->size() + where[g][1])] =
            static_cast<int>(g);
    }
    node_communicators<communicator> h{std::move(*local), std::move(*cross), uniform,
                                       std::move(parent_rank)};
    if constexpr (requires { typename T::node_transport; }) {
      using node_transport = typename T::node_transport;
      // Collective over the node even where the knob differs across its ranks: they agree inside
      // join(), which falls back on all of them alike.
      if (h.local.size() > 1) {
        const auto knob = detail::getenv_int("RINGZERO_NODE_SHM");
        detail::node_messages<communicator> over(h.local);
        if (auto nt = node_transport::join(over, !knob || *knob != 0))
          h.node = std::make_unique<communicator<node_transport>>(std::move(*nt), timeout_);
      }
    }
    const auto name = [&]() -> std::string {
      if constexpr (requires { transport_->provider(); })
        return fmt::format("libfabric ({})", transport_->provider());
      else
        return "its transport";
    };
    log::info(
        "hierarchical: rank {} of {}, node {} of {}: inside the node ({} rank{}) over {}, across "
        "nodes over {}",
        rank(), size(), t.node, t.node_count, h.local.size(), h.local.size() == 1 ? "" : "s",
        h.node ? "shm" : name(), name());
    return h;
  }

  // A sub-communicator: same transport and policy, members filled in by split().
  communicator(const communicator& parent, int rank, std::uint32_t id)
      : transport_(parent.transport_),
        ids_(parent.ids_),
        rank_(rank),
        comm_id_(id),
        tuning_(parent.tuning_),
        timeout_(parent.timeout_) {}

  [[nodiscard]] std::chrono::nanoseconds resolve_timeout(std::chrono::nanoseconds t) const {
    detail::check_timeout("communicator: the timeout", t);
    if (t.count() > 0) return t;
    if constexpr (requires(const T& x) { x.default_timeout(); }) {
      const std::chrono::nanoseconds d = transport_->default_timeout();
      detail::check_timeout("communicator: the transport's timeout", d);
      if (d.count() > 0) return d;
    }
    return detail::env_timeout();
  }

  // RINGZERO_TUNING (tuning/tuning_file.hpp): the measured constants of this transport's
  // section, agreed on by every rank before any collective prices an algorithm with them.
  void apply_tuning_file() {
    if constexpr (messaging<T> && requires(const T& x) {
                    { x.tuning_name() } -> std::convertible_to<std::string>;
                  }) {
      const auto path = detail::getenv_str("RINGZERO_TUNING");
      if (!path) return;
      const std::string section = transport_->tuning_name();
      tuning_ =
          tuning::agree_tuning(*this, *path, section, tuning::load_tuning(*path, section, tuning_));
    }
  }

  [[nodiscard]] std::uint32_t id_limit() const {
    if constexpr (requires(const T& x) { x.comm_id_bits(); })
      return std::uint32_t{1} << std::clamp(transport_->comm_id_bits(), 0,
                                            tag_layout::comm_id_bits);
    return tag_layout::max_comm_ids;
  }

  [[nodiscard]] topology place() const {
    if constexpr (has_hosts<T>) {
      using host = std::remove_cvref_t<decltype(transport_->host_of(0))>;
      std::vector<host> host_of(members_.size());
      for (std::size_t i = 0; i < members_.size(); ++i)
        host_of[i] = transport_->host_of(members_[i]);
      return detail::place(std::span<const host>(host_of), rank_);
    } else {
      return topology{0, rank_, size(), 1};
    }
  }

  void check_moved(std::string_view what) const {
    if (!transport_)
      throw invalid_argument(fmt::format("{}: this communicator was moved from", what));
  }

  [[nodiscard]] int world_of(int peer) const noexcept {
    return members_[static_cast<std::size_t>(peer)];
  }
  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= size() || peer == rank_)
      throw invalid_argument(
          fmt::format("{}: peer {} is not another rank of this {}-rank "
                      "communicator (this is rank {})",
                      what, peer, size(), rank_));
  }

  // Destroyed last to first: the hierarchy (sub-communicators sharing the transport) goes before
  // the lease and the transport.
  std::shared_ptr<T> transport_;
  std::shared_ptr<detail::comm_ids> ids_;
  std::shared_ptr<detail::comm_id_lease> lease_;
  std::vector<int> members_;
  int rank_ = 0;
  std::uint32_t comm_id_ = 0;
  tuning::policy tuning_{};
  std::chrono::nanoseconds timeout_{0};
  topology topo_{};
  detail::comm_state state_;
  std::unique_ptr<node_communicators<communicator>> hierarchy_;
};

/// Whether a communicator knows which node each rank runs on (the hierarchical algorithm and
/// split by node need it): true for communicators over transports with host_of().
template <class C>
inline constexpr bool knows_nodes = false;
template <transport T>
inline constexpr bool knows_nodes<communicator<T>> = has_hosts<T>;

}  // namespace ringzero
