// The loopback transport: N ranks as N threads of one process, exchanging messages by memcpy
// (ringzero/transport/loopback.hpp gives its communicator and the world of threads).
//
// A send and a receive meet in the receiver's mailbox; whichever arrives second copies the
// bytes, so no progress thread is needed and each message is copied exactly once. The
// transport is messaging only.
#pragma once

#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "ringzero/error.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/abort_state.hpp"
#include "ringzero/tuning/defaults.hpp"

namespace ringzero::loopback {

namespace detail {

/// world_options::cost, `tuning`'s name until 0.3: a policy given to it (which warns) replaces
/// `tuning` when the world is made.
struct cost_option {
  std::optional<ringzero::tuning::policy> given;
  cost_option() = default;
  // Implicit, as `world_options{.cost = p}` took a policy before.
  [[deprecated("0.3 renamed world_options::cost tuning; cost goes in 0.5")]] cost_option(
      const ringzero::tuning::policy& p)
      : given(p) {}
  [[deprecated("0.3 renamed world_options::cost tuning; cost goes in 0.5")]] cost_option& operator=(
      const ringzero::tuning::policy& p) {
    given = p;
    return *this;
  }
};

}  // namespace detail

struct world_options {
  /// 0: RINGZERO_TIMEOUT (default 300 s).
  std::chrono::nanoseconds timeout{0};
  /// Ranks per simulated node, for hierarchical algorithms; 0 = all ranks on one node.
  int ranks_per_node = 0;
  /// The cost model's constants and the algorithms' flow control.
  ringzero::tuning::policy tuning = ringzero::tuning::defaults::loopback.value;
  /// Deprecated (0.3 renamed it `tuning`; it goes in 0.5): a policy set here replaces `tuning`.
  detail::cost_option cost{};
};

namespace detail {

struct message {
  int src = 0;
  std::span<const std::byte> send_data;
  std::span<std::byte> recv_data;
  std::atomic<bool> done{false};
  bool size_mismatch = false;
  std::size_t other_size = 0;
};

using key = std::pair<int, tag_t>;  // (source world rank, full tag)

struct mailbox {
  std::mutex mutex;
  std::map<key, std::vector<std::shared_ptr<message>>> sends;  // unmatched, FIFO per key
  std::map<key, std::vector<std::shared_ptr<message>>> recvs;
};

/// One rank's abort(): shared by the communicators over its transport, read by every wait.
struct shared_state {
  explicit shared_state(int n) : boxes(static_cast<std::size_t>(n)) {}
  std::vector<mailbox> boxes;
  std::atomic<int> failed_rank{-1};
  std::string failure;  // written once, by the thread that set failed_rank
};

inline void complete(message& send, message& recv) {
  if (send.send_data.size() != recv.recv_data.size()) {
    send.size_mismatch = recv.size_mismatch = true;
    send.other_size = recv.recv_data.size();
    recv.other_size = send.send_data.size();
  } else if (!send.send_data.empty()) {
    std::memcpy(recv.recv_data.data(), send.send_data.data(), send.send_data.size());
  }
  send.done.store(true, std::memory_order_release);
  recv.done.store(true, std::memory_order_release);
}

// Removes `m` from the FIFO it waits in, if it is still there.
inline void unlink(std::map<key, std::vector<std::shared_ptr<message>>>& queues, const key& k,
                   const message* m) {
  auto it = queues.find(k);
  if (it == queues.end()) return;
  auto& q = it->second;
  for (auto e = q.begin(); e != q.end(); ++e)
    if (e->get() == m) {
      q.erase(e);
      break;
    }
  if (q.empty()) queues.erase(it);
}

}  // namespace detail

/// One rank's end of the world's mailboxes. Peers are world ranks; tags arrive complete (the
/// communicator has put its id in them).
class transport {
 public:
  /// Handle to one posted send or receive. Destroying it before completion withdraws it.
  class request {
   public:
    request() = default;
    request(request&&) noexcept = default;
    request& operator=(request&& o) noexcept {
      if (this != &o) {
        cancel();
        msg_ = std::move(o.msg_);
        box_ = o.box_;
        key_ = o.key_;
        is_send_ = o.is_send_;
        peer_ = o.peer_;
      }
      return *this;
    }
    request(const request&) = delete;
    request& operator=(const request&) = delete;
    ~request() { cancel(); }

   private:
    friend class transport;
    void cancel() noexcept {
      if (!msg_ || msg_->done.load(std::memory_order_acquire)) return;
      std::lock_guard lock(box_->mutex);
      if (!msg_->done.load(std::memory_order_acquire))
        detail::unlink(is_send_ ? box_->sends : box_->recvs, key_, msg_.get());
    }
    std::shared_ptr<detail::message> msg_;
    detail::mailbox* box_ = nullptr;
    detail::key key_{};
    bool is_send_ = false;
    int peer_ = -1;
  };

  transport(std::shared_ptr<detail::shared_state> shared, int rank, const world_options& opts)
      : shared_(std::move(shared)), rank_(rank), opts_(opts) {}

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return static_cast<int>(shared_->boxes.size()); }
  [[nodiscard]] const ringzero::tuning::policy& tuning() const noexcept { return opts_.tuning; }
  /// The section of a RINGZERO_TUNING file that applies here.
  [[nodiscard]] std::string tuning_name() const { return "loopback"; }
  [[nodiscard]] std::chrono::nanoseconds default_timeout() const noexcept { return opts_.timeout; }
  /// Node of world rank r when the world simulates several nodes (world_options::ranks_per_node).
  [[nodiscard]] int host_of(int r) const noexcept {
    return opts_.ranks_per_node > 0 ? r / opts_.ranks_per_node : 0;
  }
  void progress() noexcept {}

  /// Fails every wait on this rank's transport, and so on every communicator over it, with
  /// peer_error carrying `why`: now, including waits blocked in another thread, and every call
  /// after. Thread-safe; the first reason given is the one kept. The other ranks learn of it as
  /// of any failure: when this rank's function throws, world::run fails their waits.
  void abort(const std::string& why) { aborted_->set(why); }
  /// Why abort() was called, or nullopt if it was not.
  [[nodiscard]] std::optional<std::string> abort_reason() const {
    return aborted_->reason_if_set();
  }

  [[nodiscard]] request isend(int peer, tag_t tag, std::span<const std::byte> data) {
    check_aborted();
    auto msg = std::make_shared<detail::message>();
    msg->src = rank_;
    msg->send_data = data;
    auto& box = shared_->boxes[static_cast<std::size_t>(peer)];
    const detail::key k{rank_, tag};
    {
      std::lock_guard lock(box.mutex);
      if (auto it = box.recvs.find(k); it != box.recvs.end()) {
        auto recv = it->second.front();
        it->second.erase(it->second.begin());
        if (it->second.empty()) box.recvs.erase(it);
        detail::complete(*msg, *recv);
      } else {
        box.sends[k].push_back(msg);
      }
    }
    return make_request(std::move(msg), box, k, true, peer);
  }

  [[nodiscard]] request irecv(int peer, tag_t tag, std::span<std::byte> data) {
    check_aborted();
    auto msg = std::make_shared<detail::message>();
    msg->src = peer;
    msg->recv_data = data;
    auto& box = shared_->boxes[static_cast<std::size_t>(rank_)];
    const detail::key k{peer, tag};
    {
      std::lock_guard lock(box.mutex);
      if (auto it = box.sends.find(k); it != box.sends.end()) {
        auto send = it->second.front();
        it->second.erase(it->second.begin());
        if (it->second.empty()) box.sends.erase(it);
        detail::complete(*send, *msg);
      } else {
        box.recvs[k].push_back(msg);
      }
    }
    return make_request(std::move(msg), box, k, false, peer);
  }

  [[nodiscard]] bool test(request& r) {
    if (!r.msg_) throw invalid_argument("test() on an empty request");
    check_aborted();
    if (r.msg_->done.load(std::memory_order_acquire)) {
      if (r.msg_->size_mismatch)
        throw transport_error(fmt::format(
            "rank {}: message size mismatch with rank {}: {} posted {} bytes, the peer {} bytes "
            "(ranks disagree on the collective's count or type?)",
            rank_, r.peer_, r.is_send_ ? "send" : "receive",
            r.is_send_ ? r.msg_->send_data.size() : r.msg_->recv_data.size(), r.msg_->other_size));
      return true;
    }
    const int failed = shared_->failed_rank.load(std::memory_order_acquire);
    if (failed >= 0 && failed != rank_)
      throw peer_error(fmt::format("rank {} failed: {}", failed, shared_->failure), failed);
    return false;
  }

  [[nodiscard]] const std::shared_ptr<detail::shared_state>& shared() const noexcept {
    return shared_;
  }
  [[nodiscard]] const world_options& options() const noexcept { return opts_; }

 private:
  static request make_request(std::shared_ptr<detail::message> msg, detail::mailbox& box,
                              detail::key k, bool is_send, int peer) {
    request r;
    r.msg_ = std::move(msg);
    r.box_ = &box;
    r.key_ = k;
    r.is_send_ = is_send;
    r.peer_ = peer;
    return r;
  }

  void check_aborted() const {
    if (auto why = abort_reason())
      throw peer_error(fmt::format("rank {}: the communicator was aborted: {}", rank_, *why), -1);
  }

  std::shared_ptr<detail::shared_state> shared_;
  int rank_;
  world_options opts_;
  std::shared_ptr<ringzero::detail::abort_state> aborted_ =
      std::make_shared<ringzero::detail::abort_state>();
};

}  // namespace ringzero::loopback
