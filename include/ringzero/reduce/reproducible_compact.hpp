// An exact running sum in one int64 word per element: what reproducible training keeps for the
// gradient elements a rank owns (zero/exact_gradients.hpp), on the host and on the device.
//
// reproducible::accumulator lays its digits on one grid for every rank (40-bit digits at fixed
// bit positions), so two ranks' accumulators add as integers; a float term straddles two of them
// more often than not, and a block typically holds two or three words per element. An owner's
// accumulator is combined with nobody's (the terms travel to it as they are), so it may choose
// its own grid: a block of 64 elements keeps one word per element in units of 2^lo, lo being the
// lowest bit any of its terms has, and the words stay exact while the block's terms span at
// most 62 bits (gradients span 36-52 within a block). A block whose terms reach further spills:
// its words move to rows of 40-bit grid digits taken from a pool (one row per digit, as many
// digits as the block's range needs), and later terms go there. Both forms hold the exact
// integer, so the rounded sum does not depend on when, or whether, a block spilled.
//
// An element that meets an infinity or a NaN keeps only those: its word becomes a tag (the top
// bits 10, which no finite word has) over the counts of +inf, -inf and NaN (special_code, 20
// bits each at most: 2^20 terms per element), and it rounds to what IEEE addition gives,
// whatever its finite terms were. So infinities take no spill rows, however many there are.
//
// Everything per element and per block is __host__ __device__ (compact_view and the functions
// over it, reduce/detail/reproducible_compact_block.hpp): the host loops and the CUDA kernels
// (kernels/cuda/exact_accumulator.cuh) run the same functions over the same arrays, so the
// device's words are the host's. compact_accumulator is the host's owner of those arrays: it
// grows the spill pool as blocks spill. A device's pool has the size it was given; a block that
// finds it full marks the pool failed instead of adding.
//
// For combining with other ranks (hybrid sharding: the owners of one shard in several groups)
// compact_accumulator offers reproducible::accumulator's combine interface (windows, write,
// write_specials, max_adds, normalize): the words are written out as grid digits then.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/reduce/detail/gathered.hpp"
#include "ringzero/reduce/detail/reproducible_compact_block.hpp"
#include "ringzero/reduce/detail/reproducible_compact_x86.hpp"
#include "ringzero/reduce/reproducible.hpp"
#include "ringzero/reduce/simd.hpp"

namespace ringzero::reproducible {

/// An exact running sum of n elements in host memory (see the header comment): each add() is
/// exact, and the rounded sum depends on nothing but the terms added since clear().
template <class T>
class compact_accumulator {
  static_assert(supported_v<T> && format<T>::p <= 24,
                "compact_accumulator: float, bfloat16 or float16 (a spilled block holds float's "
                "whole range)");

 public:
  compact_accumulator() = default;
  /// n elements, words owned here.
  explicit compact_accumulator(std::size_t n) : own_(n) { attach(own_, n); }
  /// n elements whose words live in `words` (at least n of them), which must outlive this.
  explicit compact_accumulator(std::span<std::int64_t> words) { attach_words(words); }

  /// The arrays of a compact_view copied out of device memory (the spill pool's records and
  /// rows in use), as an accumulator to combine on the host.
  [[nodiscard]] static compact_accumulator adopt(std::vector<std::int64_t> words,
                                                 std::vector<compact_head> heads,
                                                 std::vector<spill_record> records,
                                                 std::vector<std::int64_t> rows) {
    compact_accumulator a;
    a.own_ = std::move(words);
    a.words_ = a.own_.data();
    a.n_ = a.own_.size();
    a.heads_ = std::move(heads);
    a.records_ = std::move(records);
    a.rows_ = std::move(rows);
    a.counts_[0] = static_cast<std::uint32_t>(a.records_.size());
    a.counts_[1] = static_cast<std::uint32_t>(a.rows_.size() / block_elems);
    if (a.heads_.size() != blocks(a.n_))
      throw invalid_argument(
          fmt::format("reproducible::compact_accumulator::adopt: {} heads for {} elements",
                      a.heads_.size(), a.n_));
    return a;
  }

  compact_accumulator(const compact_accumulator&) = delete;
  compact_accumulator& operator=(const compact_accumulator&) = delete;
  compact_accumulator(compact_accumulator&&) noexcept = default;
  compact_accumulator& operator=(compact_accumulator&&) noexcept = default;

  [[nodiscard]] std::size_t size() const noexcept { return n_; }

  /// Forgets every term; keeps the memory. The words are not touched (heads say they are unset).
  void clear() noexcept {
    std::fill(heads_.begin(), heads_.end(), compact_head{});
    counts_[0] = counts_[1] = counts_[2] = 0;
  }

  /// Adds terms[i] to element offset + i.
  void add(std::span<const T> terms, std::size_t offset = 0) {
    add(reduction::active_simd(), terms, offset);
  }
  /// add on a given path of the host loops (tests compare them: the words are the same on
  /// each); a path that reduction::simd_supported denies is an invalid_argument.
  void add(reduction::simd path, std::span<const T> terms, std::size_t offset = 0) {
    if (!reduction::simd_supported(path))
      throw invalid_argument(fmt::format(
          "reproducible::compact_accumulator::add: this CPU or build cannot run the {} path",
          reduction::simd_name(path)));
    if (offset > n_ || terms.size() > n_ - offset)
      throw invalid_argument(
          fmt::format("reproducible::compact_accumulator::add: {} terms at {} pass the end of {} "
                      "elements",
                      terms.size(), offset, n_));
    for (std::size_t i = 0; i < terms.size();) {
      const std::size_t e = offset + i;
      const std::size_t b = e / block_elems;
      const std::size_t m = std::min(terms.size() - i, (b + 1) * block_elems - e);
      add_block(path, b, terms.data() + i, e - b * block_elems, m);
      i += m;
    }
  }

  /// Element e's sum so far, rounded.
  [[nodiscard]] T value(std::size_t e) const noexcept { return compact_round<T>(view(), e); }
  /// Elements [from, from + out.size()) rounded into out.
  void round(std::size_t from, std::span<T> out) const noexcept {
    const compact_view v = view();
    for (std::size_t i = 0; i < out.size(); ++i) {
      // A compact word is one integer: round_int64's integer rounding (compact_round's bits)
      // where the result is a normal number.
      const compact_head h = heads_[(from + i) / block_elems];
      const std::int64_t w = words_[from + i];
      if (h.lo == empty || h.spill >= 0 || is_special(w) ||
          !ringzero::detail::round_int64<T>(w, h.lo, 1, out[i]))
        out[i] = compact_round<T>(v, from + i);
    }
  }

  /// Blocks that spilled (a measure for tests and the docs).
  [[nodiscard]] std::size_t spilled_blocks() const noexcept { return counts_[0]; }
  /// Bytes held: words (where owned), heads, and the spill pool's capacity.
  [[nodiscard]] std::size_t bytes() const noexcept {
    return own_.capacity() * sizeof(std::int64_t) + heads_.capacity() * sizeof(compact_head) +
           records_.capacity() * sizeof(spill_record) + rows_.capacity() * sizeof(std::int64_t);
  }
  /// The arrays, as the per-element functions take them.
  [[nodiscard]] compact_view view() const noexcept {
    compact_view v;
    v.words = words_;
    v.heads = const_cast<compact_head*>(heads_.data());
    v.n = n_;
    v.pool.records = const_cast<spill_record*>(records_.data());
    v.pool.rows = const_cast<std::int64_t*>(rows_.data());
    v.pool.record_cap = static_cast<std::uint32_t>(records_.size());
    v.pool.row_cap = static_cast<std::uint32_t>(rows_.size() / block_elems);
    v.pool.counts = const_cast<std::uint32_t*>(counts_);
    return v;
  }

  // --- reproducible::accumulator's combine interface (detail/reproducible_combine.hpp) ------

  /// Terms each digit written by write() may hold: 1 for a compact block (its words cut into
  /// digits under 2^40), the spill record's count otherwise.
  [[nodiscard]] std::int64_t max_adds() const noexcept {
    std::int64_t m = 1;
    for (std::uint32_t i = 0; i < counts_[0]; ++i) m = std::max<std::int64_t>(m, records_[i].adds);
    return m;
  }
  /// Carries spilled digits so that the headroom starts over.
  void normalize() {
    for (std::size_t b = 0; b < heads_.size(); ++b) {
      if (heads_[b].lo == empty || heads_[b].spill < 0) continue;
      reserve(0, 1);
      const compact_view v = view();
      if (!spill_normalize(v.pool, v.pool.records[heads_[b].spill], block_len(b)))
        throw invalid_argument(
            "reproducible::compact_accumulator: a block's sum spans beyond every supported "
            "type's range");
    }
  }
  /// Each block's grid window, then the inf/NaN flag: 2 * blocks + 1 int32, to be max-reduced.
  void windows(std::vector<std::int32_t>& win) const {
    const compact_view v = view();
    win.assign(2 * heads_.size() + 1, empty);
    bool special = false;
    for (std::size_t b = 0; b < heads_.size(); ++b) {
      const window w = compact_block_window(v, b, special);
      win[2 * b] = w.top;
      win[2 * b + 1] = w.neg_low;
    }
    win.back() = special ? 1 : 0;
  }
  /// Elements [from, to)'s digits over the agreed windows, element after element, into q.
  void write(const std::vector<std::int32_t>& win, std::size_t from, std::size_t to,
             std::int64_t* q) const {
    const compact_view v = view();
    for (std::size_t e = from; e < to; ++e) {
      const window w = window_at(win.data(), e / block_elems);
      const int n = words(w);
      for (int k = 0; k < n; ++k) *q++ = compact_digit(v, e, w.low(), k);
    }
  }
  /// Elements [from, to)'s inf/NaN counts.
  void write_specials(std::size_t from, std::size_t to, std::int64_t* codes) const {
    const compact_view v = view();
    for (std::size_t e = from; e < to; ++e) codes[e - from] = compact_special(v, e);
  }

 private:
  void attach(std::vector<std::int64_t>& words, std::size_t n) {
    words_ = words.data();
    n_ = n;
    heads_.assign(blocks(n), compact_head{});
  }
  void attach_words(std::span<std::int64_t> words) {
    words_ = words.data();
    n_ = words.size();
    heads_.assign(blocks(n_), compact_head{});
  }

  [[nodiscard]] std::size_t block_len(std::size_t b) const noexcept {
    return std::min(block_elems, n_ - b * block_elems);
  }

  void add_block(reduction::simd path, std::size_t b, const T* x, std::size_t first,
                 std::size_t m) {
    if (add_compact(path, b, x, first, m)) return;
    // A block spilling may take a record and a row for every digit.
    reserve(1, spill_digits);
    if (!compact_block_add(view(), b, x, first, m))
      throw invalid_argument(
          "reproducible::compact_accumulator: a block's terms span beyond every supported "
          "type's range");
  }

  /// compact_block_add's common case, without branches on the data: a compact block, finite
  /// terms, no tag among its words, and room for the terms. The same words (the same steps, on
  /// the bit fields directly); false, having changed nothing, for every other case.
  bool add_compact(reduction::simd path, std::size_t b, const T* x, std::size_t first,
                   std::size_t m) noexcept {
    using F = format<T>;
    constexpr int frac_bits = F::p - 1;
    constexpr std::uint32_t exp_all = (1u << F::exp_bits) - 1;
    constexpr int bias = F::emax + frac_bits;  // a term is mant * 2^(max(e, 1) - bias)
    compact_head& h = heads_[b];
    if (h.spill != compact_plain) return false;
#if RINGZERO_X86_SIMD
    if constexpr (std::is_same_v<T, float>)
      if (path == reduction::simd::avx512 && m == block_elems) return add_compact64(h, b, x);
#else
    (void)path;
#endif
    const auto split = [](T v, std::uint32_t& mant, int& exp) {
      const auto bits = static_cast<std::uint32_t>(bits_of(v));
      const std::uint32_t e = (bits >> frac_bits) & exp_all;
      const std::uint32_t f = bits & ((1u << frac_bits) - 1);
      mant = e == exp_all ? 0 : (f | (e != 0 ? 1u << frac_bits : 0u));
      exp = static_cast<int>(e != 0 ? e : 1) - bias;
      return e == exp_all;
    };
    int lo = INT32_MAX, top = INT32_MIN;
    bool special = false;
    for (std::size_t i = 0; i < m; ++i) {
      std::uint32_t mant = 0;
      int exp = 0;
      special |= split(x[i], mant, exp);
      const bool live = mant != 0;
      // countr_zero and bit_width of a zero mantissa only feed a value `live` discards.
      const int low = exp + std::countr_zero(mant | (1u << 31));
      const int high = exp + static_cast<int>(std::bit_width(mant));
      lo = std::min(lo, live ? low : INT32_MAX);
      top = std::max(top, live ? high : INT32_MIN);
    }
    if (special) return false;
    if (lo > top) return true;  // only zeros
    std::int64_t* w = words_ + b * block_elems;
    const std::size_t len = block_len(b);
    term_range r;
    r.lo = lo;
    r.top = top;
    const std::uint64_t most = h.lo == empty ? 0 : h.bound;
    const compact_plan p = plan_compact(h, most, r);
    if (!p.fits) return false;  // compact_block_add reads the words for a tighter bound
    h.bound = compact_bound(h, most, p, r);
    if (h.lo == empty)
      std::fill_n(w, len, std::int64_t{0});
    else if (p.shift > 0)
      for (std::size_t e = 0; e < len; ++e)
        w[e] = static_cast<std::int64_t>(static_cast<std::uint64_t>(w[e]) << p.shift);
    h.lo = p.lo;
    std::int64_t* out = w + first;
    for (std::size_t i = 0; i < m; ++i) {
      std::uint32_t mant = 0;
      int exp = 0;
      (void)split(x[i], mant, exp);
      const auto sign = std::uint64_t{0} -
                        (static_cast<std::uint64_t>(bits_of(x[i])) >> (F::exp_bits + frac_bits));
      // exp - lo is at least -(trailing zeros) for a nonzero term: exact either way. A zero
      // term's exponent lies outside the plan, so its shift could reach past 63 (undefined).
      const int s = exp - p.lo;
      const std::uint64_t v =
          mant == 0 ? 0 : (std::uint64_t{mant} >> std::max(0, -s)) << std::max(0, s);
      out[i] += static_cast<std::int64_t>((v ^ sign) - sign);
    }
    return true;
  }

#if RINGZERO_X86_SIMD
  /// add_compact over a whole block of floats, on AVX-512.
  bool add_compact64(compact_head& h, std::size_t b, const T* x) noexcept {
    namespace v = detail::x86::avx512;
    const v::block_range range = v::range64(x);
    if (range.special) return false;
    if (range.lo > range.top) return true;  // only zeros
    std::int64_t* w = words_ + b * block_elems;
    term_range r;
    r.lo = range.lo;
    r.top = range.top;
    const std::uint64_t most = h.lo == empty ? 0 : h.bound;
    const compact_plan p = plan_compact(h, most, r);
    if (!p.fits) return false;  // compact_block_add reads the words for a tighter bound
    h.bound = compact_bound(h, most, p, r);
    if (h.lo == empty)
      std::fill_n(w, block_elems, std::int64_t{0});
    else if (p.shift > 0)
      v::shift64(w, p.shift);
    h.lo = p.lo;
    v::add64(x, p.lo, w);
    return true;
  }
#endif

  /// Room for `records` more records and `rows` more rows.
  void reserve(std::size_t records, std::size_t rows) {
    if (counts_[0] + records > records_.size())
      records_.resize(std::max<std::size_t>(2 * records_.size(), counts_[0] + records));
    const std::size_t have = rows_.size() / block_elems;
    if (counts_[1] + rows > have)
      rows_.resize(std::max<std::size_t>(2 * have, counts_[1] + rows) * block_elems);
  }

  std::vector<std::int64_t> own_;
  std::int64_t* words_ = nullptr;
  std::size_t n_ = 0;
  std::vector<compact_head> heads_;
  std::vector<spill_record> records_;
  std::vector<std::int64_t> rows_;
  std::uint32_t counts_[3] = {0, 0, 0};
};

}  // namespace ringzero::reproducible
