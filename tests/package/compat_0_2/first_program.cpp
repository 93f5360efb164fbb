// As 0.2 documented it, unchanged (its tests/package/find_package/main.cpp at 3087dec); built by
// tests/package/CMakeLists.txt with deprecation warnings allowed.
// Two ranks, run as two threads of this process, add up their gradients with all_reduce.
#include <ringzero/ringzero.hpp>

#include <fmt/core.h>

#include <cstdio>
#include <exception>
#include <stdexcept>
#include <vector>

int main() {
  try {
    ringzero::loopback::world world(2);
    world.run([](ringzero::loopback::communicator& comm) {
      // Rank 0 contributes 1.0 in every element and rank 1 contributes 2.0.
      std::vector<float> grads(1000, static_cast<float>(comm.rank() + 1));
      ringzero::all_reduce(comm, std::span<float>(grads), ringzero::op::sum);
      for (float g : grads)
        if (g != 3.0f) throw std::runtime_error("expected 3 in every element");
      fmt::print("rank {} of {}: all_reduce gave {} in all {} elements\n", comm.rank(), comm.size(),
                 grads[0], grads.size());
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
