#include <doctest/doctest.h>

#include <ringzero/transport/loopback.hpp>
#include <ringzero/zero/model_state.hpp>

#include <algorithm>
#include <string>
#include <vector>

namespace zero = ringzero::zero;
using ringzero::bfloat16;
using ringzero::loopback::communicator;

namespace {

// Three layers of odd sizes; with 32-element buckets the middle one is a bucket of its own,
// larger than the bucket size.
template <class P>
zero::model_layout layout() {
  zero::model_layout l;
  const std::size_t sizes[] = {7, 40, 13};
  for (int i = 0; i < 3; ++i) {
    l.add_layer("layer" + std::to_string(i));
    l.add({.name = "w" + std::to_string(i), .shape = {sizes[i]}, .type = ringzero::dtype_of<P>()});
  }
  return l;
}

// Not representable in bfloat16, so rounding shows.
float value(int param, std::size_t i) {
  return 0.3f + static_cast<float>(param) - 0.01f * static_cast<float>(i);
}
float grad(int param, std::size_t i) {
  return 0.1f * static_cast<float>(param + 1) + 0.001f * static_cast<float>(i);
}

std::vector<float> values(const zero::partition_plan& plan, int p) {
  std::vector<float> v(plan.params()[static_cast<std::size_t>(p)].numel);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = value(p, i);
  return v;
}

const ringzero::options gather_options = zero::collective_options{}.all_gather;

/// Runs f(comm, plan, state, run) on every rank of a world of `world`, the state laid out for
/// `stage` and set to value(); `run` counts the collective steps it is handed.
template <class P, class F>
void with_state(int world, int stage, const zero::optimizer_options& o, F f) {
  const auto l = layout<P>();
  ringzero::loopback::world(world).run([&](communicator& comm) {
    const zero::partition_plan plan(l, world, 32, 4);
    zero::model_state<P> st(plan, zero::stage_of(stage), comm.rank(), o);
    for (int p = 0; p < 3; ++p) st.set(p, values(plan, p));
    int runs = 0;
    auto run = [&](auto&& step) {
      ++runs;
      return step(comm);
    };
    f(comm, plan, st, run, runs);
  });
}

}  // namespace

TEST_CASE_TEMPLATE("every stage holds the parameters it was set to where its layout says", P, float,
                   bfloat16) {
  for (int world = 1; world <= 3; ++world)
    for (int stage = 0; stage <= 3; ++stage) {
      CAPTURE(world);
      CAPTURE(stage);
      with_state<P>(
          world, stage, {},
          [&](communicator&, const zero::partition_plan& plan, zero::model_state<P>& st, auto& run,
              int& runs) {
            const auto& sl = zero::stage_of(stage);
            CHECK(st.parameters().size() ==
                  (sl.sharded_parameters ? plan.shard_size() : plan.padded_size()));
            CHECK(st.local().size() ==
                  (sl.sharded_optimizer ? st.own().size() : plan.all_segments().size()));
            if (!sl.sharded_parameters) {
              for (int p = 0; p < 3; ++p) {
                const auto& pi = plan.params()[static_cast<std::size_t>(p)];
                for (std::size_t i = 0; i < pi.numel; ++i)
                  CHECK(st.parameters()[pi.offset + i] == zero::to_param<P>(value(p, i)));
              }
            } else {
              for (const auto& s : st.own())
                for (std::size_t k = 0; k < s.count; ++k)
                  CHECK(st.parameters()[s.shard_offset + k] ==
                        zero::to_param<P>(value(s.param, s.begin + k)));
            }
            // The checkpoint layout: fp32 masters at shard positions, padding and moments zero.
            const auto master = st.own_array(0);
            const auto moment = st.own_array(1);
            REQUIRE(master.size() == plan.shard_size());
            std::size_t owned = 0;
            for (const auto& s : st.own())
              for (std::size_t k = 0; k < s.count; ++k) {
                CHECK(master[s.shard_offset + k] == value(s.param, s.begin + k));
                ++owned;
              }
            // No value() is zero: every other element is padding.
            CHECK(static_cast<std::size_t>(std::count_if(
                      master.begin(), master.end(), [](float x) { return x != 0.0f; })) == owned);
            for (float x : moment) CHECK(x == 0.0f);
            // Every rank ends with the whole model; only sharded optimizer state needs the network.
            const auto full = st.full_parameters(run, gather_options);
            std::vector<float> expect;
            for (int p = 0; p < 3; ++p)
              for (float x : values(plan, p)) expect.push_back(x);
            CHECK(full == expect);
            CHECK(runs == (sl.sharded_optimizer ? 1 : 0));
          });
    }
}

TEST_CASE(
    "update writes each segment's master, moment and parameter; share_updates completes "
    "the flat parameters in stages 1-2") {
  const zero::optimizer_options o{
      .kind = zero::optimizer_kind::sgd, .lr = 0.25f, .momentum = 0.5f, .weight_decay = 0.0f};
  const auto k = zero::make_step_constants(o, 1, 0.5f);
  auto after = [&](int p, std::size_t i) {
    return zero::sgd_element(grad(p, i), {value(p, i), 0.0f, 0.0f}, k, false);
  };
  for (int stage = 0; stage <= 3; ++stage) {
    CAPTURE(stage);
    with_state<bfloat16>(3, stage, o,
                         [&](communicator&, const zero::partition_plan& plan,
                             zero::model_state<bfloat16>& st, auto& run, int& runs) {
                           const auto& sl = zero::stage_of(stage);
                           std::vector<float> g;
                           for (const auto& s : st.local()) {
                             g.resize(s.count);
                             for (std::size_t j = 0; j < s.count; ++j)
                               g[j] = grad(s.param, s.begin + j);
                             st.update(s, g.data(), k, false);
                           }
                           st.share_updates(run, gather_options);
                           CHECK(runs == (sl.gather_after_step ? 1 : 0));
                           const auto master = st.own_array(0);
                           const auto moment = st.own_array(1);
                           for (const auto& s : st.own())
                             for (std::size_t j = 0; j < s.count; ++j) {
                               const auto e = after(s.param, s.begin + j);
                               CHECK(master[s.shard_offset + j] == e.w);
                               CHECK(moment[s.shard_offset + j] == e.m);
                               if (sl.sharded_parameters)
                                 CHECK(st.parameters()[s.shard_offset + j] == bfloat16(e.w));
                             }
                           // Stages 0-2 hold every parameter; in 1-2 most were updated by other
                           // ranks.
                           if (!sl.sharded_parameters)
                             for (int p = 0; p < 3; ++p) {
                               const auto& pi = plan.params()[static_cast<std::size_t>(p)];
                               for (std::size_t i = 0; i < pi.numel; ++i)
                                 CHECK(st.parameters()[pi.offset + i] == bfloat16(after(p, i).w));
                             }
                         });
  }
}

TEST_CASE("restore takes staged arrays; the parameters become the masters rounded") {
  with_state<bfloat16>(
      2, 2, {},
      [&](communicator&, const zero::partition_plan& plan, zero::model_state<bfloat16>& st, auto&,
          int&) {
        const std::size_t n = st.optimizer().local_size();
        REQUIRE(n == plan.shard_size());
        REQUIRE(st.optimizer().moment_size(2) == n);
        std::vector<float> master(n), m1(n), m2(n);
        for (std::size_t i = 0; i < n; ++i) {
          master[i] = 1.0f + 0.001f * static_cast<float>(i);
          m1[i] = 2.0f * static_cast<float>(i);
          m2[i] = 3.0f * static_cast<float>(i);
        }
        st.restore(master, m1, m2);
        const auto saved = st.own_array(0);
        const auto saved1 = st.own_array(1);
        const auto saved2 = st.own_array(2);
        for (const auto& s : st.own())
          for (std::size_t j = 0; j < s.count; ++j) {
            const std::size_t l = st.local_of(s) + j;
            CHECK(saved[s.shard_offset + j] == 1.0f + 0.001f * static_cast<float>(l));
            CHECK(saved1[s.shard_offset + j] == 2.0f * static_cast<float>(l));
            CHECK(saved2[s.shard_offset + j] == 3.0f * static_cast<float>(l));
            CHECK(st.parameters()[s.flat_offset + j] == bfloat16(saved[s.shard_offset + j]));
          }
      });
}

TEST_CASE("the byte counts are those of the buffers the stage allocates") {
  with_state<bfloat16>(2, 3, {},
                       [&](communicator&, const zero::partition_plan& plan,
                           zero::model_state<bfloat16>& st, auto&, int&) {
                         CHECK(st.parameter_bytes() == plan.shard_size() * sizeof(bfloat16));
                         // fp32 master and AdamW's two moments.
                         CHECK(st.optimizer_bytes() == 3 * plan.shard_size() * sizeof(float));
                         CHECK(st.optimizer().bytes() == st.optimizer_bytes());
                       });
  with_state<float>(2, 0, {.kind = zero::optimizer_kind::sgd},
                    [&](communicator&, const zero::partition_plan& plan,
                        zero::model_state<float>& st, auto&, int&) {
                      CHECK(st.parameter_bytes() == plan.padded_size() * sizeof(float));
                      // An fp32 parameter is its own master: SGD's momentum only.
                      CHECK(st.optimizer_bytes() == plan.padded_size() * sizeof(float));
                    });
}
