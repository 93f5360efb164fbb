// Argument checks of every collective, one message per mistake, run on the calling rank before
// anything is sent and whichever backend runs the call.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::detail {

/// The most elements of E one buffer may hold: its byte count must fit in a ptrdiff_t, as every
/// pointer difference and byte count downstream assumes. A span past it (a count computed from
/// a wrapped subtraction, say) would make size_bytes() wrap.
template <class E>
inline constexpr std::size_t max_elements = static_cast<std::size_t>(PTRDIFF_MAX) /
                                            sizeof(std::remove_cv_t<E>);

/// check_buffer's error, kept out of the check's way: the check runs on every call.
[[noreturn, gnu::cold]] inline void refuse_buffer(std::string_view what, std::string_view name,
                                                  bool null, std::size_t size,
                                                  std::size_t elem_bytes, std::size_t most) {
  if (null)
    throw invalid_argument(
        fmt::format("{}: {} is a null pointer with {} elements", what, name, size));
  throw invalid_argument(
      fmt::format("{}: {} holds {} elements of {} bytes, more than any buffer can ({} at most)",
                  what, name, size, elem_bytes, most));
}

/// Every buffer a call is given, whether this rank reads it or not: a null pointer with a
/// non-zero count is never a buffer, and no buffer holds more than max_elements.
template <class E>
void check_buffer(std::string_view what, std::string_view name, std::span<E> s) {
  const bool null = s.data() == nullptr && !s.empty();
  if (null || s.size() > max_elements<E>) [[unlikely]]
    refuse_buffer(what, name, null, s.size(), sizeof(E), max_elements<E>);
}

/// "n * count = product" for a message, without letting the product wrap.
[[nodiscard]] inline std::string product_text(std::size_t n, std::size_t count) {
  if (count != 0 && n > SIZE_MAX / count) return fmt::format("{} * {}, which overflows", n, count);
  return fmt::format("{} * {} = {}", n, count, n * count);
}

/// Whether `whole` is exactly n blocks of `block` elements (n >= 1), without multiplying.
[[nodiscard]] constexpr bool holds_blocks(std::size_t whole, std::size_t n,
                                          std::size_t block) noexcept {
  return whole % n == 0 && whole / n == block;
}

/// The two buffers of an overlap error, so that the message shows how they overlap.
[[nodiscard]] inline std::string overlap_text(const void* in, std::size_t in_bytes, const void* out,
                                              std::size_t out_bytes) {
  const auto x = reinterpret_cast<std::uintptr_t>(in);
  const auto y = reinterpret_cast<std::uintptr_t>(out);
  return fmt::format("(input: {} bytes at {}, output: {} bytes at {}, starting {} bytes {})",
                     in_bytes, in, out_bytes, out, x <= y ? y - x : x - y,
                     x <= y ? "after the input" : "before the input");
}

/// The per-call options: a deadline that the clock arithmetic cannot overflow.
inline void check_options(std::string_view what, const options& opt) {
  // Tested before the message is built: this runs on every call.
  if (opt.timeout > max_timeout)
    check_timeout(fmt::format("{}: options::timeout", what), opt.timeout);
}

[[nodiscard]] inline bool overlaps(const void* a, std::size_t an, const void* b,
                                   std::size_t bn) noexcept {
  if (an == 0 || bn == 0) return false;
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + bn && y < x + an;
}

/// Throws invalid_argument with `message` and how the buffers lie when in and out overlap,
/// unless `in_place` (the call's in-place form, where they may).
template <element E>
void check_overlap(bool in_place, std::span<const E> in, std::span<E> out,
                   std::string_view message) {
  if (!in_place && overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument(fmt::format(
        "{} {}", message, overlap_text(in.data(), in.size_bytes(), out.data(), out.size_bytes())));
}

inline void check_op(op o, std::string_view what) {
  if (!is_valid(o))
    throw invalid_argument(
        fmt::format("{}: unknown reduction op code {}", what, static_cast<int>(o)));
}

inline void check_root(int root, int n, std::string_view what) {
  if (root < 0 || root >= n)
    throw invalid_argument(
        fmt::format("{}: root {} is out of range for a {}-rank communicator", what, root, n));
}

inline void check_peer(std::string_view what, int rank, int size, int peer) {
  if (peer < 0 || peer >= size || peer == rank)
    throw invalid_argument(
        fmt::format("{}: peer {} is not another rank of this {}-rank "
                    "communicator (this is rank {})",
                    what, peer, size, rank));
}

/// A point-to-point call's options and buffers (its peers are check_peer's).
template <element E>
void check_p2p(std::string_view what, const options& opt, std::span<const E> out, std::span<E> in) {
  check_options(what, opt);
  check_buffer(what, "send buffer", out);
  check_buffer(what, "receive buffer", in);
}

/// The buffers, op and root of a call of collective `d`, from its descriptor: sizes as its
/// extents say (checked where this rank uses both buffers: on the root, for a rooted collective
/// with a root-only buffer), and overlap only in its in-place form (collective_table.hpp). Not
/// for all_to_allv (check_all_to_allv) or a collective without buffers.
template <element E>
void check_call(const collective_descriptor& d, int rank, int size, std::span<const E> in,
                std::span<E> out, op o, int root) {
  const std::string_view what = d.name;
  check_buffer(what, "input", in);
  check_buffer(what, "output", out);
  if (d.reduces) check_op(o, what);
  if (d.rooted) check_root(root, size, what);
  if (!d.uses_in(rank, root) || !d.uses_out(rank, root)) return;
  const std::string_view whose = d.in.root_only || d.out.root_only ? "root's " : "";
  const auto n = static_cast<std::size_t>(size);
  const auto overlap = [&] {
    return overlap_text(in.data(), in.size_bytes(), out.data(), out.size_bytes());
  };
  if (d.in.size == d.out.size) {
    if (in.size() != out.size())
      throw invalid_argument(fmt::format("{}: {}input has {} elements but output has {}", what,
                                         whose, in.size(), out.size()));
    if (d.in.size == extent::blocks && in.size() % n != 0)
      throw invalid_argument(fmt::format(
          "{}: {} elements do not split into {} equal blocks, one per rank", what, in.size(), n));
    if (in.data() != out.data() &&
        overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
      throw invalid_argument(fmt::format(
          "{}: input and output overlap without being the same buffer {}", what, overlap()));
    return;
  }
  // One buffer is size() blocks of the other; in place when the smaller is this rank's block.
  const bool in_is_blocks = d.in.size == extent::blocks;
  const std::string_view whole = in_is_blocks ? "input" : "output";
  const std::string_view part = in_is_blocks ? "output" : "input";
  const std::size_t whole_size = in_is_blocks ? in.size() : out.size();
  const std::size_t part_size = in_is_blocks ? out.size() : in.size();
  if (!holds_blocks(whole_size, n, part_size))
    throw invalid_argument(fmt::format("{}: {}{} must hold size() * {} elements ({}), got {}", what,
                                       whose, whole, part, product_text(n, part_size), whole_size));
  const bool in_place = d.in_place(in.data(), out.data(), part_size * sizeof(E), rank);
  if (!in_place && overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument(
        d.rooted ? fmt::format("{}: {} overlaps the root's {} but is not the root's block {}", what,
                               part, whole, overlap())
                 : fmt::format("{}: {} overlaps the {} but is not this rank's block of it {}", what,
                               part, whole, overlap()));
}

/// One side (send or receive) of an all_to_allv: a count and a displacement per rank, every
/// block inside a buffer of `len` elements.
inline void check_v_blocks(std::string_view side, int size, std::span<const std::size_t> counts,
                           std::span<const std::size_t> displs, std::size_t len) {
  check_buffer("all_to_allv", fmt::format("{} counts", side), counts);
  check_buffer("all_to_allv", fmt::format("{} displacements", side), displs);
  const auto n = static_cast<std::size_t>(size);
  if (counts.size() != n)
    throw invalid_argument(
        fmt::format("all_to_allv: {} counts has {} entries, expected one per rank ({})", side,
                    counts.size(), n));
  if (displs.size() != n)
    throw invalid_argument(
        fmt::format("all_to_allv: {} displacements has {} entries, expected one per rank ({})",
                    side, displs.size(), n));
  for (std::size_t r = 0; r < n; ++r)
    if (displs[r] > len || counts[r] > len - displs[r])
      throw invalid_argument(fmt::format(
          "all_to_allv: {} block of rank {} (displacement {}, count {}) ends past the {} "
          "buffer's {} elements",
          side, r, displs[r], counts[r], side == "send" ? "input" : "output", len));
}

template <element E>
void check_all_to_allv(int rank, int size, std::span<const E> in,
                       std::span<const std::size_t> send_counts,
                       std::span<const std::size_t> send_displs, std::span<E> out,
                       std::span<const std::size_t> recv_counts,
                       std::span<const std::size_t> recv_displs) {
  check_buffer("all_to_allv", "input", in);
  check_buffer("all_to_allv", "output", out);
  check_v_blocks("send", size, send_counts, send_displs, in.size());
  check_v_blocks("receive", size, recv_counts, recv_displs, out.size());
  const auto me = static_cast<std::size_t>(rank);
  if (send_counts[me] != recv_counts[me])
    throw invalid_argument(
        fmt::format("all_to_allv: rank {} sends itself {} elements but receives {} from itself",
                    rank, send_counts[me], recv_counts[me]));
  check_overlap(false, in, out,
                "all_to_allv: input and output overlap (all_to_allv has no in-place form)");
  // Receive blocks must not overlap: sorted by displacement, each ends before the next begins.
  std::vector<std::size_t> order;
  for (std::size_t r = 0; r < recv_counts.size(); ++r)
    if (recv_counts[r] > 0) order.push_back(r);
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return recv_displs[a] < recv_displs[b]; });
  for (std::size_t i = 1; i < order.size(); ++i) {
    const std::size_t a = order[i - 1], b = order[i];
    if (recv_displs[a] + recv_counts[a] > recv_displs[b])
      throw invalid_argument(fmt::format(
          "all_to_allv: receive blocks of ranks {} and {} overlap (elements {}..{} and {}..{})",
          std::min(a, b), std::max(a, b), recv_displs[a], recv_displs[a] + recv_counts[a],
          recv_displs[b], recv_displs[b] + recv_counts[b]));
  }
}

}  // namespace ringzero::detail
