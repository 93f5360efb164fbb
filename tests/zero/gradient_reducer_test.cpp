#include <doctest/doctest.h>

#include <ringzero/transport/loopback.hpp>
#include <ringzero/zero/gradient_reducer.hpp>

#include <limits>
#include <vector>

namespace zero = ringzero::zero;
using ringzero::loopback::communicator;

namespace {

// Four layers of odd sizes, 64-byte buckets (one layer each, or a layer larger than a bucket).
zero::model_layout layout() {
  zero::model_layout l;
  for (int i = 0; i < 4; ++i) {
    l.add_layer("layer" + std::to_string(i));
    l.add({.name = "w" + std::to_string(i), .shape = {static_cast<std::size_t>(5 + 7 * i)}});
  }
  return l;
}

// Small integers, so every summation order gives the same float.
float grad_value(int rank, int micro, int param, std::size_t i) {
  return static_cast<float>((rank + 1) * (micro + 2) + param * 3 + static_cast<int>(i % 5));
}

/// Runs `micro` micro-batches on `world` ranks at `stage`, handing gradients over in `order`
/// (parameter ids; the others are left out), and checks what each rank's reducer holds against a
/// serial sum.
void check_reduction(int world, int stage, int micro, const std::vector<int>& order,
                     int reduce_buffers = 2, std::size_t* peak = nullptr) {
  const auto l = layout();
  ringzero::loopback::world w(world);
  w.run([&](communicator& comm) {
    const zero::partition_plan plan(l, world, 16, 4);
    zero::config cfg;
    cfg.stage = stage;
    cfg.accumulation_steps = micro;
    cfg.reduce_buffers = reduce_buffers;
    zero::detail::buffer_meter meter;
    zero::detail::worker work(true);
    zero::gradient_reducer<communicator, float> red(comm, plan, zero::stage_of(stage), cfg, work,
                                                    meter);
    for (int m = 0; m < micro; ++m) {
      for (int p : order) {
        std::vector<float> g(plan.params()[static_cast<std::size_t>(p)].numel);
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = grad_value(comm.rank(), m, p, i);
        red.add(p, std::span<const float>(g));
      }
      red.end_micro_batch();
    }
    work.drain();
    CHECK(red.micro_batches() == micro);
    const auto mine =
        zero::stage_of(stage).sharded_gradients ? plan.segments(comm.rank()) : plan.all_segments();
    double expect_sumsq = 0.0;
    for (const auto& s : mine) {
      const bool given = std::find(order.begin(), order.end(), s.param) != order.end();
      const float* got = red.gradient(s);
      for (std::size_t k = 0; k < s.count; ++k) {
        float expect = 0;
        for (int m = 0; m < micro; ++m)
          for (int r = 0; r < world; ++r)
            expect += given ? grad_value(r, m, s.param, s.begin + k) : 0.0f;
        CHECK_MESSAGE(got[k] == expect, "rank ", comm.rank(), " param ", s.param, " element ",
                      s.begin + k);
        expect_sumsq += 0.25 * static_cast<double>(expect) * static_cast<double>(expect);
      }
    }
    // Halves of small integers: every order of summation is exact.
    double sumsq = 0.0;
    bool nonfinite = false;
    red.add_stats(mine, 0.5f, sumsq, nonfinite);
    CHECK(sumsq == expect_sumsq);
    CHECK_FALSE(nonfinite);
    if (peak != nullptr && comm.rank() == 0) *peak = meter.peak;
  });
}

}  // namespace

TEST_CASE("flat and sharded reducers hold the sum over ranks and micro-batches") {
  for (int world : {1, 2, 3}) {
    for (int stage : {0, 1, 2, 3}) {
      for (int micro : {1, 3}) {
        CAPTURE(world);
        CAPTURE(stage);
        CAPTURE(micro);
        check_reduction(world, stage, micro, {3, 2, 1, 0});
      }
    }
  }
}

TEST_CASE("a gradient never handed over counts as zero") {
  check_reduction(3, 0, 2, {3, 1});
  check_reduction(3, 2, 2, {3, 1});
}

TEST_CASE("backward order reuses one buffer; forward order grows the pool") {
  std::size_t peak = 0;
  check_reduction(2, 2, 1, {3, 2, 1, 0}, 1, &peak);
  const auto largest = zero::partition_plan(layout(), 2, 16, 4).max_bucket() * sizeof(float);
  CHECK(peak == largest);
  ringzero::log::set_level(ringzero::log::level::none);  // the growth warns
  check_reduction(2, 2, 1, {0, 1, 2, 3}, 1, &peak);
  ringzero::log::set_level(ringzero::log::level::warn);
  CHECK(peak == 4 * largest);
}

TEST_CASE("misuse: a second gradient, a wrong size, too many micro-batches") {
  const auto l = layout();
  ringzero::loopback::world w(1);
  w.run([&](communicator& comm) {
    const zero::partition_plan plan(l, 1, 16, 4);
    zero::config cfg;
    zero::detail::buffer_meter meter;
    zero::detail::worker work(false);
    zero::gradient_reducer<communicator, float> red(comm, plan, zero::stage_of(2), cfg, work,
                                                    meter);
    std::vector<float> g(5, 1.0f);
    red.add(0, std::span<const float>(g));
    CHECK_THROWS_AS(red.add(0, std::span<const float>(g)), ringzero::invalid_argument);
    CHECK_THROWS_AS(red.add(1, std::span<const float>(g)), ringzero::invalid_argument);
    red.end_micro_batch();
    CHECK_THROWS_AS(red.end_micro_batch(), ringzero::invalid_argument);
    red.start_step();
    CHECK(red.micro_batches() == 0);
  });
}

TEST_CASE("the gradient statistics see a NaN") {
  const auto l = layout();
  ringzero::loopback::world w(1);
  w.run([&](communicator& comm) {
    const zero::partition_plan plan(l, 1, 16, 4);
    zero::config cfg;
    zero::detail::buffer_meter meter;
    zero::detail::worker work(false);
    zero::gradient_reducer<communicator, float> red(comm, plan, zero::stage_of(2), cfg, work,
                                                    meter);
    std::vector<float> g(plan.params()[2].numel, 1.0f);
    g[3] = std::numeric_limits<float>::quiet_NaN();
    red.add(2, std::span<const float>(g));
    red.end_micro_batch();
    work.drain();
    double sumsq = 0.0;
    bool nonfinite = false;
    red.add_stats(plan.segments(0), 1.0f, sumsq, nonfinite);
    CHECK(nonfinite);
  });
}

TEST_CASE("a shared parameter's bucket waits for every use; the uses' gradients are summed") {
  zero::model_layout l;
  l.add_layer("embed");
  const int wte = l.add({.name = "wte", .shape = {5}});
  l.add_layer("head");
  l.share(wte);
  const int head = l.add({.name = "head.w", .shape = {12}});
  for (int stage : {0, 2}) {
    CAPTURE(stage);
    ringzero::loopback::world w(1);
    w.run([&](communicator& comm) {
      const zero::partition_plan plan(l, 1, 16, 4);
      REQUIRE(plan.buckets().size() == 2);
      zero::config cfg;
      zero::detail::buffer_meter meter;
      // Unthreaded: a queued reduction has run by the time add() returns.
      zero::detail::worker work(false);
      zero::gradient_reducer<communicator, float> red(comm, plan, zero::stage_of(stage), cfg, work,
                                                      meter);
      const zero::segment* tied = nullptr;
      const auto segs = plan.all_segments();
      for (const auto& s : segs)
        if (s.param == wte) tied = &s;
      REQUIRE(tied != nullptr);
      const std::vector<float> from_head{0.5f, 1.0f, 1.5f, 2.0f, 2.5f};
      const std::vector<float> from_embed{4.0f, 3.0f, 2.0f, 1.0f, -1.0f};
      const std::vector<float> h(12, 1.0f);
      red.add(head, std::span<const float>(h));
      red.add(wte, std::span<const float>(from_head));
      if (stage == 2) {
        // One use of two is in: the bucket is not reduced yet (the shard still holds zeros).
        for (std::size_t k = 0; k < tied->count; ++k) CHECK(red.gradient(*tied)[k] == 0.0f);
      }
      red.add(wte, std::span<const float>(from_embed));
      CHECK_THROWS_WITH_AS(red.add(wte, std::span<const float>(from_embed)),
                           "ringzero: add_grad: wte was already added 2 times in this "
                           "micro-batch, once per layer using it",
                           ringzero::invalid_argument);
      red.end_micro_batch();
      work.drain();
      for (std::size_t k = 0; k < tied->count; ++k)
        CHECK(red.gradient(*tied)[k] == from_head[k] + from_embed[k]);
    });
  }
}
