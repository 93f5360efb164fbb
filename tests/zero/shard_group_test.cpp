#include <doctest/doctest.h>

#include "zero_harness.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <ringzero/trace.hpp>
#include <ringzero/zero/checkpoint.hpp>
#include <ringzero/zero/shard_group.hpp>

namespace fs = std::filesystem;
using ringzero::bfloat16;
using ringzero::collective;

namespace {

// Five buckets at 256 bytes, as the sharder tests: odd sizes, a parameter larger than a bucket.
template <class P>
zt::zero::model_layout small_model() {
  return zt::make_layout<P>({{37, 5}, {129}, {3, 61, 1}});
}

zt::run_options hybrid(int world, int group, int stage, int steps = 3) {
  zt::run_options o;
  o.world = world;
  o.stage = stage;
  o.steps = steps;
  o.configure = [group](zt::zero::config& c) { c.shard_group_size = group; };
  return o;
}

// What a hybrid run is measured against: a plain run (one group) of the same world size. Its
// elements are summed over the world in one ring, a hybrid run's within the group and then
// across groups, so the two agree to rounding only; this bounds the difference after a few
// AdamW steps (measured: at most 6e-8, a few units in the last place).
constexpr double plain_tolerance = 1e-6;

struct scratch {
  fs::path root =
      fs::temp_directory_path() / ("ringzero-zero-hybrid-" + std::to_string(::getpid()));
  scratch() { fs::create_directories(root); }
  ~scratch() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  fs::path fresh(const std::string& name) const {
    fs::remove_all(root / name);
    return root / name;
  }
};

const scratch& dirs() {
  static const scratch s;
  return s;
}

void hybrid_stages_agree(int world, int group) {
  CAPTURE(world);
  CAPTURE(group);
  const auto layout = small_model<float>();
  zt::run_options plain_o = hybrid(world, 0, 0);
  const auto plain = zt::train<float>(layout, plain_o);
  const auto reference = zt::train<float>(layout, hybrid(world, group, 0));
  for (int stage = 0; stage <= 3; ++stage) {
    CAPTURE(stage);
    const auto got = zt::train<float>(layout, hybrid(world, group, stage));
    // Every rank, in every group, ends with the same bits, and every stage with stage 0's.
    for (int r = 0; r < world; ++r)
      CHECK_MESSAGE(got.params[static_cast<std::size_t>(r)] == reference.params[0], "rank ", r,
                    ": max rel diff ",
                    zt::max_rel_diff(got.params[static_cast<std::size_t>(r)], reference.params[0]));
    REQUIRE(got.steps.size() == plain.steps.size());
    for (std::size_t s = 0; s < got.steps.size(); ++s) {
      CHECK(got.steps[s].grad_norm == reference.steps[s].grad_norm);
      CHECK(got.steps[s].grad_norm == doctest::Approx(plain.steps[s].grad_norm).epsilon(1e-6));
    }
    const double d = zt::max_rel_diff(got.params[0], plain.params[0]);
    CHECK_MESSAGE(d < plain_tolerance, "max rel diff from the plain run: ", d);
    MESSAGE("world ", world, " G ", group, " stage ", stage, ": max rel diff from plain ", d);
  }
}

}  // namespace

TEST_CASE("shard_group_size must divide the world size") {
  CHECK(zt::zero::shard_group_size_for(0, 6) == 6);
  CHECK(zt::zero::shard_group_size_for(3, 6) == 3);
  CHECK(zt::zero::shard_group_size_for(1, 6) == 1);
  CHECK(zt::zero::shard_group_size_for(6, 6) == 6);
  CHECK_THROWS_WITH_AS((void)zt::zero::shard_group_size_for(4, 6),
                       doctest::Contains("shard_group_size 4 does not divide the world size 6"),
                       ringzero::invalid_argument);
  CHECK_THROWS_AS((void)zt::zero::shard_group_size_for(-2, 6), ringzero::invalid_argument);
  CHECK_THROWS_AS((void)zt::zero::shard_group_size_for(12, 6), ringzero::invalid_argument);
  // Every rank refuses alike, before any collective: no rank is left waiting.
  const auto layout = small_model<float>();
  ringzero::loopback::world w(4);
  w.run([&](zt::communicator& comm) {
    zt::zero::config cfg;
    cfg.shard_group_size = 3;
    CHECK_THROWS_WITH_AS((zt::zero::sharder<zt::communicator, float>(comm, layout, cfg)),
                         doctest::Contains("shard_group_size 3 does not divide the world size 4"),
                         ringzero::invalid_argument);
  });
}

TEST_CASE("hybrid stages 0-3 agree bitwise with each other, and with plain runs to rounding") {
  hybrid_stages_agree(4, 2);
  hybrid_stages_agree(6, 3);
  hybrid_stages_agree(6, 2);
  hybrid_stages_agree(4, 1);
}

TEST_CASE("one group per node, when every node holds as many ranks") {
  const auto layout = small_model<float>();
  auto per_node = hybrid(6, zt::zero::shard_group_per_node, 3);
  per_node.ranks_per_node = 3;
  const auto got = zt::train<float>(layout, per_node);
  const auto reference = zt::train<float>(layout, hybrid(6, 3, 3));
  for (const auto& p : got.params) CHECK(p == reference.params[0]);
  CHECK(got.memory[0].optimizer == reference.memory[0].optimizer);

  // One node: no split, the plain run's bits.
  auto one = hybrid(4, zt::zero::shard_group_per_node, 2);
  CHECK(zt::train<float>(layout, one).params[0] ==
        zt::train<float>(layout, hybrid(4, 0, 2)).params[0]);

  // Nodes of 3 and 2 ranks cannot shard alike: every rank refuses.
  ringzero::loopback::world uneven(5, {.ranks_per_node = 3});
  uneven.run([&](zt::communicator& comm) {
    zt::zero::config cfg;
    cfg.shard_group_size = zt::zero::shard_group_per_node;
    CHECK_THROWS_WITH_AS((zt::zero::sharder<zt::communicator, float>(comm, layout, cfg)),
                         doctest::Contains("the nodes hold between 2 and 3 ranks"),
                         ringzero::invalid_argument);
  });
}

TEST_CASE("hybrid with accumulation: stages 0 and 1, 2 and 3 agree bitwise; inline as threaded") {
  const auto layout = small_model<float>();
  std::vector<std::vector<float>> w;
  for (int stage = 0; stage <= 3; ++stage) {
    auto o = hybrid(6, 3, stage);
    o.accumulation = 2;
    w.push_back(zt::train<float>(layout, o).params[5]);
  }
  CHECK(w[1] == w[0]);
  CHECK(w[3] == w[2]);
  CHECK(zt::max_rel_diff(w[0], w[2]) < plain_tolerance);
  for (int stage : {1, 3}) {
    CAPTURE(stage);
    auto o = hybrid(4, 2, stage);
    const auto threaded = zt::train<float>(layout, o);
    o.comm_thread = false;
    CHECK(zt::train<float>(layout, o).params[2] == threaded.params[0]);
  }
}

TEST_CASE("a group as large as the world is plain sharding, bit for bit") {
  const auto layout = small_model<float>();
  for (int stage = 0; stage <= 3; ++stage) {
    CAPTURE(stage);
    CHECK(zt::train<float>(layout, hybrid(4, 4, stage)).params[0] ==
          zt::train<float>(layout, hybrid(4, 0, stage)).params[0]);
  }
}

template <class P>
void hybrid_16_bit_stages_agree(bool reduce_fp32) {
  CAPTURE(reduce_fp32);
  const auto layout = small_model<P>();
  auto options = [reduce_fp32](int stage) {
    auto o = hybrid(4, 2, stage);
    o.configure = [reduce_fp32](zt::zero::config& c) {
      c.shard_group_size = 2;
      c.reduce_dtype = reduce_fp32 ? ringzero::dtype::float32 : ringzero::dtype_of<P>();
    };
    return o;
  };
  const auto reference = zt::train<P>(layout, options(0));
  for (int stage = 1; stage <= 3; ++stage) {
    CAPTURE(stage);
    const auto got = zt::train<P>(layout, options(stage));
    CHECK(got.params[3] == reference.params[0]);
    for (std::size_t s = 0; s < got.steps.size(); ++s)
      CHECK(got.steps[s].loss_scale == reference.steps[s].loss_scale);
  }
}

TEST_CASE("hybrid bf16 and fp16, reduced in 16 bits or in fp32: the stages agree bitwise") {
  hybrid_16_bit_stages_agree<bfloat16>(false);
  hybrid_16_bit_stages_agree<bfloat16>(true);
  hybrid_16_bit_stages_agree<ringzero::float16>(false);
  hybrid_16_bit_stages_agree<ringzero::float16>(true);
}

TEST_CASE("an overflow on one rank of one group skips the step on every rank") {
  const auto layout = small_model<float>();
  auto o = hybrid(6, 3, 3);
  o.poison = [](int rank, int step, int param, std::vector<float>& g) {
    if (rank == 4 && step == 1 && param == 2) g[7] = std::numeric_limits<float>::infinity();
  };
  const auto got = zt::train<float>(layout, o);
  REQUIRE(got.steps.size() == 3);
  CHECK(!got.steps[0].skipped);
  CHECK(got.steps[1].skipped);
  CHECK(!got.steps[2].skipped);
  for (const auto& p : got.params) CHECK(p == got.params[0]);
  // The same poisoned run without groups skips the same step and ends at the same weights.
  auto plain = o;
  plain.configure = {};
  const auto reference = zt::train<float>(layout, plain);
  CHECK(reference.steps[1].skipped);
  CHECK(zt::max_rel_diff(got.params[0], reference.params[0]) < plain_tolerance);
}

TEST_CASE("memory is that of a plain run over one group") {
  const auto layout = small_model<float>();
  for (int stage = 0; stage <= 3; ++stage) {
    CAPTURE(stage);
    const auto h = zt::train<float>(layout, hybrid(6, 3, stage, 1));
    const auto g = zt::train<float>(layout, hybrid(3, 0, stage, 1));
    const auto n = zt::train<float>(layout, hybrid(6, 0, stage, 1));
    for (int r = 0; r < 6; ++r) {
      const auto& m = h.memory[static_cast<std::size_t>(r)];
      const auto& want = g.memory[static_cast<std::size_t>(r % 3)];
      CHECK(m.parameters == want.parameters);
      CHECK(m.gradients == want.gradients);
      CHECK(m.optimizer == want.optimizer);
    }
    // Sharded terms are 2x those of sharding over all 6 ranks (padding aside).
    if (stage >= 1) CHECK(h.memory[0].optimizer > n.memory[0].optimizer * 3 / 2);
  }
}

TEST_CASE("stage-3 gathers stay in the group; only gradient all_reduces cross groups") {
  const auto layout = small_model<float>();
  constexpr int steps = 2;
  ringzero::loopback::world w(4);
  w.run([&](zt::communicator& comm) {
    zt::zero::config cfg = zt::make_config(hybrid(4, 2, 3));
    cfg.shard_group_size = 2;
    zt::zero::sharder<zt::communicator, float> shd(comm, layout, cfg);
    CHECK(shd.shard_group_size() == 2);
    CHECK(shd.plan().world_size() == 2);
    REQUIRE(shd.replicate_communicator() != nullptr);
    auto& shard = shd.shard_communicator();
    auto& across = *shd.replicate_communicator();
    CHECK(shard.size() == 2);
    CHECK(shard.rank() == comm.rank() % 2);
    CHECK(across.size() == 2);
    CHECK(across.rank() == comm.rank() / 2);
    for (auto* c : {&comm, &shard, &across}) ringzero::trace::reset_counters(*c);
    const auto& plan = shd.plan();
    const int nl = static_cast<int>(plan.layers().size());
    for (int s = 0; s < steps; ++s) {
      for (int l = 0; l < nl; ++l) (void)shd.gather(l);
      for (int l = nl - 1; l >= 0; --l) {
        auto g = shd.gather(l, zt::zero::pass::backward);
        const auto& li = plan.layers()[static_cast<std::size_t>(l)];
        for (int p = li.first_param + li.param_count - 1; p >= li.first_param; --p) {
          std::vector<float> grad(g.param(p).size(), 0.25f * static_cast<float>(comm.rank() + 1));
          shd.add_grad(p, std::span<const float>(grad));
        }
      }
      shd.end_micro_batch();
      (void)shd.step();
    }
    const auto buckets = static_cast<std::uint64_t>(plan.buckets().size());
    std::uint64_t across_all_reduces = 0;
    for (const auto& k : ringzero::trace::counters(across)) {
      CHECK_MESSAGE(k.kind == collective::all_reduce, "the replicate communicator ran ",
                    ringzero::collective_name(k.kind));
      if (k.kind == collective::all_reduce) across_all_reduces += k.calls;
    }
    CHECK(across_all_reduces == buckets * steps);
    std::uint64_t gathers = 0;
    std::uint64_t scatters = 0;
    for (const auto& k : ringzero::trace::counters(shard)) {
      if (k.kind == collective::all_gather) gathers += k.calls;
      if (k.kind == collective::reduce_scatter) scatters += k.calls;
    }
    CHECK(gathers >= buckets * steps);
    CHECK(scatters == buckets * steps);
    CHECK(ringzero::trace::counters(comm).empty());
  });
}

TEST_CASE("a hybrid checkpoint is written once and loads at any world size and grouping") {
  const auto layout = small_model<float>();
  const auto dir = dirs().fresh("hybrid");
  auto o = hybrid(4, 2, 2);
  o.save_dir = dir;
  const auto saved = zt::train<float>(layout, o);
  const auto m = zt::zero::checkpoint_manifest::read(dir);
  CHECK(m.world_size == 2);
  CHECK(m.stage == 2);
  CHECK(m.step == 3);
  CHECK(m.shards.size() == 2);
  std::size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.is_regular_file() ? 1 : 0;
  CHECK(files == 3);  // group 0's two shards and the manifest

  struct target {
    int world;
    int group;
    int stage;
  };
  const target targets[] = {{2, 0, 1}, {4, 0, 3}, {4, 4, 2}, {4, 2, 3}, {6, 3, 0}, {6, 2, 2}};
  for (const auto& t : targets) {
    CAPTURE(t.world);
    CAPTURE(t.group);
    CAPTURE(t.stage);
    auto l = hybrid(t.world, t.group, t.stage, 0);
    l.load_dir = dir;
    const auto got = zt::train<float>(layout, l);
    CHECK(got.step_count == 3);
    for (const auto& p : got.params) CHECK(p == saved.params[0]);
  }

  // A plain checkpoint loads into a hybrid run too.
  const auto plain_dir = dirs().fresh("plain");
  auto p = hybrid(6, 0, 3);
  p.save_dir = plain_dir;
  const auto plain = zt::train<float>(layout, p);
  auto l = hybrid(6, 3, 1, 0);
  l.load_dir = plain_dir;
  for (const auto& q : zt::train<float>(layout, l).params) CHECK(q == plain.params[0]);
}

TEST_CASE("a hybrid run resumed in the same grouping continues bit for bit") {
  const auto layout = small_model<float>();
  const auto dir = dirs().fresh("resume");
  const auto uninterrupted = zt::train<float>(layout, hybrid(4, 2, 3, 5));
  auto first = hybrid(4, 2, 3, 2);
  first.save_dir = dir;
  (void)zt::train<float>(layout, first);
  auto rest = hybrid(4, 2, 1, 3);
  rest.load_dir = dir;
  const auto got = zt::train<float>(layout, rest);
  CHECK(got.step_count == 5);
  for (const auto& q : got.params) CHECK(q == uninterrupted.params[0]);
  // In another grouping, to rounding.
  auto other = hybrid(6, 3, 2, 3);
  other.load_dir = dir;
  const double d =
      zt::max_rel_diff(zt::train<float>(layout, other).params[0], uninterrupted.params[0]);
  CHECK_MESSAGE(d < plain_tolerance, "resumed at 6 ranks in groups of 3: ", d);
}

TEST_CASE("a failed hybrid save is reported on every rank of every group") {
  const auto layout = small_model<float>();
  const auto root = dirs().fresh("blocked");
  fs::create_directories(root);
  { std::ofstream(root / "file") << "x"; }
  std::vector<std::string> errors(4);
  ringzero::loopback::world w(4);
  w.run([&](zt::communicator& comm) {
    zt::zero::config cfg;
    cfg.stage = 3;
    cfg.shard_group_size = 2;
    zt::zero::sharder<zt::communicator, float> shd(comm, layout, cfg);
    try {
      shd.save(root / "file" / "ckpt");
    } catch (const ringzero::checkpoint_error& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& e : errors)
    CHECK_MESSAGE(e.find("cannot create the checkpoint directory") != std::string::npos, e);
}

TEST_CASE("a failed hybrid load is reported on every rank, and changes nothing") {
  const auto layout = small_model<float>();
  const auto dir = dirs().fresh("good");
  const auto missing = dirs().fresh("missing");
  auto save = hybrid(6, 3, 2, 1);
  save.save_dir = dir;
  (void)zt::train<float>(layout, save);
  std::vector<std::string> errors(6);
  std::vector<int> unchanged(6, 0);
  ringzero::loopback::world w(6);
  w.run([&](zt::communicator& comm) {
    zt::zero::config cfg;
    cfg.stage = 2;
    cfg.shard_group_size = 3;
    zt::zero::sharder<zt::communicator, float> shd(comm, layout, cfg);
    const std::vector<float> values(37, 0.5f);
    shd.set_parameter(0, values);
    // The first group reads a good checkpoint, the second finds none: every rank refuses, and
    // the first group keeps its state.
    try {
      shd.load(comm.rank() < 3 ? dir : missing);
    } catch (const ringzero::checkpoint_error& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
    const auto p = shd.parameter(0);
    unchanged[static_cast<std::size_t>(comm.rank())] =
        std::equal(p.begin(), p.end(), values.begin()) ? 1 : 0;
  });
  for (int r = 0; r < 6; ++r) {
    CAPTURE(r);
    CHECK(!errors[static_cast<std::size_t>(r)].empty());
    CHECK(unchanged[static_cast<std::size_t>(r)] == 1);
  }
}
