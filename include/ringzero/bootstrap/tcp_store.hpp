// The TCP rendezvous store: rank 0 runs the server (a thread in its own process) and every
// rank, rank 0 included, talks to it as a client. This is how ranks started by ringzero-run,
// torchrun, srun or mpirun find each other before any fabric exists.
//
//   auto info = ringzero::bootstrap::detect_launch();
//   ringzero::bootstrap::tcp_store store(info.master_addr, info.master_port, info.rank == 0,
//                                        info.world_size, info.token);
//   store.set(fmt::format("addr/{}", info.rank), my_address);
//   auto peer = store.get("addr/0");
//
// - Every request carries the job's token; the server refuses other tokens, so a rank of
//   another job that reuses the port fails with a clear error instead of joining this one.
// - Keys are at most 4 KiB and values at most 64 MiB. The server bounds what any client can
//   cost it (connections, memory, time to present the token or finish a request): see
//   store_limits.hpp. It listens only where it is told (see bind_address below).
// - Connecting retries with backoff until the deadline, so ranks may start before rank 0.
// - get() and wait() wait server-side (no polling) and fail with timeout_error naming the key.
// - One object may be used from several threads at once: each call borrows its own
//   connection, so a thread blocked in get() never holds up another thread's set().
// - Rank 0's destructor keeps serving until every rank's store was destroyed (at most the
//   timeout), so rank 0 finishing first does not pull the store from under the others.
// - Ranks that open one store after another on the same port number them with `generation`
//   (make_store does this): a rank already done with store g then never talks to rank 0's
//   store g while it still serves stragglers, but waits for store g+1.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "ringzero/bootstrap/detail/protocol.hpp"
#include "ringzero/bootstrap/detail/socket.hpp"
#include "ringzero/bootstrap/detail/tcp_server.hpp"
#include "ringzero/bootstrap/store.hpp"
#include "ringzero/bootstrap/store_limits.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"

namespace ringzero::bootstrap {

class tcp_store final : public store {
 public:
  /// Connects to (and, if `is_server`, first starts) the store at `host`:`port`.
  ///
  /// - `world_size`: ranks in the job; every rank must pass the same value.
  /// - `token`: the per-job secret (RINGZERO_TOKEN), at most 256 bytes.
  /// - `timeout`: deadline for connecting and for each get/wait.
  /// - `bind_address` (server only): an IP address or interface name to listen on. Empty:
  ///   loopback only if `host` is a loopback address, else every interface.
  /// - `port` 0 with `is_server` listens on a free port; port() tells which.
  /// - `generation`: how many stores on this port this rank opened before (see above); every
  ///   rank must pass the same value.
  /// - `limits` (server only): connections, memory and time the server spends on clients
  ///   (store_limits.hpp); make_store passes tcp_store_limits::from_env().
  ///
  /// Throws timeout_error if the server cannot be reached in time, bootstrap_error if it
  /// refuses this rank (wrong token, different world size) or the port cannot be bound.
  tcp_store(std::string host, int port, bool is_server, int world_size, std::string token,
            std::chrono::nanoseconds timeout = ringzero::detail::env_timeout(),
            const std::string& bind_address = {}, std::uint64_t generation = 0,
            const tcp_store_limits& limits = {})
      : host_(std::move(host)),
        port_(port),
        world_size_(world_size),
        token_(std::move(token)),
        timeout_(timeout),
        generation_(generation) {
    if (port < 0 || port > 65535 || (port == 0 && !is_server))
      throw invalid_argument(fmt::format("tcp_store: port {} is not a valid TCP port", port));
    if (world_size < 1)
      throw invalid_argument(
          fmt::format("tcp_store: world size {} must be at least 1", world_size));
    if (token_.size() > detail::max_token_bytes)
      throw invalid_argument(fmt::format("tcp_store: the token is {} bytes; at most {} allowed",
                                         token_.size(), detail::max_token_bytes));
    if (timeout_ <= std::chrono::nanoseconds::zero())
      throw invalid_argument("tcp_store: the timeout must be positive");
    const auto deadline = detail::clock::now() + timeout_;
    if (is_server) {
      // Every other rank connects to `host`: one it cannot resolve fails them at once, so it
      // fails the server at once too, naming the host, rather than after its deadline naming
      // a key the others never set.
      static_cast<void>(detail::resolve(host_, port));
      const std::string where =
          bind_address.empty() && detail::is_loopback_host(host_) ? "127.0.0.1" : bind_address;
      server_ = std::make_unique<detail::tcp_server>(where, port, world_size, token_, generation_,
                                                     limits.resolved(world_size, timeout_));
      port_ = server_->port();
      targets_ = {server_->self_endpoint()};
    } else {
      targets_ = detail::resolve(host_, port_);
    }
    release(connect(deadline));
  }

  tcp_store(const tcp_store&) = delete;
  tcp_store& operator=(const tcp_store&) = delete;

  ~tcp_store() override {
    if (!said_done_.exchange(true)) say_done();
    {
      std::lock_guard lock(pool_mutex_);
      idle_.clear();
    }
    if (!server_) return;
    const int expected = expected_done();
    const int done = server_->wait_done(expected, detail::clock::now() + timeout_);
    if (done < expected)
      log::warn("store: shutting down after {}: only {} of {} ranks closed their store",
                detail::seconds_text(timeout_), done, expected);
  }

  void set(std::string_view key, std::span<const std::byte> value) override {
    set_within(key, value, timeout_);
  }

  [[nodiscard]] std::vector<std::byte> get(std::string_view key) override {
    return get_within(key, timeout_);
  }

  std::int64_t add(std::string_view key, std::int64_t delta) override {
    return add_within(key, delta, timeout_);
  }

  std::int64_t add_within(std::string_view key, std::int64_t delta,
                          std::chrono::nanoseconds limit) override {
    check_key(key);
    std::byte arg[8];
    detail::put_u64(arg, static_cast<std::uint64_t>(delta));
    const auto r = call(detail::op::add, key, arg, deadline_within(limit));
    if (r.size() != 8)
      throw bootstrap_error(fmt::format("store at {}: malformed reply to add '{}'", where(), key));
    return static_cast<std::int64_t>(detail::get_u64(r.data()));
  }

  void set_within(std::string_view key, std::span<const std::byte> value,
                  std::chrono::nanoseconds limit) override {
    check_key(key);
    if (value.size() > detail::max_value_bytes)
      throw invalid_argument(fmt::format(
          "tcp_store: the value for '{}' is {} bytes; at most 64 MiB allowed", key, value.size()));
    call(detail::op::set, key, value, deadline_within(limit));
  }

  [[nodiscard]] std::vector<std::byte> get_within(std::string_view key,
                                                  std::chrono::nanoseconds limit) override {
    check_key(key);
    return call(detail::op::get, key, {}, deadline_within(limit));
  }

  void farewell(std::chrono::nanoseconds limit) noexcept override {
    if (!said_done_.exchange(true)) say_done();
    if (server_) static_cast<void>(server_->wait_done(expected_done(), deadline_within(limit)));
  }

  void excuse(int ranks) override {
    if (ranks > 0) excused_.fetch_add(ranks, std::memory_order_relaxed);
  }

  void wait(std::span<const std::string> keys) override {
    const auto deadline = detail::clock::now() + timeout_;
    for (const auto& k : keys) check_key(k);
    for (const auto& k : keys) call(detail::op::wait, k, {}, deadline);
  }

  /// The port the store listens on (useful with port 0).
  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] const std::string& host() const noexcept { return host_; }
  [[nodiscard]] std::chrono::nanoseconds timeout() const noexcept { return timeout_; }

 private:
  // The server is an earlier store still serving stragglers: connect again later.
  struct retry_later {
    std::string reason;
  };

  [[nodiscard]] std::string where() const { return fmt::format("{}:{}", host_, port_); }

  // Ranks known dead never say done; waiting for them would hold rank 0 for the timeout.
  [[nodiscard]] int expected_done() const noexcept {
    return std::max(1, world_size_ - excused_.load(std::memory_order_relaxed));
  }

  [[nodiscard]] detail::clock::time_point deadline_within(std::chrono::nanoseconds limit) const {
    return detail::clock::now() + std::min(limit, timeout_);
  }

  static void check_key(std::string_view key) {
    if (key.empty()) throw invalid_argument("tcp_store: keys must not be empty");
    if (key.size() > detail::max_key_bytes)
      throw invalid_argument(
          fmt::format("tcp_store: a key of {} bytes is longer than 4 KiB", key.size()));
  }

  [[nodiscard]] detail::unique_fd acquire(detail::clock::time_point deadline) {
    {
      std::lock_guard lock(pool_mutex_);
      if (!idle_.empty()) {
        detail::unique_fd fd = std::move(idle_.back());
        idle_.pop_back();
        return fd;
      }
    }
    return connect(deadline);
  }

  void release(detail::unique_fd fd) {
    std::lock_guard lock(pool_mutex_);
    idle_.push_back(std::move(fd));
  }

  [[nodiscard]] detail::unique_fd connect(detail::clock::time_point deadline) {
    auto pause = std::chrono::milliseconds(10);
    std::string last_error;
    for (;;) {
      for (const auto& ep : targets_) {
        detail::unique_fd fd;
        if (const int err = detail::try_connect(ep, deadline, fd); err != 0) {
          last_error = detail::errno_text(err);
          continue;
        }
        try {
          hello(fd.get(), deadline);
          return fd;
        } catch (const retry_later& r) {
          last_error = fmt::format("the server is still the previous store ({})", r.reason);
        } catch (const peer_error&) {
          // A previous store closing down dropped the connection; the next one will answer.
          last_error = "the connection closed before the store answered";
        }
      }
      const auto now = detail::clock::now();
      if (now >= deadline)
        throw timeout_error(
            fmt::format("store: could not connect to rank 0's store at {} within {} (last "
                        "error: {}); is rank 0 running, and do MASTER_ADDR and MASTER_PORT "
                        "name it?",
                        where(), detail::seconds_text(timeout_), last_error),
            0);
      std::this_thread::sleep_for(std::min<detail::clock::duration>(pause, deadline - now));
      pause = std::min(pause * 2, std::chrono::milliseconds(1000));
    }
  }

  void hello(int fd, detail::clock::time_point deadline) {
    std::byte arg[16];
    detail::put_u64(arg, static_cast<std::uint64_t>(world_size_));
    detail::put_u64(arg + 8, generation_);
    exchange(fd, detail::op::hello, {}, arg, deadline);
  }

  std::vector<std::byte> call(detail::op o, std::string_view key, std::span<const std::byte> value,
                              detail::clock::time_point deadline) {
    try {
      detail::unique_fd fd = acquire(deadline);
      auto r = exchange(fd.get(), o, key, value, deadline);
      release(std::move(fd));
      return r;
    } catch (const peer_error&) {
      lost_.store(true, std::memory_order_relaxed);
      throw;
    } catch (const timeout_error&) {
      if (o != detail::op::get && o != detail::op::wait)
        lost_.store(true, std::memory_order_relaxed);
      throw;
    }
  }

  // One request and its reply on `fd`. On any failure the caller drops the connection (its
  // unique_fd goes out of scope), so a half-finished exchange never desynchronises the stream.
  std::vector<std::byte> exchange(int fd, detail::op o, std::string_view key,
                                  std::span<const std::byte> value,
                                  detail::clock::time_point deadline) {
    detail::request_header h;
    h.op = static_cast<std::uint8_t>(o);
    h.token_len = static_cast<std::uint32_t>(token_.size());
    h.key_len = static_cast<std::uint32_t>(key.size());
    h.value_len = value.size();
    const auto head = detail::encode(h);
    std::vector<std::byte> msg(head.begin(), head.end());
    const auto* t = reinterpret_cast<const std::byte*>(token_.data());
    msg.insert(msg.end(), t, t + token_.size());
    const auto* k = reinterpret_cast<const std::byte*>(key.data());
    msg.insert(msg.end(), k, k + key.size());
    const bool small = value.size() <= 64 * 1024;
    if (small) msg.insert(msg.end(), value.begin(), value.end());
    check_io(detail::send_all(fd, msg, deadline), o, key);
    if (!small) check_io(detail::send_all(fd, value, deadline), o, key);

    std::array<std::byte, detail::reply_header_bytes> rh{};
    check_io(detail::recv_all(fd, rh, deadline), o, key);
    const detail::reply_header reply = detail::decode_reply(rh);
    if (reply.why != nullptr)
      throw bootstrap_error(
          fmt::format("store: the service at {} is not a ringzero store (malformed reply: {})",
                      where(), reply.why));
    const detail::status st = reply.st;
    std::vector<std::byte> payload(reply.len);
    check_io(detail::recv_all(fd, payload, deadline), o, key);
    if (st == detail::status::retry)
      throw retry_later{std::string(reinterpret_cast<const char*>(payload.data()), payload.size())};
    if (st == detail::status::error)
      throw bootstrap_error(fmt::format(
          "store at {} refused {}{}: {}", where(), detail::op_name(o),
          key.empty() ? std::string() : fmt::format(" '{}'", key),
          std::string_view(reinterpret_cast<const char*>(payload.data()), payload.size())));
    return payload;
  }

  void check_io(detail::io_result r, detail::op o, std::string_view key) const {
    if (r == detail::io_result::ok) return;
    if (r == detail::io_result::closed)
      throw peer_error(
          fmt::format("store: rank 0's store at {} closed the connection during {}{}", where(),
                      detail::op_name(o), key.empty() ? std::string() : fmt::format(" '{}'", key)),
          0);
    if (o == detail::op::get || o == detail::op::wait)
      throw timeout_error(
          fmt::format("store: timed out after {} waiting for key '{}' in the store at {} (no "
                      "rank has set it; RINGZERO_TIMEOUT sets the limit)",
                      detail::seconds_text(timeout_), key, where()),
          -1);
    throw timeout_error(
        fmt::format("store: no answer from the store at {} to {}{} within {}", where(),
                    detail::op_name(o), key.empty() ? std::string() : fmt::format(" '{}'", key),
                    detail::seconds_text(timeout_)),
        0);
  }

  // Tells the server this rank is finished with it. Best effort: the server may be gone.
  void say_done() noexcept {
    try {
      const auto deadline = detail::clock::now() +
                            std::min<std::chrono::nanoseconds>(timeout_, std::chrono::seconds(2));
      detail::unique_fd fd;
      {
        std::lock_guard lock(pool_mutex_);
        if (!idle_.empty()) {
          fd = std::move(idle_.back());
          idle_.pop_back();
        }
      }
      if (!fd) {
        // The server went away during a call (rank 0 died): retrying until the deadline
        // would only hold this rank up.
        if (lost_.load(std::memory_order_relaxed)) return;
        fd = connect(deadline);
      }
      exchange(fd.get(), detail::op::done, {}, {}, deadline);
    } catch (const std::exception& e) {
      log::info("store: could not tell {} this rank is done: {}", where(), e.what());
    }
  }

  std::string host_;
  int port_;
  int world_size_;
  std::string token_;
  std::chrono::nanoseconds timeout_;
  std::uint64_t generation_;
  std::vector<detail::endpoint> targets_;
  std::mutex pool_mutex_;
  std::vector<detail::unique_fd> idle_;
  std::atomic<int> excused_{0};
  std::atomic<bool> said_done_{false};
  std::atomic<bool> lost_{false};  ///< a call found the server gone
  // Last member: destroyed first, after the destructor body waited for the other ranks.
  std::unique_ptr<detail::tcp_server> server_;
};

}  // namespace ringzero::bootstrap
