// How the socket transport's connections prove they belong to the job. Every rank listens on
// its rails while the job sets up; anything on the host (or the network) can connect to those
// ports, so a connection is taken as a rank's only once it proved it holds the job's secret:
//
//   connecting rank                                  accepting rank
//     hello {rank, rail, generation, nonce_c}  ─────▶  checks the claim (a lower rank, this
//                                                      rail, this setup, not connected yet)
//                                               ◀─────  challenge {nonce_a, HMAC(secret, "accept",
//     checks the accepting rank's proof                            hello, nonce_a, its rank)}
//     proof {HMAC(secret, "connect", hello, nonce_a)} ─▶  checks it
//                                               ◀─────  welcome
//
// The secret is 32 random bytes rank 0 draws for each setup and hands the others through the
// store (socket.hpp): it is as private as the store is (RINGZERO_TOKEN guards a TCP store; a
// file store's directory permissions guard it), and it is never derived from a job id. Both
// proofs cover both nonces, so neither can be replayed on another connection; comparisons take
// the same time however much of a guess was right.
//
// Every connection is one non-blocking state machine (handshake), and meet() runs them all in
// one poll loop, the rank's own connections to the ranks above it and the ones it accepts
// from below: a peer that connects and then says nothing holds only its own slot, and is
// dropped after options::handshake_timeout; one that claims to be a rank already connected,
// or fails to prove itself, is refused and logged with its address. A connection this rank
// opened that the other side closed before welcoming it is opened again, until the deadline.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ringzero/bootstrap/detail/socket.hpp"
#include "ringzero/detail/hmac.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/socket/rails.hpp"
#include "ringzero/transport/socket/wire.hpp"

namespace ringzero::socket::detail {

/// The job's secret for one setup of the transport.
using job_secret = std::array<std::byte, 32>;

/// What both ends of every handshake of one setup share.
struct handshake_terms {
  int rank = 0;
  int size = 0;
  std::uint32_t generation = 0;
  job_secret secret{};
};

/// The accepting rank's proof: it holds the secret, answers this hello, and is rank `acceptor`.
[[nodiscard]] inline ringzero::detail::digest accept_mac(const job_secret& secret, const hello& h,
                                                         std::span<const std::byte> nonce,
                                                         std::uint32_t acceptor) {
  static constexpr char label[] = "ringzero-socket accept";
  return ringzero::detail::hmac_sha256(
      secret, {std::as_bytes(std::span(label)), std::as_bytes(std::span(&h, 1)), nonce,
               std::as_bytes(std::span(&acceptor, 1))});
}

/// The connecting rank's proof: it holds the secret and sent this hello, answering `nonce`.
[[nodiscard]] inline ringzero::detail::digest connect_mac(const job_secret& secret, const hello& h,
                                                          std::span<const std::byte> nonce) {
  static constexpr char label[] = "ringzero-socket connect";
  return ringzero::detail::hmac_sha256(
      secret, {std::as_bytes(std::span(label)), std::as_bytes(std::span(&h, 1)), nonce});
}

[[nodiscard]] inline const char* verdict_text(verdict v) noexcept {
  switch (v) {
    case verdict::welcome:
      return "welcome";
    case verdict::stale_generation:
      return "it belongs to another setup of the job (an earlier generation)";
    case verdict::unexpected_rank:
      return "that rank does not connect to this one (only lower ranks do)";
    case verdict::wrong_rail:
      return "it names another rail than the one it reached";
    case verdict::duplicate:
      return "that rank is connected on that rail already";
  }
  return "an unknown verdict";
}

/// One connection in its handshake, either side. step() reads and writes what the socket
/// allows without blocking, and says where the handshake stands.
class handshake {
 public:
  enum class outcome : std::uint8_t {
    working,  ///< waits for the socket (events())
    done,     ///< the connection is the peer's: release() it
    retry,    ///< (connecting) the connection failed before the welcome: open another
    refused,  ///< refused, for why(); accepting: drop it; connecting: setup fails
  };

  /// A connection accepted on `rail`, from `remote`.
  [[nodiscard]] static handshake accepting(bootstrap::detail::unique_fd fd, int rail,
                                           const handshake_terms& terms, std::string remote) {
    handshake h(std::move(fd), rail, terms);
    h.remote_ = std::move(remote);
    h.state_ = state::read_hello;
    h.expect(sizeof(hello));
    return h;
  }

  /// A connection this rank opened to `peer` on `rail` (start_connect), perhaps still under way.
  [[nodiscard]] static handshake connecting(bootstrap::detail::unique_fd fd, int peer, int rail,
                                            const handshake_terms& terms) {
    handshake h(std::move(fd), rail, terms);
    h.peer_ = peer;
    h.state_ = state::connect;
    return h;
  }

  /// Moves the handshake on. `taken(peer, rail)`: whether that peer's connection on that rail
  /// exists already (a second claim is refused).
  template <class Taken>
  outcome step(const Taken& taken) {
    for (;;) switch (state_) {
        case state::connect: {
          int err = 0;
          socklen_t err_len = sizeof err;
          if (::getsockopt(fd_.get(), SOL_SOCKET, SO_ERROR, &err, &err_len) != 0) err = errno;
          if (err == EINPROGRESS || err == EALREADY) return outcome::working;
          // Refused: the listener's backlog was full, or (rarely) it is not up yet.
          if (err == ECONNREFUSED || err == EAGAIN) return fail(outcome::retry, std::strerror(err));
          if (err != 0) return fail(outcome::refused, std::strerror(err));
          sockaddr_in a{};
          socklen_t len = sizeof a;
          if (::getpeername(fd_.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0)
            return outcome::working;  // not connected yet
          remote_ = address_text(a);
          mine_ = hello{.rank = static_cast<std::uint32_t>(terms_.rank),
                        .rail = static_cast<std::uint32_t>(rail_),
                        .generation = terms_.generation};
          ringzero::detail::random_bytes(mine_.nonce);
          send(std::as_bytes(std::span(&mine_, 1)));
          state_ = state::send_hello;
          break;
        }
        case state::send_hello:
          if (const auto r = flush(); r != io::complete) return pending_or(r, outcome::retry);
          state_ = state::read_challenge;
          expect(sizeof(challenge));
          break;
        case state::read_challenge: {
          if (const auto r = fill(); r != io::complete)
            return pending_or(r, outcome::retry, "it closed the connection before answering");
          challenge c{};
          std::memcpy(&c, in_.data(), sizeof c);
          if (c.magic != challenge{}.magic)
            return fail(outcome::refused,
                        "its answer is not the socket transport's (another program on its port?)");
          if (c.says != verdict::welcome)
            return fail(outcome::refused,
                        fmt::format("it refused this rank's hello: {}", verdict_text(c.says)));
          const auto expected =
              accept_mac(terms_.secret, mine_, c.nonce, static_cast<std::uint32_t>(peer_));
          if (!ringzero::detail::same_bytes(expected, c.mac))
            return fail(outcome::refused,
                        "it could not prove it holds this job's secret (a process of another job "
                        "on the port this rank published?)");
          proof p{};
          const auto mac = connect_mac(terms_.secret, mine_, c.nonce);
          std::memcpy(p.mac.data(), mac.data(), mac.size());
          send(std::as_bytes(std::span(&p, 1)));
          state_ = state::send_proof;
          break;
        }
        case state::send_proof:
          if (const auto r = flush(); r != io::complete) return pending_or(r, outcome::retry);
          state_ = state::read_welcome;
          expect(sizeof(welcome));
          break;
        case state::read_welcome: {
          if (const auto r = fill(); r != io::complete)
            return pending_or(r, outcome::retry, "it closed the connection before welcoming it");
          welcome w{};
          std::memcpy(&w, in_.data(), sizeof w);
          if (w.magic != welcome{}.magic || w.says != verdict::welcome)
            return fail(outcome::refused,
                        fmt::format("it refused this rank's proof: {}", verdict_text(w.says)));
          state_ = state::done;
          return outcome::done;
        }
        case state::read_hello: {
          const auto r = fill();
          // Anything but the magic is refused as soon as it shows, not once a hello's worth of
          // bytes arrived: a stranger's short message is not left to wait out the limit.
          constexpr std::uint32_t magic = hello{}.magic;
          if (got_ >= sizeof magic && std::memcmp(in_.data(), &magic, sizeof magic) != 0)
            return fail(outcome::refused,
                        "it did not introduce itself as a rank of this job (not the socket "
                        "transport's hello)");
          if (r != io::complete)
            return pending_or(r, outcome::refused,
                              got_ == 0 ? "it closed without a word" : "it closed mid-hello");
          std::memcpy(&theirs_, in_.data(), sizeof theirs_);
          verdict v = verdict::welcome;
          if (theirs_.generation != terms_.generation)
            v = verdict::stale_generation;
          else if (theirs_.rank >= static_cast<std::uint32_t>(terms_.rank))
            v = verdict::unexpected_rank;
          else if (theirs_.rail != static_cast<std::uint32_t>(rail_))
            v = verdict::wrong_rail;
          else if (taken(static_cast<int>(theirs_.rank), rail_))
            v = verdict::duplicate;
          challenge c{};
          c.says = v;
          if (v == verdict::welcome) {
            ringzero::detail::random_bytes(nonce_);
            c.nonce = nonce_;
            const auto mac =
                accept_mac(terms_.secret, theirs_, nonce_, static_cast<std::uint32_t>(terms_.rank));
            std::memcpy(c.mac.data(), mac.data(), mac.size());
          } else {
            refusal_ = fmt::format("it claimed rank {} rail {}, refused: {}", theirs_.rank,
                                   theirs_.rail, verdict_text(v));
          }
          send(std::as_bytes(std::span(&c, 1)));
          state_ = v == verdict::welcome ? state::send_challenge : state::send_refusal;
          break;
        }
        case state::send_challenge:
          if (const auto r = flush(); r != io::complete)
            return pending_or(r, outcome::refused, "it closed before its proof");
          state_ = state::read_proof;
          expect(sizeof(proof));
          break;
        case state::read_proof: {
          if (const auto r = fill(); r != io::complete)
            return pending_or(
                r, outcome::refused,
                fmt::format("it claimed rank {} and closed before its proof", theirs_.rank));
          proof p{};
          std::memcpy(&p, in_.data(), sizeof p);
          const auto expected = connect_mac(terms_.secret, theirs_, nonce_);
          if (!ringzero::detail::same_bytes(expected, p.mac))
            return fail(outcome::refused,
                        fmt::format("it claimed rank {} rail {} without holding this job's secret",
                                    theirs_.rank, theirs_.rail));
          const int claimed = static_cast<int>(theirs_.rank);
          welcome w{};
          if (taken(claimed, rail_)) {
            w.says = verdict::duplicate;
            refusal_ = fmt::format("it claimed rank {} rail {}, refused: {}", theirs_.rank,
                                   theirs_.rail, verdict_text(w.says));
          }
          send(std::as_bytes(std::span(&w, 1)));
          peer_ = claimed;
          state_ = refusal_.empty() ? state::send_welcome : state::send_refusal;
          break;
        }
        case state::send_welcome:
          if (const auto r = flush(); r != io::complete)
            return pending_or(r, outcome::refused, "it closed before its welcome");
          state_ = state::done;
          return outcome::done;
        case state::send_refusal:
          // Best effort: the refused side learns why if its socket takes the answer now.
          static_cast<void>(flush());
          return fail(outcome::refused, refusal_);
        case state::done:
          return outcome::done;
        case state::failed:
          return last_;
      }
  }

  /// What the socket must become ready for before step() can go on.
  [[nodiscard]] short events() const noexcept {
    switch (state_) {
      case state::connect:
      case state::send_hello:
      case state::send_challenge:
      case state::send_proof:
      case state::send_welcome:
      case state::send_refusal:
        return POLLOUT;
      default:
        return POLLIN;
    }
  }

  [[nodiscard]] int fd() const noexcept { return fd_.get(); }
  [[nodiscard]] int peer() const noexcept { return peer_; }
  [[nodiscard]] int rail() const noexcept { return rail_; }
  [[nodiscard]] const std::string& why() const noexcept { return why_; }
  [[nodiscard]] const std::string& remote() const noexcept { return remote_; }
  /// Whether the other side ever sent a byte: a connection closed without one is a port probe
  /// or a connection its own side gave up on, not worth a warning.
  [[nodiscard]] bool heard() const noexcept { return heard_; }
  [[nodiscard]] bootstrap::detail::unique_fd release() noexcept { return std::move(fd_); }

 private:
  enum class state : std::uint8_t {
    connect,
    send_hello,
    read_challenge,
    send_proof,
    read_welcome,
    read_hello,
    send_challenge,
    read_proof,
    send_welcome,
    send_refusal,
    done,
    failed,
  };
  enum class io : std::uint8_t { complete, pending, closed };

  handshake(bootstrap::detail::unique_fd fd, int rail, const handshake_terms& terms)
      : fd_(std::move(fd)), rail_(rail), terms_(terms) {}

  void expect(std::size_t n) noexcept {
    want_ = n;
    got_ = 0;
  }
  void send(std::span<const std::byte> b) noexcept {
    std::memcpy(out_.data(), b.data(), b.size());
    out_len_ = b.size();
    sent_ = 0;
  }

  io fill() {
    while (got_ < want_) {
      const ssize_t n = ::recv(fd_.get(), in_.data() + got_, want_ - got_, MSG_DONTWAIT);
      if (n > 0) {
        got_ += static_cast<std::size_t>(n);
        heard_ = true;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return io::pending;
      io_error_ = n == 0 ? "the connection was closed" : std::strerror(errno);
      return io::closed;
    }
    return io::complete;
  }

  io flush() {
    while (sent_ < out_len_) {
      const ssize_t n =
          ::send(fd_.get(), out_.data() + sent_, out_len_ - sent_, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n > 0) {
        sent_ += static_cast<std::size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return io::pending;
      io_error_ = n == 0 ? "the connection was closed" : std::strerror(errno);
      return io::closed;
    }
    return io::complete;
  }

  outcome pending_or(io r, outcome closed, std::string why = {}) {
    if (r == io::pending) return outcome::working;
    return fail(closed, why.empty() ? io_error_ : fmt::format("{} ({})", why, io_error_));
  }

  outcome fail(outcome o, std::string why) {
    state_ = state::failed;
    last_ = o;
    why_ = std::move(why);
    return o;
  }

  bootstrap::detail::unique_fd fd_;
  int rail_ = 0;
  int peer_ = -1;
  handshake_terms terms_;
  state state_ = state::failed;
  outcome last_ = outcome::refused;
  bool heard_ = false;
  hello mine_{};    ///< connecting: the hello sent
  hello theirs_{};  ///< accepting: the hello received
  std::array<std::byte, 16> nonce_{};
  std::array<std::byte, 64> in_{};
  std::array<std::byte, 64> out_{};
  std::size_t want_ = 0, got_ = 0, out_len_ = 0, sent_ = 0;
  std::string remote_, why_, refusal_, io_error_;
};

/// What meet() needs besides the terms.
struct meeting {
  const std::vector<rail_address>& rails;
  const std::vector<bootstrap::detail::unique_fd>& listeners;  ///< one per rail
  const std::vector<std::vector<sockaddr_in>>& addresses;      ///< per rank, per rail
  std::size_t buffer_bytes = 0;
  std::chrono::milliseconds user_timeout{1000};
  /// How long an accepted connection may take to prove itself.
  std::chrono::nanoseconds handshake_timeout{std::chrono::seconds(10)};
  bootstrap::detail::clock::time_point deadline{};
  std::chrono::nanoseconds timeout{};  ///< for messages: what the deadline was set from
};

/// Connects this rank to every other on every rail, each connection proven (handshake):
/// to the ranks above it as the connecting side, from the ranks below it as the accepting one.
/// `adopt(peer, rail, fd)` takes each connection once it is proven. Throws bootstrap_error at
/// the deadline, naming what is missing, or when a peer refuses this rank.
template <class Adopt>
void meet(const handshake_terms& terms, const meeting& m, Adopt&& adopt) {
  namespace bsd = bootstrap::detail;
  using clock = bsd::clock;
  const std::size_t nrails = m.rails.size();
  const auto n = static_cast<std::size_t>(terms.size);
  std::vector<char> have(n * nrails, 0);
  const auto taken = [&](int peer, int rail) {
    return have[static_cast<std::size_t>(peer) * nrails + static_cast<std::size_t>(rail)] != 0;
  };
  struct slot {
    handshake h;
    clock::time_point give_up;  ///< accepted: dropped then; connecting: reopened no sooner
    bool accepted;
  };
  std::vector<slot> open;
  // Connections to reopen: (peer, rail, when).
  std::vector<std::tuple<int, std::size_t, clock::time_point>> redial;
  std::string last_refusal;
  const auto dial = [&](int peer, std::size_t r) {
    auto [fd, err] = start_connect(m.rails[r], m.addresses[static_cast<std::size_t>(peer)][r],
                                   m.buffer_bytes, m.user_timeout);
    if (err == 0) {
      open.push_back({handshake::connecting(std::move(fd), peer, static_cast<int>(r), terms),
                      clock::time_point::max(), false});
      return;
    }
    if (err != ECONNREFUSED && err != EAGAIN)
      throw bootstrap_error(fmt::format(
          "socket transport: connecting from rail {} to {} failed: {}", m.rails[r].name,
          address_text(m.addresses[static_cast<std::size_t>(peer)][r]), std::strerror(err)));
    last_refusal = fmt::format("connecting to rank {} on rail {}: {}", peer, m.rails[r].name,
                               std::strerror(err));
    redial.emplace_back(peer, r, clock::now() + std::chrono::milliseconds(10));
  };
  for (int p = terms.rank + 1; p < terms.size; ++p)
    for (std::size_t r = 0; r < nrails; ++r) dial(p, r);
  std::size_t missing = n * nrails - nrails;  // every other rank on every rail
  // Accepted connections still proving themselves, at most this many at once; past it the
  // oldest goes, so a flood of idle connections cannot keep the ranks out.
  const std::size_t max_accepting = std::max<std::size_t>(64, 2 * n * nrails);
  std::vector<pollfd> pfds;
  const auto drop = [&](slot& s, std::string_view why) {
    if (s.h.heard())
      log::warn("socket transport: dropped a connection from {} on rail {}: {}", s.h.remote(),
                m.rails[static_cast<std::size_t>(s.h.rail())].name, why);
    else
      log::info("socket transport: a connection from {} on rail {} closed unheard ({})",
                s.h.remote(), m.rails[static_cast<std::size_t>(s.h.rail())].name, why);
  };
  while (missing > 0) {
    const auto now = clock::now();
    if (now >= m.deadline) {
      std::string what;
      for (std::size_t p = 0; p < n; ++p)
        for (std::size_t r = 0; r < nrails; ++r)
          if (p != static_cast<std::size_t>(terms.rank) && !have[p * nrails + r])
            what +=
                fmt::format("{}rank {} on rail {}", what.empty() ? "" : ", ", p, m.rails[r].name);
      throw bootstrap_error(fmt::format(
          "socket transport: {} connection{} never proven within {}: {}{}", missing,
          missing == 1 ? "" : "s", bsd::seconds_text(m.timeout), what,
          last_refusal.empty() ? "" : fmt::format(" (last failure: {})", last_refusal)));
    }
    for (auto it = redial.begin(); it != redial.end();)
      if (std::get<2>(*it) <= now) {
        dial(std::get<0>(*it), std::get<1>(*it));
        it = redial.erase(it);
      } else {
        ++it;
      }
    auto wake = m.deadline;
    for (const auto& s : open)
      if (s.accepted) wake = std::min(wake, s.give_up);
    for (const auto& d : redial) wake = std::min(wake, std::get<2>(d));
    pfds.clear();
    for (const auto& l : m.listeners) pfds.push_back({l.get(), POLLIN, 0});
    for (const auto& s : open) pfds.push_back({s.h.fd(), s.h.events(), 0});
    const int rc = ::poll(pfds.data(), pfds.size(), bsd::poll_ms_until(wake));
    if (rc < 0 && errno != EINTR)
      throw bootstrap_error(fmt::format("poll failed: {}", std::strerror(errno)));
    // Handshakes first (their indices follow the listeners'), then new connections.
    std::vector<slot> kept;
    kept.reserve(open.size());
    for (std::size_t i = 0; i < open.size(); ++i) {
      slot& s = open[i];
      const short re = rc > 0 ? pfds[m.listeners.size() + i].revents : short{0};
      handshake::outcome o = handshake::outcome::working;
      if (re != 0) o = s.h.step(taken);
      if (o == handshake::outcome::working) {
        if (s.accepted && clock::now() >= s.give_up) {
          drop(s, fmt::format("it did not finish its handshake within {}",
                              bsd::seconds_text(m.handshake_timeout)));
          continue;
        }
        kept.push_back(std::move(s));
        continue;
      }
      if (o == handshake::outcome::done) {
        const int peer = s.h.peer(), rail = s.h.rail();
        have[static_cast<std::size_t>(peer) * nrails + static_cast<std::size_t>(rail)] = 1;
        --missing;
        adopt(peer, rail, s.h.release());
        continue;
      }
      if (s.accepted) {
        drop(s, s.h.why());
        if (s.h.heard()) last_refusal = fmt::format("{}: {}", s.h.remote(), s.h.why());
        continue;
      }
      if (o == handshake::outcome::refused)
        throw bootstrap_error(fmt::format(
            "socket transport: rank {} ({}) refused this rank's connection on rail {}: {}",
            s.h.peer(), s.h.remote(), m.rails[static_cast<std::size_t>(s.h.rail())].name,
            s.h.why()));
      last_refusal = fmt::format("rank {} on rail {}: {}", s.h.peer(),
                                 m.rails[static_cast<std::size_t>(s.h.rail())].name, s.h.why());
      log::info("socket transport: {}; opening the connection again", last_refusal);
      redial.emplace_back(s.h.peer(), static_cast<std::size_t>(s.h.rail()),
                          clock::now() + std::chrono::milliseconds(10));
    }
    open = std::move(kept);
    if (rc <= 0) continue;
    for (std::size_t r = 0; r < m.listeners.size(); ++r) {
      if (!(pfds[r].revents & POLLIN)) continue;
      for (;;) {
        sockaddr_in from{};
        socklen_t len = sizeof from;
        bsd::unique_fd fd(::accept4(m.listeners[r].get(), reinterpret_cast<sockaddr*>(&from), &len,
                                    SOCK_NONBLOCK | SOCK_CLOEXEC));
        if (!fd) break;
        tune(fd.get(), 0, m.user_timeout);
        const std::size_t accepting = static_cast<std::size_t>(
            std::count_if(open.begin(), open.end(), [](const slot& s) { return s.accepted; }));
        if (accepting >= max_accepting) {
          const auto oldest =
              std::find_if(open.begin(), open.end(), [](const slot& s) { return s.accepted; });
          drop(*oldest, "too many connections were proving themselves at once");
          open.erase(oldest);
        }
        open.push_back(
            {handshake::accepting(std::move(fd), static_cast<int>(r), terms, address_text(from)),
             clock::now() + std::chrono::duration_cast<clock::duration>(m.handshake_timeout),
             true});
      }
    }
  }
}

}  // namespace ringzero::socket::detail
