#include <doctest/doctest.h>

#include <cmath>

#include "ringzero/algorithm.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/loopback.hpp"
#include "ringzero/tuning/cost_model.hpp"

using namespace ringzero;
using tuning::select;

namespace {

const cost_params transports[] = {cost_params{}, loopback::world_options{}.cost};

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
  CHECK(tuning::select(collective::all_reduce, 1e9, 1, cost_params{}) == algorithm::ring);
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
  const cost_params p{};
  const auto predict_hierarchical_all_to_all = [&](double bytes, int n, int nodes,
                                                   const cost_params& q) {
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
