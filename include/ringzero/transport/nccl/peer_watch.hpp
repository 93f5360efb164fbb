// How an NCCL transport learns of a failure NCCL does not report, and stops its work for it. NCCL
// does not say which rank a call waits for: abort() (from any thread) and config::dead_rank (a
// launcher's death marks, an elastic session's heartbeat) do. The transport asks between polls
// of every wait (nccl/transport.hpp), then revokes or aborts its handle.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "ringzero/detail/backoff.hpp"
#include "ringzero/transport/detail/abort_state.hpp"

namespace ringzero::nccl::detail {

/// abort()'s reason and the rank found dead, shared with the transport a communicator is moved
/// to (another thread may set them while a call waits), and config::dead_rank's probe.
class peer_watch {
 public:
  peer_watch() = default;
  explicit peer_watch(std::function<int()> dead_rank) : dead_rank_(std::move(dead_rank)) {}

  void abort(const std::string& why) { shared_->abort.set(why); }
  [[nodiscard]] bool aborted() const noexcept { return shared_->abort.is_set(); }
  [[nodiscard]] std::optional<std::string> reason() const { return shared_->abort.reason_if_set(); }
  /// The rank found dead, or -1.
  [[nodiscard]] int failed_rank() const noexcept {
    return shared_->failed_rank.load(std::memory_order_acquire);
  }
  /// Rank `rank` died: `why` becomes the reason every thread sees.
  void dead(int rank, const std::string& why) {
    shared_->failed_rank.store(rank, std::memory_order_release);
    shared_->abort.set(why);
  }
  /// config::dead_rank's answer for rank `self` of `size`, asked at most every 100 ms unless
  /// `now`; -1 without one (or for an answer that names no other rank).
  [[nodiscard]] int probe(int self, int size, bool now = false) {
    if (!dead_rank_) return -1;
    const auto t = std::chrono::steady_clock::now();
    if (!now && t < next_) return -1;
    next_ = t + std::chrono::milliseconds(100);
    const int r = dead_rank_();
    return r >= 0 && r < size && r != self ? r : -1;
  }

 private:
  struct state {
    ringzero::detail::abort_state abort;
    std::atomic<int> failed_rank{-1};
  };
  std::shared_ptr<state> shared_ = std::make_shared<state>();
  std::function<int()> dead_rank_;
  std::chrono::steady_clock::time_point next_{};  // when dead_rank_ may be asked again
};

/// ncclCommRevoke on `comm` (of CUDA device `device`), waited until NCCL's state leaves "in
/// progress" for at most min(`timeout`, 10 s): it stops what is in flight and keeps the handle
/// for ncclCommShrink. False where it did not settle, or NCCL is older than 2.28: the caller then
/// aborts the handle.
[[nodiscard]] inline bool revoke(ncclComm_t comm, int device,
                                 std::chrono::nanoseconds timeout) noexcept {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  int previous = device;
  static_cast<void>(cudaGetDevice(&previous));
  static_cast<void>(cudaSetDevice(device));
  bool revoked = false;
  ncclResult_t r = ncclCommRevoke(comm, NCCL_REVOKE_DEFAULT);
  const auto until = std::chrono::steady_clock::now() +
                     std::min<std::chrono::nanoseconds>(timeout, std::chrono::seconds(10));
  ringzero::detail::backoff b;
  while (r == ncclInProgress || r == ncclSuccess) {
    ncclResult_t state = ncclInProgress;
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) break;
    if (state == ncclSuccess) {
      revoked = true;
      break;
    }
    if (state != ncclInProgress || std::chrono::steady_clock::now() > until) break;
    b.pause();
  }
  static_cast<void>(cudaSetDevice(previous));
  return revoked;
#else
  static_cast<void>(comm), static_cast<void>(device), static_cast<void>(timeout);
  return false;
#endif
}

}  // namespace ringzero::nccl::detail
