#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "ringzero/p2p.hpp"
#include "ringzero/ringzero.hpp"

using namespace ringzero;

TEST_CASE("isend and irecv posted in either order on two ranks complete without a deadlock") {
  loopback::world w(2, {.timeout = std::chrono::seconds(20)});
  w.run([](loopback::communicator& c) {
    const int peer = 1 - c.rank();
    const std::vector<float> mine(1000, static_cast<float>(c.rank() + 1));
    std::vector<float> theirs(1000);
    // Both ranks receive first: with blocking calls each would wait for the other's send.
    // docs-begin: either-order
    auto r = irecv(c, std::span<float>(theirs), peer, /*tag=*/3);
    auto s = isend(c, std::span<const float>(mine), peer, 3);
    r.wait();
    s.wait();
    // docs-end: either-order
    CHECK(r.done());
    CHECK(theirs == std::vector<float>(1000, static_cast<float>(peer + 1)));
  });
}

TEST_CASE("messages match by tag, and in posting order within a tag") {
  loopback::world w(2, {.timeout = std::chrono::seconds(20)});
  w.run([](loopback::communicator& c) {
    if (c.rank() == 0) {
      const std::int64_t a[] = {10}, b[] = {20}, d[] = {30}, e[] = {40};
      std::vector<p2p_request<loopback::transport>> sent;
      sent.push_back(isend(c, std::span<const std::int64_t>(a), 1, 1));
      sent.push_back(isend(c, std::span<const std::int64_t>(b), 1, 2));
      sent.push_back(isend(c, std::span<const std::int64_t>(d), 1, max_p2p_tag));
      sent.push_back(isend(c, std::span<const std::int64_t>(e), 1, 1));
      for (auto& s : sent) s.wait();
    } else {
      // Posted in another order than sent: each receive gets its own tag's message, and the
      // two messages of tag 1 arrive in the order they were sent.
      std::int64_t big[1] = {}, two[1] = {}, first[1] = {}, second[1] = {};
      auto rb = irecv(c, std::span<std::int64_t>(big), 0, max_p2p_tag);
      auto r2 = irecv(c, std::span<std::int64_t>(two), 0, 2);
      auto r1 = irecv(c, std::span<std::int64_t>(first), 0, 1);
      auto r1b = irecv(c, std::span<std::int64_t>(second), 0, 1);
      for (auto* r : {&rb, &r2, &r1, &r1b}) r->wait();
      CHECK(big[0] == 30);
      CHECK(two[0] == 20);
      CHECK(first[0] == 10);
      CHECK(second[0] == 40);
    }
  });
}

TEST_CASE("tag 0 is the stream of send() and recv()") {
  loopback::world w(2, {.timeout = std::chrono::seconds(20)});
  w.run([](loopback::communicator& c) {
    const double out[] = {1.5, 2.5};
    double in[2] = {};
    if (c.rank() == 0) {
      send(c, std::span<const double>(out, 1), 1);
      auto s = isend(c, std::span<const double>(out + 1, 1), 1);
      s.wait();
    } else {
      auto r = irecv(c, std::span<double>(in, 1), 0);
      r.wait();
      recv(c, std::span<double>(in + 1, 1), 0);
      CHECK(in[0] == 1.5);
      CHECK(in[1] == 2.5);
    }
  });
}

TEST_CASE(
    "isend and irecv refuse a bad peer or tag, and an unmatched receive times out naming "
    "its peer") {
  loopback::world w(2, {.timeout = std::chrono::seconds(20)});
  w.run([](loopback::communicator& c) {
    float x[1] = {};
    CHECK_THROWS_AS(static_cast<void>(isend(c, std::span<const float>(x), c.rank())),
                    invalid_argument);
    CHECK_THROWS_AS(static_cast<void>(irecv(c, std::span<float>(x), 2)), invalid_argument);
    CHECK_THROWS_AS(static_cast<void>(irecv(c, std::span<float>(x), 1 - c.rank(), max_p2p_tag + 1)),
                    invalid_argument);
    if (c.rank() == 1) {
      auto r = irecv(c, std::span<float>(x), 0, 5, {.timeout = std::chrono::milliseconds(50)});
      try {
        r.wait();
        FAIL("an unmatched receive completed");
      } catch (const timeout_error& e) {
        CHECK(e.peer() == 0);
        CHECK(std::string(e.what()).find("irecv on rank 1 of 2") != std::string::npos);
        CHECK(std::string(e.what()).find("from rank 0 (tag 5)") != std::string::npos);
      }
    }
  });
}
