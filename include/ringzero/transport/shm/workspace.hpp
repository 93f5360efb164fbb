// The workspace of the collectives that run in the shared segment (shm/detail/collectives.hpp): per
// rank a cache line holding the rank's phase counter and two buffers, in symmetric memory.
//
// A collective is a sequence of phases. In a phase a rank writes what others will read, then
// posts the phase number and waits until every rank has posted it: posting is a release store
// to a line only this rank writes, waiting is acquire loads, so no lock exists that a dead rank
// could hold. Two buffers alternate by phase parity: a rank writes buffer p % 2 in phase p only
// after every rank posted phase p - 1, which each did after it finished reading phase p - 2.
//
// A call's first phase also carries the call's descriptor (kind, type, op, whether the sum is
// reproducible, root, count), written next to the counter before the post; once every rank
// posted, each compares the others' with its own. All see the same descriptors, so all raise
// alike, and before any reads a peer's buffer. The descriptor of the call that starts at phase p
// sits in slot p % 2, by the same argument as the buffers: a rank rewrites it only after every
// rank posted p + 1, that is, after every rank compared.
#pragma once

#include <fmt/core.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "ringzero/algorithm.hpp"
#include "ringzero/detail/agreement.hpp"
#include "ringzero/detail/backoff.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/op.hpp"
#include "ringzero/transport/shm/detail/collectives.hpp"
#include "ringzero/transport/shm/detail/engine.hpp"
#include "ringzero/transport/shm/detail/segment.hpp"
#include "ringzero/transport/shm/symmetric.hpp"
#include "ringzero/types.hpp"

namespace ringzero::shm {

class workspace {
 public:
  static constexpr std::size_t header_bytes = 2 * detail::cache_line;

  /// Symmetric bytes per rank that a workspace with buffers of buffer_bytes needs.
  [[nodiscard]] static constexpr std::size_t bytes_for(std::size_t buffer_bytes) noexcept {
    return header_bytes + 2 * detail::round_up(buffer_bytes, detail::cache_line);
  }

  /// mem: symmetric memory of bytes_for(buffer_bytes) per rank; eng: the transport's engine,
  /// which keeps messages moving and tells dead peers while a phase waits.
  workspace(std::shared_ptr<detail::engine> eng, symmetric_memory mem, std::size_t buffer_bytes,
            std::size_t streaming_bytes)
      : eng_(std::move(eng)),
        buffer_bytes_(detail::round_up(buffer_bytes, detail::cache_line)),
        streaming_bytes_(streaming_bytes),
        mem_(std::move(mem)),
        waiting_(ringzero::detail::backoff_for(mem_.size())) {}

  [[nodiscard]] int rank() const noexcept { return mem_.rank(); }
  [[nodiscard]] int size() const noexcept { return mem_.size(); }
  /// Bytes in each of a rank's two buffers.
  [[nodiscard]] std::size_t capacity() const noexcept { return buffer_bytes_; }
  [[nodiscard]] std::size_t streaming_bytes() const noexcept { return streaming_bytes_; }
  /// The phase the next begin_phase() starts.
  [[nodiscard]] std::uint64_t next_phase() const noexcept { return phase_ + 1; }

  /// Rank r's buffer for phase p.
  [[nodiscard]] std::byte* buffer(int r, std::uint64_t p) const noexcept {
    return mem_.peer(r).data() + header_bytes + (p % 2) * buffer_bytes_;
  }

  /// Posts the next phase and waits until every rank posted it, within call's deadline; returns
  /// the phase number. abort() and a peer found gone end the wait too.
  std::uint64_t phase(detail::segment_call& call) {
    const std::uint64_t p = ++phase_;
    const bool first = call.step++ == 0;
    if (first) std::memcpy(descriptor(rank(), p), &call.desc, sizeof call.desc);
    counter(rank()).store(p, std::memory_order_release);
    for (int q = 0; q < size(); ++q) {
      if (q == rank()) continue;
      ringzero::detail::backoff b = waiting_;
      unsigned polls = 0;
      // Set at the first deadline check: a wait that ends within 256 polls (the common case
      // for small calls) reads no clock.
      std::chrono::steady_clock::time_point last_check{};
      while (counter(q).load(std::memory_order_acquire) < p) {
        ++polls;
        // Messages still move meanwhile: a peer may wait on a send of this rank's to get here.
        // Every 8th poll: progress reads every peer's queues, lines the peers are writing.
        if ((polls & 7u) == 0) {
          std::lock_guard lock(eng_->mutex());
          eng_->progress();
        }
        b.pause();
        if ((polls & 255u) != 0) continue;
        if (eng_->aborted()) eng_->check_aborted(fmt::format("{} (shm segment)", call.what));
        const auto now = std::chrono::steady_clock::now();
        if (call.deadline == std::chrono::steady_clock::time_point{})
          call.deadline = now + call.timeout;
        if (now > call.deadline) throw timed_out(call, p, q);
        if (last_check == std::chrono::steady_clock::time_point{}) last_check = now;
        if (now - last_check > std::chrono::milliseconds(5)) {
          last_check = now;
          std::lock_guard lock(eng_->mutex());
          // A peer may post the phase just before it dies: only a missing post is an error.
          if (eng_->peer_gone(q) && counter(q).load(std::memory_order_acquire) < p)
            throw peer_error(eng_->dead_message(q), q);
        }
      }
    }
    if (first) check_agreement(call, p);
    return p;
  }

 private:
  /// Raises mismatch_error if some rank's descriptor for the call starting at phase p differs
  /// from this rank's, naming the lowest such rank and both descriptors.
  void check_agreement(const detail::segment_call& call, std::uint64_t p) const {
    using ringzero::detail::call_record;
    const auto theirs = [&](int q) {
      call_record r;
      std::memcpy(&r, descriptor(q, p), sizeof r);
      return r;
    };
    const int q = ringzero::detail::first_disagreeing(size(), rank(), call.desc, theirs);
    if (q < 0) return;
    throw mismatch_error(fmt::format(
        "{} (shm segment) on rank {} of {}: the ranks disagree on the call (sequence {}): rank {} "
        "called {} but rank {} called {}",
        call.what, rank(), size(), call.sequence, rank(), ringzero::detail::describe(call.desc), q,
        ringzero::detail::describe(theirs(q))));
  }

  /// Rank r's descriptor slot for the call that starts at phase p: in the counter's cache line,
  /// which the waits load anyway.
  [[nodiscard]] std::byte* descriptor(int r, std::uint64_t p) const noexcept {
    static_assert(16 + 2 * sizeof(ringzero::detail::call_record) <= detail::cache_line);
    return mem_.peer(r).data() + 16 + (p % 2) * sizeof(ringzero::detail::call_record);
  }

  [[nodiscard]] timeout_error timed_out(const detail::segment_call& call, std::uint64_t p,
                                        int q) const {
    if (log::enabled(log::level::info)) {
      // What every rank reached: the ranks behind are the ones the others wait for.
      std::string posted;
      for (int r = 0; r < size(); ++r)
        posted += fmt::format("{} rank {} at phase {}", r == 0 ? "" : ",", r,
                              counter(r).load(std::memory_order_acquire));
      std::lock_guard lock(eng_->mutex());
      log::info(
          "shm: rank {} gave up waiting in {} (shm segment), sequence {}, step {}, phase {}:{}; "
          "{}",
          rank(), call.what, call.sequence, call.step, p, posted, eng_->pending_list());
    }
    std::string what = fmt::format(
        "{} (shm segment) on rank {} of {}: step {} (phase {}) timed out after {:g} s waiting for "
        "rank {} to reach it (sequence {}; RINGZERO_TIMEOUT sets the limit)",
        call.what, rank(), size(), call.step, p,
        std::chrono::duration<double>(call.timeout).count(), q, call.sequence);
    // The rank waited for may only be waiting on a stopped one: that one is the culprit.
    if (const auto stopped = eng_->stopped_peers(); !stopped.empty())
      return {fmt::format("{}; rank {} is stopped (SIGSTOP or a debugger)", what, stopped.front()),
              stopped.front()};
    return {what, q};
  }

  [[nodiscard]] std::atomic<std::uint64_t>& counter(int r) const noexcept {
    return *reinterpret_cast<std::atomic<std::uint64_t>*>(mem_.peer(r).data());
  }

  std::shared_ptr<detail::engine> eng_;
  std::size_t buffer_bytes_;
  std::size_t streaming_bytes_;
  symmetric_memory mem_;
  /// How a phase waits for each peer: worked out once (its ranks share this node), not per wait.
  ringzero::detail::backoff waiting_;
  std::uint64_t phase_ = 0;
};

}  // namespace ringzero::shm
