// The fabric description format ringzero-model reads: one `key = value` per line, `#` starts a
// comment, quantities carry their unit (a space between number and unit is optional):
//
//   name             = p5.48xlarge
//   gpus_per_node    = 8
//   intra_bandwidth  = 450 GB/s      # one direction, one GPU; also Gb/s, MB/s
//   intra_latency    = 2 us          # also ns, ms, s
//   nics_per_node    = 32
//   nic_bandwidth    = 100 Gb/s
//   inter_latency    = 15 us
//   efficiency       = 0.9           # achieved / line rate
//   reduce_bandwidth = 1100 GB/s
//   chunk            = 1 MiB         # optional; also B, KiB, GiB, KB, MB, GB
//   published        = 8 8GiB 355GB/s   # optional, repeatable: nodes, size, all_reduce busbw
//
// Every key but chunk and published is required, once. A mistake is an invalid_argument that
// names the source, the line and the key.
#pragma once

#include <cctype>
#include <charconv>
#include <cmath>
#include <fstream>
#include <initializer_list>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/model/fabric.hpp"

namespace ringzero::model {

/// A published all_reduce measurement the model is checked against.
struct published_point {
  int nodes = 0;
  double bytes = 0;
  double busbw = 0;  ///< bytes per second
};

struct fabric_file {
  tuning::fabric fabric;
  std::vector<published_point> published;
};

namespace detail {

struct unit {
  std::string_view name;
  double scale;
};

inline constexpr unit bandwidth_units[] = {{"GB/s", 1e9},     {"Gb/s", 1e9 / 8}, {"MB/s", 1e6},
                                           {"Mb/s", 1e6 / 8}, {"TB/s", 1e12},    {"B/s", 1.0}};
inline constexpr unit time_units[] = {{"ns", 1e-9}, {"us", 1e-6}, {"ms", 1e-3}, {"s", 1.0}};
inline constexpr unit size_units[] = {
    {"B", 1.0},  {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0},
    {"KB", 1e3}, {"MB", 1e6},     {"GB", 1e9}};

inline std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

class line_parser {
 public:
  line_parser(std::string_view source, int line, std::string_view key)
      : where_(std::string(source) + ":" + std::to_string(line) + ": " + std::string(key)) {}

  [[noreturn]] void fail(const std::string& why) const {
    throw invalid_argument(where_ + ": " + why);
  }

  /// A positive number followed by one of `units` (no unit allowed when `units` is empty).
  template <std::size_t N>
  double quantity(std::string_view text, const unit (&units)[N]) const {
    return quantity(text, std::span<const unit>(units, N));
  }

  double quantity(std::string_view text, std::span<const unit> units) const {
    text = trim(text);
    double value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc{} || !std::isfinite(value) || value <= 0)
      fail("expected a positive number, got '" + std::string(text) + "'");
    const std::string_view suffix = trim(text.substr(static_cast<std::size_t>(end - text.data())));
    if (units.empty()) {
      if (!suffix.empty()) fail("expected a plain number, got '" + std::string(text) + "'");
      return value;
    }
    std::string expected;
    for (const unit& u : units) {
      if (suffix == u.name) return value * u.scale;
      expected += (expected.empty() ? "" : ", ") + std::string(u.name);
    }
    fail("unit '" + std::string(suffix) + "' is not one of " + expected);
  }

  int count(std::string_view text) const {
    const double v = quantity(text, std::span<const unit>());
    if (v != std::floor(v) || v > 1e6)
      fail("expected a whole number, got '" + std::string(text) + "'");
    return static_cast<int>(v);
  }

 private:
  std::string where_;
};

}  // namespace detail

/// Parses a fabric description; `source` names it in error messages.
[[nodiscard]] inline fabric_file parse_fabric(std::string_view text, std::string_view source) {
  using detail::trim;
  fabric_file out;
  tuning::fabric& f = out.fabric;
  std::vector<std::string> seen;
  int number = 0;
  while (!text.empty()) {
    const std::size_t eol = text.find('\n');
    std::string_view line = text.substr(0, eol);
    text = eol == std::string_view::npos ? std::string_view() : text.substr(eol + 1);
    ++number;
    line = trim(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    const std::size_t eq = line.find('=');
    if (eq == std::string_view::npos)
      throw invalid_argument(std::string(source) + ":" + std::to_string(number) +
                             ": expected 'key = value', got '" + std::string(line) + "'");
    const std::string key(trim(line.substr(0, eq)));
    const std::string_view value = trim(line.substr(eq + 1));
    const detail::line_parser p(source, number, key);
    if (key != "published") {
      for (const std::string& s : seen)
        if (s == key) p.fail("given twice");
      seen.push_back(key);
    }
    if (key == "name") {
      if (value.empty()) p.fail("empty name");
      f.name = std::string(value);
    } else if (key == "gpus_per_node") {
      f.gpus_per_node = p.count(value);
    } else if (key == "intra_bandwidth") {
      f.intra_bandwidth = p.quantity(value, detail::bandwidth_units);
    } else if (key == "intra_latency") {
      f.intra_latency = p.quantity(value, detail::time_units);
    } else if (key == "nics_per_node") {
      f.nics_per_node = p.count(value);
    } else if (key == "nic_bandwidth") {
      f.nic_bandwidth = p.quantity(value, detail::bandwidth_units);
    } else if (key == "inter_latency") {
      f.inter_latency = p.quantity(value, detail::time_units);
    } else if (key == "efficiency") {
      f.efficiency = p.quantity(value, std::span<const detail::unit>());
      if (f.efficiency > 1) p.fail("must be at most 1 (achieved / line rate)");
    } else if (key == "reduce_bandwidth") {
      f.reduce_bandwidth = p.quantity(value, detail::bandwidth_units);
    } else if (key == "chunk") {
      f.chunk_bytes = static_cast<std::size_t>(p.quantity(value, detail::size_units));
    } else if (key == "published") {
      std::istringstream words{std::string(value)};
      std::string nodes, size, busbw, extra;
      if (!(words >> nodes >> size >> busbw) || (words >> extra))
        p.fail("expected 'NODES SIZE BUSBW', e.g. '8 8GiB 355GB/s'");
      out.published.push_back({p.count(nodes), p.quantity(size, detail::size_units),
                               p.quantity(busbw, detail::bandwidth_units)});
    } else {
      p.fail(
          "unknown key (expected name, gpus_per_node, intra_bandwidth, intra_latency, "
          "nics_per_node, nic_bandwidth, inter_latency, efficiency, reduce_bandwidth, chunk "
          "or published)");
    }
  }
  for (const char* key :
       {"name", "gpus_per_node", "intra_bandwidth", "intra_latency", "nics_per_node",
        "nic_bandwidth", "inter_latency", "efficiency", "reduce_bandwidth"}) {
    bool found = false;
    for (const std::string& s : seen) found = found || s == key;
    if (!found) throw invalid_argument(std::string(source) + ": missing key '" + key + "'");
  }
  return out;
}

/// Reads and parses a fabric file.
[[nodiscard]] inline fabric_file load_fabric(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw invalid_argument("cannot open fabric file '" + path + "'");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_fabric(text.str(), path);
}

}  // namespace ringzero::model
