#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "ringzero/bootstrap/detail/protocol.hpp"
#include "ringzero/bootstrap/tcp_store.hpp"

namespace rb = ringzero::bootstrap;
using namespace std::chrono_literals;

namespace {

constexpr const char* token = "job-token-1";
constexpr auto generous = 20s;  // never reached when things work; bounds a broken run

std::vector<std::byte> bytes(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

std::string text(const std::vector<std::byte>& v) {
  return {reinterpret_cast<const char*>(v.data()), v.size()};
}

rb::tcp_store client(int port, int world, std::chrono::nanoseconds timeout = generous,
                     const std::string& tok = token) {
  return rb::tcp_store("127.0.0.1", port, false, world, tok, timeout);
}

// A raw connection to the server, for speaking the protocol wrongly on purpose.
struct raw_connection {
  int fd = -1;
  explicit raw_connection(int port) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  }
  raw_connection(const raw_connection&) = delete;
  raw_connection& operator=(const raw_connection&) = delete;
  ~raw_connection() { ::close(fd); }

  void send(std::span<const std::byte> b) const {
    CHECK(::send(fd, b.data(), b.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(b.size()));
  }

  // The server's answer: its error text, or "<closed>" if it hung up without one.
  std::string refusal() const {
    std::vector<std::byte> got;
    std::array<std::byte, 4096> buf{};
    for (;;) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 10000) <= 0) return "<no answer>";
      const ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
      if (n <= 0) break;
      got.insert(got.end(), buf.begin(), buf.begin() + n);
    }
    if (got.size() < rb::detail::reply_header_bytes) return "<closed>";
    if (rb::detail::get_u32(got.data()) != rb::detail::reply_magic) return "<bad magic>";
    if (got[4] != std::byte{1}) return "<not an error>";
    return {reinterpret_cast<const char*>(got.data()) + rb::detail::reply_header_bytes,
            got.size() - rb::detail::reply_header_bytes};
  }
};

std::array<std::byte, rb::detail::request_header_bytes> header(rb::detail::op o,
                                                               std::uint32_t token_len,
                                                               std::uint32_t key_len,
                                                               std::uint64_t value_len) {
  rb::detail::request_header h;
  h.op = static_cast<std::uint8_t>(o);
  h.token_len = token_len;
  h.key_len = key_len;
  h.value_len = value_len;
  return rb::detail::encode(h);
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

}  // namespace

TEST_CASE("set, get, add and wait in one process") {
  rb::tcp_store s("127.0.0.1", 0, true, 1, token, generous);
  REQUIRE(s.port() > 0);
  s.set("a", bytes("first"));
  CHECK(text(s.get("a")) == "first");
  s.set("a", bytes("second"));
  CHECK(text(s.get("a")) == "second");
  s.set("empty", {});
  CHECK(s.get("empty").empty());
  CHECK(s.add("n", 1) == 1);
  CHECK(s.add("n", 5) == 6);
  CHECK(s.add("n", -10) == -4);
  CHECK(text(s.get("n")) == "-4");  // counters are decimal text
  CHECK_THROWS_WITH_AS(s.add("a", 1), doctest::Contains("not an integer"),
                       ringzero::bootstrap_error);
  s.set_string("s", "text");
  CHECK(s.get_string("s") == "text");
  const std::vector<std::string> keys = {"a", "n", "s"};
  s.wait(keys);
  std::vector<std::byte> big(8 << 20);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<std::byte>(i * 7 + 3);
  s.set("big", big);
  CHECK(s.get("big") == big);
  const std::string long_key(rb::detail::max_key_bytes, 'k');
  s.set(long_key, bytes("x"));
  CHECK(text(s.get(long_key)) == "x");
}

TEST_CASE("client-side limits are checked before anything is sent") {
  rb::tcp_store s("127.0.0.1", 0, true, 1, token, generous);
  CHECK_THROWS_AS(s.set("", bytes("x")), ringzero::invalid_argument);
  CHECK_THROWS_AS(s.set(std::string(rb::detail::max_key_bytes + 1, 'k'), bytes("x")),
                  ringzero::invalid_argument);
  std::vector<std::byte> huge(rb::detail::max_value_bytes + 1);
  CHECK_THROWS_WITH_AS(s.set("k", huge), doctest::Contains("64 MiB"), ringzero::invalid_argument);
  CHECK_THROWS_AS(rb::tcp_store("127.0.0.1", 0, false, 1, token, 1s), ringzero::invalid_argument);
  CHECK_THROWS_AS(rb::tcp_store("127.0.0.1", 0, true, 0, token, 1s), ringzero::invalid_argument);
  CHECK_THROWS_AS(rb::tcp_store("127.0.0.1", 0, true, 1, std::string(300, 't'), 1s),
                  ringzero::invalid_argument);
}

TEST_CASE("ranks as threads rendezvous, count and pass barriers") {
  constexpr int world = 4;
  rb::tcp_store server("127.0.0.1", 0, true, world, token, generous);
  const int port = server.port();
  std::vector<std::int64_t> tickets(world);
  std::vector<std::string> seen(world);
  std::atomic<int> failures{0};
  auto rank_main = [&](rb::store& s, int r) {
    try {
      s.set_string(fmt::format("addr/{}", r), fmt::format("rank-{}", r));
      tickets[static_cast<std::size_t>(r)] = s.add("tickets", 1);
      s.barrier("b", world);
      s.barrier("b", world);  // the same name again: the next generation
      std::string all;
      for (int p = 0; p < world; ++p) all += s.get_string(fmt::format("addr/{}", p)) + ";";
      seen[static_cast<std::size_t>(r)] = all;
    } catch (const std::exception& e) {
      MESSAGE("rank ", r, ": ", e.what());
      ++failures;
    }
  };
  std::vector<std::thread> threads;
  for (int r = 1; r < world; ++r)
    threads.emplace_back([&, r] {
      rb::tcp_store s = client(port, world);
      rank_main(s, r);
    });
  rank_main(server, 0);
  for (auto& t : threads) t.join();
  CHECK(failures.load() == 0);
  CHECK(std::set<std::int64_t>(tickets.begin(), tickets.end()) ==
        std::set<std::int64_t>{1, 2, 3, 4});
  for (const auto& s : seen) CHECK(s == "rank-0;rank-1;rank-2;rank-3;");
  CHECK(server.get_string("b/arrived") == "8");
}

TEST_CASE("a get blocked in one thread does not hold up a set through the same store") {
  rb::tcp_store s("127.0.0.1", 0, true, 1, token, generous);
  std::string got;
  std::thread waiter([&] { got = s.get_string("late"); });
  std::this_thread::sleep_for(50ms);
  s.set_string("late", "here");
  waiter.join();
  CHECK(got == "here");
}

TEST_CASE("ranks that start before rank 0 connect once it is up") {
  const int port = free_port();
  std::string got;
  std::exception_ptr failure;
  std::thread early([&] {
    try {
      rb::tcp_store s = client(port, 2);
      got = s.get_string("from-0");
    } catch (...) {
      failure = std::current_exception();
    }
  });
  std::this_thread::sleep_for(300ms);
  {
    rb::tcp_store server("127.0.0.1", port, true, 2, token, generous);
    server.set_string("from-0", "hello");
    early.join();
  }
  CHECK(failure == nullptr);
  CHECK(got == "hello");
}

TEST_CASE("ranks as processes") {
  constexpr int world = 4;
  // Fork before the server thread exists; the children learn its port through a pipe.
  std::vector<pid_t> pids;
  std::vector<int> port_pipes;
  for (int r = 1; r < world; ++r) {
    int p[2];
    REQUIRE(::pipe(p) == 0);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::close(p[1]);
      int port = 0;
      if (::read(p[0], &port, sizeof port) != sizeof port) ::_exit(10);
      int code = 0;
      try {
        rb::tcp_store s = client(port, world);
        s.set_string(fmt::format("proc/{}", r), std::to_string(r * r));
        s.add("sum", r);
        s.barrier("all", world);
        for (int q = 0; q < world; ++q)
          if (s.get_string(fmt::format("proc/{}", q)) != std::to_string(q * q)) code = 1;
        if (s.get_string("sum") != "6") code = 2;
      } catch (...) {
        code = 3;
      }
      ::_exit(code);
    }
    ::close(p[0]);
    pids.push_back(pid);
    port_pipes.push_back(p[1]);
  }
  {
    rb::tcp_store server("127.0.0.1", 0, true, world, token, generous);
    const int port = server.port();
    for (int fd : port_pipes) {
      CHECK(::write(fd, &port, sizeof port) == sizeof port);
      ::close(fd);
    }
    server.set_string("proc/0", "0");
    server.barrier("all", world);
    CHECK(server.get_string("proc/3") == "9");
  }
  for (std::size_t i = 0; i < pids.size(); ++i) {
    int status = 0;
    REQUIRE(::waitpid(pids[i], &status, 0) == pids[i]);
    CAPTURE(i + 1);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
}

TEST_CASE("a wrong token or world size is refused, and the server keeps serving") {
  rb::tcp_store server("127.0.0.1", 0, true, 2, token, generous);
  CHECK_THROWS_WITH_AS(client(server.port(), 2, generous, "another-job"),
                       doctest::Contains("wrong job token"), ringzero::bootstrap_error);
  CHECK_THROWS_WITH_AS(client(server.port(), 3), doctest::Contains("world size mismatch"),
                       ringzero::bootstrap_error);
  rb::tcp_store good = client(server.port(), 2);
  good.set_string("k", "v");
  CHECK(server.get_string("k") == "v");
}

TEST_CASE("garbage, oversized and stalled connections do not stop the server") {
  rb::tcp_store server("127.0.0.1", 0, true, 2, token, generous);
  const int port = server.port();
  // A client that sends half a header and then nothing: others must not wait for it.
  raw_connection stalled(port);
  const auto half = header(rb::detail::op::set, 11, 1, 1);
  stalled.send(std::span(half).first(10));
  {
    raw_connection c(port);
    c.send(bytes("GET / HTTP/1.1\r\nHost: x\r\n\r\n"));
    CHECK(c.refusal() == "not a ringzero store request (bad magic)");
  }
  {
    raw_connection c(port);
    c.send(header(rb::detail::op::set, 11, 1 << 20, 1));
    CHECK(c.refusal() == "key longer than 4 KiB");
  }
  {
    raw_connection c(port);
    c.send(header(rb::detail::op::set, 11, 1, std::uint64_t{1} << 40));
    CHECK(c.refusal() == "value larger than 64 MiB");
  }
  {
    raw_connection c(port);
    c.send(header(rb::detail::op::set, 1 << 20, 1, 1));
    CHECK(c.refusal() == "token too long");
  }
  {
    raw_connection c(port);
    auto h = header(rb::detail::op::set, 11, 1, 1);
    h[4] = std::byte{99};
    c.send(h);
    CHECK(c.refusal() == "unknown operation");
  }
  {
    // The right header, the wrong token, then a large value the server must not read.
    raw_connection c(port);
    c.send(header(rb::detail::op::set, 11, 1, 1 << 20));
    c.send(bytes("job-token-2k"));
    CHECK(c.refusal().starts_with("wrong job token"));
  }
  rb::tcp_store good = client(port, 2);
  good.set_string("still", "serving");
  CHECK(server.get_string("still") == "serving");
}

TEST_CASE("missing ranks and keys end in timeout_error naming what was missing") {
  {
    const std::string where = fmt::format("127.0.0.1:{} within 0.3 s", free_port());
    const int port = std::stoi(where.substr(10));
    CHECK_THROWS_WITH_AS(client(port, 2, 300ms), doctest::Contains(where.c_str()),
                         ringzero::timeout_error);
  }
  rb::tcp_store s("127.0.0.1", 0, true, 1, token, 200ms);
  CHECK_THROWS_WITH_AS(static_cast<void>(s.get("never")),
                       doctest::Contains("waiting for key 'never'"), ringzero::timeout_error);
  s.set_string("present", "1");
  const std::vector<std::string> keys = {"present", "never-either"};
  CHECK_THROWS_WITH_AS(s.wait(keys), doctest::Contains("'never-either'"), ringzero::timeout_error);
  // A timed-out request costs its connection only: the store still works.
  s.set_string("after", "ok");
  CHECK(s.get_string("after") == "ok");
}

TEST_CASE("rank 0's store keeps serving until the other ranks are done with theirs") {
  std::optional<rb::tcp_store> server;
  server.emplace("127.0.0.1", 0, true, 2, token, generous);
  const int port = server->port();
  std::string got;
  std::exception_ptr failure;
  std::thread late([&] {
    try {
      rb::tcp_store s = client(port, 2);
      std::this_thread::sleep_for(200ms);  // rank 0 is already in its destructor by now
      s.set_string("late", "value");
      got = s.get_string("late");
    } catch (...) {
      failure = std::current_exception();
    }
  });
  server.reset();
  late.join();
  CHECK(failure == nullptr);
  CHECK(got == "value");
}

TEST_CASE("rank 0's destructor gives up on ranks that never finish") {
  // The other rank never connects; destruction must still end (after the 200 ms timeout).
  rb::tcp_store server("127.0.0.1", 0, true, 2, token, 200ms);
  server.set_string("k", "v");
}

TEST_CASE("ranks excused as dead are not waited for, and calls within a limit give up in time") {
  const auto start = std::chrono::steady_clock::now();
  {
    rb::tcp_store server("127.0.0.1", 0, true, 3, token, generous);
    rb::tcp_store other = client(server.port(), 3);
    CHECK(server.add_within("n", 2, 1s) == 2);
    other.set_within("k", std::as_bytes(std::span<const char>("v", 1)), 1s);
    CHECK(server.get_within("k", 1s).size() == 1);
    // Nobody sets it: gives up after the limit, not the store's generous timeout.
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(static_cast<void>(other.get_within("never", 100ms)), ringzero::timeout_error);
    CHECK(std::chrono::steady_clock::now() - t0 < 5s);
    server.excuse(1);  // the third rank died: rank 0 waits for `other` only
  }
  CHECK(std::chrono::steady_clock::now() - start < generous / 2);
}

TEST_CASE("a rank done with one store waits for the next instead of joining the old one") {
  std::optional<rb::tcp_store> first;
  first.emplace("127.0.0.1", 0, true, 2, token, generous, "", 0);
  const int port = first->port();
  {
    rb::tcp_store s("127.0.0.1", port, false, 2, token, generous, "", 0);
    s.set_string("k", "from the first store");
  }
  std::string got;
  std::exception_ptr failure;
  std::thread next([&] {
    try {
      // Rank 0's first store is still up (serving stragglers); this must wait for the second.
      rb::tcp_store s("127.0.0.1", port, false, 2, token, generous, "", 1);
      got = s.get_string("k");
    } catch (...) {
      failure = std::current_exception();
    }
  });
  std::this_thread::sleep_for(100ms);
  first.reset();
  {
    rb::tcp_store second("127.0.0.1", port, true, 2, token, generous, "", 1);
    second.set_string("k", "from the second store");
    CHECK_THROWS_WITH_AS(rb::tcp_store("127.0.0.1", port, false, 2, token, generous, "", 0),
                         doctest::Contains("generation mismatch"), ringzero::bootstrap_error);
    next.join();
  }
  CHECK(failure == nullptr);
  CHECK(got == "from the second store");
}
