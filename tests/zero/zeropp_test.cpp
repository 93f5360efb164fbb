// ZeRO++ in the sharder (zero/zeropp.hpp): zero_quantized_weights, zero_quantized_gradients and
// zero_hpz_partition_size over loopback ranks, on one node and on simulated nodes of 2.
//   - hpZ changes no value (bitwise the plain weights) and moves backward's gathers off the shard
//     communicator; its secondary copy is in the memory report;
//   - qwZ: every gathered weight is within half its block's scale of the master weight, and the
//     same bits on every rank;
//   - qgZ: one SGD step moves every weight by lr times a gradient within quantize::error_bound of
//     the plain one, with two hops (2 per node) and with one;
//   - all three: training reaches the plain run's objective to 1%; a checkpoint saved with them
//     loads into a plain sharder at another world size, unchanged;
//   - settings that cannot work are refused.
#include <doctest/doctest.h>

#include <ringzero/reduce/quantize.hpp>
#include <ringzero/trace.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <vector>

#include "zero_harness.hpp"

namespace {

using namespace zt;
namespace q = ringzero::quantize;

const std::vector<std::vector<std::size_t>> layers = {{300, 17}, {600}, {129, 40}, {257}};

/// Trains as zt::train does, and reads the world communicator's all_gather bytes afterwards.
template <class P>
run_result train_counting(const zero::model_layout& layout, const run_options& o,
                          std::vector<std::uint64_t>& gather_bytes) {
  run_result res;
  res.params.resize(static_cast<std::size_t>(o.world));
  res.memory.resize(static_cast<std::size_t>(o.world));
  res.held.resize(static_cast<std::size_t>(o.world));
  gather_bytes.assign(static_cast<std::size_t>(o.world), 0);
  ringzero::loopback::world w(o.world, {.ranks_per_node = o.ranks_per_node});
  w.run([&](communicator& comm) {
    train_rank<zero::sharder<communicator, P>>(comm, layout, o, res, [](auto&) {});
    for (const auto& c : ringzero::trace::counters(comm))
      if (c.kind == ringzero::collective::all_gather)
        gather_bytes[static_cast<std::size_t>(comm.rank())] += c.bytes;
  });
  return res;
}

std::size_t numel_of(const zero::model_layout& layout, std::size_t p) {
  std::size_t n = 1;
  for (std::size_t d : layout.params()[p].shape) n *= d;
  return n;
}

double objective(const zero::model_layout& layout, const std::vector<float>& w) {
  double sum = 0;
  std::size_t at = 0;
  for (std::size_t p = 0; p < layout.params().size(); ++p)
    for (std::size_t i = 0; i < numel_of(layout, p); ++i, ++at) {
      const double d = w[at] - initial_value(static_cast<int>(p) + 100, i);
      sum += d * d;
    }
  return sum;
}

}  // namespace

TEST_CASE("hpZ: the plain weights bitwise, backward gathers inside the group, its copy counted") {
  const auto layout = make_layout<float>(layers);
  run_options o;
  o.world = 4;
  o.stage = 3;
  o.steps = 3;
  o.bucket_bytes = 1024;
  o.ranks_per_node = 2;
  std::vector<std::uint64_t> plain_bytes, hpz_bytes;
  const run_result plain = train_counting<float>(layout, o, plain_bytes);
  o.configure = [](zero::config& c) { c.zero_hpz_partition_size = 2; };
  const run_result hpz = train_counting<float>(layout, o, hpz_bytes);
  for (int r = 0; r < o.world; ++r) {
    CHECK(hpz.params[static_cast<std::size_t>(r)] == plain.params[static_cast<std::size_t>(r)]);
    // The world gathers forward and the final full_parameters(); backward gathers in the group.
    CHECK(hpz_bytes[static_cast<std::size_t>(r)] <
          plain_bytes[static_cast<std::size_t>(r)] * 3 / 4);
    const auto& m = hpz.memory[static_cast<std::size_t>(r)];
    CHECK(plain.memory[static_cast<std::size_t>(r)].secondary == 0);
    CHECK(m.secondary > 0);
    CHECK(m.total() == plain.memory[static_cast<std::size_t>(r)].total() + m.secondary);
    CHECK(m.to_string().find("hpZ secondary") != std::string::npos);
  }
  // The secondary copy is the padded model over the group: parameters of 4 ranks' shards, halved.
  CHECK(hpz.memory[0].secondary == 2 * hpz.memory[0].parameters);
}

TEST_CASE("qwZ: every gathered weight within half its block's scale, the same bits on every rank") {
  const auto layout = make_layout<float>(layers);
  for (const int world : {3, 4}) {
    std::mutex mu;
    std::vector<std::vector<float>> gathered(static_cast<std::size_t>(world));
    std::vector<float> master;
    ringzero::loopback::world w(world);
    w.run([&](communicator& comm) {
      run_options o;
      o.world = world;
      o.stage = 3;
      o.bucket_bytes = 1024;
      o.configure = [](zero::config& c) { c.zero_quantized_weights = true; };
      zero::sharder<communicator, float> shd(comm, layout, make_config(o));
      for (std::size_t p = 0; p < layout.params().size(); ++p) {
        std::vector<float> v(numel_of(layout, p));
        for (std::size_t i = 0; i < v.size(); ++i) v[i] = initial_value(static_cast<int>(p), i);
        shd.set_parameter(static_cast<int>(p), v);
      }
      std::vector<float> mine;
      for (int l = 0; l < static_cast<int>(shd.plan().layers().size()); ++l) {
        auto g = shd.gather(l);
        const auto& li = shd.plan().layers()[static_cast<std::size_t>(l)];
        for (int p = li.first_param; p < li.first_param + li.param_count; ++p) {
          const auto v = g.param(p);
          mine.insert(mine.end(), v.begin(), v.end());
        }
      }
      auto full = shd.full_parameters();
      std::lock_guard lock(mu);
      gathered[static_cast<std::size_t>(comm.rank())] = std::move(mine);
      if (comm.rank() == 0) master = std::move(full);
    });
    for (int r = 1; r < world; ++r) CHECK(gathered[static_cast<std::size_t>(r)] == gathered[0]);
    // The initial values are within [-0.5, 0.5): no block's scale is above int8's for 0.5.
    const double bound = q::element_error(ringzero::wire_format::int8, 0.5);
    REQUIRE(master.size() == gathered[0].size());
    double worst = 0;
    bool changed = false;
    for (std::size_t i = 0; i < master.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(gathered[0][i]) - master[i]));
      changed = changed || gathered[0][i] != master[i];
    }
    CHECK(worst <= bound);
    CHECK(changed);  // the weights did go through int8
  }
}

TEST_CASE("qgZ: one SGD step moves every weight by lr times a gradient within the stated bound") {
  const auto layout = make_layout<float>(layers);
  for (const auto& run :
       {std::tuple{4, 2, 3}, std::tuple{4, 2, 2}, std::tuple{3, 0, 2}, std::tuple{6, 3, 0}}) {
    // Named copies, not a structured binding: INFO's lambda may not refer to one (Clang 14).
    const int world = std::get<0>(run);
    const int per_node = std::get<1>(run);
    const int stage = std::get<2>(run);
    INFO("world ", world, ", ", per_node, " per node, stage ", stage);
    run_options o;
    o.world = world;
    o.stage = stage;
    o.steps = 1;
    o.ranks_per_node = per_node;
    o.optimizer = zero::optimizer_kind::sgd;
    const run_result plain = train<float>(layout, o);
    o.configure = [](zero::config& c) { c.zero_quantized_gradients = true; };
    const run_result qg = train<float>(layout, o);
    // Each rank's gradient element is the mean over its samples of terms below 1.1 in magnitude
    // (|w|, |target| < 0.5, noise 0.1), times its share of the batch.
    const double a = 1.1 * (batch / world) / batch;
    const auto shape = stage == 0 ? q::call_shape::reduce_whole : q::call_shape::reduce_blocks;
    const double bound =
        0.1 * q::error_bound<float>(ringzero::wire_format::int4, shape, world, per_node, a);
    double worst = 0;
    for (std::size_t i = 0; i < plain.params[0].size(); ++i)
      worst = std::max(worst, std::abs(static_cast<double>(qg.params[0][i]) - plain.params[0][i]));
    INFO("worst ", worst, ", bound ", bound);
    CHECK(worst <= bound * 1.0001 + 1e-7);
    CHECK(worst > 0);
    for (int r = 1; r < world; ++r) CHECK(qg.params[static_cast<std::size_t>(r)] == qg.params[0]);
  }
}

TEST_CASE("all three: the plain objective to 1%, and a checkpoint a plain sharder loads") {
  const auto layout = make_layout<float>(layers);
  const auto dir =
      std::filesystem::temp_directory_path() / ("ringzero_zeropp_" + std::to_string(::getpid()));
  run_options o;
  o.world = 4;
  o.stage = 3;
  o.steps = 30;
  o.bucket_bytes = 1024;
  o.ranks_per_node = 2;
  const run_result plain = train<float>(layout, o);
  o.configure = [](zero::config& c) {
    c.zero_quantized_weights = true;
    c.zero_quantized_gradients = true;
    c.zero_hpz_partition_size = 2;
  };
  o.save_dir = dir;
  const run_result pp = train<float>(layout, o);
  const double l0 = objective(layout, plain.params[0]), l3 = objective(layout, pp.params[0]);
  const double start = objective(layout, [&] {
    std::vector<float> w;
    for (std::size_t p = 0; p < layout.params().size(); ++p)
      for (std::size_t i = 0; i < numel_of(layout, p); ++i)
        w.push_back(initial_value(static_cast<int>(p), i));
    return w;
  }());
  INFO("objective: start ", start, ", plain ", l0, ", ZeRO++ ", l3);
  CHECK(l0 < 0.5 * start);
  CHECK(std::abs(l3 - l0) <= 0.01 * l0);
  // The checkpoint holds the master weights as they were: a plain sharder on 2 ranks loads them.
  run_options back;
  back.world = 2;
  back.stage = 2;
  back.steps = 0;
  back.load_dir = dir;
  const run_result loaded = train<float>(layout, back);
  CHECK(loaded.params[0] == pp.params[0]);
  std::filesystem::remove_all(dir);
}

TEST_CASE("ZeRO++ settings that cannot work are refused") {
  const auto layout = make_layout<float>(layers);
  const auto refused = [&](int world, int stage, auto configure, const char* words) {
    run_options o;
    o.world = world;
    o.stage = stage;
    o.configure = configure;
    o.steps = 0;
    try {
      (void)train<float>(layout, o);
      FAIL("accepted: ", words);
    } catch (const ringzero::error& e) {
      CHECK_MESSAGE(std::string(e.what()).find(words) != std::string::npos, e.what());
    }
  };
  refused(
      2, 2, [](zero::config& c) { c.zero_quantized_weights = true; },
      "zero_quantized_weights quantizes stage 3");
  refused(
      2, 2, [](zero::config& c) { c.zero_hpz_partition_size = 2; },
      "zero_hpz_partition_size shards stage 3");
  refused(
      3, 3, [](zero::config& c) { c.zero_hpz_partition_size = 2; }, "does not divide the 3 ranks");
  refused(
      2, 3, [](zero::config& c) { c.zero_hpz_partition_size = -1; }, "expected 0, 1 or more");
  refused(
      2, 2,
      [](zero::config& c) {
        c.zero_quantized_gradients = true;
        c.reproducible = true;
      },
      "exclude each other");
  refused(
      2, 3, [](zero::config& c) { c.collectives.all_gather.wire = ringzero::wire_format::int8; },
      "quantizes through zero_quantized_weights");
}
