#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "ringzero/algorithm.hpp"
#include "ringzero/collective_table.hpp"
#include "ringzero/model/cost_model.hpp"
#include "ringzero/model/fabric.hpp"
#include "ringzero/transport/concept.hpp"

using namespace ringzero;

namespace {

// p5.48xlarge's figures (tools/model/fabrics/p5.fabric) and a p4d-like node whose NIC is
// shared by two GPUs.
tuning::fabric p5() {
  tuning::fabric f;
  f.name = "p5";
  f.gpus_per_node = 8;
  f.intra_bandwidth = 450e9;
  f.intra_latency = 2e-6;
  f.nics_per_node = 32;
  f.nic_bandwidth = 12.5e9;
  f.inter_latency = 15e-6;
  f.efficiency = 0.9;
  f.reduce_bandwidth = 1100e9;
  return f;
}

tuning::fabric shared_nic() {
  tuning::fabric f = p5();
  f.intra_bandwidth = 300e9;
  f.nics_per_node = 4;
  return f;
}

constexpr collective collectives[] = {collective::all_reduce, collective::reduce_scatter,
                                      collective::all_gather};
constexpr algorithm every_algorithm[] = {
    algorithm::ring, algorithm::tree, algorithm::recursive_doubling,
    algorithm::recursive_halving_doubling, algorithm::hierarchical};
constexpr double sizes[] = {8, 4096, 1 << 20, 3e7, 8.0 * (1 << 30)};

}  // namespace

TEST_CASE("fabric: each level's constants come from its links") {
  const tuning::fabric f = shared_nic();
  const tuning::policy intra = tuning::intra_node(f), inter = tuning::inter_node(f);
  CHECK(intra.alpha == 2e-6);
  CHECK(intra.beta == doctest::Approx(1 / (300e9 * 0.9)));
  CHECK(intra.gamma == doctest::Approx(1 / 1100e9));
  CHECK(inter.alpha == 15e-6);
  // Four NICs for eight GPUs: each GPU gets half of one.
  CHECK(inter.beta == doctest::Approx(1 / (0.5 * 12.5e9 * 0.9)));
  CHECK(tuning::inter_node(p5()).beta == doctest::Approx(1 / (4 * 12.5e9 * 0.9)));
}

TEST_CASE("fabric: one node is the one-level model with the intra-node constants") {
  const tuning::fabric f = p5();
  for (collective c : collectives)
    for (algorithm a : every_algorithm)
      for (double s : sizes) {
        INFO(collective_name(c) << " " << algorithm_name(a) << " " << s);
        const double t = tuning::predict(f, c, a, s, 1);
        if (a == algorithm::hierarchical || !tuning::applies(c, a, false))
          CHECK(std::isinf(t));
        else
          CHECK(t == tuning::predict(c, a, s, 8, tuning::intra_node(f)));
      }
}

TEST_CASE("fabric: across nodes, flat algorithms run at the inter-node rate of one GPU") {
  const tuning::fabric f = shared_nic();
  for (int nodes : {2, 3, 16, 4096})
    for (collective c : collectives)
      for (algorithm a : every_algorithm) {
        if (a == algorithm::hierarchical || !tuning::applies(c, a, true)) continue;
        for (double s : sizes)
          CHECK(tuning::predict(f, c, a, s, nodes) ==
                tuning::predict(c, a, s, nodes * 8, tuning::inter_node(f)));
      }
}

TEST_CASE("fabric: hierarchical is reduce_scatter and all_gather inside, all_reduce across") {
  const tuning::fabric f = p5();
  const tuning::policy intra = tuning::intra_node(f), inter = tuning::inter_node(f);
  for (int nodes : {2, 5, 64})
    for (double s : sizes) {
      const double expected = tuning::predict_best(collective::reduce_scatter, s, 8, intra) +
                              tuning::predict_best(collective::all_reduce, s / 8, nodes, inter) +
                              tuning::predict_best(collective::all_gather, s, 8, intra);
      CHECK(tuning::predict(f, collective::all_reduce, algorithm::hierarchical, s, nodes) ==
            doctest::Approx(expected).epsilon(1e-12));
    }
  CHECK(
      std::isinf(tuning::predict(f, collective::reduce_scatter, algorithm::hierarchical, 1e6, 4)));
  // Only S/8 per GPU crosses nodes, at the NIC rate: far ahead of any flat algorithm.
  const double big = 8.0 * (1 << 30);
  CHECK(tuning::select(f, collective::all_reduce, big, 8) == algorithm::hierarchical);
}

TEST_CASE("fabric: select picks the cheapest two-level prediction") {
  for (const tuning::fabric& f : {p5(), shared_nic()})
    for (int nodes : {1, 2, 7, 32, 4096})
      for (collective c : collectives)
        for (double s = 8; s < 1e10; s *= 3.7) {
          const algorithm pick = tuning::select(f, c, s, nodes);
          const double t = tuning::predict(f, c, pick, s, nodes);
          REQUIRE(std::isfinite(t));
          for (algorithm a : tuning::candidates(c, nodes > 1))
            CHECK(t <= tuning::predict(f, c, a, s, nodes));
        }
}

TEST_CASE("fabric: today's one-level pick is cost_model.hpp's select with the NIC constants") {
  const tuning::fabric f = p5();
  const topology t{.node = 0, .local_rank = 0, .local_size = 8, .node_count = 16};
  for (double s : sizes)
    CHECK(tuning::select_one_level(f, collective::all_reduce, s, 16) ==
          tuning::select(collective::all_reduce, s, 128, tuning::inter_node(f), t));
  CHECK(tuning::select_one_level(f, collective::all_reduce, 8.0 * (1 << 30), 1) ==
        tuning::select(collective::all_reduce, 8.0 * (1 << 30), 8, tuning::intra_node(f)));
}

TEST_CASE("fabric: a striped ring is bound by the node's NICs, or by NVLink inside a node") {
  const tuning::fabric f = p5();
  const double s = 8.0 * (1 << 30);
  const auto busbw = [&](int nodes) {
    return tuning::bus_bandwidth(collective::all_reduce, s, nodes * 8,
                                 tuning::predict_striped_ring(f, collective::all_reduce, s, nodes));
  };
  // Line rate times efficiency, less the latency of 2(n-1) hops.
  CHECK(busbw(1) == doctest::Approx(405e9).epsilon(0.002));
  CHECK(busbw(8) == doctest::Approx(360e9).epsilon(0.015));
  CHECK(busbw(8) < 360e9);
  CHECK(busbw(4096) < busbw(512));
}

TEST_CASE("fabric: bus bandwidth follows nccl-tests") {
  CHECK(tuning::bus_bandwidth(collective::all_reduce, 1e9, 4, 1.0) == doctest::Approx(1.5e9));
  CHECK(tuning::bus_bandwidth(collective::reduce_scatter, 1e9, 4, 1.0) == doctest::Approx(0.75e9));
  CHECK(tuning::bus_bandwidth(collective::all_gather, 1e9, 4, 2.0) == doctest::Approx(0.375e9));
  CHECK(tuning::bus_bandwidth(collective::broadcast, 1e9, 4, 1.0) == doctest::Approx(1e9));
  CHECK(tuning::bus_bandwidth(collective::all_reduce, 1e9, 1, 1.0) == 0.0);
  // The descriptor's factor for every collective: 1 for gather, scatter and all_to_all was the
  // copy's, where ringzero-perf reports (n-1)/n.
  for (collective c : {collective::all_to_all, collective::gather, collective::scatter})
    CHECK(tuning::bus_bandwidth(c, 1e9, 4, 1.0) == doctest::Approx(0.75e9));
  for (const collective_descriptor& d : builtin_collectives::all)
    CHECK(tuning::bus_bandwidth(d.id, 1e9, 4, 1.0) ==
          doctest::Approx(1e9 * d.bus_bandwidth_factor(4)));
}

TEST_CASE("fabric: hierarchical all_to_all gathers and scatters inside, exchanges across") {
  const tuning::fabric f = p5();
  const tuning::policy intra = tuning::intra_node(f), inter = tuning::inter_node(f);
  for (int nodes : {2, 5, 64})
    for (double s : sizes) {
      const double expected = tuning::predict_best(collective::gather, 8 * s, 8, intra) +
                              tuning::predict_best(collective::all_to_all, 8 * s, nodes, inter) +
                              tuning::predict_best(collective::scatter, 8 * s, 8, intra);
      CHECK(tuning::predict(f, collective::all_to_all, algorithm::hierarchical, s, nodes) ==
            doctest::Approx(expected).epsilon(1e-12));
    }
  CHECK(std::isinf(tuning::predict(f, collective::all_to_allv, algorithm::hierarchical, 1e6, 4)));
}
