// Reproducible training (config::reproducible): a global batch of 12 micro-batches, each rank
// taking a contiguous run of them, gives the same weights bit for bit on 1, 2, 3, 4 and 6 ranks,
// in every stage, with hybrid sharding, in fp32, bf16 and fp16, with clipping, loss scaling and
// a skipped step; a checkpoint saved at N ranks resumes at M ranks on the uninterrupted run's
// bits; a device space (emulated here; scripts/gpu_check.sh runs it on a GPU) gives the same.
#include <doctest/doctest.h>
#include <ringzero/zero/device_space.hpp>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "zero_harness.hpp"

namespace {

using ringzero::bfloat16;
using ringzero::float16;
namespace zero = ringzero::zero;

constexpr int micro_batches = 12;  // zt::batch = 24 samples: 2 per micro-batch

template <class P>
zero::model_layout layout() {
  return zt::make_layout<P>({{37, 5}, {129}, {3, 61, 1}});
}

zt::run_options options(int world, int stage, int group = 0) {
  zt::run_options o;
  o.world = world;
  o.stage = stage;
  o.accumulation = micro_batches / world;
  o.contiguous = true;
  o.steps = 3;
  o.clip = 0.05f;  // below the gradient's norm: every step clips
  o.configure = [group](zero::config& c) {
    c.reproducible = true;
    c.shard_group_size = group;
  };
  return o;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// Every rank of `r` holds `want`'s bits.
void check_all(const zt::run_result& r, const std::vector<float>& want, const std::string& what) {
  for (std::size_t q = 0; q < r.params.size(); ++q)
    CHECK_MESSAGE(same_bits(r.params[q], want), what << ", rank " << q);
}

template <class P>
void every_world_and_stage(const char* type) {
  const auto l = layout<P>();
  const auto ref = zt::train<P>(l, options(1, 0));
  REQUIRE(ref.steps.size() == 3);
  CHECK(ref.steps[0].grad_norm > 0.05);  // clipping took part
  for (int stage = 0; stage <= 3; ++stage)
    for (int n : {1, 2, 3, 4, 6}) {
      const auto r = zt::train<P>(l, options(n, stage));
      check_all(r, ref.params[0], fmt::format("{}, stage {}, {} ranks", type, stage, n));
      for (std::size_t s = 0; s < r.steps.size(); ++s) {
        CHECK(r.steps[s].grad_norm == ref.steps[s].grad_norm);
        CHECK(r.steps[s].loss_scale == ref.steps[s].loss_scale);
      }
    }
}

}  // namespace

TEST_CASE("reproducible training: fp32, every stage, 1, 2, 3, 4 and 6 ranks: one bit pattern") {
  every_world_and_stage<float>("fp32");
}

TEST_CASE("reproducible training: bf16 (fp32 reduction), every stage and world size") {
  every_world_and_stage<bfloat16>("bf16");
}

TEST_CASE("reproducible training: fp16 with dynamic loss scaling, every stage and world size") {
  every_world_and_stage<float16>("fp16");
}

TEST_CASE("reproducible training: hybrid sharding at every group size matches one group") {
  for (int stage = 0; stage <= 3; ++stage) {
    const auto ref = zt::train<bfloat16>(layout<bfloat16>(), options(1, stage));
    for (auto [n, g] : {std::pair{4, 2}, {6, 2}, {6, 3}, {4, 1}}) {
      const auto r = zt::train<bfloat16>(layout<bfloat16>(), options(n, stage, g));
      check_all(r, ref.params[0], fmt::format("stage {}, {} ranks in groups of {}", stage, n, g));
    }
  }
}

TEST_CASE("reproducible training: gradient slots, 16-bit reduction, plain float sums differ") {
  const auto l = layout<float>();
  const auto ref = zt::train<float>(l, options(1, 2));
  for (int n : {2, 3, 6})
    for (int stage : {0, 2, 3}) {
      auto o = options(n, stage);
      o.use_slots = true;
      const auto slots = zt::train<float>(l, o);
      check_all(slots, ref.params[0], fmt::format("slots, stage {}, {} ranks", stage, n));
    }
  // bf16 gradients reduced in bf16: rounded once from the exact sum, whatever the world size.
  auto bf = [](int n, int stage) {
    auto o = options(n, stage);
    o.configure = [](zero::config& c) {
      c.reproducible = true;
      c.reduce_dtype = ringzero::dtype::bfloat16;
    };
    return zt::train<bfloat16>(layout<bfloat16>(), o);
  };
  const auto bref = bf(1, 0);
  for (int n : {2, 3, 4, 6}) check_all(bf(n, 3), bref.params[0], fmt::format("bf16 reduce, {}", n));
  // Without the option the same runs differ in their last bits (the test would prove nothing
  // otherwise).
  auto plain = [&](int n) {
    auto o = options(n, 0);
    o.configure = {};
    return zt::train<float>(l, o).params[0];
  };
  CHECK_FALSE(same_bits(plain(1), plain(6)));
}

TEST_CASE("reproducible training: an overflow skips the same step at every world size") {
  // Rank 0 (which every world has) poisons one gradient of step 1: every run skips step 1 and
  // backs its loss scale off.
  auto run = [](int n, int stage) {
    auto o = options(n, stage);
    o.steps = 4;
    o.poison = [](int rank, int step, int param, std::vector<float>& g) {
      if (rank == 0 && step == 1 && param == 2) g[7] = std::numeric_limits<float>::infinity();
    };
    return zt::train<float16>(layout<float16>(), o);
  };
  const auto ref = run(1, 0);
  REQUIRE(ref.steps.size() == 4);
  CHECK(ref.steps[1].skipped);
  CHECK(ref.steps[2].loss_scale < ref.steps[1].loss_scale);
  for (int n : {2, 3, 4, 6}) {
    const auto r = run(n, n % 2 == 0 ? 3 : 1);
    check_all(r, ref.params[0], fmt::format("{} ranks", n));
    CHECK(r.steps[1].skipped);
  }
}

TEST_CASE("reproducible training: saved at N ranks, resumed at M, the uninterrupted bits") {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("ringzero_reproducible_" + std::to_string(::getpid()));
  auto run = [&](int n, int stage, int steps, const std::filesystem::path& save,
                 const std::filesystem::path& load) {
    auto o = options(n, stage);
    o.steps = steps;
    o.save_dir = save;
    o.load_dir = load;
    return zt::train<bfloat16>(layout<bfloat16>(), o);
  };
  const auto whole = run(1, 0, 4, {}, {});
  for (auto [n, m, s1, s2] : {std::tuple{4, 3, 3, 1}, {2, 6, 0, 3}, {6, 1, 2, 2}, {3, 4, 1, 0}}) {
    std::filesystem::remove_all(dir);
    (void)run(n, s1, 2, dir, {});
    const auto resumed = run(m, s2, 2, {}, dir);
    CHECK(resumed.step_count == 4);
    check_all(resumed, whole.params[0],
              fmt::format("saved at {} ranks (stage {}), resumed at {} (stage {})", n, s1, m, s2));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("reproducible training: a device space gives the host's bits at every world size") {
  // The accumulators stay on the host, the integer collectives pass through the space's memory
  // (what NCCL would move), the rounded sums and the exact norm come back: every stage, slots
  // included, hybrid sharding, a skipped step, bf16 with an fp32 reduction.
  using dev = zero::emulated_device_space;
  const auto ref = zt::train<float>(layout<float>(), options(1, 0));
  for (auto [n, stage, group] : {std::tuple{1, 0, 0}, {2, 1, 0}, {3, 2, 0}, {4, 3, 2}, {6, 0, 3}}) {
    const auto r = zt::train<float, dev>(layout<float>(), options(n, stage, group));
    check_all(r, ref.params[0], fmt::format("device space, stage {}, {} ranks", stage, n));
    for (std::size_t s = 0; s < r.steps.size(); ++s)
      CHECK(r.steps[s].grad_norm == ref.steps[s].grad_norm);
  }
  for (int stage : {0, 3}) {
    auto o = options(3, stage);
    o.use_slots = true;
    check_all(zt::train<float, dev>(layout<float>(), o), ref.params[0],
              fmt::format("device space, slots, stage {}", stage));
  }
  const auto bref = zt::train<bfloat16>(layout<bfloat16>(), options(1, 0));
  check_all(zt::train<bfloat16, dev>(layout<bfloat16>(), options(4, 2)), bref.params[0],
            "device space, bf16, 4 ranks");
  auto poisoned = [](int n, int stage) {
    auto o = options(n, stage);
    o.steps = 3;
    o.poison = [](int rank, int step, int param, std::vector<float>& g) {
      if (rank == 0 && step == 1 && param == 2) g[7] = std::numeric_limits<float>::infinity();
    };
    return o;
  };
  const auto href = zt::train<float16>(layout<float16>(), poisoned(1, 0));
  const auto hdev = zt::train<float16, dev>(layout<float16>(), poisoned(2, 3));
  check_all(hdev, href.params[0], "device space, fp16, a skipped step");
  REQUIRE(hdev.steps.size() == 3);
  CHECK(hdev.steps[1].skipped);
}
