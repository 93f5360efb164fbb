// An exact running sum of many terms per element, for sums that are built up before the ranks
// meet: micro-batch gradients in reproducible training, a global norm's squares. Each element
// holds signed 40-bit digits on one grid shared by every rank and every call (digit j holds the
// bits [40j, 40j+40)), so adding a term never rounds and never depends on what came before; a
// block of 64 elements keeps only the digits its terms have touched, and grows when a new term
// reaches past them.
//
// The ranks then combine accumulators with the passes of reduce/reproducible.hpp: `windows`
// describes each block (the digit range, as a grid-aligned window, plus the inf/NaN flag); after
// an elementwise max over the ranks, `write` lays out every element's digits over the agreed
// range, integer sums combine them (in any grouping: reduce_scatter in a shard group, then
// all_reduce across replicas), and `round_words` rounds each element once. The result is the
// exact sum of every term on every rank, rounded once: it does not depend on how the terms were
// spread over ranks or micro-batches.
//
// Headroom: a word may take 2^23 terms before it could overflow. A block normalizes itself
// (carries its words back into 40 bits) before it gets there, so one accumulator takes any
// number of terms; ranks whose max_adds() add up past max_terms call normalize() before they
// combine (reduce_accumulator does).
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/reduce/detail/reproducible_x86.hpp"
#include "ringzero/reduce/reproducible.hpp"
#include "ringzero/reduce/simd.hpp"

namespace ringzero::reproducible {

/// Floor division for the digit index of a bit position.
[[nodiscard]] constexpr int digit_of_bit(int bit) noexcept {
  return bit >= 0 ? bit / digit_bits : -((-bit + digit_bits - 1) / digit_bits);
}

template <class T>
class accumulator {
  static_assert(supported_v<T>, "accumulator: float, double, bfloat16 or float16");

 public:
  accumulator() = default;
  explicit accumulator(std::size_t n) { resize(n); }

  void resize(std::size_t n) {
    n_ = n;
    blocks_.assign(reproducible::blocks(n), block{});
  }
  [[nodiscard]] std::size_t size() const noexcept { return n_; }
  /// The most terms any block's words may hold now: a bound on the headroom in use. Ranks
  /// whose bounds add up past max_terms must normalize() before combining.
  [[nodiscard]] std::int64_t max_adds() const noexcept {
    std::int64_t m = 0;
    for (const block& b : blocks_) m = std::max(m, b.adds);
    return m;
  }

  /// Forgets every term; keeps the memory.
  void clear() {
    for (block& b : blocks_) {
      b.words.clear();
      b.jlo = 0;
      b.k = 0;
      b.adds = 0;
      b.codes.clear();
    }
  }

  /// Adds terms[i] to element offset + i.
  void add(std::span<const T> terms, std::size_t offset = 0) {
    add(reduction::active_simd(), terms, offset);
  }
  /// add on a given path of the host loops (tests and benchmarks compare them: the words are the
  /// same on each); a path that reduction::simd_supported denies is an invalid_argument.
  void add(reduction::simd path, std::span<const T> terms, std::size_t offset = 0) {
    if (!reduction::simd_supported(path))
      throw invalid_argument(
          fmt::format("reproducible::accumulator::add: this CPU or build "
                      "cannot run the {} path",
                      reduction::simd_name(path)));
    if (offset > n_ || terms.size() > n_ - offset)
      throw invalid_argument(
          fmt::format("reproducible::accumulator::add: {} terms at {} pass the "
                      "end of {} elements",
                      terms.size(), offset, n_));
    std::size_t i = 0;
    while (i < terms.size()) {
      const std::size_t e = offset + i;
      const std::size_t b = e / block_elems;
      const std::size_t end = std::min(terms.size(), i + (block_elems - e % block_elems));
      add_block(path, blocks_[b], b * block_elems, terms.subspan(i, end - i), e);
      i = end;
    }
  }

  /// Carries every word into [0, 2^40) but a signed top one, so the headroom starts over.
  void normalize() {
    for (std::size_t bi = 0; bi < blocks_.size(); ++bi) normalize_block(blocks_[bi], block_len(bi));
  }

  /// Each block's window (grid-aligned: words(window) is its digit count) and, last, whether
  /// any element holds an infinity or NaN: 2 * blocks + 1 int32, to be max-reduced.
  void windows(std::vector<std::int32_t>& win) const {
    win.assign(2 * blocks_.size() + 1, empty);
    std::int32_t special = 0;
    for (std::size_t bi = 0; bi < blocks_.size(); ++bi) {
      const block& b = blocks_[bi];
      special |= !b.codes.empty();
      if (b.k == 0) continue;
      win[2 * bi] = digit_bits * (b.jlo + b.k);
      win[2 * bi + 1] = -digit_bits * b.jlo;
    }
    win.back() = special;
  }

  /// Elements [from, to)'s digits over the agreed windows, element after element, into q
  /// (detail::digits_between(win, from, to) words).
  void write(const std::vector<std::int32_t>& win, std::size_t from, std::size_t to,
             std::int64_t* q) const {
    // A block at a time: its agreed words and where they fall among the digits it holds are
    // the same for each of its elements.
    for (std::size_t e = from; e < to;) {
      const std::size_t bi = e / block_elems;
      const std::size_t end = std::min(to, (bi + 1) * block_elems);
      const window w{win[2 * bi], win[2 * bi + 1]};
      const auto n = static_cast<std::size_t>(words(w));
      const int jlo = w.low() / digit_bits;  // exact: the windows are grid-aligned
      const block& b = blocks_[bi];
      const std::size_t len = block_len(bi), first = e - bi * block_elems, count = end - e;
      for (std::size_t k = 0; k < n; ++k) {
        const int j = jlo + static_cast<int>(k) - b.jlo;
        if (b.k > 0 && j >= 0 && j < b.k) {
          const std::int64_t* digit = b.words.data() + static_cast<std::size_t>(j) * len + first;
          for (std::size_t x = 0; x < count; ++x) q[x * n + k] = digit[x];
        } else {
          for (std::size_t x = 0; x < count; ++x) q[x * n + k] = 0;
        }
      }
      q += count * n;
      e = end;
    }
  }

  /// Elements [from, to)'s inf/NaN counts (special_code sums), into codes.
  void write_specials(std::size_t from, std::size_t to, std::int64_t* codes) const {
    for (std::size_t e = from; e < to; ++e) {
      const std::size_t bi = e / block_elems;
      const block& b = blocks_[bi];
      codes[e - from] = b.codes.empty() ? 0 : b.codes[e - bi * block_elems];
    }
  }

  /// Element e's sum so far, rounded (for tests and a single rank's own use).
  [[nodiscard]] T value(std::size_t e) const {
    std::vector<std::int32_t> win;
    windows(win);
    const std::size_t bi = e / block_elems;
    const window w{win[2 * bi], win[2 * bi + 1]};
    std::int64_t q[max_words] = {};
    write(win, e, e + 1, q);
    const block& b = blocks_[bi];
    if (!b.codes.empty()) {
      T out{};
      if (special_result(b.codes[e - bi * block_elems], out)) return out;
    }
    return round_words<T>(q, w);
  }

  /// Bytes held, for the memory figures the docs quote.
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t s = blocks_.size() * sizeof(block);
    for (const block& b : blocks_) s += (b.words.capacity() + b.codes.capacity()) * 8;
    return s;
  }

 private:
  struct block {
    int jlo = 0;            ///< the lowest digit held
    int k = 0;              ///< digits held per element (0: none yet)
    std::int64_t adds = 0;  ///< terms the words may hold at most (the headroom in use)
    /// Digit-major: digit j of element e at j * len + e, so that one digit of consecutive
    /// elements is one vector (reduce/detail/reproducible_x86.hpp).
    std::vector<std::int64_t> words;
    std::vector<std::int64_t> codes;  ///< inf/NaN counts, allocated at the first one
  };

  [[nodiscard]] std::size_t block_len(std::size_t bi) const noexcept {
    return std::min(block_elems, n_ - bi * block_elems);
  }

  /// Makes b hold digits [lo, hi] (inclusive), keeping what it has.
  static void grow(block& b, std::size_t len, int lo, int hi) {
    if (b.k > 0) {
      lo = std::min(lo, b.jlo);
      hi = std::max(hi, b.jlo + b.k - 1);
      if (lo == b.jlo && hi == b.jlo + b.k - 1) return;
    }
    const int k = hi - lo + 1;
    std::vector<std::int64_t> w(len * static_cast<std::size_t>(k), 0);
    if (b.k > 0)
      std::copy(
          b.words.begin(), b.words.end(),
          w.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(b.jlo - lo) * len));
    b.words = std::move(w);
    b.jlo = lo;
    b.k = k;
  }

  static void normalize_block(block& b, std::size_t len) {
    constexpr std::int64_t radix = std::int64_t{1} << digit_bits;
    if (b.k == 0) return;
    grow(b, len, b.jlo, b.jlo + b.k);  // a digit above for the carry out of the top
    const auto k = static_cast<std::size_t>(b.k);
    bool top_used = false;
    for (std::size_t e = 0; e < len; ++e) {
      std::int64_t carry = 0;
      for (std::size_t d = 0; d + 1 < k; ++d) {
        std::int64_t& w = b.words[d * len + e];
        const std::int64_t s = w + carry;
        const std::int64_t lo = s & (radix - 1);
        carry = (s - lo) >> digit_bits;
        w = lo;
      }
      b.words[(k - 1) * len + e] += carry;
      top_used = top_used || b.words[(k - 1) * len + e] != 0;
    }
    // Drop the spare digit again (the last len words) if no carry reached it: it would cost a
    // word on the wire.
    if (!top_used) {
      b.words.resize((k - 1) * len);
      b.k -= 1;
    }
    // Digits in [0, 2^40) and a top one of about one term: two terms' worth.
    b.adds = 2;
  }

  void add_block(reduction::simd path, block& b, std::size_t block_start, std::span<const T> terms,
                 std::size_t first) {
    const std::size_t len = block_len(block_start / block_elems);
    if (b.adds + 1 >= max_terms / 2) normalize_block(b, len);
    ++b.adds;
    if constexpr (format<T>::p <= 24) {
      add_narrow(path, b, len, block_start, terms, first);
      return;
    }
    (void)path;
    int lo = INT32_MAX, hi = INT32_MIN;
    for (const T& x : terms) {
      const term t = decompose(x);
      if (t.k != kind::finite) continue;
      lo = std::min(lo, digit_of_bit(t.exp));
      hi = std::max(hi, digit_of_bit(t.exp + bit_width64(t.mant) - 1));
    }
    if (hi >= lo) grow(b, len, lo, hi);
    for (std::size_t i = 0; i < terms.size(); ++i) {
      const term t = decompose(terms[i]);
      const std::size_t e = first + i - block_start;
      if (t.k == kind::finite) {
        std::int64_t* w = b.words.data() + e;
        const int from = digit_of_bit(t.exp) - b.jlo;
        const int to = digit_of_bit(t.exp + bit_width64(t.mant) - 1) - b.jlo;
        for (int d = from; d <= to; ++d)
          w[static_cast<std::size_t>(d) * len] += digit(t, digit_bits * b.jlo, d);
      } else if (t.k != kind::zero) {
        if (b.codes.empty()) b.codes.assign(len, 0);
        b.codes[e] += special_code(t);
      }
    }
  }

  /// add_block for types of at most 24 significant bits (float, bfloat16, float16), the hot
  /// loop of reproducible training: a term shifted to its place within its lowest digit fits
  /// in 63 bits, so it lands on at most two digits with one shift and no per-digit loop. The
  /// words are those digit() gives. Floats take the vector loops where the path has them
  /// (reduce/detail/reproducible_x86.hpp), which do the same per term; the rest runs here.
  void add_narrow(reduction::simd path, block& b, std::size_t len, std::size_t block_start,
                  std::span<const T> terms, std::size_t first) {
    using F = format<T>;
    constexpr int frac_bits = F::p - 1;
    constexpr std::uint32_t exp_all = (1u << F::exp_bits) - 1;
    constexpr int bias = F::emax + frac_bits;  // a term is mant * 2^(max(e, 1) - bias)
    constexpr std::uint64_t mask = (std::uint64_t{1} << digit_bits) - 1;
    // Branch-free per term: zeros and non-finite terms take mant 0 (adding nothing) at bit 0.
    const auto split = [](T x, std::uint64_t& mant, int& exp, std::uint64_t& sign) {
      const auto bits = static_cast<std::uint32_t>(bits_of(x));
      const std::uint32_t e = (bits >> frac_bits) & exp_all;
      const std::uint32_t f = bits & ((1u << frac_bits) - 1);
      mant = e == exp_all ? 0 : (f | (e != 0 ? 1u << frac_bits : 0u));
      exp = static_cast<int>(e != 0 ? e : 1) - bias;
      sign = std::uint64_t{0} - ((bits >> (frac_bits + F::exp_bits)) & 1u);
      return e == exp_all;
    };
    detail::narrow_range r;
#if RINGZERO_X86_SIMD
    if constexpr (std::is_same_v<T, float>) {
      if (path == reduction::simd::avx512)
        r = detail::x86::avx512::range(terms.data(), terms.size());
      else if (path == reduction::simd::avx2)
        r = detail::x86::avx2::range(terms.data(), terms.size());
    }
#endif
    int lo = r.lo, hi = r.hi;
    bool special = r.special;
    for (std::size_t i = r.done; i < terms.size(); ++i) {
      std::uint64_t mant = 0, sign = 0;
      int exp = 0;
      special |= split(terms[i], mant, exp, sign);
      const bool live = mant != 0;
      lo = std::min(lo, live ? exp : INT32_MAX);
      hi = std::max(hi, live ? exp + bit_width64(mant) - 1 : INT32_MIN);
    }
    if (hi >= lo) grow(b, len, digit_of_bit(lo), digit_of_bit(hi));
    if (b.k > 0) {
      const int base = digit_bits * b.jlo;
      const auto k = static_cast<std::size_t>(b.k);
      std::int64_t* words = b.words.data() + (first - block_start);
      std::size_t done = 0;
#if RINGZERO_X86_SIMD
      if constexpr (std::is_same_v<T, float>) {
        if (b.k * digit_bits <= detail::max_offset) {
          if (path == reduction::simd::avx512)
            done = detail::x86::avx512::add(terms.data(), terms.size(), base, b.k, words, len);
          else if (path == reduction::simd::avx2)
            done = detail::x86::avx2::add(terms.data(), terms.size(), base, b.k, words, len);
        }
      }
#else
      (void)path;
#endif
      for (std::size_t i = done; i < terms.size(); ++i) {
        std::uint64_t mant = 0, sign = 0;
        int exp = 0;
        (void)split(terms[i], mant, exp, sign);
        // >= 0 for every nonzero term (grow covered it); a zero lands on digit 0.
        const auto off = static_cast<unsigned>(mant != 0 ? exp - base : 0);
        const unsigned d = off / digit_bits;
        const std::uint64_t v = mant << (off % digit_bits);
        // The second digit is zero when the term ends in the top one: then add it there.
        const std::size_t d1 = std::min<std::size_t>(d + 1, k - 1);
        words[d * len + i] += static_cast<std::int64_t>(((v & mask) ^ sign) - sign);
        words[d1 * len + i] += static_cast<std::int64_t>(((v >> digit_bits) ^ sign) - sign);
      }
    }
    if (!special) return;
    for (std::size_t i = 0; i < terms.size(); ++i) {
      const term t = decompose(terms[i]);
      if (t.k == kind::finite || t.k == kind::zero) continue;
      if (b.codes.empty()) b.codes.assign(len, 0);
      b.codes[first + i - block_start] += special_code(t);
    }
  }

  std::size_t n_ = 0;
  std::vector<block> blocks_;
};

}  // namespace ringzero::reproducible
