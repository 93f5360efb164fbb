#include <doctest/doctest.h>

#include <unistd.h>

#include <ringzero/transport/loopback.hpp>
#include <ringzero/zero/state_checkpoint.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace fs = std::filesystem;
namespace zero = ringzero::zero;
using ringzero::bfloat16;
using ringzero::float16;
using ringzero::loopback::communicator;

namespace {

// A scratch directory per test program, removed at exit.
struct scratch {
  fs::path root = fs::temp_directory_path() / ("ringzero-zero-state-" + std::to_string(::getpid()));
  scratch() { fs::create_directories(root); }
  ~scratch() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  [[nodiscard]] fs::path fresh(const std::string& name) const {
    fs::remove_all(root / name);
    return root / name;
  }
};

const scratch& dirs() {
  static const scratch s;
  return s;
}

template <class P>
zero::model_layout layout() {
  zero::model_layout l;
  const std::size_t sizes[] = {5, 19, 11};
  for (int i = 0; i < 3; ++i) {
    l.add_layer("layer" + std::to_string(i));
    l.add({.name = "w" + std::to_string(i),
           .shape = {sizes[i]},
           .type = ringzero::dtype_of<P>(),
           .group = i == 2 ? 1 : 0});
  }
  return l;
}

zero::config two_groups() {
  zero::config c;
  c.groups = {{.name = "body"}, {.name = "head", .lr = 0.25f}};
  return c;
}

float value(int p, std::size_t i) {
  return 0.5f - 0.1f * static_cast<float>(p) + 0.01f * static_cast<float>(i);
}
float grad(int p, std::size_t i) {
  return 0.2f + 0.03f * static_cast<float>(static_cast<std::size_t>(p) * 7 + i % 5);
}

const zero::step_constants first_step = zero::make_step_constants({}, 1, 1.0f);

/// The state of an element after its one AdamW step.
zero::element_state trained(int p, std::size_t i) {
  return zero::adamw_element(grad(p, i), {value(p, i), 0.0f, 0.0f}, first_step, false);
}

/// Runs f(comm, plan, state, steps, run) on every rank, with a fresh state at `stage`.
template <class P, class F>
void on_ranks(int world, int stage, const zero::config& cfg, F f) {
  const auto l = layout<P>();
  ringzero::loopback::world(world).run([&](communicator& comm) {
    const zero::partition_plan plan(l, world, 16, 4);
    zero::model_state<P> st(plan, zero::stage_of(stage), comm.rank(), cfg.optimizer);
    zero::stepper steps(cfg, std::is_same_v<P, float16>);
    auto run = [&](auto&& step) { return step(comm); };
    f(comm, plan, st, steps, run);
  });
}

}  // namespace

TEST_CASE("a state saved at one world size and stage loads into another") {
  const zero::config cfg = two_groups();
  const fs::path dir = dirs().fresh("resize");
  on_ranks<bfloat16>(2, 1, cfg,
                     [&](communicator&, const zero::partition_plan& plan, auto& st,
                         zero::stepper& steps, auto& run) {
                       std::vector<float> g;
                       for (int p = 0; p < 3; ++p) {
                         std::vector<float> v(plan.params()[static_cast<std::size_t>(p)].numel);
                         for (std::size_t i = 0; i < v.size(); ++i) v[i] = value(p, i);
                         st.set(p, v);
                       }
                       for (const auto& s : st.local()) {
                         g.resize(s.count);
                         for (std::size_t j = 0; j < s.count; ++j)
                           g[j] = grad(s.param, s.begin + j);
                         st.update(s, g.data(), first_step, false);
                       }
                       steps.resume(5, 3);
                       steps.set_learning_rate(1, 0.125f);
                       std::uint64_t bytes = 0;
                       zero::save_state(run, cfg, dir, st, steps,
                                        [&](std::uint64_t b) { bytes = b; });
                       // Master weights and two moments of this rank's shard, and a header.
                       CHECK(bytes > 3 * plan.shard_size() * sizeof(float));
                     });
  const std::pair<int, int> targets[] = {{1, 0}, {3, 3}, {2, 2}, {4, 1}};
  for (const auto& target : targets) {
    // Variables, not structured bindings: CAPTURE and the lambdas below capture them.
    const int world = target.first, stage = target.second;
    CAPTURE(world);
    CAPTURE(stage);
    on_ranks<bfloat16>(world, stage, cfg,
                       [&](communicator&, const zero::partition_plan& plan, auto& st,
                           zero::stepper& steps, auto& run) {
                         const auto m = zero::load_state(run, cfg, dir, st, steps);
                         CHECK(m.world_size == 2);
                         CHECK(m.stage == 1);
                         CHECK(steps.step_count() == 5);
                         CHECK(steps.optimizer_steps() == 3);
                         CHECK(steps.group_lr() == std::vector<float>{1e-3f, 0.125f});
                         const auto w = st.own_array(0), m1 = st.own_array(1), m2 = st.own_array(2);
                         const bool sharded = zero::stage_of(stage).sharded_parameters;
                         for (const auto& s : st.own())
                           for (std::size_t j = 0; j < s.count; ++j) {
                             const auto e = trained(s.param, s.begin + j);
                             CHECK(w[s.shard_offset + j] == e.w);
                             CHECK(m1[s.shard_offset + j] == e.m);
                             CHECK(m2[s.shard_offset + j] == e.v);
                             if (sharded)
                               CHECK(st.parameters()[s.shard_offset + j] == bfloat16(e.w));
                           }
                         // Stages 0-2 hold every parameter, the ones other ranks read included.
                         if (!sharded)
                           for (int p = 0; p < 3; ++p) {
                             const auto& pi = plan.params()[static_cast<std::size_t>(p)];
                             for (std::size_t i = 0; i < pi.numel; ++i)
                               CHECK(st.parameters()[pi.offset + i] == bfloat16(trained(p, i).w));
                           }
                       });
  }
}

TEST_CASE("a refused load leaves the state and the counters as they were") {
  const zero::config cfg = two_groups();
  on_ranks<float>(
      2, 2, cfg,
      [&](communicator&, const zero::partition_plan&, auto& st, zero::stepper& steps, auto& run) {
        st.set(1, std::vector<float>(19, 0.75f));
        steps.resume(9, 9);
        const auto before = st.own_array(0);
        CHECK_THROWS_AS((void)zero::load_state(run, cfg, dirs().root / "missing", st, steps),
                        ringzero::checkpoint_error);
        CHECK(st.own_array(0) == before);
        CHECK(steps.step_count() == 9);
      });
}

TEST_CASE("a float16 checkpoint keeps the loss scale") {
  const zero::config cfg = two_groups();
  const fs::path dir = dirs().fresh("scale");
  on_ranks<float16>(
      2, 3, cfg,
      [&](communicator&, const zero::partition_plan&, auto& st, zero::stepper& steps, auto& run) {
        steps.restore_loss_scale(512.0f, 7);
        zero::save_state(run, cfg, dir, st, steps, [](std::uint64_t) {});
      });
  on_ranks<float16>(
      1, 0, cfg,
      [&](communicator&, const zero::partition_plan&, auto& st, zero::stepper& steps, auto& run) {
        REQUIRE(steps.scaler().scale() == 65536.0f);
        (void)zero::load_state(run, cfg, dir, st, steps);
        CHECK(steps.scaler().scale() == 512.0f);
        CHECK(steps.scaler().good_steps() == 7);
      });
}
