// What the peer benchmarks (Open MPI, Gloo) share with ringzero-perf: the -b/-e/-f/-n/-w/-c flags
// with nccl-tests' meanings and nccl-tests' table rows, so bench/compare reads every program's
// output the same way. Float sum all_reduce and float all_to_all are measured; time is the
// slowest rank's.
#pragma once

#include <fmt/core.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "cli.hpp"
#include "report.hpp"

namespace ringzero::bench {

struct peer_options {
  std::size_t min_bytes = 8;
  std::size_t max_bytes = std::size_t{32} << 20;
  std::size_t step_factor = 2;
  int iters = 20;
  int warmup = 1;
  int check = 1;
};

/// Parses -b -e -f -n -w -c; anything else is an error.
[[nodiscard]] inline peer_options parse_peer_options(int argc, char** argv) {
  peer_options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a.size() != 2 || a[0] != '-' || i + 1 >= argc)
      throw invalid_argument(
          fmt::format("usage: {} [-b min] [-e max] [-f factor] [-n iters] "
                      "[-w warmup] [-c 0|1]",
                      argv[0]));
    const std::string_view v = argv[++i];
    switch (a[1]) {
      case 'b':
        o.min_bytes = perf::parse_size("-b", v);
        break;
      case 'e':
        o.max_bytes = perf::parse_size("-e", v);
        break;
      case 'f':
        o.step_factor = static_cast<std::size_t>(perf::detail::parse_int_in("-f", v, 2, 1024));
        break;
      case 'n':
        o.iters = perf::detail::parse_int_in("-n", v, 1, 1 << 30);
        break;
      case 'w':
        o.warmup = perf::detail::parse_int_in("-w", v, 0, 1 << 30);
        break;
      case 'c':
        o.check = perf::detail::parse_int_in("-c", v, 0, 1);
        break;
      default:
        throw invalid_argument(fmt::format("unknown option '{}'", a));
    }
  }
  if (o.min_bytes < 4 || o.min_bytes > o.max_bytes) throw invalid_argument("need 4 <= -b <= -e");
  return o;
}

[[nodiscard]] inline std::vector<std::size_t> peer_sizes(const peer_options& o) {
  std::vector<std::size_t> v;
  for (std::size_t s = o.min_bytes; s <= o.max_bytes; s *= o.step_factor) v.push_back(s);
  return v;
}

/// Which collective a peer measures: the table's redop column and nccl-tests' bus factor.
enum class peer_collective { all_reduce, all_to_all, reduce_scatter, all_gather };

[[nodiscard]] inline std::string_view peer_title(peer_collective c) {
  switch (c) {
    case peer_collective::all_to_all:
      return "float all_to_all";
    case peer_collective::reduce_scatter:
      return "float sum reduce_scatter";
    case peer_collective::all_gather:
      return "float all_gather";
    default:
      return "float sum all_reduce";
  }
}

inline void print_header(std::string_view what, int ranks, const peer_options& o,
                         peer_collective c = peer_collective::all_reduce) {
  fmt::print("# {}: {}, {} ranks, iters {} warmup {} check {}\n", what, peer_title(c), ranks,
             o.iters, o.warmup, o.check);
  fmt::print(
      "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  "
      "{:>6}  {:>6}\n",
      "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw",
      "busbw", "#wrong");
}

/// One nccl-tests row; seconds are the slowest rank's mean iteration time. `count` is the
/// all_reduce vector, or the block per rank of the others (the row's size is then n blocks, as
/// ringzero-perf prints them).
inline void print_row(std::size_t count, int ranks, double oop_s, long oop_wrong, double ip_s,
                      long ip_wrong, peer_collective c = peer_collective::all_reduce) {
  const bool blocks = c != peer_collective::all_reduce;
  const std::size_t full = blocks ? count * static_cast<std::size_t>(ranks) : count;
  const double bytes = static_cast<double>(full * sizeof(float));
  const double factor = blocks ? static_cast<double>(ranks - 1) / ranks : 2.0 * (ranks - 1) / ranks;
  const bool sums = c == peer_collective::all_reduce || c == peer_collective::reduce_scatter;
  auto cell = [&](double s, long wrong) {
    const double alg = s > 0 ? bytes / 1e9 / s : 0;
    return fmt::format("  {}  {}  {}  {:>6}", perf::fit(s * 1e6, 7), perf::fit(alg, 6),
                       perf::fit(alg * factor, 6), wrong);
  };
  fmt::print("{:>12}  {:>12}  {:>8}  {:>6}  {:>6}{}{}\n", full * sizeof(float), count, "float",
             sums ? "sum" : "none", -1, cell(oop_s, oop_wrong), cell(ip_s, ip_wrong));
  std::fflush(stdout);
}

/// Rank r's input element i: small integers, so the float sum is exact in any order. The
/// pattern repeats every 23 elements.
[[nodiscard]] inline float peer_input(int rank, std::size_t i) {
  const auto v = static_cast<long>((i * 7 + static_cast<std::size_t>(rank) * 13) % 23);
  return static_cast<float>(v - 11);
}

inline void peer_fill(float* dst, std::size_t count, int rank) {
  float p[23];
  for (std::size_t k = 0; k < 23; ++k) p[k] = peer_input(rank, k);
  for (std::size_t i = 0, k = 0; i < count; ++i) {
    dst[i] = p[k];
    if (++k == 23) k = 0;
  }
}

[[nodiscard]] inline long peer_wrong(const float* out, std::size_t count, int ranks) {
  float want[23] = {};
  for (std::size_t k = 0; k < 23; ++k)
    for (int r = 0; r < ranks; ++r) want[k] += peer_input(r, k);
  long wrong = 0;
  for (std::size_t i = 0, k = 0; i < count; ++i) {
    if (out[i] != want[k]) ++wrong;
    if (++k == 23) k = 0;
  }
  return wrong;
}

}  // namespace ringzero::bench
