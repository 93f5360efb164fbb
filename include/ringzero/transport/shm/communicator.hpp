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

#include "ringzero/algorithms/segment.hpp"
#include "ringzero/bootstrap/environment.hpp"
#include "ringzero/bootstrap/rendezvous.hpp"
#include "ringzero/bootstrap/store.hpp"
#include "ringzero/collectives.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/split.hpp"
#include "ringzero/transport/shm.hpp"
#include "ringzero/transport/shm/workspace.hpp"

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

  /// The segment workspace of algorithms/segment.hpp, allocated by the first collective that
  /// uses it (collectively); nullptr on a sub-communicator, whose ranks are not the transport's.
  [[nodiscard]] shm::workspace* workspace() {
    if (comm_id_ != 0) return nullptr;
    if (!ws_) ws_ = std::make_shared<shm::workspace>(*tp_, tp_->tune().workspace_bytes);
    return ws_.get();
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
  std::shared_ptr<shm::workspace> ws_;
  std::shared_ptr<ringzero::detail::comm_ids> ids_;
  std::vector<int> members_;
  int rank_ = 0;
  std::uint32_t comm_id_ = 0;
  std::shared_ptr<ringzero::detail::comm_id_lease> lease_;
  std::chrono::nanoseconds timeout_{0};
  topology topo_{};
  ringzero::detail::comm_state state_;
};

namespace detail {

/// The segment workspace when ringzero picks the algorithm (no options::algorithm, no
/// RINGZERO_ALGO) and the collective of `bytes` fits the segment path; else nullptr.
[[nodiscard]] inline shm::workspace* segment_path(communicator& comm, const ringzero::options& opt,
                                                  std::size_t bytes) {
  if (opt.algorithm != algorithm::automatic || comm.size() == 1 ||
      ringzero::detail::getenv_str("RINGZERO_ALGO") || bytes > comm.base().tune().segment_bytes)
    return nullptr;
  return comm.workspace();
}

[[nodiscard]] inline std::chrono::nanoseconds timeout_of(const communicator& comm,
                                                         const ringzero::options& opt) {
  return opt.timeout.count() > 0 ? opt.timeout : comm.timeout();
}

}  // namespace detail

// The collectives on a shm communicator: where ringzero picks the algorithm, those that fit run
// in the segment (algorithms/segment.hpp); everything else is the generic path. Found by
// qualified calls (ringzero::all_reduce) declared after this header and by argument-dependent
// lookup.

template <element E>
void all_reduce(communicator& comm, std::span<const E> in, std::span<E> out, op o,
                const ringzero::options& opt = {}) {
  if (in.size() == out.size() && !out.empty() &&
      (in.data() == out.data() ||
       !ringzero::detail::overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))) {
    ringzero::detail::check_op(o, "all_reduce");
    transport& tp = comm.base();
    if (opt.algorithm == algorithm::automatic && comm.size() > 1 && comm.comm_id() == 0 &&
        !ringzero::detail::getenv_str("RINGZERO_ALGO") && tp.peer_address(in.data(), 0) &&
        tp.peer_address(out.data(), 0) && tp.peer_address(in.data() + in.size() - 1, 0) &&
        tp.peer_address(out.data() + out.size() - 1, 0)) {
      ringzero::detail::maybe_check<communicator, E>(comm, collective::all_reduce, out.size(), o, 0,
                                                     opt);
      algorithms::segment::all_reduce_symmetric<E>(
          *comm.workspace(),
          [&](int q) { return reinterpret_cast<const E*>(tp.peer_address(in.data(), q)); },
          [&](int q) { return reinterpret_cast<E*>(tp.peer_address(out.data(), q)); }, out.size(),
          o, detail::timeout_of(comm, opt));
      return;
    }
    if (auto* ws = detail::segment_path(comm, opt, out.size_bytes())) {
      ringzero::detail::maybe_check<communicator, E>(comm, collective::all_reduce, out.size(), o, 0,
                                                     opt);
      algorithms::segment::all_reduce<E>(*ws, in, out, o, detail::timeout_of(comm, opt));
      return;
    }
  }
  ringzero::all_reduce<communicator, E>(comm, in, out, o, opt);
}
template <element E>
void all_reduce(communicator& comm, std::span<E> data, op o, const ringzero::options& opt = {}) {
  shm::all_reduce(comm, std::span<const E>(data), data, o, opt);
}
template <element E>
void all_reduce(communicator& comm, std::span<E> in, std::span<E> out, op o,
                const ringzero::options& opt = {}) {
  shm::all_reduce(comm, std::span<const E>(in), out, o, opt);
}

template <element E>
void broadcast(communicator& comm, std::span<const E> in, std::span<E> out, int root,
               const ringzero::options& opt = {}) {
  const bool is_root = comm.rank() == root;
  const bool valid =
      root >= 0 && root < comm.size() && !out.empty() &&
      (!is_root ||
       (in.size() == out.size() &&
        (in.data() == out.data() ||
         !ringzero::detail::overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))));
  if (auto* ws = valid ? detail::segment_path(comm, opt, out.size_bytes()) : nullptr) {
    ringzero::detail::maybe_check<communicator, E>(comm, collective::broadcast, out.size(), op::sum,
                                                   root, opt);
    algorithms::segment::broadcast<E>(*ws, in, out, root, detail::timeout_of(comm, opt));
    return;
  }
  ringzero::broadcast<communicator, E>(comm, in, out, root, opt);
}
template <element E>
void broadcast(communicator& comm, std::span<E> data, int root, const ringzero::options& opt = {}) {
  shm::broadcast(comm, std::span<const E>(data), data, root, opt);
}
template <element E>
void broadcast(communicator& comm, std::span<E> in, std::span<E> out, int root,
               const ringzero::options& opt = {}) {
  shm::broadcast(comm, std::span<const E>(in), out, root, opt);
}

template <element E>
void all_gather(communicator& comm, std::span<const E> in, std::span<E> out,
                const ringzero::options& opt = {}) {
  const auto n = static_cast<std::size_t>(comm.size());
  const E* own = out.data() + in.size() * static_cast<std::size_t>(comm.rank());
  const bool valid =
      out.size() == in.size() * n && !in.empty() &&
      (in.data() == own ||
       !ringzero::detail::overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()));
  if (auto* ws = valid ? detail::segment_path(comm, opt, out.size_bytes()) : nullptr) {
    ringzero::detail::maybe_check<communicator, E>(comm, collective::all_gather, in.size(), op::sum,
                                                   0, opt);
    algorithms::segment::all_gather<E>(*ws, in, out, detail::timeout_of(comm, opt));
    return;
  }
  ringzero::all_gather<communicator, E>(comm, in, out, opt);
}
template <element E>
void all_gather(communicator& comm, std::span<E> in, std::span<E> out,
                const ringzero::options& opt = {}) {
  shm::all_gather(comm, std::span<const E>(in), out, opt);
}

template <element E>
void reduce_scatter(communicator& comm, std::span<const E> in, std::span<E> out, op o,
                    const ringzero::options& opt = {}) {
  const auto n = static_cast<std::size_t>(comm.size());
  const E* own = in.data() + out.size() * static_cast<std::size_t>(comm.rank());
  const bool valid =
      in.size() == out.size() * n && !out.empty() &&
      (out.data() == own ||
       !ringzero::detail::overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()));
  if (auto* ws = valid ? detail::segment_path(comm, opt, in.size_bytes()) : nullptr) {
    ringzero::detail::check_op(o, "reduce_scatter");
    ringzero::detail::maybe_check<communicator, E>(comm, collective::reduce_scatter, out.size(), o,
                                                   0, opt);
    algorithms::segment::reduce_scatter<E>(*ws, in, out, o, detail::timeout_of(comm, opt));
    return;
  }
  ringzero::reduce_scatter<communicator, E>(comm, in, out, o, opt);
}
template <element E>
void reduce_scatter(communicator& comm, std::span<E> in, std::span<E> out, op o,
                    const ringzero::options& opt = {}) {
  shm::reduce_scatter(comm, std::span<const E>(in), out, o, opt);
}

inline void barrier(communicator& comm, const ringzero::options& opt = {}) {
  if (auto* ws = detail::segment_path(comm, opt, 0)) {
    algorithms::segment::barrier(*ws, detail::timeout_of(comm, opt));
    return;
  }
  ringzero::barrier<communicator>(comm, opt);
}

}  // namespace ringzero::shm

namespace ringzero {
using shm::all_gather;
using shm::all_reduce;
using shm::barrier;
using shm::broadcast;
using shm::reduce_scatter;
}  // namespace ringzero
