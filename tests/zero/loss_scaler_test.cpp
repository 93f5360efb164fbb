#include <doctest/doctest.h>

#include <ringzero/zero/loss_scaler.hpp>

#include <cmath>
#include <limits>

namespace zero = ringzero::zero;

TEST_CASE("the scale backs off on overflow and grows after growth_interval clean steps") {
  zero::loss_scaling cfg{.initial = 1024.0f,
                         .growth = 2.0f,
                         .backoff = 0.25f,
                         .growth_interval = 3,
                         .min_scale = 8.0f};
  zero::loss_scaler s(cfg, true);
  CHECK(s.scale() == 1024.0f);
  s.update(false);
  s.update(false);
  CHECK(s.scale() == 1024.0f);
  CHECK(s.good_steps() == 2);
  s.update(false);
  CHECK(s.scale() == 2048.0f);
  CHECK(s.good_steps() == 0);
  s.update(false);
  s.update(true);  // an overflow resets the count of clean steps
  CHECK(s.scale() == 512.0f);
  CHECK(s.good_steps() == 0);
  for (int i = 0; i < 10; ++i) s.update(true);
  CHECK(s.scale() == 8.0f);  // never below min_scale
}

TEST_CASE("growth stops at the largest finite scale") {
  zero::loss_scaler s({.initial = 0x1p126f, .growth = 2.0f, .growth_interval = 1}, true);
  s.update(false);
  CHECK(s.scale() == 0x1p127f);
  for (int i = 0; i < 5; ++i) {
    s.update(false);
    CHECK(std::isfinite(s.scale()));
  }
  CHECK(s.scale() == 0x1p127f);
  // 1.5 * 2^127 is still finite (below FLT_MAX): growth by a non-power of two.
  zero::loss_scaler t({.initial = 0x1p127f, .growth = 1.5f, .growth_interval = 1}, true);
  t.update(false);
  CHECK(t.scale() == 1.5f * 0x1p127f);
  t.update(false);
  CHECK(t.scale() == 1.5f * 0x1p127f);
}

TEST_CASE("disabled and static scalers") {
  zero::loss_scaler off({.initial = 1024.0f}, false);
  CHECK(off.scale() == 1.0f);
  off.update(false);
  off.update(true);
  off.restore(64.0f, 3);
  CHECK(off.scale() == 1.0f);
  zero::loss_scaler fixed({.initial = 128.0f, .growth_interval = 1, .dynamic = false}, true);
  fixed.update(true);
  fixed.update(false);
  fixed.update(false);
  CHECK(fixed.scale() == 128.0f);
  zero::loss_scaler on({.initial = 1024.0f}, true);
  on.restore(64.0f, 3);
  CHECK(on.scale() == 64.0f);
  CHECK(on.good_steps() == 3);
}

TEST_CASE("settings that cannot work are refused") {
  const float inf = std::numeric_limits<float>::infinity();
  CHECK_THROWS_AS(zero::loss_scaler({.initial = inf}, true), ringzero::invalid_argument);
  CHECK_THROWS_AS(zero::loss_scaler({.initial = 0.0f}, true), ringzero::invalid_argument);
  CHECK_THROWS_AS(zero::loss_scaler({.growth = 0.5f}, true), ringzero::invalid_argument);
  CHECK_THROWS_AS(zero::loss_scaler({.growth = inf}, true), ringzero::invalid_argument);
  CHECK_THROWS_AS(zero::loss_scaler({.backoff = 0.0f}, true), ringzero::invalid_argument);
  CHECK_THROWS_AS(zero::loss_scaler({.backoff = 2.0f}, true), ringzero::invalid_argument);
  CHECK_THROWS_AS(zero::loss_scaler({.min_scale = 0.0f}, true), ringzero::invalid_argument);
}
