// ringzero-perf's command line: nccl-tests' flags with nccl-tests' meanings, plus the few that
// only make sense here (-A algorithm, -T transport, -p provider). Parsing is a pure function of
// the argument list so it can be tested without running anything.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/table.hpp"
#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::perf {

/// The collectives ringzero-perf measures, in nccl-tests' order (barrier and all_to_allv have
/// no nccl-tests program). What each one is comes from its descriptor (collective_table.hpp).
inline constexpr collective all_colls[] = {
    collective::all_reduce, collective::reduce_scatter, collective::all_gather,
    collective::broadcast,  collective::reduce,         collective::send_recv,
    collective::all_to_all, collective::gather,         collective::scatter};

[[nodiscard]] constexpr const collective_descriptor& describe(collective c) noexcept {
  return *builtin_collectives::find(c);  // every collective of all_colls is a built-in one
}

/// The name of nccl-tests' program for `c` (sendrecv_perf, alltoall_perf), else ringzero's.
[[nodiscard]] constexpr std::string_view coll_name(collective c) noexcept {
  if (c == collective::send_recv) return "sendrecv";
  if (c == collective::all_to_all) return "alltoall";
  return collective_name(c);
}

[[nodiscard]] constexpr bool has_op(collective c) noexcept {
  return describe(c).reduces;
}
[[nodiscard]] constexpr bool has_root(collective c) noexcept {
  return describe(c).rooted;
}

/// Accepts ringzero's names and nccl-tests' program names (all_reduce_perf, sendrecv_perf, ...).
[[nodiscard]] inline std::optional<collective> parse_coll(std::string_view s) {
  if (s.ends_with("_perf")) s.remove_suffix(5);
  for (collective c : all_colls)
    if (coll_name(c) == s) return c;
  if (s == "allreduce") return collective::all_reduce;
  if (s == "reducescatter") return collective::reduce_scatter;
  if (s == "allgather") return collective::all_gather;
  if (s == "send_recv") return collective::send_recv;
  if (s == "all_to_all") return collective::all_to_all;
  return std::nullopt;
}

enum class transport_kind : std::uint8_t { automatic, loopback, libfabric, nccl, shm, socket };

[[nodiscard]] constexpr std::string_view transport_name(transport_kind t) noexcept {
  switch (t) {
    case transport_kind::automatic:
      return "auto";
    case transport_kind::loopback:
      return "loopback";
    case transport_kind::libfabric:
      return "libfabric";
    case transport_kind::nccl:
      return "nccl";
    case transport_kind::shm:
      return "shm";
    case transport_kind::socket:
      return "socket";
  }
  return "?";
}

/// nccl-tests' -a: which rank's iteration time a row reports.
enum class time_mode : int { rank0 = 0, avg = 1, min = 2, max = 3 };

[[nodiscard]] constexpr std::string_view time_mode_name(time_mode m) noexcept {
  switch (m) {
    case time_mode::rank0:
      return "rank 0's";
    case time_mode::avg:
      return "the mean over ranks";
    case time_mode::min:
      return "the minimum over ranks";
    case time_mode::max:
      return "the maximum over ranks";
  }
  return "?";
}

/// nccl-tests' order for -o all.
inline constexpr op nccl_tests_ops[] = {op::sum, op::prod, op::max, op::min, op::avg};

struct options {
  collective coll = collective::all_reduce;
  int threads = 1;  ///< -t: loopback ranks (threads of this process)
  int gpus = 1;     ///< -g: accepted for compatibility; one device per rank
  std::size_t min_bytes = std::size_t{32} << 20;
  std::size_t max_bytes = std::size_t{32} << 20;
  std::size_t step_bytes = std::size_t{1} << 20;
  std::size_t step_factor = 1;
  int iters = 20;
  int warmup_iters = 1;
  int agg_iters = 1;
  int cycles = 1;
  int check = 1;  ///< -c: checked iterations per row (0 = no check)
  std::vector<op> ops{op::sum};
  std::vector<dtype> types{dtype::float32};
  int root = 0;  ///< -r: -1 = every root in turn
  time_mode average = time_mode::max;
  int blocking = 0;
  int report_cputime = 0;
  std::string json_file;
  ringzero::algorithm algo = ringzero::algorithm::automatic;
  transport_kind transport = transport_kind::automatic;
  std::string provider;
  int registration = 0;        ///< -R: 0 user buffers, 1 registered, 2 symmetric
  bool device_memory = false;  ///< --memory device: buffers on the GPU (-T libfabric, FI_HMEM)
  double timeout_s = 0;        ///< --timeout; 0 = RINGZERO_TIMEOUT
  std::string tune_file;       ///< --tune: measure the cost model's constants into this file
  bool reproducible = false;   ///< --reproducible: options::reproducible on the measured calls
  wire_format wire = wire_format::full;  ///< --wire: options::wire on the measured calls
  std::size_t wire_block = 0;            ///< --wire-block: options::wire_block
  bool help = false;
  std::vector<std::string> argv;  ///< program name and arguments as given, for the JSON report
};

namespace detail {

[[nodiscard]] inline long long parse_int(std::string_view flag, std::string_view v) {
  long long x = 0;
  const char* b = v.data();
  const char* e = v.data() + v.size();
  int base = 10;
  if (v.size() > 2 && v[0] == '0' && (v[1] == 'x' || v[1] == 'X')) {
    b += 2;
    base = 16;
  }
  auto [p, ec] = std::from_chars(b, e, x, base);
  if (ec != std::errc{} || p != e || v.empty())
    throw invalid_argument(fmt::format("{}: '{}' is not an integer", flag, v));
  return x;
}

[[nodiscard]] inline int parse_int_in(std::string_view flag, std::string_view v, long long lo,
                                      long long hi) {
  const long long x = parse_int(flag, v);
  if (x < lo || x > hi)
    throw invalid_argument(fmt::format("{}: {} is outside [{}, {}]", flag, x, lo, hi));
  return static_cast<int>(x);
}

}  // namespace detail

/// A byte count with an optional binary suffix, as nccl-tests reads it: 8, 64K, 1.5M, 2G
/// (K = 1024). A trailing "B" or "iB" after the suffix is accepted.
[[nodiscard]] inline std::size_t parse_size(std::string_view flag, std::string_view v) {
  std::string s(v);
  std::size_t pos = 0;
  double x = 0;
  try {
    x = std::stod(s, &pos);
  } catch (const std::exception&) {
    throw invalid_argument(fmt::format("{}: '{}' is not a size", flag, v));
  }
  std::string_view rest = std::string_view(s).substr(pos);
  double unit = 1;
  if (!rest.empty()) {
    switch (rest[0]) {
      case 'k':
      case 'K':
        unit = 1024.0;
        break;
      case 'm':
      case 'M':
        unit = 1024.0 * 1024;
        break;
      case 'g':
      case 'G':
        unit = 1024.0 * 1024 * 1024;
        break;
      default:
        unit = 0;
    }
    if (unit != 0) rest.remove_prefix(1);
    if (rest == "iB" || rest == "B") rest = {};
    if (unit == 0 || !rest.empty())
      throw invalid_argument(
          fmt::format("{}: '{}' has an unknown suffix (use K, M or G)", flag, v));
  }
  const double bytes = x * unit;
  if (!(bytes >= 0) || !std::isfinite(bytes))
    throw invalid_argument(fmt::format("{}: '{}' is not a non-negative size", flag, v));
  // 2^64: the first double a size_t cannot hold (converting it would be undefined).
  if (bytes >= 18446744073709551616.0)
    throw invalid_argument(fmt::format("{}: '{}' is larger than any size", flag, v));
  return static_cast<std::size_t>(bytes);
}

inline constexpr std::string_view usage_text = R"(usage: ringzero-perf <collective> [flags]
  collective: all_reduce reduce_scatter all_gather broadcast reduce sendrecv alltoall
              gather scatter (nccl-tests names such as alltoall_perf are accepted too)
nccl-tests flags:
  -t,--nthreads <n>         loopback: ranks as threads of this process (default 1)
  -g,--ngpus <n>            devices per rank; only 1 is supported
  -b,--minbytes <size>      smallest size, K/M/G suffixes (default 32M)
  -e,--maxbytes <size>      largest size (default 32M)
  -i,--stepbytes <size>     fixed increment between sizes (default 1M)
  -f,--stepfactor <n>       multiplicative factor between sizes (overrides -i)
  -n,--iters <n>            timed iterations per size (default 20)
  -w,--warmup_iters <n>     untimed iterations per size, before the sweep (default 1)
  -m,--agg_iters <n>        collectives per timed iteration (default 1)
  -N,--run_cycles <n>       repeat the sweep n times (default 1)
  -c,--check <n>            checked iterations per row, 0 = no check (default 1)
  -o,--op <op|all>          sum prod min max avg, or all (default sum)
  -d,--datatype <type|all>  int8 uint8 int32 uint32 int64 uint64 half float double
                            bfloat16, or all (default float)
  -r,--root <root|all>      root of broadcast, reduce, gather and scatter; all (or -1) =
                            each in turn
  -z,--blocking <0|1|2>     1: barrier after every collective (see docs/performance.md)
  -a,--average <0|1|2|3>    reported time: 0 rank 0, 1 mean, 2 min, 3 max over ranks
                            (default 3; nccl-tests' default is 1)
  -C,--report_cputime <0|1> accepted; CPU time equals wall time for a CPU library
  -J,--output_file <file>   also write nccl-tests' JSON report to <file>
  -R,--local_register <0|1|2> 0 user buffers, 1 registered, 2 symmetric
ringzero flags:
  -A,--algorithm <a>        ring tree rd rhd hier pairwise bruck linear auto (default auto)
  -T,--transport <t>        loopback libfabric shm socket nccl (default: alone, loopback;
                            ranks on several hosts, socket unless efa, FI_PROVIDER, -p or
                            --memory device ask for libfabric; else libfabric);
                            socket: ringzero's own TCP transport, on the rails RINGZERO_RAILS
                            names (interfaces, comma-separated)
  -p,--provider <name>      libfabric provider (shm, tcp, efa, ...)
     --memory <host|device> where the buffers live; device: cudaMalloc on GPU LOCAL_RANK %
                            (visible GPUs), moved by the provider (FI_HMEM_CUDA, e.g. efa),
                            reduced on the GPU; -T libfabric, all_reduce, reduce_scatter and
                            all_gather only (-T nccl always uses the GPU; default host)
     --timeout <seconds>    deadline for one collective (default RINGZERO_TIMEOUT or 300)
     --tune <file>          measure alpha, beta, gamma of the transport (-T, -p) instead of
                            benchmarking (-T shm: also the segment's one-phase limit), and
                            write its section of <file> (RINGZERO_TUNING)
     --reproducible         options::reproducible on the measured calls (all_reduce,
                            reduce_scatter, reduce; sum, avg, min, max): floating sums are
                            exact, rounded once; inputs get random exponents and signs, and
                            -c compares every sum bitwise with the serial exact sum
     --wire <f>             options::wire on the measured calls: full (default), bf16, int8
                            or int4 (all_reduce, reduce_scatter, all_gather; float, half,
                            bfloat16; sum, avg). Bandwidth still counts the element type's
                            bytes: what the collective delivers at full precision, not what
                            crossed the wire. -c allows quantize::error_bound's difference
     --wire-block <n>       elements per scale of int8 and int4 (default 256)
  -h,--help
)";

/// Parses the arguments after the program name. The collective may come first or be implied by
/// the program's own name (a link called all_reduce_perf).
[[nodiscard]] inline options parse_args(std::span<const std::string_view> args,
                                        std::string_view program = "ringzero-perf") {
  options o;
  o.argv.emplace_back(program);
  for (auto a : args) o.argv.emplace_back(a);
  std::size_t i = 0;
  const auto slash = program.find_last_of('/');
  if (slash != std::string_view::npos) program.remove_prefix(slash + 1);
  bool have_coll = false;
  if (auto c = parse_coll(program)) {
    o.coll = *c;
    have_coll = true;
  }
  if (!have_coll) {
    if (args.empty() || args[0].starts_with("-")) {
      if (!args.empty() && (args[0] == "-h" || args[0] == "--help")) {
        o.help = true;
        return o;
      }
      throw invalid_argument(
          "missing collective (all_reduce, reduce_scatter, all_gather, "
          "broadcast, reduce, sendrecv, alltoall, gather or scatter)");
    }
    auto c = parse_coll(args[0]);
    if (!c) throw invalid_argument(fmt::format("unknown collective '{}'", args[0]));
    o.coll = *c;
    i = 1;
  }

  struct flag {
    char short_name;
    std::string_view long_name;
  };
  static constexpr flag flags[] = {
      {'t', "nthreads"},       {'g', "ngpus"},          {'b', "minbytes"},
      {'e', "maxbytes"},       {'i', "stepbytes"},      {'f', "stepfactor"},
      {'n', "iters"},          {'w', "warmup_iters"},   {'m', "agg_iters"},
      {'N', "run_cycles"},     {'c', "check"},          {'o', "op"},
      {'d', "datatype"},       {'r', "root"},           {'z', "blocking"},
      {'a', "average"},        {'C', "report_cputime"}, {'J', "output_file"},
      {'R', "local_register"}, {'A', "algorithm"},      {'T', "transport"},
      {'p', "provider"},       {'\0', "timeout"},       {'\0', "tune"},
      {'\0', "memory"},        {'\0', "reproducible"},  {'\0', "wire"},
      {'\0', "wire-block"}};

  for (; i < args.size(); ++i) {
    std::string_view a = args[i];
    if (a == "-h" || a == "--help") {
      o.help = true;
      return o;
    }
    char key = 0;
    std::string_view name;
    std::optional<std::string_view> inline_value;
    if (a.starts_with("--")) {
      name = a.substr(2);
      if (auto eq = name.find('='); eq != std::string_view::npos) {
        inline_value = name.substr(eq + 1);
        name = name.substr(0, eq);
      }
      bool found = false;
      for (const auto& f : flags)
        if (f.long_name == name) {
          key = f.short_name;
          found = true;
        }
      if (!found) throw invalid_argument(fmt::format("unknown option '{}'", a));
      if (name == "reproducible") {  // a switch: it takes no value
        if (inline_value) throw invalid_argument("--reproducible takes no value");
        o.reproducible = true;
        continue;
      }
    } else if (a.size() >= 2 && a[0] == '-') {
      key = a[1];
      bool found = false;
      for (const auto& f : flags)
        if (f.short_name == key && key != '\0') {
          name = f.long_name;
          found = true;
        }
      if (!found) throw invalid_argument(fmt::format("unknown option '{}'", a));
      if (a.size() > 2) inline_value = a.substr(2);
    } else {
      throw invalid_argument(fmt::format("unexpected argument '{}'", a));
    }
    std::string_view v;
    if (inline_value) {
      v = *inline_value;
    } else {
      if (i + 1 >= args.size()) throw invalid_argument(fmt::format("option '{}' needs a value", a));
      v = args[++i];
    }
    const std::string fl = key ? fmt::format("-{}", key) : fmt::format("--{}", name);
    constexpr long long big = 1LL << 30;
    switch (key) {
      case 't':
        o.threads = detail::parse_int_in(fl, v, 1, 4096);
        break;
      case 'g':
        o.gpus = detail::parse_int_in(fl, v, 1, 1024);
        if (o.gpus != 1)
          throw unsupported(
              "-g: one device per rank; start more ranks instead (-t, ringzero-run -n)");
        break;
      case 'b':
        o.min_bytes = parse_size(fl, v);
        break;
      case 'e':
        o.max_bytes = parse_size(fl, v);
        break;
      case 'i':
        o.step_bytes = parse_size(fl, v);
        break;
      case 'f':
        o.step_factor = static_cast<std::size_t>(detail::parse_int_in(fl, v, 1, big));
        break;
      case 'n':
        o.iters = detail::parse_int_in(fl, v, 1, big);
        break;
      case 'w':
        o.warmup_iters = detail::parse_int_in(fl, v, 0, big);
        break;
      case 'm':
        o.agg_iters = detail::parse_int_in(fl, v, 1, big);
        break;
      case 'N':
        o.cycles = detail::parse_int_in(fl, v, 1, big);
        break;
      case 'c':
        o.check = detail::parse_int_in(fl, v, 0, big);
        break;
      case 'o':
        if (v == "all")
          o.ops.assign(std::begin(nccl_tests_ops), std::end(nccl_tests_ops));
        else
          o.ops = {parse_op(v)};
        break;
      case 'd':
        if (v == "all")
          o.types.assign(std::begin(all_dtypes), std::end(all_dtypes));
        else
          o.types = {parse_dtype(v)};
        break;
      case 'r':
        o.root = v == "all" ? -1 : detail::parse_int_in(fl, v, -1, 1 << 20);
        break;
      case 'z':
        o.blocking = detail::parse_int_in(fl, v, 0, 2);
        break;
      case 'a':
        o.average = static_cast<time_mode>(detail::parse_int_in(fl, v, 0, 3));
        break;
      case 'C':
        o.report_cputime = detail::parse_int_in(fl, v, 0, 1);
        break;
      case 'J':
        o.json_file = std::string(v);
        break;
      case 'R':
        o.registration = detail::parse_int_in(fl, v, 0, 2);
        break;
      case 'A':
        o.algo = parse_algorithm(v);
        break;
      case 'T':
        if (v == "loopback")
          o.transport = transport_kind::loopback;
        else if (v == "libfabric" || v == "ofi")
          o.transport = transport_kind::libfabric;
        else if (v == "nccl")
          o.transport = transport_kind::nccl;
        else if (v == "shm")
          o.transport = transport_kind::shm;
        else if (v == "socket")
          o.transport = transport_kind::socket;
        else if (v == "auto")
          o.transport = transport_kind::automatic;
        else
          throw invalid_argument(fmt::format(
              "-T: unknown transport '{}' (loopback, libfabric, shm, socket or nccl)", v));
        break;
      case 'p':
        o.provider = std::string(v);
        break;
      case '\0': {
        // Long only: nccl-tests' -G means CUDA graphs, and a word says more than a letter.
        if (name == "memory") {
          if (v == "host" || v == "device")
            o.device_memory = v == "device";
          else
            throw invalid_argument(fmt::format("--memory: '{}' is neither host nor device", v));
          break;
        }
        if (name == "wire") {
          o.wire = parse_wire_format(v);
          break;
        }
        if (name == "wire-block") {
          o.wire_block = static_cast<std::size_t>(
              detail::parse_int_in("--wire-block", v, 1, static_cast<long long>(max_wire_block)));
          break;
        }
        if (name == "tune") {
          if (v.empty()) throw invalid_argument("--tune: needs the file to write");
          o.tune_file = std::string(v);
          break;
        }
        std::size_t pos = 0;
        double s = 0;
        try {
          s = std::stod(std::string(v), &pos);
        } catch (const std::exception&) {
          pos = 0;
        }
        if (pos != v.size() || !(s > 0))
          throw invalid_argument(fmt::format("--timeout: '{}' is not a positive number", v));
        o.timeout_s = s;
        break;
      }
      default:
        break;
    }
  }
  if (o.min_bytes > o.max_bytes)
    throw invalid_argument(fmt::format("invalid sizes for 'minbytes' and 'maxbytes': {} > {}",
                                       o.min_bytes, o.max_bytes));
  if (o.step_factor <= 1 && o.step_bytes == 0 && o.min_bytes != o.max_bytes)
    throw invalid_argument("-i 0 without -f would never reach -e");
  if (o.wire != wire_format::full) {
    if (o.coll != collective::all_reduce && o.coll != collective::reduce_scatter &&
        o.coll != collective::all_gather)
      throw invalid_argument(fmt::format(
          "--wire: {} has no wire format; it applies to all_reduce, reduce_scatter and all_gather",
          coll_name(o.coll)));
    for (const dtype t : o.types)
      if (t != dtype::float32 && t != dtype::float16 && t != dtype::bfloat16)
        throw invalid_argument(fmt::format(
            "--wire: {} is not carried quantized (-d float, half or bfloat16)", dtype_name(t)));
    if (has_op(o.coll))
      for (const op x : o.ops)
        if (x != op::sum && x != op::avg)
          throw invalid_argument(fmt::format("--wire: {} reductions add (-o sum or avg, not {})",
                                             coll_name(o.coll), op_name(x)));
    if (o.reproducible) throw invalid_argument("--wire and --reproducible exclude each other");
  }
  if (o.reproducible) {
    if (!has_op(o.coll))
      throw invalid_argument(fmt::format(
          "--reproducible: {} adds nothing; it applies to all_reduce, reduce_scatter and reduce",
          coll_name(o.coll)));
    if (std::find(o.ops.begin(), o.ops.end(), op::prod) != o.ops.end())
      throw invalid_argument(
          "--reproducible: prod has no reproducible form (-o sum, avg, min or max)");
  }
  return o;
}

/// The sizes a sweep visits, as nccl-tests walks them: multiply by -f when it is above 1,
/// otherwise add -i.
[[nodiscard]] inline std::vector<std::size_t> sweep_sizes(const options& o) {
  std::vector<std::size_t> v;
  for (std::size_t s = o.min_bytes; s <= o.max_bytes;) {
    v.push_back(s);
    std::size_t next = o.step_factor > 1 ? s * o.step_factor : s + o.step_bytes;
    if (o.step_factor > 1 && s == 0) next = 1;
    if (next <= s) break;
    s = next;
  }
  return v;
}

}  // namespace ringzero::perf
