#include <doctest/doctest.h>

#include <string>

#include "fabric_file.hpp"
#include "report.hpp"
#include "ringzero/error.hpp"
#include "ringzero/model/fabric.hpp"
#include "workloads.hpp"

using namespace ringzero;
using model::parse_fabric;

namespace {

const std::string valid = R"(# a comment line
name = test node
gpus_per_node = 4
intra_bandwidth = 200GB/s
intra_latency = 1500 ns     # trailing comment
nics_per_node = 2
nic_bandwidth = 400 Gb/s
inter_latency = 0.01 ms
efficiency = 0.8
reduce_bandwidth = 1 TB/s
chunk = 512 KiB
published = 2 8GiB 100GB/s
published = 4 1MiB 50000MB/s
)";

/// The message parse_fabric throws for `text`, or "" if it parses.
std::string error_of(const std::string& text) {
  try {
    (void)parse_fabric(text, "x.fabric");
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return "";
}

std::string replace(std::string text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  REQUIRE(at != std::string::npos);
  return text.replace(at, from.size(), to);
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("fabric file: every key and unit") {
  const model::fabric_file file = parse_fabric(valid, "x.fabric");
  const tuning::fabric& f = file.fabric;
  CHECK(f.name == "test node");
  CHECK(f.gpus_per_node == 4);
  CHECK(f.intra_bandwidth == doctest::Approx(200e9));
  CHECK(f.intra_latency == doctest::Approx(1.5e-6));
  CHECK(f.nics_per_node == 2);
  CHECK(f.nic_bandwidth == doctest::Approx(50e9));
  CHECK(f.inter_latency == doctest::Approx(1e-5));
  CHECK(f.efficiency == doctest::Approx(0.8));
  CHECK(f.reduce_bandwidth == doctest::Approx(1e12));
  CHECK(f.chunk_bytes == 512 * 1024);
  REQUIRE(file.published.size() == 2);
  CHECK(file.published[0].nodes == 2);
  CHECK(file.published[0].bytes == 8.0 * (1 << 30));
  CHECK(file.published[0].busbw == doctest::Approx(100e9));
  CHECK(file.published[1].bytes == 1 << 20);
  CHECK(file.published[1].busbw == doctest::Approx(50e9));
}

TEST_CASE("fabric file: mistakes name the line and the key") {
  CHECK(contains(error_of(valid + "colour = blue\n"), "x.fabric:14: colour: unknown key"));
  CHECK(
      contains(error_of(valid + "gpus_per_node = 8\n"), "x.fabric:14: gpus_per_node: given twice"));
  CHECK(contains(error_of(replace(valid, "200GB/s", "200 GHz")),
                 "x.fabric:4: intra_bandwidth: unit 'GHz'"));
  CHECK(contains(error_of(replace(valid, "1500 ns", "-3 us")),
                 "intra_latency: expected a positive number"));
  CHECK(contains(error_of(replace(valid, "= 4\n", "= 4.5\n")),
                 "gpus_per_node: expected a whole number"));
  CHECK(contains(error_of(replace(valid, "= 0.8", "= 1.2")), "efficiency: must be at most 1"));
  CHECK(contains(error_of(replace(valid, "= 0.8", "= 0.8 GB/s")),
                 "efficiency: expected a plain number"));
  CHECK(contains(error_of(replace(valid, "2 8GiB 100GB/s", "2 8GiB")),
                 "x.fabric:12: published: expected 'NODES SIZE BUSBW'"));
  CHECK(contains(error_of(replace(valid, "nics_per_node = 2\n", "")),
                 "x.fabric: missing key 'nics_per_node'"));
  CHECK(contains(error_of(replace(valid, "name = test node", "name test node")),
                 "x.fabric:2: expected 'key = value'"));
  CHECK(contains(error_of(replace(valid, "name = test node", "name =")), "name: empty name"));
  CHECK(error_of(valid).empty());
}

TEST_CASE("fabric file: the shipped descriptions parse") {
  for (const char* name : {"p4d", "p5", "eth100"}) {
    const auto file = model::load_fabric(std::string(RINGZERO_FABRICS) + "/" + name + ".fabric");
    CHECK(file.fabric.gpus_per_node == 8);
    CHECK(file.fabric.efficiency <= 1);
  }
  CHECK_THROWS_AS((void)model::load_fabric(std::string(RINGZERO_FABRICS) + "/none.fabric"),
                  invalid_argument);
}

TEST_CASE("model: the p5 check stays what docs/scaling.md says") {
  const auto file = model::load_fabric(std::string(RINGZERO_FABRICS) + "/p5.fabric");
  const tuning::fabric& f = file.fabric;
  const double s = 8.0 * (1 << 30);
  const auto striped = [&](int nodes) {
    return tuning::bus_bandwidth(collective::all_reduce, s, nodes * 8,
                                 tuning::predict_striped_ring(f, collective::all_reduce, s, nodes));
  };
  // The fitted point and two out-of-sample ones, as the published table in the docs shows.
  CHECK(striped(8) / 1e9 == doctest::Approx(356.5).epsilon(0.0005));
  CHECK(striped(4) / 1e9 == doctest::Approx(358.3).epsilon(0.0005));
  CHECK(striped(32) / 1e9 == doctest::Approx(346.5).epsilon(0.0005));
  const std::string table = model::published_section(file);
  CHECK(contains(table, "| 8 | 64 | 8 GiB | 355.0 | 356.5 | +0.4 % | hier |"));
  CHECK(contains(table, "5 of 6 points within 15 %"));
}

TEST_CASE("model: ZeRO memory follows the formulas of docs/zero.md") {
  const double psi = 1e9;
  const int n = 64, g = 8;
  using model::sharding;
  CHECK(model::memory_per_gpu(sharding::stage0, psi, n, g) == doctest::Approx(16 * psi));
  CHECK(model::memory_per_gpu(sharding::stage1, psi, n, g) ==
        doctest::Approx(4 * psi + 12 * psi / n));
  CHECK(model::memory_per_gpu(sharding::stage2, psi, n, g) ==
        doctest::Approx(2 * psi + 14 * psi / n));
  CHECK(model::memory_per_gpu(sharding::stage3, psi, n, g) == doctest::Approx(16 * psi / n));
  CHECK(model::memory_per_gpu(sharding::hybrid, psi, n, g) == doctest::Approx(16 * psi / g));
}

TEST_CASE("model: ZeRO traffic per step") {
  const auto f = model::load_fabric(std::string(RINGZERO_FABRICS) + "/p5.fabric").fabric;
  using model::sharding;
  const double psi = 7e9;
  const int nodes = 4, n = 32;
  const auto sent = [&](sharding s) {
    const auto c = model::zero_step(f, s, psi, nodes);
    return c.intra_bytes + c.inter_bytes;
  };
  // Stages 0-2 move 2(n-1)/n of the bf16 gradients; stage 3 adds a second parameter gather.
  CHECK(sent(sharding::stage0) == doctest::Approx(2.0 * (n - 1) / n * 2 * psi));
  CHECK(sent(sharding::stage1) == doctest::Approx(sent(sharding::stage0)));
  CHECK(sent(sharding::stage3) == doctest::Approx(1.5 * sent(sharding::stage1)));
  const auto hybrid = model::zero_step(f, sharding::hybrid, psi, nodes);
  CHECK(hybrid.inter_bytes == doctest::Approx(2.0 * 3 / 4 * 2 * psi / 8));
  // Striped rings price stages 0-2 alike; ringzero's flat reduce_scatter/all_gather do not.
  CHECK(model::zero_step(f, sharding::stage1, psi, nodes, model::pricing::striped).seconds ==
        doctest::Approx(
            model::zero_step(f, sharding::stage0, psi, nodes, model::pricing::striped).seconds)
            .epsilon(0.01));
  CHECK(model::zero_step(f, sharding::stage1, psi, nodes).seconds >
        3 * model::zero_step(f, sharding::stage0, psi, nodes).seconds);
}

TEST_CASE("model: quantized wire formats and ZeRO++'s step") {
  const auto f = model::load_fabric(std::string(RINGZERO_FABRICS) + "/eth100.fabric").fabric;
  const double s = 64.0 * (1 << 20);
  // The wire ratio per element: bf16 halves a float, int8 with a float per 256 elements...
  CHECK(tuning::wire_ratio(wire_format::bf16, 0, 4) == doctest::Approx(0.5));
  CHECK(tuning::wire_ratio(wire_format::int8, 0, 2) == doctest::Approx((1 + 4.0 / 256) / 2));
  CHECK(tuning::wire_ratio(wire_format::int4, 64, 4) == doctest::Approx((0.5 + 4.0 / 64) / 4));
  // full is the two-level pick; a quantized all_gather between nodes moves its share of the
  // bytes, and adds the passes over the elements.
  for (const collective c :
       {collective::all_gather, collective::reduce_scatter, collective::all_reduce})
    CHECK(tuning::predict_wire(f, c, wire_format::full, 0, 4, s, 4) ==
          tuning::predict(f, c, tuning::select(f, c, s, 4), s, 4));
  const double plain =
      tuning::predict_wire(f, collective::all_gather, wire_format::full, 0, 2, s, 4);
  const double int8 =
      tuning::predict_wire(f, collective::all_gather, wire_format::int8, 0, 2, s, 4);
  CHECK(int8 < 0.55 * plain);
  CHECK(int8 > 0.5 * plain);
  // ZeRO++ with no option is stage 3; all three move a quarter of the bytes between nodes.
  using model::sharding;
  const double psi = 7e9;
  const auto none = model::zeropp_step(f, psi, 4, {});
  const auto stage3 = model::zero_step(f, sharding::stage3, psi, 4);
  CHECK(none.seconds == doctest::Approx(stage3.seconds));
  CHECK(none.inter_bytes == doctest::Approx(stage3.inter_bytes));
  const auto all = model::zeropp_step(f, psi, 4, {true, true, true});
  CHECK(all.inter_bytes < 0.25 * none.inter_bytes);
  CHECK(all.seconds < none.seconds / 4);
  CHECK(contains(model::zeropp_section({model::fabric_file{f, {}}}),
                 "| eth100-a100 | 7B | 4 (32) |"));
}

TEST_CASE("model: architectures") {
  const auto f = model::load_fabric(std::string(RINGZERO_FABRICS) + "/p4d.fabric").fabric;
  const double psi = 7e9, grads = 2 * psi;
  // A central server carries every node's gradient; sharded servers an all_reduce's worth.
  CHECK(model::central_server(f, psi, 16).link_bytes == doctest::Approx(16 * grads));
  CHECK(model::sharded_servers(f, psi, 16).link_bytes == doctest::Approx(2.0 * 15 / 16 * grads));
  CHECK(model::central_server(f, psi, 32).seconds >
        1.9 * model::central_server(f, psi, 16).seconds);
  // Fusion into fewer buffers saves latency, never bandwidth.
  const auto small = model::fused_ring(f, psi, 16, 1 << 20);
  const auto big = model::fused_ring(f, psi, 16, 64.0 * (1 << 20));
  CHECK(small.link_bytes == doctest::Approx(big.link_bytes));
  CHECK(small.seconds > big.seconds);
}

TEST_CASE("model: crossovers are located between scan points") {
  // A made-up pair of costs that cross at 1 MiB exactly: within 1 % of each other (shown as a
  // tie) from just below to just above it.
  const auto cost = [](algorithm a, double x) {
    return a == algorithm::ring ? 1e-3 + x * 1e-12 : 1e-6 + x * (1e-12 + (1e-3 - 1e-6) / (1 << 20));
  };
  CHECK(model::crossovers(cost, {algorithm::ring, algorithm::tree}) ==
        "tree → 1014 KiB → ring/tree → 1.01 MiB → ring");
  CHECK(model::format_bytes(8.0 * (1 << 30)) == "8 GiB");
  CHECK(model::format_bytes(1536) == "1.5 KiB");
  CHECK(model::format_time(2.5e-5) == "25.0 us");
  CHECK(model::format_time(0.1234) == "123.4 ms");
}
