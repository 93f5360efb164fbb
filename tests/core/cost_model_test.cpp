#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "ringzero/algorithm.hpp"
#include "ringzero/model/cost_model.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/loopback.hpp"
#include "ringzero/transport/shm.hpp"
#include "ringzero/tuning/defaults.hpp"

using namespace ringzero;
using tuning::select;

namespace {

const tuning::policy transports[] = {tuning::policy{}, loopback::world_options{}.tuning};

}  // namespace

TEST_CASE("cost model: small messages take the fewest latency steps") {
  for (const auto& p : transports) {
    for (int n = 4; n <= 64; ++n) {
      INFO("n = " << n);
      const algorithm ar = select(collective::all_reduce, 8, n, p);
      CHECK(ar != algorithm::ring);
      if (tuning::is_pow2(n)) CHECK(ar == algorithm::recursive_doubling);
      CHECK(select(collective::reduce_scatter, 8.0 * n, n, p) ==
            algorithm::recursive_halving_doubling);
      CHECK(select(collective::all_gather, 8.0 * n, n, p) == algorithm::recursive_doubling);
      CHECK(select(collective::broadcast, 8, n, p) == algorithm::tree);
      CHECK(select(collective::reduce, 8, n, p) == algorithm::tree);
    }
  }
}

TEST_CASE("cost model: large messages take the bandwidth-optimal ring") {
  const double large = 256.0 * (1 << 20);
  for (const auto& p : transports) {
    // (On two ranks a chain and a binomial tree are the same single hop.)
    for (int n = 3; n <= 64; ++n) {
      INFO("n = " << n);
      const algorithm ar = select(collective::all_reduce, large, n, p);
      // Rabenseifner moves the ring's bytes too; off powers of two its folding costs more.
      if (tuning::is_pow2(n))
        CHECK((ar == algorithm::ring || ar == algorithm::recursive_halving_doubling));
      else
        CHECK(ar == algorithm::ring);
      CHECK(select(collective::broadcast, large, n, p) == algorithm::ring);
      CHECK(select(collective::reduce, large, n, p) == algorithm::ring);
      if (!tuning::is_pow2(n))
        CHECK(select(collective::reduce_scatter, large, n, p) == algorithm::ring);
    }
  }
}

TEST_CASE("cost model: only algorithms that implement a collective are candidates") {
  CHECK(tuning::applies(collective::all_reduce, algorithm::tree));
  CHECK_FALSE(tuning::applies(collective::reduce_scatter, algorithm::tree));
  CHECK_FALSE(tuning::applies(collective::all_gather, algorithm::recursive_halving_doubling));
  CHECK_FALSE(tuning::applies(collective::broadcast, algorithm::recursive_doubling));
  CHECK_FALSE(tuning::applies(collective::barrier, algorithm::ring));
  CHECK(tuning::select(collective::all_reduce, 1e9, 1, tuning::policy{}) == algorithm::ring);
}

TEST_CASE("cost model: all_to_all takes Bruck for small blocks, pairwise exchange for large") {
  for (const auto& p : transports) {
    for (int n = 4; n <= 64; ++n) {
      INFO("n = " << n);
      CHECK(select(collective::all_to_all, 8.0 * n, n, p) == algorithm::bruck);
      CHECK(select(collective::all_to_all, 256.0 * (1 << 20), n, p) == algorithm::pairwise);
      CHECK(select(collective::all_to_allv, 8.0 * n, n, p) == algorithm::pairwise);
      // Both carry (n-1)/n of the root's buffer over its link; the tree takes fewer steps.
      CHECK(select(collective::gather, 8.0 * n, n, p) == algorithm::tree);
      CHECK(select(collective::scatter, 256.0 * (1 << 20), n, p) == algorithm::tree);
    }
    // On two ranks both gathers are one message: the earlier in the table, tree, wins the tie.
    CHECK(select(collective::gather, 1e6, 2, p) == algorithm::tree);
  }
  CHECK(tuning::applies(collective::all_to_all, algorithm::hierarchical, true));
  CHECK_FALSE(tuning::applies(collective::all_to_all, algorithm::hierarchical, false));
  CHECK_FALSE(tuning::applies(collective::all_to_allv, algorithm::bruck));
  CHECK_FALSE(tuning::applies(collective::gather, algorithm::pairwise));
  CHECK_FALSE(tuning::applies(collective::all_reduce, algorithm::linear));
}

TEST_CASE("cost model: hierarchical all_to_all is gather, leaders' all_to_all, scatter") {
  const tuning::policy p{};
  const auto predict_hierarchical_all_to_all = [&](double bytes, int n, int nodes,
                                                   const tuning::policy& q) {
    return tuning::algorithm_table::predict(
        algorithm::hierarchical, tuning::cost_query{collective::all_to_all, bytes, n, q, nodes});
  };
  const double s = 4096;
  const double expected = tuning::predict_best(collective::gather, 8 * s, 8, p) +
                          tuning::predict_best(collective::all_to_all, 8 * s, 4, p) +
                          tuning::predict_best(collective::scatter, 8 * s, 8, p);
  CHECK(predict_hierarchical_all_to_all(s, 32, 4, p) == doctest::Approx(expected));
  CHECK(std::isinf(predict_hierarchical_all_to_all(s, 30, 4, p)));
  CHECK(std::isinf(predict_hierarchical_all_to_all(s, 32, 1, p)));
  // Tiny blocks on many ranks per node: far fewer messages than pairwise exchange. With one set
  // of constants for every link Bruck still wins; hierarchical needs cheaper links inside nodes.
  CHECK(predict_hierarchical_all_to_all(8.0 * 512, 512, 16, p) <
        tuning::predict(collective::all_to_all, algorithm::pairwise, 8.0 * 512, 512, p));
  const topology t{.node = 0, .local_rank = 0, .local_size = 32, .node_count = 16};
  CHECK(tuning::select(collective::all_to_all, 8.0 * 512, 512, p, t) == algorithm::bruck);
  CHECK(tuning::select(collective::all_to_all, 1e9, 512, p, t) == algorithm::pairwise);
}

// tuning/: one policy type, each transport's defaults named with their source, a rail's price.

TEST_CASE("tuning: every built-in policy is valid, named once and says where it came from") {
  std::set<std::string_view> names;
  for (const tuning::sourced_policy& d : tuning::defaults::all) {
    INFO(d.name);
    CHECK_NOTHROW(tuning::check(d.value, d.name));
    CHECK(names.insert(d.name).second);
    CHECK(d.source.size() > 20);
  }
  CHECK(names.size() == tuning::defaults::all.size());
  CHECK(tuning::defaults::generic.value == tuning::policy{});
  // The transports report theirs unless told otherwise.
  CHECK(loopback::world_options{}.tuning == tuning::defaults::loopback.value);
  CHECK(shm::options{}.tuning == tuning::defaults::shm.value);
  loopback::world(2).run([](loopback::communicator& comm) {
    CHECK(comm.tuning() == tuning::defaults::loopback.value);
    CHECK(comm.transport().tuning() == tuning::defaults::loopback.value);
  });
}

TEST_CASE("tuning: a libfabric provider finds its defaults by name") {
  CHECK(&tuning::libfabric_default("shm") == &tuning::defaults::libfabric_shm);
  CHECK(&tuning::libfabric_default("tcp;ofi_rxm") == &tuning::defaults::libfabric_tcp);
  CHECK(&tuning::libfabric_default("tcp") == &tuning::defaults::libfabric_tcp);
  CHECK(&tuning::libfabric_default("efa") == &tuning::defaults::libfabric_efa);
  CHECK(&tuning::libfabric_default("verbs;ofi_rxm") == &tuning::defaults::libfabric_verbs);
  CHECK(&tuning::libfabric_default("sockets") == &tuning::defaults::libfabric_sockets);
  CHECK(&tuning::libfabric_default("psm3") == &tuning::defaults::libfabric_other);
  for (const auto* p : {"shm", "tcp;ofi_rxm", "efa", "verbs;ofi_rxm", "sockets", "psm3"}) {
    INFO(p);
    // Above each provider's eager protocol (tuning::policy::min_chunk_bytes).
    CHECK(tuning::libfabric_default(p).value.min_chunk_bytes >= 16 * 1024);
  }
}

TEST_CASE("tuning: rails striped together pay the slowest latency and move at their sum") {
  const tuning::policy base{.alpha = 1, .beta = 1, .gamma = 0.5, .chunk_bytes = 4096};
  CHECK(tuning::over_rails(base, {}) == base);
  const tuning::rail_price one[] = {{.alpha = 20e-6, .beta = 1.0 / 10e9}};
  const tuning::policy p1 = tuning::over_rails(base, one);
  CHECK(p1.alpha == 20e-6);
  CHECK(p1.beta == doctest::Approx(1.0 / 10e9));
  const tuning::rail_price mixed[] = {{.alpha = 20e-6, .beta = 1.0 / 10e9},
                                      {.alpha = 35e-6, .beta = 1.0 / 30e9},
                                      {.alpha = 15e-6, .beta = 1.0 / 10e9}};
  const tuning::policy p3 = tuning::over_rails(base, mixed);
  CHECK(p3.alpha == 35e-6);
  CHECK(p3.beta == doctest::Approx(1.0 / 50e9));
  // Only the wire price changes: reduction and flow control are the transport's.
  CHECK(p3.gamma == base.gamma);
  CHECK(p3.chunk_bytes == base.chunk_bytes);
  CHECK(p3.burst == base.burst);
}

TEST_CASE("tuning: a policy the model cannot price is refused, naming the field") {
  const auto refused = [](tuning::policy p, const std::string& field) {
    INFO(field);
    try {
      tuning::check(p, "test");
      FAIL("accepted");
    } catch (const invalid_argument& e) {
      CHECK(std::string(e.what()).find(field) != std::string::npos);
    }
  };
  const tuning::policy good{};
  tuning::policy p = good;
  p.alpha = -1e-6;
  refused(p, "alpha");
  p = good;
  p.beta = 0;
  refused(p, "beta");
  p = good;
  p.gamma = std::numeric_limits<double>::quiet_NaN();
  refused(p, "gamma");
  p = good;
  p.beta = std::numeric_limits<double>::infinity();
  refused(p, "beta");
  p = good;
  p.chunk_bytes = 0;
  refused(p, "chunk_bytes");
  p = good;
  p.burst = 0;
  refused(p, "burst");
  p = good;
  p.inflight = 0;
  refused(p, "inflight");
  // At the communicator too, before anything is selected with it.
  try {
    loopback::world(2, {.tuning = {.beta = 0}}).run([](loopback::communicator&) {
      FAIL("a communicator took beta = 0");
    });
    FAIL("no error");
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()).find("communicator tuning: beta") != std::string::npos);
  }
}

namespace {

// The table docs/architecture.md must contain, generated from tuning::defaults::all.
std::string expected_defaults_table() {
  std::string s =
      "| transport | alpha | 1/beta | 1/gamma | chunk | smallest chunk | source |\n"
      "|---|---|---|---|---|---|---|\n";
  for (const tuning::sourced_policy& d : tuning::defaults::all)
    s += fmt::format("| `{}` | {:g} µs | {:g} GB/s | {:g} GB/s | {} KiB | {} KiB | {} |\n", d.name,
                     d.value.alpha * 1e6, 1e-9 / d.value.beta, 1e-9 / d.value.gamma,
                     d.value.chunk_bytes / 1024, d.value.min_chunk_bytes / 1024, d.source);
  return s;
}

}  // namespace

TEST_CASE("tuning: docs/architecture.md lists exactly the built-in policies") {
  std::ifstream f(RINGZERO_SOURCE_DIR "/docs/architecture.md");
  REQUIRE(f);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string want = expected_defaults_table();
  INFO("docs/architecture.md should contain this table, generated from tuning::defaults::all:\n"
       << want);
  CHECK(ss.str().find(want) != std::string::npos);
}
