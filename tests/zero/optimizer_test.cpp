#include <doctest/doctest.h>

#include <ringzero/zero/device_space.hpp>
#include <ringzero/zero/optimizer.hpp>

#include <cmath>
#include <cstring>
#include <span>
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

// An optimizer that exists only here, added the way a new one is added to the library: one rule
// (its descriptor and its per-element arithmetic) and one line placing it in a table. Lion
// (Chen et al., 2023): the sign of an interpolated momentum, decoupled weight decay.
namespace {

constexpr auto lion_id = static_cast<zero::optimizer_kind>(200);  // no built-in kind uses it

// docs-begin: lion
struct lion_rule {
  static constexpr zero::optimizer_descriptor descriptor{lion_id, "lion", "", 1, {"exp_avg", ""}};
  static float factor(const zero::step_constants& c, bool decay) noexcept {
    return decay ? 1.0f - c.lr * c.weight_decay : 1.0f;
  }
  static float step(float g, float& w, float& m, float&, const zero::step_constants& c,
                    float keep) noexcept {
    const float gs = g * c.grad_scale;
    const float u = c.beta1 * m + (1.0f - c.beta1) * gs;
    w = w * keep - c.lr * (u > 0.0f ? 1.0f : u < 0.0f ? -1.0f : 0.0f);
    m = c.beta2 * m + (1.0f - c.beta2) * gs;
    return w;
  }
};

using with_lion = zero::builtin_optimizers::with<lion_rule>;  // the one line that registers it
// docs-end: lion

// Lion written out on its own, element by element, as the reference the table's loops must
// match bit for bit.
void lion_by_hand(const std::vector<float>& g, std::vector<float>& w, std::vector<float>& m,
                  const zero::step_constants& c, bool decay) {
  for (std::size_t i = 0; i < g.size(); ++i) {
    const float gs = g[i] * c.grad_scale;
    const float u = c.beta1 * m[i] + (1.0f - c.beta1) * gs;
    const float s = u > 0.0f ? 1.0f : (u < 0.0f ? -1.0f : 0.0f);
    w[i] = w[i] * (decay ? 1.0f - c.lr * c.weight_decay : 1.0f) - c.lr * s;
    m[i] = c.beta2 * m[i] + (1.0f - c.beta2) * gs;
  }
}

std::vector<float> lion_grad(std::size_t n, int t) {
  std::vector<float> g(n);
  for (std::size_t i = 0; i < n; ++i)
    g[i] = std::sin(static_cast<float>(i) * 0.7f + static_cast<float>(t)) * 3.0f;
  g[n / 2] = 0.0f;  // the sign of zero is zero: a step of decay alone
  return g;
}

bool same_bits(const float* a, const float* b, std::size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("optimizer table: a registered rule gets its name, parsing and moments from its row") {
  static_assert(zero::optimizer_rule<lion_rule>);
  static_assert(with_lion::size == zero::builtin_optimizers::size + 1);
  REQUIRE(with_lion::has(lion_id));
  CHECK(with_lion::at(lion_id).name == "lion");
  CHECK(with_lion::at(lion_id).moments == 1);
  CHECK(zero::parse_optimizer<with_lion>("lion") == lion_id);
  CHECK(zero::parse_optimizer<with_lion>("adam") == zero::optimizer_kind::adamw);
  // The built-in table does not know it: parsing lists only the built-ins, and a state or a step
  // asked for it is refused with its number, never run as something else.
  CHECK_FALSE(zero::builtin_optimizers::has(lion_id));
  CHECK_THROWS_WITH_AS(static_cast<void>(zero::parse_optimizer("lion")),
                       doctest::Contains("unknown optimizer 'lion' (expected adamw or sgd)"),
                       ringzero::invalid_argument);
  CHECK_THROWS_WITH_AS(zero::shard_optimizer<float>(zero::optimizer_options{.kind = lion_id}, 4),
                       doctest::Contains("no optimizer has kind 200"), ringzero::invalid_argument);
  int visited = 0;
  with_lion::visit(lion_id, [&]<class R>(std::type_identity<R>) {
    visited += std::is_same_v<R, lion_rule> ? 1 : 100;
  });
  with_lion::visit(zero::optimizer_kind::sgd, [&]<class R>(std::type_identity<R>) {
    visited += std::is_same_v<R, zero::sgd_rule> ? 10 : 100;
  });
  CHECK(visited == 11);
}

TEST_CASE("optimizer table: a registered rule runs in the host state, bitwise as written out") {
  const zero::optimizer_options o{
      .kind = lion_id, .lr = 0.01f, .beta1 = 0.9f, .beta2 = 0.99f, .weight_decay = 0.1f};
  constexpr std::size_t n = 37;
  for (bool decay : {false, true}) {
    zero::shard_optimizer<bfloat16, with_lion> opt(o, n);
    CHECK(opt.moment_count() == 1);
    CHECK(opt.moment_size(2) == 0);  // one moment: no second array allocated
    std::vector<bfloat16> param(n);
    std::vector<float> w(n), m(n, 0.0f);
    for (std::size_t i = 0; i < n; ++i) w[i] = 0.5f - 0.03f * static_cast<float>(i);
    opt.set(0, param.data(), w.data(), n);
    for (int t = 1; t <= 4; ++t) {
      const auto k = zero::make_step_constants(o, static_cast<std::uint64_t>(t), 0.5f);
      const std::vector<float> g = lion_grad(n, t);
      opt.update(g.data(), 0, param.data(), n, k, decay);
      lion_by_hand(g, w, m, k, decay);
    }
    CHECK(same_bits(opt.master(0, param.data()), w.data(), n));
    CHECK(same_bits(opt.moment(1, 0), m.data(), n));
    for (std::size_t i = 0; i < n; ++i) REQUIRE(param[i] == bfloat16(w[i]));
  }
}

TEST_CASE("optimizer table: a registered rule runs on the emulated device, bitwise as the host") {
  using space_t = zero::emulated_device_space;
  const space_t space;
  const zero::optimizer_options o{.kind = lion_id, .lr = 0.02f, .weight_decay = 0.05f};
  constexpr std::size_t n = 29;
  zero::device_optimizer<float, space_t, with_lion> dev(o, n, space);
  CHECK(dev.moment_count() == 1);
  CHECK(dev.moment_size(2) == 0);
  std::vector<float> w(n), m(n, 0.0f);
  for (std::size_t i = 0; i < n; ++i) w[i] = 0.25f * static_cast<float>(i % 5) - 0.5f;
  // fp32: the parameters are their own master weights, as in the sharder's segments.
  auto dparam = space.allocate_local<float>(n);
  auto dgrad = space.allocate_local<float>(n);
  const auto st = space.comm_stream();
  space.upload(st, dparam.data(), w.data(), n);
  space.zero(st, dev.moment(1, 0), n);
  for (int t = 1; t <= 3; ++t) {
    const auto k = zero::make_step_constants(o, static_cast<std::uint64_t>(t), 1.0f);
    const std::vector<float> g = lion_grad(n, t);
    space.upload(st, dgrad.data(), g.data(), n);
    const std::vector<zero::device_segment<float, float>> segs{
        {dgrad.data(), dparam.data(), dev.moment(1, 0), nullptr, dparam.data(), n, true}};
    space.optimizer_step<with_lion>(st, lion_id, std::span(segs), k);
    lion_by_hand(g, w, m, k, true);
    // The built-in table refuses the kind on the caller's thread, before anything is enqueued.
    CHECK_THROWS_AS(space.optimizer_step(st, lion_id, std::span(segs), k),
                    ringzero::invalid_argument);
  }
  std::vector<float> got_w(n), got_m(n);
  space.download(st, got_w.data(), dparam.data(), n);
  space.download(st, got_m.data(), dev.moment(1, 0), n);
  space.synchronize(st);
  CHECK(same_bits(got_w.data(), w.data(), n));
  CHECK(same_bits(got_m.data(), m.data(), n));
}

TEST_CASE("optimizer table: the built-in rules run through it as their element functions") {
  for (const zero::optimizer_descriptor& d : zero::optimizers) {
    const zero::optimizer_options o{.kind = d.kind, .lr = 0.05f, .weight_decay = 0.1f};
    constexpr std::size_t n = 17;
    zero::shard_optimizer<float> opt(o, n);
    CHECK(opt.moment_count() == d.moments);
    std::vector<float> param(n);
    std::vector<zero::element_state> want(n);
    for (std::size_t i = 0; i < n; ++i) want[i].w = param[i] = 1.0f - 0.1f * static_cast<float>(i);
    for (int t = 1; t <= 3; ++t) {
      const auto k = zero::make_step_constants(o, static_cast<std::uint64_t>(t), 0.5f);
      const std::vector<float> g = lion_grad(n, t);
      opt.update(g.data(), 0, param.data(), n, k, true);
      for (std::size_t i = 0; i < n; ++i)
        want[i] = d.kind == zero::optimizer_kind::adamw
                      ? zero::adamw_element(g[i], want[i], k, true)
                      : zero::sgd_element(g[i], want[i], k, true);
    }
    for (std::size_t i = 0; i < n; ++i) {
      INFO(d.name << " element " << i);
      REQUIRE(std::memcmp(&param[i], &want[i].w, sizeof(float)) == 0);
      REQUIRE(std::memcmp(opt.moment(1, 0) + i, &want[i].m, sizeof(float)) == 0);
      if (d.moments > 1) REQUIRE(std::memcmp(opt.moment(2, 0) + i, &want[i].v, sizeof(float)) == 0);
    }
  }
}
