// The TCP store's server: one thread inside rank 0's process serving every rank's requests
// from a poll() loop. Nothing a client sends can stop it serving the others: a bad frame, a
// wrong token, a connection that never authenticates, a request sent a byte at a time or a
// reply never read costs that client its connection and nothing else, and what all clients
// together can make it hold is capped (store_limits.hpp). get/wait requests for missing keys are
// parked and answered when the key is set.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ringzero/bootstrap/detail/protocol.hpp"
#include "ringzero/bootstrap/detail/socket.hpp"
#include "ringzero/bootstrap/store_limits.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"

namespace ringzero::bootstrap::detail {

using value_ptr = std::shared_ptr<const std::vector<std::byte>>;

class tcp_server {
 public:
  /// Listens on `bind_address` (empty: every interface) at `port` (0: any free port), within
  /// `limits` (already resolved: see tcp_store_limits::resolved).
  tcp_server(const std::string& bind_address, int port, int world_size, std::string token,
             std::uint64_t generation, const tcp_store_limits& limits)
      : world_size_(world_size),
        token_(std::move(token)),
        generation_(generation),
        limits_(limits) {
    endpoint where = bind_endpoint(bind_address, port);
    listen_ = open_listener(where, bind_address.empty());
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (::getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0)
      throw bootstrap_error(fmt::format("store: getsockname failed: {}", errno_text(errno)));
    local_ = make_endpoint(reinterpret_cast<const sockaddr*>(&bound), len);
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0)
      throw bootstrap_error(fmt::format("store: pipe2 failed: {}", errno_text(errno)));
    wake_read_.reset(fds[0]);
    wake_write_.reset(fds[1]);
    log::info("store: serving {} ranks on {}:{}", world_size_, local_.host(), local_.port());
    thread_ = std::thread([this] { run(); });
  }

  tcp_server(const tcp_server&) = delete;
  tcp_server& operator=(const tcp_server&) = delete;
  ~tcp_server() { stop(); }

  [[nodiscard]] int port() const noexcept { return local_.port(); }

  /// Where this process's own client should connect: the bound address, or loopback when the
  /// server listens on every interface.
  [[nodiscard]] endpoint self_endpoint() const {
    return local_.is_wildcard() ? loopback_endpoint(local_.family(), local_.port()) : local_;
  }

  /// Waits until `count` clients said done, or `deadline`; returns how many did.
  int wait_done(int count, clock::time_point deadline) {
    std::unique_lock lock(done_mutex_);
    done_cv_.wait_until(lock, deadline, [&] { return done_ >= count; });
    return done_;
  }

  void stop() noexcept {
    if (!thread_.joinable()) return;
    stopping_.store(true, std::memory_order_release);
    const char c = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_write_.get(), &c, 1);
    thread_.join();
  }

 private:
  enum class phase { header, token, body, draining };
  enum class wait_kind { get, exists };

  struct out_chunk {
    std::array<std::byte, reply_header_bytes> head{};
    value_ptr body;
    std::size_t sent = 0;
    [[nodiscard]] std::size_t size() const noexcept {
      return head.size() + (body ? body->size() : 0);
    }
  };

  static constexpr auto never = clock::time_point::max();
  // Connections refused at the cap are answered before they close; at most this many at once.
  static constexpr std::size_t refusals_in_flight = 64;
  // A refused client's unread input is discarded for this long (and up to max_drain_bytes)
  // before the close, so the kernel does not reset the connection over the refusal.
  static constexpr std::chrono::seconds drain_time{1};
  static constexpr std::size_t max_drain_bytes = std::size_t{1} << 20;
  // Slack reserved beyond an add's key for the counter's decimal text.
  static constexpr std::size_t counter_reserve = 24;

  struct connection {
    unique_fd fd;
    std::string peer;
    clock::time_point auth_by = never;     ///< present the token by then
    clock::time_point request_by = never;  ///< finish the request under way by then
    clock::time_point reply_by = never;    ///< take the queued reply by then
    clock::time_point close_by = never;    ///< refused: be gone by then
    std::size_t reserved = 0;              ///< memory reserved for the request's body
    bool authenticated = false;
    bool parked = false;   ///< a get/wait is waiting for its key
    bool closing = false;  ///< refused: reply, drain, close (by `close_by` at the latest)
    bool dead = false;
    phase ph = phase::header;
    std::array<std::byte, request_header_bytes> head{};
    std::size_t have = 0;
    request_header req;
    std::vector<std::byte> buf;
    std::size_t drained = 0;
    std::string parked_key;
    std::deque<out_chunk> out;
  };

  struct waiter {
    std::uint64_t conn;
    wait_kind kind;
  };

  static unique_fd open_listener(endpoint& where, bool any_interface) {
    unique_fd fd(::socket(where.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd && any_interface && errno == EAFNOSUPPORT) {
      // No IPv6 on this host: listen on every IPv4 interface instead.
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      const int port = where.port();
      where = make_endpoint(reinterpret_cast<const sockaddr*>(&a), sizeof a);
      where.set_port(port);
      fd.reset(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    }
    if (!fd) throw bootstrap_error(fmt::format("store: socket() failed: {}", errno_text(errno)));
    const int one = 1;
    const int zero = 0;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (where.family() == AF_INET6 && any_interface)
      ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    if (::bind(fd.get(), where.sa(), where.len) != 0) {
      const int err = errno;
      throw bootstrap_error(fmt::format(
          "store: cannot listen on {}:{}: {}{}", where.host(), where.port(), errno_text(err),
          err == EADDRINUSE ? " (another program or job holds the port: set MASTER_PORT to a free "
                              "one)"
                            : ""));
    }
    if (::listen(fd.get(), SOMAXCONN) != 0)
      throw bootstrap_error(fmt::format("store: listen() failed: {}", errno_text(errno)));
    return fd;
  }

  void run() {
    std::vector<pollfd> fds;
    std::vector<std::uint64_t> ids;
    while (!stopping_.load(std::memory_order_acquire)) {
      const auto now = clock::now();
      fds.clear();
      ids.clear();
      fds.push_back({wake_read_.get(), POLLIN, 0});
      const bool accepting = conns_.size() < limits_.max_connections + refusals_in_flight &&
                             now >= accept_paused_until_;
      if (accepting) fds.push_back({listen_.get(), POLLIN, 0});
      auto next_deadline = clock::time_point::max();
      if (!accepting && now < accept_paused_until_) next_deadline = accept_paused_until_;
      for (auto& [id, c] : conns_) {
        // A client gets one reply at a time: while one is queued, nothing more is read from
        // it, so a client that sends requests but never reads cannot pile up replies.
        short ev = c.out.empty() ? POLLIN : POLLOUT;
        if (c.closing && c.ph != phase::draining) ev = static_cast<short>(ev & ~POLLIN);
        fds.push_back({c.fd.get(), ev, 0});
        ids.push_back(id);
        next_deadline = std::min({next_deadline, c.auth_by, c.request_by, c.reply_by, c.close_by});
      }
      const int timeout_ms = next_deadline == clock::time_point::max()
                                 ? -1
                                 : std::max(1, poll_ms_until(next_deadline));
      const int rc = ::poll(fds.data(), fds.size(), timeout_ms);
      if (rc < 0 && errno != EINTR) {
        log::warn("store: poll failed: {}", errno_text(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      if (fds[0].revents != 0) drain_wake();
      if (accepting && fds[1].revents != 0) accept_all();
      const std::size_t first = accepting ? 2 : 1;
      for (std::size_t i = 0; i < ids.size(); ++i) {
        const short rev = fds[first + i].revents;
        auto it = conns_.find(ids[i]);
        if (it == conns_.end() || rev == 0) continue;
        service(ids[i], it->second, rev);
      }
      expire(clock::now());
      reap();
    }
    conns_.clear();
  }

  void drain_wake() noexcept {
    char buf[64];
    while (::read(wake_read_.get(), buf, sizeof buf) > 0) {
    }
  }

  void accept_all() {
    while (conns_.size() < limits_.max_connections + refusals_in_flight) {
      sockaddr_storage from{};
      socklen_t len = sizeof from;
      unique_fd fd(::accept4(listen_.get(), reinterpret_cast<sockaddr*>(&from), &len,
                             SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!fd) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          log::warn("store: cannot accept more connections: {}", errno_text(errno));
          accept_paused_until_ = clock::now() + std::chrono::milliseconds(100);
        }
        return;
      }
      set_nodelay(fd.get());
      connection c;
      c.fd = std::move(fd);
      const endpoint peer = make_endpoint(reinterpret_cast<const sockaddr*>(&from), len);
      c.peer = fmt::format("{}:{}", peer.host(), peer.port());
      c.auth_by = clock::now() + limits_.idle_timeout;
      const std::uint64_t id = next_id_++;
      const bool room = make_room();
      auto& added = conns_.emplace(id, std::move(c)).first->second;
      if (!room)
        refuse(added, fmt::format("the store serves at most {} connections, all in use by this "
                                  "job's ranks (RINGZERO_STORE_MAX_CONNECTIONS raises it)",
                                  limits_.max_connections));
    }
  }

  // Whether one more connection fits under the cap, after dropping the oldest connection that
  // has not presented the token if need be: a flood of idle connections then displaces only
  // itself, never a rank that has authenticated.
  bool make_room() {
    std::size_t live = 0;
    connection* oldest = nullptr;
    std::uint64_t oldest_id = 0;
    for (auto& [id, c] : conns_) {
      if (c.dead || c.closing) continue;
      ++live;
      if (!c.authenticated && (oldest == nullptr || id < oldest_id)) {
        oldest = &c;
        oldest_id = id;
      }
    }
    if (live < limits_.max_connections) return true;
    if (oldest == nullptr) return false;
    log::info("store: dropped {} to make room: {} connections and it had not authenticated",
              oldest->peer, limits_.max_connections);
    abort(*oldest);
    return true;
  }

  void service(std::uint64_t id, connection& c, short rev) {
    if ((rev & POLLOUT) != 0) flush(c);
    if (c.dead) return;
    if ((rev & (POLLIN | POLLHUP | POLLERR)) != 0) {
      if (c.ph == phase::draining)
        drain(c);
      else if (c.parked)
        check_parked(c);
      else
        read_requests(id, c);
    }
  }

  // A parked client sends nothing until it has its answer, so input now is either its close
  // (it gave up waiting) or a protocol violation; either way the connection is finished.
  void check_parked(connection& c) {
    std::byte b{};
    const ssize_t n = ::recv(c.fd.get(), &b, 1, MSG_PEEK);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    c.dead = true;
  }

  void read_requests(std::uint64_t id, connection& c) {
    std::size_t budget = std::size_t{4} << 20;  // fairness: no client monopolises a pass
    while (!c.dead && !c.parked && !c.closing && c.out.empty() && budget > 0) {
      std::span<std::byte> dst;
      if (c.ph == phase::header)
        dst = std::span(c.head).subspan(c.have);
      else
        dst = std::span(c.buf).subspan(c.have);
      if (!dst.empty()) {
        const ssize_t n = ::recv(c.fd.get(), dst.data(), std::min(dst.size(), budget), 0);
        if (n == 0) {
          c.dead = true;
          return;
        }
        if (n < 0) {
          if (errno == EINTR) continue;
          if (errno != EAGAIN && errno != EWOULDBLOCK) c.dead = true;
          return;
        }
        if (c.ph == phase::header && c.have == 0)
          c.request_by = clock::now() + limits_.request_timeout;
        c.have += static_cast<std::size_t>(n);
        budget -= static_cast<std::size_t>(n);
        if (static_cast<std::size_t>(n) < dst.size()) continue;
      }
      advance(id, c);
    }
  }

  // Moves a connection to its next phase once the current one has all its bytes.
  void advance(std::uint64_t id, connection& c) {
    switch (c.ph) {
      case phase::header:
        c.req = decode_request(c.head);
        if (const char* why = check_header(c.req)) return refuse(c, why);
        c.ph = phase::token;
        c.buf.assign(c.req.token_len, std::byte{});
        c.have = 0;
        return;
      case phase::token: {
        if (!same_token(c.buf, token_)) return refuse(c, wrong_token_text);
        c.authenticated = true;
        c.auth_by = never;
        // check_header bounded both lengths, so neither the sum nor the reservation overflows.
        const std::size_t body = std::size_t{c.req.key_len} + c.req.value_len;
        const std::size_t need =
            body + (static_cast<op>(c.req.op) == op::add ? counter_reserve : 0);
        if (need > limits_.max_memory_bytes - std::min(limits_.max_memory_bytes, memory_used_))
          return refuse(c, fmt::format("the store's memory limit of {} bytes would be passed "
                                       "({} in use, this request needs {}; "
                                       "RINGZERO_STORE_MAX_MEMORY raises it)",
                                       limits_.max_memory_bytes, memory_used_, need));
        memory_used_ += need;
        c.reserved = need;
        c.ph = phase::body;
        c.buf.assign(body, std::byte{});
        c.have = 0;
        return;
      }
      case phase::body: {
        c.ph = phase::header;
        c.have = 0;
        c.request_by = never;
        memory_used_ -= std::exchange(c.reserved, 0);
        std::vector<std::byte> body = std::move(c.buf);
        c.buf = {};
        handle(id, c, std::move(body));
        return;
      }
      case phase::draining:
        return;
    }
  }

  void handle(std::uint64_t id, connection& c, std::vector<std::byte> body) {
    const auto o = static_cast<op>(c.req.op);
    std::string key(reinterpret_cast<const char*>(body.data()), c.req.key_len);
    const std::span<const std::byte> value = std::span(body).subspan(c.req.key_len);
    switch (o) {
      case op::hello: {
        const auto [world, generation] = decode_hello(value.first<16>());
        if (world != world_size_)
          return refuse(c, fmt::format("world size mismatch: rank 0 serves {} ranks, this rank "
                                       "was started for {}",
                                       world_size_, world));
        if (generation > generation_) {
          c.closing = true;
          c.close_by = clock::now() + drain_time;
          return reply(c, status::retry, fmt::format("this is store generation {}", generation_));
        }
        if (generation < generation_)
          return refuse(c, fmt::format("store generation mismatch: rank 0 serves generation {}, "
                                       "this rank asked for {} (ranks must open their stores in "
                                       "the same order)",
                                       generation_, generation));
        return reply_ok(c, nullptr);
      }
      case op::set: {
        body.erase(body.begin(), body.begin() + static_cast<std::ptrdiff_t>(c.req.key_len));
        auto v = std::make_shared<const std::vector<std::byte>>(std::move(body));
        store(key, v);
        reply_ok(c, nullptr);
        return wake(key, v);
      }
      case op::get:
      case op::wait: {
        const auto kind = o == op::get ? wait_kind::get : wait_kind::exists;
        if (auto it = data_.find(key); it != data_.end())
          return reply_ok(c, kind == wait_kind::get ? it->second : nullptr);
        c.parked = true;
        c.parked_key = key;
        waiters_[std::move(key)].push_back({id, kind});
        return;
      }
      case op::add: {
        const auto delta = static_cast<std::int64_t>(get_u64(value.data()));
        std::int64_t now = 0;
        if (auto it = data_.find(key); it != data_.end() && !parse_counter(*it->second, now))
          return reply_error(c, fmt::format("add: the value under '{}' is not an integer", key));
        std::int64_t next = 0;
        if (__builtin_add_overflow(now, delta, &next))
          return reply_error(c, fmt::format("add: the counter '{}' would overflow", key));
        auto v = std::make_shared<const std::vector<std::byte>>(counter_bytes(next));
        store(key, v);
        std::vector<std::byte> r(8);
        put_u64(r.data(), static_cast<std::uint64_t>(next));
        reply_ok(c, std::make_shared<const std::vector<std::byte>>(std::move(r)));
        return wake(key, v);
      }
      case op::done: {
        {
          std::lock_guard lock(done_mutex_);
          ++done_;
        }
        done_cv_.notify_all();
        return reply_ok(c, nullptr);
      }
    }
  }

  // Keeps `v` under `key`, counting the bytes held against the memory limit.
  void store(const std::string& key, value_ptr v) {
    auto [it, added] = data_.try_emplace(key);
    if (added)
      memory_used_ += key.size();
    else
      memory_used_ -= it->second->size();
    memory_used_ += v->size();
    it->second = std::move(v);
  }

  void wake(const std::string& key, const value_ptr& v) {
    auto it = waiters_.find(key);
    if (it == waiters_.end()) return;
    const std::vector<waiter> ws = std::move(it->second);
    waiters_.erase(it);
    for (const waiter& w : ws) {
      auto c = conns_.find(w.conn);
      if (c == conns_.end() || c->second.dead) continue;
      c->second.parked = false;
      c->second.parked_key.clear();
      reply_ok(c->second, w.kind == wait_kind::get ? v : nullptr);
    }
  }

  void reply_ok(connection& c, value_ptr payload) {
    out_chunk ch;
    ch.head = encode_reply(status::ok, payload ? payload->size() : 0);
    ch.body = std::move(payload);
    queue(c, std::move(ch));
  }

  void queue(connection& c, out_chunk ch) {
    if (c.out.empty()) c.reply_by = clock::now() + limits_.request_timeout;
    c.out.push_back(std::move(ch));
    flush(c);
  }

  void reply_error(connection& c, const std::string& msg) { reply(c, status::error, msg); }

  void reply(connection& c, status st, const std::string& msg) {
    out_chunk ch;
    ch.head = encode_reply(st, msg.size());
    const auto* b = reinterpret_cast<const std::byte*>(msg.data());
    ch.body = std::make_shared<const std::vector<std::byte>>(b, b + msg.size());
    queue(c, std::move(ch));
  }

  void refuse(connection& c, const std::string& why) {
    log::info("store: refused a request from {}: {}", c.peer, why);
    c.closing = true;
    c.close_by = clock::now() + drain_time;
    reply_error(c, why);
  }

  void flush(connection& c) {
    while (!c.out.empty() && !c.dead) {
      out_chunk& ch = c.out.front();
      std::span<const std::byte> part;
      if (ch.sent < ch.head.size())
        part = std::span<const std::byte>(ch.head).subspan(ch.sent);
      else
        part = std::span<const std::byte>(*ch.body).subspan(ch.sent - ch.head.size());
      const ssize_t n = ::send(c.fd.get(), part.data(), part.size(), MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) c.dead = true;
        return;
      }
      ch.sent += static_cast<std::size_t>(n);
      if (ch.sent == ch.size()) c.out.pop_front();
    }
    if (c.out.empty()) c.reply_by = never;
    if (c.out.empty() && c.closing && c.ph != phase::draining) start_draining(c);
  }

  // Closing a socket with unread input makes the kernel reset the connection, which can destroy
  // the refusal the client is about to read. So: stop sending, discard what the client still
  // sends for a moment, then close.
  void start_draining(connection& c) {
    ::shutdown(c.fd.get(), SHUT_WR);
    c.ph = phase::draining;
    c.close_by = clock::now() + drain_time;
    drain(c);
  }

  void drain(connection& c) {
    std::byte buf[4096];
    for (;;) {
      const ssize_t n = ::recv(c.fd.get(), buf, sizeof buf, 0);
      if (n > 0) {
        c.drained += static_cast<std::size_t>(n);
        if (c.drained > max_drain_bytes) c.dead = true;
        if (c.dead) return;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) c.dead = true;
      return;
    }
  }

  void expire(clock::time_point now) {
    for (auto& [id, c] : conns_) {
      if (c.dead) continue;
      if (c.closing) {
        c.dead = now >= c.close_by;
        continue;
      }
      const char* why = nullptr;
      std::chrono::nanoseconds limit{};
      if (now >= c.auth_by) {
        why = "did not present the job token";
        limit = limits_.idle_timeout;
      } else if (now >= c.request_by) {
        why = "did not finish its request";
        limit = limits_.request_timeout;
      } else if (now >= c.reply_by) {
        why = "did not take its reply";
        limit = limits_.request_timeout;
      }
      if (why == nullptr) continue;
      log::info("store: dropped {}: it {} within {}", c.peer, why, seconds_text(limit));
      abort(c);
    }
  }

  // Drops a connection with a reset: the kernel discards what is still queued for it instead
  // of trickling it to a peer that reads slowly on purpose.
  static void abort(connection& c) noexcept {
    const linger now{1, 0};
    ::setsockopt(c.fd.get(), SOL_SOCKET, SO_LINGER, &now, sizeof now);
    c.dead = true;
  }

  void reap() {
    for (auto it = conns_.begin(); it != conns_.end();) {
      if (!it->second.dead) {
        ++it;
        continue;
      }
      if (it->second.parked) {
        auto w = waiters_.find(it->second.parked_key);
        if (w != waiters_.end()) {
          std::erase_if(w->second, [id = it->first](const waiter& x) { return x.conn == id; });
          if (w->second.empty()) waiters_.erase(w);
        }
      }
      memory_used_ -= it->second.reserved;
      it = conns_.erase(it);
    }
  }

  const int world_size_;
  const std::string token_;
  const std::uint64_t generation_;
  const tcp_store_limits limits_;
  unique_fd listen_;
  endpoint local_;
  unique_fd wake_read_, wake_write_;

  // Owned by the server thread.
  std::unordered_map<std::uint64_t, connection> conns_;
  std::unordered_map<std::string, value_ptr> data_;
  std::unordered_map<std::string, std::vector<waiter>> waiters_;
  std::uint64_t next_id_ = 1;
  std::size_t memory_used_ = 0;  ///< keys and values in data_, plus reservations
  clock::time_point accept_paused_until_{};

  std::mutex done_mutex_;
  std::condition_variable done_cv_;
  int done_ = 0;

  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace ringzero::bootstrap::detail
