#include <doctest/doctest.h>

#include <ringzero/zero/stage.hpp>

namespace zero = ringzero::zero;

TEST_CASE("the stage table says what each stage shards and gathers") {
  static_assert(zero::stage_table.size() == 4);
  for (int s = 0; s < 4; ++s) CHECK(zero::stage_of(s).stage == s);
  // Each stage shards everything the one before did, plus one more kind of state.
  CHECK_FALSE(zero::stage_of(0).sharded_optimizer);
  CHECK(zero::stage_of(1).sharded_optimizer);
  CHECK_FALSE(zero::stage_of(1).sharded_gradients);
  CHECK(zero::stage_of(2).sharded_gradients);
  CHECK_FALSE(zero::stage_of(2).sharded_parameters);
  CHECK(zero::stage_of(3).sharded_parameters);
  for (int s = 1; s < 4; ++s) {
    const auto& a = zero::stage_of(s - 1);
    const auto& b = zero::stage_of(s);
    CHECK((!a.sharded_optimizer || b.sharded_optimizer));
    CHECK((!a.sharded_gradients || b.sharded_gradients));
    CHECK((!a.sharded_parameters || b.sharded_parameters));
  }
  // Updated shards must be shared unless every rank updated everything (0) or parameters stay
  // sharded (3).
  for (const auto& s : zero::stage_table)
    CHECK(s.gather_after_step == (s.sharded_optimizer && !s.sharded_parameters));
  CHECK_THROWS_AS((void)zero::stage_of(4), ringzero::invalid_argument);
  CHECK_THROWS_AS((void)zero::stage_of(-1), ringzero::invalid_argument);
}
