// Reliable delivery over several rails, as bookkeeping (the rail engine, rail_engine.hpp, does
// the posting): what lets a transport with more than one rail lose one and lose no message. A
// send's completion on a rail says only that the rail is done with the buffer, not that the
// bytes arrived (ofi_rxm completes an eager send once the kernel took it; a TCP write is done
// once the kernel has it), so a rail whose link goes down takes with it messages both ends
// believe sent. Here each message (or piece of a striped one) carries a sequence number per
// ordered pair of ranks in a 32-bit word beside its tag (cq_word: libfabric's remote CQ data, a
// socket frame's field); the receiver records which numbers it has and tells the sender, as one
// idempotent statement (received_set: everything below a mark, and runs above it), in control
// messages on a rail both ends still use. The sender keeps what is not yet acknowledged (a copy
// for small sends, which complete at once; the caller's buffer for the rest, whose sends
// complete when acknowledged) and, once the receiver says it gave a rail up, sends again what
// that rail held and the receiver does not have. Each piece of a message has a number of its
// own beside the tag, so a piece sent again on another rail matches exactly the receive moved
// there, whatever else is posted, and no message is ever delivered twice. Pure bookkeeping: no
// rail calls here.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "ringzero/error.hpp"

namespace ringzero::detail::delivery {

/// Delivery's limits, named once.
struct limits {
  /// Sends up to this size (host memory) are copied and complete at once, as an injected send
  /// does; larger ones complete when the receiver acknowledges them. Below it the copy costs
  /// less than waiting a round trip for the acknowledgement; above it, the other way round.
  static constexpr std::size_t copy_bytes = std::size_t{64} << 10;
  /// Copied sends to one peer not yet acknowledged, at most (messages, bytes): past them a send
  /// waits for its acknowledgement, as a larger one does. The copies stay bounded while a
  /// receiver falls behind, and a sender that only sends still waits now and then, and so
  /// learns of a peer that is gone.
  static constexpr std::size_t max_copies = 64;
  static constexpr std::size_t max_copy_bytes = std::size_t{4} << 20;
  /// A receiver acknowledges copied sends after this many arrived, or after ack_delay: the
  /// sender's copies stay bounded without an acknowledgement per small message.
  static constexpr std::size_t ack_batch = 16;
  static constexpr std::chrono::milliseconds ack_delay{2};
  /// Bits that number a message's pieces beside its tag (libfabric spends them from the tag's
  /// top, a socket frame has a field); the highest value marks control messages.
  static constexpr int piece_bits = 4;
  static constexpr std::uint8_t control_piece = (1u << piece_bits) - 1;
  /// Rails a reliable engine drives: every piece needs a number below control_piece.
  static constexpr std::size_t max_rails = control_piece;
  /// Runs of out-of-order arrivals one statement carries: arrivals complete in the order the
  /// receiver posts, which is close to the order they were sent, so a handful is usual.
  static constexpr std::size_t max_runs = 1024;
  /// Messages cut short (a receive posted with the wrong size) a statement names: the latest
  /// few, since their senders need hearing it only once.
  static constexpr std::size_t max_cut = 16;
  /// How often the rails' links are looked at (sysfs): a failed link is found this fast.
  static constexpr std::chrono::milliseconds link_poll{100};
};

/// The word a message carries beside its tag: its sequence number's low 31 bits, and whether the
/// sender waits for the acknowledgement (so the receiver sends it at once). 32 bits: efa carries
/// 4 bytes of remote CQ data.
struct cq_word {
  static constexpr std::uint64_t seq_mask = (std::uint64_t{1} << 31) - 1;
  static constexpr std::uint64_t urgent_bit = std::uint64_t{1} << 31;
  [[nodiscard]] static constexpr std::uint64_t make(std::uint64_t seq, bool urgent) noexcept {
    return (seq & seq_mask) | (urgent ? urgent_bit : 0);
  }
  [[nodiscard]] static constexpr bool urgent(std::uint64_t word) noexcept {
    return (word & urgent_bit) != 0;
  }
};

/// The sequence numbers a receiver has from one sender: all below low(), and runs above it.
class received_set {
 public:
  /// The full number of a message that carried `word`: the one nearest above low()
  /// with those low 31 bits (a message more than 2^31 behind the mark does not exist: the
  /// receiver would still be waiting for it).
  [[nodiscard]] std::uint64_t expand(std::uint64_t word) const noexcept {
    const std::uint64_t w = word & cq_word::seq_mask;
    return low_ + ((w - (low_ & cq_word::seq_mask)) & cq_word::seq_mask);
  }

  /// Records `s`; false when it was already there.
  bool add(std::uint64_t s) {
    if (contains(s)) return false;
    auto next = runs_.lower_bound(s);  // first run starting at or after s (s is in none)
    std::uint64_t start = s;
    std::uint64_t end = s + 1;
    if (next != runs_.begin()) {
      auto prev = std::prev(next);
      if (prev->second == s) {
        start = prev->first;
        runs_.erase(prev);
      }
    }
    if (next != runs_.end() && next->first == end) {
      end = next->second;
      runs_.erase(next);
    }
    if (start == low_) {
      low_ = end;
    } else {
      runs_.emplace(start, end);
    }
    return true;
  }

  [[nodiscard]] bool contains(std::uint64_t s) const noexcept {
    if (s < low_) return true;
    auto it = runs_.upper_bound(s);
    if (it == runs_.begin()) return false;
    --it;
    return s < it->second;
  }

  [[nodiscard]] std::uint64_t low() const noexcept { return low_; }
  /// Runs above low(): [first, second), disjoint, not touching low() or each other.
  [[nodiscard]] const std::map<std::uint64_t, std::uint64_t>& runs() const noexcept {
    return runs_;
  }

  /// Adopts a statement decoded from a control message.
  void assign(std::uint64_t low, std::map<std::uint64_t, std::uint64_t> runs) {
    low_ = low;
    runs_ = std::move(runs);
  }

 private:
  std::uint64_t low_ = 0;
  std::map<std::uint64_t, std::uint64_t> runs_;
};

/// A control message: who sends it, the rails it gave up toward the receiver (a bit per rail),
/// everything it has received from the receiver, the latest messages it received cut short
/// (their first pieces' numbers: the sender lets the whole message go, since the pieces the
/// receiver did not post for will never be received), and the rate at which the receiver's
/// bytes arrive on each rail where its rails measure one (KiB/s, 0: not measured; what a sender
/// whose rails place pieces by offset weighs its pieces by). Sent whole every time, so a lost or
/// late one is harmless (a later one says more).
struct control {
  static constexpr std::uint32_t magic = 0x525a4144;  // "RZAD"
  static constexpr std::size_t header_bytes = 6 * 4 + 8;

  int from = -1;
  std::uint32_t dead = 0;
  received_set received;
  std::vector<std::uint64_t> cut{};
  std::vector<std::uint32_t> rates{};

  [[nodiscard]] static std::size_t max_bytes() noexcept {
    return header_bytes + limits::max_runs * 16 + limits::max_cut * 8 + limits::max_rails * 4;
  }

  [[nodiscard]] std::vector<std::byte> encode() const {
    return encode(from, dead, received, cut, rates);
  }
  /// `rates` all 0 travel as none.
  [[nodiscard]] static std::vector<std::byte> encode(int from, std::uint32_t dead,
                                                     const received_set& received,
                                                     std::span<const std::uint64_t> cut,
                                                     std::span<const std::uint32_t> rates = {}) {
    if (received.runs().size() > limits::max_runs)
      throw transport_error(fmt::format(
          "{} runs of messages from one rank arrived out of order, more than the {} one "
          "acknowledgement can describe",
          received.runs().size(), limits::max_runs));
    const bool measured = std::any_of(rates.begin(), rates.end(), [](auto r) { return r > 0; });
    const std::size_t rate_count = measured ? std::min(rates.size(), limits::max_rails) : 0;
    std::vector<std::byte> out;
    out.reserve(header_bytes + received.runs().size() * 16 + rate_count * 4);
    const auto put = [&](auto v) {
      const auto* b = reinterpret_cast<const std::byte*>(&v);
      out.insert(out.end(), b, b + sizeof v);
    };
    put(magic);
    put(static_cast<std::uint32_t>(from));
    put(dead);
    put(static_cast<std::uint32_t>(received.runs().size()));
    put(static_cast<std::uint32_t>(std::min(cut.size(), limits::max_cut)));
    put(static_cast<std::uint32_t>(rate_count));
    put(received.low());
    for (const auto& [a, b] : received.runs()) {
      put(a);
      put(b);
    }
    for (std::size_t i = cut.size() - std::min(cut.size(), limits::max_cut); i < cut.size(); ++i)
      put(cut[i]);
    for (std::size_t i = 0; i < rate_count; ++i) put(rates[i]);
    return out;
  }

  /// The message in `in`, or nothing when it is not one (truncated, another magic, runs that
  /// overlap or go backwards).
  [[nodiscard]] static std::optional<control> decode(std::span<const std::byte> in) {
    const auto get = [&](auto& v) {
      if (in.size() < sizeof v) return false;
      std::memcpy(&v, in.data(), sizeof v);
      in = in.subspan(sizeof v);
      return true;
    };
    std::uint32_t m = 0;
    std::uint32_t from = 0;
    std::uint32_t dead = 0;
    std::uint32_t count = 0;
    std::uint32_t cuts = 0;
    std::uint32_t rate_count = 0;
    std::uint64_t low = 0;
    if (!get(m) || m != magic || !get(from) || !get(dead) || !get(count) || !get(cuts) ||
        !get(rate_count) || !get(low) || count > limits::max_runs || cuts > limits::max_cut ||
        rate_count > limits::max_rails ||
        in.size() != std::size_t{count} * 16 + std::size_t{cuts} * 8 + std::size_t{rate_count} * 4)
      return std::nullopt;
    std::map<std::uint64_t, std::uint64_t> runs;
    std::uint64_t floor = low;
    for (std::uint32_t i = 0; i < count; ++i) {
      std::uint64_t a = 0;
      std::uint64_t b = 0;
      get(a);
      get(b);
      if (a <= floor || b <= a) return std::nullopt;
      runs.emplace(a, b);
      floor = b;
    }
    control c;
    c.cut.resize(cuts);
    for (auto& v : c.cut) get(v);
    c.rates.resize(rate_count);
    for (auto& v : c.rates) get(v);
    c.from = static_cast<int>(from);
    c.dead = dead;
    c.received.assign(low, std::move(runs));
    return c;
  }
};

/// Where a message whose home is rail `home` goes when the rails in `dead` are out of use: its
/// home, else the next rail up (wrapping) that is not dead; -1 when none is left. Both ends
/// compute it from the same set, and moving twice lands where moving once over both would.
[[nodiscard]] constexpr int substitute(std::size_t home, std::uint32_t dead,
                                       std::size_t rails) noexcept {
  for (std::size_t i = 0; i < rails; ++i) {
    const std::size_t r = (home + i) % rails;
    if ((dead & (std::uint32_t{1} << r)) == 0) return static_cast<int>(r);
  }
  return -1;
}

}  // namespace ringzero::detail::delivery
