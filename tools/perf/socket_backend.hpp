// ringzero-perf on the socket transport: one rank per process, on one host or many, started by
// a launcher (ringzero-run -n N ringzero-perf -T socket ..., or bench/netbed run), host
// buffers. RINGZERO_RAILS names the rails.
#pragma once

#include <fmt/core.h>

#include <chrono>
#include <optional>
#include <string>

// The socket communicator must be declared before bench.hpp's calls to the collectives.
#include "ringzero/transport/socket.hpp"

#include "bench.hpp"
#include "cli.hpp"
#include "perf.hpp"

namespace ringzero::perf {

[[nodiscard]] inline int run_socket(const options& o, const context& ctx) {
  socket::options opts;
  if (o.timeout_s > 0)
    opts.timeout = std::chrono::nanoseconds(static_cast<long long>(o.timeout_s * 1e9));
  auto comm = socket::communicator::from_env(opts);
  std::string rails;
  for (int r = 0; r < comm.transport().rails(); ++r)
    rails += fmt::format("{}{}", r ? "," : "", comm.transport().rail_name(r));
  const std::string what = fmt::format("socket, {} rail{} ({})", comm.transport().rails(),
                                       comm.transport().rails() == 1 ? "" : "s", rails);
  if (!o.tune_file.empty()) {
    try {
      return run_tune(comm, o.tune_file, what, ctx.out);
    } catch (const std::exception& e) {
      fmt::print(ctx.err, "ringzero-perf: rank {}: {}\n", comm.rank(), e.what());
      return exit_status::failure;
    }
  }
  const bool prints = comm.rank() == 0;
  std::optional<printer> p;
  if (prints) p.emplace(o, ctx);
  run_info info;
  info.program = ctx.program;
  info.transport =
      fmt::format("{}, {} rank{} as processes", what, comm.size(), comm.size() == 1 ? "" : "s");
  info.algorithm = algorithm_line(o);
  info.buffers = "user memory";
  host_backend<socket::communicator> b(comm, o, fmt::format("socket on {}", cpu_model()));
  try {
    const outcome r = run_rank(b, o, prints ? &*p : nullptr, info);
    return status_of(r);
  } catch (const std::exception& e) {
    if (p) p->rep().failure(e.what());
    fmt::print(ctx.err, "ringzero-perf: rank {}: {}\n", comm.rank(), e.what());
    return exit_status::failure;
  }
}

}  // namespace ringzero::perf
