// Four ranks as four threads all-reduce a vector, then every rank checks the result against
// the sum it can compute by itself. The smallest complete ringzero program.
#include <ringzero/ringzero.hpp>

#include <fmt/core.h>

#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  const int ranks = argc > 1 ? std::atoi(argv[1]) : 4;
  ringzero::loopback::world world(ranks);
  world.run([&](ringzero::loopback::communicator& comm) {
    // Rank r contributes r+1 in every element, so the sum is n(n+1)/2 everywhere.
    std::vector<float> grads(1 << 20, static_cast<float>(comm.rank() + 1));
    ringzero::all_reduce(comm, std::span<float>(grads), ringzero::op::sum);
    const float expected = static_cast<float>(comm.size() * (comm.size() + 1) / 2);
    std::size_t wrong = 0;
    for (float g : grads) wrong += g != expected;
    fmt::print("rank {}/{}: all_reduce of {} floats -> {} (expected {}), {} wrong\n", comm.rank(),
               comm.size(), grads.size(), grads[0], expected, wrong);
    if (wrong != 0) throw ringzero::error(ringzero::errc::invalid_argument, "wrong result");
  });
}
