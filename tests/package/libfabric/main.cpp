// Every rank is a process; ranks find each other through the launcher's environment
// (ringzero-run, torchrun, srun, mpirun) and all-reduce over libfabric.
//   ringzero-run -n 2 ./allreduce_fabric
#include <unistd.h>

#include <ringzero/ringzero.hpp>
#include <ringzero/transport/libfabric.hpp>

#include <fmt/core.h>

#include <cstdio>
#include <exception>
#include <stdexcept>
#include <vector>

int main() {
  try {
    auto comm = ringzero::libfabric::communicator::from_env();
    // Rank r contributes r+1, so every element ends as 1 + 2 + ... + size.
    std::vector<float> grads(1000, static_cast<float>(comm.rank() + 1));
    ringzero::all_reduce(comm, std::span<float>(grads), ringzero::op::sum);
    const float expected = static_cast<float>(comm.size() * (comm.size() + 1) / 2);
    for (float g : grads)
      if (g != expected) throw std::runtime_error(fmt::format("expected {} everywhere", expected));
    fmt::print("rank {} of {} (pid {}): all_reduce gave {} in all {} elements\n", comm.rank(),
               comm.size(), ::getpid(), grads[0], grads.size());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
