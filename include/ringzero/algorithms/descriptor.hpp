// What an algorithm header exports so the library can use it: one descriptor naming the
// algorithm, the collectives it implements, its price under the cost model and how to run it.
// algorithms/table.hpp lists the descriptors; selection, RINGZERO_ALGO / -A parsing, dispatch,
// error labels and the docs table all come from that list.
//
//   struct descriptor {
//     static constexpr algorithm id = algorithm::ring;          // options::algorithm value
//     static constexpr std::string_view name = "ring";          // RINGZERO_ALGO, -A, logs, docs
//     static constexpr collective_set implements{collective::all_reduce, ...};
//     static constexpr bool needs_nodes = false;                // competes only across nodes
//     template <class Table> static double cost(const tuning::cost_query& q);  // seconds
//     template <collective_comm C, element E>
//     static void run(C& comm, const call<E>& c, const options& opt);
//   };
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

#include "ringzero/algorithm.hpp"
#include "ringzero/collective_table.hpp"
#include "ringzero/error.hpp"
#include "ringzero/op.hpp"
#include "ringzero/tuning/cost_terms.hpp"
#include "ringzero/types.hpp"

namespace ringzero::algorithms {

/// A set of collectives, usable in constant expressions.
class collective_set {
 public:
  constexpr collective_set(std::initializer_list<collective> cs) noexcept {
    for (collective c : cs) bits_ |= bit(c);
  }
  [[nodiscard]] constexpr bool contains(collective c) const noexcept { return bits_ & bit(c); }

 private:
  static constexpr std::uint32_t bit(collective c) noexcept {
    return std::uint32_t{1} << static_cast<unsigned>(c);
  }
  std::uint32_t bits_ = 0;
};

/// Where all_to_allv's blocks lie, in elements, one entry per rank: the send_counts[r] elements
/// at in[send_displs[r]] go to rank r, the recv_counts[r] from rank r land at out[recv_displs[r]].
struct block_map {
  std::span<const std::size_t> send_counts;
  std::span<const std::size_t> send_displs;
  std::span<const std::size_t> recv_counts;
  std::span<const std::size_t> recv_displs;
};

/// One collective call as the dispatcher hands it to an algorithm, after validation, after the
/// trivial cases (empty, one rank) and, for broadcast, after root copied in to out.
/// reduce_scatter: in holds size() blocks of out.size(); all_gather: out holds size() blocks of
/// in.size(); broadcast: out is the buffer; reduce: out is read only on root; all_to_all: in and
/// out hold size() equal blocks; all_to_allv: `blocks` says where they lie; gather: out holds
/// size() blocks of in.size() on root; scatter: in holds size() blocks of out.size() on root.
template <class E>
struct call {
  collective kind = collective::all_reduce;
  std::span<const E> in;
  std::span<E> out;
  op reduction = op::sum;
  int root = 0;
  block_map blocks{};  ///< all_to_allv only
  /// The collective's descriptor, where the call carries one (run_collective sets it, so a
  /// collective outside builtin_collectives::all is described too); describe() falls back to the
  /// built-in row of `kind`.
  const collective_descriptor* described = nullptr;
};

/// What the library knows about c's collective.
template <class E>
[[nodiscard]] const collective_descriptor& describe(const call<E>& c) {
  if (c.described != nullptr) return *c.described;
  if (const collective_descriptor* d = builtin_collectives::find(c.kind)) return *d;
  throw invalid_argument("collective " + std::to_string(static_cast<int>(c.kind)) +
                         " is not a built-in one and the call carries no descriptor");
}

/// The static members a descriptor must have (run and cost are templates, checked where used).
template <class D>
concept descriptor = requires {
  { D::id } -> std::convertible_to<algorithm>;
  { D::name } -> std::convertible_to<std::string_view>;
  { D::implements } -> std::convertible_to<collective_set>;
  { D::needs_nodes } -> std::convertible_to<bool>;
};

}  // namespace ringzero::algorithms
