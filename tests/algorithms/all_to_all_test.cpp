#include <doctest/doctest.h>

#include <vector>

#include "conformance.hpp"
#include "ringzero/algorithms/binomial_gather.hpp"

namespace {

using namespace conformance;

constexpr algorithm flat[] = {algorithm::pairwise, algorithm::bruck, algorithm::automatic};
constexpr algorithm node_aware[] = {algorithm::hierarchical, algorithm::automatic};

/// Per-peer block lengths: the matrix's counts, the largest divided among the ranks so that a
/// rank's whole buffer stays about that large.
[[nodiscard]] std::vector<std::size_t> blocks_for(int n) {
  std::vector<std::size_t> b;
  for (std::size_t c : counts_for(n)) b.push_back(c > 1009 ? c / static_cast<std::size_t>(n) : c);
  return b;
}

/// Every rank's output differs, so each checks all of its own; the exact comparison is the
/// bitwise one.
template <element E>
void all_to_all_matrix(loopback::communicator& comm, world_log& log,
                       std::span<const algorithm> algos, std::string_view world) {
  const int n = comm.size();
  const int r = comm.rank();
  const auto un = static_cast<std::size_t>(n);
  const auto ur = static_cast<std::size_t>(r);
  std::vector<E> pristine, in, out;
  for (std::size_t block : blocks_for(n)) {
    const std::size_t total = un * block;
    const std::uint64_t seed = seed_of(dtype_of<E>(), op::sum, block, 16);
    pristine.resize(total);
    for (std::size_t i = 0; i < total; ++i)
      pristine[i] = testing::input_value<E>(seed, r, i, op::sum);
    // Block j of this rank's output is block r of rank j's input.
    const std::vector<E> expected = tabulate<E>(0, total, [&](std::size_t i) {
      return testing::input_value<E>(seed, static_cast<int>(i / block), ur * block + i % block,
                                     op::sum);
    });
    auto want = [&](std::size_t i) { return expected[i]; };
    for (bool in_place : {false, true}) {
      for (algorithm a : algos) {
        const std::string name =
            fmt::format("{}: all_to_all {} {} block {} {}", world, algorithm_name(a),
                        dtype_name(dtype_of<E>()), block, in_place ? "in place" : "out of place");
        const options opt = options_for<E>(a, in_place, total, n);
        if (in_place) {
          out = pristine;
          all_to_all(comm, std::span<E>(out), opt);
        } else {
          in = pristine;
          out.resize(total);
          poison(std::span<E>(out), 0xa5);
          all_to_all(comm, std::span<const E>(in), std::span<E>(out), opt);
          if (total && std::memcmp(in.data(), pristine.data(), total * sizeof(E)) != 0)
            log.fail(fmt::format("{}: rank {} input was modified", name, r));
        }
        check_exact(log, name, r, std::span<const E>(out), 0, total, want);
      }
    }
  }
}

/// Uneven blocks (v_count, zeros included). Send blocks are laid out in reverse peer order and
/// receive blocks in peer order, each followed by one element of gap that must stay poisoned.
template <element E>
void all_to_allv_matrix(loopback::communicator& comm, world_log& log, std::string_view world) {
  const int n = comm.size();
  const int r = comm.rank();
  const auto un = static_cast<std::size_t>(n);
  std::vector<E> in, out;
  std::vector<std::size_t> sc(un), sd(un), rc(un), rd(un);
  E gap;
  std::memset(static_cast<void*>(&gap), 0xa5, sizeof gap);
  for (std::size_t base : {std::size_t{0}, std::size_t{1}, un, std::size_t{1009}, 65537 / un}) {
    const std::uint64_t seed = seed_of(dtype_of<E>(), op::sum, base, 17);
    std::size_t off = 0;
    for (int j = n - 1; j >= 0; --j) {
      const auto uj = static_cast<std::size_t>(j);
      sc[uj] = testing::v_count(seed, r, j, base);
      sd[uj] = off;
      off += sc[uj] + 1;
    }
    in.resize(off);
    // Element k of the block for rank j is input_value(seed, r, j * 2^20 + k): distinct per pair.
    for (std::size_t j = 0; j < un; ++j)
      for (std::size_t k = 0; k < sc[j]; ++k)
        in[sd[j] + k] = testing::input_value<E>(seed, r, (j << 20) + k, op::sum);
    off = 0;
    for (std::size_t j = 0; j < un; ++j) {
      rc[j] = testing::v_count(seed, static_cast<int>(j), r, base);
      rd[j] = off;
      off += rc[j] + 1;
    }
    const std::string name =
        fmt::format("{}: all_to_allv {} base {}", world, dtype_name(dtype_of<E>()), base);
    for (algorithm a : {algorithm::pairwise, algorithm::automatic}) {
      out.assign(off, gap);
      options opt;
      opt.algorithm = a;
      opt.chunk_bytes = base * sizeof(E) / 3 + 1;
      all_to_allv(comm, std::span<const E>(in), std::span<const std::size_t>(sc),
                  std::span<const std::size_t>(sd), std::span<E>(out),
                  std::span<const std::size_t>(rc), std::span<const std::size_t>(rd), opt);
      std::size_t j = 0;
      check_exact(log, fmt::format("{} {}", name, algorithm_name(a)), r, std::span<const E>(out), 0,
                  off, [&](std::size_t i) {
                    while (j + 1 < un && i >= rd[j + 1]) ++j;
                    const std::size_t k = i - rd[j];
                    if (k >= rc[j]) return gap;
                    return testing::input_value<E>(seed, static_cast<int>(j),
                                                   (static_cast<std::size_t>(r) << 20) + k,
                                                   op::sum);
                  });
    }
  }
}

void run_all_to_all(int n, int ranks_per_node, std::span<const algorithm> algos) {
  const std::string world = ranks_per_node ? fmt::format("{} ranks, {} per node", n, ranks_per_node)
                                           : fmt::format("{} ranks", n);
  run_world(
      n, world_options_for(ranks_per_node), world,
      [&](loopback::communicator& comm, world_log& log) {
        for_each_type([&](auto e) { all_to_all_matrix<decltype(e)>(comm, log, algos, world); });
      });
}

}  // namespace

TEST_CASE("all_to_all conformance: pairwise, bruck and auto on 1..9 ranks") {
  for (int n = 1; n <= max_world; ++n) run_all_to_all(n, 0, flat);
}

TEST_CASE("all_to_all conformance: hier and auto on 2 and 3 ranks per node") {
  for (int per : {2, 3})
    for (int n = 1; n <= max_world; ++n) run_all_to_all(n, per, node_aware);
}

TEST_CASE("all_to_allv conformance: uneven and empty blocks, pairwise and auto, 1..9 ranks") {
  for (int n = 1; n <= max_world; ++n) {
    const std::string world = fmt::format("{} ranks", n);
    run_world(n, world_options_for(), world, [&](loopback::communicator& comm, world_log& log) {
      for_each_type([&](auto e) { all_to_allv_matrix<decltype(e)>(comm, log, world); });
    });
  }
}

TEST_CASE("binomial gather tree: every rank reached once, subtrees contiguous") {
  namespace bn = ringzero::algorithms::binomial::detail;
  for (int n = 1; n <= 70; ++n) {
    INFO("n = " << n);
    std::vector<int> owner(static_cast<std::size_t>(n), -1);
    CHECK(bn::subtree_of(0, n).size == n);
    for (int v = 0; v < n; ++v) {
      const auto t = bn::subtree_of(v, n);
      int covered = 1;
      for (int m : t.child_offsets) {
        const auto c = bn::subtree_of(v + m, n);
        CHECK(c.parent == v);
        CHECK(c.size == std::min(m, n - v - m));
        covered += c.size;
      }
      CHECK(covered == t.size);
      if (v) {
        ++owner[static_cast<std::size_t>(v)];
        CHECK(t.parent < v);
      }
    }
    for (int v = 1; v < n; ++v) CHECK(owner[static_cast<std::size_t>(v)] == 0);
  }
}
