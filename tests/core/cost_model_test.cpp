#include <doctest/doctest.h>

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
