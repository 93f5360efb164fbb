// Collectives on CUDA device buffers over libfabric (options::device_memory): two ranks as
// processes, each on device LOCAL_RANK % (visible devices), ringzero::all_reduce (sum, avg, max,
// in and out of place, ring and tree), reduce_scatter, all_gather, broadcast and reduce of
// device buffers, run by ringzero's schedules on the messaging device executor; results are
// copied to the host and compared element by element. It needs a GPU and a provider that registers
// CUDA memory (efa with GPUDirect RDMA, or shm in a libfabric built with CUDA); without a GPU it
// prints "skipped: no CUDA device", without such a provider "skipped: no libfabric provider", and
// CTest reports a skip.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "multiprocess.hpp"
#include "ringzero/kernels/cuda/device_reduction.cuh"
#include "ringzero/ringzero.hpp"
#include "ringzero/transport/libfabric.hpp"

using namespace std::chrono_literals;
using ringzero::algorithm;
using ringzero::op;
namespace fabric = ringzero::libfabric;
using multiprocess::rank_checks;

namespace {

// CUDA does not survive fork(): the parent never touches it, each rank initializes its own.
constexpr int no_device = 77;
constexpr int no_provider = 78;

int visible_devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    return 0;
  }
  return n;
}

template <class T>
std::vector<T> to_host(const T* d, std::size_t n) {
  std::vector<T> h(n);
  if (cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess)
    throw ringzero::transport_error("cudaMemcpy to the host failed");
  return h;
}

template <class T>
void to_device(T* d, const std::vector<T>& h) {
  if (cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice) != cudaSuccess)
    throw ringzero::transport_error("cudaMemcpy to the device failed");
}

template <class T>
T* device_alloc(std::size_t n) {
  void* p = nullptr;
  if (cudaMalloc(&p, n * sizeof(T)) != cudaSuccess)
    throw ringzero::transport_error("cudaMalloc failed");
  return static_cast<T*>(p);
}

/// Every rank's element i is rank + i % 13 (small integers: sums are exact in float).
template <class T>
std::vector<T> input(int rank, std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>(rank + static_cast<int>(i % 13));
  return v;
}

int rank_main(int r, int n, ringzero::bootstrap::store& s) {
  rank_checks check{r};
  const int devices = visible_devices();
  if (devices == 0) return no_device;
  const int device = r % devices;
  if (cudaSetDevice(device) != cudaSuccess) return no_device;

  // docs-begin: open
  std::optional<fabric::communicator> comm;
  try {
    comm.emplace(fabric::transport(s, r, n, {.timeout = 60s, .device_memory = true}));
  } catch (const ringzero::error& e) {
    std::fprintf(stderr, "rank %d: %s\n", r, e.what());
    return no_provider;
  }
  // docs-end: open
  fabric::transport& t = comm->transport();
  // 3 elements: a message the provider could inject; 300001: chunked, odd block sizes.
  for (std::size_t count : {std::size_t{3}, std::size_t{300001}}) {
    float* in = device_alloc<float>(count);
    float* out = device_alloc<float>(count);
    try {
      // docs-begin: register
      t.register_device_buffer(in, count * sizeof(float), device);
      t.register_device_buffer(out, count * sizeof(float), device);
      // docs-end: register
    } catch (const ringzero::unsupported& e) {
      std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      return no_provider;
    }
    const auto mine = input<float>(r, count);
    to_device(in, mine);
    // docs-begin: all-reduce
    ringzero::all_reduce(*comm, std::span<const float>(in, count), std::span<float>(out, count),
                         op::sum);
    // docs-end: all-reduce
    auto got = to_host(out, count);
    bool ok = true;
    for (std::size_t i = 0; i < count; ++i)
      ok = ok && got[i] == static_cast<float>(n * (n - 1) / 2 + n * static_cast<int>(i % 13));
    check.expect(ok, "the out-of-place sum of " + std::to_string(count) + " floats");

    to_device(out, mine);
    ringzero::all_reduce(*comm, std::span<float>(out, count), op::max);
    got = to_host(out, count);
    ok = true;
    for (std::size_t i = 0; i < count; ++i)
      ok = ok && got[i] == static_cast<float>(n - 1 + static_cast<int>(i % 13));
    check.expect(ok, "the in-place max of " + std::to_string(count) + " floats");

    to_device(in, mine);
    ringzero::all_reduce(*comm, std::span<const float>(in, count), std::span<float>(out, count),
                         op::avg);
    got = to_host(out, count);
    ok = true;
    for (std::size_t i = 0; i < count; ++i)
      ok = ok && got[i] == static_cast<float>(n - 1) / 2 + static_cast<float>(i % 13);
    check.expect(ok, "the average of " + std::to_string(count) + " floats");

    ringzero::all_reduce(*comm, std::span<const float>(in, count), std::span<float>(out, count),
                         op::sum, {.algorithm = algorithm::tree});
    got = to_host(out, count);
    ok = true;
    for (std::size_t i = 0; i < count; ++i)
      ok = ok && got[i] == static_cast<float>(n * (n - 1) / 2 + n * static_cast<int>(i % 13));
    check.expect(ok, "the tree sum of " + std::to_string(count) + " floats");

    // Broadcast from rank 1 into out, then reduce (max) to rank 0.
    ringzero::broadcast(*comm, std::span<const float>(in, count), std::span<float>(out, count), 1);
    got = to_host(out, count);
    ok = true;
    for (std::size_t i = 0; i < count; ++i)
      ok = ok && got[i] == static_cast<float>(1 + static_cast<int>(i % 13));
    check.expect(ok, "the broadcast of " + std::to_string(count) + " floats from rank 1");
    to_device(out, mine);
    ringzero::reduce(*comm, std::span<const float>(in, count), std::span<float>(out, count),
                     op::max, 0);
    if (r == 0) {
      got = to_host(out, count);
      ok = true;
      for (std::size_t i = 0; i < count; ++i)
        ok = ok && got[i] == static_cast<float>(n - 1 + static_cast<int>(i % 13));
      check.expect(ok, "the max of " + std::to_string(count) + " floats reduced to rank 0");
    }
    // docs-begin: forget
    t.forget_memory(in, count * sizeof(float));
    t.forget_memory(out, count * sizeof(float));
    // docs-end: forget
    static_cast<void>(cudaFree(in));
    static_cast<void>(cudaFree(out));
  }

  // reduce_scatter then all_gather of int32 blocks of 1000: back to the full sum.
  const std::size_t block = 1000;
  const std::size_t total = block * static_cast<std::size_t>(n);
  std::int32_t* full = device_alloc<std::int32_t>(total);
  std::int32_t* part = device_alloc<std::int32_t>(block);
  to_device(full, input<std::int32_t>(r, total));
  ringzero::reduce_scatter(*comm, std::span<const std::int32_t>(full, total),
                           std::span<std::int32_t>(part, block), op::sum);
  const auto reduced = to_host(part, block);
  bool ok = true;
  for (std::size_t i = 0; i < block; ++i) {
    const std::size_t g = static_cast<std::size_t>(r) * block + i;
    ok = ok && reduced[i] == n * (n - 1) / 2 + n * static_cast<int>(g % 13);
  }
  check.expect(ok, "rank's block of the reduce_scatter sum");
  ringzero::all_gather(*comm, std::span<const std::int32_t>(part, block),
                       std::span<std::int32_t>(full, total));
  const auto gathered = to_host(full, total);
  ok = true;
  for (std::size_t g = 0; g < total; ++g)
    ok = ok && gathered[g] == n * (n - 1) / 2 + n * static_cast<int>(g % 13);
  check.expect(ok, "the all_gather of every rank's block");
  t.forget_memory(full, total * sizeof(std::int32_t));
  t.forget_memory(part, block * sizeof(std::int32_t));
  static_cast<void>(cudaFree(full));
  static_cast<void>(cudaFree(part));
  return check.code();
}

}  // namespace

TEST_CASE(
    "device buffers over libfabric: all_reduce, reduce_scatter, all_gather, broadcast, reduce") {
  const auto out = multiprocess::run(2, 240s, rank_main);
  bool no_gpu = true;
  bool no_hmem = true;
  for (int st : out.status) {
    no_gpu = no_gpu && st == no_device;
    no_hmem = no_hmem && (st == no_provider || st == no_device);
  }
  if (no_gpu) {
    MESSAGE("skipped: no CUDA device");
    return;
  }
  if (no_hmem) {
    MESSAGE("skipped: no libfabric provider registers CUDA memory here (see the ranks' errors)");
    return;
  }
  multiprocess::require_all_passed(out);
}
