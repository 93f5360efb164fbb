// The one place algorithms post messages and wait for them. It stamps every message with the
// collective's sequence number and a (step, chunk) id, and turns a missed deadline into an error
// that names the collective, the algorithm, the step and the peer that never answered.
#pragma once

#include <fmt/core.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ringzero/detail/backoff.hpp"
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
        deadline_(clock::now() + timeout_),
        waiting_(backoff_for(ranks_here(comm))) {}

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

  /// Blocks until p completes, or throws timeout_error once no message of the call has
  /// completed for `timeout`.
  void wait(pending& p) {
    if (p.done) return;
    backoff b = waiting_;
    while (!comm_.test(p.req)) {
      b.pause();
      if (expired()) throw timed_out(p);
    }
    completed(p);
  }

  void wait_all(std::span<pending> ps) {
    for (auto& p : ps) wait(p);
  }

  /// Non-blocking wait: true once p completed, timeout_error once the call's deadline passed
  /// (`timeout` since any of its messages last completed).
  /// Lets an algorithm drive several pipelines at once without blocking on any one of them.
  [[nodiscard]] bool test(pending& p) {
    if (p.done) return true;
    if (comm_.test(p.req)) {
      completed(p);
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
  // The deadline is on progress: it moves on whenever a message of the call completes, so a
  // long collective on a slow but healthy network runs as long as it keeps moving, and a call
  // fails `timeout` after its last message moved, not `timeout` after it began. A completion
  // only sets a flag; the clock is read where it already is, every 64th unsuccessful poll, and
  // then restarts the deadline if anything moved since (at most 64 polls late).
  void completed(pending& p) {
    p.done = true;
    moved_ = true;
    trace_receive(comm_.state().trace, p.is_send);
  }

  // The communicator's ranks on this node, for backoff_for: where they outnumber its CPUs a
  // wait yields at once, since the rank it waits for may need this CPU. One that cannot say
  // where its ranks are counts as alone (it spins first).
  [[nodiscard]] static int ranks_here(T& comm) {
    if constexpr (requires { comm.topo().local_size; }) return comm.topo().local_size;
    return 1;
  }

  [[nodiscard]] bool expired() noexcept {
    if ((++polls_ & 63u) != 0) return false;
    const clock::time_point now = clock::now();
    if (moved_) {
      moved_ = false;
      deadline_ = now + timeout_;
      return false;
    }
    return now > deadline_;
  }

  [[nodiscard]] timeout_error timed_out(const pending& p) const {
    const double secs = std::chrono::duration<double>(timeout_).count();
    std::string what = fmt::format(
        "{} ({}) on rank {} of {}: step {} timed out after {:g} s without progress, waiting "
        "for rank {} to {} (sequence {}; RINGZERO_TIMEOUT sets the limit)",
        collective_, algorithm_, comm_.rank(), comm_.size(), p.step, secs, p.peer,
        p.is_send ? "receive our message" : "send its message", seq_);
    // The rank waited for is often only the dead one's neighbour: a transport that knows who
    // died (libfabric's watchdog) names it, and the error carries it as the culprit.
    if constexpr (requires { comm_.failed_rank(); }) {
      if (const int dead = comm_.failed_rank(); dead >= 0 && dead != p.peer)
        return timeout_error(fmt::format("{}; rank {} has died", what, dead), dead);
    }
    // A stopped rank (SIGSTOP, a debugger) is alive, so nothing failed, but every wait that
    // depends on it ends here: it is the culprit, whichever rank this one waited for.
    if constexpr (requires { comm_.stopped_rank(); }) {
      if (const int stopped = comm_.stopped_rank(); stopped >= 0)
        return timeout_error(
            fmt::format("{}; rank {} is stopped (SIGSTOP or a debugger)", what, stopped), stopped);
    }
    return timeout_error(what, p.peer);
  }

  T& comm_;
  std::string_view collective_;
  std::string_view algorithm_;
  bool p2p_;
  std::uint32_t seq_;
  std::chrono::nanoseconds timeout_;
  clock::time_point deadline_;
  backoff waiting_;  ///< how this call's waits back off, fresh for each wait
  unsigned polls_ = 0;
  bool moved_ = false;  ///< a message completed since the deadline was last set
};

}  // namespace ringzero::detail
