// The conformance suite every messaging transport runs (transport_conformance_test.cpp): the
// matrix of conformance_matrix.hpp and the behaviours transport/concept.hpp promises, each
// written once over a transport factory. A factory says how to open a world of n ranks (threads
// of this process, or processes forked by multiprocess.hpp), its name, and what it can do where
// transports legitimately differ (whether a send dropped while under way still arrives, how a
// dead rank is simulated and detected).
//
// A rank's body returns its exit code and reports failures with multiprocess::rank_checks, in
// threads as in processes: doctest's checks do not travel back across fork, and the same body
// must run in both.
#pragma once

#include <doctest/doctest.h>
#include <signal.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/core.h>

// libfabric joins the suite where the program links ringzero::libfabric, which links its
// collectives' instances (tests/CMakeLists.txt) and so defines this.
#if defined(RINGZERO_TEST_INSTANCES_LIBFABRIC) && !defined(RINGZERO_SUITE_WITH_LIBFABRIC)
#define RINGZERO_SUITE_WITH_LIBFABRIC 1
#endif

// The communicators with collectives of their own first: the conformance matrix's qualified
// calls must see them.
#include "ringzero/transport/shm/communicator.hpp"
#include "ringzero/transport/socket.hpp"
#ifdef RINGZERO_SUITE_WITH_LIBFABRIC
#include "ringzero/transport/libfabric.hpp"
#endif

#include "checks.hpp"
#include "conformance_matrix.hpp"
#include "lazy_transport.hpp"
#include "mailbox_rail.hpp"
#include "multiprocess.hpp"
#include "ringzero/ringzero.hpp"
#include "ringzero/transport/detail/striping.hpp"
#include "sanitized.hpp"

namespace suite {

using namespace std::chrono_literals;
using multiprocess::contains;
using multiprocess::rank_checks;
using ringzero::op;

using test_support::sanitized;

/// What a rank's body has besides its communicator: a meeting point and flags outside the
/// transport (the store, or shared memory of threads), and a way to die as a killed process does.
struct rank_context {
  int rank = 0;
  int size = 1;
  std::function<void(const std::string&)> meet;
  std::function<void(const std::string&)> raise_flag;
  std::function<bool(const std::string&)> flag_raised;  // without blocking
  std::function<void()> die;
};

/// How the sender of a message its receiver posted with the wrong size sees it.
enum class sender_sees { success, failure, either };

// --- the factories ------------------------------------------------------------------------------
// Each: name; in_process; the transport and how to make one rank of it; matrix_types (what the
// matrix compiles) and matrix_runs_automatic (whether automatic is a path of its own rather
// than one of the algorithms it resolves to); destroyed_send_arrives; death_signal (the status
// of a killed rank) and death_count (floats per all_reduce around the death); big_bytes (the
// cancelled and the truncated messages); transport_checks_peers (the transport itself refuses
// a peer that is not another rank); mismatch_sender, and whether a receive too short for its
// message learns the message's size (truncation_names_sent_size); automatic_wait_says (what an
// aborted wait of the world's automatic all_reduce names, "" for nothing particular).

/// Threads of one process over the loopback transport.
struct loopback {
  static constexpr const char* name = "loopback";
  static constexpr bool in_process = true;
  using transport = ringzero::loopback::transport;
  using matrix_types = conformance::every_type;
  static constexpr bool matrix_runs_automatic = false;
  static constexpr bool destroyed_send_arrives = false;
  static constexpr int death_signal = SIGKILL;
  static constexpr std::size_t death_count = 3000000;
  static constexpr std::size_t big_bytes = 3 << 20;
  static constexpr bool transport_checks_peers = false;
  static constexpr sender_sees mismatch_sender = sender_sees::failure;
  static constexpr bool truncation_names_sent_size = true;
  static constexpr const char* automatic_wait_says = "";

  using world = std::shared_ptr<ringzero::loopback::detail::shared_state>;
  static world make_world(int n) {
    return std::make_shared<ringzero::loopback::detail::shared_state>(n);
  }
  static transport make(const world& w, int r, std::chrono::nanoseconds timeout) {
    return transport(w, r, {.timeout = timeout});
  }
  static void fail(const world& w, int r, const std::string& why) {
    static std::mutex m;
    std::lock_guard lock(m);
    if (w->failed_rank.load() >= 0) return;
    w->failure = why;
    w->failed_rank.store(r);
  }
};

/// Threads over the lazy transport (tests/support/lazy_transport.hpp). The matrix compiles one
/// type of one byte and one of four: every message size class, at a fraction of the compile
/// time of all ten.
struct lazy {
  static constexpr const char* name = "lazy";
  static constexpr bool in_process = true;
  using transport = ringzero::testing::lazy::transport;
  using matrix_types = conformance::types<std::int8_t, float>;
  static constexpr bool matrix_runs_automatic = false;
  static constexpr bool destroyed_send_arrives = false;
  static constexpr int death_signal = SIGKILL;
  static constexpr std::size_t death_count = 300000;
  static constexpr std::size_t big_bytes = 3 << 20;
  static constexpr bool transport_checks_peers = false;
  static constexpr sender_sees mismatch_sender = sender_sees::failure;
  static constexpr bool truncation_names_sent_size = true;
  static constexpr const char* automatic_wait_says = "";

  using world = std::shared_ptr<ringzero::testing::lazy::detail::shared_state>;
  static world make_world(int n) {
    return std::make_shared<ringzero::testing::lazy::detail::shared_state>(n);
  }
  static transport make(const world& w, int r, std::chrono::nanoseconds timeout) {
    return transport(w, r, {.timeout = timeout});
  }
  static void fail(const world& w, int r, const std::string& why) {
    ringzero::testing::lazy::fail(*w, r, why);
  }
};

/// Threads over the tests' own rail kind (support/mailbox_rail.hpp) under the kit's rail engine:
/// one rail, every message acknowledged as the socket transport's are. A rail kind is all it
/// adds, and it passes what every transport does.
struct mailbox {
  static constexpr const char* name = "mailbox";
  static constexpr bool in_process = true;
  using transport = ringzero::testing::mailbox::transport;
  using matrix_types = conformance::types<std::int8_t, float>;
  static constexpr bool matrix_runs_automatic = false;
  static constexpr bool destroyed_send_arrives = true;
  static constexpr int death_signal = SIGKILL;
  static constexpr std::size_t death_count = 300000;
  static constexpr std::size_t big_bytes = 3 << 20;
  static constexpr bool transport_checks_peers = true;
  static constexpr sender_sees mismatch_sender = sender_sees::success;
  static constexpr bool truncation_names_sent_size = true;
  static constexpr const char* automatic_wait_says = "";
  static ringzero::testing::mailbox::options options() { return {.rails = 1}; }

  using world = std::shared_ptr<ringzero::testing::mailbox::post_office>;
  static world make_world(int n) {
    return std::make_shared<ringzero::testing::mailbox::post_office>(n, options().rails);
  }
  static transport make(const world& w, int r, std::chrono::nanoseconds timeout) {
    auto opt = options();
    opt.timeout = timeout;
    return transport(w, r, opt);
  }
  static void fail(const world& w, int r, const std::string& why) { w->deaths()->died(r, why); }
};

/// The mailbox on three rails whose pieces carry their offset (as the socket transport's do),
/// every message of 1 KiB or more striped.
struct mailbox_rails : mailbox {
  static constexpr const char* name = "mailbox rails";
  static ringzero::testing::mailbox::options options() {
    return {.rails = 3, .places_pieces = true, .stripe_bytes = 1024};
  }
  static world make_world(int n) {
    return std::make_shared<ringzero::testing::mailbox::post_office>(n, options().rails);
  }
  static transport make(const world& w, int r, std::chrono::nanoseconds timeout) {
    auto opt = options();
    opt.timeout = timeout;
    return transport(w, r, opt);
  }
};

/// The mailbox on three rails whose receives take exact pieces, cut alike at both ends (as
/// libfabric's are), striped from 512 bytes. A receive cut short learns the size of the piece it
/// got, not of the message.
struct mailbox_agreed : mailbox {
  static constexpr const char* name = "mailbox agreed";
  static constexpr bool truncation_names_sent_size = false;
  static ringzero::testing::mailbox::options options() {
    return {.rails = 3, .places_pieces = false, .stripe_bytes = 512};
  }
  static world make_world(int n) {
    return std::make_shared<ringzero::testing::mailbox::post_office>(n, options().rails);
  }
  static transport make(const world& w, int r, std::chrono::nanoseconds timeout) {
    auto opt = options();
    opt.timeout = timeout;
    return transport(w, r, opt);
  }
};

/// Processes over the native shm transport. automatic is the segment path
/// (transport/shm/detail/collectives.hpp), not one of the message algorithms.
struct shm {
  static constexpr const char* name = "shm";
  static constexpr bool in_process = false;
  using transport = ringzero::shm::transport;
  using matrix_types = conformance::every_type;
  static constexpr bool matrix_runs_automatic = true;
  static constexpr const char* automatic_wait_says = "shm segment";
  static constexpr bool destroyed_send_arrives = true;
  static constexpr int death_signal = SIGKILL;
  static constexpr std::size_t death_count = 3000000;  // chunks far larger than a ring of slots
  static constexpr std::size_t big_bytes = 3 << 20;
  static constexpr bool transport_checks_peers = false;
  static constexpr sender_sees mismatch_sender = sender_sees::success;
  static constexpr bool truncation_names_sent_size = true;

  static transport make(ringzero::bootstrap::store& s, int r, int n,
                        std::chrono::nanoseconds timeout) {
    return transport(s, r, n, {.timeout = timeout});
  }
  static ringzero::communicator<transport> from_env() {
    return ringzero::communicator<transport>::from_env();
  }
};

/// Processes over the socket transport on one loopback rail.
struct socket {
  static constexpr const char* name = "socket";
  static constexpr bool in_process = false;
  using transport = ringzero::socket::transport;
  using matrix_types = conformance::every_type;
  static constexpr bool matrix_runs_automatic = false;
  static constexpr const char* automatic_wait_says = "";
  static constexpr bool destroyed_send_arrives = true;
  static constexpr int death_signal = SIGKILL;
  static constexpr std::size_t death_count = 3000000;
  static constexpr std::size_t big_bytes = 3 << 20;
  static constexpr bool transport_checks_peers = true;
  static constexpr sender_sees mismatch_sender = sender_sees::success;
  static constexpr bool truncation_names_sent_size = true;
  static ringzero::socket::options options() { return {}; }

  static transport make(ringzero::bootstrap::store& s, int r, int n,
                        std::chrono::nanoseconds timeout) {
    auto opt = options();
    opt.timeout = timeout;
    return transport(s, r, n, opt);
  }
  static ringzero::communicator<transport> from_env() {
    return ringzero::communicator<transport>::from_env(options());
  }
};

/// The socket transport over three rails (loopback addresses 127.0.0.1-3), with a stripe size
/// small enough that the matrix's messages are cut.
struct socket_rails : socket {
  static constexpr const char* name = "socket rails";
  static ringzero::socket::options options() {
    return {.rails = {"127.0.0.1", "127.0.0.2", "127.0.0.3"}, .stripe_bytes = 1024};
  }
  static transport make(ringzero::bootstrap::store& s, int r, int n,
                        std::chrono::nanoseconds timeout) {
    auto opt = options();
    opt.timeout = timeout;
    return transport(s, r, n, opt);
  }
  static ringzero::communicator<transport> from_env() {
    return ringzero::communicator<transport>::from_env(options());
  }
};

#ifdef RINGZERO_SUITE_WITH_LIBFABRIC
/// Processes over libfabric. Its cancelled and truncated messages stay small: libfabric 1.17's
/// shm provider spins forever when a truncated message larger than 4 KiB (sent by
/// process_vm_readv) does not fit. A rank dies by SIGTERM, not SIGKILL: the shm provider's
/// handler then removes its shared-memory region, which would otherwise outlive the test; its
/// survivors may learn of it only at the deadline (RINGZERO_TIMEOUT=2 in that check).
template <const char* Provider, const char* Name>
struct libfabric_over {
  static constexpr const char* name = Name;
  static constexpr bool in_process = false;
  using transport = ringzero::libfabric::transport;
  using matrix_types = conformance::every_type;
  static constexpr bool matrix_runs_automatic = false;
  static constexpr bool destroyed_send_arrives = false;
  static constexpr int death_signal = SIGTERM;
  static constexpr std::size_t death_count = 300000;
  static constexpr std::size_t big_bytes = 1000;
  static constexpr bool transport_checks_peers = false;
  // After a truncation tcp;ofi_rxm (1.17) loses the pair's later messages, and what the sender
  // sees differs by provider: only the receiver's error is checked.
  static constexpr sender_sees mismatch_sender = sender_sees::either;
  // Its provider reports a truncation without the size of the message.
  static constexpr bool truncation_names_sent_size = false;
  static constexpr const char* automatic_wait_says = "";

  static transport make(ringzero::bootstrap::store& s, int r, int n,
                        std::chrono::nanoseconds timeout) {
    return transport(s, r, n, {.provider = Provider, .timeout = timeout});
  }
  static ringzero::communicator<transport> from_env() {
    return ringzero::communicator<transport>::from_env({.provider = Provider});
  }
};
inline constexpr char provider_shm[] = "shm";
inline constexpr char provider_tcp[] = "tcp;ofi_rxm";
inline constexpr char name_shm[] = "libfabric shm";
inline constexpr char name_tcp[] = "libfabric tcp";
using libfabric_shm = libfabric_over<provider_shm, name_shm>;
using libfabric_tcp = libfabric_over<provider_tcp, name_tcp>;
/// tcp;ofi_rxm on two rails, both on loopback (two endpoints, address vectors and registration
/// caches under one engine): a rail added by configuration, with the engine unchanged, passes
/// everything one rail does.
struct libfabric_rails : libfabric_tcp {
  static constexpr const char* name = "libfabric rails";
  static ringzero::libfabric::options options(std::chrono::nanoseconds timeout = {}) {
    // Striped from 512 bytes: the matrix's larger counts and the suite's 1000-byte messages
    // travel in pieces over both rails, its smaller ones whole.
    return {
        .provider = provider_tcp, .timeout = timeout, .rails = {"lo", "lo"}, .stripe_bytes = 512};
  }
  static transport make(ringzero::bootstrap::store& s, int r, int n,
                        std::chrono::nanoseconds timeout) {
    return transport(s, r, n, options(timeout));
  }
  static ringzero::communicator<transport> from_env() {
    return ringzero::communicator<transport>::from_env(options());
  }
};
/// tcp;ofi_rxm on three rails on loopback, for the rail that fails (rail_failover): one can
/// fail and two are left, so "the others" means something.
struct libfabric_failover : libfabric_rails {
  static constexpr const char* name = "libfabric failover";
  static ringzero::libfabric::options options(std::chrono::nanoseconds timeout = {}) {
    return {.provider = provider_tcp,
            .timeout = timeout,
            .rails = {"lo", "lo", "lo"},
            .stripe_bytes = 512};
  }
  static transport make(ringzero::bootstrap::store& s, int r, int n,
                        std::chrono::nanoseconds timeout) {
    return transport(s, r, n, options(timeout));
  }
};
#endif

// --- running a world ----------------------------------------------------------------------------

namespace detail {

/// Thrown by rank_context::die() in a thread: the rank ends as if killed.
struct rank_died {};

/// Named barriers of n threads, each name used once, and named flags.
class meeting {
 public:
  explicit meeting(int n) : n_(n) {}
  void meet(const std::string& name) {
    std::unique_lock lock(m_);
    if (++arrived_[name] == n_) cv_.notify_all();
    cv_.wait(lock, [&] { return arrived_[name] >= n_; });
  }
  void raise_flag(const std::string& name) {
    std::lock_guard lock(m_);
    ++flags_[name];
  }
  bool flag_raised(const std::string& name) {
    std::lock_guard lock(m_);
    return flags_[name] > 0;
  }

 private:
  int n_;
  std::mutex m_;
  std::condition_variable cv_;
  std::map<std::string, int> arrived_, flags_;
};

template <class F, class Body>
multiprocess::outcome run_threads(int n, std::chrono::nanoseconds timeout, Body& body) {
  auto world = F::make_world(n);
  meeting meet(n);
  multiprocess::outcome out;
  out.status.assign(static_cast<std::size_t>(n), 0);
  auto rank = [&](int r) {
    auto& status = out.status[static_cast<std::size_t>(r)];
    try {
      ringzero::communicator<typename F::transport> comm(F::make(world, r, timeout));
      rank_context ctx{r,
                       n,
                       [&](const std::string& name) { meet.meet(name); },
                       [&](const std::string& name) { meet.raise_flag(name); },
                       [&](const std::string& name) { return meet.flag_raised(name); },
                       [] { throw rank_died{}; }};
      status = body(comm, ctx);
    } catch (const rank_died&) {
      F::fail(world, r, "killed by the test");
      status = -F::death_signal;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      F::fail(world, r, e.what());
      status = 1;
    }
  };
  std::vector<std::thread> threads;
  for (int r = 1; r < n; ++r) threads.emplace_back(rank, r);
  rank(0);
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace detail

/// Runs body(comm, ctx) -> exit code on each of n ranks of F, within `limit` (processes are
/// killed past it; threads end by the communicator's deadline, `timeout`, or RINGZERO_TIMEOUT
/// when 0).
template <class F, class Body>
multiprocess::outcome run(int n, std::chrono::seconds limit, Body body,
                          std::chrono::nanoseconds timeout = {}) {
  if constexpr (F::in_process) {
    return detail::run_threads<F>(n, timeout, body);
  } else {
    return multiprocess::run(n, limit, [&](int r, int size, ringzero::bootstrap::store& s) {
      ringzero::communicator<typename F::transport> comm(F::make(s, r, size, timeout));
      rank_context ctx{r,
                       size,
                       [&](const std::string& name) { s.barrier(name, size); },
                       [&](const std::string& name) { (void)s.add(name, 1); },
                       [&](const std::string& name) { return s.add(name, 0) > 0; },
                       [] { ::raise(F::death_signal); }};
      return body(comm, ctx);
    });
  }
}

// --- the matrix ---------------------------------------------------------------------------------

// The element type matters to a transport only through the message sizes it makes, and the
// reductions are the same code whatever the transport (tests/algorithms covers every type). So
// 2 ranks run all ten types, more ranks one type of each size, and sanitizer builds, where each
// message costs several times more, one type, which is also all they compile; every
// collective, algorithm, op, placement and count runs in all of them.
template <class F>
using matrix_types =
    std::conditional_t<sanitized, conformance::types<float>, typename F::matrix_types>;

template <class F, class Comm>
[[nodiscard]] std::vector<std::string> run_matrix(Comm& comm) {
  using ringzero::dtype;
  using types_list = matrix_types<F>;
  static constexpr dtype each_size[] = {dtype::int8, dtype::bfloat16, dtype::float32,
                                        dtype::float64};
  std::span<const dtype> types = types_list::dtypes;
  if constexpr (std::is_same_v<types_list, conformance::every_type>)
    types = comm.size() == 2 ? std::span<const dtype>(ringzero::all_dtypes)
                             : std::span<const dtype>(each_size);
  std::vector<conformance::test_case> cases;
  for (const auto& tc : conformance::matrix(comm.size(), false, types))
    if (F::matrix_runs_automatic || tc.algo != ringzero::algorithm::automatic) cases.push_back(tc);
  auto failures = conformance::run_all<types_list>(comm, cases);
  if (comm.rank() == 0)
    std::fprintf(stderr, "%s, %d ranks: %zu cases, %zu failures\n", F::name, comm.size(),
                 cases.size(), failures.size());
  return failures;
}

/// The matrix on n ranks. Under a launcher (ringzero-run, as CTest runs the process transports'
/// matrices where it is built) this process is one rank and joins through from_env();
/// otherwise the ranks are forked or started here.
template <class F>
void conformance_over(int n) {
  if constexpr (!F::in_process) {
    if (ringzero::detail::getenv_str("RANK") && ringzero::detail::getenv_str("WORLD_SIZE")) {
      auto comm = F::from_env();
      REQUIRE(comm.size() == n);
      for (const auto& f : run_matrix<F>(comm)) FAIL_CHECK(f);
      return;
    }
  }
  auto out = run<F>(n, 300s, [&](auto& comm, rank_context&) {
    const auto failures = run_matrix<F>(comm);
    for (const auto& f : failures) std::fprintf(stderr, "%s\n", f.c_str());
    return failures.empty() ? 0 : 1;
  });
  multiprocess::require_all_passed(out);
}

// --- the behaviours -----------------------------------------------------------------------------

/// Blocks on q, as an algorithm does, for at most 60 s.
template <class Comm, class Q>
void drive(Comm& comm, Q& q, int peer) {
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!comm.test(q))
    if (std::chrono::steady_clock::now() > deadline) throw ringzero::timeout_error("stuck", peer);
}

/// Splits of the world keep their messages apart from the world's and each other's, on the
/// transport they share; hierarchical on one node falls back to a flat algorithm.
template <class F>
void sub_communicators() {
  auto out = run<F>(4, 120s, [](auto& comm, rank_context& ctx) {
    const int r = ctx.rank;
    rank_checks check{r};
    const auto t = comm.topo();
    check.expect(t.node_count == 1 && t.local_size == 4 && t.local_rank == r,
                 "one node holding all four ranks, in rank order");
    auto half = comm.split(r % 2, -r);  // keys reverse the order inside each half
    check.expect(half && half->size() == 2, "a 2-rank half");
    check.expect(half->rank() == (r < 2 ? 1 : 0), "ranks ordered by descending world rank");
    check.expect(half->comm_id() != 0, "an id other than the world's");
    auto most = comm.split(r == 3 ? -1 : 0, r);
    check.expect(r == 3 ? !most : most && most->size() == 3, "rank 3 left out of 'most'");
    // The halves run their collective before or after the world's: messages cross.
    std::vector<double> world_v(30000, r + 1.0), half_v(30000, 10.0 * (r + 1));
    if (r % 2 == 0) {
      ringzero::all_reduce(*half, std::span<double>(half_v), op::sum);
      ringzero::all_reduce(comm, std::span<double>(world_v), op::sum);
    } else {
      ringzero::all_reduce(comm, std::span<double>(world_v), op::sum);
      ringzero::all_reduce(*half, std::span<double>(half_v), op::sum);
    }
    check.expect(world_v[0] == 10.0 && world_v[29999] == 10.0, "the world sum 1+2+3+4");
    check.expect(
        half_v[0] == (r % 2 == 0 ? 40.0 : 60.0) && half_v[29999] == (r % 2 == 0 ? 40.0 : 60.0),
        "the sum over this half");
    if (most) {
      std::vector<int> v{r};
      ringzero::all_reduce(*most, std::span<int>(v), op::max);
      check.expect(v[0] == 2, "max over ranks 0..2");
    }
    std::vector<float> h(1001, 1.0f);
    ringzero::all_reduce(comm, std::span<float>(h), op::sum,
                         {.algorithm = ringzero::algorithm::hierarchical});
    check.expect(h[0] == 4.0f && h[1000] == 4.0f, "hierarchical all_reduce on one node");
    return check.code();
  });
  multiprocess::require_all_passed(out);
}

/// A receive destroyed before its message was sent is withdrawn: the message goes to the next
/// receive, and the first buffer is never written. Where the transport promises it, a send
/// destroyed right after it was posted still delivers the bytes it was posted with.
template <class F>
void cancel_on_destroy() {
  auto out = run<F>(2, 120s, [](auto& comm, rank_context& ctx) {
    const int r = ctx.rank;
    rank_checks check{r};
    std::vector<std::uint8_t> payload(F::big_bytes);
    for (std::size_t i = 0; i < payload.size(); ++i)
      payload[i] = static_cast<std::uint8_t>(1 + i % 251);
    std::vector<std::uint8_t> abandoned(payload.size(), 0), fresh(payload.size(), 0);
    if (r == 0) {
      { auto req = comm.irecv(1, 5, std::as_writable_bytes(std::span<std::uint8_t>(abandoned))); }
      // Only now may the peer send: the message must go to the second receive.
      ringzero::barrier(comm);
      auto req = comm.irecv(1, 5, std::as_writable_bytes(std::span<std::uint8_t>(fresh)));
      drive(comm, req, 1);
      check.expect(fresh == payload, "the message in the receive posted after the cancel");
      check.expect(std::all_of(abandoned.begin(), abandoned.end(), [](auto b) { return b == 0; }),
                   "the cancelled receive's buffer untouched");
      if constexpr (F::destroyed_send_arrives) {
        // Larger than a ring of slots, dropped after its start; its buffer is then freed.
        auto big = std::vector<std::uint8_t>(payload.size(), 0x3c);
        { auto q = comm.isend(1, 6, std::as_bytes(std::span<const std::uint8_t>(big))); }
        std::fill(big.begin(), big.end(), 0x00);
      }
    } else {
      ringzero::barrier(comm);
      auto req = comm.isend(0, 5, std::as_bytes(std::span<const std::uint8_t>(payload)));
      drive(comm, req, 0);
      if constexpr (F::destroyed_send_arrives) {
        auto q = comm.irecv(0, 6, std::as_writable_bytes(std::span<std::uint8_t>(fresh)));
        drive(comm, q, 0);
        check.expect(std::all_of(fresh.begin(), fresh.end(), [](auto b) { return b == 0x3c; }),
                     "the whole of the abandoned send, as it was posted");
      }
    }
    ringzero::barrier(comm);
    return check.code();
  });
  multiprocess::require_all_passed(out);
}

/// 400 messages in flight each way, 0-70 KB (across every eager/rendezvous switch), every tag
/// twice: matched by tag and, within a tag, in posting order, whatever order they arrive in.
/// Rank 0 posts its receives before its sends, rank 1 after: both orders of arrival.
template <class F>
void ordering() {
  auto out = run<F>(2, 120s, [](auto& comm, rank_context& ctx) {
    const int r = ctx.rank;
    rank_checks check{r};
    constexpr int count = 400;
    const int peer = 1 - r;
    auto size_of = [](int i) { return static_cast<std::size_t>((i * 7919) % 70000); };
    auto tag_of = [](int i) { return static_cast<ringzero::tag_t>(i / 2); };
    std::vector<std::vector<std::uint8_t>> out_bufs(count), in_bufs(count);
    using request = typename std::remove_reference_t<decltype(comm)>::request;
    std::vector<request> reqs;
    auto post_recvs = [&] {
      for (int i = 0; i < count; ++i) {
        in_bufs[std::size_t(i)].assign(size_of(i), 0);
        reqs.push_back(comm.irecv(peer, tag_of(i),
                                  std::as_writable_bytes(std::span(in_bufs[std::size_t(i)]))));
      }
    };
    if (r == 0) post_recvs();
    // Tags in reverse order, the two messages of a tag in order.
    for (int pair = count / 2 - 1; pair >= 0; --pair)
      for (const int i : {2 * pair, 2 * pair + 1}) {
        out_bufs[std::size_t(i)].assign(size_of(i), static_cast<std::uint8_t>(i + r));
        reqs.push_back(comm.isend(
            peer, tag_of(i), std::as_bytes(std::span(std::as_const(out_bufs[std::size_t(i)])))));
      }
    if (r == 1) post_recvs();
    for (auto& q : reqs) drive(comm, q, peer);
    int wrong = 0;
    for (int i = 0; i < count; ++i) {
      const auto& b = in_bufs[std::size_t(i)];
      wrong += !std::all_of(b.begin(), b.end(),
                            [&](auto x) { return x == static_cast<std::uint8_t>(i + peer); });
    }
    check.expect(wrong == 0, fmt::format("every message intact and in its receive, {} not", wrong));
    return check.code();
  });
  multiprocess::require_all_passed(out);
}

/// A receive shorter or longer than its message fails, naming the peer and both sizes.
template <class F>
void size_mismatch() {
  auto out = run<F>(2, 120s, [](auto& comm, rank_context& ctx) {
    const int r = ctx.rank;
    rank_checks check{r};
    constexpr std::size_t small_bytes = 100;
    std::vector<std::byte> small(small_bytes), big(F::big_bytes);
    if (r == 1) {
      auto shorter = comm.isend(0, 8, std::span<const std::byte>(small));
      auto longer = comm.isend(0, 7, std::span<const std::byte>(big));
      // Progress is manual: the sender drives its sends until they leave.
      for (auto* q : {&shorter, &longer}) {
        std::string what;
        try {
          drive(comm, *q, 0);
        } catch (const ringzero::error& e) {
          what = e.what();
        }
        if constexpr (F::mismatch_sender == sender_sees::success)
          check.expect(what.empty(), fmt::format("the send to complete, got '{}'", what));
        if constexpr (F::mismatch_sender == sender_sees::failure)
          check.expect(contains(what, "rank 0"),
                       fmt::format("an error naming rank 0, got '{}'", what));
      }
      // Meet outside the transport: after a truncation some providers lose the pair's later
      // messages.
      ctx.raise_flag("sent");
      ctx.meet("checked");
      return check.code();
    }
    auto expect_mismatch = [&](ringzero::tag_t tag, std::span<std::byte> buf, std::size_t sent) {
      auto q = comm.irecv(1, tag, buf);
      std::string what;
      try {
        drive(comm, q, 1);
      } catch (const ringzero::transport_error& e) {
        what = e.what();
      }
      const bool names_sent = contains(what, fmt::format(" {} byte", sent)) ||
                              (!F::truncation_names_sent_size && sent > buf.size());
      check.expect(contains(what, "rank 1") && names_sent &&
                       contains(what, fmt::format(" {} byte", buf.size())),
                   fmt::format("a transport_error naming rank 1, {} and {} bytes, got '{}'", sent,
                               buf.size(), what));
    };
    expect_mismatch(8, std::span<std::byte>(big), small_bytes);
    expect_mismatch(7, std::span<std::byte>(small), big.size());
    // The rest of the longer message may still be on its way (or its acknowledgement): the
    // sender's send completes only while this side makes progress.
    while (!ctx.flag_raised("sent")) {
      comm.progress();
      std::this_thread::sleep_for(1ms);
    }
    ctx.meet("checked");
    return check.code();
  });
  multiprocess::require_all_passed(out);
}

/// A rank that dies mid-run (SIGKILL, or an exception on a thread) is named by every
/// survivor's error, within seconds and well before the deadline.
template <class F>
void dead_peer() {
  // A long deadline: the survivors must not wait for it. libfabric's may learn of the death only
  // at the deadline, so it gets a short one, and its timeout_error must name the rank.
  const bool by_deadline = F::death_signal == SIGTERM;
  test_support::scoped_env deadline("RINGZERO_TIMEOUT", by_deadline ? "2" : "60");
  auto out = run<F>(3, 120s, [](auto& comm, rank_context& ctx) {
    const int r = ctx.rank;
    rank_checks check{r};
    const ringzero::options ring{.algorithm = ringzero::algorithm::ring};
    // In the ring, rank 2 waits to receive from rank 1 and rank 0 for rank 1 to take its chunks,
    // which are above every transport's eager size: both wait on rank 1 itself.
    std::vector<float> v(F::death_count, 1.0f);
    ringzero::all_reduce(comm, std::span<float>(v), op::sum, ring);
    check.expect(v.front() == 3.0f && v.back() == 3.0f, "the sum before the death");
    // Every rank done with it first: threads' transports fail every wait once a rank died, not
    // only those on it.
    ctx.meet("summed");
    if (r == 1) ctx.die();
    int named = -2;
    std::string what;
    const auto start = std::chrono::steady_clock::now();
    try {
      for (int i = 0; i < 3; ++i) ringzero::all_reduce(comm, std::span<float>(v), op::sum, ring);
    } catch (const ringzero::peer_error& e) {
      named = e.peer();
      what = e.what();
    } catch (const ringzero::timeout_error& e) {
      if (F::death_signal == SIGTERM) {
        named = e.peer();
        what = e.what();
      }
    }
    const auto took = std::chrono::steady_clock::now() - start;
    check.expect(named == 1 && contains(what, "rank 1"),
                 fmt::format("an error naming rank 1, got rank {}: '{}'", named, what));
    check.expect(took < 10s, fmt::format("the error within seconds, got {:.2f} s",
                                         std::chrono::duration<double>(took).count()));
    return check.code();
  });
  INFO(out.describe());
  CHECK(out.status[0] == 0);
  CHECK(out.status[1] == -F::death_signal);
  CHECK(out.status[2] == 0);
  CHECK_FALSE(out.timed_out);
}

/// abort() from another thread releases a wait at once, on the world (automatic and a forced
/// ring) and on a split (abort() is always the world's), with the reason given; every call
/// after it fails at once, isend included.
template <class F>
void abort_unblocks() {
  enum class mode { automatic, ring, split };
  for (const mode m : {mode::automatic, mode::ring, mode::split}) {
    CAPTURE(static_cast<int>(m));
    auto out = run<F>(
        2, 60s,
        [m](auto& comm, rank_context& ctx) {
          const int r = ctx.rank;
          rank_checks check{r};
          auto sub = comm.split(0, r);
          std::vector<float> v(100000, 1.0f);
          // Whatever the first call sets up exists: rank 0's next call waits in a step.
          ringzero::all_reduce(comm, std::span<float>(v), op::sum);
          if (r == 1) {
            // Never joins: rank 0's collective can only end through abort().
            ctx.meet("rank 0 done");
            return 0;
          }
          auto& target = m == mode::split ? *sub : comm;
          const ringzero::options opt{.algorithm = m == mode::ring
                                                       ? ringzero::algorithm::ring
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
          check.expect(m != mode::automatic || contains(what, F::automatic_wait_says),
                       fmt::format("the wait aborted to be the one in '{}', got '{}'",
                                   F::automatic_wait_says, what));
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
          ctx.meet("rank 0 done");
          return check.code();
        },
        30s);
    multiprocess::require_all_passed(out);
  }
}

/// A peer that is not another rank is refused, naming it, before anything is posted: the
/// communicator still works after.
template <class F>
void bad_arguments() {
  auto out = run<F>(2, 60s, [](auto& comm, rank_context& ctx) {
    const int r = ctx.rank;
    rank_checks check{r};
    std::byte b{};
    const std::span<const std::byte> one(&b, 1);
    const auto refusal = [&](auto&& call) {
      try {
        call();
      } catch (const ringzero::invalid_argument& e) {
        return std::string(e.what());
      }
      return std::string();
    };
    for (const int peer : {r, -1, 2}) {
      const auto what = refusal([&] { (void)comm.isend(peer, 1, one); });
      check.expect(contains(what, fmt::format("peer {}", peer)),
                   fmt::format("isend to {}: an invalid_argument naming it, got '{}'", peer, what));
    }
    const auto recv = refusal([&] { (void)comm.irecv(2, 1, {}); });
    check.expect(contains(recv, "peer 2"), "irecv from 2: an invalid_argument naming it");
    if constexpr (F::transport_checks_peers) {
      const auto what = refusal([&] { (void)comm.transport().isend(r, 1, one); });
      check.expect(contains(what, "peer"),
                   fmt::format("the transport's isend to itself refused, got '{}'", what));
    }
    std::vector<std::int32_t> v(37, r + 1);
    ringzero::all_reduce(comm, std::span<std::int32_t>(v), op::sum);
    check.expect(v.front() == 3 && v.back() == 3, "an all_reduce after the refusals");
    return check.code();
  });
  multiprocess::require_all_passed(out);
}

/// One rail of three fails under traffic, through the kit's hook (transport().fail_rail, as a
/// link found down would): a striped message under way arrives whole; collectives go on over the
/// rails left, bitwise as before, and the failed rail carries none of them; messages with one
/// tag keep their order across a failover, small sends that completed on return going again from
/// the engine's copies; once the last rail fails, both ranks' next call fails naming the peer
/// and its last rail. Written once, run over every network transport's rails.
template <class F>
void rail_failover() {
  auto out = run<F>(2, 180s, [](auto& comm, rank_context& ctx) {
    const int r = ctx.rank;
    const int peer = 1 - r;
    rank_checks check{r};
    auto& t = comm.transport();
    const auto& eng = t.engine();
    check.expect(eng.rails() == 3, fmt::format("three rails, got {}", eng.rails()));
    if (eng.rails() != 3) return check.code();
    const auto settled = [&](auto&& done) {
      const auto until = std::chrono::steady_clock::now() + 10s;
      while (!done() && std::chrono::steady_clock::now() < until) t.progress();
      return done();
    };
    const auto value = [](int m, std::size_t i) {
      return static_cast<std::uint8_t>(m * 37 + (i >> 6));
    };
    {
      // Rails up on every rail first (ofi_rxm connects on first use): a striped message each way.
      std::vector<std::byte> a(300 << 10), b(300 << 10);
      auto q1 = comm.isend(peer, 1, a);
      auto q2 = comm.irecv(peer, 1, b);
      drive(comm, q1, peer);
      drive(comm, q2, peer);
    }

    // 1. A striped message under way when rail 1 fails: its piece there goes over the others.
    constexpr std::size_t count = std::size_t{8} << 20;
    std::vector<std::uint8_t> data(count);
    for (std::size_t i = 0; i < count; ++i) data[i] = value(1, i);
    const auto first_failure = [&] {
      if (r == 0) {
        auto q = comm.isend(1, 2, std::as_bytes(std::span<const std::uint8_t>(data)));
        for (int i = 0; i < 3; ++i)
          if (comm.test(q)) break;
        t.fail_rail(1, "the test pulled it");
        drive(comm, q, 1);
      } else {
        std::vector<std::uint8_t> in(count, 0);
        auto q = comm.irecv(0, 2, std::as_writable_bytes(std::span<std::uint8_t>(in)));
        drive(comm, q, 0);
        check.expect(in == data, "the striped message whole and unchanged");
      }
      // The message may be whole before this side hears of the failure.
      check.expect(settled([&] { return !eng.rail_in_use(peer, 1); }),
                   "rail 1 given up toward the peer on both sides");
    };
    if constexpr (F::in_process) {
      first_failure();
    } else {
      const std::string log = multiprocess::capture_info_log("rail-failover", first_failure);
      const std::string warned = fmt::format(
          "rail {} failed toward rank {} ({})", eng.rail_name(1), peer,
          r == 0 ? std::string("the test pulled it") : fmt::format("rank {} gave it up", peer));
      check.expect(contains(log, warned) && contains(log, "and the others left"),
                   fmt::format("a warning naming the failed rail, got '{}'", log));
    }
    check.expect(eng.rail_in_use(peer, 0) && eng.rail_in_use(peer, 2), "rails 0 and 2 kept");

    // 2. Collectives go on over the two left, bitwise as before, and rail 1 carries none.
    const auto before = eng.rail_messages(1);
    std::vector<float> v(1 << 20), want(1 << 20);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.25f * static_cast<float>(i % 1000 + r);
    for (std::size_t i = 0; i < v.size(); ++i)
      want[i] = 0.25f * static_cast<float>(i % 1000) + 0.25f * static_cast<float>(i % 1000 + 1);
    ringzero::all_reduce(comm, std::span<float>(v), op::sum);
    check.expect(v == want, "an all_reduce over the remaining rails");
    check.expect(eng.rail_messages(1) == before,
                 fmt::format("nothing more on rail 1, got {} more", eng.rail_messages(1) - before));

    // 3. Messages with one tag keep their order across a failover of their rail (rail 0): those
    // sent before it, waiting unmatched on the failed rail, go again, and those sent after it
    // wait for them. Copied (256 B: under every factory's stripe size), acknowledged whole or
    // striped (100 KiB), striped (300 KiB), in turn.
    ringzero::tag_t tag = 7;
    while (ringzero::detail::rail_for(tag, 3) != 0) ++tag;
    constexpr int messages = 12;
    const auto size = [](int m) {
      return std::array<std::size_t, 3>{256, 100 << 10, 300 << 10}[static_cast<std::size_t>(m % 3)];
    };
    if (r == 0) {
      std::vector<std::vector<std::uint8_t>> src(messages);
      for (int m = 0; m < messages; ++m)
        for (std::size_t i = 0; i < size(m); ++i)
          src[static_cast<std::size_t>(m)].push_back(value(m, i));
      check.expect(settled([&] { return ctx.flag_raised("posted nothing"); }), "rank 1 ready");
      using request = typename std::remove_reference_t<decltype(comm)>::request;
      std::vector<request> sends;
      const auto send = [&](int m) {
        sends.push_back(comm.isend(
            1, tag,
            std::as_bytes(std::span<const std::uint8_t>(src[static_cast<std::size_t>(m)]))));
      };
      for (int m = 0; m < messages / 3; ++m) send(m);
      // Small sends complete on return, copied: what goes again must be the copies.
      check.expect(comm.test(sends[0]), "a small send complete at once");
      std::fill(src[0].begin(), src[0].end(), std::uint8_t{0xEE});
      check.expect(settled([&] { return eng.waiting_operations() == 0; }),
                   "the first messages on their way");
      t.fail_rail(0, "the test pulled it");
      for (int m = messages / 3; m < messages; ++m) send(m);
      for (auto& q : sends) drive(comm, q, 1);
    } else {
      ctx.raise_flag("posted nothing");
      check.expect(settled([&] { return !eng.rail_in_use(0, 0); }),
                   "rank 1 heard that the tag's rail failed");
      std::vector<std::vector<std::uint8_t>> in(messages);
      using request = typename std::remove_reference_t<decltype(comm)>::request;
      std::vector<request> recvs;
      for (int m = 0; m < messages; ++m) {
        auto& buf = in[static_cast<std::size_t>(m)];
        buf.assign(size(m), 0);
        recvs.push_back(comm.irecv(0, tag, std::as_writable_bytes(std::span<std::uint8_t>(buf))));
      }
      for (auto& q : recvs) drive(comm, q, 0);
      std::size_t wrong = 0;
      for (int m = 0; m < messages; ++m)
        for (std::size_t i = 0; i < size(m); ++i)
          wrong += in[static_cast<std::size_t>(m)][i] != value(m, i);
      check.expect(wrong == 0, fmt::format("every message in its place, {} bytes wrong", wrong));
    }

    // 4. The last rail fails, seen from both ends as a link found down is: both ranks' next call
    // fails naming the peer and its last rail. First everything sent so far is acknowledged (a
    // small send completes on return): a rank that failed its rails before its last message left
    // would keep it, and the peer would wait for it instead.
    ringzero::barrier(comm);
    check.expect(settled([&] { return eng.unacknowledged(peer) == 0; }),
                 "everything acknowledged before the last rail fails");
    ctx.raise_flag(fmt::format("quiet {}", r));
    check.expect(settled([&] { return ctx.flag_raised(fmt::format("quiet {}", peer)); }),
                 "both quiet");
    t.fail_rail(2, "the test pulled it");
    // Both failed it before either calls: a rank that had failed and left first would be seen
    // to close its transport instead.
    ctx.raise_flag(fmt::format("failed {}", r));
    check.expect(settled([&] { return ctx.flag_raised(fmt::format("failed {}", peer)); }),
                 "both failed the last rail");
    int named = -2;
    std::string what;
    try {
      ringzero::all_reduce(comm, std::span<float>(v), op::sum, {.timeout = 20s});
    } catch (const ringzero::peer_error& e) {
      named = e.peer();
      what = e.what();
    }
    check.expect(named == peer && contains(what, fmt::format("rank {}", peer)) &&
                     contains(what, fmt::format("its last rail, {}, failed", eng.rail_name(2))),
                 fmt::format("a peer_error naming rank {} and its last rail, got {}: '{}'", peer,
                             named, what));
    return check.code();
  });
  multiprocess::require_all_passed(out);
}

}  // namespace suite
