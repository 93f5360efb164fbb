// Where a message goes over several rails, as functions both ends of it can compute: the rail a
// whole message takes (rail_for, from its tag alone), how a large one is cut into a piece per
// rail (stripe, from its length and each rail's share), and the shares a sender weighs by when
// the receiver reports each rail's measured rate (shares_by_rate). Placing by what both ends
// know is what lets a receive be posted before its message arrives; where a rail's pieces carry
// their own offset (a socket frame), only the sender needs the cut, and it may follow measured
// rates that change from message to message.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace ringzero::detail {

struct striping_limits {
  /// A striped message's pieces start at multiples of this: a cache line, so that no two rails'
  /// copies write into one line, and small enough that pieces stay in proportion for the
  /// smallest striped message.
  static constexpr std::size_t piece_alignment = 64;
  /// Measured rates within this fraction of the fastest count as the fastest: windows of alike
  /// rails differ by that much from noise alone, and weighing by noise costs alike rails more
  /// than the finer division gains.
  static constexpr double near_fastest = 0.75;
};

/// One piece of a striped message: the rail it travels on and the bytes it carries.
struct stripe_piece {
  std::size_t rail = 0;
  std::size_t offset = 0;
  std::size_t length = 0;
};

/// The rail a message with `tag` travels on whole, and the one that carries the first piece of
/// a striped one: a mix of all its bits, so that the steps and chunks of one collective spread
/// over the rails, and a function of the tag alone, so that sender and receiver agree and
/// messages with one (peer, tag) stay in one rail's order.
[[nodiscard]] inline std::size_t rail_for(std::uint64_t tag, std::size_t rails) noexcept {
  if (rails <= 1) return 0;
  // splitmix64's finalizer: consecutive tags (chunk k, k+1) land on unrelated rails.
  tag ^= tag >> 30;
  tag *= 0xbf58476d1ce4e5b9ULL;
  tag ^= tag >> 27;
  tag *= 0x94d049bb133111ebULL;
  tag ^= tag >> 31;
  return static_cast<std::size_t>(tag % rails);
}

/// The number a message's piece on rail `rail` carries, when its tag's rail is `home`: the
/// piece on the home rail is number 0, as a message sent whole is, so that a receive posted
/// for one size and a message sent at another still meet (and fail naming both sizes).
[[nodiscard]] constexpr std::size_t piece_number(std::size_t rail, std::size_t home,
                                                 std::size_t rails) noexcept {
  return (rail + rails - home) % rails;
}

/// How a striped message of `bytes` is cut: consecutive pieces in rail order, each rail's in
/// proportion to its share, boundaries on piece_alignment. A rail whose piece rounds to nothing
/// (a share of 0 included) is skipped, unless `keep_empty`: then every rail has a piece, some of
/// no bytes (for a receiver that posts one per rail without knowing the cut). A function of its
/// arguments alone, so both ends of a message compute it alike from the same length and shares;
/// shares that are all 0 count as equal.
[[nodiscard]] inline std::vector<stripe_piece> stripe(std::size_t bytes,
                                                      std::span<const std::uint64_t> shares,
                                                      bool keep_empty = false) {
  // bytes × a share's running sum can pass 64 bits (a 1 TiB message, shares in Mbit/s).
  __extension__ using u128 = unsigned __int128;
  u128 total = 0;
  for (const auto s : shares) total += s;
  const bool equal = total == 0;
  if (equal) total = shares.size();
  std::vector<stripe_piece> out;
  u128 before = 0;
  std::size_t start = 0;
  for (std::size_t i = 0; i < shares.size(); ++i) {
    before += equal ? 1 : shares[i];
    std::size_t end = bytes;
    if (before < total) {
      end = static_cast<std::size_t>(u128{bytes} * before / total);
      end -= end % striping_limits::piece_alignment;
    }
    end = std::max(start, end);
    if (end > start || keep_empty)
      out.push_back({.rail = i, .offset = start, .length = end - start});
    start = end;
  }
  return out;
}

/// The shares a sender cuts by from the rates its receiver measured on each rail (any unit, 0:
/// not measured yet): a rail within near_fastest of the fastest, or not measured yet (so that it
/// is tried, and measured), counts as the fastest; a rail in `dead` (bit r for rail r) gets
/// nothing. Nothing measured: equal shares.
[[nodiscard]] inline std::vector<std::uint64_t> shares_by_rate(std::span<const std::uint32_t> rates,
                                                               std::uint32_t dead) {
  std::uint32_t fastest = 0;
  for (std::size_t i = 0; i < rates.size(); ++i)
    if ((dead & (std::uint32_t{1} << i)) == 0) fastest = std::max(fastest, rates[i]);
  std::vector<std::uint64_t> shares(rates.size(), 0);
  for (std::size_t i = 0; i < rates.size(); ++i) {
    if (dead & (std::uint32_t{1} << i)) continue;
    const double r = rates[i];
    const bool as_fastest = r == 0 || r >= striping_limits::near_fastest * fastest;
    shares[i] = fastest == 0 ? 1 : as_fastest ? fastest : rates[i];
  }
  return shares;
}

}  // namespace ringzero::detail
