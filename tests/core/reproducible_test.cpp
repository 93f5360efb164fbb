// The exact sum behind options::reproducible (reduce/reproducible.hpp), against an independent
// oracle: a plain big integer that holds every finite double exactly. The sum must be the
// representable value nearest the exact sum (ties to even) for float, double, bfloat16 and
// float16, on inputs built to break ordinary summation: cancellation, 2^+-100 ranges,
// subnormals, many terms. A correctly rounded result is never further from the exact sum than
// any other representable value, so never worse than the plain float32 sum in any order; the
// adversarial cases check that against float32 sums in many orders too.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "ringzero/detail/reproducible_call.hpp"
#include "ringzero/reduce/reproducible.hpp"
#include "ringzero/reduce/reproducible_accumulator.hpp"

using ringzero::bfloat16;
using ringzero::float16;
namespace rp = ringzero::reproducible;

namespace {

/// An integer in units of 2^-1100, 2^32 per limb: every finite double, and sums of millions.
struct big {
  static constexpr int offset = 1100, limbs = 72;
  std::array<std::int64_t, limbs> l{};

  void add(const rp::term& t, std::int64_t times = 1) {
    if (t.k != rp::kind::finite) return;
    const int pos = t.exp + offset;
    const int limb = pos / 32, shift = pos % 32;
    const rp::u128 v = static_cast<rp::u128>(t.mant) << shift;
    for (int i = 0; i < 3; ++i) {
      const auto part = static_cast<std::int64_t>((v >> (32 * i)) & 0xffffffffu);
      l[static_cast<std::size_t>(limb + i)] += (t.neg ? -part : part) * times;
    }
  }
  void normalize() {
    std::int64_t carry = 0;
    for (auto& x : l) {
      const std::int64_t s = x + carry;
      x = s & 0xffffffff;
      carry = (s - x) >> 32;
    }
    l.back() += carry << 32;  // the sign lives in the top limb
  }
  [[nodiscard]] int sign() {
    normalize();
    for (int i = limbs - 1; i >= 0; --i)
      if (l[static_cast<std::size_t>(i)] != 0) return l[static_cast<std::size_t>(i)] < 0 ? -1 : 1;
    return 0;
  }
  [[nodiscard]] big minus(const big& o) const {
    big r = *this;
    for (std::size_t i = 0; i < l.size(); ++i) r.l[i] -= o.l[i];
    return r;
  }
  [[nodiscard]] big abs() {
    if (sign() >= 0) return *this;
    big r;
    for (std::size_t i = 0; i < l.size(); ++i) r.l[i] = -l[i];
    r.normalize();
    return r;
  }
  /// -1, 0, 1 as |*this| compares with |o|.
  [[nodiscard]] int compare_abs(const big& o) const {
    big a = *this, b = o;
    a = a.abs();
    b = b.abs();
    for (int i = limbs - 1; i >= 0; --i) {
      const auto x = a.l[static_cast<std::size_t>(i)], y = b.l[static_cast<std::size_t>(i)];
      if (x != y) return x < y ? -1 : 1;
    }
    return 0;
  }
};

template <class T>
big exact(const std::vector<T>& terms, std::int64_t times = 1) {
  big b;
  for (const T& x : terms) b.add(rp::decompose(x), times);
  return b;
}

template <class T>
big of(T x, std::int64_t times = 1) {
  big b;
  b.add(rp::decompose(x), times);
  return b;
}

template <class T>
T next_up(T x) {
  using B = typename rp::format<T>::bits;
  const B b = rp::bits_of(x);
  constexpr int width = 8 * sizeof(B);
  const B sign = static_cast<B>(B{1} << (width - 1));
  if ((b & static_cast<B>(~sign)) == 0) return rp::from_bits<T>(B{1});
  return rp::from_bits<T>(static_cast<B>((b & sign) ? b - 1 : b + 1));
}
template <class T>
T negate(T x) {
  using B = typename rp::format<T>::bits;
  constexpr int width = 8 * sizeof(B);
  return rp::from_bits<T>(static_cast<B>(rp::bits_of(x) ^ (B{1} << (width - 1))));
}
template <class T>
T next_down(T x) {
  return negate(next_up(negate(x)));
}
template <class T>
bool finite(T x) {
  return rp::decompose(x).k == rp::kind::finite || rp::decompose(x).k == rp::kind::zero;
}
template <class T>
bool even(T x) {
  return (rp::bits_of(x) & 1u) == 0;
}

/// r is the representable value nearest sum/divisor, ties to even.
template <class T>
void check_nearest(const std::vector<T>& terms, T r, std::int64_t divisor = 1) {
  REQUIRE(finite(r));
  const big s = exact(terms);
  const big here = s.minus(of(r, divisor));
  for (T n : {next_up(r), next_down(r)}) {
    if (!finite(n)) continue;
    const big there = s.minus(of(n, divisor));
    const int c = here.compare_abs(there);
    CHECK(c <= 0);
    if (c == 0) CHECK(even(r));
  }
}

template <class T>
T make(double v) {
  return T(v);
}

template <class T>
std::vector<T> random_terms(std::mt19937_64& rng, int n, int lo_exp, int hi_exp, bool cancel) {
  std::uniform_real_distribution<double> m(1.0, 2.0);
  std::uniform_int_distribution<int> e(lo_exp, hi_exp);
  std::bernoulli_distribution s(0.5);
  std::vector<T> out;
  for (int i = 0; i < n; ++i) {
    const double v = std::ldexp(m(rng), e(rng)) * (s(rng) ? -1 : 1);
    out.push_back(make<T>(v));
    if (cancel && i + 1 < n) {
      out.push_back(negate(out.back()));
      ++i;
    }
  }
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

template <class T>
void nearest_cases(int lo, int hi) {
  std::mt19937_64 rng(0x5eed);
  for (int trial = 0; trial < 400; ++trial) {
    const int n = 1 + trial % 97;
    const bool cancel = trial % 3 == 0;
    const auto terms = random_terms<T>(rng, n, lo + (trial % 7), hi - (trial % 5), cancel);
    const T r = rp::serial_sum(terms.data(), terms.size());
    check_nearest(terms, r);
    // Any order gives the same bits.
    auto shuffled = terms;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    CHECK(rp::bits_of(rp::serial_sum(shuffled.data(), shuffled.size())) == rp::bits_of(r));
    // avg: the sum divided by the number of ranks, rounded once.
    const auto d = static_cast<std::uint32_t>(1 + trial % 9);
    check_nearest(terms, rp::serial_sum(terms.data(), terms.size(), d), d);
  }
}

}  // namespace

TEST_CASE("the reproducible sum is the nearest float to the exact sum") {
  nearest_cases<float>(-100, 100);
  nearest_cases<float>(-149, -120);  // subnormals and the smallest normals
  nearest_cases<float>(100, 119);    // large terms (97 of them stay below overflow)
}

TEST_CASE("the reproducible sum is the nearest double, bfloat16 and float16") {
  nearest_cases<double>(-120, 120);
  nearest_cases<double>(-1074, -1000);
  nearest_cases<bfloat16>(-100, 100);
  nearest_cases<bfloat16>(-133, -120);
  nearest_cases<float16>(-24, 8);
}

TEST_CASE("heavy cancellation and 2^+-100 ranges: never worse than float32 in any order") {
  std::mt19937_64 rng(7);
  int float32_wrong = 0;
  for (int trial = 0; trial < 200; ++trial) {
    // Large terms that cancel exactly, around small ones that carry the answer.
    std::vector<float> terms;
    std::uniform_int_distribution<int> big_e(60, 100), small_e(-100, -60);
    std::uniform_real_distribution<float> m(1.0f, 2.0f);
    for (int i = 0; i < 20; ++i) {
      const float b = std::ldexp(m(rng), big_e(rng));
      terms.push_back(b);
      terms.push_back(-b);
      terms.push_back(std::ldexp(m(rng), small_e(rng)) * (i % 2 ? -1.0f : 1.0f));
    }
    const float r = rp::serial_sum(terms.data(), terms.size());
    check_nearest(terms, r);
    const big s = exact(terms);
    for (int order = 0; order < 20; ++order) {
      std::shuffle(terms.begin(), terms.end(), rng);
      float plain = 0;
      for (float x : terms) plain += x;
      const int c = s.minus(of(r)).compare_abs(s.minus(of(plain)));
      CHECK(c <= 0);
      float32_wrong += c < 0;
    }
  }
  // The inputs do break float32: most orders lose the small terms.
  CHECK(float32_wrong > 2000);
}

TEST_CASE("many terms: a million floats of mixed sign") {
  std::mt19937_64 rng(11);
  const auto terms = random_terms<float>(rng, 1 << 20, -30, 30, false);
  const float r = rp::serial_sum(terms.data(), terms.size());
  check_nearest(terms, r);
}

TEST_CASE("infinities and NaN come back as IEEE addition gives them") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto sum = [](std::vector<float> v) { return rp::serial_sum(v.data(), v.size()); };
  CHECK(sum({1.0f, inf, 2.0f}) == inf);
  CHECK(sum({-inf, 1.0f}) == -inf);
  CHECK(std::isnan(sum({inf, -inf})));
  CHECK(std::isnan(sum({nan, 1.0f})));
  CHECK(sum({}) == 0.0f);
  CHECK(sum({0.0f, -0.0f}) == 0.0f);
  // A finite sum past the largest float overflows to infinity, once, at the end.
  const float big = std::numeric_limits<float>::max();
  CHECK(sum({big, big}) == inf);
  CHECK(sum({big, big, -big}) == big);  // float32 in this order would say inf
}

TEST_CASE("a window describes a block's bits and needs one word for ordinary data") {
  rp::window w;
  CHECK(w.is_empty());
  CHECK(rp::words(w) == 0);
  w.add(rp::decompose(1.0f));   // bit 0
  w.add(rp::decompose(0.75f));  // bits -1, -2
  CHECK(w.top == 1);
  CHECK(w.low() == -2);
  CHECK(rp::words(w) == 1);
  rp::window v;
  v.add(rp::decompose(std::ldexp(1.0f, -60)));
  w.merge(v);
  CHECK(w.low() == -60);
  CHECK(rp::words(w) == 2);
  // A double window past max_words digits keeps its top 320 bits.
  rp::window d;
  d.add(rp::decompose(1e300));
  d.add(rp::decompose(1e-300));
  CHECK(rp::words(d) == rp::max_words);
  CHECK(d.low() == d.top - rp::max_words * rp::digit_bits);
}

TEST_CASE("a tie is broken by a bit far below it") {
  auto sum = [](std::vector<float> v) { return rp::serial_sum(v.data(), v.size()); };
  const float half_ulp = std::ldexp(1.0f, -24);  // half of 1.0f's ulp: a tie, to even
  CHECK(sum({1.0f, half_ulp}) == 1.0f);
  // 2^-140 lies 116 bits below the tie, in a digit the rounding reads only as sticky.
  CHECK(sum({1.0f, half_ulp, std::ldexp(1.0f, -140)}) == std::nextafter(1.0f, 2.0f));
  CHECK(sum({1.0f, half_ulp, -std::ldexp(1.0f, -140)}) == 1.0f);
  CHECK(sum({-1.0f, -half_ulp, -std::ldexp(1.0f, -140)}) == -std::nextafter(1.0f, 2.0f));
  // Subnormal results: the smallest doubles add exactly.
  std::vector<double> d{std::ldexp(1.0, -1074), std::ldexp(1.0, -1074), std::ldexp(1.0, -1073)};
  CHECK(rp::serial_sum(d.data(), d.size()) == std::ldexp(1.0, -1072));
}

TEST_CASE("an accumulator adds terms exactly and grows its digits as terms reach past them") {
  std::mt19937_64 rng(21);
  constexpr std::size_t n = 200;  // three full blocks and a short one
  rp::accumulator<float> acc(n);
  std::vector<std::vector<float>> per(n);
  for (int batch = 0; batch < 30; ++batch) {
    // Ranges that move batch to batch, so blocks grow at both ends.
    const auto terms =
        random_terms<float>(rng, static_cast<int>(n), -20 - 4 * batch, 10 + 3 * batch, false);
    acc.add(std::span<const float>(terms));
    for (std::size_t i = 0; i < n; ++i) per[i].push_back(terms[i]);
  }
  for (std::size_t i = 0; i < n; ++i) {
    const float v = acc.value(i);
    CHECK(rp::bits_of(v) == rp::bits_of(rp::serial_sum(per[i].data(), per[i].size())));
    check_nearest(per[i], v);
  }
  // normalize changes the words, not the sums.
  acc.normalize();
  for (std::size_t i = 0; i < n; ++i)
    CHECK(rp::bits_of(acc.value(i)) == rp::bits_of(rp::serial_sum(per[i].data(), per[i].size())));
  // A piece at an offset, and specials.
  std::vector<float> piece{std::numeric_limits<float>::infinity(), 1.0f};
  acc.add(std::span<const float>(piece), 63);
  CHECK(acc.value(63) == std::numeric_limits<float>::infinity());
  CHECK_THROWS_AS(acc.add(std::span<const float>(piece), n - 1), ringzero::invalid_argument);
}

namespace {

/// Terms for comparing the paths of the host loops: mostly random floats with exponents in
/// [low, low + span) (clamped to the float range), and about one in five a signed zero, a
/// subnormal, or (where asked) an infinity or NaN.
std::vector<float> path_terms(std::mt19937_64& rng, std::size_t n, int low, int span, bool inf,
                              bool nan) {
  std::vector<float> t(n);
  for (float& x : t) {
    switch (rng() % 25) {
      case 0:
        x = 0.0f;
        break;
      case 1:
        x = -0.0f;
        break;
      case 2:
        x = inf ? std::numeric_limits<float>::infinity() : 2.0f;
        break;
      case 3:
        x = nan ? std::numeric_limits<float>::quiet_NaN() : -2.0f;
        break;
      case 4:  // a subnormal, either sign
        x = std::bit_cast<float>(static_cast<std::uint32_t>(rng() & 0x807fffffu));
        break;
      default: {
        const auto m = static_cast<float>(rng() % (1u << 24));
        const int e =
            std::clamp(low + static_cast<int>(rng() % static_cast<unsigned>(span)), -149, 104);
        x = std::ldexp((rng() & 1) != 0 ? -m : m, e);
      }
    }
  }
  return t;
}

}  // namespace

TEST_CASE("an accumulator holds the same words on every path of the host loops") {
  // The vector loops (reduce/detail/reproducible_x86.hpp) against the scalar one: every path's
  // accumulator must end with the same windows and the same digits, not merely the same
  // rounded sums. Pieces at any offset and of any length (so blocks start and end mid-vector),
  // exponents over the whole float range with subnormals, signed zeros, infinities and NaNs,
  // and batches whose ranges move so that blocks grow between adds.
  using ringzero::reduction::simd;
  std::vector<simd> paths;
  for (const simd p : ringzero::reduction::all_simd)
    if (ringzero::reduction::simd_supported(p)) paths.push_back(p);
  MESSAGE("paths compared with the scalar one: ", paths.size() - 1);
  std::mt19937_64 rng(0xacc);
  for (int trial = 0; trial < 150; ++trial) {
    const std::size_t n = 1 + rng() % 300;
    std::vector<rp::accumulator<float>> acc;
    for (std::size_t p = 0; p < paths.size(); ++p) acc.emplace_back(n);
    std::vector<std::vector<float>> per(n);
    for (int batch = 0; batch < 8; ++batch) {
      const std::vector<float> t =
          path_terms(rng, n, static_cast<int>(rng() % 200) - 140, 1 + static_cast<int>(rng() % 60),
                     trial % 7 == 0, trial % 11 == 0);
      const std::size_t at = rng() % (n + 1);
      const std::size_t len = rng() % (n - at + 1);
      const std::span<const float> piece(t.data(), len);
      for (std::size_t p = 0; p < paths.size(); ++p) acc[p].add(paths[p], piece, at);
      for (std::size_t i = 0; i < len; ++i) per[at + i].push_back(t[i]);
    }
    std::vector<std::int32_t> win0;
    acc[0].windows(win0);
    std::vector<std::int64_t> q0(ringzero::detail::digits_between(win0, 0, n));
    acc[0].write(win0, 0, n, q0.data());
    for (std::size_t p = 1; p < paths.size(); ++p) {
      CAPTURE(ringzero::reduction::simd_name(paths[p]));
      CAPTURE(trial);
      std::vector<std::int32_t> win;
      acc[p].windows(win);
      REQUIRE(win == win0);
      std::vector<std::int64_t> q(q0.size());
      acc[p].write(win, 0, n, q.data());
      CHECK(q == q0);
    }
    // And the scalar path's sums are the exact ones (the other paths hold its words).
    for (std::size_t i = 0; i < n; i += 7)
      CHECK(rp::bits_of(acc[0].value(i)) ==
            rp::bits_of(rp::serial_sum(per[i].data(), per[i].size())));
  }
}

TEST_CASE(
    "a reproducible float sum's passes give the same windows, digits and results on every path") {
  // local_windows, write_digits and read_digits (detail/reproducible_call.hpp) on each path of
  // the host loops against the scalar one, bit for bit: lengths that end mid-block and
  // mid-vector, subnormals, signed zeros, infinities and NaNs, and summed digits whose rounding
  // leaves the normal range (the vector loop hands those lanes to the general rounding).
  using ringzero::reduction::simd;
  namespace rd = ringzero::detail;
  std::vector<simd> paths;
  for (const simd p : ringzero::reduction::all_simd)
    if (p != simd::scalar && ringzero::reduction::simd_supported(p)) paths.push_back(p);
  MESSAGE("paths compared with the scalar one: ", paths.size());
  std::mt19937_64 rng(0x9a55);
  std::size_t off_normal = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const std::size_t n = rng() % 700;
    const std::vector<float> t =
        path_terms(rng, n, static_cast<int>(rng() % 250) - 150, 1 + static_cast<int>(rng() % 40),
                   trial % 7 == 0, trial % 11 == 0);
    const std::span<const float> in(t);
    std::vector<std::int32_t> win0;
    rd::local_windows(simd::scalar, in, win0);
    std::vector<std::int64_t> q0(rd::digits_between(win0, 0, n));
    rd::write_digits(simd::scalar, in, win0, 0, n, q0.data());
    // Two ranks' digits and a little more: sums that are not any one rank's.
    std::vector<std::int64_t> sum(q0.size());
    for (std::size_t i = 0; i < q0.size(); ++i)
      sum[i] = 3 * q0[i] + static_cast<std::int64_t>(rng() % 5) - 2;
    std::vector<float> out0(n);
    rd::read_digits(simd::scalar, sum.data(), win0, 0, n, 1, out0.data());
    for (const float v : out0) off_normal += v != 0.0f && !std::isnormal(v) ? 1 : 0;
    for (const simd p : paths) {
      CAPTURE(ringzero::reduction::simd_name(p));
      CAPTURE(trial);
      std::vector<std::int32_t> win;
      rd::local_windows(p, in, win);
      REQUIRE(win == win0);
      std::vector<std::int64_t> q(q0.size());
      rd::write_digits(p, in, win0, 0, n, q.data());
      CHECK(q == q0);
      std::vector<float> out(n);
      rd::read_digits(p, sum.data(), win0, 0, n, 1, out.data());
      CHECK(std::equal(out.begin(), out.end(), out0.begin(),
                       [](float a, float b) { return rp::bits_of(a) == rp::bits_of(b); }));
    }
  }
  // The inputs reached the lanes the vector rounding leaves to the general code.
  CHECK(off_normal > 0);
}

TEST_CASE("a block of several digits gets each element's rp::to_words digits, every type") {
  // write_digits cuts a multi-digit element's digits from one shift (detail::many_digits);
  // rp::to_words, digit by digit, is the definition. Windows of two digits up to double's cut
  // at max_words (1e-300 beside 1e300), mantissas with trailing zeros (powers of two: their
  // bits start above the window's low bit), zeros, subnormals, infinities and NaNs.
  namespace rd = ringzero::detail;
  std::mt19937_64 rng(0xd161);
  std::size_t multi = 0, cut = 0;
  auto one_type = [&](auto zero, int lo_exp, int hi_exp) {
    using E = decltype(zero);
    for (int trial = 0; trial < 60; ++trial) {
      const std::size_t n = rng() % 300;
      const int span = 1 + static_cast<int>(rng() % static_cast<unsigned>(hi_exp - lo_exp));
      const int from =
          lo_exp + static_cast<int>(rng() % static_cast<unsigned>(hi_exp - lo_exp - span + 1));
      std::vector<E> t(n);
      for (E& x : t) {
        const auto pick = rng() % 20;
        const double mant = pick < 4 ? 1.0 : 1.0 + static_cast<double>(rng() >> 11) * 0x1p-53;
        double v = std::ldexp(mant, from + static_cast<int>(rng() % static_cast<unsigned>(span)));
        if (pick == 4) v = 0.0;
        if (pick == 5 && trial % 5 == 0) v = std::numeric_limits<double>::infinity();
        if (pick == 6 && trial % 7 == 0) v = std::numeric_limits<double>::quiet_NaN();
        if (rng() & 1) v = -v;
        if constexpr (std::is_same_v<E, double>)
          x = v;
        else
          x = E(static_cast<float>(v));
      }
      const std::span<const E> in(t);
      std::vector<std::int32_t> win;
      rd::local_windows(in, win);
      std::vector<std::int64_t> q(rd::digits_between(win, 0, n)), want(q.size());
      rd::write_digits(in, win, 0, n, q.data());
      std::size_t at = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const rp::window w = rp::window_at(win.data(), i / rp::block_elems);
        rp::to_words(rp::decompose(t[i]), w, want.data() + at);
        at += static_cast<std::size_t>(rp::words(w));
        multi += rp::words(w) > 1 ? 1 : 0;
        cut += w.low() > -w.neg_low ? 1 : 0;
      }
      REQUIRE(at == q.size());
      CAPTURE(trial);
      CHECK(q == want);
    }
  };
  one_type(0.0f, -149, 127);
  one_type(0.0, -1074, 1023);
  one_type(bfloat16{}, -133, 127);
  one_type(float16{}, -24, 15);
  // The inputs reached the shortcut and the cut windows it hands to rp::to_words.
  CHECK(multi > 1000);
  CHECK(cut > 100);
}

TEST_CASE("an accumulator takes more terms than one word's headroom") {
  // 2^23 + 5 terms of (1 + 2^-23) 2^39 in one element: past the 2^22 adds at which a block
  // normalizes itself, twice. Added one at a time, as a norm over a large shard is.
  rp::accumulator<double> acc(1);
  const double x = std::ldexp(1.0 + std::ldexp(1.0, -23), 39);
  const std::vector<double> batch(1, x);
  const std::int64_t count = (std::int64_t{1} << 23) + 5;
  for (std::int64_t i = 0; i < count; ++i) acc.add(std::span<const double>(batch));
  CHECK(acc.max_adds() < rp::max_terms);
  // The exact sum count * x is a double: (2^23 + 1)(2^23 + 5) has 47 bits.
  CHECK(acc.value(0) == x * static_cast<double>(count));
}

namespace {

/// detail::round_one_word against rp::round_words on one-digit words: small and 62-bit sums,
/// exact ties, results near the smallest normal, subnormal and past the largest finite, every
/// divisor kind.
template <class T>
void one_word_cases() {
  using F = rp::format<T>;
  std::mt19937_64 rng(0xd161);
  const std::uint32_t divisors[] = {1, 2, 3, 7, 1000, (1u << 23) - 1};
  int checked = 0;
  int converted = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const int bits = 1 + static_cast<int>(rng() % 62);
    auto a = static_cast<std::int64_t>(rng() >> (64 - bits));
    if (trial % 5 == 0 && bits > F::p + 1)  // a tie: the first dropped bit set, none below
      a = (a >> (bits - F::p - 1) | 1) << (bits - F::p - 1);
    const std::int64_t s = (rng() & 1) != 0 ? -a : a;
    // low from far below the subnormals to past the largest finite.
    const int span = F::emax - F::emin + 2 * F::p + 120;
    const int low = F::emin - F::p - 60 - bits / 2 + static_cast<int>(rng() % span);
    const rp::window w{low + rp::digit_bits, -low};
    REQUIRE(rp::words(w) == 1);
    const std::uint32_t d = divisors[trial % 6];
    const T fast = ringzero::detail::round_one_word<T>(s, w, w.low(), d);
    const T ref = rp::round_words<T>(&s, w, d);
    INFO("s = " << s << ", low = " << low << ", divisor = " << d);
    CHECK(rp::bits_of(fast) == rp::bits_of(ref));
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      // The hardware conversion, where it answers (a normal result), as the integer paths.
      T hw{};
      if (d == 1 && ringzero::detail::round_int64_nearest<T>(s, w.low(), hw)) {
        CHECK(rp::bits_of(hw) == rp::bits_of(ref));
        ++converted;
      }
    }
    ++checked;
  }
  CHECK(checked == 20000);
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    // low is spread over the whole range: a good share of the results are normal numbers.
    CHECK(converted > 20000 / 6 / 4);
  }
}

/// detail::round_two_words and its conversion path against rp::round_words on two-digit words
/// of every magnitude (one word or both up to the 2^63 headroom), every divisor kind.
template <class T>
void two_word_cases() {
  using F = rp::format<T>;
  std::mt19937_64 rng(0x2d16);
  const std::uint32_t divisors[] = {1, 2, 3, 7, 1000, (1u << 23) - 1};
  int converted = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    std::int64_t w[2];
    for (auto& x : w) {
      const int bits = static_cast<int>(rng() % 63);
      const auto a = bits == 0 ? std::int64_t{0} : static_cast<std::int64_t>(rng() >> (64 - bits));
      x = (rng() & 1) != 0 ? -a : a;
    }
    if (trial % 7 == 0) w[1] = 0;
    if (trial % 11 == 0) w[0] = 0;
    const int span = F::emax - F::emin + 2 * F::p + 160;
    const int low = F::emin - F::p - 120 + static_cast<int>(rng() % span);
    const rp::window win{low + 2 * rp::digit_bits, -low};
    REQUIRE(rp::words(win) == 2);
    const std::uint32_t d = divisors[trial % 6];
    const T ref = rp::round_words<T>(w, win, d);
    INFO("w = " << w[0] << ", " << w[1] << ", low = " << low << ", divisor = " << d);
    CHECK(rp::bits_of(ringzero::detail::round_two_words<T>(w, low, d)) == rp::bits_of(ref));
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      T hw{};
      if (d == 1 && ringzero::detail::round_two_words_nearest<T>(w, low, hw)) {
        CHECK(rp::bits_of(hw) == rp::bits_of(ref));
        ++converted;
      }
    }
  }
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    CHECK(converted > 20000 / 6 / 4);
  }
}

/// read_digits gives the same bits whatever the thread's rounding mode: the conversion it takes
/// under round-to-nearest is refused under the others, where the integer path rounds. Terms of
/// `sig_bits` significant bits over `binades` binades in a block: one digit each at 24 and 8,
/// two at 53 and 16.
template <class T>
void rounding_mode_cases(int sig_bits, int binades) {
  std::mt19937_64 rng(0xfe7);
  const std::size_t n = 1000;
  std::vector<T> in(n);
  for (std::size_t i = 0; i < n; ++i) {
    const double m = std::ldexp(static_cast<double>(rng() >> (64 - sig_bits)), -sig_bits) + 0.5;
    in[i] = static_cast<T>(std::ldexp((rng() & 1) != 0 ? -m : m, static_cast<int>(i) % binades));
  }
  std::vector<std::int32_t> win;
  ringzero::detail::local_windows(std::span<const T>(in), win);
  std::vector<std::int64_t> q(ringzero::detail::digits_between(win, 0, n));
  ringzero::detail::write_digits(std::span<const T>(in), win, 0, n, q.data());
  // Twice each digit, as two ranks' terms would sum: the rounding is not the identity.
  for (auto& d : q) d = 2 * d + 1;
  std::vector<T> nearest(n), upward(n);
  ringzero::detail::read_digits(q.data(), win, 0, n, 1, nearest.data());
  const int mode = std::fegetround();
  REQUIRE(std::fesetround(FE_UPWARD) == 0);
  ringzero::detail::read_digits(q.data(), win, 0, n, 1, upward.data());
  std::fesetround(mode);
  for (std::size_t i = 0; i < n; ++i) {
    CAPTURE(i);
    CHECK(rp::bits_of(upward[i]) == rp::bits_of(nearest[i]));
    const rp::window w = rp::window_at(win.data(), i / rp::block_elems);
    const std::size_t at = ringzero::detail::digits_between(win, 0, i);
    CHECK(rp::bits_of(nearest[i]) == rp::bits_of(rp::round_words<T>(&q[at], w)));
  }
}

/// detail::gathered_sum (one int64 where the terms span little, serial_sum otherwise) against
/// serial_sum, over a strided layout as the gathered terms lie.
template <class T>
void gathered_cases(int lo, int hi) {
  std::mt19937_64 rng(0x9a7e);
  for (int trial = 0; trial < 600; ++trial) {
    const int n = 1 + trial % 11;
    const int width = trial % 3 == 0 ? hi - lo : 6;
    const int from = lo + static_cast<int>(rng() % static_cast<std::uint64_t>(hi - lo - width + 1));
    auto terms = random_terms<T>(rng, n, from, from + width, trial % 4 == 0);
    if (trial % 13 == 0) terms[0] = T{};
    if (trial % 29 == 0) terms[0] = rp::infinity<T>(trial % 2 == 0);
    const std::size_t stride = 3;
    std::vector<T> laid(terms.size() * stride);
    for (std::size_t r = 0; r < terms.size(); ++r) laid[r * stride] = terms[r];
    for (std::uint32_t d : {1u, static_cast<std::uint32_t>(n)}) {
      const T got = ringzero::detail::gathered_sum(laid.data(), stride, terms.size(), d);
      const T want = rp::serial_sum(terms.data(), terms.size(), d);
      CHECK(rp::bits_of(got) == rp::bits_of(want));
    }
  }
}

}  // namespace

TEST_CASE("the collective's fast paths round as round_words and serial_sum do") {
  one_word_cases<float>();
  one_word_cases<double>();
  one_word_cases<float16>();
  one_word_cases<bfloat16>();
  two_word_cases<float>();
  two_word_cases<double>();
  two_word_cases<float16>();
  two_word_cases<bfloat16>();
  rounding_mode_cases<float>(24, 8);
  rounding_mode_cases<double>(24, 8);
  rounding_mode_cases<double>(53, 16);
  gathered_cases<float>(-140, 120);
  gathered_cases<double>(-1060, 1000);
  gathered_cases<float16>(-20, 14);
  gathered_cases<bfloat16>(-130, 120);
}

TEST_CASE("gathered float sums: one pass gives serial_sum's bits on every path") {
  // detail::gathered_float_sums (the all_to_all path of a float reproducible call) adds each
  // element's terms in double where that is exact and rounds once, 16 elements at a time on
  // AVX-512. Against serial_sum, element by element, on every path: spans on both sides of the
  // exact limit (29 - ceil(log2 ranks) binades), subnormals, sums past the largest float, exact
  // zeros of either sign, averages over every world size (where the quotient rounds twice and
  // may land on a midpoint), infinities and NaN, and a rounding mode other than to nearest.
  using ringzero::reduction::simd;
  std::vector<simd> paths;
  for (const simd p : ringzero::reduction::all_simd)
    if (ringzero::reduction::simd_supported(p)) paths.push_back(p);
  MESSAGE("paths: ", paths.size());
  std::mt19937_64 rng(0x6a7);
  const float inf = std::numeric_limits<float>::infinity();
  std::size_t fast = 0;
  for (int trial = 0; trial < 240; ++trial) {
    const std::size_t ranks = 1 + static_cast<std::size_t>(trial % 9);
    const std::size_t n = 1 + rng() % 70;
    const std::size_t stride = n + rng() % 5;
    const int limit = ringzero::detail::gathered_float_span(ranks);
    // Exponents over a window just under, at or just over the exact limit, placed anywhere from
    // the subnormals to the top of the range.
    const int width = limit - 1 + trial % 4;
    const int lo = trial % 5 == 0 ? -149 : trial % 5 == 1 ? 127 - width : -120 + trial % 200;
    std::vector<float> t(ranks * stride, 0.0f);
    for (std::size_t r = 0; r < ranks; ++r)
      for (std::size_t i = 0; i < n; ++i) {
        const double m = 1.0 + static_cast<double>(rng() % (1u << 23)) / (1u << 23);
        const int e = lo + static_cast<int>(rng() % static_cast<std::uint64_t>(width + 1));
        float v = static_cast<float>(std::ldexp((rng() & 1) != 0 ? -m : m, std::min(e, 127)));
        if (rng() % 23 == 0) v = (rng() & 1) != 0 ? -0.0f : 0.0f;
        if (trial % 7 == 3 && rng() % 29 == 0) v = (rng() & 1) != 0 ? inf : -inf;
        // NaNs with and without a payload, of either sign: the result is one NaN's bits.
        if (trial % 11 == 5 && rng() % 37 == 0)
          v = (rng() & 1) != 0 ? std::numeric_limits<float>::quiet_NaN()
                               : std::bit_cast<float>(0xffc01234u);
        t[r * stride + i] = v;
      }
    // Most elements reach both ends of the window, with odd significands: a sum that needs
    // every bit of the span, where the double additions stop being exact just past the limit.
    if (ranks >= 2)
      for (std::size_t i = 0; i < n; ++i) {
        if (rng() % 4 == 0) continue;
        const auto odd = [&] {
          return 1.0 + static_cast<double>((rng() % (1u << 22)) * 2 + 1) / (1u << 23);
        };
        t[i] = static_cast<float>(std::ldexp(odd(), std::min(lo + width, 127)));
        t[stride + i] = static_cast<float>(std::ldexp((rng() & 1) != 0 ? -odd() : odd(), lo));
        // The worst case: an all-ones significand on top, the same sign below, so the sum
        // carries into one more bit.
        if (i % 4 == 1) {
          t[i] = static_cast<float>(std::ldexp(2.0 - 0x1p-23, std::min(lo + width, 127)));
          t[stride + i] = static_cast<float>(std::ldexp(odd(), lo));
        }
      }
    // Three terms just off a float's midpoint: T, half its last bit and a small e of either
    // sign, with e from within the span to far below it. Where the double additions lose e the
    // sum lands on the midpoint and rounds to even, the wrong way for half of them. (Two terms
    // cannot do this: a double holds the sum of two floats closely enough that its conversion
    // rounds as the exact sum does.)
    if (ranks >= 3)
      for (std::size_t i = 2; i < n; i += 3) {
        const int e0 = std::clamp(lo + width, -100, 100);
        t[i] = static_cast<float>(
            std::ldexp(1.0 + static_cast<double>(rng() % (1u << 23)) * 0x1p-23, e0));
        t[stride + i] = static_cast<float>(std::ldexp(1.0, e0 - 24));
        t[2 * stride + i] = static_cast<float>(
            std::ldexp((rng() & 1) != 0 ? -1.0 : 1.0, e0 - 20 - static_cast<int>(rng() % 40)));
      }
    // Element 0's terms cancel exactly where they can: an exact zero, +0 whatever the signs.
    if (ranks % 2 == 0)
      for (std::size_t r = 0; r < ranks; r += 2) t[(r + 1) * stride] = -t[r * stride];
    for (std::uint32_t d : {1u, static_cast<std::uint32_t>(ranks)}) {
      std::vector<float> want(n);
      std::vector<float> terms(ranks);
      for (std::size_t i = 0; i < n; ++i) {
        for (std::size_t r = 0; r < ranks; ++r) terms[r] = t[r * stride + i];
        want[i] = rp::serial_sum(terms.data(), ranks, d);
        float quick = 0;
        fast += ringzero::detail::gathered_float_sum(&t[i], stride, ranks, limit, d, quick) ? 1 : 0;
      }
      for (const simd p : paths) {
        for (const int mode : {FE_TONEAREST, FE_UPWARD}) {
          std::vector<float> got(n, 1.5f);
          const int saved = std::fegetround();
          REQUIRE(std::fesetround(mode) == 0);
          ringzero::detail::gathered_float_sums(p, t.data(), stride, ranks, n, d, got.data());
          std::fesetround(saved);
          for (std::size_t i = 0; i < n; ++i) {
            CAPTURE(trial);
            CAPTURE(ranks);
            CAPTURE(d);
            CAPTURE(i);
            CAPTURE(ringzero::reduction::simd_name(p));
            CAPTURE(mode);
            REQUIRE(rp::bits_of(got[i]) == rp::bits_of(want[i]));
          }
        }
      }
    }
  }
  // Most elements take the double additions, or this tested only the fallback.
  MESSAGE("elements summed in double: ", fast);
  CHECK(fast > 4000);
}

TEST_CASE("gathered float sums: averages that are ties between two floats") {
  // Three terms whose exact average is the midpoint m between two floats, lo and its successor:
  // 2 + (1 + 3k 2^-23) + 3 2^-24 = 3 (lo + 2^-24) with lo = 1 + k 2^-23. The quotient in double is
  // m itself, and the result must be the tie broken to even, as serial_sum breaks it, on every
  // path and for either sign.
  using ringzero::reduction::simd;
  std::mt19937_64 rng(0x3d);
  int checked = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const std::uint64_t k = rng() % ((1u << 23) / 3);
    const float base[3] = {2.0f, static_cast<float>(1.0 + static_cast<double>(3 * k) * 0x1p-23),
                           3 * 0x1p-24f};
    for (const float sign : {1.0f, -1.0f}) {
      // 16 copies of the element, so the AVX-512 loop sees it too.
      std::vector<float> t(3 * 16);
      for (std::size_t r = 0; r < 3; ++r)
        for (std::size_t i = 0; i < 16; ++i) t[r * 16 + i] = sign * base[(r + i) % 3];
      const float terms[3] = {sign * base[0], sign * base[1], sign * base[2]};
      const float want = rp::serial_sum(terms, 3, 3);
      REQUIRE(static_cast<double>(want) !=
              sign * (1.0 + static_cast<double>(k) * 0x1p-23 + 0x1p-24));  // it is a tie
      for (const simd p : ringzero::reduction::all_simd) {
        if (!ringzero::reduction::simd_supported(p)) continue;
        std::vector<float> got(16);
        ringzero::detail::gathered_float_sums(p, t.data(), 16, 3, 16, 3, got.data());
        for (const float g : got) {
          CAPTURE(trial);
          REQUIRE(rp::bits_of(g) == rp::bits_of(want));
        }
        ++checked;
      }
    }
  }
  CHECK(checked >= 400);
}

TEST_CASE("gathered float sums of two terms: any two floats, no exponent test") {
  // Two ranks take gathered_pair_sums: the sum rounded to double and then to float, with no
  // lane left to the integer path, on the argument that the second rounding cannot go the wrong
  // way for two terms. Against serial_sum: random bit patterns (every exponent, subnormals,
  // infinities, NaNs with payloads), and pairs built to land next to a float's midpoint, where
  // a double rounding would show: b within a few of its last bits of half a's last bit, of
  // either sign, at spans far past the exact limit. Sum and average, every path.
  using ringzero::reduction::simd;
  std::mt19937_64 rng(0x2a1);
  constexpr std::size_t n = 4099;  // the vector loops and a tail
  std::vector<float> t(2 * n);
  std::size_t checked = 0;
  for (int trial = 0; trial < 24; ++trial) {
    for (std::size_t i = 0; i < n; ++i) {
      if (trial % 2 == 0) {
        t[i] = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
        t[n + i] = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
        if (i % 3 == 0)  // exponents near each other too, where the sums are exact
          t[n + i] = std::bit_cast<float>((std::bit_cast<std::uint32_t>(t[i]) & 0xff800000u) ^
                                          static_cast<std::uint32_t>(rng() & 0x807fffffu));
        continue;
      }
      // a with a random significand; b = +-(half a's last bit) * (1 + small), 2^-k apart.
      const int e = -100 + static_cast<int>(rng() % 200);
      const double a = std::ldexp(1.0 + static_cast<double>(rng() % (1u << 23)) * 0x1p-23, e);
      const int k = static_cast<int>(rng() % 40);
      const double off = std::ldexp(static_cast<double>(static_cast<int>(rng() % 7) - 3), -k);
      const double b = std::ldexp(1.0 + off * 0x1p-20, e - 24);
      t[i] = static_cast<float>((rng() & 1) != 0 ? -a : a);
      t[n + i] = static_cast<float>((rng() & 1) != 0 ? -b : b);
      if (i % 5 == 0) std::swap(t[i], t[n + i]);
    }
    for (const std::uint32_t d : {1u, 2u}) {
      std::vector<float> want(n);
      for (std::size_t i = 0; i < n; ++i) {
        const float terms[2] = {t[i], t[n + i]};
        want[i] = rp::serial_sum(terms, 2, d);
      }
      for (const simd p : ringzero::reduction::all_simd) {
        if (!ringzero::reduction::simd_supported(p)) continue;
        std::vector<float> got(n, 1.5f);
        ringzero::detail::gathered_float_sums(p, t.data(), n, 2, n, d, got.data());
        for (std::size_t i = 0; i < n; ++i) {
          CAPTURE(trial);
          CAPTURE(d);
          CAPTURE(i);
          CAPTURE(ringzero::reduction::simd_name(p));
          CAPTURE(t[i]);
          CAPTURE(t[n + i]);
          REQUIRE(rp::bits_of(got[i]) == rp::bits_of(want[i]));
        }
        checked += n;
      }
    }
  }
  CHECK(checked >= 24 * 2 * n);
}
