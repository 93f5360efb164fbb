#include <doctest/doctest.h>

#include "checks.hpp"
#include "recording_transport.hpp"
#include "zero_harness.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

using ringzero::bfloat16;
using ringzero::float16;
using zt::zero::optimizer_kind;

namespace {

// Three layers, five buckets at 256 bytes: some buckets hold several layers' worth of small
// parameters, one parameter is larger than a bucket, sizes are odd.
template <class P>
zt::zero::model_layout small_model() {
  return zt::make_layout<P>({{37, 5}, {129}, {3, 61, 1}});
}

template <class P>
void stages_match_data_parallel(int world) {
  const auto layout = small_model<P>();
  zt::run_options o;
  o.world = world;
  o.steps = 3;
  o.stage = 0;
  const auto reference = zt::train<P>(layout, o);
  for (int r = 1; r < world; ++r)
    CHECK_MESSAGE(reference.params[static_cast<std::size_t>(r)] == reference.params[0],
                  "stage 0: rank ", r, " ended with different weights than rank 0");
  for (int stage = 1; stage <= 3; ++stage) {
    CAPTURE(stage);
    o.stage = stage;
    const auto got = zt::train<P>(layout, o);
    for (int r = 0; r < world; ++r)
      CHECK_MESSAGE(got.params[static_cast<std::size_t>(r)] == reference.params[0], "stage ", stage,
                    " rank ", r,
                    ": weights differ from stage 0 (expected bitwise equality), max rel diff ",
                    zt::max_rel_diff(got.params[static_cast<std::size_t>(r)], reference.params[0]));
    for (std::size_t s = 0; s < got.steps.size(); ++s)
      CHECK(got.steps[s].grad_norm == reference.steps[s].grad_norm);
  }
}

}  // namespace

TEST_CASE("stages 1, 2, 3 give bitwise the weights of plain data parallel (fp32)") {
  for (int world : {1, 2, 3, 4}) {
    CAPTURE(world);
    stages_match_data_parallel<float>(world);
  }
}

TEST_CASE("stages 1, 2, 3 give bitwise the weights of plain data parallel (bf16, fp16)") {
  stages_match_data_parallel<bfloat16>(3);
  stages_match_data_parallel<float16>(4);
}

TEST_CASE("the communication thread changes no bits, and SGD shards as AdamW does") {
  const auto layout = small_model<float>();
  zt::run_options o;
  o.world = 3;
  o.optimizer = optimizer_kind::sgd;
  o.stage = 0;
  const auto reference = zt::train<float>(layout, o);
  for (int stage : {2, 3})
    for (bool thread : {false, true}) {
      CAPTURE(stage);
      CAPTURE(thread);
      o.stage = stage;
      o.comm_thread = thread;
      CHECK(zt::train<float>(layout, o).params[1] == reference.params[0]);
    }
}

TEST_CASE("gradient accumulation: stages agree, bitwise within 0-1 and within 2-3") {
  const auto layout = small_model<float>();
  zt::run_options o;
  o.world = 2;
  o.accumulation = 2;
  std::vector<std::vector<float>> w;
  for (int stage = 0; stage <= 3; ++stage) {
    o.stage = stage;
    w.push_back(zt::train<float>(layout, o).params[0]);
  }
  CHECK(w[1] == w[0]);
  CHECK(w[3] == w[2]);
  // 0-1 sum micro-batches locally and reduce once; 2-3 reduce each and sum the results.
  CHECK(zt::max_rel_diff(w[0], w[2]) < 1e-5);
}

TEST_CASE("N = 1, 2, 3, 4 follow the single-rank trajectory to float tolerance") {
  const auto layout = small_model<float>();
  zt::run_options o;
  o.steps = 4;
  o.stage = 2;
  o.world = 1;
  const auto single = zt::train<float>(layout, o);
  for (int world : {2, 3, 4}) {
    CAPTURE(world);
    o.world = world;
    const auto got = zt::train<float>(layout, o);
    const double d = zt::max_rel_diff(single.params[0], got.params[0]);
    CHECK_MESSAGE(d < 1e-5, "max relative difference to the 1-rank run: ", d);
    for (std::size_t s = 0; s < got.steps.size(); ++s)
      CHECK(got.steps[s].grad_norm == doctest::Approx(single.steps[s].grad_norm).epsilon(1e-5));
  }
}

TEST_CASE("AdamW and SGD on the shards compute the textbook update") {
  // One step from known weights and gradients, against a direct evaluation of the formulas.
  const auto layout = zt::make_layout<float>({{50, 21}});
  for (auto kind : {optimizer_kind::adamw, optimizer_kind::sgd}) {
    CAPTURE(static_cast<int>(kind));
    zt::run_options o;
    o.world = 3;
    o.stage = 3;
    o.steps = 2;
    o.optimizer = kind;
    const auto got = zt::train<float>(layout, o);
    const auto cfg = zt::make_config(o).optimizer;
    std::vector<float> expect;
    for (int p = 0; p < 2; ++p) {
      const std::size_t n = p == 0 ? 50 : 21;
      const bool decay = p == 0;
      for (std::size_t i = 0; i < n; ++i) {
        double w = zt::initial_value(p, i), m = 0, v = 0;
        for (int s = 0; s < 2; ++s) {
          double g = 0;
          for (int k = 0; k < zt::batch; ++k)
            g +=
                w - zt::initial_value(p + 100, i) +
                0.1 * zt::noise(2, static_cast<std::uint64_t>(k), static_cast<std::uint64_t>(s), i);
          g /= zt::batch;
          if (kind == optimizer_kind::adamw) {
            m = cfg.beta1 * m + (1 - cfg.beta1) * g;
            v = cfg.beta2 * v + (1 - cfg.beta2) * g * g;
            const double mh = m / (1 - std::pow(cfg.beta1, s + 1));
            const double vh = v / (1 - std::pow(cfg.beta2, s + 1));
            w = w * (decay ? 1 - cfg.lr * cfg.weight_decay : 1) -
                cfg.lr * mh / (std::sqrt(vh) + cfg.eps);
          } else {
            g += decay ? cfg.weight_decay * w : 0;
            m = cfg.momentum * m + g;
            w -= cfg.lr * m;
          }
        }
        expect.push_back(static_cast<float>(w));
      }
    }
    const double d = zt::max_rel_diff(expect, got.params[0]);
    CHECK_MESSAGE(d < 1e-4, "max relative difference to the formula: ", d);
  }
}

TEST_CASE("clipping uses the same global norm on every rank and in every stage") {
  const auto layout = small_model<float>();
  zt::run_options o;
  o.world = 4;
  o.clip = 0.05f;
  o.steps = 2;
  o.stage = 0;
  const auto reference = zt::train<float>(layout, o);
  REQUIRE(reference.steps[0].grad_norm > 0.05);  // the clip is active
  // The first step's gradient is known: recompute its norm directly.
  double sumsq = 0;
  const zt::zero::partition_plan plan(layout, 1, 0);
  for (std::size_t p = 0; p < plan.params().size(); ++p)
    for (std::size_t i = 0; i < plan.params()[p].numel; ++i) {
      double g = 0;
      for (int k = 0; k < zt::batch; ++k)
        g += zt::initial_value(static_cast<int>(p), i) -
             zt::initial_value(static_cast<int>(p) + 100, i) +
             0.1 * zt::noise(2, static_cast<std::uint64_t>(k), 0, i);
      sumsq += (g / zt::batch) * (g / zt::batch);
    }
  CHECK(reference.steps[0].grad_norm == doctest::Approx(std::sqrt(sumsq)).epsilon(1e-5));
  o.clip = 0;
  const auto unclipped = zt::train<float>(layout, o);
  CHECK(zt::max_rel_diff(unclipped.params[0], reference.params[0]) > 1e-4);
  o.clip = 0.05f;
  for (int stage = 1; stage <= 3; ++stage) {
    o.stage = stage;
    const auto got = zt::train<float>(layout, o);
    CHECK(got.params[2] == reference.params[0]);
    CHECK(got.steps[1].grad_norm == reference.steps[1].grad_norm);
  }
}

TEST_CASE("an overflow on one rank makes every rank skip the step and back the scale off") {
  const auto layout = small_model<float16>();
  for (int stage = 0; stage <= 3; ++stage) {
    CAPTURE(stage);
    zt::run_options o;
    o.world = 3;
    o.stage = stage;
    o.steps = 2;
    const auto before = zt::train<float16>(layout, o);
    o.steps = 3;
    // Rank 1 alone sees an inf, in step 2.
    o.poison = [](int rank, int step, int param, std::vector<float>& g) {
      if (rank == 1 && step == 2 && param == 2) g[7] = std::numeric_limits<float>::infinity();
    };
    const auto got = zt::train<float16>(layout, o);
    REQUIRE(got.steps.size() == 3);
    CHECK_FALSE(got.steps[1].skipped);
    CHECK(got.steps[2].skipped);
    CHECK(got.step_count == 3);
    // growth_interval 2: 1024 -> 1024 -> 2048 for the third step, which overflows.
    CHECK(got.steps[2].loss_scale == 2048.0f);
    for (int r = 0; r < 3; ++r)
      CHECK_MESSAGE(got.params[static_cast<std::size_t>(r)] == before.params[0], "rank ", r,
                    " changed its weights in a skipped step");
  }
}

TEST_CASE("a NaN gradient is skipped in bf16 too, without loss scaling") {
  const auto layout = small_model<bfloat16>();
  zt::run_options o;
  o.world = 2;
  o.stage = 2;
  o.steps = 1;
  o.poison = [](int rank, int, int param, std::vector<float>& g) {
    if (rank == 0 && param == 0) g[0] = std::numeric_limits<float>::quiet_NaN();
  };
  const auto got = zt::train<bfloat16>(layout, o);
  CHECK(got.steps[0].skipped);
  CHECK(got.steps[0].loss_scale == 1.0f);
  std::vector<float> initial;
  const zt::zero::partition_plan plan(layout, 1, 0);
  for (std::size_t p = 0; p < plan.params().size(); ++p)
    for (std::size_t i = 0; i < plan.params()[p].numel; ++i)
      initial.push_back(zt::initial_value(static_cast<int>(p), i));
  CHECK(got.params[1] == initial);
}

TEST_CASE("memory per rank matches the ZeRO formulas within 5%") {
  // Psi = 1,000,000 bf16 parameters with AdamW on 4 ranks, buckets of 1 MiB.
  const double psi = 1'000'000;
  const auto layout = zt::make_layout<bfloat16>({{400'000, 100'000}, {250'000, 250'000}});
  const double n = 4;
  const double formula[] = {16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n, 16 * psi / n};
  ringzero::loopback::world w(4);
  w.run([&](zt::communicator& comm) {
    zt::zero::config cfg;
    cfg.bucket_bytes = 1 << 20;
    cfg.reduce_dtype = ringzero::dtype::bfloat16;  // the formulas' 16-bit gradients
    for (int stage = 0; stage <= 3; ++stage) {
      cfg.stage = stage;
      zt::zero::sharder<zt::communicator, bfloat16> shd(comm, layout, cfg);
      // One step, so stage 3 gathers (and frees) buckets.
      for (int l = 0; l < 2; ++l) (void)shd.gather(l);
      shd.end_micro_batch();
      (void)shd.step();
      const auto m = shd.memory();
      const double state = static_cast<double>(m.parameters + m.gradients + m.optimizer);
      const double err = std::abs(state - formula[stage]) / formula[stage];
      CHECK_MESSAGE(err < 0.05, "stage ", stage, ": ", state, " bytes, formula ", formula[stage],
                    " (", 100 * err, "%)");
      const std::size_t bucket = shd.plan().max_bucket() * sizeof(bfloat16);
      const std::size_t configured = stage >= 2 ? 2 * bucket : 0;
      CHECK(m.buffers == configured);
      if (stage == 3) {
        CHECK(m.peak_buffers <= configured + 2 * bucket);
        CHECK(m.peak_buffers > configured);
      }
    }
  });
}

TEST_CASE("stage 3 keeps gathered parameters within the configured bound") {
  const auto layout = zt::make_layout<float>({{64}, {64}, {64}, {64}, {64}, {64}});
  ringzero::loopback::world w(2);
  w.run([&](zt::communicator& comm) {
    zt::zero::config cfg;
    cfg.stage = 3;
    cfg.bucket_bytes = 256;            // one layer per bucket
    cfg.max_gathered_bytes = 3 * 256;  // the current bucket and two prefetched
    zt::zero::sharder<zt::communicator, float> shd(comm, layout, cfg);
    for (int l = 0; l < 6; ++l) {
      auto g = shd.gather(l);
      CHECK(g.param(l).size() == 64);
      CHECK_THROWS_AS((void)g.param((l + 1) % 6), ringzero::invalid_argument);
    }
    for (int l = 5; l >= 0; --l) (void)shd.gather(l, zt::zero::pass::backward);
    const auto m = shd.memory();
    CHECK(m.peak_buffers - 2 * 256 <= 3 * 256);
    CHECK(m.peak_buffers - 2 * 256 >= 2 * 256);  // prefetch happened
  });
}

TEST_CASE("misuse is reported, not silently accepted") {
  const auto layout = small_model<float>();
  ringzero::loopback::world w(1);
  w.run([&](zt::communicator& comm) {
    zt::zero::config cfg;
    zt::zero::sharder<zt::communicator, float> shd(comm, layout, cfg);
    std::vector<float> g(37, 1.0f);
    shd.add_grad(0, g);
    CHECK_THROWS_AS(shd.add_grad(0, g), ringzero::invalid_argument);
    CHECK_THROWS_AS(shd.add_grad(1, g), ringzero::invalid_argument);  // wrong size
    CHECK_THROWS_AS((void)shd.step(), ringzero::invalid_argument);    // before end_micro_batch
    shd.end_micro_batch();
    CHECK_FALSE(shd.step().skipped);
    cfg.stage = 4;
    CHECK_THROWS_AS((zt::zero::sharder<zt::communicator, float>(comm, layout, cfg)),
                    ringzero::invalid_argument);
    cfg.stage = 1;
    CHECK_THROWS_AS((zt::zero::sharder<zt::communicator, bfloat16>(comm, layout, cfg)),
                    ringzero::invalid_argument);
  });
}

TEST_CASE("a rank failing mid-step makes the others fail promptly instead of waiting") {
  const auto layout = small_model<float>();
  ringzero::loopback::world w(3, {.timeout = std::chrono::seconds(60)});
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(w.run([&](zt::communicator& comm) {
    zt::zero::config cfg;
    cfg.bucket_bytes = 256;
    zt::zero::sharder<zt::communicator, float> shd(comm, layout, cfg);
    const auto& plan = shd.plan();
    for (int p = static_cast<int>(plan.params().size()) - 1; p >= 0; --p) {
      // Rank 1 dies halfway through backward, after some buckets were queued.
      if (comm.rank() == 1 && p == 2) throw std::runtime_error("rank 1 ran out of memory");
      std::vector<float> g(plan.params()[static_cast<std::size_t>(p)].numel, 1.0f);
      shd.add_grad(p, g);
    }
    shd.end_micro_batch();
    (void)shd.step();
  }),
                       "rank 1 ran out of memory", std::runtime_error);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
}

TEST_CASE("a bucket is queued for reduction as soon as backward has handed over its gradients") {
  // One gradient buffer: handing gradients over in backward order must reuse it bucket after
  // bucket, which only works if each bucket left for its reduce_scatter before the next began.
  const auto layout = zt::make_layout<float>({{64}, {64}, {64}, {64}});
  // The second half makes the sharder warn; the test does not need to see it.
  ringzero::log::set_level(ringzero::log::level::none);
  ringzero::loopback::world w(2);
  w.run([&](zt::communicator& comm) {
    zt::zero::config cfg;
    cfg.stage = 2;
    cfg.bucket_bytes = 256;
    cfg.reduce_buffers = 1;
    zt::zero::sharder<zt::communicator, float> shd(comm, layout, cfg);
    REQUIRE(shd.plan().buckets().size() == 4);
    const std::vector<float> g(64, 1.0f);
    for (int p = 3; p >= 0; --p) shd.add_grad(p, g);
    shd.end_micro_batch();
    (void)shd.step();
    CHECK(shd.memory().peak_buffers == 64 * sizeof(float));
    // Forward order: bucket 0 cannot be reduced before bucket 3, so buffers pile up.
    for (int p = 0; p < 4; ++p) shd.add_grad(p, g);
    shd.end_micro_batch();
    (void)shd.step();
    CHECK(shd.memory().peak_buffers == 4 * 64 * sizeof(float));
  });
  ringzero::log::set_level(ringzero::log::level::warn);
}

TEST_CASE("stage 3: a bucket gathered before step() is fresh after it (issue 13)") {
  // Two layers, 4 ranks: one extra gather(0) between end_micro_batch() and step() (logging,
  // evaluation) must not let the next forward use the pre-update weights.
  const auto layout = zt::make_layout<float>({{70, 9}, {33, 12}});
  zt::run_options o;
  o.world = 4;
  o.steps = 6;
  o.stage = 0;
  const auto reference = zt::train<float>(layout, o);
  o.stage = 3;
  o.gather_before_step = true;
  const auto got = zt::train<float>(layout, o);
  for (int r = 0; r < 4; ++r)
    CHECK_MESSAGE(got.params[static_cast<std::size_t>(r)] == reference.params[0], "rank ", r,
                  ": max rel diff to stage 0 ",
                  zt::max_rel_diff(got.params[0], reference.params[0]));
}

TEST_CASE("stage 3: a handle held across step() sees the updated weights") {
  const auto layout = zt::make_layout<float>({{70, 9}, {33, 12}});
  zt::run_options o;
  o.world = 3;
  o.steps = 2;
  o.stage = 3;
  o.gather_before_step = true;
  o.hold_across_step = true;
  const auto got = zt::train<float>(layout, o);
  const std::vector<float> first(got.params[0].begin(), got.params[0].begin() + 70);
  for (int r = 0; r < 3; ++r) CHECK(got.held[static_cast<std::size_t>(r)] == first);
  o.stage = 0;
  o.hold_across_step = false;
  o.gather_before_step = false;
  CHECK(zt::train<float>(layout, o).params[0] == got.params[0]);
}

TEST_CASE("a collective algorithm the sharder cannot use is refused at construction") {
  const auto layout = small_model<float>();
  ringzero::loopback::world w(2);
  w.run([&](zt::communicator& comm) {
    zt::zero::config cfg;
    cfg.stage = 2;
    cfg.collectives.reduce_scatter.algorithm = ringzero::algorithm::tree;
    CHECK_THROWS_WITH_AS((zt::zero::sharder<zt::communicator, float>(comm, layout, cfg)),
                         doctest::Contains("reduce_scatter"), ringzero::invalid_argument);
    cfg.collectives.reduce_scatter.algorithm = ringzero::algorithm::ring;
    cfg.collectives.all_gather.algorithm = ringzero::algorithm::recursive_halving_doubling;
    CHECK_THROWS_WITH_AS((zt::zero::sharder<zt::communicator, float>(comm, layout, cfg)),
                         doctest::Contains("all_gather"), ringzero::invalid_argument);
    cfg.collectives.all_gather.algorithm = ringzero::algorithm::hierarchical;
    CHECK_THROWS_AS((zt::zero::sharder<zt::communicator, float>(comm, layout, cfg)),
                    ringzero::invalid_argument);
    cfg.scaling.growth = std::numeric_limits<float>::infinity();
    cfg.collectives.all_gather.algorithm = ringzero::algorithm::ring;
    CHECK_THROWS_AS((zt::zero::sharder<zt::communicator, float>(comm, layout, cfg)),
                    ringzero::invalid_argument);
  });
}

TEST_CASE("each kind of collective takes its own algorithm") {
  // tree all_reduce, rhd reduce_scatter, rd all_gather: every stage still trains the same model
  // (to float tolerance: the all_reduce sums in another order than the reduce_scatter).
  const auto layout = small_model<float>();
  std::vector<std::vector<float>> w;
  for (int stage = 0; stage <= 3; ++stage) {
    ringzero::loopback::world world(4);
    std::vector<float> out;
    world.run([&](zt::communicator& comm) {
      zt::run_options o;
      o.world = 4;
      o.stage = stage;
      zt::zero::config cfg = zt::make_config(o);
      cfg.collectives.all_reduce.algorithm = ringzero::algorithm::tree;
      cfg.collectives.reduce_scatter.algorithm = ringzero::algorithm::recursive_halving_doubling;
      cfg.collectives.all_gather.algorithm = ringzero::algorithm::recursive_doubling;
      zt::zero::sharder<zt::communicator, float> shd(comm, layout, cfg);
      for (int s = 0; s < 2; ++s) {
        for (int p = static_cast<int>(shd.plan().params().size()) - 1; p >= 0; --p) {
          auto h = shd.gather(shd.plan().params()[static_cast<std::size_t>(p)].layer,
                              zt::zero::pass::backward);
          std::vector<float> g(h.param(p).begin(), h.param(p).end());
          for (auto& x : g) x = 0.25f * (x - 0.1f);
          shd.add_grad(p, std::span<const float>(g));
        }
        shd.end_micro_batch();
        CHECK_FALSE(shd.step().skipped);
      }
      auto full = shd.full_parameters();
      if (comm.rank() == 0) out = std::move(full);
    });
    w.push_back(out);
  }
  for (int stage = 1; stage <= 3; ++stage) {
    CAPTURE(stage);
    CHECK(zt::max_rel_diff(w[0], w[static_cast<std::size_t>(stage)]) < 1e-5);
  }
}

TEST_CASE("loss-scale growth stops at the largest finite scale") {
  const auto layout = zt::make_layout<float16>({{16}});
  ringzero::loopback::world w(2);
  w.run([&](zt::communicator& comm) {
    zt::zero::config cfg;
    cfg.stage = 1;
    cfg.scaling.initial = 0x1p127f;
    cfg.scaling.growth_interval = 1;
    zt::zero::sharder<zt::communicator, float16> shd(comm, layout, cfg);
    for (int s = 0; s < 3; ++s) {
      shd.end_micro_batch();  // no gradient: zero, a clean step
      CHECK_FALSE(shd.step().skipped);
      CHECK_MESSAGE(std::isfinite(shd.loss_scale()), "step ", s, ": scale ", shd.loss_scale());
    }
    CHECK(shd.loss_scale() == 0x1p127f);
  });
}

namespace {

/// One step on 4 ranks where rank r hands over `value(r)` for every element of one parameter of
/// 32 elements; returns rank 0's step result.
template <class P>
zt::zero::step_result one_step(int stage, std::optional<ringzero::dtype> reduce, float predivide,
                               float (*value)(int)) {
  zt::zero::model_layout layout;
  layout.add({.name = "w", .shape = {32}, .type = ringzero::dtype_of<P>()});
  zt::zero::step_result out;
  ringzero::loopback::world w(4);
  w.run([&](zt::communicator& comm) {
    zt::zero::config cfg;
    cfg.stage = stage;
    cfg.reduce_dtype = reduce;
    cfg.gradient_predivide = predivide;
    cfg.average_gradients = false;
    cfg.scaling.initial = 1.0f;
    cfg.scaling.dynamic = false;
    zt::zero::sharder<zt::communicator, P> shd(comm, layout, cfg);
    const std::vector<P> g(32, P(value(comm.rank())));
    shd.add_grad(0, std::span<const P>(g));
    shd.end_micro_batch();
    const auto r = shd.step();
    if (comm.rank() == 0) out = r;
  });
  return out;
}

}  // namespace

TEST_CASE("reduce_dtype float32 (the default): bf16 gradients summed without 16-bit rounding") {
  // 256 + 1 + 1 + 1: bf16 has 8 significant bits, so every partial sum rounds back to 256.
  auto value = [](int r) { return r == 0 ? 256.0f : 1.0f; };
  const double exact = 259.0 * std::sqrt(32.0);
  for (int stage : {0, 2, 3}) {
    CAPTURE(stage);
    const auto in16 = one_step<bfloat16>(stage, ringzero::dtype::bfloat16, 1.0f, value);
    const auto in32 = one_step<bfloat16>(stage, ringzero::dtype::float32, 1.0f, value);
    const auto by_default = one_step<bfloat16>(stage, std::nullopt, 1.0f, value);
    CHECK(in32.grad_norm == doctest::Approx(exact).epsilon(1e-6));
    CHECK(by_default.grad_norm == in32.grad_norm);
    CHECK(std::abs(in16.grad_norm - exact) > 1.0);
  }
}

TEST_CASE("fp16: a sum that overflows in fp16 is kept by fp32 reduction or by predividing") {
  // 4 x 30000 > 65504, fp16's largest value.
  auto value = [](int) { return 30000.0f; };
  const double exact = 120000.0 * std::sqrt(32.0);
  for (int stage : {1, 3}) {
    CAPTURE(stage);
    CHECK(one_step<float16>(stage, ringzero::dtype::float16, 1.0f, value).skipped);
    const auto in32 = one_step<float16>(stage, ringzero::dtype::float32, 1.0f, value);
    CHECK_FALSE(in32.skipped);
    CHECK(in32.grad_norm == doctest::Approx(exact).epsilon(1e-6));
    CHECK_FALSE(one_step<float16>(stage, std::nullopt, 1.0f, value).skipped);
    const auto pre = one_step<float16>(stage, ringzero::dtype::float16, 4.0f, value);
    CHECK_FALSE(pre.skipped);
    CHECK(pre.grad_norm == doctest::Approx(exact).epsilon(1e-3));
  }
}

TEST_CASE("fp32 reduction keeps the stages bitwise equal, and costs twice the gradient memory") {
  const auto layout = small_model<bfloat16>();
  std::vector<std::vector<float>> w;
  std::vector<std::size_t> grad_bytes;
  for (int stage = 0; stage <= 3; ++stage) {
    ringzero::loopback::world world(3);
    std::vector<float> out;
    world.run([&](zt::communicator& comm) {
      zt::run_options o;
      o.world = 3;
      o.stage = stage;
      auto cfg = zt::make_config(o);
      cfg.reduce_dtype = ringzero::dtype::float32;
      zt::zero::sharder<zt::communicator, bfloat16> shd(comm, layout, cfg);
      for (int s = 0; s < 2; ++s) {
        for (int p = static_cast<int>(shd.plan().params().size()) - 1; p >= 0; --p) {
          std::vector<float> g(shd.plan().params()[static_cast<std::size_t>(p)].numel);
          for (std::size_t i = 0; i < g.size(); ++i)
            g[i] = zt::noise(7, static_cast<std::uint64_t>(comm.rank()),
                             static_cast<std::uint64_t>(p * 100 + s), i);
          shd.add_grad(p, std::span<const float>(g));
        }
        shd.end_micro_batch();
        (void)shd.step();
      }
      auto full = shd.full_parameters();
      if (comm.rank() == 0) {
        out = std::move(full);
        grad_bytes.push_back(shd.memory().gradients);
      }
    });
    w.push_back(out);
  }
  for (int stage = 1; stage <= 3; ++stage) CHECK(w[static_cast<std::size_t>(stage)] == w[0]);
  const zt::zero::partition_plan plan(layout, 3, 256 / sizeof(bfloat16), 16);
  CHECK(grad_bytes[0] == plan.padded_size() * sizeof(float));
  CHECK(grad_bytes[3] == plan.shard_size() * sizeof(float));
}

TEST_CASE("precision settings that cannot work are refused") {
  const auto layout = small_model<bfloat16>();
  ringzero::loopback::world w(1);
  w.run([&](zt::communicator& comm) {
    zt::zero::config cfg;
    cfg.reduce_dtype = ringzero::dtype::float16;
    CHECK_THROWS_AS((zt::zero::sharder<zt::communicator, bfloat16>(comm, layout, cfg)),
                    ringzero::invalid_argument);
    cfg.reduce_dtype = ringzero::dtype::bfloat16;
    CHECK_NOTHROW((zt::zero::sharder<zt::communicator, bfloat16>(comm, layout, cfg)));
    cfg.gradient_predivide = 0.0f;
    CHECK_THROWS_AS((zt::zero::sharder<zt::communicator, bfloat16>(comm, layout, cfg)),
                    ringzero::invalid_argument);
  });
}

TEST_CASE("parameter groups: per-group learning rate and weight decay, frozen parameters") {
  // Layer 1 in group 1; the harness's gradient of an element depends only on that element, so
  // each group trains as it would alone.
  const auto grouped = zt::make_layout<float>({{37, 5}, {129}, {3, 61, 1}},
                                              [](int layer, int) { return layer == 1 ? 1 : 0; });
  const auto plain = small_model<float>();
  zt::run_options o;
  o.world = 3;
  o.steps = 3;
  const auto base = zt::train<float>(plain, o);
  const std::size_t l1_begin = 37 + 5, l1_end = l1_begin + 129;
  auto slice = [](const std::vector<float>& v, std::size_t a, std::size_t b) {
    return std::vector<float>(v.begin() + static_cast<std::ptrdiff_t>(a),
                              v.begin() + static_cast<std::ptrdiff_t>(b));
  };
  SUBCASE("frozen") {
    for (int stage : {0, 3}) {
      o.stage = stage;
      o.configure = [](zt::zero::config& c) {
        c.groups = {{.name = "main"}, {.name = "emb", .frozen = true}};
      };
      const auto got = zt::train<float>(grouped, o);
      std::vector<float> initial;
      for (std::size_t i = 0; i < 129; ++i) initial.push_back(zt::initial_value(2, i));
      CHECK(slice(got.params[0], l1_begin, l1_end) == initial);
      CHECK(slice(got.params[0], 0, l1_begin) == slice(base.params[0], 0, l1_begin));
      CHECK(slice(got.params[0], l1_end, got.params[0].size()) ==
            slice(base.params[0], l1_end, base.params[0].size()));
    }
  }
  SUBCASE("another learning rate, weight decay and betas") {
    o.stage = 3;
    o.configure = [](zt::zero::config& c) {
      c.groups = {
          {.name = "main"},
          {.name = "slow", .lr = 0.01f, .weight_decay = 0.5f, .beta1 = 0.5f, .beta2 = 0.9f}};
    };
    const auto got = zt::train<float>(grouped, o);
    zt::run_options alone = o;
    alone.configure = [](zt::zero::config& c) {
      c.optimizer.lr = 0.01f;
      c.optimizer.weight_decay = 0.5f;
      c.optimizer.beta1 = 0.5f;
      c.optimizer.beta2 = 0.9f;
    };
    const auto slow = zt::train<float>(plain, alone);
    CHECK(slice(got.params[0], l1_begin, l1_end) == slice(slow.params[0], l1_begin, l1_end));
    CHECK(slice(got.params[0], 0, l1_begin) == slice(base.params[0], 0, l1_begin));
  }
}

TEST_CASE("a frozen parameter takes no gradient, and bad groups are refused") {
  const auto layout = zt::make_layout<float>({{8}, {8}}, [](int l, int) { return l; });
  ringzero::loopback::world w(1);
  w.run([&](zt::communicator& comm) {
    zt::zero::config cfg;
    cfg.groups = {{.name = "a"}, {.name = "b", .frozen = true}};
    zt::zero::sharder<zt::communicator, float> shd(comm, layout, cfg);
    const std::vector<float> g(8, 1.0f);
    CHECK_THROWS_WITH_AS(shd.add_grad(1, g), doctest::Contains("frozen"),
                         ringzero::invalid_argument);
    shd.add_grad(0, g);
    cfg.groups = {{.name = "a"}};
    CHECK_THROWS_AS((zt::zero::sharder<zt::communicator, float>(comm, layout, cfg)),
                    ringzero::invalid_argument);  // parameter in group 1 of 1
    cfg.groups = {{.name = "a"}, {.name = "a"}};
    CHECK_THROWS_WITH_AS((zt::zero::sharder<zt::communicator, float>(comm, layout, cfg)),
                         doctest::Contains("two groups are called a"), ringzero::invalid_argument);
    cfg.groups = {{.name = "a"}, {.name = "b", .beta2 = 1.0f}};
    CHECK_THROWS_WITH_AS((zt::zero::sharder<zt::communicator, float>(comm, layout, cfg)),
                         doctest::Contains("group b: beta2 1"), ringzero::invalid_argument);
    cfg.groups = {{.name = "a"}, {.name = "b c"}};
    CHECK_THROWS_WITH_AS((zt::zero::sharder<zt::communicator, float>(comm, layout, cfg)),
                         doctest::Contains("without whitespace"), ringzero::invalid_argument);
  });
}

TEST_CASE("warmup + cosine schedule") {
  const auto f = zt::zero::warmup_cosine(4, 12, 0.1f);
  CHECK(f(0) == 0.25f);
  CHECK(f(3) == 1.0f);
  CHECK(f(4) == doctest::Approx(1.0));
  CHECK(f(8) == doctest::Approx(0.1 + 0.9 * 0.5));
  CHECK(f(12) == 0.1f);
  CHECK(f(100) == 0.1f);
  for (std::uint64_t s = 4; s < 12; ++s) CHECK(f(s + 1) <= f(s));
}

TEST_CASE("the schedule drives every group; a resume continues it and the learning rates") {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("ringzero-zero-schedule-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const auto grouped = zt::make_layout<float>({{37, 5}, {129}, {3, 61, 1}},
                                              [](int layer, int) { return layer == 1 ? 1 : 0; });
  zt::run_options o;
  o.world = 2;
  o.stage = 3;
  o.steps = 6;
  o.configure = [](zt::zero::config& c) {
    c.groups = {{.name = "main"}, {.name = "head", .lr = 0.02f}};
    c.schedule = zt::zero::warmup_cosine(2, 6);
  };
  const auto full = zt::train<float>(grouped, o);
  // Without the schedule the run differs (the schedule is applied).
  zt::run_options flat = o;
  flat.configure = [](zt::zero::config& c) {
    c.groups = {{.name = "main"}, {.name = "head", .lr = 0.02f}};
  };
  CHECK(zt::train<float>(grouped, flat).params[0] != full.params[0]);
  // Save after 3 steps, resume for 3: bitwise the uninterrupted run.
  o.steps = 3;
  o.save_dir = dir;
  (void)zt::train<float>(grouped, o);
  const auto m = zt::zero::checkpoint_manifest::read(dir);
  REQUIRE(m.groups.size() == 2);
  CHECK(m.groups[1].name == "head");
  CHECK(m.groups[1].lr == 0.02f);
  o.save_dir.clear();
  o.load_dir = dir;
  const auto resumed = zt::train<float>(grouped, o);
  CHECK(resumed.params[0] == full.params[0]);
  std::filesystem::remove_all(dir);
}

TEST_CASE("group learning rates set by the trainer are saved and restored") {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("ringzero-zero-grouplr-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const auto layout = zt::make_layout<float>({{8}, {8}}, [](int l, int) { return l; });
  ringzero::loopback::world w(2);
  w.run([&](zt::communicator& comm) {
    zt::zero::config cfg;
    cfg.groups = {{.name = "a"}, {.name = "b", .lr = 0.5f}};
    cfg.schedule = zt::zero::warmup_cosine(10, 100);
    {
      zt::zero::sharder<zt::communicator, float> shd(comm, layout, cfg);
      shd.set_learning_rate(1, 0.25f);
      shd.end_micro_batch();
      (void)shd.step();
      CHECK(shd.learning_rate(1) == 0.25f * 0.2f);
      shd.save(dir);
    }
    zt::zero::sharder<zt::communicator, float> back(comm, layout, cfg);
    CHECK(back.learning_rate(1) == 0.5f * 0.1f);
    back.load(dir);
    CHECK(back.step_count() == 1);
    CHECK(back.learning_rate(1) == 0.25f * 0.2f);
    CHECK(back.learning_rate(0) == cfg.optimizer.lr * 0.2f);
    CHECK_THROWS_AS((void)back.learning_rate(2), ringzero::invalid_argument);
  });
  std::filesystem::remove_all(dir);
}

TEST_CASE("each step moves each group by its own learning rate times the schedule") {
  // SGD without momentum or decay and a gradient of ones: a step moves every weight of group g
  // by exactly -learning_rate(g).
  const auto layout = zt::make_layout<float>({{8}, {8}}, [](int l, int) { return l; });
  for (int stage : {0, 2, 3}) {
    CAPTURE(stage);
    ringzero::loopback::world w(2);
    w.run([&](zt::communicator& comm) {
      zt::zero::config cfg;
      cfg.stage = stage;
      cfg.optimizer = {.kind = optimizer_kind::sgd, .lr = 0.25f, .momentum = 0.0f};
      cfg.groups = {{.name = "a"}, {.name = "b", .lr = 0.5f}};
      cfg.schedule = zt::zero::warmup_cosine(2, 5, 0.1f);
      zt::zero::sharder<zt::communicator, float> shd(comm, layout, cfg);
      const std::vector<float> ones(8, 1.0f);
      auto before = shd.full_parameters();
      const float expect[][2] = {{0.125f, 0.25f}, {0.25f, 0.5f}};
      for (int s = 0; s < 7; ++s) {
        const float lr[2] = {shd.learning_rate(0), shd.learning_rate(1)};
        CHECK(lr[0] == 0.25f * cfg.schedule(static_cast<std::uint64_t>(s)));
        CHECK(lr[1] == 0.5f * cfg.schedule(static_cast<std::uint64_t>(s)));
        if (s < 2) {
          CHECK(lr[0] == expect[s][0]);
          CHECK(lr[1] == expect[s][1]);
        }
        if (s >= 5) CHECK(lr[1] == doctest::Approx(0.05f));
        if (stage == 3) {
          auto g = shd.gather(1, zt::zero::pass::backward);
          shd.add_grad(1, ones);
          auto g0 = shd.gather(0, zt::zero::pass::backward);
          shd.add_grad(0, ones);
        } else {
          shd.add_grad(1, ones);
          shd.add_grad(0, ones);
        }
        shd.end_micro_batch();
        REQUIRE_FALSE(shd.step().skipped);
        const auto after = shd.full_parameters();
        for (std::size_t i = 0; i < after.size(); ++i)
          CHECK(after[i] == doctest::Approx(before[i] - lr[i / 8]).epsilon(1e-6));
        before = after;
      }
    });
  }
}

namespace {

// A token embedding reused by the output head (tied weights), with a layer between them. Every
// gradient is a sum of multiples of 1/256 small enough to be exact in fp32, so no summation
// order (ranks, stages, the two uses of the tied weight) changes a bit: runs at every stage and
// world size must end bitwise identical.
struct tied_model {
  zt::zero::model_layout layout;
  int embed = 0, mid = 0, head = 0;
};

/// `tied`: the head layer share()s the embedding. Otherwise the head layer does not declare it,
/// and the trainer sums the two uses' gradients itself: the serial reference (stage 0 only,
/// where every parameter is present in every handle).
tied_model make_tied(bool tied) {
  tied_model m;
  m.layout.add_layer("embed");
  m.embed = m.layout.add({.name = "wte", .shape = {37}});
  m.layout.add_layer("mid");
  m.mid = m.layout.add({.name = "mid.w", .shape = {129}});
  m.layout.add_layer("head");
  if (tied) m.layout.share(m.embed);
  m.head = m.layout.add({.name = "head.b", .shape = {23}, .weight_decay = false});
  return m;
}

float quantized(float x) {
  return std::round(x * 256.0f) / 256.0f;
}

struct tied_run {
  zt::run_options o;
  bool tied = true;
  std::filesystem::path save_dir, load_dir;
};

zt::run_result train_tied(const tied_run& t) {
  const tied_model m = make_tied(t.tied);
  const auto& o = t.o;
  zt::run_result res;
  res.params.resize(static_cast<std::size_t>(o.world));
  res.memory.resize(static_cast<std::size_t>(o.world));
  ringzero::loopback::world w(o.world);
  w.run([&](zt::communicator& comm) {
    zt::zero::sharder<zt::communicator, float> shd(comm, m.layout, zt::make_config(o));
    for (int p : {m.embed, m.mid, m.head}) {
      std::vector<float> v(shd.plan().params()[static_cast<std::size_t>(p)].numel);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = zt::initial_value(p, i);
      shd.set_parameter(p, v);
    }
    if (!t.load_dir.empty()) shd.load(t.load_dir);
    const int per = zt::batch / o.world;
    const int first_sample = comm.rank() * per;
    // This rank's share of the batch sum of (scale * quantized(w) - target(sample)).
    const auto grad = [&](std::span<const float> wv, float scale, int use, int s) {
      std::vector<float> g(wv.size());
      for (std::size_t i = 0; i < wv.size(); ++i)
        for (int k = first_sample; k < first_sample + per; ++k)
          g[i] += scale * quantized(wv[i]) -
                  quantized(zt::noise(3, static_cast<std::uint64_t>(use),
                                      static_cast<std::uint64_t>(k * 100 + s), i));
      return g;
    };
    const int first = static_cast<int>(shd.step_count());
    for (int s = first; s < first + o.steps; ++s) {
      for (int l = 0; l < 3; ++l) (void)shd.gather(l);
      std::vector<float> from_head;
      {
        auto h = shd.gather(2, zt::zero::pass::backward);
        shd.add_grad(m.head, std::span<const float>(grad(h.param(m.head), 1.0f, 0, s)));
        // The head reads the tied weight through its own handle; untied, stage 3 must gather
        // the embedding's layer for it.
        std::optional<zt::zero::sharder<zt::communicator, float>::gathered> e;
        if (!t.tied) e.emplace(shd.gather(0, zt::zero::pass::recompute));
        from_head = grad((t.tied ? h : *e).param(m.embed), 2.0f, 1, s);
        if (t.tied) shd.add_grad(m.embed, std::span<const float>(from_head));
      }
      {
        auto h = shd.gather(1, zt::zero::pass::backward);
        shd.add_grad(m.mid, std::span<const float>(grad(h.param(m.mid), 0.5f, 2, s)));
      }
      {
        auto h = shd.gather(0, zt::zero::pass::backward);
        auto from_embed = grad(h.param(m.embed), 1.0f, 3, s);
        if (!t.tied)
          for (std::size_t i = 0; i < from_embed.size(); ++i) from_embed[i] += from_head[i];
        shd.add_grad(m.embed, std::span<const float>(from_embed));
      }
      shd.end_micro_batch();
      const auto r = shd.step();
      if (comm.rank() == 0) res.steps.push_back(r);
    }
    if (!t.save_dir.empty()) shd.save(t.save_dir);
    res.params[static_cast<std::size_t>(comm.rank())] = shd.full_parameters();
    res.memory[static_cast<std::size_t>(comm.rank())] = shd.memory();
  });
  return res;
}

}  // namespace

TEST_CASE("a tied weight: stages 0-3 on 1, 2, 3 ranks equal the serial sum of its uses") {
  tied_run ref;
  ref.tied = false;
  ref.o.world = 1;
  ref.o.stage = 0;
  ref.o.steps = 3;
  const auto reference = train_tied(ref);
  for (int world : {1, 2, 3})
    for (int stage = 0; stage <= 3; ++stage) {
      CAPTURE(world);
      CAPTURE(stage);
      tied_run t;
      t.o.world = world;
      t.o.stage = stage;
      t.o.steps = 3;
      // Stage 3 with room for one bucket: the head's gather must bring the embedding back.
      t.o.configure = [](zt::zero::config& c) { c.max_gathered_bytes = 1; };
      const auto got = train_tied(t);
      for (int r = 0; r < world; ++r)
        CHECK_MESSAGE(
            got.params[static_cast<std::size_t>(r)] == reference.params[0], "rank ", r,
            ": max rel diff ",
            zt::max_rel_diff(got.params[static_cast<std::size_t>(r)], reference.params[0]));
    }
}

TEST_CASE("a tied weight is one parameter: memory, numel and checkpoints count it once") {
  const tied_model m = make_tied(true);
  const zt::zero::partition_plan plan(m.layout, 2, 64);
  CHECK(plan.params().size() == 3);
  CHECK(plan.numel() == 37 + 129 + 23);
  // The same model without the share() declaration holds exactly as much.
  for (int stage = 0; stage <= 3; ++stage) {
    CAPTURE(stage);
    tied_run t;
    t.o.world = 2;
    t.o.stage = stage;
    t.o.steps = 1;
    const auto tied = train_tied(t).memory[1];
    t.tied = false;
    const auto untied = train_tied(t).memory[1];
    CHECK(tied.parameters == untied.parameters);
    CHECK(tied.gradients == untied.gradients);
    CHECK(tied.optimizer == untied.optimizer);
  }

  // Saved after 2 steps on 2 ranks at stage 3, resumed on 3 ranks at stage 1: bitwise the
  // uninterrupted run, with one checkpoint entry for the tied weight.
  const auto dir =
      std::filesystem::temp_directory_path() / ("ringzero-zero-tied-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  tied_run t;
  t.o.world = 2;
  t.o.stage = 3;
  t.o.steps = 3;
  const auto full = train_tied(t);
  t.o.steps = 2;
  t.save_dir = dir;
  (void)train_tied(t);
  const auto manifest = zt::zero::checkpoint_manifest::read(dir);
  CHECK(manifest.params.size() == 3);
  CHECK(std::count_if(manifest.params.begin(), manifest.params.end(),
                      [](const auto& p) { return p.name == "wte"; }) == 1);
  t.save_dir.clear();
  t.load_dir = dir;
  t.o.world = 3;
  t.o.stage = 1;
  t.o.steps = 1;
  const auto resumed = train_tied(t);
  CHECK(resumed.params[2] == full.params[0]);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a tied weight: a gradient per use, no more; the handle of the sharing layer reads it") {
  const tied_model m = make_tied(true);
  ringzero::loopback::world w(2);
  w.run([&](zt::communicator& comm) {
    zt::run_options o;
    o.stage = 3;
    zt::zero::sharder<zt::communicator, float> shd(comm, m.layout, zt::make_config(o));
    std::vector<float> v(37);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
    shd.set_parameter(m.embed, v);
    {
      const auto h = shd.gather(2);
      const auto wte = h.param(m.embed);
      CHECK(std::vector<float>(wte.begin(), wte.end()) == v);
      CHECK_THROWS_AS((void)h.param(m.mid), ringzero::invalid_argument);
    }
    const std::vector<float> g(37, 1.0f);
    shd.add_grad(m.embed, std::span<const float>(g));
    shd.add_grad(m.embed, std::span<const float>(g));
    CHECK_THROWS_WITH_AS(shd.add_grad(m.embed, std::span<const float>(g)),
                         "ringzero: add_grad: wte was already added 2 times in this micro-batch, "
                         "once per layer using it",
                         ringzero::invalid_argument);
    shd.end_micro_batch();
    (void)shd.step();
  });
}

namespace {

// Four layers of 16 floats, one bucket each, all the same size: an all_gather of one bucket
// pairs with an all_gather of any other without complaint from the collective itself.
zt::zero::model_layout four_equal_layers() {
  return zt::make_layout<float>({{16}, {16}, {16}, {16}});
}

struct recompute_run {
  std::vector<float> params;
  std::uint32_t collectives = 0;  // rank 0's, over the whole run
};

/// Stage `stage` on 2 ranks with activation recomputation: backward gathers the last layer, then
/// recomputes the forward of layers 0-2 (gathering them with `again`) before their backward.
/// Room for two buckets: backward at layer 3 prefetches layer 2.
recompute_run train_recompute(int stage, zt::zero::pass again) {
  const auto layout = four_equal_layers();
  const zt::zero::partition_plan plan(layout, 2, 16);
  zt::run_options o;
  o.world = 2;
  o.stage = stage;
  o.bucket_bytes = 64;
  o.configure = [&](zt::zero::config& c) {
    c.max_gathered_bytes = 2 * plan.max_bucket() * sizeof(float);
  };
  recompute_run res;
  ringzero::loopback::world w(2);
  w.run([&](zt::communicator& comm) {
    zt::zero::sharder<zt::communicator, float> shd(comm, layout, zt::make_config(o));
    REQUIRE(shd.plan().buckets().size() == 4);
    for (int p = 0; p < 4; ++p) {
      std::vector<float> v(16);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = zt::initial_value(p, i);
      shd.set_parameter(p, v);
    }
    const auto backward = [&](int l, int s) {
      auto h = shd.gather(l, zt::zero::pass::backward);
      const auto wv = h.param(l);
      std::vector<float> g(wv.size());
      for (std::size_t i = 0; i < g.size(); ++i)
        g[i] = wv[i] - zt::initial_value(l + 100, i) +
               0.1f * zt::noise(4, static_cast<std::uint64_t>(comm.rank()),
                                static_cast<std::uint64_t>(s), i);
      shd.add_grad(l, std::span<const float>(g));
    };
    const std::uint32_t before = comm.state().collective_seq;
    for (int s = 0; s < 3; ++s) {
      for (int l = 0; l < 4; ++l) (void)shd.gather(l);
      backward(3, s);
      for (int l = 0; l < 3; ++l) (void)shd.gather(l, again);
      for (int l = 2; l >= 0; --l) backward(l, s);
      shd.end_micro_batch();
      (void)shd.step();
    }
    if (comm.rank() == 0) res.collectives = comm.state().collective_seq - before;
    auto full = shd.full_parameters();
    if (comm.rank() == 0) res.params = std::move(full);
  });
  return res;
}

/// Runs `body` on every rank of a 3-rank world with RINGZERO_CHECK=1 and a short deadline, and
/// returns what each rank's mismatch_error said ("" for none).
template <class F>
std::vector<std::string> mismatches(F body) {
  const test_support::scoped_env check("RINGZERO_CHECK", "1");
  const auto layout = four_equal_layers();
  zt::run_options o;
  o.world = 3;
  o.stage = 3;
  o.bucket_bytes = 64;
  std::vector<std::string> said(3);
  ringzero::loopback::world w(3, {.timeout = std::chrono::seconds(20)});
  w.run([&](zt::communicator& comm) {
    zt::zero::sharder<zt::communicator, float> shd(comm, layout, zt::make_config(o));
    try {
      body(comm.rank(), shd);
    } catch (const ringzero::mismatch_error& e) {
      said[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  return said;
}

}  // namespace

TEST_CASE("recomputation inside backward keeps what backward prefetched, bitwise as stage 0") {
  const auto reference = train_recompute(0, zt::zero::pass::recompute);
  const auto recomputed = train_recompute(3, zt::zero::pass::recompute);
  CHECK(recomputed.params == reference.params);
  // Gathering the recomputation as backward frees the prefetched layer 2 and gathers it again:
  // the same weights, one all_gather more per step.
  const auto as_backward = train_recompute(3, zt::zero::pass::backward);
  CHECK(as_backward.params == reference.params);
  CHECK(recomputed.collectives < as_backward.collectives);
}

TEST_CASE("RINGZERO_CHECK: a rank gathering another layer fails on every rank, naming both") {
  const auto said = mismatches([](int rank, auto& shd) {
    (void)shd.gather(0);
    (void)shd.gather(rank == 1 ? 2 : 1);
    (void)shd.gather(3);
  });
  for (const auto& s : said) {
    CAPTURE(s);
    CHECK(test_support::contains(
        s, "rank 0 gathers layer 1 'layer1' (bucket 1, forward pass, gather #1)"));
    CHECK(test_support::contains(
        s, "rank 1 gathers layer 2 'layer2' (bucket 2, forward pass, gather #1)"));
  }
}

TEST_CASE("RINGZERO_CHECK: a rank skipping a gather, or in another pass, fails on every rank") {
  auto said = mismatches([](int rank, auto& shd) {
    for (int l = 0; l < 4; ++l)
      if (rank != 2 || l != 1) (void)shd.gather(l);
  });
  for (const auto& s : said) {
    CAPTURE(s);
    CHECK(test_support::contains(s, "rank 2 gathers layer 2 'layer2'"));
  }
  said = mismatches([](int rank, auto& shd) {
    (void)shd.gather(3, rank == 0 ? zt::zero::pass::recompute : zt::zero::pass::backward);
  });
  for (const auto& s : said) {
    CAPTURE(s);
    CHECK(test_support::contains(s, "rank 0 gathers layer 3 'layer3' (bucket 3, recompute pass"));
    CHECK(test_support::contains(s, "rank 1 gathers layer 3 'layer3' (bucket 3, backward pass"));
  }
  // Rank 1 reduces its gradients while the others gather: the collectives' own check sees an
  // all_gather against a reduce_scatter.
  said = mismatches([](int rank, auto& shd) {
    if (rank != 1) (void)shd.gather(3, zt::zero::pass::backward);
    const std::vector<float> g(16, 1.0f);
    for (int p = 3; p >= 0; --p) shd.add_grad(p, std::span<const float>(g));
    shd.end_micro_batch();
    (void)shd.step();
  });
  for (const auto& s : said) {
    CAPTURE(s);
    CHECK(test_support::contains(s, "RINGZERO_CHECK"));
    CHECK(test_support::contains(s, "reduce_scatter"));
  }
  CHECK(test_support::contains(said[0], "rank 0 was gathering layer 'layer3'"));
  CHECK(said[0].starts_with("ringzero: RINGZERO_CHECK: rank 0 called all_gather"));
}

namespace {

/// A loopback transport that says it runs some collectives itself (as the native shm transport
/// does) and counts the calls it is offered, running none of them.
struct offering_transport : ringzero::testing::recording<ringzero::loopback::transport> {
  using recording::recording;
  std::shared_ptr<std::atomic<int>> offered = std::make_shared<std::atomic<int>>(0);
  bool try_native(const ringzero::native_call&, const ringzero::options&) {
    ++*offered;
    return false;
  }
};
static_assert(ringzero::some_native_collectives<offering_transport>);

}  // namespace

TEST_CASE("the communicator names the sharder's fixed-order algorithm") {
  using ringzero::algorithm;
  using ringzero::collective;
  ringzero::loopback::world w(2);
  w.run([&](zt::communicator& c) {
    // Messages only: the ring where it runs the collective, automatic where it does not.
    CHECK(c.fixed_order_algorithm(collective::all_reduce) == algorithm::ring);
    CHECK(c.fixed_order_algorithm(collective::reduce_scatter) == algorithm::ring);
    CHECK(c.fixed_order_algorithm(collective::all_gather) == algorithm::ring);
    CHECK(c.fixed_order_algorithm(collective::gather) == algorithm::automatic);
    for (int k = 0; k <= static_cast<int>(collective::scatter); ++k) {
      const auto kind = static_cast<collective>(k);
      CAPTURE(ringzero::collective_name(kind));
      CHECK((c.fixed_order_algorithm(kind) == algorithm::ring) ==
            ringzero::algorithms::ring::descriptor::implements.contains(kind));
    }
    // A transport with collectives of its own runs them on its world of more than one rank,
    // not on a communicator split from it.
    ringzero::communicator<offering_transport> comm(offering_transport(c.transport()));
    CHECK(comm.fixed_order_algorithm(collective::all_reduce) == algorithm::automatic);
    auto half = comm.split(comm.rank(), 0);
    REQUIRE(half.has_value());
    CHECK(half->comm_id() != 0);
    CHECK(half->fixed_order_algorithm(collective::all_reduce) == algorithm::ring);
  });
}

TEST_CASE("collectives left unset go to the transport's own; a named ring stays the ring") {
  const auto layout = small_model<float>();
  const auto run = [&](std::optional<ringzero::algorithm> named) {
    int offered = 0;
    ringzero::algorithm resolved{};
    ringzero::loopback::world w(2);
    w.run([&](zt::communicator& c) {
      ringzero::communicator<offering_transport> comm(offering_transport(c.transport()));
      zt::run_options o;
      o.world = 2;
      o.stage = 1;
      auto cfg = zt::make_config(o);
      if (named)
        for (auto* x : {&cfg.collectives.all_reduce, &cfg.collectives.reduce_scatter,
                        &cfg.collectives.all_gather})
          x->algorithm = *named;
      zt::zero::sharder<ringzero::communicator<offering_transport>, float> shd(comm, layout, cfg);
      for (int p = static_cast<int>(shd.plan().params().size()) - 1; p >= 0; --p) {
        std::vector<float> g(shd.plan().params()[static_cast<std::size_t>(p)].numel, 0.25f);
        shd.add_grad(p, std::span<const float>(g));
      }
      shd.end_micro_batch();
      (void)shd.step();
      if (comm.rank() == 0) {
        offered = *comm.transport().offered;
        resolved = shd.configuration().collectives.all_reduce.algorithm;
      }
    });
    return std::pair(offered, resolved);
  };
  const auto [unset_offered, unset_algo] = run(std::nullopt);
  CHECK(unset_offered > 0);
  CHECK(unset_algo == ringzero::algorithm::automatic);
  const auto [ring_offered, ring_algo] = run(ringzero::algorithm::ring);
  CHECK_MESSAGE(ring_offered == 0, "a named ring was handed to the transport's own collectives");
  CHECK(ring_algo == ringzero::algorithm::ring);
  // On a transport with no collectives of its own, unset is the ring (the stages then agree).
  ringzero::loopback::world w(1);
  w.run([&](zt::communicator& comm) {
    zt::zero::sharder<zt::communicator, float> shd(comm, layout, zt::zero::config{});
    CHECK(shd.configuration().collectives.all_reduce.algorithm == ringzero::algorithm::ring);
    CHECK(shd.configuration().reduce_dtype == ringzero::dtype::float32);
  });
}
