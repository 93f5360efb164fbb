// What abort() leaves behind in a transport, written once: a flag every wait reads where it
// already polls its deadline (one load, no syscall, no lock), and the reason, set once by the
// first abort() and read by the error every failed wait throws. abort() is called from any
// thread, also while another is blocked inside the transport, so it never waits on one.
#pragma once

#include <atomic>
#include <mutex>
#include <optional>
#include <string>

namespace ringzero::detail {

class abort_state {
 public:
  /// Records `why` and raises the flag; the first call wins, later ones change nothing.
  void set(const std::string& why) {
    std::lock_guard lock(mutex_);
    if (set_.load(std::memory_order_relaxed)) return;
    why_ = why;  // before the flag: a reader that sees the flag finds the reason
    set_.store(true, std::memory_order_release);
  }
  [[nodiscard]] bool is_set() const noexcept { return set_.load(std::memory_order_acquire); }
  /// What set() was given; empty until it was called.
  [[nodiscard]] std::string reason() const {
    std::lock_guard lock(mutex_);
    return why_;
  }
  /// The reason once set() was called, else nothing.
  [[nodiscard]] std::optional<std::string> reason_if_set() const {
    if (!is_set()) return std::nullopt;
    return reason();
  }

 private:
  std::atomic<bool> set_{false};
  mutable std::mutex mutex_;
  std::string why_;
};

}  // namespace ringzero::detail
