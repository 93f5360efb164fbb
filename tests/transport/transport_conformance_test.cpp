// Every messaging transport through the same suite (transport_suite.hpp): loopback and the lazy
// transport as threads, shm, socket on one rail and three, and libfabric's shm, tcp;ofi_rxm and
// tcp;ofi_rxm on two rails as processes. Each test case runs once per transport, named
// "<case><transport>".
//
// CTest runs the in-process transports, the process ones and each (transport, world size) of
// the matrix as tests of their own, selected by name (see CMakeLists.txt); the matrices above
// one rank are skipped without --no-skip.
#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "transport_suite.hpp"

using namespace std::chrono_literals;

TYPE_TO_STRING_AS("loopback", suite::loopback);
TYPE_TO_STRING_AS("lazy", suite::lazy);
TYPE_TO_STRING_AS("mailbox", suite::mailbox);
TYPE_TO_STRING_AS("mailbox rails", suite::mailbox_rails);
TYPE_TO_STRING_AS("mailbox agreed", suite::mailbox_agreed);
TYPE_TO_STRING_AS("shm", suite::shm);
TYPE_TO_STRING_AS("socket", suite::socket);
TYPE_TO_STRING_AS("socket rails", suite::socket_rails);
#ifdef RINGZERO_SUITE_WITH_LIBFABRIC
TYPE_TO_STRING_AS("libfabric shm", suite::libfabric_shm);
TYPE_TO_STRING_AS("libfabric tcp", suite::libfabric_tcp);
TYPE_TO_STRING_AS("libfabric rails", suite::libfabric_rails);
TYPE_TO_STRING_AS("libfabric failover", suite::libfabric_failover);
#define RINGZERO_SUITE_LIBFABRIC \
  , suite::libfabric_shm, suite::libfabric_tcp, suite::libfabric_rails
#define RINGZERO_SUITE_LIBFABRIC_RAILS , suite::libfabric_failover
#else
#define RINGZERO_SUITE_LIBFABRIC
#define RINGZERO_SUITE_LIBFABRIC_RAILS
#endif

#define RINGZERO_SUITE_IN_PROCESS \
  suite::loopback, suite::lazy, suite::mailbox, suite::mailbox_rails, suite::mailbox_agreed
// Every network transport's rails: the kit's engine over each rail kind.
#define RINGZERO_SUITE_RAILS \
  suite::mailbox_rails, suite::mailbox_agreed, suite::socket_rails RINGZERO_SUITE_LIBFABRIC_RAILS
#define RINGZERO_SUITE_ALL \
  RINGZERO_SUITE_IN_PROCESS, suite::shm, suite::socket, suite::socket_rails RINGZERO_SUITE_LIBFABRIC

TEST_CASE_TEMPLATE("conformance 1 rank", F, RINGZERO_SUITE_ALL) {
  suite::conformance_over<F>(1);
}
TEST_CASE_TEMPLATE("conformance 2 ranks" * doctest::skip(), F, RINGZERO_SUITE_ALL) {
  suite::conformance_over<F>(2);
}
TEST_CASE_TEMPLATE("conformance 3 ranks" * doctest::skip(), F, RINGZERO_SUITE_ALL) {
  suite::conformance_over<F>(3);
}
TEST_CASE_TEMPLATE("conformance 4 ranks" * doctest::skip(), F, RINGZERO_SUITE_ALL) {
  suite::conformance_over<F>(4);
}
// Threads make larger worlds cheap: sizes neither a power of two nor one below.
TEST_CASE_TEMPLATE("conformance 5 ranks" * doctest::skip(), F, RINGZERO_SUITE_IN_PROCESS) {
  suite::conformance_over<F>(5);
}
TEST_CASE_TEMPLATE("conformance 6 ranks" * doctest::skip(), F, RINGZERO_SUITE_IN_PROCESS) {
  suite::conformance_over<F>(6);
}

TEST_CASE_TEMPLATE("sub-communicators keep their messages apart", F, RINGZERO_SUITE_ALL) {
  suite::sub_communicators<F>();
}
TEST_CASE_TEMPLATE("a destroyed receive is never written (cancel on destroy)", F,
                   RINGZERO_SUITE_ALL) {
  suite::cancel_on_destroy<F>();
}
TEST_CASE_TEMPLATE("hundreds of messages in flight, matched by tag and posting order", F,
                   RINGZERO_SUITE_ALL) {
  suite::ordering<F>();
}
TEST_CASE_TEMPLATE("a receive posted with the wrong size fails with both sizes named", F,
                   RINGZERO_SUITE_ALL) {
  suite::size_mismatch<F>();
}
TEST_CASE_TEMPLATE("a rank that dies is named by the survivors' errors", F, RINGZERO_SUITE_ALL) {
  suite::dead_peer<F>();
}
TEST_CASE_TEMPLATE("abort() from another thread unblocks a wait, and every call after fails", F,
                   RINGZERO_SUITE_ALL) {
  suite::abort_unblocks<F>();
}
TEST_CASE_TEMPLATE("bad arguments are named", F, RINGZERO_SUITE_ALL) {
  suite::bad_arguments<F>();
}
TEST_CASE_TEMPLATE("a rail that fails moves its messages to the rails left, in order", F,
                   RINGZERO_SUITE_RAILS) {
  suite::rail_failover<F>();
}

namespace {

/// The lazy transport with the progress rule broken: test(req) advances req alone.
struct lazy_only_req : suite::lazy {
  static transport make(const world& w, int r, std::chrono::nanoseconds timeout) {
    return transport(w, r, {.test_advances_all = false, .timeout = timeout});
  }
};

}  // namespace

// The suite must catch a transport that breaks the progress rule of transport/concept.hpp: the
// ring waits on its receive while its send is in flight, recursive doubling likewise, so with
// test(req) advancing req alone no message moves, and every rank times out. The same calls
// over the lazy transport that keeps the rule complete: the rule, not the laziness, decides.
TEST_CASE("lazy transport: a test() that advances only its own request deadlocks, and is caught") {
  for (const auto algo : {ringzero::algorithm::ring, ringzero::algorithm::recursive_doubling}) {
    const std::string name(ringzero::algorithm_name(algo));
    CAPTURE(name);
    const auto call = [algo](auto& comm, suite::rank_context& ctx) {
      std::vector<float> v(1000, static_cast<float>(ctx.rank + 1));
      ringzero::all_reduce(comm, std::span<float>(v), ringzero::op::sum, {.algorithm = algo});
      return v.front() == 10.0f && v.back() == 10.0f ? 0 : 1;
    };
    const auto kept = suite::run<suite::lazy>(4, 60s, call, 1s);
    INFO("rule kept: " << kept.describe());
    CHECK(kept.all_passed());

    std::vector<std::string> errors(4);
    std::vector<double> took(4);
    const auto broken = suite::run<lazy_only_req>(
        4, 60s,
        [&](auto& comm, suite::rank_context& ctx) {
          const auto start = std::chrono::steady_clock::now();
          try {
            (void)call(comm, ctx);
          } catch (const ringzero::timeout_error& e) {
            errors[static_cast<std::size_t>(ctx.rank)] = e.what();
          }
          took[static_cast<std::size_t>(ctx.rank)] =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          return 0;
        },
        1s);
    CHECK(broken.all_passed());
    for (int r = 0; r < 4; ++r) {
      const auto& what = errors[static_cast<std::size_t>(r)];
      const double t = took[static_cast<std::size_t>(r)];
      INFO("rank " << r << ", after " << t << " s: '" << what << "'");
      CHECK(suite::contains(what, fmt::format("all_reduce ({})", name)));
      CHECK(suite::contains(what, "without progress"));
      CHECK(t >= 0.9);
      CHECK(t < 10.0);
    }
  }
}
