// Faults on the libfabric transport that a single process can stage: abort() from another
// thread, a rank that stalls (SIGSTOP), and the watchdog's culprit finding. A rank SIGKILLed in the
// middle of a collective is tried by kill_trials.py, over whole programs, with and without
// ringzero-run.
#include <doctest/doctest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/core.h>

#include "multiprocess.hpp"
#include "ringzero/ringzero.hpp"
#include "ringzero/transport/libfabric.hpp"

using namespace std::chrono_literals;
using ringzero::op;
namespace fabric = ringzero::libfabric;
using multiprocess::contains;
using multiprocess::rank_checks;
using multiprocess::require_all_passed;

namespace {

const char* const providers[] = {"shm", "tcp;ofi_rxm"};

}  // namespace

TEST_CASE("abort() from another thread unblocks a waiting collective and every later call") {
  for (const char* provider : providers) {
    CAPTURE(provider);
    auto out = multiprocess::run(2, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
      rank_checks check{r};
      fabric::communicator comm(fabric::transport(s, r, n, {.provider = provider, .timeout = 30s}));
      if (r == 1) {
        // Never joins: rank 0's collective can only end through abort().
        s.barrier("rank 0 done", 2);
        return 0;
      }
      std::vector<float> v(100000, 1.0f);
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
      check.expect(contains(again, "aborted"), "a call after abort() to fail as aborted too");
      // A call with nothing to send never waits: the communicator itself must refuse it.
      std::string empty;
      try {
        ringzero::all_reduce(comm, std::span<float>(), op::sum);
      } catch (const ringzero::peer_error& e) {
        empty = e.what();
      }
      check.expect(contains(empty, "aborted"), "an empty call after abort() to fail as aborted");
      s.barrier("rank 0 done", 2);
      return check.code();
    });
    require_all_passed(out);
  }
}

TEST_CASE("a stalled rank (SIGSTOP): the others time out naming collective, sequence, step, peer") {
  for (const char* provider : providers) {
    CAPTURE(provider);
    auto out = multiprocess::run(3, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
      rank_checks check{r};
      fabric::communicator comm(fabric::transport(s, r, n, {.provider = provider, .timeout = 2s}));
      std::vector<float> v(200000, 1.0f);
      const ringzero::options ring{.algorithm = ringzero::algorithm::ring};
      // The first call opens the connections: under ThreadSanitizer on a busy machine it can take
      // longer than the 2 s the stalled call below is meant to wait, so it gets its own deadline.
      ringzero::all_reduce(comm, std::span<float>(v), op::sum,
                           {.algorithm = ringzero::algorithm::ring, .timeout = 60s});
      if (r == 1) {
        s.set_string("pid/1", std::to_string(::getpid()));
        ::raise(SIGSTOP);
        return 0;  // continued once the others are done
      }
      // RINGZERO_DEBUG=INFO: the pending operations go to the log, which this rank reads back.
      std::string what;
      int peer = -2;
      const std::string log = multiprocess::capture_info_log("stall", [&] {
        try {
          ringzero::all_reduce(comm, std::span<float>(v), op::sum, ring);
        } catch (const ringzero::timeout_error& e) {
          what = e.what();
          peer = e.peer();
        }
      });
      // The wait that gives up is on rank 1, or on a neighbour that waits on it: a send to
      // the stopped rank completes once the provider has buffered it (tcp;ofi_rxm sends
      // eagerly, into the socket), and the wait is then on the receive from rank 2. Either way
      // the error names rank 1, as the peer and as stopped.
      check.expect(
          contains(what, "all_reduce (ring)") && contains(what, "sequence 1") &&
              contains(what, "step ") &&
              (contains(what, "waiting for rank 1") ||
               (contains(what, "waiting for rank 2") && contains(what, "rank 1 is stopped"))),
          fmt::format("a timeout naming all_reduce, sequence 1, a step and rank 1, got "
                      "'{}'",
                      what));
      check.expect(peer == 1, fmt::format("timeout_error::peer() == 1, got {}", peer));
      check.expect(
          contains(log, "pending operations when a wait gave up") && contains(log, "sequence 1"),
          fmt::format("the log to list the pending operations, got '{}'", log));
      s.barrier("survivors done", 2);
      if (r == 0) ::kill(std::stoi(s.get_string("pid/1")), SIGCONT);
      return check.code();
    });
    require_all_passed(out);
  }
}

TEST_CASE("a rank found dead is named by waits on other ranks, and failed_rank() says so") {
  for (const char* provider : providers) {
    CAPTURE(provider);
    auto out = multiprocess::run(3, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
      rank_checks check{r};
      fabric::communicator comm(fabric::transport(s, r, n, {.provider = provider, .timeout = 20s}));
      std::vector<float> v(1000, 1.0f);
      ringzero::all_reduce(comm, std::span<float>(v), op::sum);
      if (r == 2) std::_Exit(0);  // gone without a word, as a killed rank
      const auto start = std::chrono::steady_clock::now();
      while (comm.failed_rank() < 0 && std::chrono::steady_clock::now() - start < 5s)
        std::this_thread::sleep_for(5ms);
      check.expect(comm.failed_rank() == 2,
                   fmt::format("failed_rank() == 2, got {}", comm.failed_rank()));
      // Ranks 0 and 1 both live: a point-to-point wait between them still fails, naming 2.
      std::string what;
      int culprit = -2;
      std::vector<std::byte> buf(64);
      try {
        auto req = r == 0 ? comm.irecv(1, 7, buf) : comm.irecv(0, 7, buf);
        while (!comm.test(req)) {
        }
      } catch (const ringzero::peer_error& e) {
        what = e.what();
        culprit = e.peer();
      }
      check.expect(culprit == 2 && contains(what, "rank 2 died"),
                   fmt::format("a peer_error naming rank 2, got rank {}: '{}'", culprit, what));
      check.expect(std::chrono::steady_clock::now() - start < 10s, "the error within seconds");
      return check.code();
    });
    INFO(out.describe());
    CHECK(out.status[0] == 0);
    CHECK(out.status[1] == 0);
    CHECK_FALSE(out.timed_out);
  }
}

TEST_CASE(
    "after a rank of this host died, nothing is sent to it and shm endpoints close without "
    "the provider") {
  // An elastic survivor closes its endpoint while forming the next generation; over shm, a call
  // into the region of a rank that died holding its lock never returns, and the watchdog ended
  // the survivor (exit 70). Now a send to a rank found gone is not posted, and the shm endpoint
  // is left to the process once a rank of this host died: the survivors go on to a new
  // communicator.
  auto out = multiprocess::run(3, 90s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    std::string log;
    {
      fabric::communicator comm(fabric::transport(s, r, n, {.provider = "shm", .timeout = 20s}));
      std::vector<float> v(1000, 1.0f);
      ringzero::all_reduce(comm, std::span<float>(v), op::sum);
      if (r == 2) std::_Exit(0);  // gone without a word, as a killed rank
      const auto start = std::chrono::steady_clock::now();
      while (comm.failed_rank() < 0 && std::chrono::steady_clock::now() - start < 5s)
        std::this_thread::sleep_for(5ms);
      std::string what;
      const std::vector<std::byte> word(8);
      try {
        auto req = comm.isend(2, 9, word);
        while (!comm.test(req)) {
        }
      } catch (const ringzero::peer_error& e) {
        what = e.what();
      }
      check.expect(contains(what, "rank 2"),
                   fmt::format("a send to rank 2 fails naming it, got '{}'", what));
      log = multiprocess::capture_info_log("fabric-left-open", [&] {
        fabric::communicator gone = std::move(comm);
        static_cast<void>(gone);
      });
    }
    check.expect(contains(log,
                          "a rank of this host died or is stopped: the shm endpoints are left "
                          "open"),
                 fmt::format("teardown without the provider, got '{}'", log));
    // The survivors form a world of their own and go on.
    fabric::communicator comm(fabric::transport(s, r, 2, {.provider = "shm", .timeout = 20s}));
    std::vector<float> v(1000, static_cast<float>(r + 1));
    ringzero::all_reduce(comm, std::span<float>(v), op::sum);
    check.expect(v.front() == 3.0f && v.back() == 3.0f, "the sum 1 + 2 in the next world");
    return check.code();
  });
  INFO(out.describe());
  CHECK(out.status[0] == 0);
  CHECK(out.status[1] == 0);
  CHECK_FALSE(out.timed_out);
}

// SIGKILL during hierarchical all_reduces whose node level runs over the native shm transport
// (two "nodes" of two ranks on this host, each with a host name of its own). Its neighbour on
// the node, waiting on it over shm, fails within a second with a peer_error naming it in the
// parent's numbering, as libfabric names a dead rank. The other node's ranks wait on it (or on
// its neighbour, gone after its error) across nodes over tcp;ofi_rxm, where a peer on another
// host is found dead only by the deadline: they must fail with a ringzero error by then, not hang.
TEST_CASE("a rank SIGKILLed during a hierarchical all_reduce with shm inside the node is named") {
  constexpr int victim = 1;
  constexpr auto deadline = 8s;
  auto out = multiprocess::run(4, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
    if (!multiprocess::become_host(fmt::format("ringzero-node-{}", r / 2)))
      return multiprocess::rank_skipped;
    rank_checks check{r};
    fabric::communicator comm(
        fabric::transport(s, r, n, {.provider = "tcp;ofi_rxm", .timeout = deadline}));
    const ringzero::options hier{.algorithm = ringzero::algorithm::hierarchical};
    std::vector<float> v(1 << 16, 1.0f);
    ringzero::all_reduce(comm, std::span<float>(v), op::sum, hier);
    check.expect(comm.hierarchy() && comm.hierarchy()->node, "a node level over shm");
    if (r == victim) {
      std::this_thread::sleep_for(100ms);  // the others are inside the next all_reduce by now
      ::raise(SIGKILL);
    }
    const auto start = std::chrono::steady_clock::now();
    std::string what;
    int culprit = -2;
    bool failed = false;
    try {
      for (;;) ringzero::all_reduce(comm, std::span<float>(v), op::sum, hier);
    } catch (const ringzero::peer_error& e) {
      what = e.what();
      culprit = e.peer();
      failed = true;
    } catch (const ringzero::error& e) {
      what = e.what();
      failed = true;
    }
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    check.expect(failed, "a ringzero error");
    if (r == 0) {
      check.expect(
          culprit == victim && contains(what, fmt::format("rank {} died", victim)),
          fmt::format("a peer_error naming rank {}, got rank {}: '{}'", victim, culprit, what));
      check.expect(took < 3, fmt::format("the error within 3 s, took {:.1f} s", took));
    } else {
      check.expect(took < std::chrono::duration<double>(deadline).count() + 5,
                   fmt::format("the error by the deadline, took {:.1f} s: '{}'", took, what));
    }
    return check.code();
  });
  if (std::count(out.status.begin(), out.status.end(), multiprocess::rank_skipped) == 4) {
    MESSAGE("skipped: ranks cannot have host names of their own here (needs CAP_SYS_ADMIN)");
    return;
  }
  INFO(out.describe());
  CHECK(out.status[victim] == -SIGKILL);
  for (int r = 0; r < 4; ++r)
    if (r != victim) CHECK(out.status[static_cast<std::size_t>(r)] == 0);
  CHECK_FALSE(out.timed_out);
}

// A peer on another host sends a message the survivor has not asked for yet, then dies. Over
// tcp;ofi_rxm, past 16 KiB, libfabric 1.17 sent it by rendezvous: the survivor kept the
// announcement, closed the dead peer's connection, and when it then posted the receive, read
// the message through the closed connection's null endpoint (SIGSEGV inside fi_cq_read, 1 to 2
// kill trials in 100). Ringzero makes ofi_rxm send every message eagerly (rail.hpp,
// rxm_eager_by_default): the survivor gets either the whole message or an error naming the dead
// rank, and lives. The ranks have host names of their own, so that the watchdog cannot see the
// death through /proc and stop the survivor before the provider does.
// FI_OFI_RXM_EAGER_LIMIT=16384 brings the rendezvous back, and the crash with it.
TEST_CASE("a message announced by a peer that then died is received or named, never a crash") {
  constexpr std::size_t bytes = 1 << 20;
  constexpr std::uint64_t tag = 5;
  auto out = multiprocess::run(2, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
    if (!multiprocess::become_host(fmt::format("ringzero-node-{}", r)))
      return multiprocess::rank_skipped;
    rank_checks check{r};
    fabric::communicator comm(
        fabric::transport(s, r, n, {.provider = "tcp;ofi_rxm", .timeout = 5s}));
    ringzero::barrier(comm);  // both connected
    std::vector<std::byte> buf(bytes);
    if (r == 1) {
      std::fill(buf.begin(), buf.end(), std::byte{0x5a});
      auto req = comm.isend(0, tag, buf);
      // Until the message is on its way (eager: handed to the socket; rendezvous: announced),
      // then gone without a word.
      const auto start = std::chrono::steady_clock::now();
      while (!comm.test(req) && std::chrono::steady_clock::now() - start < 300ms) {
      }
      std::_Exit(0);
    }
    // The survivor lets the provider see the message and then the closed connection, before
    // it asks for the message: progress on a receive of another tag.
    std::this_thread::sleep_for(300ms);
    std::vector<std::byte> other(8);
    std::string what;
    int culprit = -2;
    bool received = false;
    try {
      auto probe = comm.irecv(1, tag + 1, other);
      const auto start = std::chrono::steady_clock::now();
      while (std::chrono::steady_clock::now() - start < 300ms && !comm.test(probe)) {
      }
      auto req = comm.irecv(1, tag, buf);
      while (!comm.test(req)) {
      }
      received = true;
    } catch (const ringzero::peer_error& e) {
      what = e.what();
      culprit = e.peer();
    } catch (const ringzero::error& e) {
      what = e.what();
    }
    if (received)
      check.expect(
          std::all_of(buf.begin(), buf.end(), [](std::byte b) { return b == std::byte{0x5a}; }),
          "the message received whole");
    else
      check.expect(culprit == 1,
                   fmt::format("a peer_error naming rank 1, got rank {}: '{}'", culprit, what));
    return check.code();
  });
  if (std::count(out.status.begin(), out.status.end(), multiprocess::rank_skipped) == 2) {
    MESSAGE("skipped: ranks cannot have host names of their own here (needs CAP_SYS_ADMIN)");
    return;
  }
  INFO(out.describe());
  CHECK(out.status[0] == 0);
  CHECK_FALSE(out.timed_out);
}

// abort() from another thread reaches a rank blocked in the node level over shm (rank 0, whose
// neighbour on the node has not started the collective) as well as ranks blocked across nodes.
TEST_CASE("abort() releases a hierarchical all_reduce blocked in its node level over shm") {
  auto out = multiprocess::run(4, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
    if (!multiprocess::become_host(fmt::format("ringzero-node-{}", r / 2)))
      return multiprocess::rank_skipped;
    rank_checks check{r};
    fabric::communicator comm(
        fabric::transport(s, r, n, {.provider = "tcp;ofi_rxm", .timeout = 30s}));
    const ringzero::options hier{.algorithm = ringzero::algorithm::hierarchical};
    std::vector<float> v(1 << 12, 1.0f);
    ringzero::all_reduce(comm, std::span<float>(v), op::sum, hier);
    ringzero::barrier(comm);
    if (r == 1) {
      std::this_thread::sleep_for(1s);  // never joins: rank 0 waits on it over shm
      return check.code();
    }
    std::thread stopper([&] {
      std::this_thread::sleep_for(200ms);
      comm.abort("stopped by the test");
    });
    const auto start = std::chrono::steady_clock::now();
    std::string what;
    try {
      ringzero::all_reduce(comm, std::span<float>(v), op::sum, hier);
    } catch (const ringzero::peer_error& e) {
      what = e.what();
    }
    stopper.join();
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    check.expect(contains(what, "stopped by the test"),
                 fmt::format("a peer_error carrying the reason, got '{}'", what));
    check.expect(took < 10, fmt::format("released within 10 s, took {:.1f} s", took));
    return check.code();
  });
  if (std::count(out.status.begin(), out.status.end(), multiprocess::rank_skipped) == 4) {
    MESSAGE("skipped: ranks cannot have host names of their own here (needs CAP_SYS_ADMIN)");
    return;
  }
  require_all_passed(out);
}

TEST_CASE("failure board: the first failure on record is every rank's verdict") {
  namespace rfd = ringzero::libfabric::detail;
  auto store = std::make_shared<ringzero::bootstrap::tcp_store>("127.0.0.1", 0, true, 1, "t", 5s);
  rfd::failure_board b0(store, "job/", 0, true);
  rfd::failure_board b1(store, "job/", 1, true);
  rfd::failure_board b3(store, "job/", 3, true);
  // Rank 1 sees rank 2 die first; rank 0 later finds rank 1 gone (it raised and exited):
  // both name rank 2.
  const auto first = b1.settle(2, "its process (pid 42) is gone");
  CHECK(first.rank == 2);
  CHECK(contains(first.why, "pid 42"));
  CHECK(contains(first.why, "found by rank 1"));
  const auto later = b0.settle(1, "its connection failed");
  CHECK(later.rank == 2);
  CHECK(later.why == first.why);
  // On a board with no failure, a rank that marked its exit is not blamed.
  rfd::failure_board c0(store, "other/", 0, true);
  rfd::failure_board c3(store, "other/", 3, true);
  c3.leaving();
  CHECK(c0.settle(3, "its process (pid 7) is gone").rank == -1);
  CHECK(c0.settle(2, "its process (pid 8) is gone").rank == 2);
  CHECK(b3.settle(1, "x").rank == 2);
}

namespace {
// A store whose server is gone, as when rank 0, which serves it, was killed.
class gone_store final : public ringzero::bootstrap::store {
 public:
  void set(std::string_view, std::span<const std::byte>) override { fail(); }
  std::vector<std::byte> get(std::string_view) override { fail(); }
  std::int64_t add(std::string_view, std::int64_t) override { fail(); }
  void wait(std::span<const std::string>) override { fail(); }

 private:
  [[noreturn]] static void fail() {
    throw ringzero::peer_error("store: rank 0's store closed the connection", 0);
  }
};
}  // namespace

TEST_CASE("failure board: an unreachable store falls back to what the rank saw, and says so") {
  namespace rfd = ringzero::libfabric::detail;
  auto store = std::make_shared<gone_store>();
  // Served by rank 0: its store going away names rank 0.
  const auto v = rfd::failure_board(store, "job/", 2, true).settle(1, "its connection failed");
  CHECK(v.rank == 0);
  CHECK(contains(v.why, "unreachable"));
  CHECK(contains(v.why, "rank 1 fail"));
  // Served elsewhere: the rank's own finding, marked as unchecked.
  const auto w = rfd::failure_board(store, "job/", 2, false).settle(1, "its connection failed");
  CHECK(w.rank == 1);
  CHECK(contains(w.why, "not checked against the other ranks"));
}

TEST_CASE("a survivor that exits after the first death is not named by a rank that looks late") {
  // Rank 0 is stopped while rank 2 dies and rank 1, having seen it, exits; rank 0 then finds
  // both gone at once. Its own view cannot order them; the store's record does.
  for (const char* provider : providers) {
    CAPTURE(provider);
    auto out = multiprocess::run(3, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
      rank_checks check{r};
      const std::shared_ptr<ringzero::bootstrap::store> kept(&s, [](auto*) {});
      fabric::communicator comm(
          fabric::transport(kept, r, n, {.provider = provider, .timeout = 20s}));
      std::vector<float> v(1000, 1.0f);
      ringzero::all_reduce(comm, std::span<float>(v), op::sum);
      if (r == 0) s.set_string("test/pid0", std::to_string(::getpid()));
      if (r == 1) {
        const pid_t pid0 = static_cast<pid_t>(std::stol(s.get_string("test/pid0")));
        ::kill(pid0, SIGSTOP);
        s.set_string("test/stopped", "1");
        const auto start = std::chrono::steady_clock::now();
        while (comm.failed_rank() < 0 && std::chrono::steady_clock::now() - start < 10s)
          std::this_thread::sleep_for(5ms);
        // Rank 0 resumes only once this rank is gone too, from a helper process.
        const pid_t self = ::getpid();
        if (::fork() == 0) {
          while (::getppid() == self) std::this_thread::sleep_for(5ms);
          std::this_thread::sleep_for(50ms);
          ::kill(pid0, SIGCONT);
          std::_Exit(0);
        }
        std::_Exit(comm.failed_rank() == 2 ? 0 : 3);  // gone at once, as a survivor that raised
      }
      if (r == 2) {
        static_cast<void>(s.get_string("test/stopped"));
        std::_Exit(0);  // the first death
      }
      // Rank 0, resumed with ranks 1 and 2 both gone.
      const auto start = std::chrono::steady_clock::now();
      while (comm.failed_rank() < 0 && std::chrono::steady_clock::now() - start < 10s)
        std::this_thread::sleep_for(5ms);
      check.expect(comm.failed_rank() == 2,
                   fmt::format("failed_rank() == 2, got {}", comm.failed_rank()));
      return check.code();
    });
    INFO(out.describe());
    CHECK(out.status[0] == 0);
    CHECK(out.status[1] == 0);
    CHECK_FALSE(out.timed_out);
  }
}

TEST_CASE("calls on a moved-from communicator fail with invalid_argument") {
  auto out = multiprocess::run(1, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    fabric::communicator comm(fabric::transport(s, r, n, {.provider = "shm"}));
    fabric::communicator other(std::move(comm));
    std::vector<float> v(8, 1.0f);
    std::string what;
    try {
      ringzero::all_reduce(comm, std::span<float>(v), op::sum);  // NOLINT(bugprone-use-after-move)
      what = "no error";
    } catch (const ringzero::invalid_argument& e) {
      what = e.what();
    }
    check.expect(contains(what, "moved from"),
                 fmt::format("an error saying moved from, got '{}'", what));
    std::string aborted;
    try {
      comm.abort("too late");  // NOLINT(bugprone-use-after-move)
    } catch (const ringzero::invalid_argument& e) {
      aborted = e.what();
    }
    check.expect(contains(aborted, "abort()") && contains(aborted, "moved from"),
                 fmt::format("abort() on it to say moved from, got '{}'", aborted));
    check.expect(comm.failed_rank() == -1, "failed_rank() == -1 on a moved-from communicator");
    ringzero::all_reduce(other, std::span<float>(v), op::sum);
    check.expect(v[0] == 1.0f, "the communicator moved to to work");
    return check.code();
  });
  require_all_passed(out);
}

namespace {
// The handlers as static initialization left them, before doctest installs its own for the
// signals it reports (SIGTERM among them) around each test case. Defined after the transport's
// header, so initialized after its reset.
const std::vector<const void*> handlers_at_start = [] {
  std::vector<const void*> h;
  for (const int sig : fabric::detail::psm_signals) h.push_back(fabric::detail::handler_of(sig));
  return h;
}();
}  // namespace

TEST_CASE("libfabric's PSM providers leave no signal handler behind (a SIGTERM must end a rank)") {
  namespace d = fabric::detail;
  CHECK(d::is_psm_library("/usr/lib/x86_64-linux-gnu/libinfinipath.so.4"));
  CHECK(d::is_psm_library("libpsm_infinipath.so.1"));
  CHECK(d::is_psm_library("/lib/libpsm2.so.2"));
  CHECK_FALSE(d::is_psm_library("/usr/lib/libfabric.so.1"));
  CHECK_FALSE(d::is_psm_library(""));
  // Where libfabric links PSM (Debian 12), its constructor installed handlers for all of these
  // before main; none may be left.
  REQUIRE(handlers_at_start.size() == std::size(d::psm_signals));
  for (std::size_t i = 0; i < handlers_at_start.size(); ++i) {
    INFO("signal " << d::psm_signals[i] << "'s handler is in "
                   << d::object_of(handlers_at_start[i]));
    CHECK_FALSE(d::is_psm_library(d::object_of(handlers_at_start[i])));
  }
  CHECK(d::psm_signal_handlers_reset >= 0);
}
