#include <doctest/doctest.h>

#include <ringzero/transport/loopback.hpp>
#include <ringzero/zero/step.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

namespace zero = ringzero::zero;
using ringzero::float16;
using ringzero::loopback::communicator;

namespace {

// Two parameters of 4 elements, "a" in group 0 and "b" in group 1: 8-element buckets, so at
// world 2 each rank owns half of each.
template <class P>
zero::model_layout layout() {
  zero::model_layout l;
  l.add_layer("layer");
  l.add({.name = "a", .shape = {4}, .type = ringzero::dtype_of<P>(), .group = 0});
  l.add({.name = "b", .shape = {4}, .type = ringzero::dtype_of<P>(), .group = 1});
  return l;
}

// Plain SGD (no momentum, no decay) at lr 0.5, group b at 0.25: a step moves a weight by exactly
// its learning rate times its gradient.
zero::config two_groups() {
  zero::config c;
  c.optimizer = {.kind = zero::optimizer_kind::sgd, .lr = 0.5f, .momentum = 0.0f};
  c.groups = {{.name = "a"}, {.name = "b", .lr = 0.25f}};
  return c;
}

/// Reduced gradients made by hand: one value per flat position, whatever the stage.
struct fake_grads {
  std::vector<float> flat;
  int started = 0;
  void add_stats(const std::vector<zero::segment>& segs, float scale, double& sumsq,
                 bool& nonfinite) const noexcept {
    for (const auto& s : segs)
      zero::grad_stats(flat.data() + s.flat_offset, s.count, scale, sumsq, nonfinite);
  }
  void start_step() noexcept { ++started; }
  [[nodiscard]] const float* gradient(const zero::segment& s) const noexcept {
    return flat.data() + s.flat_offset;
  }
};

/// Runs f(comm, plan, state, run) on every rank; the state's weights all 1.
template <class P, class F>
void with_state(int world, int stage, const zero::config& cfg, F f) {
  const auto l = layout<P>();
  ringzero::loopback::world(world).run([&](communicator& comm) {
    const zero::partition_plan plan(l, world, 8, 4);
    zero::model_state<P> st(plan, zero::stage_of(stage), comm.rank(), cfg.optimizer);
    const std::vector<float> ones(4, 1.0f);
    st.set(0, ones);
    st.set(1, ones);
    auto run = [&](auto&& step) { return step(comm); };
    f(comm, plan, st, run);
  });
}

const ringzero::options gather_options = zero::collective_options{}.all_gather;

}  // namespace

TEST_CASE("gradient_unscale undoes the loss scale, the predivide and the average") {
  zero::config c;
  c.accumulation_steps = 2;
  c.gradient_predivide = 8.0f;
  CHECK(zero::gradient_unscale(c, 4, 1024.0f) == 1.0f / 1024.0f);
  c.average_gradients = false;
  CHECK(zero::gradient_unscale(c, 4, 1024.0f) == 8.0f / 1024.0f);
}

TEST_CASE("clip_factor brings the norm within the bound and leaves a smaller one alone") {
  const float clip = zero::clip_factor(1.0f, 5.0);
  CHECK(clip == static_cast<float>(1.0 / (5.0 + 1e-6)));
  CHECK(5.0 * clip < 1.0);
  CHECK(zero::clip_factor(10.0f, 5.0) == 1.0f);
  CHECK(zero::clip_factor(0.0f, 5.0) == 1.0f);  // 0: no clipping
}

TEST_CASE("agree_gradient_stats sums the squares and spreads an overflow to every rank") {
  ringzero::loopback::world(3).run([](communicator& comm) {
    const auto o = zero::collective_options{}.all_reduce;
    zero::gradient_stats s{.sumsq = comm.rank() + 1.0, .nonfinite = comm.rank() == 2};
    zero::agree_gradient_stats(comm, s, o);
    CHECK(s.sumsq == 6.0);
    CHECK(s.nonfinite);
    zero::gradient_stats clean{.sumsq = 0.5};
    zero::agree_gradient_stats(comm, clean, o);
    CHECK(clean.sumsq == 1.5);
    CHECK_FALSE(clean.nonfinite);
  });
}

TEST_CASE("each group steps by its own learning rate times the schedule, in every stage") {
  zero::config cfg = two_groups();
  cfg.schedule = [](std::uint64_t at) { return at == 0 ? 1.0f : 0.5f; };
  for (int world = 1; world <= 2; ++world)
    for (int stage = 0; stage <= 3; ++stage) {
      CAPTURE(world);
      CAPTURE(stage);
      with_state<float>(
          world, stage, cfg,
          [&](communicator&, const zero::partition_plan& plan, zero::model_state<float>& st,
              auto& run) {
            zero::stepper steps(cfg, false);
            CHECK(steps.learning_rate(0) == 0.5f);
            CHECK(steps.learning_rate(1) == 0.25f);
            // Every rank's gradient is `world`: averaged over the ranks, 1.
            fake_grads g{std::vector<float>(plan.padded_size(), static_cast<float>(world))};
            auto r = steps.take(st, g, run);
            CHECK_FALSE(r.skipped);
            CHECK(r.step == 1);
            CHECK(r.grad_norm == std::sqrt(8.0));
            CHECK(steps.learning_rate(0) == 0.25f);  // the schedule at step 1
            r = steps.take(st, g, run);
            CHECK(r.step == 2);
            CHECK(steps.optimizer_steps() == 2);
            CHECK(g.started == 2);
            // a: 1 - 0.5 - 0.25; b: 1 - 0.25 - 0.125.
            const std::vector<float> expect = {0.25f,  0.25f,  0.25f,  0.25f,
                                               0.625f, 0.625f, 0.625f, 0.625f};
            CHECK(st.full_parameters(run, gather_options) == expect);
            // Stages 1-2: the step's all_gather gave every rank the other's updates.
            if (!zero::stage_of(stage).sharded_parameters)
              for (int p = 0; p < 2; ++p)
                for (std::size_t i = 0; i < 4; ++i)
                  CHECK(st.parameters()[plan.params()[static_cast<std::size_t>(p)].offset + i] ==
                        expect[4 * static_cast<std::size_t>(p) + i]);
          });
    }
}

TEST_CASE("a frozen group keeps its weights") {
  zero::config cfg = two_groups();
  cfg.groups[1].frozen = true;
  with_state<float>(2, 3, cfg,
                    [&](communicator&, const zero::partition_plan& plan,
                        zero::model_state<float>& st, auto& run) {
                      zero::stepper steps(cfg, false);
                      fake_grads g{std::vector<float>(plan.padded_size(), 2.0f)};
                      CHECK_FALSE(steps.take(st, g, run).skipped);
                      const std::vector<float> expect = {0.5f, 0.5f, 0.5f, 0.5f,
                                                         1.0f, 1.0f, 1.0f, 1.0f};
                      CHECK(st.full_parameters(run, gather_options) == expect);
                    });
}

TEST_CASE("clipping scales the gradient down to max_grad_norm") {
  zero::config cfg = two_groups();
  cfg.max_grad_norm = 1.0f;
  with_state<float>(1, 0, cfg,
                    [&](communicator&, const zero::partition_plan& plan,
                        zero::model_state<float>& st, auto& run) {
                      zero::stepper steps(cfg, false);
                      fake_grads g{std::vector<float>(plan.padded_size(), 0.0f)};
                      const std::size_t a = plan.params()[0].offset;
                      g.flat[a] = 3.0f;
                      g.flat[a + 1] = 4.0f;
                      const auto r = steps.take(st, g, run);
                      CHECK(r.grad_norm == 5.0);  // the norm before clipping
                      const float clip = zero::clip_factor(1.0f, 5.0);
                      const auto w = st.full_parameters(run, gather_options);
                      CHECK(w[0] == 1.0f - 0.5f * (3.0f * clip));
                      CHECK(w[1] == 1.0f - 0.5f * (4.0f * clip));
                      CHECK(w[2] == 1.0f);
                    });
}

TEST_CASE("an inf on one rank skips the step on every rank and backs the loss scale off") {
  const zero::config cfg = two_groups();
  with_state<float16>(
      2, 2, cfg,
      [&](communicator& comm, const zero::partition_plan& plan, zero::model_state<float16>& st,
          auto& run) {
        zero::stepper steps(cfg, true);
        REQUIRE(steps.scaler().scale() == 65536.0f);
        fake_grads g{std::vector<float>(plan.padded_size(), 1.0f)};
        if (comm.rank() == 1) g.flat[st.own().front().flat_offset] = INFINITY;
        const auto before = st.own_array(0);
        const auto r = steps.take(st, g, run);
        CHECK(r.skipped);
        CHECK(r.step == 1);
        CHECK(r.loss_scale == 65536.0f);  // the scale this step's gradients carried
        CHECK(steps.scaler().scale() == 32768.0f);
        CHECK(steps.step_count() == 1);
        CHECK(steps.optimizer_steps() == 0);
        CHECK(g.started == 1);  // the next micro-batch still starts a new accumulation
        CHECK(st.own_array(0) == before);
        // The next clean step is the first optimizer step.
        std::fill(g.flat.begin(), g.flat.end(), 32768.0f);
        const auto clean = steps.take(st, g, run);
        CHECK_FALSE(clean.skipped);
        CHECK(steps.optimizer_steps() == 1);
        // Each gradient unscales to 32768 / (32768 * 2 ranks): 8 halves.
        CHECK(clean.grad_norm == std::sqrt(2.0));
        CHECK(st.own_array(0) != before);
      });
}

TEST_CASE("learning rates by group, resume and the loss scale a checkpoint restores") {
  zero::config cfg = two_groups();
  cfg.schedule = [](std::uint64_t at) { return static_cast<float>(at); };
  zero::stepper steps(cfg, false);
  steps.set_learning_rate(1, 0.125f);
  CHECK(steps.group_lr() == std::vector<float>{0.5f, 0.125f});
  steps.set_learning_rate(2.0f);
  CHECK(steps.group_lr() == std::vector<float>{2.0f, 2.0f});
  CHECK_THROWS_WITH_AS(steps.set_learning_rate(2, 0.1f), "ringzero: zero: parameter group 2 of 2",
                       ringzero::invalid_argument);
  CHECK_THROWS_AS((void)steps.learning_rate(-1), ringzero::invalid_argument);
  steps.resume(7, 5);
  CHECK(steps.step_count() == 7);
  CHECK(steps.optimizer_steps() == 5);
  CHECK(steps.learning_rate(0) == 14.0f);  // the base rate times the schedule at step 7
  steps.restore_loss_scale(1024.0f, 3);
  CHECK(steps.scaler().scale() == 1.0f);  // not float16: no loss scaling
  zero::stepper half(cfg, true);
  half.restore_loss_scale(1024.0f, 3);
  CHECK(half.scaler().scale() == 1024.0f);
  CHECK(half.scaler().good_steps() == 3);
}
