// Argument checks of every collective, one message per mistake, run on the calling rank before
// anything is sent and whichever backend runs the call.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::detail {

[[nodiscard]] inline bool overlaps(const void* a, std::size_t an, const void* b,
                                   std::size_t bn) noexcept {
  if (an == 0 || bn == 0) return false;
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + bn && y < x + an;
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

template <element E>
void check_all_reduce(std::span<const E> in, std::span<E> out, op o) {
  check_op(o, "all_reduce");
  if (in.size() != out.size())
    throw invalid_argument(
        fmt::format("all_reduce: input has {} elements but output has {}", in.size(), out.size()));
  if (in.data() != out.data() && overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("all_reduce: input and output overlap without being the same buffer");
}

template <element E>
void check_reduce_scatter(int rank, int size, std::span<const E> in, std::span<E> out, op o) {
  check_op(o, "reduce_scatter");
  const auto n = static_cast<std::size_t>(size);
  if (in.size() != out.size() * n)
    throw invalid_argument(fmt::format(
        "reduce_scatter: input must hold size() * output elements ({} * {} = {}), got {}", n,
        out.size(), n * out.size(), in.size()));
  const E* own_block = in.data() + out.size() * static_cast<std::size_t>(rank);
  if (out.data() != own_block && overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument(
        "reduce_scatter: output overlaps the input but is not this rank's block of it");
}

template <element E>
void check_all_gather(int rank, int size, std::span<const E> in, std::span<E> out) {
  const auto n = static_cast<std::size_t>(size);
  if (out.size() != in.size() * n)
    throw invalid_argument(
        fmt::format("all_gather: output must hold size() * input elements ({} * {} = {}), got {}",
                    n, in.size(), n * in.size(), out.size()));
  const E* own_block = out.data() + in.size() * static_cast<std::size_t>(rank);
  if (in.data() != own_block && overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("all_gather: input overlaps the output but is not this rank's block");
}

template <element E>
void check_broadcast(int rank, int size, std::span<const E> in, std::span<E> out, int root) {
  check_root(root, size, "broadcast");
  if (rank != root) return;
  if (in.size() != out.size())
    throw invalid_argument(fmt::format("broadcast: root's input has {} elements but output has {}",
                                       in.size(), out.size()));
  if (in.data() != out.data() && overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("broadcast: input and output overlap without being the same buffer");
}

template <element E>
void check_reduce(int rank, int size, std::span<const E> in, std::span<E> out, op o, int root) {
  check_op(o, "reduce");
  check_root(root, size, "reduce");
  if (rank != root) return;
  if (in.size() != out.size())
    throw invalid_argument(fmt::format("reduce: root's input has {} elements but output has {}",
                                       in.size(), out.size()));
  if (in.data() != out.data() && overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("reduce: input and output overlap without being the same buffer");
}

template <element E>
void check_all_to_all(int size, std::span<const E> in, std::span<E> out) {
  const auto n = static_cast<std::size_t>(size);
  if (in.size() != out.size())
    throw invalid_argument(
        fmt::format("all_to_all: input has {} elements but output has {}", in.size(), out.size()));
  if (in.size() % n != 0)
    throw invalid_argument(fmt::format(
        "all_to_all: {} elements do not split into {} equal blocks, one per rank", in.size(), n));
  if (in.data() != out.data() && overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("all_to_all: input and output overlap without being the same buffer");
}

/// One side (send or receive) of an all_to_allv: a count and a displacement per rank, every
/// block inside a buffer of `len` elements.
inline void check_v_blocks(std::string_view side, int size, std::span<const std::size_t> counts,
                           std::span<const std::size_t> displs, std::size_t len) {
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
  check_v_blocks("send", size, send_counts, send_displs, in.size());
  check_v_blocks("receive", size, recv_counts, recv_displs, out.size());
  const auto me = static_cast<std::size_t>(rank);
  if (send_counts[me] != recv_counts[me])
    throw invalid_argument(
        fmt::format("all_to_allv: rank {} sends itself {} elements but receives {} from itself",
                    rank, send_counts[me], recv_counts[me]));
  if (overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument(
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

template <element E>
void check_gather(int rank, int size, std::span<const E> in, std::span<E> out, int root) {
  check_root(root, size, "gather");
  if (rank != root) return;
  const auto n = static_cast<std::size_t>(size);
  if (out.size() != in.size() * n)
    throw invalid_argument(fmt::format(
        "gather: root's output must hold size() * input elements ({} * {} = {}), got {}", n,
        in.size(), n * in.size(), out.size()));
  const E* own_block = out.data() + in.size() * static_cast<std::size_t>(root);
  if (in.data() != own_block && overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("gather: input overlaps the root's output but is not the root's block");
}

template <element E>
void check_scatter(int rank, int size, std::span<const E> in, std::span<E> out, int root) {
  check_root(root, size, "scatter");
  if (rank != root) return;
  const auto n = static_cast<std::size_t>(size);
  if (in.size() != out.size() * n)
    throw invalid_argument(fmt::format(
        "scatter: root's input must hold size() * output elements ({} * {} = {}), got {}", n,
        out.size(), n * out.size(), in.size()));
  const E* own_block = in.data() + out.size() * static_cast<std::size_t>(root);
  if (out.data() != own_block && overlaps(in.data(), in.size_bytes(), out.data(), out.size_bytes()))
    throw invalid_argument("scatter: output overlaps the root's input but is not the root's block");
}

}  // namespace ringzero::detail
