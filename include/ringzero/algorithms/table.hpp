// The one list of ringzero's algorithms. Everything that needs to know which algorithms exist
// asks it: the cost model's candidates and prices (model/cost_model.hpp), RINGZERO_ALGO and
// ringzero-perf -A (parse), dispatch and error labels (collectives.hpp), and the docs table
// (tests/core/algorithm_table_test.cpp checks docs/architecture.md against it).
//
// Adding an algorithm: write its header with a descriptor (algorithms/descriptor.hpp says what
// it holds), give it an enumerator in algorithm.hpp, and add it to `builtin` below.
#pragma once

#include <array>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/bruck.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/algorithms/hierarchical.hpp"
#include "ringzero/algorithms/linear.hpp"
#include "ringzero/algorithms/pairwise.hpp"
#include "ringzero/algorithms/rabenseifner.hpp"
#include "ringzero/algorithms/recursive_doubling.hpp"
#include "ringzero/algorithms/ring.hpp"
#include "ringzero/algorithms/tree.hpp"
#include "ringzero/error.hpp"
#include "ringzero/tuning/cost_terms.hpp"

namespace ringzero::algorithms {

/// A list of algorithm descriptors, in the order ties are broken (earlier wins).
template <descriptor... D>
struct table {
  /// The same list with more algorithms at the end (tests register their own this way).
  template <descriptor... X>
  using with = table<D..., X...>;

  static constexpr std::size_t size = sizeof...(D);
  static constexpr std::array<algorithm, size> ids{D::id...};
  static constexpr std::array<std::string_view, size> names{D::name...};

  /// The name of `a` as RINGZERO_ALGO and ringzero-perf -A spell it; "auto" for automatic.
  [[nodiscard]] static constexpr std::string_view name(algorithm a) noexcept {
    if (a == algorithm::automatic) return "auto";
    for (std::size_t i = 0; i < size; ++i)
      if (ids[i] == a) return names[i];
    return "?";
  }

  /// The algorithm named `s` ("auto" and "automatic" both mean automatic).
  [[nodiscard]] static algorithm parse(std::string_view s) {
    if (s == "auto" || s == "automatic") return algorithm::automatic;
    for (std::size_t i = 0; i < size; ++i)
      if (names[i] == s) return ids[i];
    std::string known = "auto";
    for (std::string_view n : names) known += ", " + std::string(n);
    throw invalid_argument("unknown algorithm '" + std::string(s) + "' (expected " + known + ")");
  }

  [[nodiscard]] static constexpr bool known(algorithm a) noexcept {
    for (algorithm x : ids)
      if (x == a) return true;
    return false;
  }

  /// Whether `a` implements `c` at all.
  [[nodiscard]] static constexpr bool implements(collective c, algorithm a) noexcept {
    return ((D::id == a && D::implements.contains(c)) || ...);
  }

  /// Whether `a` needs ranks on more than one node to be worth anything (hierarchical).
  [[nodiscard]] static constexpr bool needs_nodes(algorithm a) noexcept {
    return ((D::id == a && D::needs_nodes) || ...);
  }

  /// Algorithms the cost model weighs for `c`: those that implement it, the node-aware ones
  /// only when the ranks span several nodes.
  [[nodiscard]] static std::vector<algorithm> candidates(collective c, bool multi_node) {
    std::vector<algorithm> out;
    ((D::implements.contains(c) && (multi_node || !D::needs_nodes) ? out.push_back(D::id) : void()),
     ...);
    return out;
  }

  /// Predicted seconds of `a` for q; infinity where it does not apply, 0 on one rank.
  [[nodiscard]] static double predict(algorithm a, const tuning::cost_query& q) {
    if (!implements(q.c, a)) return std::numeric_limits<double>::infinity();
    if (q.ranks <= 1) return 0.0;
    double t = std::numeric_limits<double>::infinity();
    ((D::id == a ? (t = D::template cost<table>(q), void()) : void()), ...);
    return t;
  }

  /// The cheapest candidate for q (node-aware ones compete when q.nodes > 1); ties go to the
  /// earlier descriptor.
  [[nodiscard]] static algorithm select(const tuning::cost_query& q) {
    algorithm best = algorithm::ring;
    double best_t = std::numeric_limits<double>::infinity();
    // Over the descriptors directly, not candidates(): this runs on every automatic call, and
    // the vector would cost an allocation each time.
    const bool multi_node = q.nodes > 1;
    const auto weigh = [&](algorithm a, bool eligible) {
      if (!eligible) return;
      const double t = predict(a, q);
      if (t < best_t) {
        best_t = t;
        best = a;
      }
    };
    (weigh(D::id, D::implements.contains(q.c) && (multi_node || !D::needs_nodes)), ...);
    return best;
  }

  /// The prediction for what select() picks among the single-level algorithms.
  [[nodiscard]] static double predict_best(tuning::cost_query q) {
    q.nodes = 1;
    return predict(select(q), q);
  }

  /// Runs `a` (which must implement c.kind) on comm.
  template <class C, element E>
  static void run(algorithm a, C& comm, const call<E>& c, const options& opt) {
    bool ran = false;
    ((D::id == a && D::implements.contains(c.kind) ? (D::run(comm, c, opt), ran = true, void())
                                                   : void()),
     ...);
    if (!ran)
      throw unsupported(std::string(describe(c).name) + ": algorithm '" + std::string(name(a)) +
                        "' does not implement this collective");
  }
};

/// ringzero's algorithms.
using builtin = table<ring::descriptor, tree::descriptor, recursive_doubling::descriptor,
                      rabenseifner::descriptor, hierarchical::descriptor, pairwise::descriptor,
                      bruck::descriptor, linear::descriptor>;

}  // namespace ringzero::algorithms

namespace ringzero {

/// Short names as RINGZERO_ALGO and ringzero-perf -A spell them.
[[nodiscard]] constexpr std::string_view algorithm_name(algorithm a) noexcept {
  return algorithms::builtin::name(a);
}

[[nodiscard]] inline algorithm parse_algorithm(std::string_view s) {
  return algorithms::builtin::parse(s);
}

}  // namespace ringzero
