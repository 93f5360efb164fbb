#include <doctest/doctest.h>

#include <set>
#include <vector>

#include "conformance.hpp"
#include "ringzero/algorithms/tree.hpp"

namespace {

using namespace conformance;

constexpr algorithm flat[] = {algorithm::ring, algorithm::tree, algorithm::recursive_doubling,
                              algorithm::recursive_halving_doubling, algorithm::automatic};
constexpr algorithm node_aware[] = {algorithm::hierarchical, algorithm::automatic};

template <element E>
void all_reduce_matrix(loopback::communicator& comm, world_log& log,
                       std::span<const algorithm> algos, std::string_view world) {
  const int n = comm.size();
  const int r = comm.rank();
  std::vector<E> pristine, in, out;
  std::vector<testing::reduced<E>> want;
  for (op o : all_ops) {
    for (std::size_t count : counts_for(n)) {
      const std::uint64_t seed = seed_of(dtype_of<E>(), o, count);
      pristine.resize(count);
      for (std::size_t i = 0; i < count; ++i) pristine[i] = testing::input_value<E>(seed, r, i, o);
      const auto range = slice(count, r, n);
      const std::size_t lo = range.first, hi = range.second;  // lambdas below capture lo
      want.clear();
      for (std::size_t i = lo; i < hi; ++i)
        want.push_back(testing::reduce_serial<E>(
            o, n, [&](int j) { return testing::input_value<E>(seed, j, i, o); }));
      for (bool in_place : {false, true}) {
        for (algorithm a : algos) {
          const std::string name = fmt::format(
              "{}: all_reduce {} {} {} count {} {}", world, algorithm_name(a),
              dtype_name(dtype_of<E>()), op_name(o), count, in_place ? "in place" : "out of place");
          const options opt = options_for<E>(a, in_place, count, n);
          if (in_place) {
            out = pristine;
            all_reduce(comm, std::span<E>(out), o, opt);
          } else {
            in = pristine;
            out.resize(count);
            poison(std::span<E>(out), 0xa5);
            for (std::size_t i = lo; i < hi; ++i) out[i] = testing::complement(want[i - lo].exact);
            all_reduce(comm, std::span<const E>(in), std::span<E>(out), o, opt);
            if (count && std::memcmp(in.data(), pristine.data(), count * sizeof(E)) != 0)
              log.fail(fmt::format("{}: rank {} input was modified", name, r));
          }
          check_reduced(log, name, r, std::span<const E>(out), lo, hi,
                        [&](std::size_t i) { return want[i - lo]; });
          log.record(r, name, digest_of(std::span<const E>(out)));
        }
      }
    }
  }
}

void run_matrix(int n, int ranks_per_node, std::span<const algorithm> algos) {
  const std::string world = ranks_per_node ? fmt::format("{} ranks, {} per node", n, ranks_per_node)
                                           : fmt::format("{} ranks", n);
  run_world(
      n, world_options_for(ranks_per_node), world,
      [&](loopback::communicator& comm, world_log& log) {
        for_each_type([&](auto e) { all_reduce_matrix<decltype(e)>(comm, log, algos, world); });
      });
}

}  // namespace

TEST_CASE("all_reduce conformance: ring, tree, rd, rhd and auto on 1..9 ranks") {
  for (int n = 1; n <= max_world; ++n) run_matrix(n, 0, flat);
}

TEST_CASE("all_reduce conformance: hier and auto on 2 and 3 ranks per node") {
  for (int per : {2, 3}) {
    for (int n = 1; n <= max_world; ++n) {
      try {
        run_matrix(n, per, node_aware);
      } catch (const ringzero::unsupported& e) {
        MESSAGE("hierarchical all_reduce skipped on " << n << " ranks, " << per
                                                      << " per node: " << e.what());
        return;
      }
    }
  }
}

TEST_CASE("double binary tree: consistent trees, no rank a leaf in both") {
  namespace tree = ringzero::algorithms::tree;
  for (int n = 2; n <= 70; ++n) {
    INFO("n = " << n);
    std::vector<bool> leaf_in_first(static_cast<std::size_t>(n));
    for (int which : {0, 1}) {
      INFO("tree " << which);
      int roots = 0;
      std::vector<int> parent(static_cast<std::size_t>(n));
      for (int r = 0; r < n; ++r) {
        const auto node = tree::detail::double_tree_node(n, r, which);
        parent[static_cast<std::size_t>(r)] = node.parent;
        if (node.parent < 0) ++roots;
        CHECK(node.children.size() <= 2);
        CHECK(node.self <= node.children.size());
        for (std::size_t k = 0; k < node.children.size(); ++k) {
          const int c = node.children[k];
          CHECK(tree::detail::double_tree_node(n, c, which).parent == r);
          CHECK((c < r) == (k < node.self));  // lower ranks combine first
        }
        const bool leaf = node.children.empty();
        if (which == 0)
          leaf_in_first[static_cast<std::size_t>(r)] = leaf;
        else
          CHECK_FALSE((leaf && leaf_in_first[static_cast<std::size_t>(r)]));
      }
      CHECK(roots == 1);
      // Every rank reaches the root within floor(log2 n) + 1 hops: a tree, and a shallow one.
      int max_depth = 0;
      for (int r = 0; r < n; ++r) {
        int d = 0;
        for (int x = r; parent[static_cast<std::size_t>(x)] >= 0 && d <= n; ++d)
          x = parent[static_cast<std::size_t>(x)];
        max_depth = std::max(max_depth, d);
      }
      CHECK(max_depth <= ringzero::tuning::floor_log2(n) + 1);
    }
  }
}
