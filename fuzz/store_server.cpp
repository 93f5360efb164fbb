// The TCP store's server itself, fed over a real connection: each input is sent as one client's
// byte stream, the connection is half-closed, and every reply is read until the server closes.
// This runs the server's own incremental parser, its limits and its parked get/wait handling
// (on its thread, under the same sanitizers); the store keeps its keys from input to input, as
// a long job's store does. Small limits make the memory cap reachable.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "ringzero/bootstrap/detail/tcp_server.hpp"
#include "ringzero/bootstrap/store_limits.hpp"

namespace rb = ringzero::bootstrap;

namespace {

rb::detail::tcp_server& server() {
  static const auto s = [] {
    rb::tcp_store_limits limits;
    limits.max_memory_bytes = std::size_t{8} << 20;
    return std::make_unique<rb::detail::tcp_server>("127.0.0.1", 0, 1, "job-token-1", 0,
                                                    limits.resolved(1, std::chrono::seconds(5)));
  }();
  return *s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(server().port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // libFuzzer's timeout alarm (SIGALRM) can interrupt connect(): try again with a fresh socket.
  // A server that stopped listening fails every try.
  int fd = -1;
  for (int attempt = 0; fd < 0; ++attempt) {
    if (attempt == 100) std::abort();
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) std::abort();
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(fd);
      fd = -1;
      ::usleep(1000);
    }
  }
  std::size_t sent = 0;
  std::array<std::byte, 65536> buf{};
  // Send and read at once, so a server replying to a long stream never waits on this client.
  // The server answers or closes within its request timeout (5 s); 20 s means it hung.
  const auto hung = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  const auto again = [] { return errno == EAGAIN || errno == EINTR; };
  while (true) {
    if (std::chrono::steady_clock::now() > hung) std::abort();
    pollfd p{fd, static_cast<short>(POLLIN | (sent < size ? POLLOUT : 0)), 0};
    const int rc = ::poll(&p, 1, 1000);
    if (rc < 0 && errno != EINTR) std::abort();
    if (rc <= 0) continue;
    if ((p.revents & POLLOUT) != 0) {
      const ssize_t n = ::send(fd, data + sent, size - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) sent += static_cast<std::size_t>(n);
      if (n < 0 && !again()) sent = size;  // the server closed on a refusal
      if (sent == size) ::shutdown(fd, SHUT_WR);
    }
    if ((p.revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
      const ssize_t n = ::recv(fd, buf.data(), buf.size(), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && !again())) break;
    }
  }
  ::close(fd);
  return 0;
}
