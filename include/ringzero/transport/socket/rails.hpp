// Where the socket transport's rails are and how its connections are made: each rail is an
// IPv4 address of this host (an interface's, by name, or a literal); every rank listens on
// each of its rails, publishes the addresses through the store, connects to the ranks above
// it rail by rail (from its own address on that rail, so each connection leaves through its
// interface) and accepts the ranks below it. Rails can also be discovered (RINGZERO_RAILS=auto):
// every rank lists its interfaces and the ranks keep those they can all use together
// (transport/detail/interfaces.hpp).
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/core.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ringzero/bootstrap/detail/socket.hpp"
#include "ringzero/bootstrap/store.hpp"
#include "ringzero/error.hpp"
#include "ringzero/transport/detail/interfaces.hpp"
#include "ringzero/transport/socket/wire.hpp"

namespace ringzero::socket::detail {

namespace bsd = bootstrap::detail;

/// One rail of this host: its name (an interface, or the address given) and IPv4 address.
struct rail_address {
  std::string name;
  in_addr address{};
};

/// The IPv4 address of interface or literal `what`.
[[nodiscard]] inline rail_address find_rail(const std::string& what) {
  rail_address r;
  r.name = what;
  if (::inet_pton(AF_INET, what.c_str(), &r.address) == 1) return r;
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0)
    throw bootstrap_error(fmt::format("getifaddrs failed: {}", std::strerror(errno)));
  std::unique_ptr<ifaddrs, decltype(&::freeifaddrs)> guard(ifs, &::freeifaddrs);
  for (const ifaddrs* p = ifs; p != nullptr; p = p->ifa_next)
    if (p->ifa_addr != nullptr && p->ifa_addr->sa_family == AF_INET && what == p->ifa_name) {
      r.address = reinterpret_cast<const sockaddr_in*>(p->ifa_addr)->sin_addr;
      return r;
    }
  throw bootstrap_error(fmt::format(
      "socket transport: rail '{}' is neither an IPv4 address nor an interface with an IPv4 "
      "address on this host (RINGZERO_RAILS and RINGZERO_SOCKET_IFNAME take interface names)",
      what));
}

using ringzero::detail::agree_rails;
using ringzero::detail::interface_address;
using ringzero::detail::interfaces_text;
using ringzero::detail::local_interfaces;
using ringzero::detail::parse_interfaces;

/// The address this host uses to reach `host` (ringzero::detail::route_source), as a rail.
[[nodiscard]] inline std::optional<rail_address> route_to(const std::string& host) {
  const auto from = ringzero::detail::route_source(host);
  if (!from) return std::nullopt;
  rail_address r;
  r.address = *from;
  char buf[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &r.address, buf, sizeof buf);
  r.name = buf;
  return r;
}

[[nodiscard]] inline std::string address_text(const sockaddr_in& a) {
  char buf[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &a.sin_addr, buf, sizeof buf);
  return fmt::format("{}:{}", buf, ntohs(a.sin_port));
}

/// Socket options of every data connection: no Nagle delay, big buffers (0: the kernel's
/// autotuning) and a bound on unacknowledged data, so that a rail whose link went away fails
/// instead of retransmitting for a quarter of an hour.
inline void tune(int fd, std::size_t buffer_bytes, std::chrono::milliseconds user_timeout) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (buffer_bytes > 0) {
    const int b = static_cast<int>(std::min<std::size_t>(buffer_bytes, 1u << 30));
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof b);
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof b);
  }
  const auto ms = static_cast<unsigned>(user_timeout.count());
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof ms);
}

/// A listening socket on `r`, any port.
[[nodiscard]] inline std::pair<bsd::unique_fd, sockaddr_in> listen_on(const rail_address& r,
                                                                      std::size_t buffer_bytes) {
  bsd::unique_fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) throw bootstrap_error(fmt::format("socket() failed: {}", std::strerror(errno)));
  tune(fd.get(), buffer_bytes, std::chrono::milliseconds(0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr = r.address;
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0 ||
      ::listen(fd.get(), SOMAXCONN) != 0)
    throw bootstrap_error(fmt::format("socket transport: cannot listen on rail {} ({}): {}", r.name,
                                      address_text(a), std::strerror(errno)));
  socklen_t len = sizeof a;
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0)
    throw bootstrap_error(fmt::format("getsockname failed: {}", std::strerror(errno)));
  return {std::move(fd), a};
}

/// Starts a connection from `from` (port any) to `to` without waiting for it: the socket, and
/// 0 or the error connect() gave at once (EINPROGRESS is no error: poll for POLLOUT, then read
/// SO_ERROR). The handshake (handshake.hpp) waits for it among the others and retries refusals
/// (the peer's listener exists before its address is published, so they are rare).
[[nodiscard]] inline std::pair<bsd::unique_fd, int> start_connect(
    const rail_address& from, const sockaddr_in& to, std::size_t buffer_bytes,
    std::chrono::milliseconds user_timeout) {
  bsd::unique_fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) throw bootstrap_error(fmt::format("socket() failed: {}", std::strerror(errno)));
  tune(fd.get(), buffer_bytes, user_timeout);
  sockaddr_in src{};
  src.sin_family = AF_INET;
  src.sin_addr = from.address;
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&src), sizeof src) != 0)
    throw bootstrap_error(fmt::format("socket transport: cannot bind to rail {}: {}", from.name,
                                      std::strerror(errno)));
  int err = 0;
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&to), sizeof to) != 0 &&
      errno != EINPROGRESS)
    err = errno;
  return {std::move(fd), err};
}

}  // namespace ringzero::socket::detail
