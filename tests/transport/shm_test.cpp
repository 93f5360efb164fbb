// The shm transport with ranks as processes: the conformance matrix for 1 to 4 ranks,
// sub-communicators, cancellation, many messages in flight, size mismatches, symmetric memory,
// the segment's removal, a peer killed with SIGKILL, abort() and a stalled rank.
//
// CTest runs each "conformance" case as a test of its own (see CMakeLists.txt).
#include <doctest/doctest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/core.h>

// The shm communicator's collectives first: the conformance matrix's qualified calls must see
// them.
#include "ringzero/transport/shm/communicator.hpp"

#include "conformance_matrix.hpp"
#include "multiprocess.hpp"
#include "ringzero/ringzero.hpp"

using namespace std::chrono_literals;
using ringzero::op;
namespace shm = ringzero::shm;
using multiprocess::contains;
using multiprocess::rank_checks;
using multiprocess::require_all_passed;

namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool sanitized = true;
#else
constexpr bool sanitized = false;
#endif

// The sanitizer builds run one element type of the matrix (ten would take them ten times as
// long), so they compile one.
using matrix_types =
    std::conditional_t<sanitized, conformance::types<float>, conformance::every_type>;

[[nodiscard]] std::vector<std::string> run_matrix(shm::communicator& comm) {
  using ringzero::dtype;
  const dtype each_size[] = {dtype::int8, dtype::bfloat16, dtype::float32, dtype::float64};
  const auto types = sanitized          ? std::span<const dtype>(matrix_types::dtypes)
                     : comm.size() == 2 ? std::span<const dtype>(ringzero::all_dtypes)
                                        : std::span<const dtype>(each_size);
  // automatic runs too: on shm it is the segment path (transport/shm/detail/collectives.hpp), not
  // one of the message algorithms.
  const auto cases = conformance::matrix(comm.size(), false, types);
  auto failures = conformance::run_all<matrix_types>(comm, cases);
  if (comm.rank() == 0)
    std::fprintf(stderr, "shm, %d ranks: %zu cases, %zu failures\n", comm.size(), cases.size(),
                 failures.size());
  return failures;
}

void conformance_over(int n) {
  if (ringzero::detail::getenv_str("RANK") && ringzero::detail::getenv_str("WORLD_SIZE")) {
    auto comm = shm::communicator::from_env();
    REQUIRE(comm.size() == n);
    for (const auto& f : run_matrix(comm)) FAIL_CHECK(f);
    return;
  }
  auto out = multiprocess::run(n, 300s, [&](int r, int size, ringzero::bootstrap::store& s) {
    shm::communicator comm(shm::transport(s, r, size));
    const auto failures = run_matrix(comm);
    for (const auto& f : failures) std::fprintf(stderr, "%s\n", f.c_str());
    return failures.empty() ? 0 : 1;
  });
  require_all_passed(out);
}

template <class Q>
void drive(shm::communicator& comm, Q& q, int peer) {
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!comm.test(q))
    if (std::chrono::steady_clock::now() > deadline) throw ringzero::timeout_error("stuck", peer);
}

[[nodiscard]] std::size_t segments_of(int pid) {
  std::size_t n = 0;
  const std::string prefix = fmt::format("ringzero-{}-", pid);
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
    n += e.path().filename().string().starts_with(prefix);
  return n;
}

}  // namespace

TEST_CASE("conformance shm 1 rank") {
  conformance_over(1);
}
TEST_CASE("conformance shm 2 ranks" * doctest::skip()) {
  conformance_over(2);
}
TEST_CASE("conformance shm 3 ranks" * doctest::skip()) {
  conformance_over(3);
}
TEST_CASE("conformance shm 4 ranks" * doctest::skip()) {
  conformance_over(4);
}

TEST_CASE("the segment's name is gone once every rank mapped it") {
  auto out = multiprocess::run(3, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    shm::communicator comm(shm::transport(s, r, n));
    // Rank 0 created the segment (and names it after its pid); the constructor returns only once
    // all ranks mapped it, and the last of them removed the name.
    s.set_string(fmt::format("pid/{}", r), std::to_string(::getpid()));
    const int creator = std::stoi(s.get_string("pid/0"));
    check.expect(segments_of(creator) == 0, "no /dev/shm entry left by rank 0's process");
    s.barrier("looked", n);
    auto buf = comm.allocate<double>(1000);
    ringzero::barrier(comm);
    check.expect(segments_of(creator) == 0, "no entry left by the symmetric allocation");
    std::fill(buf.local().begin(), buf.local().end(), 1.0 + r);
    ringzero::barrier(comm);
    for (int p = 0; p < n; ++p)
      check.expect(buf.peer(p)[999] == 1.0 + p, fmt::format("rank {}'s part seen in place", p));
    check.expect(buf.memory().owner(buf.peer(2).data() + 5) == 2, "owner() to find rank 2");
    check.expect(buf.memory().owner(&r) == -1, "owner() of other memory to be -1");
    ringzero::barrier(comm);
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("sub-communicators keep their messages apart") {
  auto out = multiprocess::run(4, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    shm::communicator comm(shm::transport(s, r, n));
    const auto t = comm.topo();
    check.expect(t.node_count == 1 && t.local_size == 4 && t.local_rank == r, "one node of four");
    auto half = comm.split(r % 2, -r);
    check.expect(half && half->size() == 2, "a 2-rank half");
    check.expect(half->rank() == (r < 2 ? 1 : 0), "ranks ordered by descending world rank");
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
    std::vector<float> h(1001, 1.0f);
    ringzero::all_reduce(comm, std::span<float>(h), op::sum,
                         {.algorithm = ringzero::algorithm::hierarchical});
    check.expect(h[1000] == 4.0f, "hierarchical all_reduce on one node");
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("a destroyed receive is never written; a destroyed send under way still arrives") {
  auto out = multiprocess::run(2, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    shm::communicator comm(shm::transport(s, r, n));
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
      // A send larger than the ring, dropped after its start: its buffer is overwritten, the
      // peer still gets the original bytes.
      {
        auto big = std::vector<std::uint8_t>(payload.size(), 0x3c);
        auto q = comm.isend(1, 6, std::as_bytes(std::span<const std::uint8_t>(big)));
        std::fill(big.begin(), big.end(), 0x3c);  // still the bytes the peer must see
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

TEST_CASE("hundreds of messages in flight, matched by tag not by arrival") {
  auto out = multiprocess::run(2, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    shm::communicator comm(shm::transport(s, r, n));
    constexpr int count = 400;
    const int peer = 1 - r;
    auto size_of = [](int i) { return static_cast<std::size_t>((i * 7919) % 70000); };
    std::vector<std::vector<std::uint8_t>> out_bufs(count), in_bufs(count);
    std::vector<shm::communicator::request> reqs;
    // Rank 0 posts its receives first, rank 1 after its sends: both orders of arrival.
    auto post_recvs = [&] {
      for (int i = 0; i < count; ++i) {
        in_bufs[std::size_t(i)].assign(size_of(i), 0);
        reqs.push_back(comm.irecv(peer, static_cast<ringzero::tag_t>(i),
                                  std::as_writable_bytes(std::span(in_bufs[std::size_t(i)]))));
      }
    };
    if (r == 0) post_recvs();
    for (int i = count - 1; i >= 0; --i) {
      out_bufs[std::size_t(i)].assign(size_of(i), static_cast<std::uint8_t>(i + r));
      reqs.push_back(comm.isend(peer, static_cast<ringzero::tag_t>(i),
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

TEST_CASE("a receive posted with the wrong size fails with both sizes named") {
  auto out = multiprocess::run(2, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    shm::communicator comm(shm::transport(s, r, n));
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
      check.expect(
          what.find(sizes) != std::string::npos && what.find("rank 1") != std::string::npos,
          fmt::format("a transport_error naming rank 1 and '{}', got '{}'", sizes, what));
    };
    expect_mismatch(8, std::span<std::byte>(big), "the peer sent 100 bytes");
    expect_mismatch(7, std::span<std::byte>(small), "posted a 100 byte receive");
    s.set_string("checked", "1");
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE(
    "a rank killed with SIGKILL is named by the survivors' errors, well within the deadline") {
  // A long deadline: the survivors must not wait for it, they learn from the kernel that the
  // process is gone.
  ::setenv("RINGZERO_TIMEOUT", "60", 1);
  auto out = multiprocess::run(3, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    shm::communicator comm(shm::transport(s, r, n));
    const ringzero::options ring{.algorithm = ringzero::algorithm::ring};
    // Chunks far larger than a ring of slots: rank 0 waits on rank 1 taking its data.
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

TEST_CASE("bad arguments are named") {
  auto out = multiprocess::run(2, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    shm::communicator comm(shm::transport(s, r, n));
    std::string what;
    try {
      std::byte b{};
      (void)comm.isend(r, 1, std::span<const std::byte>(&b, 1));
    } catch (const ringzero::invalid_argument& e) {
      what = e.what();
    }
    check.expect(what.find("peer") != std::string::npos, "an invalid_argument naming the peer");
    return check.code();
  });
  require_all_passed(out);
  auto bad = multiprocess::run(1, 30s, [&](int r, int n, ringzero::bootstrap::store& s) {
    try {
      shm::communicator comm(shm::transport(s, r, n, {.segment = {.slots = 1}}));
    } catch (const ringzero::invalid_argument&) {
      return 0;
    }
    return 1;
  });
  require_all_passed(bad);
}

TEST_CASE("automatic collectives of the world run in the segment; the others over messages") {
  auto out = multiprocess::run(3, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    // A forced algorithm in the environment would keep every call off the segment.
    ::unsetenv("RINGZERO_ALGO");
    rank_checks check{r};
    shm::communicator comm(shm::transport(s, r, n));
    const auto sum_of_ranks = static_cast<float>(n * (n - 1) / 2);
    const auto all_equal = [&](const std::vector<float>& v) {
      return std::all_of(v.begin(), v.end(), [&](float x) { return x == sum_of_ranks; });
    };
    std::vector<float> v(100, static_cast<float>(r));
    ringzero::all_reduce(comm, std::span<float>(v), op::sum,
                         {.algorithm = ringzero::algorithm::ring});
    check.expect(all_equal(v), "the forced ring's sum");
    check.expect(!comm.transport().segment_used(), "a forced algorithm over messages");
    auto sub = comm.split(0, -r);
    check.expect(sub.has_value(), "a sub-communicator of every rank");
    std::fill(v.begin(), v.end(), static_cast<float>(r));
    ringzero::all_reduce(*sub, std::span<float>(v), op::sum);
    check.expect(all_equal(v), "the sub-communicator's sum");
    check.expect(!comm.transport().segment_used(), "a sub-communicator's call over messages");
    std::string what;
    try {
      (void)sub->allocate<float>(10);
    } catch (const ringzero::unsupported& e) {
      what = e.what();
    }
    check.expect(what.find("world communicator") != std::string::npos,
                 "symmetric memory refused on a sub-communicator");
    std::fill(v.begin(), v.end(), static_cast<float>(r));
    ringzero::all_reduce(comm, std::span<float>(v), op::sum);
    check.expect(all_equal(v), "the segment's sum");
    check.expect(comm.transport().segment_used(), "the world's automatic call in the segment");
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("segment collectives in pieces: a workspace far smaller than the messages") {
  // 256-byte buffers and a 64-byte streaming threshold: every size of the matrix takes several
  // pieces, and symmetric outputs go through the streaming stores.
  auto out = multiprocess::run(3, 300s, [&](int r, int n, ringzero::bootstrap::store& s) {
    shm::communicator comm(
        shm::transport(s, r, n, {.segment = {.workspace_bytes = 256, .streaming_bytes = 64}}));
    using piece_types = conformance::types<float, std::int8_t>;
    std::vector<conformance::test_case> cases;
    for (const auto& tc : conformance::matrix(n, false, piece_types::dtypes))
      if (tc.algo == ringzero::algorithm::automatic) cases.push_back(tc);
    const auto failures = conformance::run_all<piece_types>(comm, cases);
    for (const auto& f : failures) std::fprintf(stderr, "%s\n", f.c_str());
    return failures.empty() ? 0 : 1;
  });
  require_all_passed(out);
}

TEST_CASE("segment collectives whose ranks disagree on count, op or kind raise on every rank") {
  auto out = multiprocess::run(3, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    ::unsetenv("RINGZERO_ALGO");
    ::unsetenv("RINGZERO_CHECK");
    rank_checks check{r};
    shm::communicator comm(shm::transport(s, r, n));
    const ringzero::options opt{.timeout = 20s};
    // Each call, its guards on both sides, and what every rank's error must name.
    const auto expect_mismatch = [&](const std::string& name, std::size_t count, op o, bool barrier,
                                     const std::string& a, const std::string& b) {
      std::vector<float> guard_before(64, 7.0f), v(count, 1.0f), guard_after(64, 7.0f);
      std::string what;
      try {
        if (barrier)
          ringzero::barrier(comm, opt);
        else
          ringzero::all_reduce(comm, std::span<float>(v), o, opt);
      } catch (const ringzero::mismatch_error& e) {
        what = e.what();
      }
      check.expect(
          contains(what, a) && contains(what, b),
          fmt::format("{}: a mismatch_error naming '{}' and '{}', got '{}'", name, a, b, what));
      const auto intact = [](const std::vector<float>& g) {
        return std::all_of(g.begin(), g.end(), [](float x) { return x == 7.0f; });
      };
      check.expect(intact(guard_before) && intact(guard_after), name + ": guards intact");
    };
    // One shot (a single phase) and two-shot sizes.
    expect_mismatch("1000 vs 2000 floats", r == 1 ? 2000 : 1000, op::sum, false, "count 1000",
                    "count 2000");
    expect_mismatch("100000 vs 200000 floats", r == 2 ? 200000 : 100000, op::sum, false,
                    "count 100000", "count 200000");
    expect_mismatch("sum vs max", 1000, r == 2 ? op::max : op::sum, false, "op sum", "op max");
    expect_mismatch("all_reduce vs barrier", 1000, op::sum, r == 0, "called all_reduce",
                    "called barrier");
    // Every rank stopped at the same phase: a matching call still runs in the segment.
    std::vector<float> v(1000, static_cast<float>(r));
    ringzero::all_reduce(comm, std::span<float>(v), op::sum, opt);
    const auto sum_of_ranks = static_cast<float>(n * (n - 1) / 2);
    check.expect(std::all_of(v.begin(), v.end(), [&](float x) { return x == sum_of_ranks; }),
                 "a matching call after the mismatches sums correctly");
    check.expect(comm.transport().segment_used(), "that call in the segment");
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("all_reduce on symmetric buffers reads peers in place, every rank bitwise equal") {
  auto out = multiprocess::run(3, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    shm::communicator comm(shm::transport(s, r, n, {.segment = {.streaming_bytes = 4096}}));
    // Either side of shm::detail::symmetric_min_bytes (512 B): copied through the workspace, or
    // read in place.
    for (const std::size_t count : {std::size_t{1}, std::size_t{127}, std::size_t{128},
                                    std::size_t{1000}, std::size_t{300007}}) {
      auto in = comm.allocate<float>(count);
      auto res = comm.allocate<float>(count);
      for (const bool in_place : {false, true}) {
        for (std::size_t i = 0; i < count; ++i)
          in.local()[i] = 0.1f * static_cast<float>((i * 31 + static_cast<std::size_t>(r)) % 97);
        std::span<float> dst = in_place ? in.local() : res.local();
        ringzero::all_reduce(comm, std::span<const float>(in.local()), dst, op::sum);
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < count; ++i) {
          float want = 0;
          for (int q = 0; q < n; ++q)
            want += 0.1f * static_cast<float>((i * 31 + static_cast<std::size_t>(q)) % 97);
          wrong += std::abs(dst[i] - want) > 1e-4f * std::max(1.0f, want);
        }
        check.expect(wrong == 0,
                     fmt::format("{} elements, in place {}: {} wrong", count, in_place, wrong));
        // Every rank's copy of the result is the same bits: compare with rank 0's in place.
        ringzero::barrier(comm);
        const auto* rank0 = in_place ? in.peer(0).data() : res.peer(0).data();
        check.expect(std::memcmp(rank0, dst.data(), count * sizeof(float)) == 0,
                     "the same bits as rank 0");
        ringzero::barrier(comm);
      }
    }
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("abort() from another thread unblocks waits in the segment, on messages and on a split") {
  // The modes: an automatic call of the world (in the segment), a forced ring of the world and an
  // automatic call of a sub-communicator (both over messages); abort() is always the world's.
  enum class mode { segment, ring, split };
  for (const mode m : {mode::segment, mode::ring, mode::split}) {
    CAPTURE(static_cast<int>(m));
    auto out = multiprocess::run(2, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
      ::unsetenv("RINGZERO_ALGO");
      rank_checks check{r};
      shm::communicator comm(shm::transport(s, r, n, {.timeout = 30s}));
      auto sub = comm.split(0, r);
      std::vector<float> v(100000, 1.0f);
      // The segment's workspace exists: rank 0's next call waits in a phase, not in its setup.
      ringzero::all_reduce(comm, std::span<float>(v), op::sum);
      if (r == 1) {
        // Never joins: rank 0's collective can only end through abort().
        s.barrier("rank 0 done", 2);
        return 0;
      }
      auto& target = m == mode::split ? *sub : comm;
      const ringzero::options opt{.algorithm = m == mode::ring ? ringzero::algorithm::ring
                                                               : ringzero::algorithm::automatic};
      std::thread aborter([&] {
        std::this_thread::sleep_for(300ms);
        comm.abort("stopped by the test");
      });
      const auto start = std::chrono::steady_clock::now();
      std::string what;
      try {
        ringzero::all_reduce(target, std::span<float>(v), op::sum, opt);
      } catch (const ringzero::peer_error& e) {
        what = e.what();
      }
      const auto took = std::chrono::steady_clock::now() - start;
      aborter.join();
      check.expect(contains(what, "aborted") && contains(what, "stopped by the test"),
                   fmt::format("an error saying the communicator was aborted, got '{}'", what));
      check.expect(took < 10s, "the waiter to be released well before the 30 s deadline");
      std::fprintf(stderr, "shm abort(), mode %d: released %.3f s after the call began (300 ms)\n",
                   static_cast<int>(m), std::chrono::duration<double>(took).count());
      check.expect(m != mode::segment || contains(what, "shm segment"),
                   fmt::format("the wait in the segment to be the one aborted, got '{}'", what));
      for (auto* c : {&comm, &*sub}) {
        std::string again;
        const auto at = std::chrono::steady_clock::now();
        try {
          ringzero::all_reduce(*c, std::span<float>(v), op::sum, opt);
        } catch (const ringzero::peer_error& e) {
          again = e.what();
        }
        check.expect(
            contains(again, "aborted") && std::chrono::steady_clock::now() - at < 1s,
            fmt::format("a call after abort() to fail at once as aborted, got '{}'", again));
      }
      std::string sent;
      try {
        (void)comm.isend(1, 0, {});
      } catch (const ringzero::peer_error& e) {
        sent = e.what();
      }
      check.expect(contains(sent, "aborted"),
                   fmt::format("isend after abort() to fail as aborted, got '{}'", sent));
      s.barrier("rank 0 done", 2);
      return check.code();
    });
    require_all_passed(out);
  }
}

TEST_CASE("a stalled rank (SIGSTOP): the others time out naming collective, sequence, step, peer") {
  // In the segment (automatic, 800 KB: every rank waits for rank 1's post) and over messages
  // (ring, 12 MB: chunks larger than a ring of slots). On the ring, rank 2 waits for rank 1 to
  // send; rank 0 for rank 1 to take its data, or for rank 2, held up by rank 1 in turn: each
  // names the peer it waits for (a stalled process is alive; only a dead one is named as such).
  struct stall_case {
    ringzero::algorithm algo;
    std::size_t count;
    const char* names;     // in the timeout's message
    const char* log_says;  // in the RINGZERO_DEBUG=INFO log
  };
  const stall_case cases[] = {
      {ringzero::algorithm::automatic, 200000, "all_reduce (shm segment)", "rank 1 at phase"},
      {ringzero::algorithm::ring, 3000000, "all_reduce (ring)", "pending messages"}};
  for (const auto& c : cases) {
    const std::string name = c.names;
    CAPTURE(name);
    auto out = multiprocess::run(3, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
      ::unsetenv("RINGZERO_ALGO");
      rank_checks check{r};
      shm::communicator comm(shm::transport(s, r, n, {.timeout = 2s}));
      std::vector<float> v(c.count, 1.0f);
      const ringzero::options opt{.algorithm = c.algo};
      ringzero::all_reduce(comm, std::span<float>(v), op::sum, opt);
      if (r == 1) {
        s.set_string("pid/1", std::to_string(::getpid()));
        ::raise(SIGSTOP);
        return 0;  // continued once the others are done
      }
      // RINGZERO_DEBUG=INFO: what this rank waits for goes to the log, which it reads back.
      std::string what;
      int peer = -2;
      std::chrono::steady_clock::duration took{};
      const std::string log = multiprocess::capture_info_log("shm-stall", [&] {
        const auto start = std::chrono::steady_clock::now();
        try {
          ringzero::all_reduce(comm, std::span<float>(v), op::sum, opt);
        } catch (const ringzero::timeout_error& e) {
          what = e.what();
          peer = e.peer();
        }
        took = std::chrono::steady_clock::now() - start;
      });
      const bool segment = c.algo == ringzero::algorithm::automatic;
      check.expect(peer == 1 || (!segment && r == 0 && peer == 2),
                   fmt::format("timeout_error::peer() == 1{}, got {}",
                               !segment && r == 0 ? " or 2" : "", peer));
      check.expect(contains(what, c.names) && contains(what, "sequence 1") &&
                       contains(what, "step ") &&
                       contains(what, fmt::format("waiting for rank {}", peer)),
                   fmt::format("a timeout naming {}, sequence 1, a step and rank {}, got '{}'",
                               c.names, peer, what));
      std::fprintf(stderr, "shm stall, rank %d: timeout_error after %.3f s (2 s): %s\n", r,
                   std::chrono::duration<double>(took).count(), what.c_str());
      check.expect(took >= 1900ms && took < 6s,
                   fmt::format("the error at the 2 s deadline, got {:.2f} s",
                               std::chrono::duration<double>(took).count()));
      check.expect(contains(log, "gave up waiting") && contains(log, c.log_says) &&
                       contains(log, "sequence 1") && contains(log, fmt::format("rank {}", peer)),
                   fmt::format("the log to say what the rank waited for, got '{}'", log));
      s.barrier("survivors done", 2);
      if (r == 0) ::kill(std::stoi(s.get_string("pid/1")), SIGCONT);
      return check.code();
    });
    require_all_passed(out);
  }
}
