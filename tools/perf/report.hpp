// ringzero-perf's output: the comment header, table and footer laid out column for column as
// nccl-tests prints them, so scripts that parse nccl-tests logs read these too, and the same
// results as nccl-tests' JSON report (-J, format version 2).
#pragma once

#include <fmt/core.h>
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <string>
#include <string_view>
#include <vector>

#include "cli.hpp"
#include "data.hpp"
#include "ringzero/version.hpp"

namespace ringzero::perf {

/// One rank as the "Using devices" block lists it.
struct device_info {
  int rank = 0;
  int pid = 0;
  std::string host;
  int device = 0;
  std::string device_hex;
  std::string description;
};

/// One half (out-of-place or in-place) of a table row.
struct cell {
  double time_us = 0;
  bandwidth bw;
  std::int64_t wrong = -1;  ///< -1: not checked
};

struct row {
  std::size_t bytes = 0;
  std::size_t count = 0;
  std::string type;
  std::string redop;
  int root = -1;
  cell out_of_place;
  cell in_place;
  int iters = 0;
};

/// What the header says about this run besides nccl-tests' own line.
struct run_info {
  std::string program;    ///< "all_reduce_perf" style name
  std::string transport;  ///< one line: transport, provider, how ranks were started
  std::string algorithm;  ///< one line
  std::string buffers;    ///< one line: what -R did
  std::vector<device_info> devices;
};

/// Prints `v` right-aligned in `width` columns with as many of two decimals as fit, like
/// nccl-tests' time and bandwidth columns.
[[nodiscard]] inline std::string fit(double v, int width) {
  int digits = 1;
  for (double p = 10; std::abs(v) >= p && digits < 40; p *= 10) ++digits;
  if (digits + 3 <= width) return fmt::format("{:>{}.2f}", v, width);
  if (digits + 2 <= width) return fmt::format("{:>{}.1f}", v, width);
  if (digits <= width) return fmt::format("{:>{}.0f}", v, width);
  return fmt::format("{:>{}.{}e}", v, width, width > 6 ? width - 6 : 0);
}

[[nodiscard]] inline std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (c < 0x20)
          out += fmt::format("\\u{:04x}", c);
        else
          out += ch;
    }
  }
  return out + "\"";
}

[[nodiscard]] inline std::string json_number(double v) {
  if (std::isnan(v) || std::isinf(v)) return "\"nan\"";
  return fmt::format("{:f}", v);
}

[[nodiscard]] inline std::string now_string() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

/// Environment variables worth recording with a result: ringzero's, libfabric's, NCCL's and the
/// launcher's rendezvous variables. Anything that looks like a credential is left out (the
/// launcher's RINGZERO_TOKEN is one), which is why this is not nccl-tests' full environment.
[[nodiscard]] inline bool recorded_env(std::string_view kv) {
  const std::string_view name = kv.substr(0, kv.find('='));
  for (std::string_view secret : {"TOKEN", "SECRET", "PASSWORD", "KEY", "CREDENTIAL"})
    if (name.find(secret) != std::string_view::npos) return false;
  for (std::string_view p : {"RINGZERO_", "FI_", "NCCL_", "CUDA_VISIBLE_DEVICES",
                             "OMPI_COMM_WORLD_", "SLURM_PROCID", "SLURM_NTASKS"})
    if (name.starts_with(p)) return true;
  for (std::string_view v :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
    if (name == v) return true;
  return false;
}

/// Rank 0's view of the run. Lines go to `out` as soon as they are known (a long sweep shows
/// progress); the JSON document is written at the end.
class report {
 public:
  report(const options& o, std::FILE* out, std::vector<std::string> env)
      : opts_(o), out_(out), env_(std::move(env)), start_(now_string()) {}

  void header(const run_info& info) {
    info_ = info;
    line("# ringzero-perf version {} (nccl-tests compatible output)", ringzero::version_string);
    line("# Collective test starting: {}", info.program);
    line(
        "# nThread {} nGpus {} minBytes {} maxBytes {} step: {}({}) warmup iters: {} iters: {} "
        "agg iters: {} validation: {} graph: 0",
        opts_.threads, opts_.gpus, opts_.min_bytes, opts_.max_bytes,
        opts_.step_factor > 1 ? opts_.step_factor : opts_.step_bytes,
        opts_.step_factor > 1 ? "factor" : "bytes", opts_.warmup_iters, opts_.iters,
        opts_.agg_iters, opts_.check);
    if (opts_.blocking == 1)
      line("# Blocking Enabled: wait for completion and barrier after each collective ");
    if (opts_.blocking > 1)
      line("# Blocking Enabled: wait for completion after each collective (no barrier) ");
#ifndef __OPTIMIZE__
    line(
        "# Warning: this ringzero-perf was compiled without optimization; build with "
        "CMAKE_BUILD_TYPE=Release for numbers worth comparing");
#endif
    line("# Transport: {}", info.transport);
    line("# Algorithm: {}", info.algorithm);
    line("# Buffers: {}", info.buffers);
    line(
        "# Time: each rank's mean over -n iterations, then {} (-a {}; nccl-tests' default is "
        "-a 1)",
        time_mode_name(opts_.average), static_cast<int>(opts_.average));
    line("#");
    line("# Using devices");
    for (const auto& d : info.devices)
      line("#  Rank {:>2} Group {:>2} Pid {:>6} on {:>10} device {:>2} [{}] {}", d.rank, 0, d.pid,
           d.host, d.device, d.device_hex, d.description);
    line("#");
    const std::string t = opts_.report_cputime ? "cputime" : "time";
    line(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}           out-of-place                       "
        "in-place          ",
        "", "", "", "", "");
    line(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  "
        "{:>6} ",
        "size", "count", "type", "redop", "root", t, "algbw", "busbw", "#wrong", t, "algbw",
        "busbw", "#wrong");
    line(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  "
        "{:>6} ",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)",
        "");
  }

  void begin_row(const row& r) {
    write(fmt::format("{:>12}  {:>12}  {:>8}  {:>6}  {:>6}", r.bytes, r.count, r.type, r.redop,
                      r.root));
  }

  void add_cell(const cell& c) {
    std::string wrong = c.wrong < 0 ? fmt::format("{:>6}", "N/A")
                                    : fmt::format("{:>6g}", static_cast<double>(c.wrong));
    write(fmt::format("  {}  {}  {}  {}", fit(c.time_us, 7), fit(c.bw.alg, 6), fit(c.bw.bus, 6),
                      wrong));
    bus_sum_ += c.bw.bus;
    ++bus_count_;
  }

  void end_row(const row& r) {
    write("\n");
    std::fflush(out_);
    rows_.push_back(r);
  }

  /// `errors`: (rank, row half) pairs that had wrong elements, as nccl-tests counts them.
  void footer(int errors) {
    errors_ = errors;
    line("# {:<20} : {} {}", "Out of bounds values", errors, errors ? "FAILED" : "OK");
    line("# {:<20} : {:g} ", "Avg bus bandwidth", average_bus_bandwidth());
    line("#");
    line("# Collective test concluded: {}", info_.program);
    line("#");
    std::fflush(out_);
  }

  void failure(const std::string& what) {
    failures_.push_back(what);
    line("# error: {}", what);
    std::fflush(out_);
  }

  [[nodiscard]] double average_bus_bandwidth() const {
    return bus_count_ ? bus_sum_ / bus_count_ : 0.0;
  }

  /// nccl-tests' JSON layout (version 2). Its booleans are the strings "true"/"false" and its
  /// root is the padded text of the table column; both are kept so its readers work unchanged.
  [[nodiscard]] std::string json() const {
    auto jbool = [](bool b) { return json_string(b ? "true" : "false"); };
    std::string s = "{";
    s += fmt::format("\"version\":2,\"start_time\":{},\"args\":[", json_string(start_));
    for (std::size_t i = 0; i < opts_.argv.size(); ++i)
      s += (i ? "," : "") + json_string(opts_.argv[i]);
    s += "],\"env\":[";
    for (std::size_t i = 0; i < env_.size(); ++i) s += (i ? "," : "") + json_string(env_[i]);
    s += fmt::format("],\"nccl_version\":0,\"ringzero_version\":{}",
                     json_string(ringzero::version_string));
    s += ",\"config\":{";
    s += fmt::format("\"nthreads\":{},\"ngpus\":{},\"minimum_bytes\":{},\"maximum_bytes\":{},",
                     opts_.threads, opts_.gpus, opts_.min_bytes, opts_.max_bytes);
    if (opts_.step_factor > 1)
      s += fmt::format("\"step_factor\":{},", opts_.step_factor);
    else
      s += fmt::format("\"step_bytes\":{},", opts_.step_bytes);
    s += fmt::format(
        "\"warmup_iters\":{},\"iterations\":{},\"aggregated_iterations\":{},\"validation\":{},"
        "\"graph\":0,\"blocking_collectives\":{},\"per_iter_timing\":{},\"parallel_init\":{},"
        "\"transport\":{},\"algorithm\":{},\"buffers\":{},\"average\":{},\"devices\":[",
        opts_.warmup_iters, opts_.iters, opts_.agg_iters, opts_.check, jbool(opts_.blocking != 0),
        jbool(false), jbool(false), json_string(info_.transport), json_string(info_.algorithm),
        json_string(info_.buffers), static_cast<int>(opts_.average));
    for (std::size_t i = 0; i < info_.devices.size(); ++i) {
      const auto& d = info_.devices[i];
      s += fmt::format(
          "{}{{\"rank\":{},\"group\":0,\"pid\":{},\"hostname\":{},\"device\":{},\"device_hex\":{},"
          "\"device_info\":{}}}",
          i ? "," : "", d.rank, d.pid, json_string(d.host), d.device, json_string(d.device_hex),
          json_string(d.description));
    }
    s += "]},\"results\":[";
    auto jcell = [&](const char* key, const cell& c) {
      return fmt::format(
          "\"{}\":{{\"{}\":{},\"alg_bw\":{},\"bus_bw\":{},\"nwrong\":{}}}", key,
          opts_.report_cputime ? "cpu_time" : "time", json_number(c.time_us), json_number(c.bw.alg),
          json_number(c.bw.bus),
          c.wrong < 0 ? std::string("null") : json_number(static_cast<double>(c.wrong)));
    };
    for (std::size_t i = 0; i < rows_.size(); ++i) {
      const auto& r = rows_[i];
      s += fmt::format(
          "{}{{\"size\":{},\"count\":{},\"type\":{},\"redop\":{},\"root\":{},{},{},"
          "\"actual_iterations\":{},\"experiment_name\":\"\"}}",
          i ? "," : "", r.bytes, r.count, json_string(r.type), json_string(r.redop),
          json_string(fmt::format("{:>6}", r.root)), jcell("out_of_place", r.out_of_place),
          jcell("in_place", r.in_place), r.iters);
    }
    s += "]";
    if (errors_ >= 0) {
      s += fmt::format(
          ",\"out_of_bounds\":{{\"count\":{},\"okay\":{}}},\"average_bus_bandwidth\":{{"
          "\"bandwidth\":{},\"okay\":{}}}",
          errors_, jbool(errors_ == 0), json_number(average_bus_bandwidth()),
          json_string("unchecked"));
    }
    s += ",\"errors\":[";
    for (std::size_t i = 0; i < failures_.size(); ++i)
      s += (i ? "," : "") + json_string(failures_[i]);
    s += fmt::format("],\"end_time\":{}}}\n", json_string(now_string()));
    return s;
  }

  [[nodiscard]] const std::vector<row>& rows() const noexcept {
    return rows_;
  }

 private:
  template <class... Args>
  void line(fmt::format_string<Args...> f, Args&&... args) {
    write(fmt::format(f, std::forward<Args>(args)...));
    write("\n");
  }
  void write(const std::string& s) {
    std::fwrite(s.data(), 1, s.size(), out_);
  }

  const options& opts_;
  std::FILE* out_;
  std::vector<std::string> env_;
  std::string start_;
  run_info info_;
  std::vector<row> rows_;
  std::vector<std::string> failures_;
  double bus_sum_ = 0;
  int bus_count_ = 0;
  int errors_ = -1;
};

}  // namespace ringzero::perf
