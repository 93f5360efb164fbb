// The shm transport with ranks as processes, what only it has: symmetric memory, the segment's
// removal, collectives in the segment, and a stalled rank. The conformance matrix and the
// behaviours every transport shares run in transport_conformance_test.cpp.
#include <doctest/doctest.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/core.h>

// The shm communicator's collectives first: the conformance matrix's qualified calls must see
// them.
#include "ringzero/transport/shm.hpp"

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

[[nodiscard]] std::size_t segments_of(int pid) {
  std::size_t n = 0;
  const std::string prefix = fmt::format("ringzero-{}-", pid);
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
    n += e.path().filename().string().starts_with(prefix);
  return n;
}

/// Makes process_vm_readv fail with EPERM in this process from now on, as the default seccomp
/// profile of a container without CAP_SYS_PTRACE does. False where seccomp filters are refused.
[[nodiscard]] bool refuse_cross_memory_reads() {
#if defined(__x86_64__)
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_process_vm_readv, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog program{static_cast<unsigned short>(std::size(filter)), filter};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
         ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) == 0;
#else
  return false;
#endif
}

/// Rank r's element i of an all_gather input: distinct per rank and position.
template <class E>
[[nodiscard]] E gathered(int r, std::size_t i) {
  return static_cast<E>((static_cast<std::size_t>(r) * 131 + i * 7) % 127);
}

/// all_gather of `count` elements per rank, out of place and in place: whether every block holds
/// its rank's input; the first wrong element otherwise.
template <class E>
[[nodiscard]] std::string check_all_gather(shm::communicator& comm, std::size_t count) {
  const int r = comm.rank();
  const int n = comm.size();
  const auto un = static_cast<std::size_t>(n);
  for (bool in_place : {false, true}) {
    std::vector<E> in(count), out(count * un, E{99});
    for (std::size_t i = 0; i < count; ++i) in[i] = gathered<E>(r, i);
    if (in_place) {
      std::copy(in.begin(), in.end(),
                out.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(r)));
      ringzero::all_gather(
          comm, std::span<const E>(out.data() + count * static_cast<std::size_t>(r), count),
          std::span<E>(out));
    } else {
      ringzero::all_gather(comm, std::span<const E>(in), std::span<E>(out));
    }
    for (int q = 0; q < n; ++q)
      for (std::size_t i = 0; i < count; ++i)
        if (out[static_cast<std::size_t>(q) * count + i] != gathered<E>(q, i))
          return fmt::format("{} elements of {} bytes{}: block {} element {} is wrong", count,
                             sizeof(E), in_place ? " in place" : "", q, i);
  }
  return {};
}

/// all_to_all of `count` elements per pair of ranks, out of place and in place: whether block q
/// of every rank's output holds rank q's block for it; the first wrong element otherwise.
template <class E>
[[nodiscard]] std::string check_all_to_all(shm::communicator& comm, std::size_t count) {
  const int r = comm.rank();
  const int n = comm.size();
  const auto un = static_cast<std::size_t>(n);
  // Rank q's element i of its block for rank t.
  const auto value = [&](int q, int t, std::size_t i) { return gathered<E>(q * 17 + t, i); };
  for (bool in_place : {false, true}) {
    std::vector<E> in(count * un), out(count * un, E{99});
    for (int t = 0; t < n; ++t)
      for (std::size_t i = 0; i < count; ++i)
        in[static_cast<std::size_t>(t) * count + i] = value(r, t, i);
    if (in_place) {
      out = in;
      ringzero::all_to_all(comm, std::span<E>(out));
    } else {
      ringzero::all_to_all(comm, std::span<const E>(in), std::span<E>(out));
    }
    for (int q = 0; q < n; ++q)
      for (std::size_t i = 0; i < count; ++i)
        if (out[static_cast<std::size_t>(q) * count + i] != value(q, r, i))
          return fmt::format("all_to_all, {} elements of {} bytes{}: block {} element {} is wrong",
                             count, sizeof(E), in_place ? " in place" : "", q, i);
  }
  return {};
}

/// all_reduce of `count` elements with `o`, out of place and in place, on `comm` and on
/// `reference` (the same ranks, reducing in the shared segment): whether both give the same bits
/// and every rank's contribution counts; the first difference otherwise.
template <class E>
[[nodiscard]] std::string check_all_reduce(shm::communicator& comm, shm::communicator& reference,
                                           std::size_t count, op o) {
  const int r = comm.rank();
  std::vector<E> in(count), out(count), expected(count);
  // Distinct per rank and position, with fractions whose sums round (float), so that an
  // order other than the ranks' shows in the bits.
  for (std::size_t i = 0; i < count; ++i)
    in[i] = static_cast<E>(static_cast<double>(gathered<E>(r, i)) / (o == op::prod ? 64.0 : 3.0) +
                           (o == op::prod ? 1.0 : 0.0));
  ringzero::all_reduce(reference, std::span<const E>(in), std::span<E>(expected), o);
  for (bool in_place : {false, true}) {
    std::fill(out.begin(), out.end(), E{99});
    if (in_place) {
      out = in;
      ringzero::all_reduce(comm, std::span<E>(out), o);
    } else {
      ringzero::all_reduce(comm, std::span<const E>(in), std::span<E>(out), o);
    }
    for (std::size_t i = 0; i < count; ++i)
      if (std::memcmp(&out[i], &expected[i], sizeof(E)) != 0)
        return fmt::format(
            "all_reduce {}, {} elements of {} bytes{}: element {} is {}, the "
            "segment's {}",
            ringzero::op_name(o), count, sizeof(E), in_place ? " in place" : "", i,
            static_cast<double>(out[i]), static_cast<double>(expected[i]));
  }
  // The reference itself: a sum over ranks is not any one rank's input.
  if (o == op::sum && count > 1 && comm.size() > 1 && expected[1] == in[1])
    return "the segment's sum equals this rank's input";
  return {};
}

}  // namespace

TEST_CASE("all_gather and all_to_all of large blocks read each peer's input from its process") {
  // Around the default threshold (16 KiB per block), past the workspace's capacity and past
  // segment_bytes (where the call went over messages before), odd byte counts included.
  auto out = multiprocess::run(3, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    shm::communicator comm(shm::transport(s, r, n));
    for (std::size_t count :
         {std::size_t{4095}, std::size_t{4096}, std::size_t{65537}, (std::size_t{3} << 20) + 1}) {
      const std::string bad = check_all_gather<float>(comm, count);
      check.expect(bad.empty(), bad);
    }
    for (std::size_t count : {std::size_t{16383}, std::size_t{16385}, std::size_t{1} << 20}) {
      const std::string bad = check_all_gather<std::int8_t>(comm, count);
      check.expect(bad.empty(), bad);
    }
    // all_to_all reads each peer's slice for this rank the same way, in place from a copy.
    for (std::size_t count :
         {std::size_t{4095}, std::size_t{4096}, std::size_t{65537}, (std::size_t{1} << 20) + 1}) {
      const std::string bad = check_all_to_all<float>(comm, count);
      check.expect(bad.empty(), bad);
    }
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("all_reduce of large buffers reads the peers' inputs and outputs from their processes") {
  // Turned on from 4 KiB (it is off by default), so that counts around that, across the 64 KiB
  // pieces and past the workspace's capacity take the cross-process path; the reference, with
  // the default, stays in the segment.
  for (int ranks : {2, 3, 4}) {
    CAPTURE(ranks);
    auto out = multiprocess::run(ranks, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
      rank_checks check{r};
      shm::communicator comm(
          shm::transport(s, r, n, {.segment = {.cross_memory_all_reduce_bytes = 4096}}));
      shm::communicator segment(shm::transport(s, r, n));
      for (std::size_t count :
           {std::size_t{1024}, std::size_t{1031}, std::size_t{65537}, (std::size_t{1} << 20) + 3})
        for (op o : {op::sum, op::avg, op::max, op::prod}) {
          const std::string bad = check_all_reduce<float>(comm, segment, count, o);
          check.expect(bad.empty(), bad);
        }
      for (std::size_t count : {std::size_t{513}, std::size_t{100003}}) {
        const std::string bad = check_all_reduce<double>(comm, segment, count, op::sum);
        check.expect(bad.empty(), bad);
        const std::string bad8 = check_all_reduce<std::int8_t>(comm, segment, count * 8, op::max);
        check.expect(bad8.empty(), bad8);
      }
      return check.code();
    });
    require_all_passed(out);
  }
}

TEST_CASE("all_gather: ranks that disagree on reading across processes raise, naming the path") {
  // RINGZERO_SHM_CMA=0 on rank 1 only: the large call's descriptors differ, and every rank says
  // so instead of waiting for phases the others never post; small calls are alike either way.
  auto out = multiprocess::run(3, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    if (r == 1) ::setenv("RINGZERO_SHM_CMA", "0", 1);
    shm::communicator comm(shm::transport(s, r, n));
    const std::string small = check_all_gather<float>(comm, 100);
    check.expect(small.empty(), small);
    std::string what;
    try {
      (void)check_all_gather<float>(comm, 65536);
    } catch (const ringzero::mismatch_error& e) {
      what = e.what();
    }
    check.expect(contains(what, "inputs read across processes") && contains(what, "rank 1"),
                 "a mismatch_error naming the cross-process path and rank 1, got '" + what + "'");
    // Counts that put one rank in the workspace and another over messages were not compared
    // before (docs/reliability.md); now every large all_gather starts with a compared phase.
    ::unsetenv("RINGZERO_SHM_CMA");
    shm::communicator alike(shm::transport(s, r, n, {.timeout = 20s}));
    const std::size_t count = r == 2 ? std::size_t{2} << 20 : std::size_t{1} << 16;
    std::vector<float> in(count, 1.0f), gathered_all(count * static_cast<std::size_t>(n));
    what.clear();
    try {
      ringzero::all_gather(alike, std::span<const float>(in), std::span<float>(gathered_all));
    } catch (const ringzero::mismatch_error& e) {
      what = e.what();
    }
    check.expect(contains(what, "count 65536") && contains(what, "count 2097152"),
                 "a mismatch_error naming both counts, got '" + what + "'");
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("all_gather where the kernel refuses cross-memory reads: same results, every rank") {
  // Rank 2 runs under a seccomp filter that fails process_vm_readv with EPERM. Its first large
  // all_gather finds out, every rank learns it in the call's second phase, and that call and
  // every later one complete through the segment and messages, on all ranks alike (ranks that
  // took different paths would fail the next call's descriptor check).
  auto out = multiprocess::run(3, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    bool refused = true;
    if (r == 2) refused = refuse_cross_memory_reads();
    s.set_string(fmt::format("refused/{}", r), refused ? "1" : "0");
    if (s.get_string("refused/2") != "1") {
      std::fprintf(stderr, "seccomp filters are refused here; skipping\n");
      return 0;
    }
    // all_reduce by cross-memory attach is opt-in (segment_options): turned on here.
    shm::communicator comm(
        shm::transport(s, r, n, {.segment = {.cross_memory_all_reduce_bytes = 4096}}));
    shm::communicator segment(shm::transport(s, r, n));
    for (int round = 0; round < 3; ++round) {
      // all_reduce first: its first large call finds out with a probe, before touching a buffer.
      const std::string bad_reduce = check_all_reduce<float>(comm, segment, 1 << 20, op::sum);
      check.expect(bad_reduce.empty(), fmt::format("round {}: {}", round, bad_reduce));
      const std::string bad = check_all_gather<float>(comm, 65537);
      check.expect(bad.empty(), fmt::format("round {}: {}", round, bad));
      const std::string bad_a2a = check_all_to_all<float>(comm, 65537);
      check.expect(bad_a2a.empty(), fmt::format("round {}: {}", round, bad_a2a));
    }
    return check.code();
  });
  require_all_passed(out);
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

TEST_CASE("a symmetric allocation a rank never joins times out naming that rank") {
  auto out = multiprocess::run(2, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    shm::communicator comm(shm::transport(s, r, n, {.timeout = 300ms}));
    if (r == 0) {
      try {
        (void)comm.allocate<float>(10);
        check.expect(false, "the allocation to time out");
      } catch (const ringzero::timeout_error& e) {
        check.expect(e.peer() == 1, fmt::format("peer() 1, got {}", e.peer()));
        check.expect(std::string(e.what()).find("waiting for rank 1") != std::string::npos,
                     fmt::format("the message to name rank 1: {}", e.what()));
      }
    }
    s.barrier("timed out", n);
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("a segment of one slot is refused") {
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

TEST_CASE("the segment's one-phase limit is the communicator's tuning; either way the same bits") {
  auto out = multiprocess::run(2, 300s, [&](int r, int n, ringzero::bootstrap::store& s) {
    ::unsetenv("RINGZERO_ALGO");
    ::unsetenv("RINGZERO_TUNING");
    rank_checks check{r};
    shm::communicator comm(shm::transport(s, r, n));
    // The phases a float all_reduce of `bytes` posted (one piece at these sizes).
    const auto phases_at = [&](std::size_t bytes) {
      std::vector<float> v(bytes / sizeof(float), static_cast<float>(r + 1));
      ringzero::all_reduce(comm, std::span<float>(v), op::sum);
      check.expect(std::all_of(v.begin(), v.end(), [](float x) { return x == 3.0f; }),
                   fmt::format("the sum at {} bytes", bytes));
      return comm.transport().segment_phases();
    };
    check.expect(phases_at(16 << 10) == 1, "the built-in rule: 16 KiB on 2 ranks in one phase");
    ringzero::tuning::policy p = comm.tuning();
    p.one_phase_bytes = 4096;
    p.one_phase_ranks = 2;
    comm.set_tuning(p);
    check.expect(phases_at(4096) == 1, "a tuned limit of 4 KiB: 4 KiB in one phase");
    check.expect(phases_at(8192) == 2, "a tuned limit of 4 KiB: 8 KiB in two");
    p.one_phase_ranks = 3;
    comm.set_tuning(p);
    check.expect(phases_at(8192) == 1, "a limit measured on 3 ranks leaves 2 ranks to the rule");
    p.one_phase_ranks = -1;
    bool refused = false;
    try {
      comm.set_tuning(p);
    } catch (const ringzero::invalid_argument& e) {
      refused = std::string(e.what()).find("one_phase_ranks = -1") != std::string::npos;
    }
    check.expect(refused, "set_tuning refuses a negative world size, naming the field");
    // The conformance matrix's automatic calls, every size in two phases, then in one.
    using phase_types = conformance::types<float, std::int8_t>;
    std::vector<conformance::test_case> cases;
    for (const auto& tc : conformance::matrix(n, false, phase_types::dtypes))
      if (tc.algo == ringzero::algorithm::automatic) cases.push_back(tc);
    for (std::size_t limit : {std::size_t{1}, std::size_t{1} << 40}) {
      p.one_phase_bytes = limit;
      p.one_phase_ranks = 0;
      comm.set_tuning(p);
      for (const auto& f : conformance::run_all<phase_types>(comm, cases))
        check.expect(false, fmt::format("one_phase_bytes {}: {}", limit, f));
    }
    return check.code();
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

TEST_CASE("a stalled rank (SIGSTOP): the others time out naming collective, sequence, step, peer") {
  // In the segment (automatic, 800 KB: every rank waits for rank 1's post) and over messages
  // (ring, 12 MB: chunks larger than a ring of slots). On the ring, rank 2 waits for rank 1 to
  // send; rank 0 for rank 1 to take its data, or for rank 2, held up by rank 1 in turn: each
  // says whom it waited for, and every one names the stopped rank 1 as the culprit (peer()), as
  // libfabric does; before, rank 0 blamed rank 2, which was only waiting too.
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
      // The rank waited for: rank 1 but on the ring's rank 0, which may wait for rank 2.
      const bool waited_for_1 = contains(what, "waiting for rank 1");
      check.expect(peer == 1, fmt::format("timeout_error::peer() == 1, got {}", peer));
      check.expect(
          contains(what, c.names) && contains(what, "sequence 1") && contains(what, "step ") &&
              (waited_for_1 || (!segment && r == 0 && contains(what, "waiting for rank 2"))) &&
              contains(what, "rank 1 is stopped (SIGSTOP or a debugger)"),
          fmt::format("a timeout naming {}, sequence 1, a step, the rank waited for and "
                      "the stopped rank 1, got '{}'",
                      c.names, what));
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

namespace {

/// Rank r's term of element i for the reproducible sums below: ordinary values of every scale,
/// pairs 2^200 apart (wider than the pass adds in double), cancellation, subnormals and now and
/// then an infinity or a NaN, so that the segment's exact sums take every path of the pass.
[[nodiscard]] float exact_term(int r, std::size_t i) {
  std::uint64_t h =
      (i + 1) * 0x9E3779B97F4A7C15ull ^ (static_cast<std::uint64_t>(r) + 1) * 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  h *= 0x94D049BB133111EBull;
  h ^= h >> 32;
  const auto unit = static_cast<float>(static_cast<std::int64_t>(h % 2000001) - 1000000) * 1e-6f;
  switch (i % 16) {
    case 11:  // 2^100 and -2^100 with small terms between: heavy cancellation, a wide span
      return r == 0 ? 0x1p100f : r == 1 ? -0x1p100f : std::ldexp(unit, -100);
    case 12:  // subnormal
      return std::ldexp(static_cast<float>(h % 4096), -149);
    case 13:  // ties of averages: small integers
      return static_cast<float>(h % 7);
    case 14:
      if (i % 64 == 14 && r == 1) return std::numeric_limits<float>::infinity();
      if (i % 128 == 30 && r == 0) return std::numeric_limits<float>::quiet_NaN();
      return unit;
    default:
      return std::ldexp(unit, static_cast<int>(h >> 40) % 24 - 12);
  }
}

/// Whether `got` holds, bit for bit, the exact sum (avg: divided by the ranks) of exact_term over
/// the ranks for elements first .. first + got.size(); the first wrong element otherwise.
[[nodiscard]] std::string check_exact(std::span<const float> got, std::size_t first, int n, op o,
                                      const std::string& what) {
  std::vector<float> terms(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < got.size(); ++i) {
    for (int q = 0; q < n; ++q) terms[static_cast<std::size_t>(q)] = exact_term(q, first + i);
    const float want = ringzero::reproducible::serial_sum(
        terms.data(), terms.size(), static_cast<std::uint32_t>(o == op::avg ? n : 1));
    if (std::bit_cast<std::uint32_t>(want) != std::bit_cast<std::uint32_t>(got[i]))
      return fmt::format("{}: element {} is {:a}, the exact sum is {:a}", what, first + i, got[i],
                         want);
  }
  return {};
}

/// all_gather and all_to_all calls on comm so far: the reproducible path over messages makes
/// them; the segment's exact sums do not.
[[nodiscard]] std::uint64_t message_path_calls(shm::communicator& comm) {
  std::uint64_t calls = 0;
  for (const auto& k : ringzero::trace::counters(comm))
    if (k.kind == ringzero::collective::all_gather || k.kind == ringzero::collective::all_to_all)
      calls += k.calls;
  return calls;
}

/// Reproducible float all_reduce and reduce_scatter (sum and avg, in place and out of place,
/// counts across the one-shot and block-per-rank modes) and all_reduce on symmetric buffers:
/// every element bitwise serial_sum's, every call in the segment.
[[nodiscard]] int check_exact_segment(int r, int n, ringzero::bootstrap::store& s,
                                      std::size_t workspace_bytes) {
  ::unsetenv("RINGZERO_ALGO");
  rank_checks check{r};
  shm::segment_options seg;
  if (workspace_bytes > 0) seg.workspace_bytes = workspace_bytes;
  shm::communicator comm(shm::transport(s, r, n, {.segment = seg}));
  ringzero::options opt;
  opt.reproducible = true;
  const auto un = static_cast<std::size_t>(n);
  const std::uint64_t before = message_path_calls(comm);
  for (const op o : {op::sum, op::avg}) {
    for (const std::size_t count :
         std::initializer_list<std::size_t>{0, 1, 7, 100, 1000, 1031, 4099, 70001}) {
      for (const bool in_place : {false, true}) {
        const std::string what = fmt::format("all_reduce {} of {} floats{}", ringzero::op_name(o),
                                             count, in_place ? " in place" : "");
        std::vector<float> in(count), out(count, -1.0f);
        for (std::size_t i = 0; i < count; ++i) in[i] = exact_term(r, i);
        if (in_place) {
          ringzero::all_reduce(comm, std::span<float>(in), o, opt);
          out = in;
        } else {
          ringzero::all_reduce(comm, std::span<const float>(in), std::span<float>(out), o, opt);
        }
        const std::string bad = check_exact(out, 0, n, o, what);
        check.expect(bad.empty(), bad);
      }
    }
    for (const std::size_t block : std::initializer_list<std::size_t>{0, 1, 7, 333, 4099}) {
      for (const bool in_place : {false, true}) {
        const std::string what =
            fmt::format("reduce_scatter {} of {} floats a rank{}", ringzero::op_name(o), block,
                        in_place ? " in place" : "");
        std::vector<float> in(block * un), out(block, -1.0f);
        for (std::size_t i = 0; i < in.size(); ++i) in[i] = exact_term(r, i);
        const std::size_t mine = static_cast<std::size_t>(r) * block;
        if (in_place) {
          ringzero::reduce_scatter(comm, std::span<const float>(in),
                                   std::span<float>(in.data() + mine, block), o, opt);
          std::copy(in.begin() + static_cast<std::ptrdiff_t>(mine),
                    in.begin() + static_cast<std::ptrdiff_t>(mine + block), out.begin());
        } else {
          ringzero::reduce_scatter(comm, std::span<const float>(in), std::span<float>(out), o, opt);
        }
        const std::string bad = check_exact(out, mine, n, o, what);
        check.expect(bad.empty(), bad);
      }
    }
  }
  // Symmetric buffers: the peers' inputs are read in place, one mapping's stride apart.
  for (const std::size_t count : std::initializer_list<std::size_t>{1000, 70001}) {
    auto in = comm.allocate<float>(count);
    auto res = comm.allocate<float>(count);
    for (const bool in_place : {false, true}) {
      for (std::size_t i = 0; i < count; ++i) in.local()[i] = exact_term(r, i);
      const std::span<float> dst = in_place ? in.local() : res.local();
      ringzero::all_reduce(comm, std::span<const float>(in.local()), dst, op::sum, opt);
      const std::string bad = check_exact(
          dst, 0, n, op::sum,
          fmt::format("all_reduce of {} symmetric floats{}", count, in_place ? " in place" : ""));
      check.expect(bad.empty(), bad);
      ringzero::barrier(comm);
    }
  }
  check.expect(message_path_calls(comm) == before,
               "every reproducible call ran in the segment, none over messages");
  // A rank that asks for the plain sum meets the others' exact one in the segment: every rank
  // raises, naming the difference.
  std::vector<float> v(1000, 1.0f);
  ringzero::options odd = opt;
  odd.reproducible = r != 1;
  odd.timeout = 20s;
  std::string what;
  try {
    ringzero::all_reduce(comm, std::span<float>(v), op::sum, odd);
  } catch (const ringzero::mismatch_error& e) {
    what = e.what();
  }
  check.expect(contains(what, "reproducible"),
               fmt::format("a mismatch_error naming the reproducible sum, got '{}'", what));
  return check.code();
}

}  // namespace

TEST_CASE("reproducible float sums in the segment: serial_sum's bits, no message") {
  // 2, 3 and 4 ranks with the default workspace; 3 with 256-byte buffers, so that every call
  // takes several pieces.
  struct setup {
    int ranks;
    std::size_t workspace;
  };
  for (const setup& t : {setup{2, 0}, setup{3, 0}, setup{4, 0}, setup{3, 256}}) {
    const int ranks = t.ranks;
    const std::size_t workspace = t.workspace;
    CAPTURE(ranks);
    CAPTURE(workspace);
    auto out = multiprocess::run(ranks, 300s, [&](int r, int n, ringzero::bootstrap::store& s) {
      return check_exact_segment(r, n, s, workspace);
    });
    require_all_passed(out);
  }
}

TEST_CASE("the segment's exact sum: terms one stride apart, or anywhere") {
  // exact_float_sum reads the ranks' terms in place where they lie one stride apart (the
  // segment's buffers and symmetric memory always do) and copies them side by side otherwise.
  // Both ways, and for one rank, in place too: serial_sum's bits.
  constexpr std::size_t n = 1031;
  for (const int ranks : {1, 2, 3, 5}) {
    const auto ur = static_cast<std::size_t>(ranks);
    for (const op o : {op::sum, op::avg}) {
      CAPTURE(ranks);
      CAPTURE(ringzero::op_name(o));
      const shm::detail::exact_float_sum exact{
          static_cast<std::uint32_t>(o == op::avg ? ranks : 1)};
      // One stride apart (n + 3 floats), and each rank's terms in a vector of its own.
      std::vector<float> laid(ur * (n + 3));
      std::vector<std::vector<float>> apart(ur, std::vector<float>(n));
      for (std::size_t r = 0; r < ur; ++r)
        for (std::size_t i = 0; i < n; ++i)
          laid[r * (n + 3) + i] = apart[r][i] = exact_term(static_cast<int>(r), i);
      std::vector<float> from_laid(n), from_apart(n);
      exact(
          ranks, [&](int q) { return laid.data() + static_cast<std::size_t>(q) * (n + 3); },
          from_laid.data(), n);
      exact(
          ranks, [&](int q) { return apart[static_cast<std::size_t>(q)].data(); },
          from_apart.data(), n);
      std::string bad = check_exact(from_laid, 0, ranks, o, "one stride apart");
      CHECK_MESSAGE(bad.empty(), bad);
      bad = check_exact(from_apart, 0, ranks, o, "apart");
      CHECK_MESSAGE(bad.empty(), bad);
      // In place: the output is rank 0's terms.
      exact(
          ranks, [&](int q) { return laid.data() + static_cast<std::size_t>(q) * (n + 3); },
          laid.data(), n);
      bad = check_exact(std::span<const float>(laid.data(), n), 0, ranks, o, "in place");
      CHECK_MESSAGE(bad.empty(), bad);
    }
  }
}
