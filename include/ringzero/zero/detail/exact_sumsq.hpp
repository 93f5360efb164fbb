// The global gradient norm of reproducible training (config::reproducible): the sum of squares
// of every gradient element, exact, so that the norm, the clipping factor and the overflow
// verdict are the same bits whichever ranks hold which elements.
//
// The square of a float m * 2^e (m < 2^24) is m^2 * 2^(2e), exact in 48 bits; this rank's
// squares are summed per exponent as 128-bit integers (one add per element), then laid out as
// one fixed-point number of 640 bits in units of 2^-298 (the smallest square), as signed 40-bit
// digits in int64 words: the ranks add the words with an int64 sum, which is exact, and each
// rank rounds the total once to double.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include "ringzero/collectives.hpp"
#include "ringzero/detail/reproducible_combine.hpp"
#include "ringzero/kernels/element.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/reproducible.hpp"

namespace ringzero::zero::detail {

namespace rp = ringzero::reproducible;

/// A gradient element's square as exact_sumsq bins it: m^2 (exact in 48 bits) in bin e, the
/// float's biased exponent; false for an infinity or NaN. The host's and the device's one
/// function (zero/cuda_exact.cuh bins on the GPU).
template <class G>
RINGZERO_HD inline bool square_of(G g, std::uint32_t& e, std::uint64_t& m2) noexcept {
  const std::uint32_t b = rp::bits_of(kernels::to_float(g));  // exact for the 16-bit types
  e = (b >> 23) & 0xffu;
  if (e == 0xffu) return false;
  const std::uint64_t m = e != 0 ? ((b & 0x7fffffu) | 0x800000u) : (b & 0x7fffffu);
  m2 = m * m;
  return true;
}

/// Bins of squares as a device holds them: bin e's low and high 64 bits at [2e] and [2e + 1],
/// and a nonzero word at [512] once an element was an infinity or NaN.
inline constexpr std::size_t device_bins = 513;

class exact_sumsq {
 public:
  /// 40-bit digits of the sum: 640 bits from 2^-298 hold any sum of up to 2^64 float squares.
  static constexpr int digits = 16;
  using words_type = std::array<std::int64_t, digits>;

  /// Adds g[i]^2 for every element (converted to float, which is exact for the 16-bit types);
  /// an infinity or NaN sets nonfinite() instead.
  template <class G>
  void add(const G* g, std::size_t n) noexcept {
    for (std::size_t i = 0; i < n; ++i) {
      std::uint32_t e = 0;
      std::uint64_t m2 = 0;
      if (square_of(g[i], e, m2))
        bins_[e] += m2;
      else
        nonfinite_ = true;
    }
  }
  /// Adds bins a device summed (device_bins words, as laid out there).
  void add_bins(const std::uint64_t* bins) noexcept {
    for (std::size_t e = 0; e < 256; ++e)
      bins_[e] += (static_cast<rp::u128>(bins[2 * e + 1]) << 64) | bins[2 * e];
    nonfinite_ = nonfinite_ || bins[512] != 0;
  }

  [[nodiscard]] bool nonfinite() const noexcept { return nonfinite_; }

  /// This rank's sum as digits: element-wise int64 sums of several ranks' words are the words
  /// of the sum of their sums.
  [[nodiscard]] words_type words() const noexcept {
    limbs_type l{};
    for (std::uint32_t e = 0; e < 255; ++e)
      if (bins_[e] != 0) {
        // bins_[e] is in units of 2^(2 * max(e, 1) - 300); the grid's unit is 2^-298.
        add_shifted(l, bins_[e], 2 * static_cast<int>(e == 0 ? 1 : e) - 2);
      }
    words_type w{};
    for (int k = 0; k < digits; ++k) w[static_cast<std::size_t>(k)] = bits_at(l, 40 * k, 40);
    return w;
  }

  /// Summed words (nonnegative, each below 2^63) as the nearest double.
  [[nodiscard]] static double round(const words_type& w) noexcept {
    limbs_type l{};
    for (int k = 0; k < digits; ++k)
      add_shifted(l, static_cast<rp::u128>(w[static_cast<std::size_t>(k)]), 40 * k);
    int top = limbs * 64 - 1;
    while (top >= 0 && ((l[static_cast<std::size_t>(top / 64)] >> (top % 64)) & 1u) == 0) --top;
    if (top < 0) return 0.0;
    // The top 128 bits (or all of them) as a, the rest as the sticky bit.
    const int low = top >= 127 ? top - 127 : 0;
    rp::u128 a = 0;
    for (int b = top; b >= low; --b)
      a = (a << 1) | ((l[static_cast<std::size_t>(b / 64)] >> (b % 64)) & 1u);
    bool sticky = false;
    for (int b = 0; b < low && !sticky; ++b)
      sticky = ((l[static_cast<std::size_t>(b / 64)] >> (b % 64)) & 1u) != 0;
    return rp::round_to<double>(false, a, low - 298, sticky);
  }

  /// Collective over `comm`: the sum of every rank's squares, rounded once, and whether any
  /// rank saw an infinity or NaN. `o`: the all_reduces' options.
  template <class Comm, class Via = ringzero::detail::host_collectives>
  [[nodiscard]] std::pair<double, bool> agree(Comm& comm, const ringzero::options& o,
                                              const Via& via = Via{}) const {
    ringzero::options plain = o;
    plain.reproducible = false;
    std::int32_t bad = nonfinite_ ? 1 : 0;
    via.all_reduce(comm, std::span<std::int32_t>(&bad, 1), op::max, plain);
    words_type w = words();
    via.all_reduce(comm, std::span<std::int64_t>(w), op::sum, plain);
    return {round(w), bad != 0};
  }

 private:
  static constexpr int limbs = 11;  // 704 bits: the sum, and the carries of the words
  using limbs_type = std::array<std::uint64_t, limbs>;

  /// l += v * 2^shift (the sum stays within the limbs).
  static void add_shifted(limbs_type& l, rp::u128 v, int shift) noexcept {
    const auto word = static_cast<std::size_t>(shift / 64);
    const int bit = shift % 64;
    const auto lo = static_cast<std::uint64_t>(v), hi = static_cast<std::uint64_t>(v >> 64);
    const std::uint64_t parts[3] = {lo << bit, bit == 0 ? hi : (lo >> (64 - bit)) | (hi << bit),
                                    bit == 0 ? 0 : hi >> (64 - bit)};
    std::uint64_t carry = 0;
    for (std::size_t k = word; k < l.size(); ++k) {
      const std::uint64_t add = k - word < 3 ? parts[k - word] : 0;
      if (add == 0 && carry == 0 && k - word >= 3) break;
      const std::uint64_t s = l[k] + add;
      const std::uint64_t c1 = s < add ? 1 : 0;
      l[k] = s + carry;
      carry = c1 + (l[k] < carry ? 1 : 0);
    }
  }

  /// Bits [from, from + count) of l (count <= 64).
  [[nodiscard]] static std::int64_t bits_at(const limbs_type& l, int from, int count) noexcept {
    const auto word = static_cast<std::size_t>(from / 64);
    const int bit = from % 64;
    std::uint64_t v = l[word] >> bit;
    if (bit != 0 && word + 1 < l.size()) v |= l[word + 1] << (64 - bit);
    return static_cast<std::int64_t>(v & ((std::uint64_t{1} << count) - 1));
  }

  std::array<rp::u128, 256> bins_{};
  bool nonfinite_ = false;
};

}  // namespace ringzero::zero::detail
