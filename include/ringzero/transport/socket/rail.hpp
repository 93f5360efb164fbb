// One rail of the socket transport: this rank's TCP connections on one interface, one to each
// peer, as a rail kind of the transport kit (transport/detail/rail.hpp: post, poll, cancel, link
// state, price). The kit's rail engine (transport/detail/rail_engine.hpp) stripes messages over
// the rails, numbers and acknowledges them, and moves them off a rail that fails; a rail only
// moves frames and matches them.
//
// Frames: a 40-byte header (wire.hpp) and, for data, the payload, sent with one sendmsg per
// batch (many frames, up to connection_limits::write_batch_bytes, then the rail reads before it
// writes more) and read with one readv that puts a payload straight into its receive's buffer and
// the next headers into a staging buffer. Each frame carries its piece's offset and its message's
// size, so a receive takes any cut of its message (rail_traits::places_pieces): the sender cuts
// by the rates the receiver measures here (connection.hpp, rate_meter) and reports in its
// statements. Matching is on the host (tag_matching.hpp); a message nobody posted for waits in a
// buffer of its own until a receive claims it, the rest of it then going straight into that
// receive. A peer that closes its transport says goodbye on every connection, naming the rank it
// saw fail first.
//
// Progress is the caller's: everything runs inside poll(), post() and inject(), nothing blocks.
// The rails of one transport share one poll() over all their connections (poller).
#pragma once

#include <fmt/core.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ringzero/log.hpp"
#include "ringzero/transport/detail/delivery.hpp"
#include "ringzero/transport/detail/interfaces.hpp"
#include "ringzero/transport/detail/rail.hpp"
#include "ringzero/transport/detail/tag_matching.hpp"
#include "ringzero/transport/socket/connection.hpp"
#include "ringzero/transport/socket/wire.hpp"
#include "ringzero/tuning/defaults.hpp"

namespace ringzero::socket::detail {

struct rail_limits {
  /// The largest message: what a frame header may announce, and an isend may send. Far above
  /// what one host holds, it only keeps sizes and offsets clear of overflow; what bounds a
  /// receiver's memory is that a message nobody posted for holds only the bytes that arrived
  /// (arrival::held).
  static constexpr std::uint64_t max_message_bytes = std::uint64_t{1} << 40;
  /// Where the bytes of discarded payloads (a receive of the wrong size) go.
  static constexpr std::size_t scratch_bytes = std::size_t{256} << 10;
  /// The largest injected send: the engine's copied sends (delivery::limits::copy_bytes).
  static constexpr std::size_t inject_bytes = std::size_t{64} << 10;
  /// Operations a rail takes at once, each way: a connection queues what it cannot write yet,
  /// so the engine need not hold any back.
  static constexpr std::size_t queue_limit = std::size_t{1} << 20;
};

/// One poll() over the connections of every rail of a transport, each time a rail finds the
/// last results already used: the engine polls its rails in turn, so the first pays for all.
class poller {
 public:
  explicit poller(std::size_t rails) : fresh_(rails, false) {}

  void add(std::size_t rail, connection* c) {
    entries_.push_back({rail, c});
    revents_.push_back(0);
  }

  /// Calls f(connection, revents) for each of `rail`'s connections with something to do.
  template <class F>
  void each(std::size_t rail, F&& f) {
    if (!fresh_[rail]) refresh();
    fresh_[rail] = false;
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      if (entries_[i].rail != rail || revents_[i] == 0) continue;
      const short re = std::exchange(revents_[i], short{0});
      f(*entries_[i].c, re);
    }
  }

 private:
  void refresh() {
    fds_.clear();
    index_.clear();
    std::fill(revents_.begin(), revents_.end(), short{0});
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      const connection& c = *entries_[i].c;
      if (!c.alive) continue;
      fds_.push_back({c.fd.get(), static_cast<short>(POLLIN | (c.has_output() ? POLLOUT : 0)), 0});
      index_.push_back(i);
    }
    if (!fds_.empty() && ::poll(fds_.data(), fds_.size(), 0) > 0)
      for (std::size_t j = 0; j < fds_.size(); ++j) revents_[index_[j]] = fds_[j].revents;
    std::fill(fresh_.begin(), fresh_.end(), true);
  }

  struct entry {
    std::size_t rail;
    connection* c;
  };
  std::vector<entry> entries_;
  std::vector<short> revents_;
  std::vector<bool> fresh_;
  std::vector<pollfd> fds_;
  std::vector<std::size_t> index_;
};

class rail {
 public:
  using scratch = op_scratch;
  using op = detail::op;

  rail(std::string name, std::size_t index, int size, std::shared_ptr<poller> polls)
      : name_(std::move(name)),
        index_(index),
        conns_(static_cast<std::size_t>(size)),
        polls_(std::move(polls)),
        scratch_(rail_limits::scratch_bytes) {}
  rail(const rail&) = delete;
  rail& operator=(const rail&) = delete;

  /// Reads what arrived, so that closing does not reset the connection under the bytes the peer
  /// has yet to read, and closes.
  ~rail() {
    for (auto& c : conns_)
      if (c && c->fd) {
        std::byte sink[4096];
        while (::recv(c->fd.get(), sink, sizeof sink, MSG_DONTWAIT) > 0) {
        }
        ::shutdown(c->fd.get(), SHUT_WR);
        c->fd.reset();
      }
  }

  /// Adopts `fd` as the connection to `peer` (connected, non-blocking): the handshake's.
  void adopt(int peer, unique_fd fd) {
    auto& c = conns_[static_cast<std::size_t>(peer)];
    c = std::make_unique<connection>();
    c->fd = std::move(fd);
    c->peer = peer;
    c->alive = true;
    c->rx.resize(connection_limits::rx_bytes);
    polls_->add(index_, c.get());
  }

  // The rail concept (transport/detail/rail.hpp).

  [[nodiscard]] long post(op& o) noexcept {
    try {
      connection* c = at(o.world_peer);
      if (o.is_send) {
        if (!usable(c)) return fail(o, c), 0;
        c->out.push_back({.h = header_of(o), .o = &o});
        c->bundled = 0;
        if (c->out.size() == 1) flush(*c);
        return 0;
      }
      if (auto kept = matcher_.claim(o)) return take(o, *kept->second), 0;
      if (o.world_peer >= 0 && !usable(c)) return fail(o, c), 0;
      matcher_.post(&o);
      return 0;
    } catch (...) {
      return -ENOMEM;
    }
  }

  /// Writes the message now, after what was bundled before it (`more`), and keeps what the
  /// socket did not take; -EAGAIN behind a frame still queued, which it would overtake.
  [[nodiscard]] long inject(const ringzero::detail::rail_message& m) noexcept {
    try {
      connection* c = at(m.peer);
      if (!usable(c)) return -ECONNRESET;
      if (c->out.size() > c->bundled) return -EAGAIN;
      outgoing f{.h = header_of(m)};
      if (m.more) {
        f.own.assign(m.bytes.begin(), m.bytes.end());
        c->out.push_back(std::move(f));
        ++c->bundled;
        return 0;
      }
      f.borrowed = m.bytes;
      c->out.push_back(std::move(f));
      c->bundled = 0;
      flush(*c);
      // What the socket did not take becomes the rail's: the caller's bytes may go now.
      if (!c->out.empty() && !c->out.back().o && c->out.back().own.empty() &&
          c->out.back().h.length > 0) {
        auto& last = c->out.back();
        last.own.assign(last.borrowed.begin(), last.borrowed.end());
        last.borrowed = {};
      }
      return 0;
    } catch (...) {
      return -ENOMEM;
    }
  }

  void cancel(op& o) noexcept {
    if (!o.is_send) {
      if (matcher_.withdraw(&o))
        events_.push_back({.o = &o, .fault = fault_t::cancelled, .why = "cancelled"});
      return;
    }
    connection* c = at(o.world_peer);
    if (!c) return;
    // A frame begun must be finished: the stream would lose its framing.
    for (std::size_t i = c->partial > 0 ? 1 : 0; i < c->out.size(); ++i)
      if (c->out[i].o == &o) {
        c->out.erase(c->out.begin() + static_cast<std::ptrdiff_t>(i));
        events_.push_back({.o = &o, .fault = fault_t::cancelled, .why = "cancelled"});
        return;
      }
  }

  void poll(ringzero::detail::rail_events<op>& events) {
    polls_->each(index_, [&](connection& c, short re) {
      if (c.alive && (re & (POLLIN | POLLHUP | POLLERR))) read(c);
      if (c.alive && (re & POLLOUT)) flush(c);
    });
    // One at a time, taken off first: the engine may poll again from inside an event.
    while (!events_.empty()) {
      const event e = std::move(events_.front());
      events_.pop_front();
      if (e.kind == event::left)
        events.peer_left(e.peer, e.culprit);
      else if (e.kind == event::lost)
        events.link_failed(e.peer, e.why);
      else if (e.fault)
        events.failed(*e.o, *e.fault, e.why, e.sent, e.word, e.with_word);
      else
        events.done(*e.o, e.len, e.word, e.with_word);
    }
  }

  /// Why the interface's link is down (sysfs), or empty; a rail named by its address has none.
  [[nodiscard]] std::string link_state() const { return ringzero::detail::link_down(name_); }
  [[nodiscard]] tuning::rail_price price() const noexcept {
    return tuning::defaults::socket_rail.value;
  }
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] ringzero::detail::rail_traits traits() const noexcept {
    return {.send_limit = rail_limits::queue_limit,
            .receive_limit = rail_limits::queue_limit,
            .inject_size = rail_limits::inject_bytes,
            .max_message_size = rail_limits::max_message_bytes,
            .places_pieces = true,
            .rebuffers = true,
            .bundles = true};
  }
  [[nodiscard]] std::string error_text(long rc) const {
    return std::strerror(static_cast<int>(rc < 0 ? -rc : rc));
  }
  /// The rate `peer`'s bytes arrive at on this rail, KiB/s (0: not measured yet).
  [[nodiscard]] std::uint32_t arrival_rate(int peer) const noexcept {
    const auto& c = conns_[static_cast<std::size_t>(peer)];
    return c ? c->meter.kib_per_second() : 0;
  }

  /// One step of closing: a goodbye on every connection (naming the rank this one saw fail
  /// first, if any), after what is still queued, and the connections read meanwhile. True once
  /// every goodbye is written whole (a peer that then read half a frame and the end of the
  /// stream would blame this rank for the failure).
  [[nodiscard]] bool close_step(int culprit) noexcept {
    bool done = true;
    try {
      for (auto& c : conns_) {
        if (!c || !c->alive) continue;
        if (!c->bye_queued) {
          c->out.push_back({.h = frame_header::bye(culprit)});
          c->bundled = 0;
          c->bye_queued = true;
        }
        flush(*c);
        if (c->alive) read(*c);
        done = done && (!c->alive || c->out.empty());
      }
    } catch (...) {
      return true;  // closing goes on regardless
    }
    return done;
  }

  /// For tests: breaks the connection to `peer`, as a reset would.
  void break_connection(int peer) {
    if (connection* c = at(peer); c && c->alive) ::shutdown(c->fd.get(), SHUT_RDWR);
  }

 private:
  using fault_t = ringzero::detail::rail_fault;

  /// What poll() reports, in the order it happened.
  struct event {
    enum kind_t : std::uint8_t { op_ended, lost, left };
    kind_t kind = op_ended;
    op* o = nullptr;
    std::optional<fault_t> fault{};
    std::string why{};
    std::size_t len = 0;
    std::size_t sent = 0;
    std::uint64_t word = 0;
    bool with_word = false;
    int peer = -1;
    int culprit = -1;
  };

  [[nodiscard]] connection* at(int peer) noexcept {
    return peer < 0 ? nullptr : conns_[static_cast<std::size_t>(peer)].get();
  }
  [[nodiscard]] static bool usable(const connection* c) noexcept {
    return c && c->alive && !c->got_bye;
  }
  /// An operation toward a peer this rail cannot reach.
  void fail(op& o, const connection* c) {
    std::string why = !c ? "no connection" : c->got_bye ? "it closed its transport" : c->why;
    events_.push_back({.o = &o, .fault = fault_t::peer_lost, .why = std::move(why)});
  }

  [[nodiscard]] static frame_header header_of(const op& o) noexcept {
    return {.kind = frame_kind::data,
            .piece = o.piece,
            .with_word = static_cast<std::uint8_t>(o.with_data ? 1 : 0),
            .word = static_cast<std::uint32_t>(o.data),
            .length = o.length,
            .tag = o.tag,
            .total = std::max(o.total, o.offset + o.length),
            .offset = o.offset};
  }
  [[nodiscard]] static frame_header header_of(const ringzero::detail::rail_message& m) noexcept {
    return {.kind = frame_kind::data,
            .piece = m.piece,
            .with_word = static_cast<std::uint8_t>(m.with_data ? 1 : 0),
            .word = static_cast<std::uint32_t>(m.data),
            .length = m.bytes.size(),
            .tag = m.tag,
            .total = std::max(m.total, m.offset + m.bytes.size()),
            .offset = m.offset};
  }

  /// A frame with header `h` fits receive `o`: its message's size where the receive takes any
  /// cut, else no more than the receive holds.
  [[nodiscard]] static bool fits(const op& o, const frame_header& h) noexcept {
    return o.placed ? h.total == o.length : h.length <= o.length && h.offset == 0;
  }
  void refuse(op& o, const frame_header& h) {
    events_.push_back({.o = &o,
                       .fault = fault_t::truncated,
                       .why = "the message does not fit the receive",
                       .sent = o.placed ? h.total : h.length,
                       .word = h.word,
                       .with_word = h.with_word != 0});
  }
  void finished(op& o, const frame_header& h) {
    events_.push_back({.o = &o, .len = h.length, .word = h.word, .with_word = h.with_word != 0});
  }

  /// Receive `o` claims a message that arrived before it was posted.
  void take(op& o, arrival& a) {
    if (a.lost) {
      events_.push_back({.o = &o, .fault = fault_t::peer_lost, .why = a.why});
      return;
    }
    if (!fits(o, a.h)) {
      a.discard = true;
      return refuse(o, a.h);
    }
    std::byte* dest = o.buffer + (o.placed ? a.h.offset : 0);
    a.give(dest);
    if (a.complete) return finished(o, a.h);
    // Still arriving: the rest goes straight into the receive.
    a.waiting = &o;
    a.dest = dest;
  }

  void flush(connection& c) {
    const int err = c.write([&](outgoing& f) {
      if (f.o) events_.push_back({.o = f.o, .len = f.h.length});
    });
    if (err == 0) return;
    // A peer that closed its transport said goodbye first, naming the rank it saw fail; the
    // goodbye may wait unread behind the reset that failed this write. Read it before calling
    // the connection failed, or this rank blames a survivor for another's death.
    read(c);
    if (c.alive) lost(c, fmt::format("send failed: {}", std::strerror(err)));
  }

  /// The connection broke: its operations fail, and the engine hears which peer it lost.
  void lost(connection& c, std::string why) {
    c.alive = false;
    c.fd.reset();
    c.why = why;
    events_.push_back({.kind = event::lost, .why = why, .peer = c.peer});
    abandon(c, why);
  }

  /// Fails every operation tied to the connection, which will move no more frames. Messages that
  /// arrived whole are still received.
  void abandon(connection& c, const std::string& why) {
    for (auto& f : c.out)
      if (f.o) events_.push_back({.o = f.o, .fault = fault_t::peer_lost, .why = why});
    c.out.clear();
    c.partial = 0;
    c.bundled = 0;
    if (c.target) events_.push_back({.o = c.target, .fault = fault_t::peer_lost, .why = why});
    c.target = nullptr;
    if (c.kept && !c.kept->complete) {
      c.kept->lost = true;
      c.kept->why = why;
      if (c.kept->waiting)
        events_.push_back({.o = c.kept->waiting, .fault = fault_t::peer_lost, .why = why});
      c.kept->waiting = nullptr;
    }
    c.kept.reset();
    c.in_payload = false;
    for (op* o : matcher_.withdraw_peer(c.peer))
      events_.push_back({.o = o, .fault = fault_t::peer_lost, .why = why});
  }

  /// Reads what the connection has, frame by frame.
  void read(connection& c) {
    bool more = true;
    for (int rounds = 0; c.alive && rounds < 64; ++rounds) {
      // Frames already in the staging buffer.
      for (;;) {
        if (c.in_payload) {
          const std::size_t avail = c.rx_end - c.rx_begin;
          if (avail == 0) break;
          std::size_t room = 0;
          std::byte* t = c.payload_target(room);
          const std::size_t take = std::min(avail, room);
          if (t) std::memcpy(t, c.rx.data() + c.rx_begin, take);
          c.rx_begin += take;
          received(c, take);
          continue;
        }
        if (c.rx_end - c.rx_begin < sizeof(frame_header)) break;
        frame_header h;
        std::memcpy(&h, c.rx.data() + c.rx_begin, sizeof h);
        c.rx_begin += sizeof h;
        if (!on_header(c, h)) return;
      }
      // Everything read is parsed: a frame is still arriving if its payload is part-read or
      // part of its header is (a whole statement read alone does not count: the time until the
      // next read would be idle time).
      c.meter.sampling = c.in_payload || c.rx_end > c.rx_begin;
      if (!more) return;  // the last read left the socket empty
      // What is left is part of a header: to the front.
      if (c.rx_begin > 0) {
        std::memmove(c.rx.data(), c.rx.data() + c.rx_begin, c.rx_end - c.rx_begin);
        c.rx_end -= c.rx_begin;
        c.rx_begin = 0;
      }
      // One readv: the rest of the current payload straight into place, then the staging
      // buffer for the frames after it.
      iovec iov[2];
      int k = 0;
      std::size_t direct = 0;
      if (c.in_payload && c.rx_begin == c.rx_end) {
        std::byte* t = c.payload_target(direct);
        if (!t) {
          t = scratch_.data();
          direct = std::min(direct, scratch_.size());
        }
        iov[k++] = {t, direct};
      }
      iov[k++] = {c.rx.data() + c.rx_end, c.rx.size() - c.rx_end};
      const std::size_t asked = direct + (c.rx.size() - c.rx_end);
      const ssize_t n = ::readv(c.fd.get(), iov, k);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        return lost(c, fmt::format("receive failed: {}", std::strerror(errno)));
      }
      if (n == 0) return lost(c, "the connection was closed");
      auto got = static_cast<std::size_t>(n);
      more = got == asked;
      const std::size_t into_direct = std::min(got, direct);
      got -= into_direct;
      c.rx_end += got;
      if (into_direct > 0) received(c, into_direct);
      c.meter.arrived(static_cast<std::uint64_t>(n), clock::now());
    }
  }

  /// `n` more bytes of the current payload are in place.
  void received(connection& c, std::size_t n) {
    c.cur_got += n;
    if (c.kept) c.kept->got = c.cur_got;
    if (c.cur_got == c.cur.length) end_payload(c);
  }

  /// A frame header read; false once the connection moves no more frames.
  bool on_header(connection& c, const frame_header& h) {
    // Every field that sizes, places or names is checked before anything is allocated for the
    // frame or a byte of its payload copied.
    if (h.kind == frame_kind::bye && h.word > conns_.size())
      return violation(c, fmt::format("a goodbye naming rank {}", static_cast<long>(h.word) - 1));
    if (h.kind != frame_kind::bye && h.kind != frame_kind::data)
      return violation(c, fmt::format("a frame of unknown kind {}", static_cast<unsigned>(h.kind)));
    if (h.kind == frame_kind::data) {
      const char* bad = h.total > rail_limits::max_message_bytes ? "a message over the size limit"
                        : h.offset > h.total || h.length > h.total - h.offset
                            ? "a piece outside its message"
                        : h.piece > ringzero::detail::delivery::limits::control_piece
                            ? "a piece number out of range"
                            : nullptr;
      if (bad)
        return violation(c, fmt::format("{} ({} bytes at offset {} of a {}-byte message)", bad,
                                        h.length, h.offset, h.total));
    }
    if (h.kind == frame_kind::bye) {
      // The peer closes its transport: nothing more comes on this connection, and nothing more
      // is read from it. Whole messages it sent are still received.
      c.got_bye = true;
      c.alive = false;
      events_.push_back(
          {.kind = event::left, .peer = c.peer, .culprit = static_cast<int>(h.word) - 1});
      abandon(c, "it closed its transport");
      return false;
    }
    c.cur = h;
    c.cur_got = 0;
    c.in_payload = true;
    c.target = nullptr;
    c.kept.reset();
    if (op* r = matcher_.match(c.peer, h.piece, h.tag)) {
      if (fits(*r, h)) {
        c.target = r;
        c.target_at = r->buffer + (r->placed ? h.offset : 0);
      } else {
        refuse(*r, h);  // its payload goes nowhere
      }
    } else {
      auto a = std::make_shared<arrival>();
      a->h = h;
      matcher_.keep(c.peer, h.piece, h.tag, a);
      c.kept = std::move(a);
    }
    if (h.length == 0) end_payload(c);
    return true;
  }

  /// A frame no rank of this job sends: the connection is given up (as if it broke), since
  /// nothing after it on that stream can be trusted to be framed right.
  bool violation(connection& c, const std::string& what) {
    log::error("socket: rank {} sent {} on rail {}; giving the connection up", c.peer, what, name_);
    lost(c, fmt::format("protocol violation: {}", what));
    return false;
  }

  void end_payload(connection& c) {
    c.in_payload = false;
    if (c.target) {
      finished(*c.target, c.cur);
      c.target = nullptr;
      return;
    }
    if (!c.kept) return;
    std::shared_ptr<arrival> a = std::move(c.kept);
    a->complete = true;
    if (a->waiting && !a->discard) finished(*a->waiting, a->h);
    a->waiting = nullptr;
  }

  std::string name_;
  std::size_t index_;
  std::vector<std::unique_ptr<connection>> conns_;  ///< by world rank; none for this one
  std::shared_ptr<poller> polls_;
  ringzero::detail::tag_matcher<op, std::shared_ptr<arrival>> matcher_;
  std::deque<event> events_;
  std::vector<std::byte> scratch_;
};
static_assert(ringzero::detail::rail_kind<rail>);

}  // namespace ringzero::socket::detail
