#include <doctest/doctest.h>

#include <ringzero/error.hpp>
#include <ringzero/zero/options.hpp>

#include <string>

namespace zero = ringzero::zero;
using ringzero::dtype;

namespace {

// Two bf16 parameters, the second in group 1.
zero::model_layout two_groups() {
  zero::model_layout l;
  l.add_layer("fc");
  l.add({.name = "fc.w", .shape = {8}, .type = dtype::bfloat16});
  l.add({.name = "fc.b", .shape = {2}, .type = dtype::bfloat16, .group = 1});
  return l;
}

zero::config grouped() {
  zero::config c;
  c.groups = {{.name = "decay"}, {.name = "embed", .frozen = true}};
  return c;
}

std::string rejection(const zero::config& c, dtype type = dtype::bfloat16) {
  try {
    (void)zero::check_config(c, two_groups(), type, false);
  } catch (const ringzero::invalid_argument& e) {
    return e.what();
  }
  return {};
}

}  // namespace

TEST_CASE("check_config accepts a config that can work") {
  auto c = grouped();
  c.stage = 3;
  c.accumulation_steps = 4;
  CHECK_NOTHROW((void)zero::check_config(c, two_groups(), dtype::bfloat16, false));
}

TEST_CASE("check_config names the setting that cannot work") {
  auto c = grouped();
  CHECK(rejection(c, dtype::float16).find("fc.w is registered as bfloat16") != std::string::npos);
  c.stage = 4;
  CHECK(rejection(c).find("stage 4") != std::string::npos);
  c = grouped();
  c.accumulation_steps = 0;
  CHECK(rejection(c).find("accumulation_steps 0") != std::string::npos);
  c = grouped();
  c.reduce_dtype = dtype::float16;
  CHECK(rejection(c).find("zero: reduce_dtype ") != std::string::npos);
  c.reduce_dtype = dtype::float32;
  CHECK(rejection(c).empty());
  c = grouped();
  c.gradient_predivide = 0.0f;
  CHECK(rejection(c).find("gradient_predivide") != std::string::npos);
  c = grouped();
  c.groups.pop_back();
  CHECK(rejection(c).find("fc.b is in group 1, config has 1") != std::string::npos);
  c = grouped();
  c.collectives.all_reduce.algorithm = ringzero::algorithm::hierarchical;
  CHECK(rejection(c).find("node topology") != std::string::npos);
  CHECK_NOTHROW((void)zero::check_config(c, two_groups(), dtype::bfloat16, true));
}

TEST_CASE("frozen groups refuse gradients and groups have checkpoint names") {
  const auto c = grouped();
  const zero::partition_plan plan(two_groups(), 1, 0);
  const auto& l = plan;
  CHECK_FALSE(zero::frozen(c, 0));
  CHECK(zero::frozen(c, 1));
  CHECK_NOTHROW(zero::check_trainable(c, l.params()[0]));
  CHECK_THROWS_WITH_AS(zero::check_trainable(c, l.params()[1]),
                       doctest::Contains("fc.b belongs to the frozen group embed"),
                       ringzero::invalid_argument);
  CHECK(zero::group_name(c, 1) == "embed");
  CHECK(zero::group_name(zero::config{}, 0) == "default");
}

TEST_CASE("optimizers: every row parses by its names and keeps its named moments") {
  for (const zero::optimizer_descriptor& d : zero::optimizers) {
    CAPTURE(d.name);
    CHECK(&zero::describe(d.kind) == &d);
    CHECK(zero::optimizer_name(d.kind) == d.name);
    CHECK(zero::parse_optimizer(d.name) == d.kind);
    if (!d.alias.empty()) CHECK(zero::parse_optimizer(d.alias) == d.kind);
    REQUIRE(d.moments >= 1);
    REQUIRE(static_cast<std::size_t>(d.moments) <= d.moment_names.size());
    for (int i = 0; i < d.moments; ++i)
      CHECK_FALSE(d.moment_names[static_cast<std::size_t>(i)].empty());
  }
  CHECK(zero::describe(zero::optimizer_kind::adamw).moments == 2);
  CHECK(zero::describe(zero::optimizer_kind::sgd).moments == 1);
  CHECK_THROWS_WITH_AS(static_cast<void>(zero::parse_optimizer("lamb")),
                       "ringzero: unknown optimizer 'lamb' (expected adamw or sgd)",
                       ringzero::invalid_argument);
}
