// The tables ringzero-model prints and docs/scaling.md shows, as markdown. Each section is a
// pure function of the fabric files, so `ringzero-model --check` can regenerate the document's
// tables and compare them byte for byte.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fabric_file.hpp"
#include "ringzero/algorithm.hpp"
#include "ringzero/model/fabric.hpp"
#include "workloads.hpp"

namespace ringzero::model {

inline constexpr double kib = 1024.0, mib = kib * kib, gib = mib * kib;

/// 1, 2, 4, ..., 4096 nodes.
[[nodiscard]] inline std::vector<int> node_counts() {
  std::vector<int> out;
  for (int n = 1; n <= 4096; n *= 2) out.push_back(n);
  return out;
}

[[nodiscard]] inline std::string format_bytes(double b) {
  const char* names[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  if (b == std::floor(b) || b >= 100) return fmt::format("{:.0f} {}", b, names[u]);
  return fmt::format("{:.3g} {}", b, names[u]);
}

[[nodiscard]] inline std::string format_time(double s) {
  if (s < 1e-3) return fmt::format("{:.1f} us", s * 1e6);
  if (s < 1) return fmt::format("{:.1f} ms", s * 1e3);
  return fmt::format("{:.2f} s", s);
}

[[nodiscard]] inline std::string format_gbps(double bytes_per_second) {
  return fmt::format("{:.1f}", bytes_per_second / 1e9);
}

[[nodiscard]] inline std::string format_gb(double bytes) {
  return fmt::format("{:.1f}", bytes / 1e9);
}

/// The algorithms within 1 % of the cheapest at `bytes`, joined by "/" in name order: a
/// near-tie is shown as one, since which of them a model picks there is rounding.
template <class Cost>
[[nodiscard]] std::string contenders(Cost cost, const std::vector<algorithm>& candidates,
                                     double bytes) {
  double best = std::numeric_limits<double>::infinity();
  for (algorithm a : candidates) best = std::min(best, cost(a, bytes));
  std::vector<std::pair<double, algorithm>> close;
  for (algorithm a : candidates)
    if (const double t = cost(a, bytes); t <= best * 1.01) close.emplace_back(t, a);
  std::stable_sort(close.begin(), close.end(),
                   [](const auto& x, const auto& y) { return x.first < y.first; });
  std::vector<std::string_view> names;
  for (const auto& c : close) names.push_back(algorithm_name(c.second));
  std::sort(names.begin(), names.end());
  std::string out(names.front());
  for (std::size_t i = 1; i < names.size(); ++i) out += "/" + std::string(names[i]);
  return out;
}

/// Where the cheapest algorithm under `cost` changes between 8 B and 8 GiB, as
/// "rd → 45.3 KiB → hier": a scan in steps of 2^(1/8), each change located by bisection.
template <class Cost>
[[nodiscard]] std::string crossovers(Cost cost, const std::vector<algorithm>& candidates) {
  const auto label = [&](double x) { return contenders(cost, candidates, x); };
  std::string current = label(8);
  std::string out = current;
  const double step = std::pow(2.0, 1.0 / 8);
  for (double x = 8 * step; x <= 8 * gib * 1.0001; x *= step) {
    const std::string next = label(x);
    if (next == current) continue;
    double l = x / step, h = x;
    for (int i = 0; i < 60; ++i) {
      const double m = std::sqrt(l * h);
      (label(m) == current ? l : h) = m;
    }
    out += " → " + format_bytes(std::round(h)) + " → " + next;
    current = next;
  }
  return out;
}

[[nodiscard]] inline std::string fabrics_section(const std::vector<fabric_file>& files) {
  std::string s =
      "| fabric | GPUs per node | NVLink per GPU (line) | intra α | NICs per node | NICs per "
      "node (line) | NIC share per GPU (line) | inter α | efficiency | reduction |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n";
  for (const fabric_file& file : files) {
    const tuning::fabric& f = file.fabric;
    s += fmt::format(
        "| {} | {} | {} GB/s | {} | {} × {} Gb/s | {} GB/s | {} GB/s | {} | {:.2f} | {} GB/s |\n",
        f.name, f.gpus_per_node, format_gbps(f.intra_bandwidth), format_time(f.intra_latency),
        f.nics_per_node, f.nic_bandwidth * 8 / 1e9, format_gbps(f.nics_per_node * f.nic_bandwidth),
        format_gbps(f.nics_per_node * f.nic_bandwidth / f.gpus_per_node),
        format_time(f.inter_latency), f.efficiency, format_gbps(f.reduce_bandwidth));
  }
  return s;
}

/// One row per published point: the striped-ring prediction and its error, and what
/// ringzero's own algorithms would reach there.
[[nodiscard]] inline std::string published_section(const fabric_file& file) {
  const tuning::fabric& f = file.fabric;
  if (file.published.empty()) return fmt::format("{}: no published points.\n", f.name);
  std::string s = fmt::format(
      "{}: all_reduce bus bandwidth in GB/s.\n\n"
      "| nodes | GPUs | size | published | model (striped ring) | error | ringzero pick | "
      "ringzero pick busbw | ringzero ring (one channel) |\n"
      "|---|---|---|---|---|---|---|---|---|\n",
      f.name);
  int within = 0;
  double worst = 0;
  for (const published_point& p : file.published) {
    const int n = p.nodes * f.gpus_per_node;
    const auto busbw = [&](double t) {
      return tuning::bus_bandwidth(collective::all_reduce, p.bytes, n, t);
    };
    const double model =
        busbw(tuning::predict_striped_ring(f, collective::all_reduce, p.bytes, p.nodes));
    const double error = (model - p.busbw) / p.busbw;
    within += std::abs(error) <= 0.15;
    worst = std::max(worst, std::abs(error));
    const algorithm pick = tuning::select(f, collective::all_reduce, p.bytes, p.nodes);
    s += fmt::format(
        "| {} | {} | {} | {} | {} | {:+.1f} % | {} | {} | {} |\n", p.nodes, n,
        format_bytes(p.bytes), format_gbps(p.busbw), format_gbps(model), error * 100,
        algorithm_name(pick),
        format_gbps(busbw(tuning::predict(f, collective::all_reduce, pick, p.bytes, p.nodes))),
        format_gbps(
            busbw(tuning::predict(f, collective::all_reduce, algorithm::ring, p.bytes, p.nodes))));
  }
  s += fmt::format("\n{} of {} points within 15 %; largest error {:.1f} %.\n", within,
                   file.published.size(), worst * 100);
  return s;
}

/// all_reduce from 1 to 4096 nodes: the two-level pick at four sizes, and every algorithm's
/// bus bandwidth at 8 GiB.
[[nodiscard]] inline std::string all_reduce_section(const fabric_file& file) {
  const tuning::fabric& f = file.fabric;
  const collective c = collective::all_reduce;
  std::string s = fmt::format(
      "{}: the pick and its time (8 B) or bus bandwidth (GB/s) per size; then each algorithm's "
      "bus bandwidth at 8 GiB.\n\n"
      "| nodes | GPUs | 8 B | 1 MiB | 64 MiB | 8 GiB | ring | tree | rd | rhd | hier | "
      "striped ring |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|\n",
      f.name);
  for (int nodes : node_counts()) {
    const int n = nodes * f.gpus_per_node;
    const auto pick_at = [&](double bytes, bool as_time) {
      const algorithm a = tuning::select(f, c, bytes, nodes);
      const double t = tuning::predict(f, c, a, bytes, nodes);
      return fmt::format(
          "{} {}", algorithm_name(a),
          as_time ? format_time(t) : format_gbps(tuning::bus_bandwidth(c, bytes, n, t)));
    };
    const auto at_8gib = [&](algorithm a) -> std::string {
      const double t = tuning::predict(f, c, a, 8 * gib, nodes);
      if (!std::isfinite(t)) return "–";
      return format_gbps(tuning::bus_bandwidth(c, 8 * gib, n, t));
    };
    s += fmt::format(
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n", nodes, n,
        pick_at(8, true), pick_at(mib, false), pick_at(64 * mib, false), pick_at(8 * gib, false),
        at_8gib(algorithm::ring), at_8gib(algorithm::tree), at_8gib(algorithm::recursive_doubling),
        at_8gib(algorithm::recursive_halving_doubling), at_8gib(algorithm::hierarchical),
        format_gbps(tuning::bus_bandwidth(c, 8 * gib, n,
                                          tuning::predict_striped_ring(f, c, 8 * gib, nodes))));
  }
  return s;
}

/// reduce_scatter and all_gather from 1 to 4096 nodes: the pick's time at 8 B and bus
/// bandwidth at 1 MiB and 8 GiB (size = the full buffer, as nccl-tests counts it).
[[nodiscard]] inline std::string scatter_gather_section(const fabric_file& file) {
  const tuning::fabric& f = file.fabric;
  std::string s = fmt::format(
      "{}: reduce_scatter and all_gather, the pick and its time (8 B) or bus bandwidth (GB/s).\n\n"
      "| nodes | GPUs | reduce_scatter 8 B | 1 MiB | 8 GiB | all_gather 8 B | 1 MiB | 8 GiB |\n"
      "|---|---|---|---|---|---|---|---|\n",
      f.name);
  for (int nodes : node_counts()) {
    const int n = nodes * f.gpus_per_node;
    s += fmt::format("| {} | {} |", nodes, n);
    for (collective c : {collective::reduce_scatter, collective::all_gather}) {
      for (double bytes : {8.0, mib, 8 * gib}) {
        const algorithm a = tuning::select(f, c, bytes, nodes);
        const double t = tuning::predict(f, c, a, bytes, nodes);
        s += fmt::format(
            " {} {} |", algorithm_name(a),
            bytes == 8.0 ? format_time(t) : format_gbps(tuning::bus_bandwidth(c, bytes, n, t)));
      }
    }
    s += "\n";
  }
  return s;
}

/// Where the picks change with size: under the two-level model, and under the one-level
/// model algorithm::automatic uses today when the transport reports the inter-node constants.
[[nodiscard]] inline std::string crossover_section(const fabric_file& file) {
  const tuning::fabric& f = file.fabric;
  const collective c = collective::all_reduce;
  std::string s = fmt::format(
      "{}: cheapest all_reduce from 8 B to 8 GiB; an arrow carries the size where the next "
      "starts, a/b is a tie within 1 %.\n\n"
      "| nodes | two-level model | one-level model (`auto` today) | time lost by `auto` today, "
      "worst size |\n"
      "|---|---|---|---|\n",
      f.name);
  for (int nodes : node_counts()) {
    const std::vector<algorithm> cands = tuning::candidates(c, nodes > 1);
    const int n = nodes * f.gpus_per_node;
    const tuning::policy one = nodes > 1 ? tuning::inter_node(f) : tuning::intra_node(f);
    const auto two_level = [&](algorithm a, double x) {
      return tuning::predict(f, c, a, x, nodes);
    };
    const auto one_level = [&](algorithm a, double x) {
      return a == algorithm::hierarchical ? tuning::predict_hierarchical(x, n, nodes, one)
                                          : tuning::predict(c, a, x, n, one);
    };
    double worst = 0, worst_at = 8;
    for (double x = 8; x <= 8 * gib; x *= 2) {
      const double best = two_level(tuning::select(f, c, x, nodes), x);
      const double lost = two_level(tuning::select_one_level(f, c, x, nodes), x) / best - 1;
      if (lost > worst) {
        worst = lost;
        worst_at = x;
      }
    }
    s += fmt::format("| {} | {} | {} | {} |\n", nodes, crossovers(two_level, cands),
                     crossovers(one_level, cands),
                     worst > 0 ? fmt::format("{:.0f} % at {}", worst * 100, format_bytes(worst_at))
                               : std::string("0 %"));
  }
  return s;
}

struct model_size {
  const char* name;
  double psi;
};
inline constexpr model_size zero_models[] = {{"7B", 7e9}, {"70B", 70e9}};
inline constexpr int zero_nodes[] = {4, 32};

/// Stages 0-3 and hybrid sharding for 7B and 70B parameters on 4 and 32 nodes.
[[nodiscard]] inline std::string zero_section(const std::vector<fabric_file>& files) {
  std::string s =
      "| model | nodes (GPUs) | stage | model state per GPU (GB) | sent per GPU (GB) | "
      "of it across nodes (GB) |";
  std::string rule = "|---|---|---|---|---|---|";
  for (const fabric_file& file : files) {
    s += fmt::format(" {} ringzero | {} striped rings |", file.fabric.name, file.fabric.name);
    rule += "---|---|";
  }
  s += "\n" + rule + "\n";
  const tuning::fabric& first = files.front().fabric;
  for (const model_size& m : zero_models)
    for (int nodes : zero_nodes)
      for (sharding st : {sharding::stage0, sharding::stage1, sharding::stage2, sharding::stage3,
                          sharding::hybrid}) {
        const int g = first.gpus_per_node, n = nodes * g;
        const step_cost volume = zero_step(first, st, m.psi, nodes);
        s += fmt::format("| {} | {} ({}) | {} | {} | {} | {} |", m.name, nodes, n,
                         sharding_name(st), format_gb(memory_per_gpu(st, m.psi, n, g)),
                         format_gb(volume.intra_bytes + volume.inter_bytes),
                         format_gb(volume.inter_bytes));
        for (const fabric_file& file : files)
          for (pricing how : {pricing::ringzero, pricing::striped})
            s += fmt::format(" {} |",
                             format_time(zero_step(file.fabric, st, m.psi, nodes, how).seconds));
        s += "\n";
      }
  return s;
}

/// Stage 3 with ZeRO++'s options, one at a time and together, for 7B and 70B parameters on 4
/// and 32 nodes of each fabric: the step's communication time and the bytes each GPU sends to
/// other nodes.
[[nodiscard]] inline std::string zeropp_section(const std::vector<fabric_file>& files) {
  std::string s =
      "| fabric | model | nodes (GPUs) | stage 3 | qwZ | hpZ | qgZ | all three | speedup | "
      "across nodes per GPU, stage 3 → all three (GB) |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n";
  for (const fabric_file& file : files)
    for (const model_size& m : zero_models)
      for (int nodes : zero_nodes) {
        const tuning::fabric& f = file.fabric;
        const auto step = [&](zeropp o) { return zeropp_step(f, m.psi, nodes, o); };
        const step_cost plain = step({}), all = step({true, true, true});
        s += fmt::format(
            "| {} | {} | {} ({}) | {} | {} | {} | {} | {} | {:.2f}x | {} → {} |\n", f.name, m.name,
            nodes, nodes * f.gpus_per_node, format_time(plain.seconds),
            format_time(step({.weights = true}).seconds), format_time(step({.hpz = true}).seconds),
            format_time(step({.gradients = true}).seconds), format_time(all.seconds),
            plain.seconds / all.seconds, format_gb(plain.inter_bytes), format_gb(all.inter_bytes));
      }
  return s;
}

inline constexpr double horovod_fusion_bytes = 64 * mib;
inline constexpr int architecture_nodes = 16;

/// A 7B model's bf16 gradient exchange on 16 nodes, by architecture.
[[nodiscard]] inline std::string architectures_section(const std::vector<fabric_file>& files) {
  const double psi = 7e9;
  const int nodes = architecture_nodes;
  std::string s = "| architecture | busiest link | bytes on it per step, each way (GB) |";
  std::string rule = "|---|---|---|";
  for (const fabric_file& file : files) {
    s += fmt::format(" time on {} |", file.fabric.name);
    rule += "---|";
  }
  s += "\n" + rule + "\n";
  const auto row = [&](const char* name, const char* link, double link_bytes, auto seconds) {
    s += fmt::format("| {} | {} | {} |", name, link, format_gb(link_bytes));
    for (const fabric_file& file : files)
      s += fmt::format(" {} |", format_time(seconds(file.fabric)));
    s += "\n";
  };
  const tuning::fabric& first = files.front().fabric;
  const int n = nodes * first.gpus_per_node;
  const double grads = grad_bytes_per_param * psi;
  row("parameter server, one server node", "the server's NICs",
      central_server(first, psi, nodes).link_bytes,
      [&](const tuning::fabric& f) { return central_server(f, psi, nodes).seconds; });
  row("parameter servers, one shard per node", "each node's NICs",
      sharded_servers(first, psi, nodes).link_bytes,
      [&](const tuning::fabric& f) { return sharded_servers(f, psi, nodes).seconds; });
  row("ring all_reduce, 64 MiB tensor fusion (Horovod)", "each GPU's NIC share",
      fused_ring(first, psi, nodes, horovod_fusion_bytes).link_bytes, [&](const tuning::fabric& f) {
        return fused_ring(f, psi, nodes, horovod_fusion_bytes).seconds;
      });
  row("ringzero hierarchical all_reduce", "each GPU's NIC share",
      2.0 * (nodes - 1) / nodes * grads / first.gpus_per_node, [&](const tuning::fabric& f) {
        return tuning::predict(f, collective::all_reduce, algorithm::hierarchical, grads, nodes);
      });
  row("reduce_scatter + all_gather (ZeRO 1-2)", "each GPU's NIC share", 2.0 * (n - 1) / n * grads,
      [&](const tuning::fabric& f) { return zero_step(f, sharding::stage1, psi, nodes).seconds; });
  return s;
}

}  // namespace ringzero::model
