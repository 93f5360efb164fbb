// The sharder on a device space, through zero::emulated_device_space: every buffer is "device"
// memory the trainer thread never touches, work runs on a compute and a communication stream
// (one thread each) ordered only by the sharder's events. The element arithmetic is the host
// sharder's, so every run must end bitwise where the same run on host memory ends; a missing
// hand-off between the streams shows up here as a different result, and under ThreadSanitizer
// as a race.
#include <doctest/doctest.h>

#include "zero_harness.hpp"

#include <ringzero/zero/device_space.hpp>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

using ringzero::bfloat16;
using ringzero::float16;
using zt::zero::emulated_device_space;
using zt::zero::optimizer_kind;

namespace {

/// Compute-stream work that takes time, as kernels do: a hand-off the sharder forgot between
/// the streams, or between a stream and the trainer thread, then loses the race every time.
struct laggy_device_space : emulated_device_space {
  laggy_device_space() : emulated_device_space(std::chrono::microseconds(300)) {}
};
static_assert(zt::zero::device_space<emulated_device_space>);
static_assert(zt::zero::device_space<laggy_device_space>);

template <class P>
zt::zero::model_layout small_model() {
  return zt::make_layout<P>({{37, 5}, {129}, {3, 61, 1}});
}

template <class P>
void same_as_host(const zt::run_options& o, const char* what) {
  const auto layout = small_model<P>();
  const auto host = zt::train<P, zt::zero::host_space>(layout, o);
  const auto dev = zt::train<P, emulated_device_space>(layout, o);
  const auto laggy = zt::train<P, laggy_device_space>(layout, o);
  CAPTURE(what);
  CHECK_MESSAGE(laggy.params == dev.params, "slow compute-stream work changed the result");
  CAPTURE(o.stage);
  CAPTURE(o.world);
  for (int r = 0; r < o.world; ++r)
    CHECK_MESSAGE(dev.params[static_cast<std::size_t>(r)] == host.params[0], "rank ", r,
                  ": device-space weights differ from host memory, max rel diff ",
                  zt::max_rel_diff(dev.params[static_cast<std::size_t>(r)], host.params[0]));
  REQUIRE(dev.steps.size() == host.steps.size());
  for (std::size_t s = 0; s < dev.steps.size(); ++s) {
    CHECK(dev.steps[s].grad_norm == host.steps[s].grad_norm);
    CHECK(dev.steps[s].skipped == host.steps[s].skipped);
    CHECK(dev.steps[s].loss_scale == host.steps[s].loss_scale);
  }
  // The trajectory moved: a sharder that never updated would match an equally idle host run.
  zt::run_options idle = o;
  idle.steps = 0;
  const auto initial = zt::train<P, zt::zero::host_space>(layout, idle);
  CHECK(dev.params[0] != initial.params[0]);
}

}  // namespace

TEST_CASE("device space: every stage gives bitwise the weights of host memory (fp32, AdamW)") {
  for (int world : {1, 2, 3}) {
    for (int stage = 0; stage <= 3; ++stage) {
      zt::run_options o;
      o.world = world;
      o.stage = stage;
      same_as_host<float>(o, "fp32 adamw");
    }
  }
}

TEST_CASE("device space: bf16 and fp16 parameters, SGD, accumulation, clipping") {
  for (int stage = 0; stage <= 3; ++stage) {
    zt::run_options o;
    o.world = 2;
    o.stage = stage;
    o.accumulation = 2;
    o.clip = 0.05f;
    same_as_host<bfloat16>(o, "bf16 accumulation clip");
    o.optimizer = optimizer_kind::sgd;
    same_as_host<float16>(o, "fp16 sgd accumulation clip");
  }
}

TEST_CASE("device space: fp32 reduction of bf16 gradients, hybrid sharding, small buffers") {
  for (int stage : {1, 2, 3}) {
    zt::run_options o;
    o.world = 4;
    o.stage = stage;
    o.configure = [](zt::zero::config& c) {
      c.reduce_dtype = ringzero::dtype::float32;
      c.shard_group_size = 2;
      c.reduce_buffers = 1;
      c.max_gathered_bytes = 300;
    };
    same_as_host<bfloat16>(o, "bf16 reduce fp32 hybrid");
  }
}

TEST_CASE("device space: an overflow skips the step on every rank, as on host memory") {
  zt::run_options o;
  o.world = 3;
  o.stage = 2;
  o.steps = 4;
  o.poison = [](int rank, int step, int param, std::vector<float>& g) {
    if (rank == 1 && step == 1 && param == 2) g[0] = std::numeric_limits<float>::infinity();
  };
  same_as_host<float16>(o, "fp16 overflow");
  const auto dev = zt::train<float16, emulated_device_space>(small_model<float16>(), o);
  CHECK(dev.steps[1].skipped);
  CHECK_FALSE(dev.steps[0].skipped);
}

TEST_CASE("device space: a held stage-3 handle reads the updated weights after step()") {
  zt::run_options o;
  o.world = 2;
  o.stage = 3;
  o.gather_before_step = true;
  o.hold_across_step = true;
  const auto layout = small_model<float>();
  const auto host = zt::train<float, zt::zero::host_space>(layout, o);
  const auto dev = zt::train<float, emulated_device_space>(layout, o);
  CHECK(dev.held == host.held);
  CHECK(dev.params == host.params);
}

TEST_CASE("device space: checkpoints round-trip through host staging, across spaces") {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("ringzero_device_ckpt_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const auto layout = small_model<bfloat16>();
  zt::run_options o;
  o.world = 2;
  o.stage = 3;
  o.steps = 2;
  o.save_dir = dir;
  // Saved from the device space, resumed on host memory and on the device space: the three
  // continuations agree with an uninterrupted host run.
  (void)zt::train<bfloat16, emulated_device_space>(layout, o);
  zt::run_options resume = o;
  resume.save_dir.clear();
  resume.load_dir = dir;
  resume.stage = 1;
  const auto on_host = zt::train<bfloat16, zt::zero::host_space>(layout, resume);
  const auto on_dev = zt::train<bfloat16, emulated_device_space>(layout, resume);
  zt::run_options straight = o;
  straight.save_dir.clear();
  straight.steps = 4;
  straight.stage = 1;
  const auto reference = zt::train<bfloat16, zt::zero::host_space>(layout, straight);
  CHECK(on_dev.params == on_host.params);
  CHECK(on_dev.step_count == 4);
  CHECK(zt::max_rel_diff(on_dev.params[0], reference.params[0]) == 0.0);
  std::filesystem::remove_all(dir);
}

TEST_CASE(
    "device space: a warm step waits on the host once, launches the statistics once, and "
    "takes no memory from the driver") {
  // Many small segments per rank (a shard of 40 tensors), so a launch per segment would show.
  std::vector<std::size_t> many(40, 33);
  const auto layout = zt::make_layout<bfloat16>({many, {129, 7}, {3, 61, 1}});
  for (int stage = 0; stage <= 3; ++stage) {
    for (const int world : {1, 3}) {
      zt::run_options o;
      o.world = world;
      o.stage = stage;
      o.steps = 5;
      o.accumulation = 2;
      o.clip = 1.0f;
      o.bucket_bytes = 512;  // several buckets: stage 3 gathers and frees each every step
      std::mutex m;
      std::vector<std::string> over;
      o.on_counters = [&](int rank, int step, const zt::zero::device_counters& start,
                          const zt::zero::device_counters& before,
                          const zt::zero::device_counters& after) {
        const std::lock_guard lock(m);
        const auto say = [&](const char* what, std::uint64_t got, std::uint64_t want) {
          if (got != want)
            over.push_back(fmt::format("stage {} world {} rank {} step {}: {} {} (want {})", stage,
                                       world, rank, step, what, got, want));
        };
        say("host waits in step()", after.host_syncs - before.host_syncs, 1);
        say("statistics launches", after.statistics_launches - start.statistics_launches, 1);
        if (step >= 2)
          say("driver allocations", after.driver_allocations - start.driver_allocations, 0);
      };
      (void)zt::train<bfloat16, emulated_device_space>(layout, o);
      for (const auto& line : over) FAIL_CHECK(line);
    }
  }
}

TEST_CASE("device space: a failed collective surfaces as an error from the sharder, no hang") {
  // Rank 1 hands over a gradient of the wrong length: an invalid_argument on that rank before
  // anything is enqueued; the others' collectives then miss their peer and time out.
  zt::run_options o;
  o.world = 2;
  o.stage = 2;
  o.configure = [](zt::zero::config& c) {
    for (auto* x :
         {&c.collectives.all_reduce, &c.collectives.reduce_scatter, &c.collectives.all_gather})
      x->timeout = std::chrono::seconds(2);
  };
  const auto layout = small_model<float>();
  ringzero::loopback::world w(2);
  std::vector<std::string> errors(2);
  w.run([&](zt::communicator& comm) {
    try {
      zt::zero::sharder<zt::communicator, float, emulated_device_space> shd(comm, layout,
                                                                            zt::make_config(o));
      std::vector<float> g(37, 0.5f);
      if (comm.rank() == 1) g.resize(3);
      shd.add_grad(0, std::span<const float>(g));
      shd.end_micro_batch();
      (void)shd.step();
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  CHECK(errors[1].find("add_grad") != std::string::npos);
  CHECK_FALSE(errors[0].empty());
}

TEST_CASE("gradient slots: written in place, the same bits as handed-over copies") {
  // fp32 parameters and bf16 ones reduced in fp32, over several micro-batches, every stage, on
  // host memory and on the device space; and a shared parameter (two uses) summed in its slot.
  for (int stage = 0; stage <= 3; ++stage) {
    CAPTURE(stage);
    zt::run_options o;
    o.world = 2;
    o.stage = stage;
    o.accumulation = 2;
    const auto l32 = small_model<float>();
    const auto copies = zt::train<float, zt::zero::host_space>(l32, o);
    zt::run_options slots = o;
    slots.use_slots = true;
    CHECK(zt::train<float, zt::zero::host_space>(l32, slots).params == copies.params);
    CHECK(zt::train<float, emulated_device_space>(l32, slots).params == copies.params);
    CHECK(zt::train<float, laggy_device_space>(l32, slots).params == copies.params);

    o.configure = [](zt::zero::config& c) { c.reduce_dtype = ringzero::dtype::float32; };
    slots.configure = o.configure;
    const auto l16 = small_model<bfloat16>();
    const auto copies16 = zt::train<bfloat16, zt::zero::host_space>(l16, o);
    CHECK(zt::train<bfloat16, zt::zero::host_space>(l16, slots).params == copies16.params);
    CHECK(zt::train<bfloat16, emulated_device_space>(l16, slots).params == copies16.params);
  }
}

TEST_CASE("gradient slots: wrong type, predivide and a second hand-over are refused") {
  const auto layout = small_model<bfloat16>();
  ringzero::loopback::world w(1);
  w.run([&](zt::communicator& comm) {
    zt::zero::config cfg;
    cfg.reduce_dtype = ringzero::dtype::bfloat16;
    zt::zero::sharder<zt::communicator, bfloat16> shd(comm, layout, cfg);
    CHECK_THROWS_WITH_AS((void)shd.gradient_slot<float>(0),
                         doctest::Contains("reduces gradients in bfloat16"),
                         ringzero::invalid_argument);
    auto slot = shd.gradient_slot<bfloat16>(0);
    CHECK(slot.size() == 37);
    shd.add_grad(0, slot);
    CHECK_THROWS_WITH_AS((void)shd.gradient_slot<bfloat16>(0), doctest::Contains("already added"),
                         ringzero::invalid_argument);
    zt::zero::config pre;
    pre.reduce_dtype = ringzero::dtype::bfloat16;
    pre.gradient_predivide = 2.0f;
    zt::zero::sharder<zt::communicator, bfloat16> shd2(comm, layout, pre);
    CHECK_THROWS_WITH_AS((void)shd2.gradient_slot<bfloat16>(1),
                         doctest::Contains("gradient_predivide"), ringzero::invalid_argument);
  });
}
