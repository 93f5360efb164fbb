// POSIX socket plumbing for the TCP store: owned descriptors, name resolution, non-blocking
// connect and whole-buffer send/receive against a deadline. Every socket is close-on-exec, so a
// trainer that spawns helpers does not leak the store's connections into them.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <fmt/core.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ringzero/error.hpp"

namespace ringzero::bootstrap::detail {

using clock = std::chrono::steady_clock;

[[nodiscard]] inline std::string errno_text(int err) {
  return std::strerror(err);
}

/// Human-readable seconds for error messages ("2.5 s").
[[nodiscard]] inline std::string seconds_text(std::chrono::nanoseconds d) {
  return fmt::format("{:g} s", std::chrono::duration<double>(d).count());
}

class unique_fd {
 public:
  unique_fd() = default;
  explicit unique_fd(int fd) noexcept : fd_(fd) {}
  unique_fd(unique_fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  unique_fd& operator=(unique_fd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  unique_fd(const unique_fd&) = delete;
  unique_fd& operator=(const unique_fd&) = delete;
  ~unique_fd() { reset(); }

  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] explicit operator bool() const noexcept { return fd_ >= 0; }
  [[nodiscard]] int release() noexcept { return std::exchange(fd_, -1); }
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

/// Milliseconds left until `deadline`, rounded up so a poll never returns just short of it.
[[nodiscard]] inline int poll_ms_until(clock::time_point deadline) {
  const auto left = deadline - clock::now();
  if (left <= clock::duration::zero()) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<long long>(ms, 1000 * 60 * 60));
}

/// A resolved socket address.
struct endpoint {
  sockaddr_storage addr{};
  socklen_t len = 0;

  [[nodiscard]] const sockaddr* sa() const noexcept {
    return reinterpret_cast<const sockaddr*>(&addr);
  }
  [[nodiscard]] int family() const noexcept { return addr.ss_family; }
  [[nodiscard]] int port() const noexcept {
    if (family() == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
    return ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
  }
  void set_port(int port) noexcept {
    if (family() == AF_INET6)
      reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = htons(static_cast<std::uint16_t>(port));
    else
      reinterpret_cast<sockaddr_in*>(&addr)->sin_port = htons(static_cast<std::uint16_t>(port));
  }
  [[nodiscard]] bool is_wildcard() const noexcept {
    if (family() == AF_INET6) {
      const auto& a = reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_addr;
      return IN6_IS_ADDR_UNSPECIFIED(&a);
    }
    return reinterpret_cast<const sockaddr_in*>(&addr)->sin_addr.s_addr == htonl(INADDR_ANY);
  }
  [[nodiscard]] std::string host() const {
    char buf[INET6_ADDRSTRLEN] = {};
    if (family() == AF_INET6)
      ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_addr, buf,
                  sizeof buf);
    else
      ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&addr)->sin_addr, buf, sizeof buf);
    return buf;
  }
};

[[nodiscard]] inline endpoint make_endpoint(const sockaddr* sa, socklen_t len) {
  endpoint e;
  std::memcpy(&e.addr, sa, std::min<std::size_t>(len, sizeof e.addr));
  e.len = len;
  return e;
}

[[nodiscard]] inline endpoint loopback_endpoint(int family, int port) {
  endpoint e;
  if (family == AF_INET6) {
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_loopback;
    e = make_endpoint(reinterpret_cast<const sockaddr*>(&a), sizeof a);
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    e = make_endpoint(reinterpret_cast<const sockaddr*>(&a), sizeof a);
  }
  e.set_port(port);
  return e;
}

/// Whether `host` names this machine's loopback: a store whose rendezvous address is loopback
/// need not listen on any other interface.
[[nodiscard]] inline bool is_loopback_host(std::string_view host) {
  if (host == "localhost" || host == "::1" || host == "ip6-localhost") return true;
  in_addr a{};
  const std::string h(host);
  return ::inet_pton(AF_INET, h.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}

/// Every address `host`:`port` resolves to, IPv4 first (the common case for MASTER_ADDR).
[[nodiscard]] inline std::vector<endpoint> resolve(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_ADDRCONFIG;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0)
    throw bootstrap_error(fmt::format("cannot resolve store host '{}': {}", host,
                                      rc == EAI_SYSTEM ? errno_text(errno) : ::gai_strerror(rc)));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, &::freeaddrinfo);
  std::vector<endpoint> out;
  for (const addrinfo* p = res; p != nullptr; p = p->ai_next)
    if (p->ai_family == AF_INET || p->ai_family == AF_INET6)
      out.push_back(make_endpoint(p->ai_addr, p->ai_addrlen));
  std::stable_partition(out.begin(), out.end(),
                        [](const endpoint& e) { return e.family() == AF_INET; });
  if (out.empty())
    throw bootstrap_error(fmt::format("store host '{}' has no IPv4 or IPv6 address", host));
  return out;
}

/// The address a server binds: empty = every interface; otherwise an IP literal or the name of
/// a network interface (its first IPv4 address, else its first IPv6 one).
[[nodiscard]] inline endpoint bind_endpoint(const std::string& where, int port) {
  if (where.empty()) {
    sockaddr_in6 a6{};
    a6.sin6_family = AF_INET6;
    a6.sin6_addr = in6addr_any;
    endpoint e = make_endpoint(reinterpret_cast<const sockaddr*>(&a6), sizeof a6);
    e.set_port(port);
    return e;
  }
  sockaddr_in a4{};
  a4.sin_family = AF_INET;
  if (::inet_pton(AF_INET, where.c_str(), &a4.sin_addr) == 1) {
    endpoint e = make_endpoint(reinterpret_cast<const sockaddr*>(&a4), sizeof a4);
    e.set_port(port);
    return e;
  }
  sockaddr_in6 a6{};
  a6.sin6_family = AF_INET6;
  if (::inet_pton(AF_INET6, where.c_str(), &a6.sin6_addr) == 1) {
    endpoint e = make_endpoint(reinterpret_cast<const sockaddr*>(&a6), sizeof a6);
    e.set_port(port);
    return e;
  }
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0)
    throw bootstrap_error(fmt::format("getifaddrs failed: {}", errno_text(errno)));
  std::unique_ptr<ifaddrs, decltype(&::freeifaddrs)> guard(ifs, &::freeifaddrs);
  const ifaddrs* v6 = nullptr;
  for (const ifaddrs* p = ifs; p != nullptr; p = p->ifa_next) {
    if (p->ifa_addr == nullptr || where != p->ifa_name) continue;
    if (p->ifa_addr->sa_family == AF_INET) {
      endpoint e = make_endpoint(p->ifa_addr, sizeof(sockaddr_in));
      e.set_port(port);
      return e;
    }
    if (p->ifa_addr->sa_family == AF_INET6 && v6 == nullptr) v6 = p;
  }
  if (v6 != nullptr) {
    endpoint e = make_endpoint(v6->ifa_addr, sizeof(sockaddr_in6));
    e.set_port(port);
    return e;
  }
  throw bootstrap_error(
      fmt::format("store bind address '{}' is neither an IP address nor an interface with an "
                  "address on this host",
                  where));
}

[[nodiscard]] inline unique_fd make_socket(int family) {
  unique_fd fd(::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) throw bootstrap_error(fmt::format("socket() failed: {}", errno_text(errno)));
  return fd;
}

inline void set_nodelay(int fd) noexcept {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/// One non-blocking connect attempt; returns 0 on success or the errno that made it fail.
[[nodiscard]] inline int try_connect(const endpoint& to, clock::time_point deadline,
                                     unique_fd& out) {
  unique_fd fd = make_socket(to.family());
  if (::connect(fd.get(), to.sa(), to.len) != 0) {
    if (errno != EINPROGRESS) return errno;
    pollfd p{fd.get(), POLLOUT, 0};
    int rc = 0;
    do {
      rc = ::poll(&p, 1, poll_ms_until(deadline));
    } while (rc < 0 && errno == EINTR);
    if (rc < 0) return errno;
    if (rc == 0) return ETIMEDOUT;
    int err = 0;
    socklen_t len = sizeof err;
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
    if (err != 0) return err;
  }
  set_nodelay(fd.get());
  out = std::move(fd);
  return 0;
}

enum class io_result { ok, closed, timed_out };

/// Sends all of `data` before `deadline`; throws on a socket error.
[[nodiscard]] inline io_result send_all(int fd, std::span<const std::byte> data,
                                        clock::time_point deadline) {
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) return io_result::closed;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
      throw bootstrap_error(fmt::format("send() to the store failed: {}", errno_text(errno)));
    pollfd p{fd, POLLOUT, 0};
    const int rc = ::poll(&p, 1, poll_ms_until(deadline));
    if (rc == 0) return io_result::timed_out;
  }
  return io_result::ok;
}

/// Receives exactly `data.size()` bytes before `deadline`.
[[nodiscard]] inline io_result recv_all(int fd, std::span<std::byte> data,
                                        clock::time_point deadline) {
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::recv(fd, data.data() + done, data.size() - done, 0);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    if (n == 0) return io_result::closed;
    if (errno == EINTR) continue;
    if (errno == ECONNRESET) return io_result::closed;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      throw bootstrap_error(fmt::format("recv() from the store failed: {}", errno_text(errno)));
    pollfd p{fd, POLLIN, 0};
    const int rc = ::poll(&p, 1, poll_ms_until(deadline));
    if (rc == 0) return io_result::timed_out;
  }
  return io_result::ok;
}

}  // namespace ringzero::bootstrap::detail
