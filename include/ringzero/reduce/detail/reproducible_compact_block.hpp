// The compact words' layout and the steps on one element and one block of them, all
// __host__ __device__: reproducible::compact_accumulator (reduce/reproducible_compact.hpp) runs
// them in the host's loops, and the CUDA kernels (kernels/cuda/exact_accumulator.cuh) one thread
// to a block, over the same arrays, so that the device's words are the host's. Apart from the
// accumulator, which owns the host's arrays (growing the spill pool, the AVX-512 path, the
// combine interface): this is the arithmetic both sides must share bit for bit.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>

#include "ringzero/reduce/reproducible.hpp"

namespace ringzero::reproducible {

/// Bits a compact word may use: two words within it add without overflow.
inline constexpr int compact_bits = 62;
/// Digits a spilled block holds at most: float's whole range (bits -149 to 152 with the carry
/// of 2^23 terms) on the 40-bit grid is 8, and a window may start one digit lower.
inline constexpr int spill_digits = 10;

/// A block's state. lo == empty: no term yet, its words are not read (they hold whatever a
/// previous use left). spill >= 0: the block's finite sums lie in that spill record, and its
/// words are 0 or an inf/NaN tag; compact_tags: compact, and some word is a tag; compact_plain:
/// compact, no tag. `bound` bounds the compact words' magnitudes, so that an add needs to read
/// them only when the bound says the block might be full.
inline constexpr std::int32_t compact_plain = -1;
inline constexpr std::int32_t compact_tags = -2;
struct compact_head {
  std::int32_t lo = empty;
  std::int32_t spill = compact_plain;
  std::uint64_t bound = 0;
};

/// A spilled block: digit jlo + d of element e at row rows[d], column e.
struct spill_record {
  std::int32_t jlo = 0;
  std::int32_t k = 0;
  std::int32_t adds = 0;  ///< terms the digits may hold at most (the headroom in use)
  std::int32_t rows[spill_digits] = {};
};

/// Terms an element may take between clears: the inf/NaN counts of a tagged word are 20 bits.
inline constexpr std::int64_t max_compact_terms = std::int64_t{1} << 20;

/// Whether a word is an inf/NaN tag (top bits 10: finite words lie in (-2^62, 2^62)).
RINGZERO_HD inline bool is_special(std::int64_t w) noexcept {
  return (w >> 62) == -2;
}

/// t (an infinity or NaN) added into word w: w becomes (or stays) a tag, its counts grown.
RINGZERO_HD inline std::int64_t with_special(std::int64_t w, const term& t) noexcept {
  const std::int64_t counts = is_special(w) ? w - INT64_MIN : 0;
  // special_code's fields (nan << 42, +inf << 21, -inf) repacked 20 bits apart under the tag.
  const std::int64_t c = special_code(t);
  const std::int64_t packed = ((c >> 42) << 40) | (((c >> 21) & 0xfffff) << 20) | (c & 0xfffff);
  return INT64_MIN + counts + packed;
}

/// A tag's counts as special_code sums them.
RINGZERO_HD inline std::int64_t tag_code(std::int64_t w) noexcept {
  const std::int64_t c = w - INT64_MIN;
  constexpr std::int64_t m = (std::int64_t{1} << 20) - 1;
  return ((c >> 40) << 42) | (((c >> 20) & m) << 21) | (c & m);
}

/// Where spilled blocks keep their digits: records and rows of block_elems words, handed out in
/// order. counts[0] and counts[1] are the records and rows taken, counts[2] nonzero once a block
/// found the pool full (its terms were not added).
struct spill_pool {
  spill_record* records = nullptr;
  std::int64_t* rows = nullptr;
  std::uint32_t record_cap = 0;
  std::uint32_t row_cap = 0;
  std::uint32_t* counts = nullptr;
};

/// The arrays of one accumulator of n elements: a word per element, a head per block.
struct compact_view {
  std::int64_t* words = nullptr;
  compact_head* heads = nullptr;
  std::size_t n = 0;
  spill_pool pool;
};

/// What a block's incoming terms need: the lowest set bit and one past the highest of its
/// finite nonzero terms (lo > top: none), and whether one is an infinity or a NaN.
struct term_range {
  int lo = INT32_MAX;
  int top = INT32_MIN;
  bool special = false;
  RINGZERO_HD inline void add(const term& t) noexcept {
    if (t.k == kind::finite) {
      const int low = t.exp + low_zeros64(t.mant);
      lo = lo < low ? lo : low;
      top = max_int(top, t.exp + bit_width64(t.mant));
    } else if (t.k != kind::zero) {
      special = true;
    }
  }
  RINGZERO_HD inline void merge(const term_range& o) noexcept {
    lo = lo < o.lo ? lo : o.lo;
    top = max_int(top, o.top);
    special = special || o.special;
  }
  [[nodiscard]] RINGZERO_HD inline bool finite() const noexcept { return lo <= top; }
  [[nodiscard]] RINGZERO_HD inline bool none() const noexcept { return !finite() && !special; }
};

/// Floor division of a bit position by the digit width: the digit holding that bit.
RINGZERO_HD constexpr int digit_index(int bit) noexcept {
  return bit >= 0 ? bit / digit_bits : -((-bit + digit_bits - 1) / digit_bits);
}

/// |w| of a finite word, 0 for a tag: what the block's range has to hold.
RINGZERO_HD inline std::uint64_t magnitude(std::int64_t w) noexcept {
  if (is_special(w)) return 0;
  return w < 0 ? std::uint64_t{0} - static_cast<std::uint64_t>(w) : static_cast<std::uint64_t>(w);
}

/// How a compact block takes terms of range r, its largest word being `most` (a magnitude):
/// `shift` bits down to the new lo first, then each term added; or not at all (spill).
struct compact_plan {
  bool fits = false;
  int lo = 0;
  int shift = 0;
};

[[nodiscard]] RINGZERO_HD inline compact_plan plan_compact(const compact_head& h,
                                                           std::uint64_t most,
                                                           const term_range& r) noexcept {
  compact_plan p;
  if (h.spill >= 0) return p;
  if (h.lo == empty) {
    p.lo = r.finite() ? r.lo : 0;
    p.fits = !r.finite() || r.top - r.lo < compact_bits;
    return p;
  }
  p.lo = r.finite() && r.lo < h.lo ? r.lo : h.lo;
  p.shift = h.lo - p.lo;
  // Words below 2^(bits + shift) after the shift, terms below 2^(top - lo): the sum stays below
  // 2^62 if both do below 2^61.
  const int bits = bit_width64(most);
  p.fits = bits + p.shift < compact_bits && (!r.finite() || r.top - p.lo < compact_bits);
  return p;
}

/// A word moved `shift` bits down the grid (multiplied by 2^shift; plan_compact made room).
RINGZERO_HD inline std::int64_t compact_shift(std::int64_t w, int shift) noexcept {
  if (is_special(w)) return w;
  return static_cast<std::int64_t>(static_cast<std::uint64_t>(w) << shift);
}

/// Word w of a block whose plan fits, after term t: its bits in units of 2^lo added (exact:
/// plan_compact made room, and lo is at most the term's lowest set bit), or t's inf/NaN count.
RINGZERO_HD inline std::int64_t compact_add(std::int64_t w, const term& t, int lo) noexcept {
  if (t.k == kind::zero) return w;
  if (t.k != kind::finite) return with_special(w, t);
  if (is_special(w)) return w;  // the element is inf or NaN whatever its finite terms
  const int s = t.exp - lo;
  const std::uint64_t v = s >= 0 ? t.mant << s : t.mant >> -s;
  return t.neg ? w - static_cast<std::int64_t>(v) : w + static_cast<std::int64_t>(v);
}

/// A finite word as a term (its magnitude and sign at exponent lo), for the digit functions.
RINGZERO_HD inline term word_term(std::int64_t w, int lo) noexcept {
  term t;
  if (w == 0 || is_special(w)) return t;
  t.k = kind::finite;
  t.neg = w < 0;
  t.mant = magnitude(w);
  t.exp = lo;
  return t;
}

/// The grid window a compact block's words occupy (empty when every finite word is 0).
[[nodiscard]] RINGZERO_HD inline window compact_window(int lo, std::uint64_t most) noexcept {
  window w;
  if (lo == empty || most == 0) return w;
  const int jlo = digit_index(lo);
  const int jhi = digit_index(lo + bit_width64(most) - 1);
  w.top = digit_bits * (jhi + 1);
  w.neg_low = -digit_bits * jlo;
  return w;
}

/// The grid window of a spilled block's digits.
[[nodiscard]] RINGZERO_HD inline window spill_window(const spill_record& s) noexcept {
  window w;
  if (s.k == 0) return w;
  w.top = digit_bits * (s.jlo + s.k);
  w.neg_low = -digit_bits * s.jlo;
  return w;
}

/// Takes `count` items from a pool counter; -1 (and the pool marked failed) when full.
RINGZERO_HD inline std::int64_t take(std::uint32_t* counter, std::uint32_t cap, std::uint32_t count,
                                     std::uint32_t* failed) noexcept {
#if defined(__CUDA_ARCH__)
  const std::uint32_t at = atomicAdd(counter, count);
#else
  const std::uint32_t at = *counter;
  *counter += count;
#endif
  if (static_cast<std::uint64_t>(at) + count > cap) {
    *failed = 1;
    return -1;
  }
  return at;
}

[[nodiscard]] RINGZERO_HD inline std::int64_t* pool_row(const spill_pool& p,
                                                        std::int32_t row) noexcept {
  return p.rows + static_cast<std::size_t>(row) * block_elems;
}

/// Makes s hold digits [jlo, jhi] besides those it holds, the new ones zero over the block's
/// `len` elements. False when the pool is full, or the range is beyond any supported type's
/// (the pool is then marked failed too).
RINGZERO_HD inline bool spill_cover(const spill_pool& p, spill_record& s, int jlo, int jhi,
                                    std::size_t len) noexcept {
  if (s.k > 0) {
    jlo = jlo < s.jlo ? jlo : s.jlo;
    jhi = max_int(jhi, s.jlo + s.k - 1);
  }
  const int k = jhi - jlo + 1;
  if (k > spill_digits) {
    p.counts[2] = 1;
    return false;
  }
  if (k == s.k) return true;
  const std::int64_t at =
      take(p.counts + 1, p.row_cap, static_cast<std::uint32_t>(k - s.k), p.counts + 2);
  if (at < 0) return false;
  auto next = static_cast<std::int32_t>(at);
  std::int32_t rows[spill_digits] = {};
  for (int d = 0; d < k; ++d) {
    const int j = jlo + d;
    if (s.k > 0 && j >= s.jlo && j < s.jlo + s.k) {
      rows[d] = s.rows[j - s.jlo];
    } else {
      rows[d] = next++;
      std::int64_t* row = pool_row(p, rows[d]);
      for (std::size_t e = 0; e < len; ++e) row[e] = 0;
    }
  }
  for (int d = 0; d < k; ++d) s.rows[d] = rows[d];
  s.jlo = jlo;
  s.k = k;
  return true;
}

/// A finite t's digits added into element e of s (s covers them).
RINGZERO_HD inline void spill_add(const spill_pool& p, const spill_record& s, std::size_t e,
                                  const term& t) noexcept {
  const int from = digit_index(t.exp + low_zeros64(t.mant)) - s.jlo;
  const int to = digit_index(t.exp + bit_width64(t.mant) - 1) - s.jlo;
  for (int d = from; d <= to; ++d) pool_row(p, s.rows[d])[e] += digit(t, digit_bits * s.jlo, d);
}

/// Carries the block's digits into [0, 2^40), all but the top one, which keeps the sign, after
/// adding a digit above for the carry out of the old top: the headroom starts over (adds = 2:
/// the digits and a top one of about one term). False when the pool is full.
RINGZERO_HD inline bool spill_normalize(const spill_pool& p, spill_record& s,
                                        std::size_t len) noexcept {
  constexpr std::int64_t radix = std::int64_t{1} << digit_bits;
  if (s.k == 0) return true;
  if (!spill_cover(p, s, s.jlo, s.jlo + s.k, len)) return false;
  for (std::size_t e = 0; e < len; ++e) {
    std::int64_t carry = 0;
    for (int d = 0; d + 1 < s.k; ++d) {
      std::int64_t& w = pool_row(p, s.rows[d])[e];
      const std::int64_t v = w + carry;
      const std::int64_t lo = v & (radix - 1);
      carry = (v - lo) >> digit_bits;
      w = lo;
    }
    pool_row(p, s.rows[s.k - 1])[e] += carry;
  }
  s.adds = 2;
  return true;
}

/// Block b of v takes terms x[0, m) at its elements [first, first + m), given their range and
/// the block's largest word magnitude, through its spill record (made now if it is compact: its
/// finite words move there first). Serial over the block: the spill path is rare, and the
/// device runs it on one thread. False when the pool is full: the terms were not added.
template <class T>
RINGZERO_HD inline bool spill_block_add(const compact_view& v, std::size_t b, const T* x,
                                        std::size_t first, std::size_t m, const term_range& r,
                                        std::uint64_t most) noexcept {
  const spill_pool& p = v.pool;
  compact_head& h = v.heads[b];
  const std::size_t base = b * block_elems;
  const std::size_t len = v.n - base < block_elems ? v.n - base : block_elems;
  std::int64_t* words = v.words + base;
  if (h.spill < 0) {
    const std::int64_t at = take(p.counts, p.record_cap, 1, p.counts + 2);
    if (at < 0) return false;
    spill_record& s = p.records[at];
    s = spill_record{};
    const window w = compact_window(h.lo, most);  // empty for a block without words yet
    if (!w.is_empty() && !spill_cover(p, s, w.low() / digit_bits, w.top / digit_bits - 1, len))
      return false;
    for (std::size_t e = 0; e < len; ++e) {
      if (h.lo == empty) {
        words[e] = 0;
        continue;
      }
      if (is_special(words[e])) continue;
      const term t = word_term(words[e], h.lo);
      for (int d = 0; d < s.k; ++d) pool_row(p, s.rows[d])[e] = digit(t, digit_bits * s.jlo, d);
      words[e] = 0;
    }
    s.adds = 1;
    h.spill = static_cast<std::int32_t>(at);
    if (h.lo == empty) h.lo = 0;  // not empty any more; a spilled block's lo is not read
  }
  spill_record& s = p.records[h.spill];
  if (r.finite() && !spill_cover(p, s, digit_index(r.lo), digit_index(r.top - 1), len))
    return false;
  if (s.adds + 1 >= max_terms / 2 && !spill_normalize(p, s, len)) return false;
  ++s.adds;
  for (std::size_t i = 0; i < m; ++i) {
    const term t = decompose(x[i]);
    if (t.k == kind::finite)
      spill_add(p, s, first + i, t);
    else if (t.k != kind::zero)
      words[first + i] = with_special(words[first + i], t);
  }
  return true;
}

/// Element e rounded to T: the word, or the spilled digits; IEEE's inf or NaN for a tag.
template <class T>
[[nodiscard]] RINGZERO_HD inline T compact_round(const compact_view& v, std::size_t e) noexcept {
  const std::size_t b = e / block_elems;
  const compact_head h = v.heads[b];
  if (h.lo == empty) return from_bits<T>(0);
  const std::int64_t w = v.words[e];
  if (is_special(w)) {
    T out{};
    (void)special_result(tag_code(w), out);
    return out;
  }
  if (h.spill < 0) return round_words<T>(&w, window{h.lo + digit_bits, -h.lo});
  const spill_record& s = v.pool.records[h.spill];
  std::int64_t q[spill_digits] = {};
  for (int d = 0; d < s.k; ++d) q[d] = pool_row(v.pool, s.rows[d])[e - b * block_elems];
  return round_words<T>(q, spill_window(s));
}

/// Block b's share of a combine: its grid window, and `special` set if an element is inf/NaN.
[[nodiscard]] RINGZERO_HD inline window compact_block_window(const compact_view& v, std::size_t b,
                                                             bool& special) noexcept {
  const compact_head h = v.heads[b];
  if (h.lo == empty) return window{};
  const std::size_t base = b * block_elems;
  const std::size_t len = v.n - base < block_elems ? v.n - base : block_elems;
  std::uint64_t most = 0;
  for (std::size_t e = 0; e < len; ++e) {
    special = special || is_special(v.words[base + e]);
    const std::uint64_t a = magnitude(v.words[base + e]);
    most = a > most ? a : most;
  }
  return h.spill >= 0 ? spill_window(v.pool.records[h.spill]) : compact_window(h.lo, most);
}

/// Digit k of element e over an agreed window whose low bit is `low` (grid-aligned).
[[nodiscard]] RINGZERO_HD inline std::int64_t compact_digit(const compact_view& v, std::size_t e,
                                                            int low, int k) noexcept {
  const std::size_t b = e / block_elems;
  const compact_head h = v.heads[b];
  if (h.lo == empty) return 0;
  if (h.spill < 0) return digit(word_term(v.words[e], h.lo), low, k);
  const spill_record& s = v.pool.records[h.spill];
  const int d = low / digit_bits + k - s.jlo;
  return d >= 0 && d < s.k ? pool_row(v.pool, s.rows[d])[e - b * block_elems] : 0;
}

/// Element e's inf/NaN counts, as special_code sums them.
[[nodiscard]] RINGZERO_HD inline std::int64_t compact_special(const compact_view& v,
                                                              std::size_t e) noexcept {
  if (v.heads[e / block_elems].lo == empty) return 0;
  const std::int64_t w = v.words[e];
  return is_special(w) ? tag_code(w) : 0;
}

/// The bound of a compact block after a plan that fits: each word grew by less than one term of
/// range r, 2^(top - lo).
[[nodiscard]] RINGZERO_HD inline std::uint64_t compact_bound(const compact_head& h,
                                                             std::uint64_t most,
                                                             const compact_plan& p,
                                                             const term_range& r) noexcept {
  const std::uint64_t words = h.lo == empty ? 0 : most << p.shift;
  return words + (r.finite() ? std::uint64_t{1} << (r.top - p.lo) : 0);
}

/// Block b of v takes terms x[0, m) at its elements [first, first + m) (the host's loop; the
/// device's kernel runs the same steps a warp at a time): their range, the plan against the
/// block's bound (against its largest word if the bound says it is full), then each word
/// shifted and each term added; or the spill path. False when a spill found the pool full.
template <class T>
RINGZERO_HD inline bool compact_block_add(const compact_view& v, std::size_t b, const T* x,
                                          std::size_t first, std::size_t m) noexcept {
  compact_head& h = v.heads[b];
  std::int64_t* w = v.words + b * block_elems;
  const std::size_t len = v.n - b * block_elems < block_elems ? v.n - b * block_elems : block_elems;
  term_range r;
  for (std::size_t i = 0; i < m; ++i) r.add(decompose(x[i]));
  if (r.none()) return true;
  std::uint64_t most = h.lo == empty ? 0 : h.bound;
  compact_plan p = plan_compact(h, most, r);
  if (!p.fits && h.lo != empty && h.spill < 0) {
    most = 0;
    for (std::size_t e = 0; e < len; ++e) {
      const std::uint64_t a = magnitude(w[e]);
      most = a > most ? a : most;
    }
    p = plan_compact(h, most, r);
  }
  if (!p.fits) return spill_block_add(v, b, x, first, m, r, most);
  if (h.lo == empty)
    for (std::size_t e = 0; e < len; ++e) w[e] = 0;
  else if (p.shift > 0)
    for (std::size_t e = 0; e < len; ++e) w[e] = compact_shift(w[e], p.shift);
  h.bound = compact_bound(h, most, p, r);
  h.lo = p.lo;
  if (r.special) h.spill = compact_tags;
  for (std::size_t i = 0; i < m; ++i)
    w[first + i] = compact_add(w[first + i], decompose(x[i]), p.lo);
  return true;
}

}  // namespace ringzero::reproducible
