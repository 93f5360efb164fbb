// ringzero-trace: reads the per-rank files RINGZERO_TRACE wrote.
//
//   ringzero-trace merge [-o OUT] DIR|FILE...   one timeline, a track per rank, clocks aligned
//   ringzero-trace report DIR|FILE...           which rank arrived last, per collective kind
#include <fmt/core.h>

#include <cstdio>
#include <exception>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "analysis.hpp"
#include "ringzero/version.hpp"
#include "trace_file.hpp"

namespace {

constexpr const char* usage_text =
    "usage: ringzero-trace merge [-o OUT] DIR|FILE...\n"
    "       ringzero-trace report DIR|FILE...\n"
    "\n"
    "Reads the files a job wrote with RINGZERO_TRACE=DIR (DIR/rank<R>.json; files of killed\n"
    "ranks included).\n"
    "  merge   writes one Chrome-trace / Perfetto JSON timeline with a track per rank, each\n"
    "          rank's clock moved onto rank 0's (default OUT: ringzero-trace.json); open it in\n"
    "          ui.perfetto.dev or chrome://tracing\n"
    "  report  says, per collective kind, which rank arrived last most often and by how much\n";

int usage_error(const std::string& msg) {
  fmt::print(stderr, "ringzero-trace: {}\n{}", msg, usage_text);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) return usage_error("no command");
  if (args[0] == "-h" || args[0] == "--help") {
    fmt::print("{}", usage_text);
    return 0;
  }
  if (args[0] == "--version") {
    fmt::print("ringzero-trace {}\n", ringzero::version_string);
    return 0;
  }
  const std::string cmd = args[0];
  std::string out_path = "ringzero-trace.json";
  std::vector<std::string> inputs;
  for (std::size_t i = 1; i < args.size(); ++i) {
    if (cmd == "merge" && (args[i] == "-o" || args[i] == "--output")) {
      if (++i == args.size()) return usage_error("-o needs a file name");
      out_path = args[i];
    } else {
      inputs.push_back(args[i]);
    }
  }
  if (cmd != "merge" && cmd != "report") return usage_error("unknown command '" + cmd + "'");
  if (inputs.empty()) return usage_error("no trace directory or file given");
  try {
    const auto files = ringzero::trace_tool::read_inputs(inputs);
    for (const auto& f : files)
      if (f.torn_tail)
        fmt::print(stderr, "ringzero-trace: {}: last line cut short (process killed?); skipped\n",
                   f.path);
    if (cmd == "merge") {
      std::ofstream out(out_path, std::ios::binary | std::ios::trunc);
      out << ringzero::trace_tool::merge(files);
      if (!out.flush()) {
        fmt::print(stderr, "ringzero-trace: cannot write {}\n", out_path);
        return 1;
      }
      fmt::print("ringzero-trace: {} file(s) merged into {}\n", files.size(), out_path);
    } else {
      fmt::print("{}", ringzero::trace_tool::format_report(
                           files, ringzero::trace_tool::straggler_summary(files)));
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "ringzero-trace: {}\n", e.what());
    return 1;
  }
  return 0;
}
