// Builds against ringzero::nccl. With a GPU, a one-rank NCCL communicator all-reduces a device
// buffer; without one, creating the communicator must fail with a ringzero::error, not crash.
#include <cuda_runtime.h>

#include <ringzero/ringzero.hpp>
#include <ringzero/transport/nccl.hpp>

#include <fmt/core.h>

#include <cstdio>
#include <exception>
#include <vector>

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    try {
      auto comm = ringzero::nccl::communicator::single();
      std::fprintf(stderr, "communicator::single() succeeded without a GPU\n");
      return 1;
    } catch (const ringzero::error& e) {
      fmt::print("no GPU: communicator::single() raised {}\n", e.what());
      return 0;
    }
  }
  try {
    // docs-begin: nccl-usage
    auto comm = ringzero::nccl::communicator::single();  // or from_env() under a launcher
    // The communicator made its rank's GPU current: cudaMalloc below allocates there.
    std::vector<float> host(1000, 1.0f);
    float* device = nullptr;
    if (cudaMalloc(&device, host.size() * sizeof(float)) != cudaSuccess) return 1;
    cudaMemcpy(device, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice);
    ringzero::all_reduce(comm, std::span<float>(device, host.size()), ringzero::op::sum);
    cudaMemcpy(host.data(), device, host.size() * sizeof(float), cudaMemcpyDeviceToHost);
    cudaFree(device);
    // docs-end: nccl-usage
    for (float x : host)
      if (x != 1.0f) {
        std::fprintf(stderr, "expected 1 in every element, got %g\n", static_cast<double>(x));
        return 1;
      }
    fmt::print("rank {} of {} on GPU {}: all_reduce gave {} in all {} elements\n", comm.rank(),
               comm.size(), comm.transport().device(), host[0], host.size());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
