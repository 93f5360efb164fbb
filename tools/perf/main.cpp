// ringzero-perf: nccl-tests' all_reduce_perf & co. for ringzero's transports. Usage and output:
// docs/performance.md; `ringzero-perf --help`.
#include <cstdio>
#include <string_view>
#include <vector>

// Transport headers first: their collectives overload the names bench.hpp calls, and a
// qualified call in a template only sees the overloads declared before it.
#if RINGZERO_PERF_WITH_LIBFABRIC
#include "ringzero/transport/libfabric.hpp"
#endif
#if RINGZERO_PERF_WITH_NCCL
#include "ringzero/transport/nccl.hpp"
#endif
#include "ringzero/transport/shm.hpp"
#include "ringzero/transport/socket.hpp"

#if RINGZERO_PERF_WITH_LIBFABRIC
#include "libfabric_backend.hpp"
#endif
#if RINGZERO_PERF_WITH_LIBFABRIC_DEVICE
#include "libfabric_device.hpp"
#endif
#if RINGZERO_PERF_WITH_NCCL
#include "nccl_backend.hpp"
#endif
#include "perf.hpp"
#include "shm_backend.hpp"
#include "socket_backend.hpp"

extern char** environ;

int main(int argc, char** argv) {
  // A line at a time even into a pipe or a file (a launcher's, Slurm's, `> log`): progress is
  // read while the job runs, not when it exits.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::vector<std::string_view> args(argv + 1, argv + argc);
  ringzero::perf::transports extra;
#if RINGZERO_PERF_WITH_LIBFABRIC
  extra.libfabric = ringzero::perf::run_libfabric;
  extra.efa_present = [] { return ringzero::libfabric::detail::provider_available("efa"); };
#endif
#if RINGZERO_PERF_WITH_LIBFABRIC_DEVICE
  extra.libfabric_device = ringzero::perf::run_libfabric_device;
#endif
#if RINGZERO_PERF_WITH_NCCL
  extra.nccl = ringzero::perf::run_nccl;
#endif
  extra.shm = ringzero::perf::run_shm;
  extra.socket = ringzero::perf::run_socket;
  return ringzero::perf::main(args, argv[0], stdout, stderr, environ, extra);
}
