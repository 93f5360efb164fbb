#include <doctest/doctest.h>

#include <ringzero/zero/optimizer.hpp>

#include <cmath>
#include <type_traits>
#include <vector>

namespace zero = ringzero::zero;
using ringzero::bfloat16;

TEST_CASE("sgd_element: plain momentum by hand") {
  const zero::step_constants k{
      .grad_scale = 0.5f, .lr = 0.25f, .momentum = 0.5f, .weight_decay = 0.0f};
  CHECK(zero::sgd_element(2.0f, {1.0f, 0.0f, 0.0f}, k, true).w == 0.75f);
  CHECK(zero::sgd_element(2.0f, {1.0f, 1.0f, 0.0f}, k, true).m == 1.5f);
}

// The host sharder and the CUDA kernels take one struct of constants and one segment type
// (zero/optimizer_math.hpp calls the kernels' element functions).
static_assert(std::is_same_v<zero::step_constants, ringzero::kernels::optimizer_constants>);

TEST_CASE("adamw_element follows the textbook formula over several steps") {
  zero::optimizer_options o{.lr = 0.01f, .weight_decay = 0.1f};
  for (bool decay : {false, true}) {
    zero::element_state s{0.7f, 0.0f, 0.0f};
    double w = 0.7, m = 0, v = 0;
    for (int t = 1; t <= 5; ++t) {
      const float g = 0.3f - 0.1f * static_cast<float>(t);
      const auto k = zero::make_step_constants(o, static_cast<std::uint64_t>(t), 0.5f);
      s = zero::adamw_element(g, s, k, decay);
      const double gs = 0.5 * g;
      m = o.beta1 * m + (1 - o.beta1) * gs;
      v = o.beta2 * v + (1 - o.beta2) * gs * gs;
      const double mh = m / (1 - std::pow(o.beta1, t)), vh = v / (1 - std::pow(o.beta2, t));
      w = w * (decay ? 1 - o.lr * o.weight_decay : 1) - o.lr * mh / (std::sqrt(vh) + o.eps);
      CHECK(s.w == doctest::Approx(w).epsilon(1e-5));
      CHECK(s.m == doctest::Approx(m).epsilon(1e-5));
      CHECK(s.v == doctest::Approx(v).epsilon(1e-5));
    }
  }
}

TEST_CASE("sgd_element: momentum, Nesterov, L2 decay") {
  zero::optimizer_options o{.kind = zero::optimizer_kind::sgd,
                            .lr = 0.1f,
                            .momentum = 0.9f,
                            .nesterov = true,
                            .weight_decay = 0.01f};
  const auto k = zero::make_step_constants(o, 1, 1.0f);
  const auto s = zero::sgd_element(0.5f, {2.0f, 0.25f, 0.0f}, k, true);
  const float g = 0.5f + 0.01f * 2.0f;
  const float b = 0.9f * 0.25f + g;
  CHECK(s.m == b);
  CHECK(s.w == 2.0f - 0.1f * (g + 0.9f * b));
}

TEST_CASE("shard_optimizer keeps an fp32 master for 16-bit parameters and rounds the result") {
  zero::optimizer_options o{.lr = 0.01f};
  zero::shard_optimizer<bfloat16> opt(o, 4);
  CHECK(opt.bytes() == 3 * 4 * sizeof(float));
  std::vector<bfloat16> p(4);
  const float init[4] = {1.0f, -1.0f, 0.5f, 0.001f};
  opt.set(0, p.data(), init, 4);
  CHECK(static_cast<float>(p[1]) == -1.0f);
  const std::vector<float> g = {0.1f, 0.2f, -0.3f, 0.0f};
  const auto k = zero::make_step_constants(o, 1, 1.0f);
  opt.update(g.data(), 0, p.data(), 4, k, false);
  for (std::size_t i = 0; i < 4; ++i) {
    const auto e = zero::adamw_element(g[i], {init[i], 0.0f, 0.0f}, k, false);
    CHECK(*opt.master(i, p.data() + i) == e.w);
    CHECK(*opt.moment(1, i) == e.m);
    CHECK(*opt.moment(2, i) == e.v);
    CHECK(static_cast<float>(p[i]) == static_cast<float>(bfloat16(e.w)));
  }
  // fp32 parameters are their own master; SGD keeps one moment.
  zero::shard_optimizer<float> sgd({.kind = zero::optimizer_kind::sgd}, 3);
  std::vector<float> w(3, 1.0f);
  CHECK(sgd.master(1, w.data() + 1) == w.data() + 1);
  CHECK(sgd.moment_count() == 1);
  CHECK(sgd.bytes() == 3 * sizeof(float));
}

TEST_CASE("accumulate rounds to the gradient type; grad_stats finds non-finite values") {
  std::vector<bfloat16> acc(2);
  const float a[2] = {1.0f, 3.0f};
  zero::accumulate(acc.data(), a, 2, true);
  zero::accumulate(acc.data(), a, 2, false);
  CHECK(static_cast<float>(acc[1]) == 6.0f);
  double sumsq = 0;
  bool bad = false;
  zero::grad_stats(acc.data(), 2, 0.5f, sumsq, bad);
  CHECK(sumsq == 1.0 + 9.0);
  CHECK_FALSE(bad);
  const float inf[1] = {INFINITY};
  zero::grad_stats(inf, 1, 1.0f, sumsq, bad);
  CHECK(bad);
}

TEST_CASE("group_options: a group's settings override the base ones it sets") {
  const zero::optimizer_options base{.lr = 0.1f, .beta1 = 0.8f, .weight_decay = 0.01f};
  const std::vector<zero::param_group> groups = {
      {.name = "a"}, {.name = "b", .lr = 0.5f, .weight_decay = 0.0f, .beta2 = 0.95f}};
  const auto a = zero::group_options(base, groups, 0);
  CHECK(a.lr == 0.1f);
  CHECK(a.weight_decay == 0.01f);
  const auto b = zero::group_options(base, groups, 1);
  CHECK(b.lr == 0.5f);
  CHECK(b.weight_decay == 0.0f);
  CHECK(b.beta1 == 0.8f);
  CHECK(b.beta2 == 0.95f);
  CHECK(zero::group_options(base, {}, 0).lr == 0.1f);
  // The step constants follow the group's betas (bias correction included).
  const auto kb = zero::make_step_constants(b, 1, 1.0f);
  const auto ka = zero::make_step_constants(a, 1, 1.0f);
  CHECK(kb.lr == 0.5f);
  CHECK(zero::adamw_element(1.0f, {0.0f, 0.0f, 0.0f}, kb, false).v ==
        doctest::Approx(1.0f - 0.95f));
  CHECK(zero::adamw_element(1.0f, {0.0f, 0.0f, 0.0f}, ka, false).m == doctest::Approx(1.0f - 0.8f));
}

TEST_CASE("check_groups names the group and the setting that cannot work") {
  using groups = std::vector<zero::param_group>;
  CHECK_NOTHROW(zero::check_groups(groups{{.name = "a", .lr = 0.0f, .beta1 = 0.0f}}));
  CHECK_THROWS_WITH_AS(zero::check_groups(groups{{}}), doctest::Contains("group 0 needs a name"),
                       ringzero::invalid_argument);
  CHECK_THROWS_WITH_AS(zero::check_groups(groups{{.name = "x", .lr = -1.0f}}),
                       doctest::Contains("group x: lr -1"), ringzero::invalid_argument);
  CHECK_THROWS_WITH_AS(zero::check_groups(groups{{.name = "x", .weight_decay = -0.5f}}),
                       doctest::Contains("weight_decay"), ringzero::invalid_argument);
  CHECK_THROWS_WITH_AS(zero::check_groups(groups{{.name = "x", .beta1 = 1.5f}}),
                       doctest::Contains("beta1"), ringzero::invalid_argument);
  CHECK_THROWS_AS(zero::check_groups(groups{{.name = "x", .lr = std::nanf("")}}),
                  ringzero::invalid_argument);
}

TEST_CASE("each group starts from its own learning rate, or the optimizer's") {
  zero::config c;
  c.optimizer.lr = 0.5f;
  CHECK(zero::initial_group_lr(c) == std::vector<float>{0.5f});
  c.groups = {{.name = "a", .lr = 0.25f}, {.name = "b"}};
  CHECK(zero::initial_group_lr(c) == std::vector<float>{0.25f, 0.5f});
}

TEST_CASE("group step constants apply each group's rate, the schedule and the gradient scale") {
  zero::config c;
  c.optimizer = {.kind = zero::optimizer_kind::sgd, .lr = 1.0f, .momentum = 0.9f};
  c.groups = {{.name = "a"}, {.name = "b", .weight_decay = 0.5f}};
  c.schedule = [](std::uint64_t at) { return at == 7 ? 0.5f : 1.0f; };
  const auto ks = zero::group_step_constants(c, {0.25f, 2.0f}, 7, 3, 0.125f);
  REQUIRE(ks.size() == 2);
  CHECK(ks[0].lr == 0.125f);
  CHECK(ks[1].lr == 1.0f);
  CHECK(ks[1].weight_decay == 0.5f);
  CHECK(ks[0].grad_scale == 0.125f);
  c.schedule = {};
  CHECK(zero::group_step_constants(c, {0.25f, 2.0f}, 7, 3, 1.0f)[0].lr == 0.25f);
}
