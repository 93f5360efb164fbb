// The vector paths of the host reductions (reduce/simd.hpp, reduce/detail/x86.hpp) against the
// scalar loop, bit for bit: every element type and op, counts around the vector widths,
// unaligned starts, outputs aliasing either input, special values, and every 16-bit
// float value paired with 160 others. Paths this CPU cannot run are skipped with a message.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/reduce/simd.hpp"
#include "sanitized.hpp"

using ringzero::bfloat16;
using ringzero::float16;
using ringzero::op;
using ringzero::reduction::simd;
namespace reduction = ringzero::reduction;

namespace {

// Sanitized and unoptimised builds run the software 16-bit conversions of the scalar reference
// twenty to fifty times slower: there the exhaustive case pairs every value with the first 3
// special bit patterns only instead of 160 partners. That still runs every
// instruction of every path (the case before it covers NaNs on every path), and the optimised
// build checks the arithmetic in full.
#if defined(RINGZERO_TEST_SANITIZED) || !defined(__OPTIMIZE__)
constexpr std::size_t exhaustive_partners = 3;
#else
constexpr std::size_t exhaustive_partners = 160;
#endif

/// The vector paths this CPU runs; the others are reported once.
std::vector<simd> vector_paths() {
  std::vector<simd> paths;
  for (const simd s : {simd::avx2, simd::avx512}) {
    if (reduction::simd_supported(s))
      paths.push_back(s);
    else
      MESSAGE("skipping the ", reduction::simd_name(s), " path: this CPU or build cannot run it");
  }
  return paths;
}

template <class F>
void for_each_element(F&& f) {
  f(float{});
  f(double{});
  f(float16{});
  f(bfloat16{});
  f(std::int8_t{});
  f(std::uint8_t{});
  f(std::int32_t{});
  f(std::uint32_t{});
  f(std::int64_t{});
  f(std::uint64_t{});
}

template <class T>
std::string type_name() {
  return std::string(ringzero::dtype_name(ringzero::dtype_of<T>()));
}

/// Bit patterns that vector code gets wrong most easily, for T's width.
template <class T>
std::vector<T> specials() {
  std::vector<T> v;
  const auto bits = [&](auto b) { v.push_back(std::bit_cast<T>(b)); };
  if constexpr (std::is_same_v<T, float>) {
    for (const std::uint32_t b : {0x00000000u,
                                  0x80000000u,
                                  0x7f800000u,
                                  0xff800000u,
                                  0x7fc00000u,
                                  0xffc00001u,
                                  0x7f800001u /* signalling */,
                                  0x7fa5a5a5u,
                                  0x00000001u,
                                  0x807fffffu,
                                  0x00800000u,
                                  0x7f7fffffu,
                                  0xff7fffffu,
                                  0x3f800000u,
                                  0x3f800001u,
                                  0x33800000u,
                                  0x477fe000u,
                                  0x477ff000u,
                                  0x38800000u,
                                  0x387fc000u,
                                  0x3f808000u,
                                  0x3f818000u})
      bits(b);
  } else if constexpr (std::is_same_v<T, double>) {
    for (const std::uint64_t b :
         {0x0ull, 0x8000000000000000ull, 0x7ff0000000000000ull, 0xfff0000000000000ull,
          0x7ff8000000000000ull, 0xfff8000000000001ull, 0x7ff0000000000001ull, 0x1ull,
          0x800fffffffffffffull, 0x7fefffffffffffffull, 0x3ff0000000000000ull})
      bits(b);
  } else if constexpr (sizeof(T) == 2) {
    for (const std::uint16_t b :
         {0x0000, 0x8000, 0x7c00, 0xfc00, 0x7e00, 0xfe01, 0x7c01, 0x7f80, 0xff80, 0x7fc0, 0x7f81,
          0x0001, 0x8001, 0x03ff, 0x007f, 0x7bff, 0x7f7f, 0x3c00, 0x3f80, 0x3c01, 0xbc00})
      bits(static_cast<std::uint16_t>(b));
  } else {
    using L = std::numeric_limits<T>;
    for (const T x : {T{0}, T{1}, static_cast<T>(-1), L::min(), L::max(),
                      static_cast<T>(L::min() + 1), static_cast<T>(L::max() - 1), T{2}, T{16}})
      v.push_back(x);
  }
  return v;
}

/// n random bit patterns with a special value at about every fourth position.
template <class T>
std::vector<T> random_elements(std::size_t n, std::mt19937_64& rng) {
  std::vector<T> v(n);
  std::vector<unsigned char> raw(n * sizeof(T));
  for (auto& c : raw) c = static_cast<unsigned char>(rng());
  if (n != 0) std::memcpy(v.data(), raw.data(), raw.size());
  const std::vector<T> sp = specials<T>();
  for (std::size_t i = 0; i < n; ++i)
    if (rng() % 4 == 0) v[i] = sp[rng() % sp.size()];
  return v;
}

template <class T>
bool same_bits(const std::vector<T>& x, const std::vector<T>& y) {
  return x.size() == y.size() &&
         (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0);
}

/// The first element where two results differ, for the failure message.
template <class T>
std::string first_difference(const std::vector<T>& got, const std::vector<T>& want,
                             const std::vector<T>& a, const std::vector<T>& b) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) == 0) continue;
    const auto hex = [](const T& x) {
      std::uint64_t u = 0;
      std::memcpy(&u, &x, sizeof(T));
      char buf[24];
      std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(u));
      return std::string(buf);
    };
    return "element " + std::to_string(i) + ": a " + hex(a[i]) + " b " + hex(b[i]) + " gave " +
           hex(got[i]) + ", scalar " + hex(want[i]);
  }
  return "none";
}

enum class alias { none, out_is_a, out_is_b };

/// Copies of the inputs, an output and the result, reused from call to call (and copied with
/// memcpy) so that unoptimised builds do not spend their time copying element by element.
template <class T>
struct buffers {
  std::vector<T> x, y, out, result;
};

template <class T>
void copy_into(std::vector<T>& dst, const T* src, std::size_t n) {
  dst.resize(n);
  if (n != 0) std::memcpy(dst.data(), src, n * sizeof(T));
}

/// combine (and finish_avg for avg) on `path` over a[off..off+n) and b[off..off+n).
template <class T>
const std::vector<T>& run(buffers<T>& w, simd path, op o, const std::vector<T>& a,
                          const std::vector<T>& b, std::size_t off, std::size_t n, alias al,
                          int ranks) {
  copy_into(w.x, a.data(), a.size());
  copy_into(w.y, b.data(), b.size());
  w.out.resize(a.size());
  T* dst = al == alias::out_is_a ? w.x.data() : al == alias::out_is_b ? w.y.data() : w.out.data();
  reduction::combine(path, o, w.x.data() + off, w.y.data() + off, dst + off, n);
  if (o == op::avg) reduction::finish_avg(path, dst + off, n, ranks);
  copy_into(w.result, dst + off, n);
  return w.result;
}

}  // namespace

TEST_CASE("RINGZERO_SIMD names a path the CPU can run, or fails naming the value") {
  const auto all = [](simd) { return true; };
  const auto avx2_only = [](simd s) { return s != simd::avx512; };
  const auto scalar_only = [](simd s) { return s == simd::scalar; };
  using reduction::detail::choose_simd;
  CHECK(choose_simd(std::nullopt, all) == simd::avx512);
  CHECK(choose_simd(std::nullopt, avx2_only) == simd::avx2);
  CHECK(choose_simd(std::nullopt, scalar_only) == simd::scalar);
  CHECK(choose_simd("scalar", scalar_only) == simd::scalar);
  CHECK(choose_simd("avx2", all) == simd::avx2);
  CHECK_THROWS_WITH_AS(static_cast<void>(choose_simd("avx512", avx2_only)),
                       doctest::Contains("RINGZERO_SIMD=avx512"), ringzero::invalid_argument);
  CHECK_THROWS_WITH_AS(static_cast<void>(choose_simd("sse9", all)), doctest::Contains("'sse9'"),
                       ringzero::invalid_argument);
  CHECK(reduction::simd_supported(simd::scalar));
  float x = 1, y = 2, out = 0;
  CHECK_THROWS_WITH_AS(reduction::combine(static_cast<simd>(7), op::sum, &x, &y, &out, 1),
                       doctest::Contains("reduction path ? (code 7)"), ringzero::invalid_argument);
  CHECK_THROWS_AS(reduction::finish_avg(static_cast<simd>(7), &out, 1, 2),
                  ringzero::invalid_argument);
  CHECK(reduction::simd_supported(reduction::active_simd()));
  MESSAGE("active reduction path: ", reduction::simd_name(reduction::active_simd()));
}

TEST_CASE("every vector path gives the scalar bits for every type, op, count, offset and alias") {
  const auto paths = vector_paths();
  std::mt19937_64 rng(11);
  for_each_element([&](auto zero) {
    using T = decltype(zero);
    buffers<T> scalar_bufs, path_bufs;
    for (const std::size_t n : {0, 1, 7, 31, 1021, 65537}) {
      const std::vector<T> a = random_elements<T>(n + 3, rng);
      const std::vector<T> b = random_elements<T>(n + 3, rng);
      for (const op o : ringzero::all_ops) {
        const int ranks = 2 + static_cast<int>(n % 5);
        for (std::size_t off = 0; off <= 3; ++off) {
          const std::vector<T>& want =
              run(scalar_bufs, simd::scalar, o, a, b, off, n, alias::none, ranks);
          for (const simd path : paths) {
            for (const alias al : {alias::none, alias::out_is_a, alias::out_is_b}) {
              const std::vector<T>& got = run(path_bufs, path, o, a, b, off, n, al, ranks);
              INFO(reduction::simd_name(path), " ", type_name<T>(), " ", ringzero::op_name(o),
                   " n ", n, " offset ", off, " alias ", static_cast<int>(al), ": ",
                   first_difference(got, want, std::vector<T>(a.begin() + off, a.end()),
                                    std::vector<T>(b.begin() + off, b.end())));
              CHECK(same_bits(got, want));
            }
          }
        }
      }
    }
  });
}

TEST_CASE("16-bit floats: every value against special and random values, both orders") {
  const auto paths = vector_paths();
  std::mt19937_64 rng(16);
  auto check_type = [&](auto zero) {
    using T = decltype(zero);
    buffers<T> scalar_bufs, path_bufs;
    std::vector<T> every(65536);
    for (std::size_t i = 0; i < every.size(); ++i)
      every[i] = T::from_bits(static_cast<std::uint16_t>(i));
    std::vector<T> partners = specials<T>();
    partners.resize(std::min(partners.size(), exhaustive_partners));
    while (partners.size() < exhaustive_partners)
      partners.push_back(T::from_bits(static_cast<std::uint16_t>(rng())));
    for (const T p : partners) {
      const std::vector<T> other(every.size(), p);
      for (const op o : {op::sum, op::prod, op::min, op::max}) {
        for (const bool every_first : {true, false}) {
          const auto& a = every_first ? every : other;
          const auto& b = every_first ? other : every;
          const std::vector<T>& want =
              run(scalar_bufs, simd::scalar, o, a, b, 0, a.size(), alias::none, 1);
          for (const simd path : paths) {
            const std::vector<T>& got = run(path_bufs, path, o, a, b, 0, a.size(), alias::none, 1);
            INFO(reduction::simd_name(path), " ", type_name<T>(), " ", ringzero::op_name(o), ": ",
                 first_difference(got, want, a, b));
            REQUIRE(same_bits(got, want));
          }
        }
      }
    }
    for (const int ranks : {2, 3, 5, 7, 64, 1000}) {
      std::vector<T> want = every;
      reduction::finish_avg(simd::scalar, want.data(), want.size(), ranks);
      for (const simd path : paths) {
        std::vector<T> got = every;
        reduction::finish_avg(path, got.data(), got.size(), ranks);
        INFO(reduction::simd_name(path), " ", type_name<T>(), " avg over ", ranks, ": ",
             first_difference(got, want, every, every));
        CHECK(same_bits(got, want));
      }
    }
  };
  check_type(float16{});
  check_type(bfloat16{});
}

TEST_CASE("the scalar path keeps the arithmetic of kernels::combine") {
  // Spot checks of the definitions the vector paths are compared with.
  const float nan_a = std::bit_cast<float>(0x7fc00001u), nan_b = std::bit_cast<float>(0x7fc00002u);
  float out = 0;
  reduction::combine(simd::scalar, op::min, &nan_a, &nan_b, &out, 1);
  CHECK(std::bit_cast<std::uint32_t>(out) == 0x7fc00001u);  // the first operand on NaN
  const float zero = 0.0f, minus_zero = -0.0f;
  reduction::combine(simd::scalar, op::max, &minus_zero, &zero, &out, 1);
  CHECK(std::bit_cast<std::uint32_t>(out) == 0x80000000u);                          // and on ties
  const bfloat16 x = bfloat16::from_bits(0x3f80), y = bfloat16::from_bits(0x3b80);  // 1, 2^-8
  bfloat16 r;
  reduction::combine(simd::scalar, op::sum, &x, &y, &r, 1);
  CHECK(r.bits == 0x3f80);  // 1 + 2^-8 is halfway between 1 and its successor: ties to even
}
