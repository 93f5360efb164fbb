// The socket transport's progress engine: one process's TCP connections to its peers, one per
// rail and peer, and the messages moving over them. Everything runs in the caller's thread,
// inside test() and progress() (the concept's progress rule); nothing blocks.
//
// Wire format: frames of a 40-byte header (wire.hpp) and, for data, the payload. A message is
// sent as one piece on one rail when small, or cut into pieces spread over the rails when
// large; each piece carries the message's sequence number (per ordered pair of ranks), its tag,
// the message's size and the piece's offset, so pieces may arrive on any rail in any order.
// Messages are matched in the order they were sent (their sequence numbers), which keeps the
// concept's rule that messages with the same (peer, tag) match in posting order across rails.
// The receiver acknowledges the pieces it read, per connection (a count); a send completes
// once every piece of it was acknowledged, and a piece is kept until then, so that when a
// rail fails, the pieces it had not delivered go again over the rails that are left (the
// receiver drops pieces it already has). A small send (up to engine_limits::eager_bytes) is
// copied and completes once the kernel has taken all of it: waiting for its acknowledgement
// doubled the latency of a small message (a frame there and one back); the copy is what goes
// again if its rail fails before the acknowledgement comes.
#pragma once

#include <fmt/core.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ringzero/bootstrap/detail/socket.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/abort_state.hpp"
#include "ringzero/transport/socket/wire.hpp"

namespace ringzero::socket::detail {

using clock = std::chrono::steady_clock;
using bootstrap::detail::unique_fd;

/// The engine's limits, named once.
struct engine_limits {
  /// Bytes one write() puts into a connection at most before the engine turns to reading, and
  /// the iovec entries one sendmsg() may use. Both directions of a ring step run at once, and
  /// on one host the kernel's copy into the peer's socket is the sender's work: a rank that
  /// wrote a whole 1 MiB step before reading found what had arrived meanwhile out of its caches.
  /// On loopback, 2 ranks, a cap of 256 KiB against none took 1 MiB all_reduce from 295-355 µs
  /// to 187-237 and 4 MiB from 1,237-1,273 to 774-853 (docs/performance.md); 128 KiB did as well
  /// at 1-4 MiB and worse at 16 MiB, 512 KiB worse below 16 MiB.
  static constexpr std::size_t write_batch_bytes = std::size_t{256} << 10;
  static constexpr std::size_t write_batch_iov = 64;
  /// Each connection's staging buffer for reads: headers and small payloads come in through
  /// it, many per recv; larger payloads are read straight into the receive's buffer.
  static constexpr std::size_t rx_bytes = std::size_t{256} << 10;
  /// Where the bytes of discarded pieces (duplicates, mismatched or abandoned receives) go.
  static constexpr std::size_t scratch_bytes = std::size_t{256} << 10;
  /// The largest piece: larger messages are cut into more pieces than there are rails, so that
  /// the rails that drain first take more of them.
  static constexpr std::size_t max_piece_bytes = std::size_t{4} << 20;
  /// The largest message: what a frame header may announce. Far above what one host holds,
  /// it only keeps sizes and offsets clear of overflow; what bounds a receiver's memory is
  /// that an unmatched message holds only the pieces that arrived (incoming::hold).
  static constexpr std::uint64_t max_message_bytes = std::uint64_t{1} << 40;
  /// A striped message is cut into one piece per live rail at least, and up to this many while
  /// pieces stay over min_piece_bytes: the granularity of its division among rails of different
  /// rates.
  static constexpr std::size_t pieces_per_rail = 8;
  static constexpr std::size_t min_piece_bytes = std::size_t{64} << 10;
  /// How long a rank that has seen another die lets completions already on their way arrive
  /// before its other waits fail too.
  static constexpr std::chrono::milliseconds settle{200};
  /// Sends up to this size complete when written (above, when acknowledged). Below the socket
  /// policy's smallest pipeline chunk (tuning::defaults::socket), so that a pipeline's chunks
  /// still complete only once received and cannot run ahead of the receiver.
  static constexpr std::size_t eager_bytes = std::size_t{64} << 10;
  /// Pieces of eager sends a connection reads before it acknowledges them in a frame of its
  /// own; until then an acknowledgement rides on the next data it writes. Nothing waits on
  /// those acknowledgements but the sender's copies, so sending each alone only cost a
  /// sendmsg() here and a read there per small message.
  static constexpr std::uint64_t lazy_ack_pieces = 16;
};

/// One posted send or receive.
struct op {
  enum class status : std::uint8_t { pending, done, failed };
  bool is_send = false;
  int peer = -1;
  tag_t tag = 0;
  std::byte* data = nullptr;
  std::size_t size = 0;
  status state = status::pending;
  std::string error;
  int error_peer = -1;
  bool peer_loss = false;       ///< fails with peer_error (else transport_error)
  std::size_t pieces_left = 0;  ///< sends: pieces not yet acknowledged
  std::size_t unwritten = 0;    ///< eager sends: pieces not yet written whole
  bool orphaned = false;        ///< its request is gone; a send finishes from `copy`
  std::vector<std::byte> copy;
  struct incoming* attached = nullptr;  ///< receives: the message being read into it

  /// A small send: sent from `copy`, done once written whole (engine_limits::eager_bytes).
  [[nodiscard]] bool eager() const noexcept {
    return is_send && size <= engine_limits::eager_bytes;
  }
};

/// A message from a peer, from its first piece's arrival until it is read whole and matched.
struct incoming {
  std::uint64_t seq = 0;
  tag_t tag = 0;
  std::size_t total = 0;
  /// Every piece announced so far, offset to length: pieces never overlap.
  std::map<std::uint64_t, std::size_t> pieces;
  /// Its pieces' bytes until a receive is matched with it, by offset: each allocated when its
  /// piece's header arrives, at the piece's length (checked against the message first), so an
  /// unmatched message holds what its sender sent, never what a header claims is coming.
  std::map<std::uint64_t, std::vector<std::byte>> held;
  std::shared_ptr<op> recv;  ///< the receive it goes into
  bool matched = false;      ///< its turn came: given to a receive or queued unexpected
  bool discard = false;      ///< its bytes go nowhere (size mismatch, receive abandoned)
  std::size_t got = 0;
  std::vector<std::uint64_t> done_offsets;  ///< pieces read whole (duplicates are dropped)

  [[nodiscard]] bool complete() const noexcept { return got == total; }
  /// Takes in the piece at [offset, offset + length), which on_header checked lies within the
  /// message, with room for its bytes while no receive is matched. False when it contradicts
  /// the pieces announced before: another length at that offset (a piece sent again after a
  /// rail failed is the same piece), or bytes another piece covers.
  [[nodiscard]] bool admit(std::uint64_t offset, std::size_t length) {
    const auto next = pieces.lower_bound(offset);
    if (next != pieces.end() && next->first == offset) return next->second == length;
    if (next != pieces.end() && next->first - offset < length) return false;
    if (next != pieces.begin() && offset - std::prev(next)->first < std::prev(next)->second)
      return false;
    pieces.emplace_hint(next, offset, length);
    if (!discard && !recv) held.emplace(offset, std::vector<std::byte>(length));
    return true;
  }
  /// Where byte `at` of the piece starting at `offset` goes, or nullptr: nowhere.
  [[nodiscard]] std::byte* target(std::uint64_t offset, std::size_t at) {
    if (discard) return nullptr;
    if (recv) return recv->data + offset + at;
    const auto it = held.find(offset);
    return it == held.end() ? nullptr : it->second.data() + at;
  }
  void drop_held() noexcept { held.clear(); }
};

/// A piece of a send, queued on one connection until acknowledged.
struct piece {
  std::shared_ptr<op> o;
  frame_header h{};
  [[nodiscard]] std::size_t frame_bytes() const noexcept { return sizeof(frame_header) + h.length; }
};

/// One TCP connection to a peer, on one rail.
struct connection {
  unique_fd fd;
  int rail = 0;
  bool alive = false;
  // Output: out[0 .. written) are on the wire awaiting acknowledgement; out[written] has
  // `partial` bytes written; the rest wait.
  std::deque<piece> out;
  std::size_t written = 0;
  std::size_t partial = 0;
  std::size_t queued_bytes = 0;  ///< payload bytes in `out`
  std::uint64_t acked = 0;       ///< pieces of this connection acknowledged so far
  // Control frames (acknowledgements, goodbye), written only between data frames.
  frame_header ctrl{};
  std::size_t ctrl_len = 0;
  std::size_t ctrl_off = 0;
  bool bye_due = false;
  bool bye_sent = false;
  // Input.
  std::vector<std::byte> rx;
  std::size_t rx_begin = 0;
  std::size_t rx_end = 0;
  bool in_payload = false;
  frame_header cur{};
  std::size_t cur_got = 0;
  std::shared_ptr<incoming> cur_msg;
  std::uint64_t received = 0;  ///< data frames read whole
  bool ack_due = false;  ///< a frame read since the last acknowledgement belongs to a send that
                         ///< completes only when acknowledged (over eager_bytes)
  std::uint64_t ack_sent = 0;  ///< the count last acknowledged
  bool got_bye = false;
  std::uint64_t bytes_out = 0;  ///< payload bytes acknowledged (for statistics)
  // The rail's rate, measured where the bytes arrive: payload read over the time between
  // reads, counted only while a frame was still arriving in between (so idle time is not), in
  // windows of at least rate_window bytes; the estimate is the best of the last
  // rate_samples windows (a max filter, as TCP BBR keeps its bandwidth estimate). The receiver
  // reports its figure in every acknowledgement; `rate` is the peer's figure for this
  // connection's outgoing direction, what a striped message's pieces are placed by
  // (weighted_pick). Why these choices: a window can only come out low, never high (time the
  // receiver spent elsewhere while a frame sat whole in the kernel counts as arrival time), and
  // more so on a rail that carries little, so a smoothed mean would starve that rail of
  // pieces and of the windows that could correct it; and acknowledgement times would be worse
  // still, since an acknowledgement waits behind the reverse direction's data.
  clock::time_point rx_last{};
  bool rx_sampling = false;  ///< a frame was arriving at rx_last
  std::uint64_t window_bytes = 0;
  std::int64_t window_ns = 0;
  std::array<double, 4> samples{};  ///< the last windows' rates, bytes per second
  std::size_t next_sample = 0;
  double rx_rate = 0;  ///< bytes per second arriving on this connection; 0: not measured yet
  double rate = 0;     ///< the peer's rx_rate for what this side sends; 0: not reported yet

  static constexpr std::uint64_t rate_window = std::uint64_t{1} << 20;

  /// Queues a piece of `len` payload bytes.
  void enqueue(piece&& p, std::size_t len) {
    queued_bytes += len;
    out.push_back(std::move(p));
  }

  /// `bytes` read at `now`: the interval since the last read is a sample if a frame was
  /// arriving all along (rx_sampling, which the reader sets once it has parsed what it read);
  /// once a window is full, rx_rate is the best of the last windows.
  void arrived(std::uint64_t bytes, clock::time_point now) noexcept {
    if (rx_sampling) {
      window_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(now - rx_last).count();
      window_bytes += bytes;
      if (window_bytes >= rate_window && window_ns > 0) {
        samples[next_sample++ % samples.size()] =
            static_cast<double>(window_bytes) * 1e9 / static_cast<double>(window_ns);
        rx_rate = *std::max_element(samples.begin(), samples.end());
        window_bytes = 0;
        window_ns = 0;
      }
    }
    rx_last = now;
  }

  /// rx_rate as an acknowledgement carries it: KiB/s, at least 1 once measured, 0 before.
  [[nodiscard]] std::uint32_t rx_rate_field() const noexcept {
    if (rx_rate <= 0) return 0;
    const double kib = rx_rate / 1024.0;
    return kib >= 4294967295.0 ? 4294967295u
                               : std::max<std::uint32_t>(1, static_cast<std::uint32_t>(kib));
  }
};

/// Where the next piece of `len` bytes to a peer goes: with `weighted`, the live connection that
/// would finish it first at its measured rate, (queued + len) / rate (a rail not measured yet,
/// or within a quarter of the fastest, counts as the fastest); else, or while
/// no rail is measured, the one with the fewest bytes queued. Ties go to the first from `start`
/// (round robin). Returns conns.size() when none is alive.
[[nodiscard]] inline std::size_t weighted_pick(const std::vector<connection>& conns,
                                               std::size_t start, std::size_t len,
                                               bool weighted) noexcept {
  constexpr double near_fastest = 0.75;
  const std::size_t n = conns.size();
  double fastest = 0;
  if (weighted)
    for (const auto& c : conns)
      if (c.alive) fastest = std::max(fastest, c.rate);
  std::size_t best = n;
  double best_cost = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t at = (start + i) % n;
    const connection& c = conns[at];
    if (!c.alive) continue;
    const double bytes = static_cast<double>(c.queued_bytes + len);
    // Rates within a quarter of the fastest count as the fastest: windows of alike rails
    // differ by that much from noise alone, and weighing by noise costs alike rails more than
    // the finer division gains.
    const double r = c.rate > 0 && c.rate < near_fastest * fastest ? c.rate : fastest;
    const double cost = fastest > 0 ? bytes / r : bytes;
    if (best == n || cost < best_cost) {
      best = at;
      best_cost = cost;
    }
  }
  return best;
}

struct peer_state {
  std::vector<connection> conns;  ///< one per rail
  std::uint64_t send_seq = 0;
  std::uint64_t next_match = 0;
  std::map<std::uint64_t, std::shared_ptr<incoming>> arriving;
  std::map<tag_t, std::deque<std::shared_ptr<op>>> posted;
  std::map<tag_t, std::deque<std::shared_ptr<incoming>>> unexpected;
  std::size_t next_rail = 0;
  bool gone = false;
  std::string why;   ///< why it is gone
  int culprit = -1;  ///< the rank its loss is blamed on
  bool graceful = false;
};

class engine {
 public:
  /// `weighted`: a striped message's pieces go to the rails in proportion to their measured
  /// rates (weighted_pick); false: to the least loaded.
  engine(int rank, int size, std::vector<std::string> rail_names, std::size_t stripe_bytes,
         bool weighted = true)
      : rank_(rank),
        rail_names_(std::move(rail_names)),
        stripe_bytes_(stripe_bytes),
        weighted_(weighted),
        peers_(static_cast<std::size_t>(size)),
        scratch_(engine_limits::scratch_bytes) {}
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  ~engine() { close(std::chrono::seconds(2)); }

  /// Adopts `fd` as the connection to `peer` on `rail` (connected, non-blocking).
  void adopt(int peer, int rail, unique_fd fd) {
    auto& ps = peers_[static_cast<std::size_t>(peer)];
    if (ps.conns.size() < rail_names_.size()) ps.conns.resize(rail_names_.size());
    auto& c = ps.conns[static_cast<std::size_t>(rail)];
    c.fd = std::move(fd);
    c.rail = rail;
    c.alive = true;
    c.rx.resize(engine_limits::rx_bytes);
  }

  [[nodiscard]] std::mutex& mutex() const noexcept { return mutex_; }
  [[nodiscard]] int rails() const noexcept { return static_cast<int>(rail_names_.size()); }
  [[nodiscard]] const std::string& rail_name(int r) const {
    return rail_names_[static_cast<std::size_t>(r)];
  }

  /// Connections to `peer` that still work.
  [[nodiscard]] int live_rails(int peer) const {
    std::lock_guard lock(mutex_);
    int n = 0;
    for (const auto& c : peers_[static_cast<std::size_t>(peer)].conns) n += c.alive;
    return n;
  }
  /// Payload bytes acknowledged on each rail, over all peers.
  [[nodiscard]] std::vector<std::uint64_t> rail_bytes() const {
    std::lock_guard lock(mutex_);
    std::vector<std::uint64_t> b(rail_names_.size(), 0);
    for (const auto& ps : peers_)
      for (std::size_t r = 0; r < ps.conns.size(); ++r) b[r] += ps.conns[r].bytes_out;
    return b;
  }

  /// Each rail's rate toward `peer` as the peer measured it (bytes per second; 0 until it
  /// reported one): what striped pieces are placed by.
  [[nodiscard]] std::vector<double> rail_rates(int peer) const {
    std::lock_guard lock(mutex_);
    std::vector<double> r(rail_names_.size(), 0.0);
    const auto& conns = peers_[static_cast<std::size_t>(peer)].conns;
    for (std::size_t i = 0; i < conns.size() && i < r.size(); ++i) r[i] = conns[i].rate;
    return r;
  }

  /// A test's stand-in for a failing link: shuts the connection to `peer` on `rail` down in
  /// both directions, as a reset would.
  void break_rail(int peer, int rail) {
    std::lock_guard lock(mutex_);
    auto& c = peers_[static_cast<std::size_t>(peer)].conns.at(static_cast<std::size_t>(rail));
    if (c.alive) ::shutdown(c.fd.get(), SHUT_RDWR);
  }

  [[nodiscard]] std::shared_ptr<op> send(int peer, tag_t tag, std::span<const std::byte> data) {
    std::lock_guard lock(mutex_);
    check_aborted();
    auto o = std::make_shared<op>();
    o->is_send = true;
    o->peer = peer;
    o->tag = tag;
    o->data = const_cast<std::byte*>(data.data());  // only read
    o->size = data.size();
    if (o->eager()) {
      o->copy.assign(data.begin(), data.end());
      o->data = o->copy.data();
    }
    auto& ps = peers_[static_cast<std::size_t>(peer)];
    if (ps.gone) {
      fail_gone(*o, ps);
      return o;
    }
    const std::uint64_t seq = ps.send_seq++;
    const int live = live_count(ps);
    std::size_t pieces = 1;
    // Striped: several pieces per rail, so that placing each where it finishes first
    // (weighted_pick) divides the message in proportion to the rails' rates to within a
    // piece, and a rail that slows down holds up one piece, not a whole share.
    if (live > 1 && data.size() >= stripe_bytes_) {
      const auto rails = static_cast<std::size_t>(live);
      pieces = std::clamp(data.size() / engine_limits::min_piece_bytes, rails,
                          rails * engine_limits::pieces_per_rail);
    }
    pieces = std::max(pieces, (data.size() + engine_limits::max_piece_bytes - 1) /
                                  engine_limits::max_piece_bytes);
    // Equal pieces, on 4 KiB boundaries.
    std::size_t share = (data.size() + pieces - 1) / pieces;
    if (pieces > 1) share = (share + 4095) / 4096 * 4096;
    o->pieces_left = 0;
    std::size_t offset = 0;
    std::vector<connection*> touched;
    do {
      const std::size_t len = std::min(share, data.size() - offset);
      piece p;
      p.o = o;
      p.h = frame_header::data(seq, tag, data.size(), offset, static_cast<std::uint32_t>(len));
      connection& c = pick(ps, pieces > 1, len);
      c.enqueue(std::move(p), len);
      ++o->pieces_left;
      ++o->unwritten;
      if (std::find(touched.begin(), touched.end(), &c) == touched.end()) touched.push_back(&c);
      offset += len;
    } while (offset < data.size());
    for (connection* c : touched) write(peer, *c);
    return o;
  }

  [[nodiscard]] std::shared_ptr<op> recv(int peer, tag_t tag, std::span<std::byte> data) {
    std::lock_guard lock(mutex_);
    check_aborted();
    auto o = std::make_shared<op>();
    o->peer = peer;
    o->tag = tag;
    o->data = data.data();
    o->size = data.size();
    auto& ps = peers_[static_cast<std::size_t>(peer)];
    if (auto it = ps.unexpected.find(tag); it != ps.unexpected.end()) {
      std::shared_ptr<incoming> e = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) ps.unexpected.erase(it);
      attach(*e, o);
      if (e->complete()) finish(ps, e);
      return o;
    }
    if (ps.gone) {
      fail_gone(*o, ps);
      return o;
    }
    ps.posted[tag].push_back(o);
    return o;
  }

  /// Moves everything that can move.
  void progress() {
    std::lock_guard lock(mutex_);
    progress_locked();
  }

  /// Whether o finished; throws its failure. Called with the lock held.
  [[nodiscard]] bool test_locked(const std::shared_ptr<op>& o) {
    if (o->state == op::status::pending) progress_locked();
    if (o->state == op::status::pending) {
      if (aborted()) {
        const std::string what =
            fmt::format("the communicator was aborted ({}) while a {} rank {} was pending",
                        abort_reason(), o->is_send ? "send to" : "receive from", o->peer);
        abandon_locked(o);
        throw peer_error(what, -1);
      }
      if (failed_rank_ >= 0 && clock::now() - failed_at_ >= engine_limits::settle) {
        const std::string what =
            fmt::format("rank {} failed ({}); this rank was waiting for a {} rank {} over sockets",
                        failed_rank_, failure_, o->is_send ? "send to" : "receive from", o->peer);
        abandon_locked(o);
        throw peer_error(what, failed_rank_);
      }
      return false;
    }
    if (o->state == op::status::done) return true;
    if (o->peer_loss) throw peer_error(o->error, o->error_peer);
    throw transport_error(o->error);
  }

  /// The request for o was destroyed before it finished.
  void abandon(const std::shared_ptr<op>& o) noexcept {
    std::lock_guard lock(mutex_);
    abandon_locked(o);
  }

  void abort(const std::string& why) { abort_.set(why); }
  [[nodiscard]] bool aborted() const noexcept { return abort_.is_set(); }
  [[nodiscard]] std::string abort_reason() const { return abort_.reason(); }
  [[nodiscard]] int failed_rank() const {
    std::lock_guard lock(mutex_);
    return failed_rank_;
  }
  /// Records `rank` as the failure this rank names (unless one is known already): a wait gave
  /// up on it though its connections live (a stopped process).
  void blame(int rank, const std::string& why) {
    std::lock_guard lock(mutex_);
    if (rank >= 0 && rank != rank_) note_failure(rank, why);
  }
  /// How to tell whether a rank's process is stopped (the transport knows the processes): a
  /// goodbye that names a rank then says so.
  void set_stopped_probe(std::function<bool(int)> probe) {
    std::lock_guard lock(mutex_);
    stopped_ = std::move(probe);
  }

  /// Says goodbye on every connection (naming the rank this one saw fail first, if any),
  /// writes what is still queued for up to `grace`, and closes.
  void close(std::chrono::nanoseconds grace) noexcept {
    std::lock_guard lock(mutex_);
    if (closed_) return;
    closed_ = true;
    try {
      for (std::size_t p = 0; p < peers_.size(); ++p)
        for (auto& c : peers_[p].conns)
          if (c.alive) c.bye_due = true;
      const auto until = clock::now() + grace;
      for (;;) {
        bool pending = false;
        for (std::size_t p = 0; p < peers_.size(); ++p)
          for (auto& c : peers_[p].conns) {
            if (!c.alive) continue;
            // The goodbye counts as sent once its last byte is: a write may stop inside it
            // (the socket full, or the write's byte budget spent), and a peer that then reads
            // half a frame and the end of the stream would blame this rank for the failure.
            if (!c.bye_sent || c.ctrl_len > 0) {
              pending = true;
              write(static_cast<int>(p), c);
            }
          }
        if (!pending || clock::now() >= until) break;
        progress_locked();
        poll_out(until);
      }
    } catch (...) {
      // Closing goes on regardless.
    }
    for (auto& ps : peers_)
      for (auto& c : ps.conns)
        if (c.fd) {
          // Read what arrived, so that closing does not reset the connection under the bytes
          // the peer has yet to read.
          std::byte sink[4096];
          while (::recv(c.fd.get(), sink, sizeof sink, MSG_DONTWAIT) > 0) {
          }
          ::shutdown(c.fd.get(), SHUT_WR);
          c.fd.reset();
          c.alive = false;
        }
  }

 private:
  void check_aborted() const {
    if (aborted())
      throw peer_error(fmt::format("the communicator was aborted: {}", abort_reason()), -1);
  }

  [[nodiscard]] static int live_count(const peer_state& ps) noexcept {
    int n = 0;
    for (const auto& c : ps.conns) n += c.alive;
    return n;
  }

  /// The connection for the next piece: round robin for whole messages, the least loaded for
  /// the pieces of a striped one.
  /// The live connection for a piece of `len` bytes: by load (weighted_pick) for the pieces of
  /// a striped message, else the next live one round robin. The caller checked one is live.
  [[nodiscard]] connection& pick(peer_state& ps, bool by_load, std::size_t len) {
    const std::size_t n = ps.conns.size();
    std::size_t at = n;
    if (by_load) {
      at = weighted_pick(ps.conns, ps.next_rail, len, weighted_);
    } else {
      for (std::size_t i = 0; i < n && at == n; ++i)
        if (ps.conns[(ps.next_rail + i) % n].alive) at = (ps.next_rail + i) % n;
    }
    connection& best = ps.conns[at];
    ps.next_rail = (static_cast<std::size_t>(best.rail) + 1) % n;
    return best;
  }

  void fail_gone(op& o, const peer_state& ps) {
    o.state = op::status::failed;
    o.peer_loss = true;
    o.error_peer = ps.culprit;
    o.error = fmt::format("a {} rank {} failed: {}", o.is_send ? "send to" : "receive from", o.peer,
                          ps.why);
  }

  void attach(incoming& e, const std::shared_ptr<op>& r) {
    if (r->size != e.total) {
      r->state = op::status::failed;
      r->error = fmt::format(
          "message size mismatch with rank {}: posted a {} byte receive, the peer sent {} bytes "
          "(ranks disagree on the collective's count or type?)",
          r->peer, r->size, e.total);
      e.discard = true;
      e.drop_held();
      return;
    }
    e.recv = r;
    r->attached = &e;
    // A zero-byte receive has no buffer (data may be null, which memcpy may not be given).
    for (const auto& [offset, bytes] : e.held)
      if (!bytes.empty()) std::memcpy(r->data + offset, bytes.data(), bytes.size());
    e.drop_held();
  }

  /// Matches arrived messages with receives, in the order they were sent.
  void match(peer_state& ps) {
    for (auto it = ps.arriving.find(ps.next_match); it != ps.arriving.end();
         it = ps.arriving.find(ps.next_match)) {
      std::shared_ptr<incoming> e = it->second;
      e->matched = true;
      ++ps.next_match;
      auto q = ps.posted.find(e->tag);
      if (q != ps.posted.end()) {
        std::shared_ptr<op> r = std::move(q->second.front());
        q->second.pop_front();
        if (q->second.empty()) ps.posted.erase(q);
        attach(*e, r);
      } else {
        ps.unexpected[e->tag].push_back(e);
      }
      if (e->complete()) finish(ps, e);
    }
  }

  /// A message read whole: its receive completes once it was matched.
  void finish(peer_state& ps, const std::shared_ptr<incoming>& e) {
    if (!e->matched) return;
    ps.arriving.erase(e->seq);
    if (e->recv) {
      if (e->recv->state == op::status::pending) e->recv->state = op::status::done;
      e->recv->attached = nullptr;
      e->recv.reset();
    }
  }

  void abandon_locked(const std::shared_ptr<op>& o) noexcept {
    if (o->state != op::status::pending) return;
    auto& ps = peers_[static_cast<std::size_t>(o->peer)];
    if (o->is_send) {
      // Its pieces may be on the wire already: the rest go from a copy (an eager send has one).
      try {
        if (!o->eager()) {
          o->copy.assign(o->data, o->data + o->size);
          o->data = o->copy.data();
        }
      } catch (...) {
        // Out of memory: the pieces not yet written are withdrawn instead below.
      }
      o->orphaned = true;
      return;
    }
    if (o->attached) {
      o->attached->discard = true;
      o->attached->recv.reset();
      o->attached = nullptr;
    } else if (auto q = ps.posted.find(o->tag); q != ps.posted.end()) {
      auto& d = q->second;
      d.erase(std::remove(d.begin(), d.end(), o), d.end());
      if (d.empty()) ps.posted.erase(q);
    }
    o->state = op::status::failed;
    o->error = "abandoned";
  }

  void progress_locked() {
    pfds_.clear();
    pidx_.clear();
    for (std::size_t p = 0; p < peers_.size(); ++p)
      for (auto& c : peers_[p].conns) {
        if (!c.alive) continue;
        short ev = POLLIN;
        if (has_output(c)) ev |= POLLOUT;
        pfds_.push_back({c.fd.get(), ev, 0});
        pidx_.emplace_back(static_cast<int>(p), c.rail);
      }
    if (pfds_.empty()) return;
    int n = ::poll(pfds_.data(), pfds_.size(), 0);
    if (n <= 0) return;
    for (std::size_t i = 0; i < pfds_.size(); ++i) {
      const short re = pfds_[i].revents;
      if (re == 0) continue;
      const auto [p, r] = pidx_[i];
      auto& c = peers_[static_cast<std::size_t>(p)].conns[static_cast<std::size_t>(r)];
      if (c.alive && (re & (POLLIN | POLLHUP | POLLERR))) read(p, c);
      if (c.alive && (re & POLLOUT)) write(p, c);
    }
    // Acknowledge what a sender waits on (eager pieces wait for data going back, or for
    // lazy_ack_pieces of them).
    for (std::size_t p = 0; p < peers_.size(); ++p)
      for (auto& c : peers_[p].conns)
        if (c.alive && ack_wanted(c)) write(static_cast<int>(p), c);
  }

  /// Waits until some connection with output can take more, or `until`.
  void poll_out(clock::time_point until) {
    pfds_.clear();
    for (auto& ps : peers_)
      for (auto& c : ps.conns)
        if (c.alive) pfds_.push_back({c.fd.get(), static_cast<short>(POLLIN | POLLOUT), 0});
    if (pfds_.empty()) return;
    ::poll(pfds_.data(), pfds_.size(), std::min(bootstrap::detail::poll_ms_until(until), 10));
  }

  [[nodiscard]] static bool ack_wanted(const connection& c) noexcept {
    return c.received != c.ack_sent &&
           (c.ack_due || c.received - c.ack_sent >= engine_limits::lazy_ack_pieces);
  }

  [[nodiscard]] static bool has_output(const connection& c) noexcept {
    return c.written < c.out.size() || c.ctrl_len > 0 || ack_wanted(c) ||
           (c.bye_due && !c.bye_sent);
  }

  /// Writes what the connection has queued, up to write_batch_bytes, in as few sendmsg calls as
  /// the socket takes.
  void write(int peer, connection& c) {
    struct seg {
      const void* p;
      std::size_t n;
      bool ctrl;
    };
    seg segs[engine_limits::write_batch_iov];
    iovec iov[engine_limits::write_batch_iov];
    std::size_t budget = engine_limits::write_batch_bytes;
    while (c.alive && budget > 0) {
      // A control frame goes out between data frames only.
      const bool boundary = c.partial == 0;
      if (boundary && c.ctrl_len == 0) {
        if (c.received != c.ack_sent) {
          c.ctrl = frame_header::ack(c.received, c.rx_rate_field());
          c.ctrl_len = sizeof(frame_header);
          c.ack_sent = c.received;
          c.ack_due = false;
        } else if (c.bye_due && !c.bye_sent && c.written == c.out.size()) {
          c.ctrl = frame_header::bye(failed_rank_);
          c.ctrl_len = sizeof(frame_header);
          c.bye_sent = true;
        }
      }
      std::size_t k = 0, bytes = 0;
      auto add = [&](const void* p, std::size_t n, bool ctrl) {
        n = std::min(n, budget - bytes);  // a frame may end in a later write
        if (n == 0) return;
        segs[k] = {p, n, ctrl};
        iov[k] = {const_cast<void*>(p), n};
        ++k;
        bytes += n;
      };
      std::size_t i = c.written;
      auto add_frame = [&](const piece& pc, std::size_t skip) {
        const auto* h = reinterpret_cast<const std::byte*>(&pc.h);
        if (skip < sizeof(frame_header)) add(h + skip, sizeof(frame_header) - skip, false);
        const std::size_t pskip = skip > sizeof(frame_header) ? skip - sizeof(frame_header) : 0;
        if (pc.h.length > pskip) add(pc.o->data + pc.h.offset + pskip, pc.h.length - pskip, false);
      };
      if (!boundary) add_frame(c.out[i++], c.partial);
      if (c.ctrl_len > 0 && (boundary || k > 0))
        add(reinterpret_cast<const std::byte*>(&c.ctrl) + c.ctrl_off, c.ctrl_len - c.ctrl_off,
            true);
      while (i < c.out.size() && k + 2 <= engine_limits::write_batch_iov && bytes < budget)
        add_frame(c.out[i++], 0);
      if (k == 0) return;
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = k;
      const ssize_t n = ::sendmsg(c.fd.get(), &m, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        // A peer that closed its transport said goodbye first, naming the rank it saw fail;
        // the goodbye may wait unread behind the reset that failed this write. Read it before
        // calling the connection failed, or this rank blames a survivor for another's death.
        const std::string why = fmt::format("send failed: {}", std::strerror(errno));
        read(peer, c);
        if (c.alive && !c.got_bye) rail_failed(peer, c, why);
        return;
      }
      budget -= static_cast<std::size_t>(n);
      // Account for what went, segment by segment.
      auto left = static_cast<std::size_t>(n);
      for (std::size_t s = 0; s < k && left > 0; ++s) {
        const std::size_t take = std::min(left, segs[s].n);
        left -= take;
        if (segs[s].ctrl) {
          c.ctrl_off += take;
          if (c.ctrl_off == c.ctrl_len) c.ctrl_off = c.ctrl_len = 0;
          continue;
        }
        c.partial += take;
        if (c.partial == c.out[c.written].frame_bytes()) {
          // An eager send is done once its last piece is written whole (a piece written
          // again after a rail failed counts once).
          op& o = *c.out[c.written].o;
          if (o.eager() && o.unwritten > 0 && --o.unwritten == 0 && o.state == op::status::pending)
            o.state = op::status::done;
          ++c.written;
          c.partial = 0;
        }
      }
      if (static_cast<std::size_t>(n) < bytes) return;  // the socket is full
    }
  }

  /// Reads what the connection has, frame by frame.
  void read(int peer, connection& c) {
    auto& ps = peers_[static_cast<std::size_t>(peer)];
    bool more = true;
    for (int rounds = 0; c.alive && rounds < 64; ++rounds) {
      // Frames already in the staging buffer.
      for (;;) {
        if (c.in_payload) {
          const std::size_t avail = c.rx_end - c.rx_begin;
          if (avail == 0) break;
          const std::size_t take = std::min(avail, c.cur.length - c.cur_got);
          if (std::byte* t = piece_target(c)) std::memcpy(t, c.rx.data() + c.rx_begin, take);
          c.rx_begin += take;
          c.cur_got += take;
          if (c.cur_got == c.cur.length) end_piece(ps, c);
          continue;
        }
        if (c.rx_end - c.rx_begin < sizeof(frame_header)) break;
        frame_header h;
        std::memcpy(&h, c.rx.data() + c.rx_begin, sizeof h);
        c.rx_begin += sizeof h;
        if (!on_header(peer, c, h)) return;
      }
      // Everything read is parsed: a frame is still arriving if its payload is part-read or
      // part of its header is (a whole acknowledgement read alone does not count: the time
      // until the next read would be idle time).
      c.rx_sampling = c.in_payload || c.rx_end > c.rx_begin;
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
        direct = c.cur.length - c.cur_got;
        std::byte* t = piece_target(c);
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
        rail_failed(peer, c, fmt::format("receive failed: {}", std::strerror(errno)));
        return;
      }
      if (n == 0) {
        rail_failed(peer, c, "the connection was closed");
        return;
      }
      auto got = static_cast<std::size_t>(n);
      more = got == asked;
      const std::size_t into_direct = std::min(got, direct);
      if (direct > 0) {
        c.cur_got += into_direct;
        got -= into_direct;
        if (c.cur_got == c.cur.length) end_piece(ps, c);
      }
      c.rx_end += got;
      c.arrived(static_cast<std::uint64_t>(n), clock::now());
    }
  }

  [[nodiscard]] std::byte* piece_target(connection& c) {
    return c.cur_msg ? c.cur_msg->target(c.cur.offset, c.cur_got) : nullptr;
  }

  /// Why a data frame's header cannot be a piece this engine's sender cut, or nullptr. Every
  /// field that sizes, places or counts bytes is checked here, before anything is allocated for
  /// the frame or a byte of its payload is copied.
  [[nodiscard]] static const char* bad_data_header(const frame_header& h) noexcept {
    if (h.length > engine_limits::max_piece_bytes) return "a piece longer than a sender cuts";
    if (h.total > engine_limits::max_message_bytes) return "a message over the size limit";
    if (h.offset > h.total || h.length > h.total - h.offset) return "a piece outside its message";
    return nullptr;
  }

  /// A frame no rank of this job sends: the connection is given up (as if it broke), since
  /// nothing after it on that stream can be trusted to be framed right.
  bool violation(int peer, connection& c, const std::string& what) {
    log::error("socket: rank {} sent {} on rail {}; giving the connection up", peer, what,
               rail_names_[static_cast<std::size_t>(c.rail)]);
    rail_failed(peer, c, fmt::format("protocol violation: {}", what));
    return false;
  }

  /// A frame header read; false once the connection is closed.
  bool on_header(int peer, connection& c, const frame_header& h) {
    auto& ps = peers_[static_cast<std::size_t>(peer)];
    switch (h.kind) {
      case frame_kind::ack:
        if (h.seq > c.acked + c.written)
          return violation(peer, c,
                           fmt::format("an acknowledgement of {} pieces, {} were sent", h.seq,
                                       c.acked + c.written));
        on_ack(c, h.seq);
        if (h.length > 0) c.rate = static_cast<double>(h.length) * 1024.0;
        return true;
      case frame_kind::bye: {
        if (h.seq > peers_.size())
          return violation(peer, c, fmt::format("a goodbye naming rank {}", h.seq - 1));
        c.got_bye = true;
        const int culprit = static_cast<int>(h.seq) - 1;
        if (culprit >= 0 && culprit != rank_ && failed_rank_ < 0)
          note_failure(culprit, stopped_ && stopped_(culprit)
                                    ? fmt::format("rank {} is stopped (SIGSTOP or a debugger), "
                                                  "as rank {} reported",
                                                  culprit, peer)
                                    : fmt::format("rank {} reported it", peer));
        connection_closed(peer, c);
        return false;
      }
      case frame_kind::data:
        break;
      default:
        return violation(peer, c,
                         fmt::format("a frame of unknown kind {}", static_cast<unsigned>(h.kind)));
    }
    if (const char* bad = bad_data_header(h))
      return violation(peer, c,
                       fmt::format("{} ({} bytes at offset {} of a {}-byte message)", bad, h.length,
                                   h.offset, h.total));
    c.cur = h;
    c.cur_got = 0;
    c.in_payload = true;
    c.cur_msg.reset();
    if (h.seq >= ps.next_match || ps.arriving.count(h.seq)) {
      auto& slot = ps.arriving[h.seq];
      if (!slot) {
        slot = std::make_shared<incoming>();
        slot->seq = h.seq;
        slot->tag = h.tag;
        slot->total = h.total;
        c.cur_msg = slot;
        match(ps);  // first: a receive posted already takes the bytes, nothing is held
      } else {
        c.cur_msg = slot;
        if (slot->total != h.total || slot->tag != h.tag)
          return violation(peer, c,
                           fmt::format("pieces of message {} that disagree on its size ({} and "
                                       "{} bytes) or tag",
                                       h.seq, slot->total, h.total));
      }
      if (!c.cur_msg->admit(h.offset, h.length))
        return violation(peer, c, "a piece that overlaps its message's other pieces");
    }
    if (c.cur.length == 0) end_piece(ps, c);
    return true;
  }

  void end_piece(peer_state& ps, connection& c) {
    c.in_payload = false;
    ++c.received;
    if (c.cur.total > engine_limits::eager_bytes) c.ack_due = true;
    std::shared_ptr<incoming> e = std::move(c.cur_msg);
    if (!e) return;
    if (std::find(e->done_offsets.begin(), e->done_offsets.end(), c.cur.offset) !=
        e->done_offsets.end())
      return;
    e->done_offsets.push_back(c.cur.offset);
    e->got += c.cur.length;
    if (e->complete()) {
      if (!e->matched) return;  // finished when its turn comes (match())
      finish(ps, e);
    }
  }

  void on_ack(connection& c, std::uint64_t count) {
    while (c.acked < count && c.written > 0) {
      piece& p = c.out.front();
      c.queued_bytes -= p.h.length;
      c.bytes_out += p.h.length;
      if (--p.o->pieces_left == 0 && p.o->state == op::status::pending)
        p.o->state = op::status::done;
      c.out.pop_front();
      --c.written;
      ++c.acked;
    }
  }

  void note_failure(int rank, std::string why) {
    if (failed_rank_ >= 0) return;
    failed_rank_ = rank;
    failure_ = std::move(why);
    failed_at_ = clock::now();
  }

  /// The peer said goodbye on this connection.
  void connection_closed(int peer, connection& c) {
    c.alive = false;
    auto& ps = peers_[static_cast<std::size_t>(peer)];
    if (live_count(ps) > 0) return;
    peer_gone(peer, "it closed its transport", true);
  }

  /// The connection broke: its pieces move to the peer's other rails, or the peer is gone.
  void rail_failed(int peer, connection& c, const std::string& why) {
    c.alive = false;
    c.fd.reset();
    auto& ps = peers_[static_cast<std::size_t>(peer)];
    const std::string rail = rail_names_[static_cast<std::size_t>(c.rail)];
    if (closed_) return;
    if (c.got_bye) return;
    const int left = live_count(ps);
    if (left == 0) {
      peer_gone(peer,
                rail_names_.size() > 1
                    ? fmt::format("its last rail, {}, failed: {}", rail, why)
                    : fmt::format("its connection failed ({}): has it died?", why),
                false, c.rail);
      return;
    }
    std::deque<piece> moved = std::move(c.out);
    c.out.clear();
    c.written = c.partial = c.queued_bytes = 0;
    c.ctrl_len = c.ctrl_off = 0;
    c.cur_msg.reset();
    c.in_payload = false;
    log::warn(
        "socket: rail {} to rank {} failed ({}); its {} unacknowledged piece{} and all later "
        "traffic go over the {} remaining rail{}",
        rail, peer, why, moved.size(), moved.size() == 1 ? "" : "s", left, left == 1 ? "" : "s");
    std::vector<connection*> touched;
    for (auto& p : moved) {
      if (p.o->state != op::status::pending) continue;
      const std::size_t len = p.h.length;
      connection& to = pick(ps, true, len);
      to.enqueue(std::move(p), len);
      if (std::find(touched.begin(), touched.end(), &to) == touched.end()) touched.push_back(&to);
    }
    for (connection* t : touched) write(peer, *t);
  }

  void peer_gone(int peer, const std::string& why, bool graceful, int rail = -1) {
    auto& ps = peers_[static_cast<std::size_t>(peer)];
    if (ps.gone) return;
    ps.gone = true;
    ps.graceful = graceful;
    // The first failure this rank saw is what every error names, as on the other transports:
    // a survivor that raised on it and exited closes its connections too, gracefully or, when
    // its goodbye is lost under a reset (the peer's acknowledgements reaching a socket already
    // closed), not; either way it is not the culprit.
    ps.culprit = failed_rank_ >= 0 ? failed_rank_ : peer;
    ps.why = fmt::format("rank {} is gone: {}", peer, why);
    if (failed_rank_ >= 0 && failed_rank_ != peer)
      ps.why += fmt::format(" after rank {} failed ({})", failed_rank_, failure_);
    if (rail >= 0 && rail_names_.size() > 1)
      ps.why += fmt::format(" (rail {})", rail_names_[static_cast<std::size_t>(rail)]);
    if (!graceful) note_failure(peer, ps.why);
    auto fail = [&](op& o) {
      if (o.state != op::status::pending) return;
      fail_gone(o, ps);
    };
    for (auto& c : ps.conns) {
      for (auto& p : c.out) fail(*p.o);
      c.out.clear();
      c.written = c.partial = c.queued_bytes = 0;
      c.alive = false;
      c.fd.reset();
      c.cur_msg.reset();
    }
    for (auto& [tag, q] : ps.posted)
      for (auto& o : q) fail(*o);
    ps.posted.clear();
    for (auto it = ps.arriving.begin(); it != ps.arriving.end();) {
      if (it->second->recv) {
        fail(*it->second->recv);
        it->second->recv->attached = nullptr;
        it->second->recv.reset();
      }
      it = ps.arriving.erase(it);
    }
    // Unexpected messages that arrived whole are still received; the others never will be.
    for (auto it = ps.unexpected.begin(); it != ps.unexpected.end();) {
      auto& q = it->second;
      q.erase(std::remove_if(q.begin(), q.end(), [](const auto& e) { return !e->complete(); }),
              q.end());
      it = q.empty() ? ps.unexpected.erase(it) : std::next(it);
    }
  }

  int rank_;
  std::vector<std::string> rail_names_;
  std::size_t stripe_bytes_;
  bool weighted_;
  std::vector<peer_state> peers_;
  std::vector<std::byte> scratch_;
  std::vector<pollfd> pfds_;
  std::vector<std::pair<int, int>> pidx_;
  int failed_rank_ = -1;
  std::string failure_;
  clock::time_point failed_at_{};
  bool closed_ = false;
  std::function<bool(int)> stopped_;  ///< set_stopped_probe()
  mutable std::mutex mutex_;
  ringzero::detail::abort_state abort_;
};

}  // namespace ringzero::socket::detail
