// The compact exact accumulator (reduce/reproducible_compact.hpp): one word per element while a
// block's terms span at most 62 bits, spilled rows of grid digits beyond, and in both forms the
// sum rounded once, which must be serial_sum's (the oracle-checked exact sum of
// test_reproducible_sum) whatever the order, the pieces and the ranges of the terms.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "ringzero/detail/reproducible_call.hpp"
#include "ringzero/reduce/reproducible.hpp"
#include "ringzero/reduce/reproducible_compact.hpp"
#include "ringzero/reduce/simd.hpp"

using ringzero::bfloat16;
using ringzero::float16;
namespace rp = ringzero::reproducible;

namespace {

/// n terms: random significands with exponents in [low, low + span) (clamped to the type's
/// range), and about one in ten a signed zero or, where asked, a subnormal, an infinity or a
/// NaN.
template <class T>
std::vector<T> terms(std::mt19937_64& rng, std::size_t n, int low, int span, bool special,
                     bool subnormal = true) {
  using F = rp::format<T>;
  std::vector<T> t(n);
  for (T& x : t) {
    const auto pick = rng() % 30;
    if (pick == 0) {
      x = T(0.0f);
    } else if (pick == 1) {
      x = T(-0.0f);
    } else if (pick == 2 && special) {
      x = (rng() & 1) != 0 ? T(std::numeric_limits<float>::infinity())
                           : T(std::numeric_limits<float>::quiet_NaN());
    } else if (pick == 3 && subnormal) {
      // A subnormal of T, either sign: the low fraction bits only.
      const auto bits =
          static_cast<typename F::bits>((rng() & ((std::uint64_t{1} << (F::p - 1)) - 1)) |
                                        ((rng() & 1) << (F::exp_bits + F::p - 1)));
      x = rp::from_bits<T>(bits);
    } else {
      const auto m = static_cast<double>(rng() % (std::uint64_t{1} << F::p));
      const int e = std::clamp(low + static_cast<int>(rng() % static_cast<unsigned>(span)),
                               F::emin - F::p + 1, F::emax - F::p - 8);
      x = T(static_cast<float>(std::ldexp((rng() & 1) != 0 ? -m : m, e)));
    }
  }
  return t;
}

template <class T>
bool same(T a, T b) {
  return rp::bits_of(a) == rp::bits_of(b);
}

/// Batches of terms added in pieces at random offsets, against serial_sum element by element.
/// Returns the blocks that spilled.
template <class T>
std::size_t check_sums(std::mt19937_64& rng, std::size_t n, int batches, int low, int drift,
                       int span, bool special, bool subnormal = true) {
  rp::compact_accumulator<T> acc(n);
  std::vector<std::vector<T>> per(n);
  for (int batch = 0; batch < batches; ++batch) {
    const auto t = terms<T>(rng, n, low + drift * batch, span, special, subnormal);
    const std::size_t at = rng() % (n + 1);
    const std::size_t len = batch % 3 == 0 ? n - at : rng() % (n - at + 1);
    acc.add(std::span<const T>(t.data(), len), at);
    for (std::size_t i = 0; i < len; ++i) per[at + i].push_back(t[i]);
  }
  std::vector<T> out(n);
  acc.round(0, std::span<T>(out));
  for (std::size_t i = 0; i < n; ++i) {
    const T want = per[i].empty() ? T(0.0f) : rp::serial_sum(per[i].data(), per[i].size());
    CAPTURE(i);
    CHECK(same(out[i], want));
    CHECK(same(acc.value(i), want));
  }
  return acc.spilled_blocks();
}

}  // namespace

TEST_CASE("a compact accumulator keeps gradient-like sums in one word per element") {
  // 24 micro-batches of terms whose bits span up to 40 (a gradient block's span 36-52 bits, the
  // significands included) and no subnormals: no block spills, and every element's sum is
  // serial_sum's.
  std::mt19937_64 rng(56);
  CHECK(check_sums<float>(rng, 1000, 24, -30, 0, 16, false, false) == 0);
  CHECK(check_sums<bfloat16>(rng, 333, 24, -30, 0, 30, false, false) == 0);
  CHECK(check_sums<float16>(rng, 200, 24, -14, 0, 8, false, false) == 0);
  // Ranges that move down batch after batch: the words shift down the grid, still one each.
  CHECK(check_sums<float>(rng, 300, 12, -10, -2, 8, false, false) == 0);
}

TEST_CASE("a compact accumulator spills wide blocks and stays exact") {
  std::mt19937_64 rng(0x5b11);
  std::size_t spilled = 0;
  for (int trial = 0; trial < 60; ++trial) {
    CAPTURE(trial);
    const std::size_t n = 1 + rng() % 400;
    // Spans over the whole float range, ranges that drift either way, infinities and NaNs.
    const int low = static_cast<int>(rng() % 240) - 160;
    const int drift = static_cast<int>(rng() % 21) - 10;
    const int span = 1 + static_cast<int>(rng() % 120);
    spilled += check_sums<float>(rng, n, 10, low, drift, span, trial % 4 == 0);
    spilled += check_sums<bfloat16>(rng, n, 6, low, drift, span, trial % 5 == 0);
    spilled +=
        check_sums<float16>(rng, n, 6, -24, 1, 1 + static_cast<int>(rng() % 30), trial % 3 == 0);
  }
  CHECK(spilled > 100);
  // Terms 2^100 apart in one block must spill, and do.
  rp::compact_accumulator<float> acc(64);
  const std::vector<float> wide{std::ldexp(1.0f, 60), std::ldexp(1.0f, -60), -std::ldexp(1.0f, 60)};
  acc.add(std::span<const float>(wide));
  CHECK(acc.spilled_blocks() == 1);
  CHECK(acc.value(1) == std::ldexp(1.0f, -60));
  CHECK(acc.value(2) == -std::ldexp(1.0f, 60));
  CHECK(acc.value(63) == 0.0f);
}

TEST_CASE("a compact accumulator: clear, words held elsewhere, and pieces past the end") {
  std::vector<std::int64_t> words(130, 0x5555);  // stale words: clear() means they are not read
  rp::compact_accumulator<float> acc{std::span<std::int64_t>(words)};
  const std::vector<float> a{1.5f, -2.25f, 3.0f};
  acc.add(std::span<const float>(a), 127);
  CHECK(acc.value(0) == 0.0f);
  CHECK(acc.value(127) == 1.5f);
  CHECK(acc.value(129) == 3.0f);
  CHECK(words[128] != 0x5555);
  acc.clear();
  acc.add(std::span<const float>(a).subspan(0, 1), 126);
  CHECK(acc.value(127) == 0.0f);
  CHECK(acc.value(126) == 1.5f);
  CHECK_THROWS_AS(acc.add(std::span<const float>(a), 128), ringzero::invalid_argument);
}

TEST_CASE("a compact accumulator writes grid digits that round to its sums") {
  // The combine interface (detail/reproducible_combine.hpp): windows, then digits over them,
  // summed with another accumulator's as integers, round to the exact sum of both sets of terms
  // -- a compact block next to a spilled one, the windows of one wider than its own.
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    CAPTURE(trial);
    const std::size_t n = 1 + rng() % 300;
    rp::compact_accumulator<float> a(n), b(n);
    std::vector<std::vector<float>> per(n);
    for (int batch = 0; batch < 5; ++batch)
      for (auto* acc : {&a, &b}) {
        const auto t = terms<float>(rng, n, static_cast<int>(rng() % 100) - 70,
                                    1 + static_cast<int>(rng() % 50), trial % 6 == 0);
        acc->add(std::span<const float>(t));
        for (std::size_t i = 0; i < n; ++i) per[i].push_back(t[i]);
      }
    if (trial % 2 == 0) a.normalize();
    std::vector<std::int32_t> wa, wb;
    a.windows(wa);
    b.windows(wb);
    for (std::size_t i = 0; i < wa.size(); ++i) wa[i] = std::max(wa[i], wb[i]);
    const std::size_t len = ringzero::detail::digits_between(wa, 0, n);
    std::vector<std::int64_t> qa(len), qb(len), ca(n), cb(n);
    a.write(wa, 0, n, qa.data());
    b.write(wa, 0, n, qb.data());
    for (std::size_t i = 0; i < len; ++i) qa[i] += qb[i];
    std::vector<float> out(n);
    ringzero::detail::read_digits(qa.data(), wa, 0, n, 1, out.data());
    if (wa.back() != 0) {
      a.write_specials(0, n, ca.data());
      b.write_specials(0, n, cb.data());
      for (std::size_t i = 0; i < n; ++i) ca[i] += cb[i];
      ringzero::detail::apply_specials(ca.data(), n, out.data());
    }
    CHECK(a.max_adds() >= 1);
    for (std::size_t i = 0; i < n; ++i)
      CHECK(same(out[i], rp::serial_sum(per[i].data(), per[i].size())));
  }
}

TEST_CASE("a spilled block carries its digits before they could overflow") {
  // 2^23 + 8 terms just under 2^40 in one digit would pass 2^63 there; the block carries its
  // digits at 2^22 adds. The 2^-100 term makes the block spill (its bits span 140).
  rp::compact_accumulator<float> acc(1);
  const float tiny = std::ldexp(1.0f, -100);
  acc.add(std::span<const float>(&tiny, 1));
  const float big = std::ldexp(16777215.0f, 16);
  constexpr std::int64_t k = (std::int64_t{1} << 23) + 8;
  for (std::int64_t i = 0; i < k; ++i) acc.add(std::span<const float>(&big, 1));
  CHECK(acc.spilled_blocks() == 1);
  const double exact = static_cast<double>(k) * 16777215.0 * 65536.0;  // exact in double
  CHECK(acc.value(0) == static_cast<float>(exact));
}

TEST_CASE("a compact accumulator: an element's infinities and NaNs as IEEE addition has them") {
  const float inf = std::numeric_limits<float>::infinity();
  rp::compact_accumulator<float> acc(4);
  for (int i = 0; i < 3; ++i) {
    const std::vector<float> t{
        inf, -inf, 1.0f, i == 1 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, -90)};
    acc.add(std::span<const float>(t));
  }
  const std::vector<float> t{-inf, 2.0f, 3.0f, 1.0f};
  acc.add(std::span<const float>(t));
  CHECK(acc.value(0) != acc.value(0));  // +inf and -inf: NaN
  CHECK(acc.value(1) == -inf);
  CHECK(acc.value(2) == 6.0f);
  CHECK(acc.value(3) != acc.value(3));
  CHECK(acc.spilled_blocks() == 1);  // 2^-90 beside 1.0 (the tags took no rows)
}

TEST_CASE("a compact accumulator holds the same words on every path of the host loops") {
  // The AVX-512 loop (reduce/detail/reproducible_compact_x86.hpp) against the scalar one: the
  // same heads and words, not merely the same sums, over pieces that start and end mid-block,
  // ranges that move (shifts), and terms that spill or are infinite (the vector loop hands
  // those blocks back).
  using ringzero::reduction::simd;
  std::vector<simd> paths;
  for (const simd p : ringzero::reduction::all_simd)
    if (ringzero::reduction::simd_supported(p)) paths.push_back(p);
  MESSAGE("paths compared with the scalar one: ", paths.size() - 1);
  std::mt19937_64 rng(0xc0de);
  for (int trial = 0; trial < 100; ++trial) {
    CAPTURE(trial);
    const std::size_t n = 1 + rng() % 500;
    std::vector<rp::compact_accumulator<float>> acc;
    for (std::size_t p = 0; p < paths.size(); ++p) acc.emplace_back(n);
    for (int batch = 0; batch < 8; ++batch) {
      const auto t = terms<float>(rng, n, static_cast<int>(rng() % 120) - 90,
                                  1 + static_cast<int>(rng() % (trial % 3 == 0 ? 80 : 20)),
                                  trial % 5 == 0, trial % 4 == 0);
      const std::size_t at = batch % 2 == 0 ? 0 : rng() % (n + 1);
      const std::size_t len = batch % 2 == 0 ? n : rng() % (n - at + 1);
      for (std::size_t p = 0; p < paths.size(); ++p)
        acc[p].add(paths[p], std::span<const float>(t.data(), len), at);
    }
    const rp::compact_view v0 = acc[0].view();
    for (std::size_t p = 1; p < paths.size(); ++p) {
      CAPTURE(ringzero::reduction::simd_name(paths[p]));
      const rp::compact_view v = acc[p].view();
      for (std::size_t b = 0; b < rp::blocks(n); ++b) {
        REQUIRE(v.heads[b].lo == v0.heads[b].lo);
        REQUIRE(v.heads[b].spill == v0.heads[b].spill);
        CHECK(v.heads[b].bound == v0.heads[b].bound);
        if (v.heads[b].lo == rp::empty || v.heads[b].spill >= 0) continue;
        for (std::size_t e = b * rp::block_elems; e < std::min(n, (b + 1) * rp::block_elems); ++e) {
          CHECK(v.words[e] == v0.words[e]);
          CHECK(rp::magnitude(v.words[e]) <= v.heads[b].bound);  // the bound holds
        }
      }
      for (std::size_t i = 0; i < n; ++i) CHECK(same(acc[p].value(i), acc[0].value(i)));
    }
  }
}
