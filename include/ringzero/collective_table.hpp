// The one list of ringzero's collectives. A collective is a descriptor: its name, whether it
// takes a root and a reduction op, the extent of each buffer in units of the call's count and
// on which ranks it is used, and nccl-tests' bus-bandwidth factor. Everything that needs to
// know about a collective asks its descriptor instead of switching on the enum: buffer
// validation and the in-place rule (detail/validate.hpp), the count RINGZERO_CHECK compares and
// the bytes the cost model prices (collectives.hpp), which buffers live on a device, the
// transports' native paths, trace and counters (detail/trace_state.hpp) and ringzero-perf.
//
// Adding a collective: a descriptor (an unused enumerator needs no change here, as
// tests/core/collective_table_test.cpp shows) plus the algorithms that implement it, run through
// ringzero::run_collective. A built-in one is also listed in `builtin_collectives::all` below and
// gets a named entry point in collectives.hpp.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace ringzero {

enum class collective : std::uint8_t {
  all_reduce,
  reduce_scatter,
  all_gather,
  broadcast,
  reduce,
  barrier,
  send_recv,
  all_to_all,
  all_to_allv,
  gather,
  scatter
};

/// How many elements one buffer of a call holds, in units of the call's count.
enum class extent : std::uint8_t {
  none,    ///< no buffer (barrier)
  one,     ///< `count` elements
  blocks,  ///< size() blocks of `count`, block r for (or from) rank r
  varies,  ///< per-rank counts and displacements (all_to_allv)
};

/// One buffer of a collective: its extent, and whether only the root reads or writes it (it
/// may be empty on the other ranks).
struct buffer_rule {
  extent size = extent::none;
  bool root_only = false;
};

/// nccl-tests' bus-bandwidth factor, busbw = algbw × factor, algbw measured over the call's
/// full buffer (descriptor::full_elems).
enum class bus_factor : std::uint8_t {
  none,          ///< 0: nothing moves (barrier)
  one,           ///< 1: the whole buffer crosses each link once (broadcast, reduce, send_recv)
  spread,        ///< (n-1)/n: each rank's block crosses one link (all_gather, all_to_all, ...)
  twice_spread,  ///< 2(n-1)/n: reduce-scatter then all-gather (all_reduce)
};

/// What the library knows about one collective. The in-place rule follows from the extents:
/// where in and out have the same extent, the call is in place when they are the same buffer;
/// where one holds `blocks` and the other `one`, when the smaller is this rank's block of the
/// larger (the root's, for a rooted collective: it is checked on the root only).
struct collective_descriptor {
  collective id = collective::all_reduce;
  std::string_view name;
  bool rooted = false;   ///< takes a root
  bool reduces = false;  ///< takes a reduction op and combines values
  buffer_rule in{};
  buffer_rule out{};
  bus_factor bus = bus_factor::one;

  [[nodiscard]] constexpr bool uses_in(int rank, int root) const noexcept {
    return in.size != extent::none && (!in.root_only || rank == root);
  }
  [[nodiscard]] constexpr bool uses_out(int rank, int root) const noexcept {
    return out.size != extent::none && (!out.root_only || rank == root);
  }
  /// Elements of the input (output) this rank passes in a call of `count` on `ranks` ranks: 0
  /// where it does not use it, or where the extent is not a multiple of the count.
  [[nodiscard]] constexpr std::size_t in_elems(std::size_t count, int ranks, int rank,
                                               int root) const noexcept {
    return uses_in(rank, root) ? elems(in.size, count, ranks) : 0;
  }
  [[nodiscard]] constexpr std::size_t out_elems(std::size_t count, int ranks, int rank,
                                                int root) const noexcept {
    return uses_out(rank, root) ? elems(out.size, count, ranks) : 0;
  }
  [[nodiscard]] static constexpr std::size_t elems(extent e, std::size_t count,
                                                   int ranks) noexcept {
    if (e == extent::one) return count;
    if (e == extent::blocks) return count * static_cast<std::size_t>(ranks > 0 ? ranks : 1);
    return 0;
  }
  /// Whether `input` and `output` (both used by this rank) are the call's in-place form: the
  /// same buffer where the extents match, else the smaller at block `rank` of the larger, a
  /// block being `block_bytes` (the root's block for a rooted collective, checked on the root).
  [[nodiscard]] bool in_place(const void* input, const void* output, std::size_t block_bytes,
                              int rank) const noexcept {
    const auto* i = static_cast<const std::byte*>(input);
    const auto* o = static_cast<const std::byte*>(output);
    const std::size_t own = block_bytes * static_cast<std::size_t>(rank);
    if (in.size == out.size) return i == o;
    return in.size == extent::blocks ? o == i + own : i == o + own;
  }

  /// Whether the full buffer is size() blocks of the count.
  [[nodiscard]] constexpr bool blocked() const noexcept {
    return in.size == extent::blocks || out.size == extent::blocks;
  }

  /// The call's count (nccl-tests' count: what RINGZERO_CHECK compares and native_call carries)
  /// from its buffer sizes: the size of a buffer every rank passes whole, else of one every
  /// rank passes in blocks, divided by the world size. 0 for a collective without one.
  [[nodiscard]] constexpr std::size_t count(std::size_t in_size, std::size_t out_size,
                                            int ranks) const noexcept {
    if (out.size == extent::one && !out.root_only) return out_size;
    if (in.size == extent::one && !in.root_only) return in_size;
    const auto n = static_cast<std::size_t>(ranks > 0 ? ranks : 1);
    if (in.size == extent::blocks && !in.root_only) return in_size / n;
    if (out.size == extent::blocks && !out.root_only) return out_size / n;
    return 0;
  }

  /// Elements of the call's full buffer: what the cost model prices and busbw is measured over.
  [[nodiscard]] constexpr std::size_t full_elems(std::size_t count, int ranks) const noexcept {
    return blocked() ? count * static_cast<std::size_t>(ranks > 0 ? ranks : 1) : count;
  }

  [[nodiscard]] constexpr double bus_bandwidth_factor(int ranks) const noexcept {
    const double n = ranks;
    switch (bus) {
      case bus_factor::none:
        return 0.0;
      case bus_factor::one:
        return 1.0;
      case bus_factor::spread:
        return ranks > 1 ? (n - 1) / n : 0.0;
      case bus_factor::twice_spread:
        return ranks > 1 ? 2.0 * (n - 1) / n : 0.0;
    }
    return 0.0;
  }
};

/// ringzero's collectives (a namespace of its own, so that a caller's variable named after a
/// collective does not collide under `using namespace ringzero`).
namespace builtin_collectives {

inline constexpr buffer_rule one{extent::one}, blocks{extent::blocks}, none{extent::none},
    varies{extent::varies}, root_one{extent::one, true}, root_blocks{extent::blocks, true};

// clang-format off
//                                          id                          name              rooted reduces in           out          bus
inline constexpr collective_descriptor all_reduce    {collective::all_reduce,     "all_reduce",     false, true,  one,         one,         bus_factor::twice_spread};
inline constexpr collective_descriptor reduce_scatter{collective::reduce_scatter, "reduce_scatter", false, true,  blocks,      one,         bus_factor::spread};
inline constexpr collective_descriptor all_gather    {collective::all_gather,     "all_gather",     false, false, one,         blocks,      bus_factor::spread};
inline constexpr collective_descriptor broadcast     {collective::broadcast,      "broadcast",      true,  false, root_one,    one,         bus_factor::one};
inline constexpr collective_descriptor reduce        {collective::reduce,         "reduce",         true,  true,  one,         root_one,    bus_factor::one};
inline constexpr collective_descriptor barrier       {collective::barrier,        "barrier",        false, false, none,        none,        bus_factor::none};
inline constexpr collective_descriptor send_recv     {collective::send_recv,      "send_recv",      false, false, one,         one,         bus_factor::one};
inline constexpr collective_descriptor all_to_all    {collective::all_to_all,     "all_to_all",     false, false, blocks,      blocks,      bus_factor::spread};
inline constexpr collective_descriptor all_to_allv   {collective::all_to_allv,    "all_to_allv",    false, false, varies,      varies,      bus_factor::spread};
inline constexpr collective_descriptor gather        {collective::gather,         "gather",         true,  false, one,         root_blocks, bus_factor::spread};
inline constexpr collective_descriptor scatter       {collective::scatter,        "scatter",        true,  false, root_blocks, one,         bus_factor::spread};
// clang-format on

/// ringzero's collectives, in enumerator order.
inline constexpr std::array all{all_reduce, reduce_scatter, all_gather,  broadcast, reduce, barrier,
                                send_recv,  all_to_all,     all_to_allv, gather,    scatter};

/// The built-in descriptor of `c`, or null for an enumerator no built-in collective uses.
[[nodiscard]] constexpr const collective_descriptor* find(collective c) noexcept {
  const auto i = static_cast<std::size_t>(c);
  return i < all.size() ? &all[i] : nullptr;
}

static_assert(
    [] {
      for (std::size_t i = 0; i < all.size(); ++i)
        if (static_cast<std::size_t>(all[i].id) != i) return false;
      return true;
    }(),
    "builtin_collectives::all must list the collectives in enumerator order");

}  // namespace builtin_collectives

[[nodiscard]] constexpr std::string_view collective_name(collective c) noexcept {
  const collective_descriptor* d = builtin_collectives::find(c);
  return d != nullptr ? d->name : "?";
}

}  // namespace ringzero
