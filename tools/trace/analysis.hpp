// ringzero-trace's two jobs: merging the ranks' files into one timeline, and the straggler
// report.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "trace_file.hpp"

namespace ringzero::trace_tool {

/// One timeline: every rank a process (pid = rank) with a phases and a collectives track per
/// communicator, timestamps moved onto rank 0's clock and started at zero.
[[nodiscard]] inline std::string merge(const std::vector<rank_file>& files) {
  double base = std::numeric_limits<double>::infinity();
  for (const auto& f : files)
    for (const auto& e : f.events)
      if (e.string_or("ph", "") != "M") base = std::min(base, e.number_or("ts", 0) + f.offset_us);
  if (base == std::numeric_limits<double>::infinity()) base = 0;

  std::vector<std::string> lines;
  std::map<int, bool> named;
  for (const auto& f : files) {
    if (!named[f.rank]) {
      named[f.rank] = true;
      lines.push_back(fmt::format(
          R"({{"name":"process_name","ph":"M","pid":{0},"tid":0,"args":{{"name":"rank {0}"}}}})",
          f.rank));
      lines.push_back(fmt::format(
          R"({{"name":"process_sort_index","ph":"M","pid":{0},"tid":0,"args":{{"sort_index":{0}}}}})",
          f.rank));
    }
    // The writer's tracks: 2k phases, 2k+1 collectives, for its communicator instance k.
    const std::string comm_name =
        f.instance == 0 ? std::string() : fmt::format("communicator {} ", f.instance);
    for (int phases = 0; phases < 2; ++phases) {
      const int tid = 2 * f.instance + (phases != 0 ? 0 : 1);
      lines.push_back(fmt::format(
          R"({{"name":"thread_name","ph":"M","pid":{},"tid":{},"args":{{"name":"{}{}"}}}})", f.rank,
          tid, comm_name, phases != 0 ? "phases" : "collectives"));
      lines.push_back(fmt::format(
          R"({{"name":"thread_sort_index","ph":"M","pid":{},"tid":{},"args":{{"sort_index":{}}}}})",
          f.rank, tid, tid));
    }
    for (const auto& e : f.events) {
      if (e.string_or("ph", "") == "M") continue;
      json ev = e;
      ev.set("pid", json::number_value(f.rank));
      // Rounded to the nanosecond the files carry, so the shift adds no digits of noise.
      ev.set("ts", json::number_value(
                       std::round((e.number_or("ts", 0) + f.offset_us - base) * 1e3) / 1e3));
      std::string s;
      write_json(s, ev);
      lines.push_back(std::move(s));
    }
  }
  std::string out = "[";
  for (std::size_t i = 0; i < lines.size(); ++i) {
    if (i > 0) out += "\n,";
    out += lines[i];
  }
  out += "\n]\n";
  return out;
}

/// Who arrived last at the collectives of one kind.
struct kind_summary {
  std::string kind;
  std::size_t calls = 0;  ///< collectives every rank's file recorded
  int ranks = 0;
  std::map<int, std::size_t> last_count;  ///< rank -> times it arrived last
  std::map<int, double> late_sum_us;      ///< rank -> sum of its margins over the next-latest
  std::map<int, double> late_max_us;
  std::map<int, double> wait_sum_us;  ///< rank -> sum of its waits at entry
  std::map<int, std::size_t> wait_n;

  /// The rank that arrived last most often (lowest rank on a tie), or -1 with no calls.
  [[nodiscard]] int straggler() const {
    int best = -1;
    std::size_t most = 0;
    for (const auto& [r, n] : last_count)
      if (n > most) {
        most = n;
        best = r;
      }
    return best;
  }
};

/// Matches the same collective across ranks by (communicator instance, sequence number) and,
/// on the aligned clocks, takes the latest start as the last arrival; "late by" is how long
/// after the next-latest rank it arrived, i.e. how long it alone held the others.
[[nodiscard]] inline std::vector<kind_summary> straggler_summary(
    const std::vector<rank_file>& files) {
  struct arrival {
    int rank;
    double ts;
    double wait_us;
    std::string name;
  };
  std::map<std::tuple<int, std::int64_t>, std::vector<arrival>> calls;
  std::map<int, int> ranks_per_instance;
  for (const auto& f : files) {
    ++ranks_per_instance[f.instance];
    for (const auto& e : f.events) {
      if (e.string_or("cat", "") != "collective") continue;
      const json* a = e.find("args");
      if (a == nullptr) continue;
      const auto seq = static_cast<std::int64_t>(a->number_or("seq", -1));
      if (seq < 0) continue;
      calls[{f.instance, seq}].push_back({f.rank, e.number_or("ts", 0) + f.offset_us,
                                          a->number_or("wait_us", -1), e.string_or("name", "?")});
    }
  }
  std::map<std::string, kind_summary> by_kind;
  for (auto& entry : calls) {
    auto& v = entry.second;  // a reference, not a binding: the lambdas below capture it
    const int expected = ranks_per_instance[std::get<0>(entry.first)];
    if (static_cast<int>(v.size()) != expected || expected < 2) continue;
    if (std::any_of(v.begin(), v.end(), [&](const arrival& x) { return x.name != v[0].name; }))
      continue;
    std::sort(v.begin(), v.end(), [](const arrival& a, const arrival& b) { return a.ts < b.ts; });
    kind_summary& k = by_kind[v[0].name];
    k.kind = v[0].name;
    k.ranks = std::max(k.ranks, expected);
    ++k.calls;
    const arrival& last = v.back();
    const double late = last.ts - v[v.size() - 2].ts;
    ++k.last_count[last.rank];
    k.late_sum_us[last.rank] += late;
    k.late_max_us[last.rank] = std::max(k.late_max_us[last.rank], late);
    for (const auto& x : v)
      if (x.wait_us >= 0) {
        k.wait_sum_us[x.rank] += x.wait_us;
        ++k.wait_n[x.rank];
      }
  }
  std::vector<kind_summary> out;
  for (auto& [name, k] : by_kind) out.push_back(std::move(k));
  return out;
}

[[nodiscard]] inline std::string format_us(double us) {
  if (us >= 1e6) return fmt::format("{:.2f} s", us / 1e6);
  if (us >= 1e3) return fmt::format("{:.2f} ms", us / 1e3);
  return fmt::format("{:.1f} us", us);
}

/// The report as text: one headline per collective kind, then the detail behind it.
[[nodiscard]] inline std::string format_report(const std::vector<rank_file>& files,
                                               const std::vector<kind_summary>& kinds) {
  std::string out;
  int ranks = 0;
  for (const auto& f : files) ranks = std::max(ranks, f.rank + 1);
  std::size_t unclosed = 0;
  for (const auto& f : files) unclosed += f.closed ? 0 : 1;
  out += fmt::format("straggler report: {} file(s), {} rank(s)", files.size(), ranks);
  if (unclosed > 0)
    out += fmt::format(" ({} file(s) not closed: killed or still running)", unclosed);
  out += '\n';
  if (kinds.empty()) out += "no collective was recorded by every rank\n";
  for (const auto& k : kinds) {
    const int s = k.straggler();
    const std::size_t n = k.last_count.at(s);
    out += fmt::format(
        "{}: rank {} arrived last in {} of {} calls ({:.0f}%), {} after the next-latest rank on "
        "average (max {})\n",
        k.kind, s, n, k.calls, 100.0 * static_cast<double>(n) / static_cast<double>(k.calls),
        format_us(k.late_sum_us.at(s) / static_cast<double>(n)), format_us(k.late_max_us.at(s)));
    out += "  last arrivals by rank:";
    for (const auto& [r, c] : k.last_count) out += fmt::format(" {}:{}", r, c);
    out += '\n';
    if (!k.wait_n.empty()) {
      out += "  mean wait at entry:";
      for (const auto& [r, c] : k.wait_n)
        out += fmt::format(" {}:{}", r, format_us(k.wait_sum_us.at(r) / static_cast<double>(c)));
      out += '\n';
    }
  }
  return out;
}

}  // namespace ringzero::trace_tool
