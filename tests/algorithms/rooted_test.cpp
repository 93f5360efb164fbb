#include <doctest/doctest.h>

#include <atomic>
#include <vector>

#include "conformance.hpp"

namespace {

using namespace conformance;

// ring = pipelined chain, tree = binomial tree for the rooted collectives.
constexpr algorithm algos[] = {algorithm::ring, algorithm::tree, algorithm::automatic};

[[nodiscard]] std::vector<int> roots_for(int n) {
  std::vector<int> r = {0, n / 2, n - 1};
  std::sort(r.begin(), r.end());
  r.erase(std::unique(r.begin(), r.end()), r.end());
  return r;
}

template <element E>
void broadcast_matrix(loopback::communicator& comm, world_log& log, std::string_view world) {
  const int n = comm.size();
  const int r = comm.rank();
  std::vector<E> in, out;
  for (int root : roots_for(n)) {
    for (std::size_t count : counts_for(n)) {
      const std::uint64_t seed = seed_of(dtype_of<E>(), op::sum, count, root);
      // The root's input (the whole buffer there), or the slice [lo, hi) this rank checks.
      const auto [lo, hi] = slice(count, r, n);
      const std::size_t from = r == root ? 0 : lo, to = r == root ? count : hi;
      const std::vector<E> expected = tabulate<E>(
          from, to, [&](std::size_t i) { return testing::input_value<E>(seed, root, i, op::sum); });
      auto want = [&](std::size_t i) { return expected[i - from]; };
      for (bool in_place : {false, true}) {
        for (algorithm a : algos) {
          const std::string name = fmt::format("{}: broadcast {} {} root {} count {} {}", world,
                                               algorithm_name(a), dtype_name(dtype_of<E>()), root,
                                               count, in_place ? "in place" : "out of place");
          const options opt = options_for<E>(a, in_place, count, n);
          in.resize(r == root ? count : 0);
          for (std::size_t i = 0; i < in.size(); ++i) in[i] = want(i);
          out.resize(count);
          poison(std::span<E>(out), 0xa5);
          for (std::size_t i = lo; i < hi; ++i) out[i] = testing::complement(want(i));
          if (in_place) {
            if (r == root) out = in;
            broadcast(comm, std::span<E>(out), root, opt);
          } else {
            broadcast(comm, std::span<const E>(in), std::span<E>(out), root, opt);
          }
          check_exact(log, name, r, std::span<const E>(out), lo, hi, want);
          log.record(r, name, digest_of(std::span<const E>(out)));
        }
      }
    }
  }
}

// Only the root receives, so it checks everything; every other rank checks that its output
// (when it passes one) is untouched.
template <element E>
void reduce_matrix(loopback::communicator& comm, world_log& log, std::string_view world) {
  const int n = comm.size();
  const int r = comm.rank();
  std::vector<E> pristine, data, out;
  std::vector<testing::reduced<E>> want;
  for (int root : roots_for(n)) {
    for (op o : all_ops) {
      for (std::size_t count : counts_for(n)) {
        const std::uint64_t seed = seed_of(dtype_of<E>(), o, count, root);
        pristine.resize(count);
        for (std::size_t i = 0; i < count; ++i)
          pristine[i] = testing::input_value<E>(seed, r, i, o);
        want.clear();
        if (r == root)
          for (std::size_t i = 0; i < count; ++i)
            want.push_back(testing::reduce_serial<E>(
                o, n, [&](int j) { return testing::input_value<E>(seed, j, i, o); }));
        for (bool in_place : {false, true}) {
          for (std::size_t ai = 0; ai < std::size(algos); ++ai) {
            const algorithm a = algos[ai];
            const std::string name =
                fmt::format("{}: reduce {} {} {} root {} count {} {}", world, algorithm_name(a),
                            dtype_name(dtype_of<E>()), op_name(o), root, count,
                            in_place ? "in place" : "out of place");
            const options opt = options_for<E>(a, in_place, count, n);
            data = pristine;
            std::span<E> result;
            if (in_place) {
              result = std::span<E>(data);
              reduce(comm, result, o, root, opt);
            } else {
              // Off the root, out may be empty; alternate that with a buffer that must stay as
              // it is.
              const bool empty_out = r != root && ai % 2 == 0;
              out.resize(empty_out ? 0 : count);
              for (std::size_t i = 0; i < out.size(); ++i)
                out[i] = testing::complement(r == root ? want[i].exact : pristine[i]);
              result = std::span<E>(out);
              reduce(comm, std::span<const E>(data), result, o, root, opt);
              if (count && std::memcmp(data.data(), pristine.data(), count * sizeof(E)) != 0)
                log.fail(fmt::format("{}: rank {} input was modified", name, r));
            }
            if (r == root) {
              check_reduced(log, name, r, std::span<const E>(result), 0, count,
                            [&](std::size_t i) { return want[i]; });
            } else {
              check_exact(log, name, r, std::span<const E>(result), 0, result.size(),
                          [&](std::size_t i) {
                            return in_place ? pristine[i] : testing::complement(pristine[i]);
                          });
            }
          }
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("broadcast conformance: chain, binomial and auto, three roots, 1..9 ranks") {
  for (int n = 1; n <= max_world; ++n) {
    const std::string world = fmt::format("{} ranks", n);
    run_world(n, world_options_for(), world, [&](loopback::communicator& comm, world_log& log) {
      for_each_type([&](auto e) { broadcast_matrix<decltype(e)>(comm, log, world); });
    });
  }
}

TEST_CASE("reduce conformance: chain, binomial and auto, three roots, 1..9 ranks") {
  for (int n = 1; n <= max_world; ++n) {
    const std::string world = fmt::format("{} ranks", n);
    run_world(n, world_options_for(), world, [&](loopback::communicator& comm, world_log& log) {
      for_each_type([&](auto e) { reduce_matrix<decltype(e)>(comm, log, world); });
    });
  }
}

TEST_CASE("barrier: nobody leaves before everyone arrived, 1..9 ranks") {
  for (int n = 1; n <= max_world; ++n) {
    const std::string world = fmt::format("{} ranks", n);
    std::atomic<int> arrived{0};
    constexpr int rounds = 50;
    run_world(n, world_options_for(), world, [&](loopback::communicator& comm, world_log& log) {
      for (int k = 0; k < rounds; ++k) {
        arrived.fetch_add(1);
        barrier(comm);
        log.checked();
        // Others may already be in the next round, but all of this round must be in.
        const int seen = arrived.load();
        if (seen < n * (k + 1))
          log.fail(
              fmt::format("{}: rank {} left barrier {} having seen {} arrivals, expected "
                          ">= {}",
                          world, comm.rank(), k, seen, n * (k + 1)));
      }
    });
  }
}
