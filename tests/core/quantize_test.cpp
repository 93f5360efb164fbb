// The wire formats of options::wire element by element (reduce/quantize.hpp): the stated error
// bound, exactly, over values from subnormal to FLT_MAX and exact ties; the scale's 16 bits; ties
// to even; inf and NaN; int4's packing; the segment layout; bf16. The functions tested are the
// ones the CUDA kernels run (RINGZERO_HD), so this is also their host test.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "ringzero/reduce/quantize.hpp"
#include "ringzero/reduce/simd.hpp"

namespace {

using namespace ringzero;
namespace q = ringzero::quantize;

constexpr wire_format coded[] = {wire_format::int8, wire_format::int4};

int significant_bits(float s) {
  std::uint32_t m = std::bit_cast<std::uint32_t>(s) & 0x7fffffu;
  if ((std::bit_cast<std::uint32_t>(s) >> 23) != 0) m |= 0x800000u;
  if (m == 0) return 0;
  return static_cast<int>(std::bit_width(m)) - std::countr_zero(m);
}

/// Random finite floats over the whole range: random bit patterns (every binade equally often,
/// subnormals included), and values near a few magnitudes.
std::vector<float> samples(std::uint64_t seed, std::size_t n) {
  std::mt19937_64 g(seed);
  std::vector<float> v;
  for (std::size_t i = 0; i < n; ++i) {
    float x;
    do {
      x = std::bit_cast<float>(static_cast<std::uint32_t>(g()));
    } while (!std::isfinite(x));
    v.push_back(x);
  }
  return v;
}

}  // namespace

TEST_CASE("one encoding is within half the block's scale, exactly, from subnormals to FLT_MAX") {
  std::mt19937_64 g(7);
  for (const wire_format f : coded) {
    const int qm = q::qmax(f);
    for (int trial = 0; trial < 4000; ++trial) {
      // A block of 32 values around one magnitude, or spread over every binade.
      std::vector<float> block;
      if (trial % 2 == 0) {
        const float top = std::bit_cast<float>(static_cast<std::uint32_t>(g()) & 0x7f7fffffu);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        for (int i = 0; i < 32; ++i) block.push_back(top * u(g));
        block.push_back(trial % 4 == 0 ? -top : top);
      } else {
        block = samples(g(), 33);
      }
      float absmax = 0;
      for (float x : block) absmax = std::max(absmax, std::abs(x));
      const float s = q::scale_of(absmax, qm);
      INFO("format ", wire_format_name(f), ", absmax ", absmax, ", scale ", s);
      REQUIRE(significant_bits(s) <= 16);
      REQUIRE(static_cast<double>(s) * qm >= static_cast<double>(absmax));
      REQUIRE(static_cast<double>(s) <=
              static_cast<double>(absmax) / qm * (1 + 0x1p-15) + 0x1p-149);
      for (float x : block) {
        const int c = q::code_of(x, s, q::inverse_of(s), qm);
        // The nearest integer to x / s, ties to even, from a quotient exact enough to decide:
        // long double's 64 bits against the 40 that separate a non-tie from a tie.
        const long double ref =
            s == 0 ? 0.0L
                   : std::nearbyint(static_cast<long double>(x) / static_cast<long double>(s));
        CHECK_MESSAGE(c == static_cast<int>(std::clamp<long double>(ref, -qm, qm)), "x ", x);
        REQUIRE(c >= -qm);
        REQUIRE(c <= qm);
        const float v = q::value_of(c, s, qm);
        // The value is exact: the code times the scale, in double, is the same number.
        REQUIRE(static_cast<double>(v) == static_cast<double>(c) * static_cast<double>(s));
        const double err = std::abs(static_cast<double>(x) - static_cast<double>(v));
        CHECK_MESSAGE(err <= static_cast<double>(s) / 2, "x ", x, " code ", c, " err ", err);
        if (std::abs(x) == absmax && absmax > 0) CHECK(std::abs(c) == qm);
      }
    }
  }
}

TEST_CASE("exact ties go to the even code; a scale's neighbours round to the nearer code") {
  for (const wire_format f : coded) {
    const int qm = q::qmax(f);
    for (const float s : {1.0f, 0.375f, 49.0f / 4096.0f, 3.0f * 0x1p-140f, 12345.0f}) {
      for (int k = -qm; k < qm; ++k) {
        const double tie = (k + 0.5) * static_cast<double>(s);
        const auto x = static_cast<float>(tie);
        if (static_cast<double>(x) != tie) continue;  // not representable: no tie
        const double inv = q::inverse_of(s);
        const int c = q::code_of(x, s, inv, qm);
        CHECK_MESSAGE(c % 2 == 0, "scale ", s, " tie between ", k, " and ", k + 1, " gave ", c);
        CHECK((c == k || c == k + 1));
        CHECK(q::code_of(std::nextafter(x, 1e30f), s, inv, qm) == k + 1);
        CHECK(q::code_of(std::nextafter(x, -1e30f), s, inv, qm) == k);
      }
    }
  }
}

TEST_CASE(
    "inf and NaN take the reserved code and come back as NaN; the block's scale ignores them") {
  const float inf = std::numeric_limits<float>::infinity();
  for (const wire_format f : coded) {
    const q::segment_layout L{f, 4, 8};
    const float in[8] = {1.0f, inf, -2.0f, std::nanf(""), -inf, 0.5f, 0.25f, inf};
    std::vector<std::uint8_t> bytes(L.bytes());
    q::encode(L, in, bytes.data());
    const int qm = q::qmax(f);
    CHECK(q::scale_at(bytes.data(), 0) == q::scale_of(2.0f, qm));
    CHECK(q::scale_at(bytes.data(), 1) == q::scale_of(0.5f, qm));
    std::vector<float> out(8);
    q::decode(L, bytes.data(), out.data(), 8);
    for (int i : {1, 3, 4, 7}) CHECK(std::isnan(out[static_cast<std::size_t>(i)]));
    for (int i : {0, 2})
      CHECK(std::abs(out[static_cast<std::size_t>(i)] - in[i]) <= q::scale_of(2.0f, qm) / 2);
    for (int i : {5, 6})
      CHECK(std::abs(out[static_cast<std::size_t>(i)] - in[i]) <= q::scale_of(0.5f, qm) / 2);
    // A block of nothing but inf and NaN: scale 0, every element NaN.
    const float specials[4] = {inf, -inf, std::nanf(""), inf};
    const q::segment_layout S{f, 4, 4};
    std::vector<std::uint8_t> sb(S.bytes());
    q::encode(S, specials, sb.data());
    CHECK(q::scale_at(sb.data(), 0) == 0.0f);
    std::vector<float> so(4);
    q::accumulate(S, sb.data(), so.data(), true);
    for (float v : so) CHECK(std::isnan(v));
  }
}

TEST_CASE("int4: two codes a byte, low nibble first, every pair round trips") {
  for (int lo = -8; lo <= 7; ++lo)
    for (int hi = -8; hi <= 7; ++hi) {
      const std::uint8_t b = q::pack4(lo, hi);
      CHECK(q::unpack4(b, 0) == lo);
      CHECK(q::unpack4(b, 1) == hi);
      CHECK(q::code_at(&b, 0, wire_format::int4) == lo);
      CHECK(q::code_at(&b, 1, wire_format::int4) == hi);
    }
}

TEST_CASE("segment layout: scales, then codes, then zeros to a multiple of 8") {
  for (const std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{256},
                                  std::size_t{257}, std::size_t{1000}}) {
    for (const std::size_t block :
         {std::size_t{1}, std::size_t{3}, std::size_t{64}, std::size_t{256}}) {
      const q::segment_layout i8{wire_format::int8, block, count};
      const q::segment_layout i4{wire_format::int4, block, count};
      const q::segment_layout b16{wire_format::bf16, block, count};
      const std::size_t blocks = (count + block - 1) / block;
      CHECK(i8.blocks() == blocks);
      CHECK(i8.bytes() == (4 * blocks + count + 7) / 8 * 8);
      CHECK(i4.bytes() == (4 * blocks + (count + 1) / 2 + 7) / 8 * 8);
      CHECK(b16.blocks() == 0);
      CHECK(b16.bytes() == (2 * count + 7) / 8 * 8);
      // Encoding writes every byte (padding zeroed), and decoding matches value_at.
      const auto in = samples(count * 31 + block, count);
      for (const auto& L : {i8, i4, b16}) {
        std::vector<std::uint8_t> bytes(L.bytes(), 0xA5);
        q::encode(L, in.data(), bytes.data());
        for (std::size_t k = L.scale_bytes() + L.code_bytes(); k < L.bytes(); ++k)
          CHECK(bytes[k] == 0);
        if (L.format == wire_format::int4 && count % 2 == 1)
          CHECK((bytes[L.scale_bytes() + count / 2] >> 4) == 0);  // the odd element's free nibble
        std::vector<float> out(count);
        q::decode(L, bytes.data(), out.data(), count);
        for (std::size_t i = 0; i < count; ++i) {
          const float v = q::value_at(L, bytes.data(), i);
          CHECK(std::memcmp(&out[i], &v, 4) == 0);
        }
      }
    }
  }
}

TEST_CASE("bf16 on the wire: nearest-even bfloat16, within 2^-8 |x|; inf and NaN as they are") {
  const auto in = samples(11, 20000);
  const q::segment_layout L{wire_format::bf16, 0, in.size()};
  std::vector<std::uint8_t> bytes(L.bytes());
  q::encode(L, in.data(), bytes.data());
  std::vector<float> out(in.size());
  q::decode(L, bytes.data(), out.data(), out.size());
  for (std::size_t i = 0; i < in.size(); ++i) {
    CHECK(out[i] == static_cast<float>(bfloat16(in[i])));
    if (std::isfinite(out[i]))
      CHECK(std::abs(static_cast<double>(out[i]) - in[i]) <=
            q::element_error(wire_format::bf16, std::abs(static_cast<double>(in[i]))));
  }
  const float inf = std::numeric_limits<float>::infinity();
  const float special[3] = {inf, -inf, std::nanf("")};
  const q::segment_layout S{wire_format::bf16, 0, 3};
  std::vector<std::uint8_t> sb(S.bytes());
  q::encode(S, special, sb.data());
  float so[3];
  q::decode(S, sb.data(), so, 3);
  CHECK(so[0] == inf);
  CHECK(so[1] == -inf);
  CHECK(std::isnan(so[2]));
}

TEST_CASE("16-bit inputs are widened exactly before encoding") {
  std::vector<bfloat16> b;
  std::vector<float16> h;
  std::vector<float> bw, hw;
  for (float x : samples(5, 500)) {
    const float small = std::fmod(x, 1000.0f);  // within float16's range
    b.push_back(bfloat16(x));
    h.push_back(float16(small));
    bw.push_back(static_cast<float>(b.back()));
    hw.push_back(static_cast<float>(h.back()));
  }
  for (const wire_format f : {wire_format::bf16, wire_format::int8, wire_format::int4}) {
    const q::segment_layout L{f, 64, b.size()};
    std::vector<std::uint8_t> x(L.bytes()), y(L.bytes());
    q::encode(L, b.data(), x.data());
    q::encode(L, bw.data(), y.data());
    CHECK(x == y);
    q::encode(L, h.data(), x.data());
    q::encode(L, hw.data(), y.data());
    CHECK(x == y);
  }
}

TEST_CASE("element_error bounds one encoding of any block whose magnitudes stay below it") {
  std::mt19937_64 g(3);
  for (const wire_format f : {wire_format::bf16, wire_format::int8, wire_format::int4}) {
    for (int trial = 0; trial < 200; ++trial) {
      const double a = std::ldexp(1.0 + static_cast<double>(g() % 1000) / 1000.0,
                                  static_cast<int>(g() % 200) - 100);
      std::uniform_real_distribution<double> u(-a, a);
      std::vector<float> block(64);
      for (float& x : block) x = static_cast<float>(u(g));
      const q::segment_layout L{f, 64, 64};
      std::vector<std::uint8_t> bytes(L.bytes());
      q::encode(L, block.data(), bytes.data());
      for (std::size_t i = 0; i < 64; ++i)
        CHECK(std::abs(static_cast<double>(q::value_at(L, bytes.data(), i)) - block[i]) <=
              q::element_error(f, a));
    }
  }
}

TEST_CASE("every host vector path writes the scalar path's bytes and sums, bit for bit") {
  const float inf = std::numeric_limits<float>::infinity();
  std::mt19937_64 g(17);
  std::vector<float> in;
  for (int i = 0; i < 3000; ++i) {
    const std::uint64_t h = g();
    float x = std::ldexp(static_cast<float>(h % 20001) / 10000.0f - 1.0f,
                         static_cast<int>((h >> 20) % 12) - 6);
    if (h % 97 == 0) x = (h & 1) ? inf : -inf;
    if (h % 89 == 0) x = std::nanf("");
    if (h % 83 == 0) x = std::ldexp(static_cast<float>((h >> 8) % 15) - 7.5f, -3);  // ties
    in.push_back(x);
  }
  // A block of 256 exact ties under a scale whose reciprocal is inexact (49/4096): x · (1 / s)
  // misses -126.5 there, and only the residual finds the tie.
  constexpr float tie_scale = 49.0f / 4096.0f;
  for (int k = -127; k < 127; ++k)
    in[static_cast<std::size_t>(k + 127)] = (static_cast<float>(k) + 0.5f) * tie_scale;
  in[254] = 127 * tie_scale;
  in[255] = -127 * tie_scale;
  std::vector<bfloat16> inb(in.begin(), in.end());
  std::vector<float16> inh;
  for (float x : in) inh.push_back(float16(std::isfinite(x) ? std::fmod(x, 60000.0f) : x));
  const auto bits_equal = [](const auto& a, const auto& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  for (const reduction::simd path : reduction::all_simd) {
    if (path == reduction::simd::scalar || !reduction::simd_supported(path)) continue;
    for (const wire_format f : {wire_format::bf16, wire_format::int8, wire_format::int4})
      for (const std::size_t block :
           {std::size_t{1}, std::size_t{7}, std::size_t{64}, std::size_t{256}, std::size_t{1000}})
        for (const std::size_t count :
             {std::size_t{5}, std::size_t{17}, std::size_t{256}, std::size_t{2999}}) {
          INFO(reduction::simd_name(path), " ", wire_format_name(f), " block ", block, " count ",
               count);
          const q::segment_layout L{f, block, count};
          const auto check_type = [&](const auto* src) {
            std::vector<std::uint8_t> a(L.bytes(), 1), b(L.bytes(), 2);
            q::encode(L, src, a.data(), reduction::simd::scalar);
            q::encode(L, src, b.data(), path);
            CHECK(a == b);
            using E = std::remove_cvref_t<decltype(*src)>;
            std::vector<E> da(count), db(count);
            q::decode(L, a.data(), da.data(), count, reduction::simd::scalar);
            q::decode(L, a.data(), db.data(), count, path);
            CHECK(bits_equal(da, db));
          };
          check_type(in.data());
          check_type(inb.data());
          check_type(inh.data());
          // Sums over three segments, one holding infinities of the other sign.
          std::vector<float> other(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(count));
          for (float& x : other) x = std::isinf(x) ? -x : 0.5f * x;
          std::vector<std::uint8_t> s1(L.bytes()), s2(L.bytes());
          q::encode(L, in.data(), s1.data());
          q::encode(L, other.data(), s2.data());
          std::vector<float> acc_a(count), acc_b(count);
          for (int k = 0; k < 3; ++k) {
            const std::uint8_t* seg = k == 1 ? s2.data() : s1.data();
            q::accumulate(L, seg, acc_a.data(), k == 0, reduction::simd::scalar);
            q::accumulate(L, seg, acc_b.data(), k == 0, path);
          }
          CHECK(bits_equal(acc_a, acc_b));
        }
  }
}
