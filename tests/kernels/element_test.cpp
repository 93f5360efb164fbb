// The kernels' per-element functions on the host, against the host code they must reproduce:
// reduce/cpu.hpp for reductions and the sharder's optimizer for accumulation, gradient statistics,
// AdamW and SGD. Bitwise, except the sum of squares in a different order (the GPU's), which
// must stay within the reassociation bound.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernel_cases.hpp"
#include "ringzero/kernels/optimizer.hpp"
#include "ringzero/kernels/reduce.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/zero/optimizer_math.hpp"

using namespace kernel_cases;
using ringzero::op;
namespace k = ringzero::kernels;
namespace zd = sharder_ref;

namespace {

template <class T>
std::size_t count_different(const std::vector<T>& a, const std::vector<T>& b) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < a.size(); ++i) bad += same_bits(a[i], b[i]) ? 0 : 1;
  return bad;
}

template <class F>
void for_each_param_type(F&& f) {
  f(float{});
  f(float16{});
  f(bfloat16{});
}

}  // namespace

TEST_CASE("combine and finish_avg match reduce/cpu.hpp bitwise for every type and op") {
  std::mt19937_64 rng(12);
  for (const auto t : ringzero::all_dtypes) {
    ringzero::visit_dtype(t, [&](auto zero) {
      using T = decltype(zero);
      const std::size_t n = 4099;
      const auto a = values<T>(rng, n);
      const auto b = values<T>(rng, n);
      for (const op o : ringzero::all_ops) {
        INFO(ringzero::dtype_name(t), " ", ringzero::op_name(o));
        std::vector<T> ref(n), got(n);
        ringzero::reduction::combine(o, a.data(), b.data(), ref.data(), n);
        element_combine(o, a.data(), b.data(), got.data(), n);
        CHECK(count_different(ref, got) == 0);
      }
      for (const int ranks : {1, 2, 3, 7, 128, 1000}) {
        INFO(ringzero::dtype_name(t), " avg over ", ranks);
        std::vector<T> ref = a, got(n);
        ringzero::reduction::finish_avg(ref.data(), n, ranks);
        for (std::size_t i = 0; i < n; ++i) got[i] = ranks == 1 ? a[i] : k::finish_avg(a[i], ranks);
        CHECK(count_different(ref, got) == 0);
      }
    });
  }
}

TEST_CASE(
    "16-bit conversions agree with types.hpp on every half and bfloat16 and on random floats") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto h = float16::from_bits(static_cast<std::uint16_t>(b));
    const auto f = bfloat16::from_bits(static_cast<std::uint16_t>(b));
    REQUIRE(std::bit_cast<std::uint32_t>(k::to_float(h)) ==
            std::bit_cast<std::uint32_t>(static_cast<float>(h)));
    REQUIRE(std::bit_cast<std::uint32_t>(k::to_float(f)) ==
            std::bit_cast<std::uint32_t>(static_cast<float>(f)));
  }
  std::mt19937_64 rng(13);
  for (int i = 0; i < 200000; ++i) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
    REQUIRE(k::from_float<float16>(x).bits == float16(x).bits);
    REQUIRE(k::from_float<bfloat16>(x).bits == bfloat16(x).bits);
  }
}

TEST_CASE("accumulate matches the sharder's bitwise for P and fp32 sources") {
  std::mt19937_64 rng(14);
  for_each_param_type([&](auto pz) {
    using P = decltype(pz);
    auto run = [&](auto sz) {
      using S = decltype(sz);
      const std::size_t n = 3001;
      const auto src = values<S>(rng, n);
      const auto start = values<P>(rng, n);
      for (const bool first : {true, false})
        for (const float scale : {1.0f, 0.125f, 1.0f / 3.0f}) {
          INFO(ringzero::dtype_name(ringzero::dtype_of<P>()), " from ",
               ringzero::dtype_name(ringzero::dtype_of<S>()), first ? " first" : " later",
               " scale ", scale);
          std::vector<P> ref = start, got = start;
          zd::accumulate(ref.data(), src.data(), n, first, scale);
          for (std::size_t i = 0; i < n; ++i)
            got[i] = k::accumulate<P>(got[i], src[i], first, scale);
          CHECK(count_different(ref, got) == 0);
        }
    };
    run(P{});
    if constexpr (!std::is_same_v<P, float>) run(float{});
  });
}

TEST_CASE("gradient statistics: the same terms, bitwise in order and within the bound in a tree") {
  std::mt19937_64 rng(15);
  for_each_param_type([&](auto pz) {
    using P = decltype(pz);
    INFO(ringzero::dtype_name(ringzero::dtype_of<P>()));
    const std::size_t n = 100003;
    for (const bool finite : {true, false}) {
      const auto g = values<P>(rng, n, finite);
      const float scale = 0.37f;
      double ref = 0.0;
      bool ref_bad = false;
      zd::grad_stats(g.data(), n, scale, ref, ref_bad);
      double seq = 0.0;
      bool bad = false;
      std::vector<double> terms(n);
      for (std::size_t i = 0; i < n; ++i) {
        const float f = k::unscaled(g[i], scale);
        bad |= !k::is_finite(f);
        terms[i] = static_cast<double>(f) * static_cast<double>(f);
        seq += terms[i];
      }
      CHECK(bad == ref_bad);
      CHECK(bad == !finite);
      if (!finite) continue;
      CHECK(std::bit_cast<std::uint64_t>(seq) == std::bit_cast<std::uint64_t>(ref));
      // A GPU-like order: strided per-thread sums, then a pairwise tree. Every term is
      // positive, so any order is within n * 2^-53 of the exact sum, relative.
      const std::size_t threads = std::size_t{1} << 12;
      std::vector<double> part(threads, 0.0);
      for (std::size_t i = 0; i < n; ++i) part[i % threads] += terms[i];
      for (std::size_t w = threads / 2; w > 0; w /= 2)
        for (std::size_t i = 0; i < w; ++i) part[i] += part[i + w];
      const double bound = static_cast<double>(n) * std::ldexp(1.0, -53) * ref;
      CHECK(std::fabs(part[0] - ref) <= 2 * bound);
    }
  });
}

TEST_CASE("AdamW and SGD steps match the sharder's bitwise") {
  std::mt19937_64 rng(16);
  for_each_param_type([&](auto pz) {
    using P = decltype(pz);
    for (int trial = 0; trial < 6; ++trial) {
      const bool nesterov = trial % 2 == 1;
      const bool decay = trial % 3 != 0;
      const bool finite = trial != 5;
      const auto c = random_constants(rng, nesterov);
      const std::size_t n = 2053;
      INFO(ringzero::dtype_name(ringzero::dtype_of<P>()), " trial ", trial);
      {
        shard<P> ref(rng, n, finite);
        shard<P> got = ref;
        zd::adamw(ref.grad.data(), ref.master.data(), ref.m.data(), ref.v.data(), ref.param.data(),
                  n, c.host, decay);
        const float keep = k::adamw_keep(c.kernel, decay);
        for (std::size_t i = 0; i < n; ++i) {
          const float p =
              k::adamw(k::to_float(got.grad[i]), got.master[i], got.m[i], got.v[i], c.kernel, keep);
          if constexpr (!std::is_same_v<P, float>) got.param[i] = k::from_float<P>(p);
        }
        CHECK(count_different(ref.master, got.master) == 0);
        CHECK(count_different(ref.m, got.m) == 0);
        CHECK(count_different(ref.v, got.v) == 0);
        CHECK(count_different(ref.param, got.param) == 0);
      }
      {
        shard<P> ref(rng, n, finite);
        shard<P> got = ref;
        zd::sgd(ref.grad.data(), ref.master.data(), ref.m.data(), ref.param.data(), n, c.host,
                decay);
        const float wd = decay ? c.kernel.weight_decay : 0.0f;
        for (std::size_t i = 0; i < n; ++i) {
          const float p = k::sgd(k::to_float(got.grad[i]), got.master[i], got.m[i], c.kernel, wd);
          if constexpr (!std::is_same_v<P, float>) got.param[i] = k::from_float<P>(p);
        }
        CHECK(count_different(ref.master, got.master) == 0);
        CHECK(count_different(ref.m, got.m) == 0);
        CHECK(count_different(ref.param, got.param) == 0);
      }
    }
  });
}

TEST_CASE("segment_of finds where a run of chunks starts, as the multi-tensor kernels need") {
  // Segments of 3, 1, 4 and 2 chunks: chunk c lies in the last segment starting at or before c.
  const std::size_t first_chunk[] = {0, 3, 4, 8, 10};
  const int expected[] = {0, 0, 0, 1, 2, 2, 2, 2, 3, 3};
  for (std::size_t c = 0; c < 10; ++c) {
    CAPTURE(c);
    CHECK(k::segment_of(first_chunk, 4, c) == expected[c]);
  }
  const std::size_t one[] = {0, 5};
  CHECK(k::segment_of(one, 1, 4) == 0);
  // Empty segments (a repeated start) are skipped: a chunk belongs to the last of them.
  const std::size_t empty[] = {0, 2, 2, 3};
  CHECK(k::segment_of(empty, 3, 2) == 2);
}
