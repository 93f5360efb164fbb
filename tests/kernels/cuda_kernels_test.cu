// The CUDA kernels against the host: reductions bitwise against reduce/cpu.hpp for every type and
// op, the optimizer step bitwise against the sharder's, the gradient statistics within the
// reassociation bound (and identical from run to run). Sizes cover 0, 1, primes, several
// chunks and misaligned pointers; outputs are poisoned first and the bytes past the end checked.
// Without a GPU every case prints "skipped: no CUDA device" and CTest reports a skip.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernel_cases.hpp"
#include "ringzero/kernels/cuda/optimizer.cuh"
#include "ringzero/kernels/cuda/quantize.cuh"
#include "ringzero/kernels/cuda/reduce.cuh"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/reduce/quantize.hpp"
#include "ringzero/zero/optimizer_table.hpp"

using namespace kernel_cases;
using ringzero::op;
namespace k = ringzero::kernels;
namespace kc = ringzero::kernels::cuda;
namespace zd = sharder_ref;

namespace {

bool have_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    MESSAGE("skipped: no CUDA device");
    return false;
  }
  return true;
}

void ok(cudaError_t e) {
  REQUIRE_MESSAGE(e == cudaSuccess, cudaGetErrorString(e));
}

constexpr unsigned char poison = 0xA5;
constexpr std::size_t guard = 64;  // bytes checked past the end of every output

/// A device copy of `n` Ts starting `offset` elements into a 256-byte-aligned allocation, so a
/// nonzero offset gives a pointer that is not 16-byte aligned; the rest is poisoned.
template <class T>
class dev {
 public:
  dev(std::size_t n, std::size_t offset = 0) : n_(n), off_(offset) {
    bytes_ = (n + offset) * sizeof(T) + guard;
    ok(cudaMalloc(&base_, bytes_));
    ok(cudaMemset(base_, poison, bytes_));
  }
  dev(const std::vector<T>& v, std::size_t offset = 0) : dev(v.size(), offset) { upload(v); }
  dev(const dev&) = delete;
  ~dev() { cudaFree(base_); }
  T* get() const { return reinterpret_cast<T*>(static_cast<char*>(base_)) + off_; }
  void upload(const std::vector<T>& v) {
    ok(cudaMemcpy(get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> v(n_);
    ok(cudaMemcpy(v.data(), get(), n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
  /// Whether the guard bytes past the last element are still poison.
  bool tail_intact() const {
    std::vector<unsigned char> t(guard);
    ok(cudaMemcpy(t.data(), reinterpret_cast<const char*>(get() + n_), guard,
                  cudaMemcpyDeviceToHost));
    for (auto c : t)
      if (c != poison) return false;
    return true;
  }

 private:
  void* base_ = nullptr;
  std::size_t n_, off_, bytes_;
};

template <class T>
std::size_t count_different(const std::vector<T>& a, const std::vector<T>& b) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < a.size(); ++i) bad += same_bits(a[i], b[i]) ? 0 : 1;
  return bad;
}

/// Same bits, or both NaN: a NaN computed on the GPU carries the GPU's canonical payload.
template <class T>
std::size_t count_different_nan_equal(const std::vector<T>& a, const std::vector<T>& b) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = static_cast<double>(static_cast<float>(a[i]));
    const double y = static_cast<double>(static_cast<float>(b[i]));
    bad += same_bits(a[i], b[i]) || (std::isnan(x) && std::isnan(y)) ? 0 : 1;
  }
  return bad;
}

/// Floating sum, product and average of a NaN give a NaN whose payload is the hardware's
/// choice (x86 keeps the operand's, and makes its own default NaN negative); the GPU's may
/// differ, so for those the NaNs are compared as NaNs and every other element bitwise.
template <class T>
bool arithmetic_nan_payloads_differ(op o) {
  return ringzero::is_floating_element_v<T> && o != op::min && o != op::max;
}

/// Says how many results differ only in a NaN's bits, with the first such element.
template <class T>
void report_nan_payloads(const std::vector<T>& a, const std::vector<T>& b,
                         const std::vector<T>& ref, const std::vector<T>& got) {
  std::size_t count = 0, first = 0;
  for (std::size_t i = 0; i < ref.size(); ++i)
    if (!same_bits(ref[i], got[i]) && count++ == 0) first = i;
  if (count == 0) return;
  auto hex = [](const T& x) {
    std::uint64_t u = 0;
    std::memcpy(&u, static_cast<const void*>(&x), sizeof(T));
    char buf[24];
    std::snprintf(buf, sizeof buf, "%llx", static_cast<unsigned long long>(u));
    return std::string(buf);
  };
  MESSAGE(count, " NaN results with other bits than the host's; first at ", first,
          ": a=", hex(a[first]), " b=", hex(b[first]), " host=", hex(ref[first]),
          " device=", hex(got[first]));
}

const std::size_t sizes[] = {0, 1, 7, 8, 17, 4099, 65536 + 13, 1000003};

__global__ void convert_kernel(const float* in, ringzero::float16* h, ringzero::bfloat16* b,
                               std::size_t n) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    h[i] = k::from_float<ringzero::float16>(in[i]);
    b[i] = k::from_float<ringzero::bfloat16>(in[i]);
  }
}

__global__ void widen_kernel(float* h, float* b) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 65536) {
    ringzero::float16 x;
    ringzero::bfloat16 y;
    x.bits = y.bits = static_cast<std::uint16_t>(i);
    h[i] = k::to_float(x);
    b[i] = k::to_float(y);
  }
}

}  // namespace

TEST_CASE("16-bit conversions on the device agree with types.hpp") {
  if (!have_device()) return;
  {
    dev<float> h(65536), b(65536);
    widen_kernel<<<256, 256>>>(h.get(), b.get());
    ok(cudaGetLastError());
    const auto hv = h.download(), bv = b.download();
    std::size_t bad = 0;
    for (std::uint32_t i = 0; i < 65536; ++i) {
      const auto bits = static_cast<std::uint16_t>(i);
      bad += same_bits(hv[i], static_cast<float>(ringzero::float16::from_bits(bits))) ? 0 : 1;
      bad += same_bits(bv[i], static_cast<float>(ringzero::bfloat16::from_bits(bits))) ? 0 : 1;
    }
    CHECK(bad == 0);
  }
  std::mt19937_64 rng(21);
  const std::size_t n = std::size_t{1} << 22;
  std::vector<float> in(n);
  for (auto& x : in) x = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
  // Every rounding boundary of both formats near 1, and the overflow thresholds.
  for (std::uint32_t i = 0; i < 65536; ++i) in[i] = std::bit_cast<float>(0x3f800000u + i * 2);
  in[0] = 65519.996f;
  in[1] = 65520.0f;
  in[2] = 3.3961775e38f;
  dev<float> d(in);
  dev<ringzero::float16> h(n);
  dev<ringzero::bfloat16> b(n);
  convert_kernel<<<1024, 256>>>(d.get(), h.get(), b.get(), n);
  ok(cudaGetLastError());
  const auto hv = h.download();
  const auto bv = b.download();
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    bad += hv[i].bits == ringzero::float16(in[i]).bits ? 0 : 1;
    bad += bv[i].bits == ringzero::bfloat16(in[i]).bits ? 0 : 1;
  }
  CHECK(bad == 0);
}

TEST_CASE("combine and finish_avg on the device match reduce/cpu.hpp bitwise") {
  if (!have_device()) return;
  std::mt19937_64 rng(22);
  for (const auto t : ringzero::all_dtypes) {
    ringzero::visit_dtype(t, [&](auto zero) {
      using T = decltype(zero);
      for (const std::size_t n : sizes) {
        for (const std::size_t offset : {std::size_t{0}, std::size_t{1}}) {
          const auto a = values<T>(rng, n);
          const auto b = values<T>(rng, n);
          for (const op o : ringzero::all_ops) {
            INFO(ringzero::dtype_name(t), " ", ringzero::op_name(o), " n=", n, " offset=", offset);
            std::vector<T> ref(n);
            ringzero::reduction::combine(o, a.data(), b.data(), ref.data(), n);
            dev<T> da(a, offset), db(b, 0), dout(n, offset);
            kc::combine(o, da.get(), db.get(), dout.get(), n);
            ok(cudaDeviceSynchronize());
            const auto got = dout.download();
            CHECK(count_different_nan_equal(ref, got) == 0);
            if (arithmetic_nan_payloads_differ<T>(o))
              report_nan_payloads(a, b, ref, got);
            else
              CHECK(count_different(ref, got) == 0);
            CHECK(dout.tail_intact());
            kc::combine(o, da.get(), db.get(), da.get(), n);  // in place
            ok(cudaDeviceSynchronize());
            CHECK(count_different_nan_equal(ref, da.download()) == 0);
            CHECK(da.tail_intact());
          }
          for (const int ranks : {2, 3, 7, 1000}) {
            INFO(ringzero::dtype_name(t), " avg over ", ranks, " n=", n, " offset=", offset);
            std::vector<T> ref = a;
            ringzero::reduction::finish_avg(ref.data(), n, ranks);
            dev<T> d(a, offset);
            kc::finish_avg(d.get(), n, ranks);
            ok(cudaDeviceSynchronize());
            const auto got = d.download();
            CHECK(count_different_nan_equal(ref, got) == 0);
            if (arithmetic_nan_payloads_differ<T>(op::avg))
              report_nan_payloads(a, a, ref, got);
            else
              CHECK(count_different(ref, got) == 0);
            CHECK(d.tail_intact());
          }
        }
      }
    });
  }
  CHECK_THROWS_AS(kc::combine<float>(op::sum, nullptr, nullptr, nullptr, 3),
                  ringzero::invalid_argument);
  CHECK_THROWS_AS(kc::finish_avg<float>(nullptr, 3, 0), ringzero::invalid_argument);
}

template <class F>
void for_each_param_type(F&& f) {
  f(float{});
  f(ringzero::float16{});
  f(ringzero::bfloat16{});
}

TEST_CASE("accumulate on the device matches the sharder's bitwise") {
  if (!have_device()) return;
  std::mt19937_64 rng(23);
  for_each_param_type([&](auto pz) {
    using P = decltype(pz);
    auto run = [&](auto sz) {
      using S = decltype(sz);
      for (const std::size_t n : sizes) {
        for (const std::size_t offset : {std::size_t{0}, std::size_t{3}}) {
          const auto src = values<S>(rng, n);
          const auto start = values<P>(rng, n);
          for (const bool first : {true, false}) {
            INFO(ringzero::dtype_name(ringzero::dtype_of<P>()), " from ",
                 ringzero::dtype_name(ringzero::dtype_of<S>()), " n=", n, " offset=", offset,
                 first ? " first" : " later");
            std::vector<P> ref = start;
            zd::accumulate(ref.data(), src.data(), n, first);
            dev<P> d(start, offset);
            dev<S> s(src, offset);
            kc::accumulate(d.get(), s.get(), n, first);
            ok(cudaDeviceSynchronize());
            const auto got = d.download();
            CHECK(count_different_nan_equal(ref, got) == 0);
            if (first)
              CHECK(count_different(ref, got) == 0);  // a conversion keeps NaN payloads
            else
              report_nan_payloads(start, start, ref, got);
            CHECK(d.tail_intact());
          }
        }
      }
    };
    run(P{});
    if constexpr (!std::is_same_v<P, float>) run(float{});
  });
}

TEST_CASE("gradient statistics on the device: the host's flag, its sum within the bound, stable") {
  if (!have_device()) return;
  std::mt19937_64 rng(24);
  for_each_param_type([&](auto pz) {
    using P = decltype(pz);
    kc::grad_stats_accumulator acc;
    for (const std::size_t n : sizes) {
      for (const bool finite : {true, false}) {
        INFO(ringzero::dtype_name(ringzero::dtype_of<P>()), " n=", n, finite ? "" : " non-finite");
        const auto g = values<P>(rng, n, finite);
        const float scale = 0.61f;
        double ref = 0.0;
        bool ref_bad = false;
        zd::grad_stats(g.data(), n, scale, ref, ref_bad);
        dev<P> d(g, n % 2);
        acc.reset();
        acc.add(d.get(), n, scale);
        const kc::grad_stats r1 = acc.read();
        CHECK((r1.nonfinite != 0) == ref_bad);
        if (ref_bad) continue;
        CHECK(std::fabs(r1.sumsq - ref) <= static_cast<double>(n) * std::ldexp(1.0, -52) * ref);
        acc.reset();
        acc.add(d.get(), n, scale);
        const kc::grad_stats r2 = acc.read();
        CHECK(std::bit_cast<std::uint64_t>(r1.sumsq) == std::bit_cast<std::uint64_t>(r2.sumsq));
        // Without a reset, a second call adds to the first (the shard's segments, one by one).
        acc.add(d.get(), n, scale);
        CHECK(acc.read().sumsq == r1.sumsq + r1.sumsq);
      }
    }
  });
}

template <class P>
struct device_shard {
  dev<P> grad;
  dev<float> master, m, v;
  dev<P> param;
  device_shard(const shard<P>& s, std::size_t offset)
      : grad(s.grad, offset),
        master(s.master, offset),
        m(s.m, offset),
        v(s.v, offset),
        param(s.param, offset) {}
};

TEST_CASE("multi-tensor AdamW and SGD on the device match the sharder's bitwise") {
  if (!have_device()) return;
  std::mt19937_64 rng(25);
  for_each_param_type([&](auto pz) {
    using P = decltype(pz);
    for (const bool sgd : {false, true}) {
      for (int trial = 0; trial < 3; ++trial) {
        const bool finite = trial != 2;
        const auto c = random_constants(rng, trial == 1);
        // Every awkward size, some misaligned; 7 segments take the small batch, 40 the large,
        // 450 two large ones.
        std::vector<std::size_t> counts = {0, 1, 5, 8, 65536, 65536 * 2 + 3, 200003};
        const std::size_t segments = trial == 0 ? 40 : trial == 1 ? 7 : 450;
        while (counts.size() < segments) counts.push_back(1 + rng() % 5000);
        std::vector<shard<P>> host;
        std::vector<std::unique_ptr<device_shard<P>>> devs;
        std::vector<kc::optimizer_segment<P>> segs;
        for (std::size_t i = 0; i < counts.size(); ++i) {
          host.emplace_back(rng, counts[i], finite);
          devs.push_back(std::make_unique<device_shard<P>>(host.back(), i % 3 == 2 ? 1 : 0));
          auto& d = *devs.back();
          segs.push_back({d.grad.get(), d.master.get(), d.m.get(), d.v.get(),
                          std::is_same_v<P, float> ? nullptr : d.param.get(), counts[i],
                          i % 4 != 1});
        }
        if (sgd)
          kc::optimizer_step<ringzero::zero::sgd_rule, P>(segs, c.kernel);
        else
          kc::optimizer_step<ringzero::zero::adamw_rule, P>(segs, c.kernel);
        ok(cudaDeviceSynchronize());
        for (std::size_t i = 0; i < counts.size(); ++i) {
          INFO(ringzero::dtype_name(ringzero::dtype_of<P>()), sgd ? " sgd" : " adamw", " trial ",
               trial, " segment ", i, " of ", counts[i]);
          auto& h = host[i];
          const bool decay = i % 4 != 1;
          if (sgd)
            zd::sgd(h.grad.data(), h.master.data(), h.m.data(), h.param.data(), counts[i], c.host,
                    decay);
          else
            zd::adamw(h.grad.data(), h.master.data(), h.m.data(), h.v.data(), h.param.data(),
                      counts[i], c.host, decay);
          auto& d = *devs[i];
          if (finite) {
            CHECK(count_different(h.master, d.master.download()) == 0);
            CHECK(count_different(h.m, d.m.download()) == 0);
            CHECK(count_different(h.v, d.v.download()) == 0);
            if constexpr (!std::is_same_v<P, float>)
              CHECK(count_different(h.param, d.param.download()) == 0);
          } else {
            CHECK(count_different_nan_equal(h.master, d.master.download()) == 0);
            CHECK(count_different_nan_equal(h.m, d.m.download()) == 0);
            CHECK(count_different_nan_equal(h.v, d.v.download()) == 0);
            if constexpr (!std::is_same_v<P, float>)
              CHECK(count_different_nan_equal(h.param, d.param.download()) == 0);
          }
          CHECK(d.master.tail_intact());
          CHECK(d.m.tail_intact());
          CHECK(d.v.tail_intact());
          CHECK(d.param.tail_intact());
        }
      }
    }
  });
}

namespace {

// An optimizer that exists only in this test: one rule, its descriptor and per-element
// arithmetic in RINGZERO_HD functions (the _rn operations of kernels/element.hpp, so the device
// rounds as the host does). The kernel takes it as it takes the built-in rules.
struct lion_rule {
  static constexpr ringzero::zero::optimizer_descriptor descriptor{
      static_cast<ringzero::zero::optimizer_kind>(200), "lion", "", 1, {"exp_avg", ""}};
  RINGZERO_HD static float factor(const k::optimizer_constants& c, bool decay) noexcept {
    return decay ? k::sub(1.0f, k::mul(c.lr, c.weight_decay)) : 1.0f;
  }
  RINGZERO_HD static float step(float g, float& w, float& m, float&,
                                const k::optimizer_constants& c, float keep) noexcept {
    const float gs = k::mul(g, c.grad_scale);
    const float u = k::add(k::mul(c.beta1, m), k::mul(k::sub(1.0f, c.beta1), gs));
    w = k::sub(k::mul(w, keep), k::mul(c.lr, u > 0.0f ? 1.0f : (u < 0.0f ? -1.0f : 0.0f)));
    m = k::add(k::mul(c.beta2, m), k::mul(k::sub(1.0f, c.beta2), gs));
    return w;
  }
};
static_assert(ringzero::zero::optimizer_rule<lion_rule>);

}  // namespace

TEST_CASE("an optimizer rule added in one place runs on the device, bitwise as on the host") {
  if (!have_device()) return;
  std::mt19937_64 rng(41);
  const auto c = random_constants(rng, false);
  constexpr std::size_t n = 10007;
  std::vector<float> g(n), w(n), m(n);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (std::size_t i = 0; i < n; ++i) g[i] = u(rng), w[i] = u(rng), m[i] = u(rng) * 0.1f;
  dev<float> dg(g), dw(w, 1), dm(m);  // the master misaligned: the scalar head, then vectors
  const std::vector<kc::optimizer_segment<float>> segs{
      {dg.get(), dw.get(), dm.get(), nullptr, nullptr, n, true}};
  kc::optimizer_step<lion_rule, float>(segs, c.kernel);
  ok(cudaDeviceSynchronize());
  const float keep = lion_rule::factor(c.kernel, true);
  float scratch = 0.0f;
  for (std::size_t i = 0; i < n; ++i) lion_rule::step(g[i], w[i], m[i], scratch, c.kernel, keep);
  CHECK(count_different(w, dw.download()) == 0);
  CHECK(count_different(m, dm.download()) == 0);
  CHECK(dw.tail_intact());
  CHECK(dm.tail_intact());
}

TEST_CASE(
    "options::wire's encode, decode and accumulate on the device: the host's bytes and sums") {
  if (!have_device()) return;
  namespace qz = ringzero::quantize;
  using ringzero::wire_format;
  std::mt19937_64 rng(57);
  const float inf = std::numeric_limits<float>::infinity();
  for (const wire_format f : {wire_format::bf16, wire_format::int8, wire_format::int4})
    for (const std::size_t block : {std::size_t{1}, std::size_t{7}, std::size_t{256}})
      for (const std::size_t n : sizes) {
        if (n > 65536 + 13) continue;
        INFO(ringzero::wire_format_name(f), " block ", block, " n ", n);
        std::vector<float> x(n), y(n);
        std::uniform_real_distribution<float> u(-3.0f, 3.0f);
        for (std::size_t i = 0; i < n; ++i) {
          x[i] = i % 211 == 5 ? inf : (i % 223 == 9 ? std::nanf("") : u(rng));
          y[i] = i % 211 == 5 ? -inf : u(rng) * 0.01f;
        }
        const qz::segment_layout L{f, block, n};
        std::vector<std::uint8_t> hx(L.bytes()), hy(L.bytes());
        qz::encode(L, x.data(), hx.data());
        qz::encode(L, y.data(), hy.data());
        dev<float> dx(x), dy(y);
        dev<std::uint8_t> bx(L.bytes()), by(L.bytes());
        kc::encode(L, dx.get(), bx.get());
        kc::encode(L, dy.get(), by.get());
        ok(cudaDeviceSynchronize());
        CHECK(bx.download() == hx);
        CHECK(by.download() == hy);
        CHECK(bx.tail_intact());
        // bfloat16 elements, encoded from and decoded to.
        std::vector<ringzero::bfloat16> xb(x.begin(), x.end()), back(n);
        std::vector<std::uint8_t> hb(L.bytes());
        qz::encode(L, xb.data(), hb.data());
        dev<ringzero::bfloat16> dxb(xb), dback(n);
        kc::encode(L, dxb.get(), bx.get());
        kc::decode(L, bx.get(), dback.get(), n);
        ok(cudaDeviceSynchronize());
        CHECK(bx.download() == hb);
        qz::decode(L, hb.data(), back.data(), n);
        CHECK(count_different_nan_equal(back, dback.download()) == 0);
        // Sums of the two segments in float.
        std::vector<float> acc(n);
        qz::accumulate(L, hx.data(), acc.data(), true);
        qz::accumulate(L, hy.data(), acc.data(), false);
        dev<float> dacc(n);
        kc::encode(L, dx.get(), bx.get());  // x's bytes again (bx held xb's); by still y's
        kc::accumulate(L, bx.get(), dacc.get(), true);
        kc::accumulate(L, by.get(), dacc.get(), false);
        ok(cudaDeviceSynchronize());
        CHECK(count_different_nan_equal(acc, dacc.download()) == 0);
        CHECK(dacc.tail_intact());
      }
}
