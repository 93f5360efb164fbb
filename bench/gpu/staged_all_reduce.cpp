// all_reduce of device buffers by several processes that share one GPU, through ringzero's own
// algorithms over libfabric, staged through pinned host memory: copy the device buffer to the
// host, all_reduce there, copy the result back. NCCL refuses two ranks on one GPU, so this is
// how the multi-rank algorithm paths run on a machine with a single GPU; it measures the staging
// and the host transport, not GPU-to-GPU communication.
//
//   ringzero-run -n 4 ringzero-bench-staged [-b 4K] [-e 64M] [-f 4] [-r 10] [-A ring] [-p shm]
//
// Inputs are integers below 2^10 chosen by rank and index, so every sum is exact; the device
// result (its buffer poisoned first) is copied back and checked bitwise. Times are rank 0's
// medians per phase; a row is "ok" when every rank's check passed (an all_reduce of the mismatch
// counts). Plain C++ calling the CUDA runtime: nvcc 13 cannot yet compile ringzero's transport
// headers (fmt 9's compile-time format strings, some std::span conversions).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <span>
#include <string>
#include <vector>

#include "ringzero/ringzero.hpp"
#include "ringzero/transport/libfabric.hpp"

namespace {

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}

float input(int rank, std::size_t i) {
  return static_cast<float>((i * 2654435761u + static_cast<std::size_t>(rank) * 40503u) % 1021u);
}

std::size_t parse_size(const std::string& s) {
  std::size_t v = std::stoull(s);
  switch (s.back()) {
    case 'K':
      return v << 10;
    case 'M':
      return v << 20;
    case 'G':
      return v << 30;
    default:
      return v;
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) try {
  std::size_t min_bytes = 4096, max_bytes = std::size_t{64} << 20;
  int factor = 4, reps = 10;
  ringzero::options copt;
  ringzero::libfabric::options fopt;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i], v = argv[i + 1];
    if (f == "-b")
      min_bytes = parse_size(v);
    else if (f == "-e")
      max_bytes = parse_size(v);
    else if (f == "-f")
      factor = std::stoi(v);
    else if (f == "-r")
      reps = std::stoi(v);
    else if (f == "-A")
      copt.algorithm = ringzero::parse_algorithm(v);
    else if (f == "-p")
      fopt.provider = v;
    else
      throw ringzero::invalid_argument("unknown flag " + f);
  }
  // Every rank on the one GPU, checked before joining so that a machine without one fails at
  // once on every rank instead of after the rendezvous.
  ok(cudaSetDevice(0), "cudaSetDevice");
  auto comm = ringzero::libfabric::communicator::from_env(fopt);
  const int rank = comm.rank(), size = comm.size();
  cudaDeviceProp prop{};
  ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  if (rank == 0)
    std::printf(
        "# ringzero-bench-staged: %d processes on %s, libfabric provider %s, algorithm %s\n"
        "# %12s %10s %10s %10s %10s %10s %4s\n",
        size, prop.name, fopt.provider.empty() ? "(default)" : fopt.provider.c_str(),
        std::string(ringzero::algorithm_name(copt.algorithm)).c_str(), "bytes", "D2H(us)",
        "reduce(us)", "H2D(us)", "total(us)", "GB/s", "ok");
  const std::size_t max_n = max_bytes / sizeof(float);
  float *src = nullptr, *dst = nullptr, *host = nullptr;
  ok(cudaMalloc(&src, max_n * sizeof(float)), "cudaMalloc");
  ok(cudaMalloc(&dst, max_n * sizeof(float)), "cudaMalloc");
  ok(cudaMallocHost(&host, max_n * sizeof(float)), "cudaMallocHost");
  std::vector<float> in(max_n), want(max_n), got(max_n);
  for (std::size_t i = 0; i < max_n; ++i) {
    in[i] = input(rank, i);
    for (int r = 0; r < size; ++r) want[i] += input(r, i);
  }
  ok(cudaMemcpy(src, in.data(), max_n * sizeof(float), cudaMemcpyHostToDevice), "H2D");
  using clock = std::chrono::steady_clock;
  auto us = [](clock::time_point a, clock::time_point b) {
    return std::chrono::duration<double, std::micro>(b - a).count();
  };
  int failures = 0;
  for (std::size_t bytes = min_bytes; bytes <= max_bytes; bytes *= factor) {
    const std::size_t n = bytes / sizeof(float);
    std::vector<double> d2h, red, h2d, total;
    std::uint64_t bad = 0;
    for (int r = 0; r < reps + 1; ++r) {
      ok(cudaMemset(dst, 0xA5, n * sizeof(float)), "cudaMemset");
      ok(cudaDeviceSynchronize(), "cudaMemset");
      ringzero::barrier(comm);
      const auto t0 = clock::now();
      ok(cudaMemcpy(host, src, n * sizeof(float), cudaMemcpyDeviceToHost), "D2H");
      const auto t1 = clock::now();
      ringzero::all_reduce(comm, std::span<float>(host, n), ringzero::op::sum, copt);
      const auto t2 = clock::now();
      ok(cudaMemcpy(dst, host, n * sizeof(float), cudaMemcpyHostToDevice), "H2D");
      const auto t3 = clock::now();
      if (r > 0) {  // the first is a warm-up (registration, connection set-up)
        d2h.push_back(us(t0, t1));
        red.push_back(us(t1, t2));
        h2d.push_back(us(t2, t3));
        total.push_back(us(t0, t3));
      }
      ok(cudaMemcpy(got.data(), dst, n * sizeof(float), cudaMemcpyDeviceToHost), "D2H");
      for (std::size_t i = 0; i < n; ++i) bad += got[i] == want[i] ? 0 : 1;
    }
    ringzero::all_reduce(comm, std::span<std::uint64_t>(&bad, 1), ringzero::op::sum);
    failures += bad != 0;
    if (rank == 0)
      std::printf("  %12zu %10.1f %10.1f %10.1f %10.1f %10.3f %4s\n", bytes, median(d2h),
                  median(red), median(h2d), median(total), bytes / median(total) * 1e-3,
                  bad == 0 ? "ok" : "BAD");
  }
  cudaFree(src);
  cudaFree(dst);
  cudaFreeHost(host);
  return failures == 0 ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "ringzero-bench-staged: %s\n", e.what());
  return 2;
}
