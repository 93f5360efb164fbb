// Bandwidth of ringzero's CUDA kernels (kernels/cuda/*.cuh) against the device's own copy
// bandwidth, measured in the same run: a device-to-device cudaMemcpyAsync and a plain 16-byte
// copy kernel. Each kernel's bytes are the fewest it must move (every input read once, every
// output written once); GB/s = those bytes / median time; "of copy" = that over the memcpy's.
//
//   ringzero-bench-kernels [-n elements (default 2^26)] [-r reps (default 30)] [-w warm-ups (5)]
//
// Inputs are random (a hash of the index), outputs are poisoned before the checked run, and one
// run of every kernel is compared element by element with the host element functions before
// it is timed; a mismatch makes the program fail.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "ringzero/kernels/cuda/optimizer.cuh"
#include "ringzero/kernels/cuda/reduce.cuh"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/zero/optimizer_table.hpp"

namespace {

namespace k = ringzero::kernels;
namespace kc = ringzero::kernels::cuda;
using ringzero::bfloat16;
using ringzero::float16;

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}

__host__ __device__ inline std::uint32_t mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<std::uint32_t>(x);
}

// Values in (-scale, scale) (0 < v < scale when positive), different for every seed and index.
template <class T>
__global__ void fill(T* p, std::size_t n, std::uint64_t seed, float scale, bool positive) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float u = static_cast<float>(mix(seed * 0x9e3779b97f4a7c15ull + i) >> 8) * 0x1p-24f;
    const float v = positive ? u * scale + 1e-12f : (2.0f * u - 1.0f) * scale;
    p[i] = k::from_float<T>(v);
  }
}

template <class T>
struct buffer {
  T* p = nullptr;
  std::size_t n = 0;
  explicit buffer(std::size_t count) : n(count) { ok(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc"); }
  buffer(const buffer&) = delete;
  ~buffer() { cudaFree(p); }
  void random(std::uint64_t seed, float scale = 1.0f, bool positive = false) {
    fill<T><<<1024, 256>>>(p, n, seed, scale, positive);
    ok(cudaGetLastError(), "fill");
  }
  void poison() { ok(cudaMemset(p, 0xA5, n * sizeof(T)), "cudaMemset"); }
  std::vector<T> get() const {
    std::vector<T> v(n);
    ok(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return v;
  }
};

template <class T>
bool same(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         std::memcmp(static_cast<const void*>(a.data()), static_cast<const void*>(b.data()),
                     a.size() * sizeof(T)) == 0;
}

/// Median time in microseconds of `reps` runs of f, after `warm` untimed ones.
double median_us(int reps, int warm, const std::function<void()>& f) {
  cudaEvent_t a, b;
  ok(cudaEventCreate(&a), "cudaEventCreate");
  ok(cudaEventCreate(&b), "cudaEventCreate");
  for (int i = 0; i < warm; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    ok(cudaEventRecord(a), "cudaEventRecord");
    f();
    ok(cudaEventRecord(b), "cudaEventRecord");
    ok(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    ok(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    t.push_back(ms * 1e3);
  }
  ok(cudaGetLastError(), "timed kernels");
  ok(cudaEventDestroy(a), "cudaEventDestroy");
  ok(cudaEventDestroy(b), "cudaEventDestroy");
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <class T>
__global__ void copy_kernel(const T* __restrict__ in, T* __restrict__ out, std::size_t n) {
  constexpr int V = 16 / sizeof(T);
  const std::size_t nv = n / V;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < nv;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    kc::detail::store<T, V>(out + i * V, kc::detail::load<T, V>(in + i * V));
}

struct row {
  std::string name;
  double bytes, us;
  bool checked;
};

}  // namespace

int main(int argc, char** argv) try {
  std::size_t n = std::size_t{1} << 26;
  int reps = 30, warm = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i];
    if (f == "-n")
      n = std::stoull(argv[i + 1]);
    else if (f == "-r")
      reps = std::stoi(argv[i + 1]);
    else if (f == "-w")
      warm = std::stoi(argv[i + 1]);
    else
      throw std::runtime_error("unknown flag " + f);
  }
  int dev = 0;
  cudaDeviceProp prop{};
  ok(cudaGetDevice(&dev), "cudaGetDevice");
  ok(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  int rt = 0, drv = 0;
  ok(cudaRuntimeGetVersion(&rt), "cudaRuntimeGetVersion");
  ok(cudaDriverGetVersion(&drv), "cudaDriverGetVersion");
  std::printf("# ringzero-bench-kernels: %s, %d SMs, L2 %d MB; CUDA runtime %d, driver %d\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, rt, drv);
  std::printf("# n = %zu elements per array, median of %d runs after %d warm-ups\n", n, reps, warm);
  std::vector<row> rows;
  bool all_ok = true;
  auto check = [&](const char* name, bool good) {
    if (!good) std::printf("# MISMATCH: %s differs from the host element functions\n", name);
    all_ok &= good;
    return good;
  };

  {  // the ceiling: 1 GiB device-to-device, and the same bytes through a 16-byte copy kernel
    const std::size_t cn = std::size_t{1} << 28;
    buffer<float> a(cn), b(cn);
    a.random(1);
    rows.push_back(
        {"memcpy D2D (1 GiB)", 2.0 * cn * 4,
         median_us(
             reps, warm,
             [&] { ok(cudaMemcpyAsync(b.p, a.p, cn * 4, cudaMemcpyDeviceToDevice), "memcpy"); }),
         true});
    rows.push_back({"copy kernel, 16 B (1 GiB)", 2.0 * cn * 4,
                    median_us(reps, warm,
                              [&] {
                                copy_kernel<float>
                                    <<<kc::detail::grid_for(cn / 4), 256>>>(a.p, b.p, cn);
                              }),
                    same(a.get(), b.get())});
  }
  auto combine_rows = [&](auto zero, const char* tname) {
    using T = decltype(zero);
    buffer<T> a(n), b(n), out(n);
    a.random(2);
    b.random(3);
    out.poison();
    kc::combine(ringzero::op::sum, a.p, b.p, out.p, n);
    ok(cudaDeviceSynchronize(), "combine");
    const auto ha = a.get(), hb = b.get();
    std::vector<T> ref(n);
    ringzero::reduction::combine(ringzero::op::sum, ha.data(), hb.data(), ref.data(), n);
    const std::string name = std::string("combine sum ") + tname;
    const bool good = check(name.c_str(), same(ref, out.get()));
    rows.push_back(
        {name, 3.0 * n * sizeof(T),
         median_us(reps, warm, [&] { kc::combine(ringzero::op::sum, a.p, b.p, out.p, n); }), good});
  };
  combine_rows(float{}, "float");
  combine_rows(bfloat16{}, "bfloat16");
  {
    buffer<float> a(n);
    a.random(4);
    rows.push_back({"finish_avg float (in place)", 2.0 * n * 4,
                    median_us(reps, warm, [&] { kc::finish_avg(a.p, n, 3); }), true});
  }
  auto adamw_rows = [&](auto zero, const char* tname, int segments) {
    using P = decltype(zero);
    buffer<P> g(n), param(n);
    buffer<float> master(n), m(n), v(n);
    g.random(5, 4.0f);
    master.random(6);
    m.random(7, 1e-2f);
    v.random(8, 1e-3f, true);
    param.poison();
    std::vector<kc::optimizer_segment<P>> segs;
    // Tensors laid end to end in flat buffers, at odd offsets (the first few elements of each
    // take the scalar path).
    auto bound = [&](int s) { return n * static_cast<std::size_t>(s) / segments; };
    for (int s = 0; s < segments; ++s) {
      const std::size_t b = bound(s), e = bound(s + 1);
      segs.push_back({g.p + b, master.p + b, m.p + b, v.p + b,
                      std::is_same_v<P, float> ? nullptr : param.p + b, e - b, s % 2 == 0});
    }
    k::optimizer_constants c;
    c.grad_scale = 0.5f;
    c.lr = 1e-3f;
    c.beta1 = 0.9f;
    c.beta2 = 0.999f;
    c.eps = 1e-8f;
    c.step_size = static_cast<float>(1e-3 / (1 - std::pow(0.9, 10.0)));
    c.inv_bias2 = static_cast<float>(1 / (1 - std::pow(0.999, 10.0)));
    c.weight_decay = 0.01f;
    auto hg = g.get();
    auto hmaster = master.get(), hm = m.get(), hv = v.get();
    std::vector<P> hparam(n);
    kc::optimizer_step<ringzero::zero::adamw_rule, P>(segs, c);
    ok(cudaDeviceSynchronize(), "optimizer_step");
    for (int s = 0; s < segments; ++s) {
      const std::size_t b = bound(s), e = bound(s + 1);
      const float keep = k::adamw_keep(c, s % 2 == 0);
      for (std::size_t i = b; i < e; ++i) {
        const float p = k::adamw(k::to_float(hg[i]), hmaster[i], hm[i], hv[i], c, keep);
        if constexpr (!std::is_same_v<P, float>) hparam[i] = k::from_float<P>(p);
      }
    }
    const std::string name = std::string("adamw ") + tname + (segments > 1 ? ", " : "") +
                             (segments > 1 ? std::to_string(segments) + " segments" : "");
    bool good = same(hmaster, master.get()) && same(hm, m.get()) && same(hv, v.get());
    if constexpr (!std::is_same_v<P, float>) good = good && same(hparam, param.get());
    check(name.c_str(), good);
    const double bytes =
        static_cast<double>(n) * (std::is_same_v<P, float> ? 28.0 : 24.0 + 2.0 * sizeof(P));
    rows.push_back(
        {name, bytes,
         median_us(reps, warm, [&] { kc::optimizer_step<ringzero::zero::adamw_rule, P>(segs, c); }),
         good});
    if (segments == 1) {
      const double sbytes =
          static_cast<double>(n) * (std::is_same_v<P, float> ? 20.0 : 16.0 + 2.0 * sizeof(P));
      rows.push_back(
          {std::string("sgd ") + tname, sbytes,
           median_us(reps, warm, [&] { kc::optimizer_step<ringzero::zero::sgd_rule, P>(segs, c); }),
           false});
    }
  };
  adamw_rows(float{}, "float", 1);
  adamw_rows(bfloat16{}, "bfloat16", 1);
  adamw_rows(float16{}, "float16", 1);
  adamw_rows(bfloat16{}, "bfloat16", 1000);
  {
    buffer<bfloat16> dst(n);
    buffer<float> src(n);
    dst.random(9);
    src.random(10);
    const auto hd = dst.get();
    const auto hs = src.get();
    kc::accumulate(dst.p, src.p, n, false);
    ok(cudaDeviceSynchronize(), "accumulate");
    std::vector<bfloat16> ref(n);
    for (std::size_t i = 0; i < n; ++i) ref[i] = k::accumulate<bfloat16>(hd[i], hs[i], false);
    const bool good = check("accumulate", same(ref, dst.get()));
    rows.push_back({"accumulate bfloat16 += float", 8.0 * n,
                    median_us(reps, warm, [&] { kc::accumulate(dst.p, src.p, n, false); }), good});
  }
  {
    buffer<bfloat16> g(n);
    g.random(11, 3.0f);
    kc::grad_stats_accumulator acc;
    acc.reset();
    acc.add(g.p, n, 0.25f);
    const auto r = acc.read();
    const auto hg = g.get();
    double ref = 0;
    for (auto x : hg) {
      const double f = k::unscaled(x, 0.25f);
      ref += f * f;
    }
    const bool good =
        check("grad stats", r.nonfinite == 0 && std::fabs(r.sumsq - ref) <= n * 0x1p-52 * ref);
    rows.push_back({"grad stats bfloat16", 2.0 * n,
                    median_us(reps, warm, [&] { acc.add(g.p, n, 0.25f); }), good});
  }
  {
    buffer<float> g(n);
    g.random(12, 3.0f);
    kc::grad_stats_accumulator acc;
    acc.reset();
    acc.add(g.p, n, 0.25f);
    const auto r = acc.read();
    const auto hg = g.get();
    double ref = 0;
    for (auto x : hg) {
      const double f = k::unscaled(x, 0.25f);
      ref += f * f;
    }
    const bool good = check("grad stats float",
                            r.nonfinite == 0 && std::fabs(r.sumsq - ref) <= n * 0x1p-52 * ref);
    rows.push_back({"grad stats float", 4.0 * n,
                    median_us(reps, warm, [&] { acc.add(g.p, n, 0.25f); }), good});
  }
  const double copy_gbs = rows[0].bytes / rows[0].us * 1e-3;
  std::printf("%-34s %12s %10s %9s %8s %8s\n", "kernel", "bytes", "time(us)", "GB/s", "of copy",
              "checked");
  for (const auto& r : rows) {
    const double gbs = r.bytes / r.us * 1e-3;
    std::printf("%-34s %12.0f %10.1f %9.1f %7.1f%% %8s\n", r.name.c_str(), r.bytes, r.us, gbs,
                100.0 * gbs / copy_gbs, r.checked ? "yes" : "-");
  }
  return all_ok ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "ringzero-bench-kernels: %s\n", e.what());
  return 2;
}
