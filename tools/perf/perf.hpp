// ringzero-perf's driver: parses the command line, picks the transport, runs the benchmark on
// every rank and turns the outcome into an exit status (0 all checks passed, 1 some element was
// wrong, 2 bad usage, 3 a run-time failure). The loopback transport is always built in; main.cpp
// adds the libfabric and NCCL runners where those backends exist.
#pragma once

#include <fmt/core.h>

#include <cerrno>
#include <cstdio>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "bench.hpp"
#include "cli.hpp"
#include "report.hpp"
#include "ringzero/bootstrap/environment.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/transport/loopback.hpp"
#include "tune.hpp"

namespace ringzero::perf {

namespace exit_status {
inline constexpr int ok = 0;
inline constexpr int wrong = 1;
inline constexpr int usage = 2;
inline constexpr int failure = 3;
}  // namespace exit_status

/// What a transport runner gets besides the options.
struct context {
  std::FILE* out = stdout;
  std::FILE* err = stderr;
  std::vector<std::string> env;  ///< recorded in the JSON report
  std::string program;           ///< "all_reduce_perf" style name for the header
};

using runner = std::function<int(const options&, const context&)>;

/// Runners for transports other than loopback; empty where that backend is not built in.
struct transports {
  runner libfabric;
  /// libfabric with buffers in GPU memory (--memory device); needs CUDA at build time.
  runner libfabric_device;
  runner nccl;
  runner shm;
  runner socket;
  /// Whether libfabric offers efa here (the automatic choice below); unset: it does not.
  bool (*efa_present)() = nullptr;
};

[[nodiscard]] inline std::string algorithm_line(const options& o) {
  std::string line;
  if (o.algo != algorithm::automatic)
    line = fmt::format("{} (forced with -A)", algorithm_name(o.algo));
  else if (auto forced = ringzero::detail::getenv_str("RINGZERO_ALGO"))
    line = fmt::format("auto; RINGZERO_ALGO={} applies where it can", *forced);
  else
    line = "auto (the cost model picks per call)";
  if (o.reproducible)
    line += "; reproducible sums (--reproducible: exact, rounded once, over int32/int64 calls)";
  if (o.wire != wire_format::full)
    line += fmt::format(
        "; wire {} in blocks of {} (--wire: bandwidth counts the full-precision bytes delivered)",
        wire_format_name(o.wire), o.wire_block == 0 ? default_wire_block : o.wire_block);
  return line;
}

/// Opens `path` for the JSON report without overwriting anything: like nccl-tests, an existing
/// file makes it try path.0, path.1, ...
[[nodiscard]] inline std::FILE* open_json(const std::string& path, std::FILE* out) {
  std::string p = path;
  for (int i = 0; i < 1000; ++i) {
    if (std::FILE* f = std::fopen(p.c_str(), "wx")) {
      fmt::print(out, "# Writing JSON output to {}\n", p);
      return f;
    }
    if (errno != EEXIST) break;
    p = fmt::format("{}.{}", path, i);
  }
  fmt::print(out, "# skipping json output; {} not accessible\n", p);
  return nullptr;
}

/// Rank 0's side of a run: the header, the table as rows complete, the footer, the JSON file.
class printer {
 public:
  printer(const options& o, const context& ctx)
      : rep_(o, ctx.out, ctx.env),
        json_(o.json_file.empty() ? nullptr : open_json(o.json_file, ctx.out)) {}
  ~printer() {
    if (json_) {
      const std::string doc = rep_.json();
      std::fwrite(doc.data(), 1, doc.size(), json_);
      std::fclose(json_);
    }
  }
  printer(const printer&) = delete;
  printer& operator=(const printer&) = delete;
  [[nodiscard]] report& rep() noexcept { return rep_; }

 private:
  report rep_;
  std::FILE* json_;
};

/// One rank's whole run. `p` is non-null on the rank that prints.
template <class Backend>
outcome run_rank(Backend& b, const options& o, printer* p, run_info info) {
  info.devices = gather_devices(b);
  if (p) p->rep().header(info);
  engine<Backend> e(b, o, p ? &p->rep() : nullptr);
  const outcome result = e.run();
  if (p) p->rep().footer(result.errors);
  return result;
}

[[nodiscard]] inline int status_of(const outcome& r) {
  return r.errors > 0 ? exit_status::wrong : exit_status::ok;
}

[[nodiscard]] inline int run_loopback(const options& o, const context& ctx) {
  loopback::world_options wo;
  if (o.timeout_s > 0)
    wo.timeout = std::chrono::nanoseconds(static_cast<long long>(o.timeout_s * 1e9));
  loopback::world w(o.threads, wo);
  printer p(o, ctx);
  run_info info;
  info.program = ctx.program;
  info.transport = fmt::format(
      "loopback, {} rank{} as threads of one process (each message is "
      "one memcpy between threads)",
      o.threads, o.threads == 1 ? "" : "s");
  info.algorithm = algorithm_line(o);
  info.buffers = o.registration == 0
                     ? "user memory (-R 0)"
                     : fmt::format("-R {} accepted, but loopback has no registration: user memory",
                                   o.registration);
  const std::string description = fmt::format("loopback thread on {}", cpu_model());
  outcome result;
  try {
    if (!o.tune_file.empty()) {
      w.run([&](loopback::communicator& c) {
        (void)run_tune(c, o.tune_file, "loopback threads", ctx.out);
      });
      return exit_status::ok;
    }
    w.run([&](loopback::communicator& c) {
      host_backend<loopback::communicator> b(c, o, description);
      const outcome r = run_rank(b, o, c.rank() == 0 ? &p : nullptr, info);
      if (c.rank() == 0) result = r;
    });
  } catch (const std::exception& e) {
    p.rep().failure(e.what());
    fmt::print(ctx.err, "ringzero-perf: {}\n", e.what());
    return exit_status::failure;
  }
  return status_of(result);
}

/// The environment entries recorded with a result (see recorded_env).
[[nodiscard]] inline std::vector<std::string> recorded_environment(char** envp) {
  std::vector<std::string> env;
  for (char** e = envp; e != nullptr && *e != nullptr; ++e)
    if (recorded_env(*e)) env.emplace_back(*e);
  return env;
}

/// True when a launcher (ringzero-run, torchrun, mpirun, Slurm) started this process as one
/// rank of several.
/// Whether a launcher started this process as one rank of several. Launcher variables that are
/// set but make no launch (RANK without WORLD_SIZE, WORLD_SIZE=abc, MASTER_ADDR without a port)
/// are an error here, as in the transports' from_env(): run alone, each of N such processes
/// would measure a one-rank job and report success.
[[nodiscard]] inline bool launched_as_rank() {
  return bootstrap::detect_launch().world_size > 1;
}

/// The transport without -T. Alone (or with -t threads): loopback. A launched rank: libfabric,
/// except when the ranks span hosts (fewer on this one than in the job) and nothing asks for
/// libfabric (no efa here, no FI_PROVIDER, no -p, host buffers): then ringzero's socket
/// transport, which reaches the line rate on every rail where tcp;ofi_rxm reaches half of one
/// (docs/performance.md, "Between hosts").
[[nodiscard]] inline transport_kind automatic_transport(const options& o, const transports& extra) {
  if (o.threads != 1) return transport_kind::loopback;
  const bootstrap::launch_info info = bootstrap::detect_launch();
  if (info.world_size <= 1) return transport_kind::loopback;
  const bool libfabric_asked =
      !o.provider.empty() || o.device_memory || (extra.efa_present && extra.efa_present());
  const bool without_libfabric = !extra.libfabric && !libfabric_asked &&
                                 !ringzero::detail::getenv_str("FI_PROVIDER").has_value();
  if (extra.socket &&
      (bootstrap::prefer_socket_between_hosts(info, libfabric_asked) || without_libfabric))
    return transport_kind::socket;
  return extra.libfabric ? transport_kind::libfabric : transport_kind::loopback;
}

/// The whole program; main() forwards here.
inline int main(std::span<const std::string_view> args, std::string_view program, std::FILE* out,
                std::FILE* err, char** envp, const transports& extra = {}) {
  options o;
  try {
    o = parse_args(args, program);
  } catch (const error& e) {
    fmt::print(err, "ringzero-perf: {} (ringzero-perf --help lists the options)\n", e.what());
    return exit_status::usage;
  }
  if (o.help) {
    fmt::print(out, "{}", usage_text);
    return exit_status::ok;
  }
  context ctx;
  ctx.out = out;
  ctx.err = err;
  ctx.env = recorded_environment(envp);
  ctx.program = fmt::format("{}_perf", coll_name(o.coll));

  try {
    transport_kind t = o.transport;
    // Read inside the try: a malformed launcher environment is a clear error, not a crash.
    if (t == transport_kind::automatic) t = automatic_transport(o, extra);
    o.transport = t;
    if (o.wire != wire_format::full && (o.device_memory || t == transport_kind::nccl))
      throw invalid_argument("--wire: quantized collectives run on host buffers, not on a GPU's");
    switch (t) {
      case transport_kind::libfabric:
        if (!extra.libfabric)
          throw unsupported(
              "-T libfabric: this ringzero-perf was built without the libfabric "
              "transport (Debian: libfabric-dev)");
        if (o.threads != 1)
          throw invalid_argument(
              "-t applies to -T loopback; start libfabric ranks with a "
              "launcher (ringzero-run -n N ringzero-perf ...)");
        if (o.device_memory) {
          if (!extra.libfabric_device)
            throw unsupported(
                "--memory device: this ringzero-perf was built without CUDA (it needs nvcc and "
                "the CUDA toolkit when it is built); -T libfabric runs with host buffers only");
          return extra.libfabric_device(o, ctx);
        }
        return extra.libfabric(o, ctx);
      case transport_kind::shm:
        if (o.device_memory)
          throw invalid_argument("--memory device: the shm transport moves host memory only");
        if (!extra.shm) throw unsupported("-T shm: this ringzero-perf was built without it");
        if (o.threads != 1)
          throw invalid_argument(
              "-t applies to -T loopback; start shm ranks with a launcher "
              "(ringzero-run -n N ringzero-perf -T shm ...)");
        return extra.shm(o, ctx);
      case transport_kind::socket:
        if (o.device_memory)
          throw invalid_argument("--memory device: the socket transport moves host memory only");
        if (!extra.socket) throw unsupported("-T socket: this ringzero-perf was built without it");
        if (o.threads != 1)
          throw invalid_argument(
              "-t applies to -T loopback; start socket ranks with a launcher "
              "(ringzero-run -n N ringzero-perf -T socket ...)");
        return extra.socket(o, ctx);
      case transport_kind::nccl:
        if (!extra.nccl)
          throw unsupported("-T nccl: this ringzero-perf was built without the NCCL transport");
        if (o.threads != 1)
          throw invalid_argument(
              "-t applies to -T loopback; start one NCCL rank per GPU with a "
              "launcher (ringzero-run -n N ringzero-perf ...)");
        if (!o.tune_file.empty())
          throw unsupported(
              "--tune: NCCL runs its own algorithms; ringzero's cost model is unused");
        return extra.nccl(o, ctx);
      default:
        if (o.device_memory)
          throw invalid_argument(
              "--memory device needs -T libfabric (or -T nccl, whose buffers are always on the "
              "GPU)");
        if (!o.provider.empty())
          throw invalid_argument("-p names a libfabric provider; it needs -T libfabric");
        return run_loopback(o, ctx);
    }
  } catch (const invalid_argument& e) {
    fmt::print(err, "ringzero-perf: {}\n", e.what());
    return exit_status::usage;
  } catch (const std::exception& e) {
    fmt::print(err, "ringzero-perf: {}\n", e.what());
    return exit_status::failure;
  }
}

}  // namespace ringzero::perf
