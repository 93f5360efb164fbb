// The socket transport with ranks as processes: the conformance matrix for 1 to 4 ranks on one
// rail and for 2 and 3 ranks striped over three (loopback addresses 127.0.0.1-3 as rails),
// sub-communicators, cancellation, many messages in flight, size mismatches, a peer killed
// with SIGKILL, abort(), bad arguments, and a rail that fails mid-transfer.
//
// CTest runs each "conformance" case as a test of its own (see CMakeLists.txt).
#include <doctest/doctest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/core.h>

// The socket communicator's collectives first: the conformance matrix's qualified calls must
// see them.
#include "ringzero/transport/socket.hpp"

#include "conformance_matrix.hpp"
#include "multiprocess.hpp"
#include "ringzero/ringzero.hpp"

using namespace std::chrono_literals;
using ringzero::op;
namespace sock = ringzero::socket;
using multiprocess::contains;
using multiprocess::rank_checks;
using multiprocess::require_all_passed;

namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool sanitized = true;
#else
constexpr bool sanitized = false;
#endif

using matrix_types =
    std::conditional_t<sanitized, conformance::types<float>, conformance::every_type>;

/// Three rails on loopback, and a stripe size small enough that the matrix's messages are cut.
const sock::options three_rails{.rails = {"127.0.0.1", "127.0.0.2", "127.0.0.3"},
                                .stripe_bytes = 1024};

[[nodiscard]] std::vector<std::string> run_matrix(sock::communicator& comm) {
  using ringzero::dtype;
  const dtype each_size[] = {dtype::int8, dtype::bfloat16, dtype::float32, dtype::float64};
  const auto types = sanitized          ? std::span<const dtype>(matrix_types::dtypes)
                     : comm.size() == 2 ? std::span<const dtype>(ringzero::all_dtypes)
                                        : std::span<const dtype>(each_size);
  std::vector<conformance::test_case> cases;
  // automatic always resolves to one of the algorithms below, which run explicitly.
  for (const auto& tc : conformance::matrix(comm.size(), false, types))
    if (tc.algo != ringzero::algorithm::automatic) cases.push_back(tc);
  auto failures = conformance::run_all<matrix_types>(comm, cases);
  if (comm.rank() == 0)
    std::fprintf(stderr, "socket, %d ranks, %d rail(s): %zu cases, %zu failures\n", comm.size(),
                 comm.transport().rails(), cases.size(), failures.size());
  return failures;
}

/// Under a launcher this process is one rank and joins through from_env(); otherwise it forks
/// the ranks itself.
void conformance_over(int n, const sock::options& opt = {}) {
  if (ringzero::detail::getenv_str("RANK") && ringzero::detail::getenv_str("WORLD_SIZE")) {
    auto comm = sock::communicator::from_env(opt);
    REQUIRE(comm.size() == n);
    for (const auto& f : run_matrix(comm)) FAIL_CHECK(f);
    return;
  }
  auto out = multiprocess::run(n, 300s, [&](int r, int size, ringzero::bootstrap::store& s) {
    sock::communicator comm(sock::transport(s, r, size, opt));
    const auto failures = run_matrix(comm);
    for (const auto& f : failures) std::fprintf(stderr, "%s\n", f.c_str());
    return failures.empty() ? 0 : 1;
  });
  require_all_passed(out);
}

template <class Q>
void drive(sock::communicator& comm, Q& q, int peer) {
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!comm.test(q))
    if (std::chrono::steady_clock::now() > deadline) throw ringzero::timeout_error("stuck", peer);
}

}  // namespace

TEST_CASE("conformance socket 1 rank") {
  conformance_over(1);
}
TEST_CASE("conformance socket 2 ranks" * doctest::skip()) {
  conformance_over(2);
}
TEST_CASE("conformance socket 3 ranks" * doctest::skip()) {
  conformance_over(3);
}
TEST_CASE("conformance socket 4 ranks" * doctest::skip()) {
  conformance_over(4);
}
TEST_CASE("conformance socket rails 2 ranks" * doctest::skip()) {
  conformance_over(2, three_rails);
}
TEST_CASE("conformance socket rails 3 ranks" * doctest::skip()) {
  conformance_over(3, three_rails);
}

TEST_CASE("sub-communicators keep their messages apart") {
  auto out = multiprocess::run(4, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    sock::communicator comm(sock::transport(s, r, n));
    auto half = comm.split(r % 2, -r);
    check.expect(half && half->size() == 2, "a 2-rank half");
    std::vector<double> world_v(30000, r + 1.0), half_v(30000, 10.0 * (r + 1));
    if (r % 2 == 0) {
      ringzero::all_reduce(*half, std::span<double>(half_v), op::sum);
      ringzero::all_reduce(comm, std::span<double>(world_v), op::sum);
    } else {
      ringzero::all_reduce(comm, std::span<double>(world_v), op::sum);
      ringzero::all_reduce(*half, std::span<double>(half_v), op::sum);
    }
    check.expect(world_v[0] == 10.0, "the world sum 1+2+3+4");
    check.expect(half_v[29999] == (r % 2 == 0 ? 40.0 : 60.0), "the sum over this half");
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("a destroyed receive is never written; a destroyed send under way still arrives") {
  for (const auto& opt : {sock::options{}, three_rails}) {
    CAPTURE(opt.rails.size());
    auto out = multiprocess::run(2, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
      rank_checks check{r};
      sock::communicator comm(sock::transport(s, r, n, opt));
      std::vector<std::uint8_t> payload(3 << 20, 0xab);
      std::vector<std::uint8_t> abandoned(payload.size(), 0), fresh(payload.size(), 0);
      if (r == 0) {
        { auto req = comm.irecv(1, 5, std::as_writable_bytes(std::span<std::uint8_t>(abandoned))); }
        ringzero::barrier(comm);
        auto req = comm.irecv(1, 5, std::as_writable_bytes(std::span<std::uint8_t>(fresh)));
        drive(comm, req, 1);
        check.expect(fresh == payload, "the message in the receive posted after the cancel");
        check.expect(std::all_of(abandoned.begin(), abandoned.end(), [](auto b) { return b == 0; }),
                     "the cancelled receive's buffer untouched");
        {
          auto big = std::vector<std::uint8_t>(payload.size(), 0x3c);
          auto q = comm.isend(1, 6, std::as_bytes(std::span<const std::uint8_t>(big)));
          std::fill(big.begin(), big.end(), 0x3c);
        }
      } else {
        ringzero::barrier(comm);
        auto req = comm.isend(0, 5, std::as_bytes(std::span<const std::uint8_t>(payload)));
        drive(comm, req, 0);
        auto q = comm.irecv(0, 6, std::as_writable_bytes(std::span<std::uint8_t>(fresh)));
        drive(comm, q, 0);
        check.expect(std::all_of(fresh.begin(), fresh.end(), [](auto b) { return b == 0x3c; }),
                     "the whole of the abandoned send");
      }
      ringzero::barrier(comm);
      return check.code();
    });
    require_all_passed(out);
  }
}

TEST_CASE("hundreds of messages in flight, matched by tag not by arrival, on one rail or three") {
  for (const auto& opt : {sock::options{}, three_rails}) {
    CAPTURE(opt.rails.size());
    auto out = multiprocess::run(2, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
      rank_checks check{r};
      sock::communicator comm(sock::transport(s, r, n, opt));
      constexpr int count = 400;
      const int peer = 1 - r;
      auto size_of = [](int i) { return static_cast<std::size_t>((i * 7919) % 70000); };
      std::vector<std::vector<std::uint8_t>> out_bufs(count), in_bufs(count);
      std::vector<sock::communicator::request> reqs;
      auto post_recvs = [&] {
        for (int i = 0; i < count; ++i) {
          in_bufs[std::size_t(i)].assign(size_of(i), 0);
          // Every tag twice: the second message must land in the second receive.
          reqs.push_back(comm.irecv(peer, static_cast<ringzero::tag_t>(i / 2),
                                    std::as_writable_bytes(std::span(in_bufs[std::size_t(i)]))));
        }
      };
      if (r == 0) post_recvs();
      for (int i = 0; i < count; ++i) {
        out_bufs[std::size_t(i)].assign(size_of(i), static_cast<std::uint8_t>(i + r));
        reqs.push_back(
            comm.isend(peer, static_cast<ringzero::tag_t>(i / 2),
                       std::as_bytes(std::span(std::as_const(out_bufs[std::size_t(i)])))));
      }
      if (r == 1) post_recvs();
      for (auto& q : reqs) drive(comm, q, peer);
      for (int i = 0; i < count; ++i) {
        const auto& b = in_bufs[std::size_t(i)];
        check.expect(std::all_of(b.begin(), b.end(),
                                 [&](auto x) { return x == static_cast<std::uint8_t>(i + peer); }),
                     fmt::format("message {} intact", i));
      }
      return check.code();
    });
    require_all_passed(out);
  }
}

TEST_CASE("a receive posted with the wrong size fails with both sizes named") {
  auto out = multiprocess::run(2, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    sock::communicator comm(sock::transport(s, r, n));
    std::vector<std::byte> small(100), big(100000);
    if (r == 1) {
      auto shorter = comm.isend(0, 8, std::span<const std::byte>(small));
      auto longer = comm.isend(0, 7, std::span<const std::byte>(big));
      drive(comm, shorter, 0);
      drive(comm, longer, 0);
      (void)s.get("checked");
      return 0;
    }
    auto expect_mismatch = [&](ringzero::tag_t tag, std::span<std::byte> buf,
                               std::string_view sizes) {
      auto q = comm.irecv(1, tag, buf);
      std::string what;
      try {
        drive(comm, q, 1);
      } catch (const ringzero::transport_error& e) {
        what = e.what();
      }
      check.expect(contains(what, std::string(sizes)) && contains(what, "rank 1"),
                   fmt::format("a transport_error naming rank 1 and '{}', got '{}'", sizes, what));
    };
    expect_mismatch(8, std::span<std::byte>(big), "the peer sent 100 bytes");
    expect_mismatch(7, std::span<std::byte>(small), "posted a 100 byte receive");
    // The stream is still in step: a matching message after the mismatches arrives.
    s.set_string("checked", "1");
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE(
    "a rank killed with SIGKILL is named by the survivors' errors, well within the deadline") {
  ::setenv("RINGZERO_TIMEOUT", "60", 1);
  auto out = multiprocess::run(3, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    sock::communicator comm(sock::transport(s, r, n));
    const ringzero::options ring{.algorithm = ringzero::algorithm::ring};
    std::vector<float> v(3000000, 1.0f);
    ringzero::all_reduce(comm, std::span<float>(v), op::sum, ring);
    if (r == 1) ::raise(SIGKILL);
    int named = -2;
    std::string what;
    const auto start = std::chrono::steady_clock::now();
    try {
      for (int i = 0; i < 3; ++i) ringzero::all_reduce(comm, std::span<float>(v), op::sum, ring);
    } catch (const ringzero::peer_error& e) {
      named = e.peer();
      what = e.what();
    }
    const auto took = std::chrono::steady_clock::now() - start;
    check.expect(named == 1,
                 fmt::format("a peer_error naming rank 1, got rank {}: '{}'", named, what));
    check.expect(contains(what, "rank 1"), "the message to name rank 1");
    check.expect(took < 10s, "the error within seconds, not at the 60 s deadline");
    return check.code();
  });
  ::unsetenv("RINGZERO_TIMEOUT");
  INFO(out.describe());
  CHECK(out.status[0] == 0);
  CHECK(out.status[1] == -SIGKILL);
  CHECK(out.status[2] == 0);
  CHECK_FALSE(out.timed_out);
}

TEST_CASE("abort() from another thread unblocks a wait, and every call after fails at once") {
  auto out = multiprocess::run(2, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    sock::communicator comm(sock::transport(s, r, n, {.timeout = 30s}));
    std::vector<float> v(100000, 1.0f);
    ringzero::all_reduce(comm, std::span<float>(v), op::sum);
    if (r == 1) {
      s.barrier("rank 0 done", 2);
      return 0;
    }
    std::thread aborter([&] {
      std::this_thread::sleep_for(300ms);
      comm.abort("stopped by the test");
    });
    const auto start = std::chrono::steady_clock::now();
    std::string what;
    try {
      ringzero::all_reduce(comm, std::span<float>(v), op::sum);
    } catch (const ringzero::peer_error& e) {
      what = e.what();
    }
    const auto took = std::chrono::steady_clock::now() - start;
    aborter.join();
    check.expect(contains(what, "aborted") && contains(what, "stopped by the test"),
                 fmt::format("an error saying the communicator was aborted, got '{}'", what));
    check.expect(took < 10s, "the waiter to be released well before the 30 s deadline");
    std::string again;
    try {
      ringzero::all_reduce(comm, std::span<float>(v), op::sum);
    } catch (const ringzero::peer_error& e) {
      again = e.what();
    }
    check.expect(contains(again, "aborted"), "a call after abort() to fail as aborted");
    std::string sent;
    try {
      (void)comm.isend(1, 0, {});
    } catch (const ringzero::peer_error& e) {
      sent = e.what();
    }
    check.expect(contains(sent, "aborted"), "isend after abort() to fail as aborted");
    s.barrier("rank 0 done", 2);
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("bad arguments are named") {
  auto out = multiprocess::run(2, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    sock::communicator comm(sock::transport(s, r, n));
    std::string what;
    try {
      std::byte b{};
      (void)comm.transport().isend(r, 1, std::span<const std::byte>(&b, 1));
    } catch (const ringzero::invalid_argument& e) {
      what = e.what();
    }
    check.expect(contains(what, "peer"), "an invalid_argument naming the peer");
    return check.code();
  });
  require_all_passed(out);
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

TEST_CASE("striping: pieces go where they finish first at each rail's measured rate") {
  namespace d = ringzero::socket::detail;
  std::vector<d::connection> conns(3);
  for (int i = 0; i < 3; ++i) {
    conns[static_cast<std::size_t>(i)].rail = i;
    conns[static_cast<std::size_t>(i)].alive = true;
  }
  constexpr std::size_t piece = std::size_t{1} << 20;
  const auto place = [&](std::size_t pieces, bool weighted) {
    std::vector<int> got(conns.size(), 0);
    for (auto& c : conns) c.queued_bytes = 0;
    std::size_t next = 0;
    for (std::size_t k = 0; k < pieces; ++k) {
      const std::size_t at = d::weighted_pick(conns, next, piece, weighted);
      REQUIRE(at < conns.size());
      conns[at].queued_bytes += piece;
      ++got[at];
      next = (at + 1) % conns.size();
    }
    return got;
  };
  // Nothing measured yet: the least loaded, round robin, as equal shares.
  CHECK(place(24, true) == std::vector<int>{8, 8, 8});
  // Rails of 3 : 2 : 1: the message divides in that proportion.
  conns[0].rate = 3e8;
  conns[1].rate = 2e8;
  conns[2].rate = 1e8;
  CHECK(place(24, true) == std::vector<int>{12, 8, 4});
  // Unweighted, the rates are ignored.
  CHECK(place(24, false) == std::vector<int>{8, 8, 8});
  // Rates within a quarter of the fastest are noise between alike rails: equal shares.
  conns[1].rate = 2.4e8;
  conns[2].rate = 2.9e8;
  CHECK(place(24, true) == std::vector<int>{8, 8, 8});
  conns[1].rate = 2e8;
  conns[2].rate = 1e8;
  // A rail not measured yet counts as fast as the fastest, so it is tried; a dead one never is.
  conns[2].rate = 0;
  CHECK(place(16, true) == std::vector<int>{6, 4, 6});
  conns[1].alive = false;
  CHECK(place(10, true) == std::vector<int>{5, 0, 5});
  conns[0].alive = conns[2].alive = false;
  CHECK(d::weighted_pick(conns, 0, piece, true) == conns.size());
}

TEST_CASE("striping: a rail's rate is measured where its bytes arrive, while they arrive") {
  namespace d = ringzero::socket::detail;
  using std::chrono::milliseconds;
  constexpr std::uint64_t half = std::uint64_t{512} << 10, mib = std::uint64_t{1} << 20;
  d::connection c;
  const auto t0 = d::clock::now();
  // One read of `bytes` at t0 + ms, after which a frame is still `arriving` or not, as
  // engine::read accounts it.
  const auto read = [&](std::uint64_t bytes, int ms, bool arriving) {
    c.arrived(bytes, t0 + milliseconds(ms));
    c.rx_sampling = arriving;
  };
  read(half, 40, true);  // the first read after an idle spell: not a sample
  CHECK(c.rx_rate == 0);
  CHECK(c.rx_rate_field() == 0);  // acknowledgements say "not measured"
  read(half, 45, true);
  CHECK(c.rx_rate == 0);  // half a window so far
  read(half, 50, true);
  const double r10 = static_cast<double>(mib) / 0.010;  // 1 MiB in 10 ms
  CHECK(c.rx_rate == doctest::Approx(r10));
  CHECK(c.rx_rate_field() == static_cast<std::uint32_t>(c.rx_rate / 1024.0));
  // A faster window raises the estimate at once; slower ones do not lower it while the faster
  // is among the last four.
  read(mib, 55, true);
  CHECK(c.rx_rate == doctest::Approx(2 * r10));
  read(half, 60, false);  // the frame is whole: nothing arriving after this read
  // The idle time until the next read is not a sample.
  read(mib, 5000, true);
  read(mib, 5010, true);  // with the half from before: 1.5 MiB in 15 ms
  CHECK(c.rx_rate == doctest::Approx(2 * r10));
  for (int w = 0; w < 3; ++w) read(mib, 5030 + 20 * w, true);  // 1 MiB in 20 ms each
  // Four windows on, the fast one is gone: the best of the last four is 1.5 MiB in 15 ms.
  CHECK(c.rx_rate == doctest::Approx(r10));
  read(mib, 5090, true);
  CHECK(c.rx_rate == doctest::Approx(r10 / 2));
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

TEST_CASE(
    "a rail that fails mid-transfer: its pieces move to the others; the last one names "
    "the rank and the rail") {
  auto out = multiprocess::run(2, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    std::string log;
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
    log = multiprocess::capture_info_log("socket-rail", [&] {
      if (r == 0) {
        auto q = comm.isend(1, 1, std::as_bytes(std::span<const std::uint8_t>(data)));
        // Some of it moves, then rail 1 breaks under it.
        const auto until = std::chrono::steady_clock::now() + 30s;
        bool done = false;
        while (!done && comm.transport().rail_bytes()[1] == 0 &&
               std::chrono::steady_clock::now() < until)
          done = comm.test(q);
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
    check.expect(contains(log, "rail 127.0.0.2 to rank") && contains(log, "remaining rail"),
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
                     contains(what, "rail 127.0.0."),
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
