// ringzero's schedules on GPU buffers across ranks with the real kernels, on one GPU or several:
// ranks are threads over a test transport whose messages are device-to-device copies with events
// (support/cuda_loopback.hpp), so the messaging device executor (detail/device_executor.hpp)
// posts sends only once the kernels that made them finished and reduces what arrived, as it does
// over libfabric with FI_HMEM, where no GPU machine here has a provider for it. Every result is
// checked against the serial reference; reproducible sums against the host path's bits. Without
// a GPU every case says so and CTest reports a skip. The kernels are registered by
// cuda_loopback_kernels.cu, the only source nvcc compiles; the collectives are the host
// compiler's.
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "cuda_loopback.hpp"
#include "ringzero/kernels/device_reduction.hpp"
#include "ringzero/ringzero.hpp"

namespace {

using ringzero::algorithm;
using ringzero::op;
using test_support::cuda_loopback_communicator;

bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) return true;
  static_cast<void>(cudaGetLastError());
  MESSAGE("no CUDA device is visible; skipping");
  return false;
}

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw ringzero::transport_error(std::string(what) + ": " + cudaGetErrorString(e));
}

/// Device memory of the current device holding `v`; copied back by read().
template <class T>
class device_vector {
 public:
  explicit device_vector(const std::vector<T>& v) : n_(v.size()) {
    ok(cudaMalloc(&p_, std::max<std::size_t>(n_, 1) * sizeof(T)), "cudaMalloc");
    ok(cudaMemcpy(p_, v.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
    ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // a test's setup: no peer involved
  }
  ~device_vector() { static_cast<void>(cudaFree(p_)); }
  device_vector(const device_vector&) = delete;
  device_vector& operator=(const device_vector&) = delete;
  std::span<T> span() const { return {p_, n_}; }
  std::vector<T> read() const {
    std::vector<T> v(n_);
    ok(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return v;
  }

 private:
  std::size_t n_;
  T* p_ = nullptr;
};

/// Rank r's i-th term: small integers, so every sum is exact in float.
float term(int r, std::size_t i) {
  return static_cast<float>((r + 1) * 5 + static_cast<int>(i % 31)) - 20.0f;
}

struct failures {
  std::mutex m;
  std::vector<std::string> list;
  void add(std::string s) {
    std::lock_guard lock(m);
    list.push_back(std::move(s));
  }
};

}  // namespace

TEST_CASE("on a GPU: ringzero's schedules across ranks, device-to-device, real kernels") {
  if (!have_gpu()) return;
  REQUIRE(ringzero::kernels::registered_device_reduction() != nullptr);
  int devices = 0;
  ok(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  for (int d = 0; d < devices; ++d) {
    int ordering = 0;
    ok(cudaDeviceGetAttribute(&ordering, cudaDevAttrGPUDirectRDMAWritesOrdering, d),
       "cudaDeviceGetAttribute");
    // 0: a flush is needed between a NIC's writes and a kernel (the executor makes it); 100,
    // 200: the device orders them itself.
    MESSAGE("GPU ", d, ": cudaDevAttrGPUDirectRDMAWritesOrdering ", ordering);
  }
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    failures bad;
    test_support::run_cuda_loopback(n, [&](cuda_loopback_communicator& comm) {
      const int r = comm.rank();
      const auto un = static_cast<std::size_t>(n);
      constexpr std::size_t count = 100003;  // several chunks, not a multiple of anything
      std::vector<float> mine(count * un);
      for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = term(r, i);
      const auto sum = [&](std::size_t i) {
        float s = 0.0f;
        for (int p = 0; p < n; ++p) s += term(p, i);
        return s;
      };
      for (algorithm a : {algorithm::ring, algorithm::tree}) {
        device_vector<float> d(std::vector<float>(mine.begin(), mine.begin() + count));
        ringzero::all_reduce(comm, d.span(), op::sum, {.algorithm = a});
        const auto got = d.read();
        for (std::size_t i = 0; i < count; ++i)
          if (got[i] != sum(i)) {
            bad.add(fmt::format("rank {} {} all_reduce: element {} is {}", r,
                                ringzero::algorithm_name(a), i, got[i]));
            break;
          }
      }
      {
        device_vector<float> in(mine);
        device_vector<float> out{std::vector<float>(count)};
        ringzero::reduce_scatter(comm, std::span<const float>(in.span()), out.span(), op::sum,
                                 {.algorithm = algorithm::ring});
        const auto got = out.read();
        for (std::size_t i = 0; i < count; ++i)
          if (got[i] != sum(static_cast<std::size_t>(r) * count + i)) {
            bad.add(fmt::format("rank {} reduce_scatter: element {} is {}", r, i, got[i]));
            break;
          }
      }
      {
        device_vector<float> in(std::vector<float>(count, static_cast<float>(r)));
        device_vector<float> out{std::vector<float>(count * un)};
        ringzero::all_gather(comm, std::span<const float>(in.span()), out.span());
        const auto got = out.read();
        for (int p = 0; p < n; ++p)
          if (got[static_cast<std::size_t>(p) * count + count - 1] != static_cast<float>(p))
            bad.add(fmt::format("rank {} all_gather: block {} is wrong", r, p));
      }
    });
    for (const auto& f : bad.list) FAIL_CHECK(f);
  }
}

TEST_CASE("on a GPU: reproducible sums across ranks give the host path's bits") {
  if (!have_gpu()) return;
  constexpr std::size_t count = 70001;
  for (int n : {2, 3}) {
    CAPTURE(n);
    std::vector<std::vector<float>> inputs(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
      auto& v = inputs[static_cast<std::size_t>(r)];
      v.resize(count);
      for (std::size_t i = 0; i < count; ++i)
        v[i] = std::ldexp(term(r, i),
                          static_cast<int>((i * 13 + static_cast<std::size_t>(r)) % 80) - 40);
    }
    std::vector<float> want(count);
    ringzero::loopback::world(n).run([&](ringzero::loopback::communicator& comm) {
      std::vector<float> out(count);
      ringzero::all_reduce(comm,
                           std::span<const float>(inputs[static_cast<std::size_t>(comm.rank())]),
                           std::span<float>(out), op::sum, {.reproducible = true});
      if (comm.rank() == 0) want = out;
    });
    failures bad;
    test_support::run_cuda_loopback(n, [&](cuda_loopback_communicator& comm) {
      device_vector<float> in(inputs[static_cast<std::size_t>(comm.rank())]);
      device_vector<float> out{std::vector<float>(count)};
      ringzero::all_reduce(comm, std::span<const float>(in.span()), out.span(), op::sum,
                           {.reproducible = true});
      const std::vector<float> got = out.read();
      if (std::memcmp(got.data(), want.data(), count * sizeof(float)) != 0)
        bad.add(fmt::format("rank {}: bits differ from the host path's", comm.rank()));
    });
    for (const auto& f : bad.list) FAIL_CHECK(f);
  }
}
