// One TCP connection of the socket transport: to one peer, on one rail (socket/rail.hpp). What
// is queued to go (frames of the operations posted on it, and small frames of their own), the
// writer that puts many of them into one sendmsg, the receiving side's staging buffer and the
// rate at which the peer's bytes arrive.
#pragma once

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ringzero/bootstrap/detail/socket.hpp"
#include "ringzero/transport/detail/rail.hpp"
#include "ringzero/transport/socket/wire.hpp"

namespace ringzero::socket::detail {

using clock = std::chrono::steady_clock;
using bootstrap::detail::unique_fd;

/// The connection's limits, named once.
struct connection_limits {
  /// Bytes one write() puts into a connection at most before the rail turns to reading, and the
  /// iovec entries one sendmsg() may use. Both directions of a ring step run at once, and on one
  /// host the kernel's copy into the peer's socket is the sender's work: a rank that wrote a
  /// whole 1 MiB step before reading found what had arrived meanwhile out of its caches. On
  /// loopback, 2 ranks, a cap of 256 KiB against none took 1 MiB all_reduce from 295-355 µs to
  /// 187-237 and 4 MiB from 1,237-1,273 to 774-853 (docs/performance.md); 128 KiB did as well
  /// at 1-4 MiB and worse at 16 MiB, 512 KiB worse below 16 MiB.
  static constexpr std::size_t write_batch_bytes = std::size_t{256} << 10;
  static constexpr std::size_t write_batch_iov = 64;
  /// Each connection's staging buffer for reads: headers and small payloads come in through it,
  /// many per recv; larger payloads are read straight into their receive's buffer.
  static constexpr std::size_t rx_bytes = std::size_t{256} << 10;
};

struct op_scratch {};
using op = ringzero::detail::rail_op<op_scratch>;

/// A frame waiting to be written: a posted send's (its payload read from the operation's buffer
/// at each write, so the engine may point it at a copy meanwhile), or one of the connection's
/// own (an injected message's rest, a goodbye).
struct outgoing {
  frame_header h{};
  op* o = nullptr;
  std::span<const std::byte> borrowed{};  ///< an inject's bytes, only until inject() returns
  std::vector<std::byte> own{};

  [[nodiscard]] const std::byte* payload() const noexcept {
    if (o) return o->buffer;
    return own.empty() ? borrowed.data() : own.data();
  }
  [[nodiscard]] std::size_t frame_bytes() const noexcept { return sizeof(frame_header) + h.length; }
};

/// A message nobody posted for yet, from its header's arrival: its bytes as they came, a chunk
/// at a time, so that it holds what its sender sent, never what its header claims is coming (or,
/// once a receive claimed it while it was still arriving, that receive's buffer).
struct arrival {
  static constexpr std::size_t chunk_bytes = std::size_t{1} << 20;

  frame_header h{};
  std::vector<std::vector<std::byte>> chunks{};
  std::size_t got = 0;
  bool complete = false;
  op* waiting = nullptr;      ///< the receive that claimed it before it was whole
  std::byte* dest = nullptr;  ///< where the waiting receive takes it
  bool discard = false;       ///< its receive refused it: the rest of its bytes go nowhere
  bool lost = false;          ///< its connection broke before it was whole
  std::string why{};

  /// Where byte `at` of its payload goes while no receive holds it, and how many bytes from
  /// there fit before the next chunk (allocated now, as its first byte arrives).
  [[nodiscard]] std::byte* held(std::size_t at, std::size_t& room) {
    const std::size_t k = at / chunk_bytes;
    if (chunks.size() <= k) chunks.resize(k + 1);
    auto& c = chunks[k];
    if (c.empty()) c.resize(std::min(chunk_bytes, h.length - k * chunk_bytes));
    room = c.size() - at % chunk_bytes;
    return c.data() + at % chunk_bytes;
  }
  /// Copies the bytes held so far to `to`, and lets them go.
  void give(std::byte* to) {
    std::size_t done = 0;
    for (const auto& c : chunks) {
      const std::size_t n = std::min(c.size(), got - done);
      if (n == 0) break;
      std::memcpy(to + done, c.data(), n);
      done += n;
    }
    chunks = {};
  }
};

/// The rate of the peer's bytes, measured where they arrive: payload read over the time between
/// reads, counted only while a frame was still arriving in between (so idle time is not), in
/// windows of at least `window` bytes; the estimate is the best of the last samples.size()
/// windows (a max filter, as TCP BBR keeps its bandwidth estimate). Why: a window can only come
/// out low, never high (time the receiver spent elsewhere while a frame sat whole in the kernel
/// counts as arrival time), and more so on a rail that carries little, so a smoothed mean would
/// starve that rail of pieces and of the windows that could correct it; and acknowledgement
/// times would be worse still, since an acknowledgement waits behind the reverse direction's
/// data. The receiver reports its figure in its statements (delivery::control::rates), and the
/// sender cuts striped messages by it (striping.hpp, shares_by_rate).
struct rate_meter {
  static constexpr std::uint64_t window = std::uint64_t{1} << 20;

  clock::time_point last{};
  bool sampling = false;  ///< a frame was arriving at `last`
  std::uint64_t window_bytes = 0;
  std::int64_t window_ns = 0;
  std::array<double, 4> samples{};  ///< the last windows' rates, bytes per second
  std::size_t next_sample = 0;
  double rate = 0;  ///< bytes per second; 0: not measured yet

  /// `bytes` read at `now`: the interval since the last read is a sample if a frame was arriving
  /// all along (sampling, which the reader sets once it has parsed what it read); once a window
  /// is full, rate is the best of the last windows.
  void arrived(std::uint64_t bytes, clock::time_point now) noexcept {
    if (sampling) {
      window_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(now - last).count();
      window_bytes += bytes;
      if (window_bytes >= window && window_ns > 0) {
        samples[next_sample++ % samples.size()] =
            static_cast<double>(window_bytes) * 1e9 / static_cast<double>(window_ns);
        rate = *std::max_element(samples.begin(), samples.end());
        window_bytes = 0;
        window_ns = 0;
      }
    }
    last = now;
  }

  /// The rate as a statement carries it: KiB/s, at least 1 once measured, 0 before.
  [[nodiscard]] std::uint32_t kib_per_second() const noexcept {
    if (rate <= 0) return 0;
    const double kib = rate / 1024.0;
    return kib >= 4294967295.0 ? 4294967295u
                               : std::max<std::uint32_t>(1, static_cast<std::uint32_t>(kib));
  }
};

/// One TCP connection to a peer, on one rail.
struct connection {
  unique_fd fd;
  int peer = -1;
  bool alive = false;
  bool got_bye = false;  ///< the peer closed its transport, in order
  bool bye_queued = false;
  std::string why;  ///< why it broke, once it did
  /// Frames at the end of `out` queued to leave with the next message (rail_message::more).
  std::size_t bundled = 0;
  // Output: out[0] has `partial` bytes (header and payload) written; the rest wait.
  std::deque<outgoing> out;
  std::size_t partial = 0;
  // Input: frames are parsed from rx[rx_begin, rx_end); a payload goes into `target` (a
  // receive's buffer), `kept` (an arrival nobody posted for) or nowhere.
  std::vector<std::byte> rx;
  std::size_t rx_begin = 0;
  std::size_t rx_end = 0;
  bool in_payload = false;
  frame_header cur{};
  std::size_t cur_got = 0;
  op* target = nullptr;
  std::byte* target_at = nullptr;
  std::shared_ptr<arrival> kept;
  rate_meter meter;

  [[nodiscard]] bool has_output() const noexcept { return alive && !out.empty(); }

  /// Where the next bytes of the current payload go (null: nowhere), and how many of them fit
  /// there in one piece.
  [[nodiscard]] std::byte* payload_target(std::size_t& room) {
    room = cur.length - cur_got;
    if (target) return target_at + cur_got;
    if (!kept || kept->discard) return nullptr;
    if (kept->waiting) return kept->dest + cur_got;
    std::size_t fits = 0;
    std::byte* at = kept->held(cur_got, fits);
    room = std::min(room, fits);
    return at;
  }

  /// Writes what is queued, up to write_batch_bytes, in as few sendmsg calls as the socket
  /// takes; each frame written whole is handed to `written`. 0, or the errno of a failed write.
  template <class Written>
  int write(Written&& written) {
    std::array<iovec, connection_limits::write_batch_iov> iov{};
    std::size_t budget = connection_limits::write_batch_bytes;
    while (alive && budget > 0 && !out.empty()) {
      std::size_t k = 0;
      std::size_t bytes = 0;
      const auto add = [&](const std::byte* p, std::size_t n) {
        n = std::min(n, budget - bytes);  // a frame may end in a later write
        if (n == 0) return;
        iov[k] = {const_cast<std::byte*>(p), n};
        ++k;
        bytes += n;
      };
      for (std::size_t i = 0; i < out.size() && k + 2 <= iov.size() && bytes < budget; ++i) {
        const outgoing& f = out[i];
        const std::size_t skip = i == 0 ? partial : 0;
        const auto* h = reinterpret_cast<const std::byte*>(&f.h);
        if (skip < sizeof(frame_header)) add(h + skip, sizeof(frame_header) - skip);
        const std::size_t pskip = skip > sizeof(frame_header) ? skip - sizeof(frame_header) : 0;
        if (f.h.length > pskip) add(f.payload() + pskip, f.h.length - pskip);
      }
      if (k == 0) return 0;
      msghdr m{};
      m.msg_iov = iov.data();
      m.msg_iovlen = k;
      const ssize_t n = ::sendmsg(fd.get(), &m, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        return errno;
      }
      budget -= static_cast<std::size_t>(n);
      auto left = static_cast<std::size_t>(n);
      while (left > 0) {
        const std::size_t take = std::min(left, out.front().frame_bytes() - partial);
        partial += take;
        left -= take;
        if (partial == out.front().frame_bytes()) {
          outgoing done = std::move(out.front());
          out.pop_front();
          partial = 0;
          written(done);
        }
      }
      if (static_cast<std::size_t>(n) < bytes) return 0;  // the socket is full
    }
    return 0;
  }
};

}  // namespace ringzero::socket::detail
