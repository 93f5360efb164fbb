// ringzero-perf on the shm transport: one rank per process on one host, started by a launcher
// (ringzero-run -n N ringzero-perf -T shm ...), host buffers.
#pragma once

#include <fmt/core.h>

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

// The shm communicator must be declared before bench.hpp's calls to the collectives.
#include "ringzero/transport/shm.hpp"

#include "bench.hpp"
#include "cli.hpp"
#include "perf.hpp"

namespace ringzero::perf {

/// Host buffers that, with -R 2, are symmetric memory of the shm transport: the collectives
/// then read the peers' buffers in place (nccl-tests' -R 2, NCCL's symmetric registration).
class shm_backend : public host_backend<shm::communicator> {
 public:
  shm_backend(shm::communicator& comm, const options& o, std::string description)
      : host_backend<shm::communicator>(comm, o, std::move(description)),
        comm_(comm),
        symmetric_(o.registration >= 2) {}

  [[nodiscard]] std::byte* allocate(std::size_t bytes) {
    if (!symmetric_) return host_backend<shm::communicator>::allocate(bytes);
    symmetric_buffers_.push_back(comm_.allocate<std::byte>(bytes));
    return symmetric_buffers_.back().local().data();
  }

 private:
  shm::communicator& comm_;
  bool symmetric_;
  std::vector<shm::symmetric_buffer<std::byte>> symmetric_buffers_;
};

[[nodiscard]] inline int run_shm(const options& o, const context& ctx) {
  shm::options opts;
  if (o.timeout_s > 0)
    opts.timeout = std::chrono::nanoseconds(static_cast<long long>(o.timeout_s * 1e9));
  auto comm = shm::communicator::from_env(opts);
  if (!o.tune_file.empty()) {
    try {
      return run_tune(comm, o.tune_file, "shm, native shared memory", ctx.out);
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
  info.transport = fmt::format("shm (one shared segment), {} rank{} as processes", comm.size(),
                               comm.size() == 1 ? "" : "s");
  info.algorithm = algorithm_line(o);
  info.buffers = o.registration >= 2
                     ? "symmetric memory of the shm transport (-R 2): peers' buffers read in place"
                     : "user memory (-R 0; -R 1 is the same on shm)";
  shm_backend b(comm, o, fmt::format("shm on {}", cpu_model()));
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
