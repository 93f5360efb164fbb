// The shm transport's message engine: one single-producer, single-consumer ring of slots per
// ordered pair of ranks, inside the shared segment.
//
// A slot is a 32-byte header (sequence flag, tag, message size, fragment length) followed by
// payload, so a message of up to 32 bytes travels in one cache line that the receiver polls,
// and larger ones in consecutive slots that the sender fills while the receiver drains
// (pipelined: two copies, each of them streaming through the cache-resident ring). The sender
// publishes a slot by storing its sequence number with release order; the receiver frees it by
// advancing the channel's tail. Each field has exactly one writer, so no rank ever waits for a
// lock that a dead rank could hold.
//
// Matching follows MPI: per peer, messages match posted receives by tag in posting order;
// a message that arrives before its receive is kept in an unexpected list (heap memory) so the
// ring never blocks behind it, and a receive posted while such a message is still arriving
// takes over the rest of it directly.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/abort_state.hpp"
#include "ringzero/transport/detail/pending_report.hpp"
#include "ringzero/transport/shm/detail/segment.hpp"

namespace ringzero::shm::detail {

struct slot_header {
  std::atomic<std::uint64_t> seq;  ///< n+1 once the n-th slot of the channel is filled
  std::uint64_t tag;
  std::uint64_t size;  ///< of the whole message
  std::uint32_t len;   ///< of this fragment
  std::uint32_t reserved;
};
inline constexpr std::size_t slot_header_bytes = 32;
static_assert(sizeof(slot_header) == slot_header_bytes);

/// The consumer's side of a channel, on a cache line of its own.
struct alignas(cache_line) channel_control {
  std::atomic<std::uint64_t> tail;
};

/// Fixed fields at the start of the segment.
struct alignas(cache_line) segment_header {
  std::uint64_t magic;
  std::uint32_t ranks;
  std::uint32_t slots;
  std::uint64_t slot_bytes;
  std::uint64_t bytes;
  std::atomic<std::uint32_t> mapped;
};
inline constexpr std::uint64_t segment_magic = 0x72696e677a65726full;  // "ringzerO"

/// Where everything sits in a segment of n ranks with `slots` slots of `slot_bytes` per channel.
struct layout {
  std::size_t ranks = 1;
  std::size_t slots = 64;
  std::size_t slot_bytes = 8192;

  [[nodiscard]] std::size_t records() const noexcept {
    return round_up(sizeof(segment_header), cache_line);
  }
  [[nodiscard]] std::size_t channels() const noexcept {
    return round_up(records() + ranks * sizeof(rank_record), 4096);
  }
  [[nodiscard]] std::size_t channel_bytes() const noexcept {
    return round_up(sizeof(channel_control) + slots * slot_bytes, 4096);
  }
  [[nodiscard]] std::size_t channel(std::size_t from, std::size_t to) const noexcept {
    const std::size_t index = from * (ranks - 1) + (to < from ? to : to - 1);
    return channels() + index * channel_bytes();
  }
  [[nodiscard]] std::size_t bytes() const noexcept {
    return channels() + ranks * (ranks - 1) * channel_bytes();
  }
};

/// One posted send or receive that did not finish when it was posted.
struct op {
  int peer = -1;
  std::uint64_t tag = 0;
  bool is_send = false;
  bool started = false;  ///< a send: its first fragment is in the ring
  bool orphan = false;   ///< its request is gone; the engine frees it when it finishes
  enum class status : std::uint8_t { pending, done, failed } state = status::pending;
  const std::byte* src = nullptr;  ///< a send: the next byte to send
  std::size_t left = 0;            ///< a send: bytes not yet in the ring
  std::byte* dst = nullptr;        ///< a receive
  std::size_t size = 0;            ///< the message size
  std::string error;
  std::vector<std::byte> owned;  ///< a cancelled send's unsent bytes
};

struct unexpected_message {
  std::uint64_t tag = 0;
  std::vector<std::byte> data;
  bool complete = false;
};

class engine {
 public:
  engine(mapping seg, int rank, int size) : seg_(std::move(seg)), rank_(rank), size_(size) {
    const auto* h = header();
    geometry_ = {static_cast<std::size_t>(h->ranks), h->slots,
                 static_cast<std::size_t>(h->slot_bytes)};
    payload_ = geometry_.slot_bytes - slot_header_bytes;
    peers_.resize(static_cast<std::size_t>(size));
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      auto& ps = peers_[static_cast<std::size_t>(p)];
      ps.out = seg_.data() +
               geometry_.channel(static_cast<std::size_t>(rank), static_cast<std::size_t>(p));
      ps.in = seg_.data() +
              geometry_.channel(static_cast<std::size_t>(p), static_cast<std::size_t>(rank));
    }
  }
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;
  ~engine() {
    record(rank_).state.store(rank_left, std::memory_order_release);
    for (op* o : all_ops_) delete o;
  }

  [[nodiscard]] segment_header* header() const noexcept {
    return reinterpret_cast<segment_header*>(seg_.data());
  }
  [[nodiscard]] rank_record& record(int r) const noexcept {
    return reinterpret_cast<rank_record*>(seg_.data() + geometry_.records())[r];
  }
  [[nodiscard]] const layout& geometry() const noexcept { return geometry_; }
  void unlink_segment() noexcept { seg_.unlink(); }
  [[nodiscard]] std::size_t eager_limit() const noexcept { return payload_; }
  [[nodiscard]] std::mutex& mutex() noexcept { return mutex_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }

  /// abort(): every wait of the transport reads the flag where it already polls its deadline (a
  /// load, no syscall); it is this process's, not in the segment, so a peer cannot set or hold it.
  void abort(const std::string& why) { abort_.set(why); }
  [[nodiscard]] bool aborted() const noexcept { return abort_.is_set(); }
  [[nodiscard]] std::string abort_reason() const { return abort_.reason(); }
  /// Throws peer_error once abort() was called.
  void check_aborted(std::string_view where) const {
    if (aborted())
      throw peer_error(fmt::format("{} on rank {}: the communicator was aborted: {}", where, rank_,
                                   abort_reason()),
                       -1);
  }

  /// True the first time only: one RINGZERO_DEBUG=INFO listing per transport, not one per
  /// request a failed collective drops.
  [[nodiscard]] bool first_give_up() noexcept { return !std::exchange(gave_up_, true); }

  /// The messages posted and not finished, one line each (RINGZERO_DEBUG=INFO when a wait gives
  /// up). Call with mutex() held.
  [[nodiscard]] std::string pending_list() const {
    ringzero::detail::pending_report report;
    for (const op* o : all_ops_) {
      if (o->state != op::status::pending || o->orphan ||
          std::find(free_.begin(), free_.end(), o) != free_.end())
        continue;
      report.add(o->is_send, o->peer, o->size, o->tag);
    }
    return fmt::format("{} pending messages{}", report.count(), report.lines());
  }

  /// Sends as much as the ring takes now; returns the op still to finish, or nullptr.
  [[nodiscard]] op* send(int peer, std::uint64_t tag, std::span<const std::byte> data) {
    auto& ps = peers_[static_cast<std::size_t>(peer)];
    op* o = make_op(peer, tag, true);
    o->src = data.data();
    o->left = data.size();
    o->size = data.size();
    if (ps.dead) return fail(o, dead_message(peer));
    ps.sendq.push_back(o);
    if (ps.sendq.size() == 1) progress_send(ps);
    if (o->state == op::status::done) {
      free_op(o);
      return nullptr;
    }
    return o;
  }

  [[nodiscard]] op* recv(int peer, std::uint64_t tag, std::span<std::byte> data) {
    auto& ps = peers_[static_cast<std::size_t>(peer)];
    op* o = make_op(peer, tag, false);
    o->dst = data.data();
    o->size = data.size();
    for (auto it = ps.unexpected.begin(); it != ps.unexpected.end(); ++it) {
      if (it->tag != tag) continue;
      if (it->data.size() != data.size()) {
        mismatch(o, it->data.size());
        if (ps.receiving && ps.into_unexpected == &*it) {
          ps.dest = nullptr;
          ps.into_unexpected = nullptr;
        }
        ps.unexpected.erase(it);
        return o;
      }
      const std::size_t have = it->complete ? it->data.size() : ps.offset;
      if (have) std::memcpy(o->dst, it->data.data(), have);
      if (it->complete) {
        o->state = op::status::done;
      } else {
        // Still arriving: the rest goes straight into the posted buffer.
        ps.dest = o->dst;
        ps.into = o;
        ps.into_unexpected = nullptr;
      }
      ps.unexpected.erase(it);
      return finish_or_keep(o);
    }
    ps.posted.push_back(o);
    progress_recv(ps);
    if (ps.dead && o->state == op::status::pending) {
      // What the peer wrote before it died was taken above; nothing more will come.
      if (ps.receiving && ps.into == o) {
        ps.dest = nullptr;
        ps.into = nullptr;
      } else if (auto it = std::find(ps.posted.begin(), ps.posted.end(), o);
                 it != ps.posted.end()) {
        ps.posted.erase(it);
      }
      return fail(o, dead_message(peer));
    }
    return finish_or_keep(o);
  }

  /// Moves every message that can move without waiting.
  void progress() {
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      auto& ps = peers_[static_cast<std::size_t>(p)];
      if (!ps.sendq.empty()) progress_send(ps);
      progress_recv(ps);
    }
  }

  /// The peers whose process is stopped (SIGSTOP, a debugger): alive, so not gone, but a wait on
  /// them can only time out. /proc reads: for a wait that gave up.
  [[nodiscard]] std::vector<int> stopped_peers() const {
    std::vector<int> out;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const auto& rec = record(p);
      const auto st = ringzero::detail::read_process_stat(rec.pid.load(std::memory_order_acquire));
      if (st && st->stopped() && st->start == rec.start.load(std::memory_order_acquire))
        out.push_back(p);
    }
    return out;
  }

  /// Checks the peer's process (a /proc read, so callers rate-limit it); true if it is gone.
  [[nodiscard]] bool peer_gone(int peer) {
    auto& ps = peers_[static_cast<std::size_t>(peer)];
    if (ps.dead) return true;
    const auto& rec = record(peer);
    const process_id want{rec.pid.load(std::memory_order_acquire),
                          rec.start.load(std::memory_order_acquire)};
    if (rec.state.load(std::memory_order_acquire) == rank_left) {
      ps.dead = true;
    } else if (read_process(want.pid) != want) {
      ps.dead = true;
      remove_names_of(want.pid);
    }
    return ps.dead;
  }

  /// The peer to blame while waiting on `waited`, -1 if none: a peer this rank still has
  /// messages pending with (or `waited`) that is gone. A dead process is named before a rank
  /// that merely closed its transport, even when only the latter is waited on: such a rank
  /// usually closed because of that death. A dead rank this rank needs nothing from is not
  /// blamed while the peers it waits on are alive (it may have finished its part first).
  [[nodiscard]] int find_gone(int waited) {
    int killed = -1;
    int left = -1;
    for (int i = 0; i < size_; ++i) {
      const int p = i == 0 ? waited : (i == waited ? 0 : i);
      if (p == rank_ || !peer_gone(p)) continue;
      const auto& ps = peers_[static_cast<std::size_t>(p)];
      const bool needed = p == waited || !ps.sendq.empty() || !ps.posted.empty() || ps.receiving;
      const bool closed = record(p).state.load(std::memory_order_acquire) == rank_left;
      if (!closed && needed) return p;
      if (!closed && killed < 0) killed = p;
      if (closed && needed && left < 0) left = p;
    }
    if (left < 0) return -1;
    return killed >= 0 ? killed : left;
  }

  [[nodiscard]] std::string dead_message(int peer) const {
    const auto& rec = record(peer);
    const bool left = rec.state.load(std::memory_order_acquire) == rank_left;
    return fmt::format("shm: rank {} (pid {}) {}", peer, rec.pid.load(),
                       left ? "closed its transport while this rank still waited on it"
                            : "is gone: its process exited or was killed");
  }

  /// A request dropped before it finished (transport::request's destructor): a wait gave up (a
  /// deadline, a failure, abort()) or the caller lost interest. Lists what was pending once,
  /// under RINGZERO_DEBUG=INFO, then cancels o.
  void abandon(op* o) noexcept {
    std::lock_guard lock(mutex_);
    if (o->state == op::status::pending && log::enabled(log::level::info) && first_give_up()) {
      try {
        log::info("shm: rank {} gave up waiting; {}", rank_, pending_list());
      } catch (...) {
        // Only a diagnostic: the cancellation below matters more.
      }
    }
    cancel(o);
  }

  /// The request's owner gave up on o before it finished. Call with mutex() held.
  void cancel(op* o) {
    auto& ps = peers_[static_cast<std::size_t>(o->peer)];
    if (o->state != op::status::pending) {
      free_op(o);
      return;
    }
    if (o->is_send) {
      if (!o->started || ps.dead) {
        ps.sendq.erase(std::find(ps.sendq.begin(), ps.sendq.end(), o));
        free_op(o);
        return;
      }
      // The receiver already holds the start of the message: finish it from a copy, as the
      // caller's buffer may be freed once the request is gone.
      o->owned.assign(o->src, o->src + o->left);
      o->src = o->owned.data();
      o->orphan = true;
      return;
    }
    if (ps.receiving && ps.into == o) {
      ps.dest = nullptr;  // the rest of the message is read and dropped
      ps.into = nullptr;
    } else {
      auto it = std::find(ps.posted.begin(), ps.posted.end(), o);
      if (it != ps.posted.end()) ps.posted.erase(it);
    }
    free_op(o);
  }

  void free_op(op* o) noexcept {
    o->owned.clear();
    o->error.clear();
    free_.push_back(o);
  }

 private:
  struct peer_state {
    std::byte* out = nullptr;
    std::byte* in = nullptr;
    std::uint64_t head = 0;       ///< slots this rank wrote to the peer
    std::uint64_t tail_seen = 0;  ///< the peer's tail as last read
    std::uint64_t tail = 0;       ///< slots this rank read from the peer
    std::deque<op*> sendq;
    std::deque<op*> posted;
    std::list<unexpected_message> unexpected;
    // The message arriving now.
    bool receiving = false;
    std::size_t offset = 0;
    std::size_t remaining = 0;
    std::byte* dest = nullptr;  ///< nullptr: drop the bytes
    op* into = nullptr;
    unexpected_message* into_unexpected = nullptr;
    bool dead = false;
  };

  [[nodiscard]] slot_header* slot(std::byte* channel, std::uint64_t n) const noexcept {
    return reinterpret_cast<slot_header*>(channel + sizeof(channel_control) +
                                          (n % geometry_.slots) * geometry_.slot_bytes);
  }
  [[nodiscard]] static channel_control* control(std::byte* channel) noexcept {
    return reinterpret_cast<channel_control*>(channel);
  }

  void progress_send(peer_state& ps) {
    while (!ps.sendq.empty()) {
      op* o = ps.sendq.front();
      while (!o->started || o->left > 0) {
        if (ps.head - ps.tail_seen >= geometry_.slots) {
          ps.tail_seen = control(ps.out)->tail.load(std::memory_order_acquire);
          if (ps.head - ps.tail_seen >= geometry_.slots) return;
        }
        slot_header* s = slot(ps.out, ps.head);
        const std::size_t len = std::min(o->left, payload_);
        s->tag = o->tag;
        s->size = o->size;
        s->len = static_cast<std::uint32_t>(len);
        if (len) std::memcpy(reinterpret_cast<std::byte*>(s) + slot_header_bytes, o->src, len);
        ++ps.head;
        s->seq.store(ps.head, std::memory_order_release);
        o->src += len;
        o->left -= len;
        o->started = true;
      }
      ps.sendq.pop_front();
      complete(o);
    }
  }

  void progress_recv(peer_state& ps) {
    for (;;) {
      slot_header* s = slot(ps.in, ps.tail);
      if (s->seq.load(std::memory_order_acquire) != ps.tail + 1) return;
      if (!ps.receiving) begin_message(ps, s->tag, s->size);
      const std::size_t len = s->len;
      if (len > ps.remaining || len > payload_)
        throw transport_error(fmt::format(
            "shm: corrupt fragment from a peer ({} bytes where {} remained of the message)", len,
            ps.remaining));
      if (ps.dest && len)
        std::memcpy(ps.dest + ps.offset, reinterpret_cast<const std::byte*>(s) + slot_header_bytes,
                    len);
      ps.offset += len;
      ps.remaining -= len;
      ++ps.tail;
      control(ps.in)->tail.store(ps.tail, std::memory_order_release);
      if (ps.remaining == 0) {
        ps.receiving = false;
        if (ps.into) complete(ps.into);
        if (ps.into_unexpected) ps.into_unexpected->complete = true;
        ps.into = nullptr;
        ps.into_unexpected = nullptr;
        ps.dest = nullptr;
      }
    }
  }

  void begin_message(peer_state& ps, std::uint64_t tag, std::uint64_t size) {
    ps.receiving = true;
    ps.offset = 0;
    ps.remaining = size;
    ps.dest = nullptr;
    ps.into = nullptr;
    ps.into_unexpected = nullptr;
    auto it = std::find_if(ps.posted.begin(), ps.posted.end(),
                           [&](const op* o) { return o->tag == tag; });
    if (it != ps.posted.end()) {
      op* o = *it;
      ps.posted.erase(it);
      if (o->size != size) {
        mismatch(o, size);
        return;
      }
      ps.dest = o->dst;
      ps.into = o;
      return;
    }
    auto& u = ps.unexpected.emplace_back();
    u.tag = tag;
    u.data.resize(size);
    ps.dest = u.data.data();
    ps.into_unexpected = &u;
  }

  void mismatch(op* o, std::size_t sent) {
    o->state = op::status::failed;
    o->error = fmt::format(
        "shm: receive from rank {} (tag {:#x}): the peer sent {} bytes but this rank posted a {} "
        "byte receive",
        o->peer, o->tag, sent, o->size);
  }

  void complete(op* o) {
    o->state = op::status::done;
    if (o->orphan) free_op(o);
  }

  [[nodiscard]] op* finish_or_keep(op* o) {
    if (o->state != op::status::done) return o;
    free_op(o);
    return nullptr;
  }

  [[nodiscard]] op* fail(op* o, std::string why) {
    o->state = op::status::failed;
    o->error = std::move(why);
    return o;
  }

  [[nodiscard]] op* make_op(int peer, std::uint64_t tag, bool is_send) {
    op* o;
    if (free_.empty()) {
      o = new op;
      all_ops_.push_back(o);
    } else {
      o = free_.back();
      free_.pop_back();
    }
    o->peer = peer;
    o->tag = tag;
    o->is_send = is_send;
    o->started = false;
    o->orphan = false;
    o->state = op::status::pending;
    o->src = nullptr;
    o->dst = nullptr;
    o->left = 0;
    o->size = 0;
    return o;
  }

  mapping seg_;
  int rank_;
  int size_;
  layout geometry_;
  std::size_t payload_ = 0;
  std::vector<peer_state> peers_;
  std::vector<op*> all_ops_;
  std::vector<op*> free_;
  std::mutex mutex_;
  bool gave_up_ = false;
  ringzero::detail::abort_state abort_;
};

}  // namespace ringzero::shm::detail
