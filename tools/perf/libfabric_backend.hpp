// ringzero-perf on the libfabric transport: one rank per process, started by a launcher
// (ringzero-run -n N, torchrun, mpirun, srun), host buffers. -p picks the provider; -R 1 asks the
// transport to register buffers even where the provider does not need it.
#pragma once

#include <fmt/core.h>

#include <chrono>
#include <optional>
#include <string>

#include "bench.hpp"
#include "cli.hpp"
#include "perf.hpp"
#include "ringzero/transport/libfabric.hpp"

namespace ringzero::perf {

[[nodiscard]] inline libfabric::communicator make_libfabric_communicator(const options& o) {
  libfabric::options opts;
  opts.provider = o.provider;
  if (o.timeout_s > 0)
    opts.timeout = std::chrono::nanoseconds(static_cast<long long>(o.timeout_s * 1e9));
  opts.register_memory = o.registration >= 1;
  return libfabric::communicator::from_env(opts);
}

[[nodiscard]] inline int run_libfabric(const options& o, const context& ctx) {
  auto comm = make_libfabric_communicator(o);
  if (!o.tune_file.empty()) {
    try {
      return run_tune(comm, o.tune_file, "libfabric", ctx.out);
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
      fmt::format("libfabric, provider {}, {} rank{} as processes", comm.transport().provider(),
                  comm.size(), comm.size() == 1 ? "" : "s");
  info.algorithm = algorithm_line(o);
  switch (o.registration) {
    case 0:
      info.buffers = "user memory; registered only where the provider needs it (-R 0)";
      break;
    case 1:
      info.buffers = "user memory, registered with the provider (-R 1)";
      break;
    default:
      info.buffers =
          "-R 2 accepted, but the libfabric transport has no symmetric memory: user "
          "memory, registered (-R 1)";
  }
  host_backend<libfabric::communicator> b(
      comm, o, fmt::format("libfabric {} on {}", comm.transport().provider(), cpu_model()));
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
