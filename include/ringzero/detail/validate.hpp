// Argument checks of every collective, one message per mistake, run on the calling rank before
// anything is sent and whichever backend runs the call.
#pragma once

#include <fmt/core.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

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

}  // namespace ringzero::detail
