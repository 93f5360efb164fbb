// The one place algorithms post messages and wait for them. It stamps every message with the
// collective's sequence number and a (step, chunk) id, and turns a missed deadline into an error
// that names the collective, the algorithm, the step and the peer that never answered.
#pragma once

#include <fmt/core.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <thread>
#include <vector>

#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/trace_state.hpp"
#include "ringzero/error.hpp"

namespace ringzero::detail {

using clock = std::chrono::steady_clock;

/// The algorithm's part of a message tag (tag_layout says where each field sits).
[[nodiscard]] constexpr tag_t make_tag(bool p2p, std::uint32_t seq, std::uint32_t step,
                                       std::uint32_t chunk) noexcept {
  return tag_layout::make(p2p, seq, step, chunk);
}

template <class T>
[[nodiscard]] std::span<const std::byte> as_bytes(std::span<const T> s) noexcept {
  return std::as_bytes(s);
}
template <class T>
[[nodiscard]] std::span<std::byte> as_writable_bytes(std::span<T> s) noexcept {
  return std::as_writable_bytes(s);
}

/// Spin first (a peer on the same node answers in well under a microsecond), then yield, then
/// sleep briefly: a blocking sleep/wake costs tens of microseconds, so sleeping is the last
/// resort for long waits, not the first.
class backoff {
 public:
  void pause() {
    ++n_;
    if (n_ < 256) return;
    if (n_ < 4096) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  void reset() noexcept { n_ = 0; }

 private:
  unsigned n_ = 0;
};

/// One collective call's messaging context.
template <collective_comm T>
class exchange {
 public:
  using request = typename T::request;

  exchange(T& comm, std::string_view collective, std::string_view algorithm,
           std::chrono::nanoseconds timeout = std::chrono::nanoseconds{0}, bool p2p = false,
           std::uint32_t sequence = 0)
      : comm_(comm),
        collective_(collective),
        algorithm_(algorithm),
        p2p_(p2p),
        seq_(p2p ? sequence : comm.state().collective_seq++),
        timeout_(timeout.count() > 0 ? timeout : std::chrono::nanoseconds(comm.timeout())),
        deadline_(clock::now() + timeout_) {}

  [[nodiscard]] T& comm() noexcept { return comm_; }
  [[nodiscard]] int rank() const { return comm_.rank(); }
  [[nodiscard]] int size() const { return comm_.size(); }

  /// A posted message. A default-constructed pending stands for "nothing to wait for".
  struct pending {
    request req;
    int peer = -1;
    int step = 0;
    bool is_send = false;
    bool done = true;
  };

  [[nodiscard]] pending send(int peer, int step, std::uint32_t chunk,
                             std::span<const std::byte> bytes) {
    return {comm_.isend(peer, make_tag(p2p_, seq_, static_cast<std::uint32_t>(step), chunk), bytes),
            peer, step, true, false};
  }
  [[nodiscard]] pending recv(int peer, int step, std::uint32_t chunk, std::span<std::byte> bytes) {
    return {comm_.irecv(peer, make_tag(p2p_, seq_, static_cast<std::uint32_t>(step), chunk), bytes),
            peer, step, false, false};
  }

  /// Blocks until p completes or the call's deadline passes.
  void wait(pending& p) {
    if (p.done) return;
    backoff b;
    while (!comm_.test(p.req)) {
      b.pause();
      if (expired()) throw timed_out(p);
    }
    p.done = true;
    trace_receive(comm_.state().trace, p.is_send);
  }

  void wait_all(std::span<pending> ps) {
    for (auto& p : ps) wait(p);
  }

  /// Non-blocking wait: true once p completed, timeout_error once the call's deadline passed.
  /// Lets an algorithm drive several pipelines at once without blocking on any one of them.
  [[nodiscard]] bool test(pending& p) {
    if (p.done) return true;
    if (comm_.test(p.req)) {
      p.done = true;
      trace_receive(comm_.state().trace, p.is_send);
      return true;
    }
    if (expired()) throw timed_out(p);
    return false;
  }

  /// Exchange with two peers at once: the basic step of every ring and butterfly.
  void sendrecv(int to, std::span<const std::byte> out, int from, std::span<std::byte> in, int step,
                std::uint32_t chunk = 0) {
    pending r = recv(from, step, chunk, in);
    pending s = send(to, step, chunk, out);
    wait(r);
    wait(s);
  }

 private:
  // Reading the clock on every unsuccessful poll costs more than the poll; once every 64 is
  // still far finer than any deadline.
  [[nodiscard]] bool expired() noexcept {
    return (++polls_ & 63u) == 0 && clock::now() > deadline_;
  }

  [[nodiscard]] timeout_error timed_out(const pending& p) const {
    const double secs = std::chrono::duration<double>(timeout_).count();
    return timeout_error(
        fmt::format("{} ({}) on rank {} of {}: step {} timed out after {:g} s waiting for rank {} "
                    "to {} (sequence {}; RINGZERO_TIMEOUT sets the limit)",
                    collective_, algorithm_, comm_.rank(), comm_.size(), p.step, secs, p.peer,
                    p.is_send ? "receive our message" : "send its message", seq_),
        p.peer);
  }

  T& comm_;
  std::string_view collective_;
  std::string_view algorithm_;
  bool p2p_;
  std::uint32_t seq_;
  std::chrono::nanoseconds timeout_;
  clock::time_point deadline_;
  unsigned polls_ = 0;
};

}  // namespace ringzero::detail
