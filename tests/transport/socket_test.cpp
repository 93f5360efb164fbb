// The socket transport with ranks as processes, what only it has: its rails (rates measured where
// the bytes arrive, rails named or discovered, a connection that breaks) and hierarchical over
// two simulated nodes. The conformance matrix (one rail, and three: loopback addresses
// 127.0.0.1-3), the behaviours every transport shares and a rail given up under traffic run in
// transport_conformance_test.cpp; striping and delivery are the kit's (rail_engine_test.cpp).
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "multiprocess.hpp"
#include "ringzero/ringzero.hpp"
#include "ringzero/transport/socket.hpp"

using namespace std::chrono_literals;
using ringzero::op;
namespace sock = ringzero::socket;
using multiprocess::contains;
using multiprocess::rank_checks;
using multiprocess::require_all_passed;

namespace {

/// Three rails on loopback, and a stripe size small enough that every message is cut.
const sock::options three_rails{.rails = {"127.0.0.1", "127.0.0.2", "127.0.0.3"},
                                .stripe_bytes = 1024};

template <class Q>
void drive(sock::communicator& comm, Q& q, int peer) {
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!comm.test(q))
    if (std::chrono::steady_clock::now() > deadline) throw ringzero::timeout_error("stuck", peer);
}

}  // namespace

TEST_CASE("a rail that names no interface is refused, naming it") {
  auto bad = multiprocess::run(1, 30s, [&](int r, int n, ringzero::bootstrap::store& s) {
    try {
      sock::communicator comm(sock::transport(s, r, n, {.rails = {"no-such-interface0"}}));
    } catch (const ringzero::bootstrap_error& e) {
      return contains(e.what(), "no-such-interface0") ? 0 : 2;
    }
    return 1;
  });
  require_all_passed(bad);
}

TEST_CASE("striping: a rail's rate is measured where its bytes arrive, while they arrive") {
  namespace d = ringzero::socket::detail;
  using std::chrono::milliseconds;
  constexpr std::uint64_t half = std::uint64_t{512} << 10, mib = std::uint64_t{1} << 20;
  d::rate_meter c;
  const auto t0 = d::clock::now();
  // One read of `bytes` at t0 + ms, after which a frame is still `arriving` or not, as
  // engine::read accounts it.
  const auto read = [&](std::uint64_t bytes, int ms, bool arriving) {
    c.arrived(bytes, t0 + milliseconds(ms));
    c.sampling = arriving;
  };
  read(half, 40, true);  // the first read after an idle spell: not a sample
  CHECK(c.rate == 0);
  CHECK(c.kib_per_second() == 0);  // statements say "not measured"
  read(half, 45, true);
  CHECK(c.rate == 0);  // half a window so far
  read(half, 50, true);
  const double r10 = static_cast<double>(mib) / 0.010;  // 1 MiB in 10 ms
  CHECK(c.rate == doctest::Approx(r10));
  CHECK(c.kib_per_second() == static_cast<std::uint32_t>(c.rate / 1024.0));
  // A faster window raises the estimate at once; slower ones do not lower it while the faster
  // is among the last four.
  read(mib, 55, true);
  CHECK(c.rate == doctest::Approx(2 * r10));
  read(half, 60, false);  // the frame is whole: nothing arriving after this read
  // The idle time until the next read is not a sample.
  read(mib, 5000, true);
  read(mib, 5010, true);  // with the half from before: 1.5 MiB in 15 ms
  CHECK(c.rate == doctest::Approx(2 * r10));
  for (int w = 0; w < 3; ++w) read(mib, 5030 + 20 * w, true);  // 1 MiB in 20 ms each
  // Four windows on, the fast one is gone: the best of the last four is 1.5 MiB in 15 ms.
  CHECK(c.rate == doctest::Approx(r10));
  read(mib, 5090, true);
  CHECK(c.rate == doctest::Approx(r10 / 2));
}

TEST_CASE("RINGZERO_RAIL_SHARES is measured or equal, and anything else is named") {
  ::setenv("RINGZERO_RAIL_SHARES", "equal", 1);
  CHECK_FALSE(sock::transport::weigh_rails_from_env());
  ::setenv("RINGZERO_RAIL_SHARES", "measured", 1);
  CHECK(sock::transport::weigh_rails_from_env());
  ::setenv("RINGZERO_RAIL_SHARES", "fastest", 1);
  CHECK_THROWS_WITH_AS(static_cast<void>(sock::transport::weigh_rails_from_env()),
                       doctest::Contains("RINGZERO_RAIL_SHARES=fastest"),
                       ringzero::invalid_argument);
  ::unsetenv("RINGZERO_RAIL_SHARES");
  CHECK(sock::transport::weigh_rails_from_env());
}

TEST_CASE("RINGZERO_RAILS=auto keeps the interfaces every host can use together") {
  namespace d = sock::detail;
  const auto cands = [](std::string_view text) { return d::parse_interfaces(text); };
  // Text and back.
  const auto some = cands("eth0=10.1.0.5/16 rz0=10.77.0.1/24");
  REQUIRE(some.size() == 2);
  CHECK(some[0].name == "eth0");
  CHECK(some[0].prefix == 16);
  CHECK(d::interfaces_text(some) == "eth0=10.1.0.5/16 rz0=10.77.0.1/24");
  CHECK_THROWS_AS(static_cast<void>(cands("eth0=10.1.0.5")), ringzero::bootstrap_error);
  CHECK_THROWS_AS(static_cast<void>(cands("eth0=10.1.0/16")), ringzero::bootstrap_error);
  // A NIC without an address (an EFA device) travels by name alone.
  const auto efa = cands("rdmap16s27 rdmap32s27");
  REQUIRE(efa.size() == 2);
  CHECK(efa[1].name == "rdmap32s27");
  CHECK(efa[1].prefix == -1);
  CHECK(d::interfaces_text(efa) == "rdmap16s27 rdmap32s27");

  const std::vector<std::string> two_hosts{"a", "b"};
  SUBCASE("rails named and numbered alike, a subnet each: all of them, in name order") {
    CHECK(d::agree_rails({cands("rz0=10.77.0.1/24 rz1=10.77.1.1/24 rz2=10.77.2.1/24"),
                          cands("rz0=10.77.0.2/24 rz1=10.77.1.2/24 rz2=10.77.2.2/24")},
                         two_hosts) == std::vector<std::string>{"rz0", "rz1", "rz2"});
  }
  SUBCASE("an interface one host lacks, or on another subnet there, is left out") {
    CHECK(d::agree_rails({cands("eth0=192.0.2.10/24 rz0=10.77.0.1/24 rz1=10.77.1.1/24"),
                          cands("eth0=198.51.100.7/24 rz0=10.77.0.2/24")},
                         two_hosts) == std::vector<std::string>{"rz0"});
    // The same network under another prefix is another subnet.
    CHECK(
        d::agree_rails({cands("rz0=10.77.0.1/24"), cands("rz0=10.77.0.2/16")}, two_hosts).empty());
  }
  SUBCASE("a bridge every host numbers alike is no rail between them; on one host it is") {
    CHECK(d::agree_rails({cands("docker0=172.17.0.1/16 rz0=10.77.0.1/24"),
                          cands("docker0=172.17.0.1/16 rz0=10.77.0.2/24")},
                         two_hosts) == std::vector<std::string>{"rz0"});
    CHECK(d::agree_rails({cands("docker0=172.17.0.1/16"), cands("docker0=172.17.0.1/16")},
                         {"a", "a"}) == std::vector<std::string>{"docker0"});
  }
  SUBCASE("NICs without addresses: those every rank has, without an address everywhere") {
    CHECK(
        d::agree_rails({cands("rdmap16s27 rdmap32s27 rdmap48s27"), cands("rdmap16s27 rdmap32s27")},
                       two_hosts) == std::vector<std::string>{"rdmap16s27", "rdmap32s27"});
    CHECK(d::agree_rails({cands("rz0"), cands("rz0=10.77.0.2/24")}, two_hosts).empty());
  }
  SUBCASE("nothing in common: none, and the transport falls back to one rail") {
    CHECK(d::agree_rails({cands("eth0=192.0.2.10/24"), cands("")}, two_hosts).empty());
    CHECK(d::agree_rails({}, {}).empty());
  }
  SUBCASE("this host's interfaces: up, IPv4, never loopback, each once, by name") {
    const auto mine = d::local_interfaces();
    for (std::size_t i = 0; i < mine.size(); ++i) {
      CHECK(mine[i].name != "lo");
      CHECK((ntohl(mine[i].address.s_addr) >> 24) != 127);
      CHECK(mine[i].prefix >= 0);
      CHECK(mine[i].prefix <= 32);
      if (i > 0) CHECK(mine[i - 1].name < mine[i].name);
    }
  }
}

TEST_CASE("RINGZERO_RAILS=auto on one host is one rail, on loopback") {
  ::setenv("RINGZERO_RAILS", "auto", 1);
  auto out = multiprocess::run(2, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    sock::communicator comm(sock::transport(s, r, n, {}));
    check.expect(comm.transport().rails() == 1 && comm.transport().rail_name(0) == "127.0.0.1",
                 fmt::format("one rail on 127.0.0.1, got {} ({})", comm.transport().rails(),
                             comm.transport().rail_name(0)));
    std::vector<float> v(1000, static_cast<float>(r + 1));
    ringzero::all_reduce(comm, std::span<float>(v), op::sum);
    check.expect(v.front() == 3.0f && v.back() == 3.0f, "the sum 1 + 2");
    return check.code();
  });
  ::unsetenv("RINGZERO_RAILS");
  require_all_passed(out);
}

TEST_CASE(
    "a connection that breaks mid-transfer: the rail reports it, its pieces move to the others; "
    "the last one names the rank and the rail") {
  // The rail's own detection (a reset connection); a rail given up through the kit's hook, and
  // what moves with it, is the suite's (rail_failover, "socket rails" there).
  auto out = multiprocess::run(2, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    sock::communicator comm(sock::transport(s, r, n, three_rails));
    const int peer = 1 - r;
    check.expect(comm.transport().rails() == 3 && comm.transport().live_rails(peer) == 3,
                 "three rails up");
    const std::vector<ringzero::tuning::rail_price> three(
        3, ringzero::tuning::defaults::socket_rail.value);
    check.expect(comm.tuning() ==
                     ringzero::tuning::over_rails(ringzero::tuning::defaults::socket.value, three),
                 "priced as its three rails together");
    constexpr std::size_t count = std::size_t{24} << 20;
    std::vector<std::uint8_t> data(count);
    for (std::size_t i = 0; i < count; ++i) data[i] = static_cast<std::uint8_t>((i * 131) >> 7);
    const std::string log = multiprocess::capture_info_log("socket-rail", [&] {
      if (r == 0) {
        auto q = comm.isend(1, 1, std::as_bytes(std::span<const std::uint8_t>(data)));
        // Some of it moves, then rail 1 breaks under it.
        for (int i = 0; i < 3; ++i)
          if (comm.test(q)) break;
        comm.transport().break_rail(1, 1);
        drive(comm, q, 1);
      } else {
        std::vector<std::uint8_t> in(count, 0);
        auto q = comm.irecv(0, 1, std::as_writable_bytes(std::span<std::uint8_t>(in)));
        drive(comm, q, 0);
        check.expect(in == data, "the message whole and unchanged");
      }
      // The message may be whole before this side reads the broken rail's end.
      const auto until = std::chrono::steady_clock::now() + 10s;
      while (comm.transport().live_rails(peer) == 3 && std::chrono::steady_clock::now() < until)
        comm.progress();
    });
    check.expect(comm.transport().live_rails(peer) == 2, "two rails left");
    check.expect(contains(log, fmt::format("rail 127.0.0.2 failed toward rank {}", peer)) &&
                     contains(log, "and the others left"),
                 fmt::format("a warning naming the failed rail, got '{}'", log));
    // Collectives go on over the two left, bitwise as before.
    std::vector<float> v(1 << 20), want(1 << 20);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.25f * static_cast<float>(i % 1000 + r);
    for (std::size_t i = 0; i < v.size(); ++i)
      want[i] = 0.25f * static_cast<float>(i % 1000) + 0.25f * static_cast<float>(i % 1000 + 1);
    ringzero::all_reduce(comm, std::span<float>(v), op::sum);
    check.expect(v == want, "an all_reduce over the remaining rails");
    // Rank 0 breaks the other two: both ranks' next call fails naming the peer and a rail.
    ringzero::barrier(comm);
    if (r == 0) {
      comm.transport().break_rail(1, 0);
      comm.transport().break_rail(1, 2);
    }
    int named = -2;
    std::string what;
    try {
      ringzero::all_reduce(comm, std::span<float>(v), op::sum, {.timeout = 20s});
    } catch (const ringzero::peer_error& e) {
      named = e.peer();
      what = e.what();
    }
    check.expect(named == peer && contains(what, fmt::format("rank {}", peer)) &&
                     contains(what, "its last rail, 127.0.0."),
                 fmt::format("a peer_error naming rank {} and its last rail, got {}: '{}'", peer,
                             named, what));
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("hierarchical over two nodes of one host: shm inside the node, bitwise as sockets") {
  auto out = multiprocess::run(4, 120s, [](int r, int n, ringzero::bootstrap::store& s) {
    if (!multiprocess::become_host(fmt::format("ringzero-node-{}", r / 2)))
      return multiprocess::rank_skipped;
    rank_checks check{r};
    sock::communicator comm(sock::transport(s, r, n, {.timeout = 60s}));
    const auto t = comm.topo();
    check.expect(t.node_count == 2 && t.local_size == 2 && t.node == r / 2,
                 fmt::format("2 nodes of 2 ranks, got {} nodes of {}", t.node_count, t.local_size));
    auto sockets_only = comm.split(0, r);
    const ringzero::options hier{.algorithm = ringzero::algorithm::hierarchical};
    for (const std::size_t count : {std::size_t{1}, std::size_t{1000}, std::size_t{1} << 20}) {
      std::vector<float> a(count);
      std::uint32_t x = 2654435761u * static_cast<std::uint32_t>(r + 1);
      for (std::size_t i = 0; i < count; ++i) {
        x = x * 1664525u + 1013904223u;
        a[i] = static_cast<float>(x >> 8) * 1e-3f - 7e3f;
      }
      std::vector<float> fa(count), fb(count);
      ringzero::all_reduce(comm, std::span<const float>(a), std::span<float>(fa), op::sum, hier);
      if (!sockets_only->hierarchy()) ::setenv("RINGZERO_NODE_SHM", "0", 1);
      ringzero::all_reduce(*sockets_only, std::span<const float>(a), std::span<float>(fb), op::sum,
                           hier);
      ::unsetenv("RINGZERO_NODE_SHM");
      check.expect(std::memcmp(fa.data(), fb.data(), count * sizeof(float)) == 0,
                   fmt::format("{} floats: node shm bitwise as sockets alone", count));
    }
    check.expect(comm.hierarchy() && comm.hierarchy()->node, "the node level over shm");
    check.expect(sockets_only->hierarchy() && !sockets_only->hierarchy()->node,
                 "the node level over sockets with RINGZERO_NODE_SHM=0");
    return check.code();
  });
  if (std::all_of(out.status.begin(), out.status.end(),
                  [](int st) { return st == multiprocess::rank_skipped; })) {
    MESSAGE("skipped: ranks cannot have host names of their own here (needs CAP_SYS_ADMIN)");
    return;
  }
  require_all_passed(out);
}
