// Reproducible training (config::reproducible): a global batch of 12 micro-batches, each rank
// taking a contiguous run of them, gives the same weights bit for bit on 1, 2, 3, 4 and 6 ranks,
// in every stage, with hybrid sharding, in fp32, bf16 and fp16, with clipping, loss scaling and
// a skipped step, with a tied parameter (each use a term), with gradients whose blocks spill;
// a checkpoint saved at N ranks resumes at M ranks on the uninterrupted run's bits; a device
// space (emulated here; scripts/gpu_check.sh runs it on a GPU) gives the same; the exact
// accumulators are a shard.
#include <doctest/doctest.h>
#include <ringzero/reduce/reproducible.hpp>
#include <ringzero/zero/device_space.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "zero_harness.hpp"

namespace {

using ringzero::bfloat16;
using ringzero::float16;
namespace zero = ringzero::zero;
namespace rp = ringzero::reproducible;

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
  // The accumulators, their adds and the exchange run on the device's streams; the exact norm
  // reads the gradients back once a step, and hybrid sharding combines across the groups on the
  // host: every stage, slots included, hybrid sharding, a skipped step, bf16 with an fp32
  // reduction.
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

namespace {

/// The gradient of the tied model's parameter p, use `use`, for a sample and a step: values of
/// many magnitudes, the second use's smaller.
float tied_grad(int p, int use, int sample, int step, std::size_t i) {
  return std::ldexp(
      zt::noise(static_cast<std::uint64_t>(p * 2 + use), static_cast<std::uint64_t>(sample),
                static_cast<std::uint64_t>(step), i),
      -3 * use - static_cast<int>(i % 5));
}

/// A model whose layer 2 uses layer 0's parameter again (a tied embedding): the parameter takes
/// two gradients every micro-batch. Trained `steps` steps of 12 micro-batches on `world` ranks,
/// each rank a contiguous run; the first use goes through gradient_slot when `slots`. Rank 0's
/// full_parameters() at the end. `sgd`: plain SGD at lr 0.5 with summed gradients, so one step
/// makes w - g / 2 of the exact sum g.
template <class Space = zero::memory_space_t<zt::communicator>>
std::vector<float> train_tied(int world, int stage, bool slots, int steps = 2, bool sgd = false) {
  zero::model_layout l;
  l.add_layer("embed");
  const int tied = l.add({.name = "wte", .shape = {300}, .type = ringzero::dtype::float32});
  const int pos = l.add({.name = "wpe", .shape = {70}, .type = ringzero::dtype::float32});
  l.add_layer("block");
  const int mid = l.add({.name = "w", .shape = {500}, .type = ringzero::dtype::float32});
  l.add_layer("head");
  l.share(tied);
  const int head = l.add({.name = "ln", .shape = {40}, .type = ringzero::dtype::float32});
  zero::config cfg;
  cfg.stage = stage;
  cfg.optimizer.lr = 0.05f;
  cfg.bucket_bytes = 1024;
  cfg.accumulation_steps = micro_batches / world;
  cfg.reproducible = true;
  if (sgd) {
    cfg.optimizer = {.kind = zero::optimizer_kind::sgd, .lr = 0.5f, .momentum = 0.0f};
    cfg.average_gradients = false;
  }
  std::vector<float> out;
  ringzero::loopback::world w(world);
  w.run([&](zt::communicator& comm) {
    zero::sharder<zt::communicator, float, Space> shd(comm, l, cfg);
    for (int p = 0; p < 4; ++p) {
      std::vector<float> v(shd.plan().params()[static_cast<std::size_t>(p)].numel);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = zt::initial_value(p, i);
      shd.set_parameter(p, v);
    }
    std::vector<std::vector<float>> keep;  // a device space reads them in stream order
    const auto grad = [&](int p, int use, int sample, int step) {
      std::vector<float> g(shd.plan().params()[static_cast<std::size_t>(p)].numel);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = tied_grad(p, use, sample, step, i);
      return g;
    };
    for (int s = 0; s < steps; ++s) {
      for (int m = 0; m < cfg.accumulation_steps; ++m) {
        const int sample = comm.rank() * cfg.accumulation_steps + m;
        // Backward: the head's use of the tied parameter first, its own last.
        for (const auto& [p, use] :
             {std::pair{head, 0}, {tied, 1}, {mid, 0}, {pos, 0}, {tied, 0}}) {
          auto g = grad(p, use, sample, s);
          if (slots && p == tied && use == 1) {
            const auto slot = shd.template gradient_slot<float>(p);
            if constexpr (zero::on_device<Space>) {
              shd.space().upload(shd.space().compute_stream(), slot.data(), g.data(), g.size());
            } else {
              std::copy(g.begin(), g.end(), slot.begin());
            }
            shd.add_grad(p, slot);
            continue;
          }
          shd.add_grad(p, std::span<const float>(g));
          keep.push_back(std::move(g));
        }
        shd.end_micro_batch();
        if constexpr (zero::on_device<Space>) shd.space().synchronize();
        keep.clear();
      }
      (void)shd.step();
    }
    const auto full = shd.full_parameters();
    if (comm.rank() == 0) out = full;
  });
  return out;
}

}  // namespace

TEST_CASE("reproducible training: each use of a tied parameter is a term of its own") {
  // The tied parameter's two gradients a micro-batch travel as two layers of its bucket; summed
  // in float on the way they would be rounded, and the world sizes would disagree.
  const auto ref = train_tied(1, 0, false);
  for (int stage : {0, 1, 2, 3})
    for (int n : {1, 2, 3, 4, 6}) {
      CHECK_MESSAGE(same_bits(train_tied(n, stage, false), ref),
                    fmt::format("stage {}, {} ranks", stage, n));
      if (n % 2 == 0)
        CHECK_MESSAGE(same_bits(train_tied(n, stage, true), train_tied(1, stage, true)),
                      fmt::format("a slot for the first use, stage {}, {} ranks", stage, n));
    }
  using dev = zero::emulated_device_space;
  CHECK(same_bits(train_tied<dev>(3, 3, false), ref));
  CHECK(same_bits(train_tied<dev>(2, 0, true), train_tied(1, 0, true)));
  // And the sum is every use's every term: one SGD step from w makes w - g / 2, g the exact sum
  // of the 24 terms of each element of the tied parameter (rounded once), at 2 ranks.
  const auto one = train_tied(2, 3, false, 1, true);
  for (std::size_t i = 0; i < 300; ++i) {
    std::vector<float> terms;
    for (int sample = 0; sample < micro_batches; ++sample)
      for (int use : {0, 1}) terms.push_back(tied_grad(0, use, sample, 0, i));
    const float g = rp::serial_sum(terms.data(), terms.size());
    CHECK(one[i] == zt::initial_value(0, i) - 0.5f * g);
  }
}

TEST_CASE("reproducible training: the exact accumulators are a shard in every stage") {
  // Psi = 9,069: words of 8 bytes for the rank's shard, block heads, nothing spilled. Stages 2-3
  // keep their gradient shard over the words: the gradients are the accumulator.
  const auto l = zt::make_layout<bfloat16>({{4000, 61}, {3001}, {2000, 7}});
  const double psi = 9069;
  for (int stage : {0, 3})
    for (int n : {1, 4}) {
      auto o = options(n, stage);
      o.steps = 1;
      o.bucket_bytes = 4096;
      const auto r = zt::train<bfloat16>(l, o);
      for (const auto& m : r.memory) {
        CAPTURE(stage);
        CAPTURE(n);
        const double per = static_cast<double>(m.accumulator) / (psi / n);
        CHECK(per > 8.0);
        CHECK(per < 8.6);  // padding, 16 bytes of head per 64 elements
        if (stage == 3)
          CHECK(m.gradients == m.accumulator);
        else
          CHECK(m.gradients > m.accumulator + static_cast<std::size_t>(4 * psi));
      }
    }
}

TEST_CASE("reproducible training: gradients spanning beyond a word spill, on host and device") {
  // Some elements of each gradient scaled by 2^-100: their blocks' terms span 130 bits and more,
  // past one word's 62, so those blocks keep grid digits in spilled rows; the bits stay those of
  // one rank. The device space's pool (1/128 of the blocks, at least 64) is outgrown over the
  // steps and grows after each; a step that spills more than it holds fails.
  const auto l = zt::make_layout<float>({{6000, 61}, {3001}, {4000, 7}});
  auto wide = [](int every) {
    // The same elements whoever computes the micro-batch (the trainer's side of the contract).
    return [every](int, int step, int param, std::vector<float>& g) {
      for (std::size_t i = static_cast<std::size_t>(param); i < g.size();
           i += static_cast<std::size_t>(every * (step + 1)))
        g[i] = std::ldexp(g[i], -100);
    };
  };
  auto run = [&](int n, int stage, int every, int steps) {
    auto o = options(n, stage);
    o.steps = steps;
    o.bucket_bytes = 16384;
    o.poison = wide(every);
    return o;
  };
  using dev = zero::emulated_device_space;
  const auto ref = zt::train<float>(l, run(1, 0, 300, 3));
  auto tame = run(1, 0, 300, 3);
  tame.poison = {};
  // Spilled rows and a grown pool show in the accumulators' bytes.
  CHECK(ref.memory[0].accumulator > zt::train<float>(l, tame).memory[0].accumulator);
  CHECK(zt::train<float, dev>(l, run(1, 0, 300, 3)).memory[0].accumulator >
        zt::train<float, dev>(l, tame).memory[0].accumulator);
  for (int stage : {0, 3})
    for (int n : {2, 3}) {
      check_all(zt::train<float>(l, run(n, stage, 300, 3)), ref.params[0],
                fmt::format("host, stage {}, {} ranks", stage, n));
      check_all(zt::train<float, dev>(l, run(n, stage, 300, 3)), ref.params[0],
                fmt::format("device, stage {}, {} ranks", stage, n));
    }
  // 13,069 elements are 205 blocks (one rank): a pool of 65. A scaled element every 64 spills
  // nearly every block at once: more than the pool holds.
  CHECK_THROWS_WITH_AS((zt::train<float, dev>(l, run(1, 3, 64, 1))),
                       "ringzero: zero: reproducible: this step's gradients span more than 62 bits "
                       "in more blocks of 64 than the device's spill pool holds (65 blocks, 195 "
                       "rows); it grows after each step",
                       ringzero::unsupported);
}

TEST_CASE("reproducible training on a device space: no host wait per gradient, five per step") {
  // The adds run on the device: between a step's start and step() the only host waits are the
  // trainer's own (the harness waits for the compute stream before each gradient and after each
  // micro-batch). step() reads the norm's bins with the pool's use (one wait) and agrees on two
  // host words through device memory (an upload and a download each): five, whatever the model.
  const auto layout = zt::make_layout<bfloat16>({std::vector<std::size_t>(20, 33), {129, 7}});
  const int params = 22;
  for (int stage : {0, 3})
    for (int world : {1, 3}) {
      auto o = options(world, stage);
      o.steps = 4;
      o.bucket_bytes = 512;
      std::mutex m;
      std::vector<std::string> over;
      o.on_counters = [&](int rank, int step, const zero::device_counters& start,
                          const zero::device_counters& before, const zero::device_counters& after) {
        const std::lock_guard lock(m);
        const auto say = [&](const char* what, std::uint64_t got, std::uint64_t want) {
          if (got != want)
            over.push_back(fmt::format("stage {} world {} rank {} step {}: {} {} (want {})", stage,
                                       world, rank, step, what, got, want));
        };
        say("host waits before step()", before.host_syncs - start.host_syncs,
            static_cast<std::uint64_t>(o.accumulation * (params + 1)));
        say("host waits in step()", after.host_syncs - before.host_syncs, 5);
        say("statistics launches", after.statistics_launches - start.statistics_launches, 0);
        if (step >= 2)
          say("driver allocations", after.driver_allocations - start.driver_allocations, 0);
      };
      (void)zt::train<bfloat16, zero::emulated_device_space>(layout, o);
      for (const auto& line : over) FAIL_CHECK(line);
    }
}
