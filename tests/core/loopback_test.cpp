#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "ringzero/ringzero.hpp"

using namespace ringzero;
using namespace std::chrono_literals;

namespace {

std::span<const std::byte> bytes(const std::vector<int>& v) {
  return std::as_bytes(std::span(v));
}
std::span<std::byte> bytes(std::vector<int>& v) {
  return std::as_writable_bytes(std::span(v));
}

void wait(loopback::communicator& c, loopback::communicator::request& r) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!c.test(r))
    if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("request hung");
}

/// Collects what each rank caught, for checks on the test's own thread.
struct caught {
  std::mutex m;
  std::vector<std::string> what;
  std::vector<int> peer;
  std::vector<errc> code;
  explicit caught(int n)
      : what(static_cast<std::size_t>(n)),
        peer(static_cast<std::size_t>(n), -2),
        code(static_cast<std::size_t>(n)) {}
  void set(int r, const error& e, int p) {
    std::lock_guard lock(m);
    what[static_cast<std::size_t>(r)] = e.what();
    peer[static_cast<std::size_t>(r)] = p;
    code[static_cast<std::size_t>(r)] = e.code();
  }
};

}  // namespace

TEST_CASE("loopback: a world needs at least one rank") {
  CHECK_THROWS_AS(loopback::world(0), invalid_argument);
}

TEST_CASE("loopback: messages match by peer and tag, in posting order, either side first") {
  loopback::world w(3);
  std::atomic<int> checked{0};
  w.run([&](loopback::communicator& c) {
    if (c.rank() == 0) {
      const std::vector<int> a = {1, 2, 3}, b = {4, 5, 6}, d = {7, 8, 9};
      auto s1 = c.isend(1, 5, bytes(a));  // same tag twice: FIFO
      auto s2 = c.isend(1, 5, bytes(b));
      auto s3 = c.isend(1, 6, bytes(d));
      wait(c, s1);
      wait(c, s2);
      wait(c, s3);
    } else if (c.rank() == 1) {
      std::vector<int> x(3), y(3), z(3), q(3);
      auto r3 = c.irecv(0, 6, bytes(z));  // posted before the others: matched by tag
      auto r1 = c.irecv(0, 5, bytes(x));
      auto r2 = c.irecv(0, 5, bytes(y));
      auto r4 = c.irecv(2, 5, bytes(q));  // same tag, other peer
      wait(c, r1);
      wait(c, r2);
      wait(c, r3);
      wait(c, r4);
      CHECK(x == std::vector<int>{1, 2, 3});
      CHECK(y == std::vector<int>{4, 5, 6});
      CHECK(z == std::vector<int>{7, 8, 9});
      CHECK(q == std::vector<int>{10, 11, 12});
      ++checked;
    } else {
      const std::vector<int> e = {10, 11, 12};
      auto s = c.isend(1, 5, bytes(e));
      wait(c, s);
    }
  });
  CHECK(checked == 1);
}

TEST_CASE("loopback: a request destroyed before completion is withdrawn") {
  loopback::world w(2);
  w.run([&](loopback::communicator& c) {
    std::vector<int> got(2, 0);
    if (c.rank() == 1) {
      {
        std::vector<int> gone(2, 0);
        auto r = c.irecv(0, 9, bytes(gone));
      }  // withdrawn: must not take the message
      barrier(c);
      auto r = c.irecv(0, 9, bytes(got));
      wait(c, r);
      CHECK(got == std::vector<int>{5, 6});
    } else {
      barrier(c);
      const std::vector<int> v = {5, 6};
      auto s = c.isend(1, 9, bytes(v));
      wait(c, s);
    }
  });
}

TEST_CASE("loopback: a peer outside the communicator is an invalid argument") {
  loopback::world w(2);
  w.run([&](loopback::communicator& c) {
    std::vector<int> v(1);
    CHECK_THROWS_AS((void)c.isend(c.rank(), 1, bytes(v)), invalid_argument);
    CHECK_THROWS_AS((void)c.irecv(2, 1, bytes(v)), invalid_argument);
    CHECK_THROWS_AS((void)c.irecv(-1, 1, bytes(v)), invalid_argument);
  });
}

TEST_CASE("loopback: sizes that disagree fail on both sides, naming both sizes") {
  loopback::world w(2);
  caught got(2);
  w.run([&](loopback::communicator& c) {
    std::vector<int> v(c.rank() == 0 ? 2 : 1, 1);
    auto r = c.rank() == 0 ? c.isend(1, 3, bytes(std::as_const(v))) : c.irecv(0, 3, bytes(v));
    try {
      wait(c, r);
    } catch (const transport_error& e) {
      got.set(c.rank(), e, -1);
    }
  });
  for (int r : {0, 1}) {
    INFO("rank " << r << ": " << got.what[static_cast<std::size_t>(r)]);
    CHECK(got.code[static_cast<std::size_t>(r)] == errc::transport);
    CHECK(got.what[static_cast<std::size_t>(r)].find("size mismatch") != std::string::npos);
    CHECK(got.what[static_cast<std::size_t>(r)].find("8 bytes") != std::string::npos);
    CHECK(got.what[static_cast<std::size_t>(r)].find("4 bytes") != std::string::npos);
  }
}

TEST_CASE("loopback: a receive from a peer that never sends times out naming peer and step") {
  loopback::world w(2, {.timeout = 200ms});
  caught got(2);
  w.run([&](loopback::communicator& c) {
    if (c.rank() == 1) return;  // never sends
    std::vector<int> v(4);
    try {
      recv(c, std::span<int>(v), 1);
    } catch (const timeout_error& e) {
      got.set(0, e, e.peer());
    }
  });
  INFO(got.what[0]);
  CHECK(got.code[0] == errc::timeout);
  CHECK(got.peer[0] == 1);
  CHECK(got.what[0].find("waiting for rank 1 to send") != std::string::npos);
  CHECK(got.what[0].find("step 0") != std::string::npos);
}

TEST_CASE("loopback: a collective a rank never joins times out naming that rank") {
  loopback::world w(3, {.timeout = 200ms});
  caught got(3);
  w.run([&](loopback::communicator& c) {
    if (c.rank() == 2) return;
    std::vector<float> v(1000, 1.0f);
    try {
      all_reduce(c, std::span<float>(v), op::sum, {.algorithm = algorithm::ring});
    } catch (const timeout_error& e) {
      got.set(c.rank(), e, e.peer());
    }
  });
  for (int r : {0, 1}) {
    INFO("rank " << r << ": " << got.what[static_cast<std::size_t>(r)]);
    CHECK(got.peer[static_cast<std::size_t>(r)] == 2);
    CHECK(got.what[static_cast<std::size_t>(r)].find("all_reduce (ring)") != std::string::npos);
    CHECK(got.what[static_cast<std::size_t>(r)].find("step") != std::string::npos);
  }
}

TEST_CASE("loopback: a rank that throws makes the others fail with peer_error naming it") {
  // The timeout is far longer than the test: the others must learn of the failure, not wait.
  loopback::world w(4, {.timeout = 60s});
  caught got(4);
  CHECK_THROWS_WITH_AS(w.run([&](loopback::communicator& c) {
    if (c.rank() == 2) throw std::runtime_error("rank 2 exploded");
    std::vector<double> v(100000, 1.0);
    try {
      all_reduce(c, std::span<double>(v), op::sum);
    } catch (const peer_error& e) {
      got.set(c.rank(), e, e.peer());
    }
  }),
                       "rank 2 exploded", std::runtime_error);
  for (int r : {0, 1, 3}) {
    INFO("rank " << r << ": " << got.what[static_cast<std::size_t>(r)]);
    CHECK(got.code[static_cast<std::size_t>(r)] == errc::peer_failure);
    CHECK(got.peer[static_cast<std::size_t>(r)] == 2);
    CHECK(got.what[static_cast<std::size_t>(r)].find("rank 2 exploded") != std::string::npos);
  }
}

TEST_CASE("loopback: ranks_per_node places ranks on simulated nodes") {
  loopback::world w(5, {.ranks_per_node = 2});
  std::array<topology, 5> seen{};
  w.run([&](loopback::communicator& c) { seen[static_cast<std::size_t>(c.rank())] = c.topo(); });
  for (int r = 0; r < 5; ++r) {
    const auto& t = seen[static_cast<std::size_t>(r)];
    CHECK(t.node == r / 2);
    CHECK(t.local_rank == r % 2);
    CHECK(t.node_count == 3);
    CHECK(t.local_size == (r < 4 ? 2 : 1));
  }
}
