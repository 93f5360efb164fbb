#include <doctest/doctest.h>

#include <vector>

#include "conformance.hpp"

namespace {

using namespace conformance;

// linear = the root talks to every rank, tree = binomial tree.
constexpr algorithm algos[] = {algorithm::linear, algorithm::tree, algorithm::automatic};

[[nodiscard]] std::vector<int> roots_for(int n) {
  std::vector<int> r = {0, n / 2, n - 1};
  std::sort(r.begin(), r.end());
  r.erase(std::unique(r.begin(), r.end()), r.end());
  return r;
}

// Only the root receives, so it checks everything; every other rank checks that its output
// (when it passes one) is untouched.
template <element E>
void gather_matrix(loopback::communicator& comm, world_log& log, std::string_view world) {
  const int n = comm.size();
  const int r = comm.rank();
  const auto un = static_cast<std::size_t>(n);
  std::vector<E> pristine, in, out;
  for (int root : roots_for(n)) {
    for (std::size_t count : counts_for(n)) {
      const std::uint64_t seed = seed_of(dtype_of<E>(), op::sum, count, 32 + root);
      pristine.resize(count);
      for (std::size_t i = 0; i < count; ++i)
        pristine[i] = testing::input_value<E>(seed, r, i, op::sum);
      const std::vector<E> expected =
          tabulate<E>(0, r == root ? un * count : 0, [&](std::size_t i) {
            return testing::input_value<E>(seed, static_cast<int>(i / count), i % count, op::sum);
          });
      auto want = [&](std::size_t i) { return expected[i]; };
      for (bool in_place : {false, true}) {
        for (std::size_t ai = 0; ai < std::size(algos); ++ai) {
          const algorithm a = algos[ai];
          const std::string name = fmt::format("{}: gather {} {} root {} count {} {}", world,
                                               algorithm_name(a), dtype_name(dtype_of<E>()), root,
                                               count, in_place ? "in place" : "out of place");
          const options opt = options_for<E>(a, in_place, un * count, n);
          const bool empty_out = r != root && ai % 2 == 0;
          out.resize(empty_out ? 0 : un * count);
          poison(std::span<E>(out), 0xa5);
          const std::vector<E> out_before = out;
          const std::size_t base = static_cast<std::size_t>(r) * count;
          if (in_place && r == root) {
            std::copy(pristine.begin(), pristine.end(),
                      out.begin() + static_cast<std::ptrdiff_t>(base));
            gather(comm, std::span<const E>(out).subspan(base, count), std::span<E>(out), root,
                   opt);
          } else {
            in = pristine;
            gather(comm, std::span<const E>(in), std::span<E>(out), root, opt);
            if (count && std::memcmp(in.data(), pristine.data(), count * sizeof(E)) != 0)
              log.fail(fmt::format("{}: rank {} input was modified", name, r));
          }
          if (r == root)
            check_exact(log, name, r, std::span<const E>(out), 0, un * count, want);
          else
            check_exact(log, name, r, std::span<const E>(out), 0, out.size(),
                        [&](std::size_t i) { return out_before[i]; });
        }
      }
    }
  }
}

template <element E>
void scatter_matrix(loopback::communicator& comm, world_log& log, std::string_view world) {
  const int n = comm.size();
  const int r = comm.rank();
  const auto un = static_cast<std::size_t>(n);
  std::vector<E> in, out;
  for (int root : roots_for(n)) {
    for (std::size_t count : counts_for(n)) {
      const std::uint64_t seed = seed_of(dtype_of<E>(), op::sum, count, 48 + root);
      const std::size_t base = static_cast<std::size_t>(r) * count;
      const std::vector<E> expected = tabulate<E>(base, base + count, [&](std::size_t i) {
        return testing::input_value<E>(seed, root, i, op::sum);
      });
      auto want = [&](std::size_t i) { return expected[i]; };
      // This rank's full input (what the root sends), once per case.
      const std::vector<E> source = tabulate<E>(0, un * count, [&](std::size_t i) {
        return testing::input_value<E>(seed, r, i, op::sum);
      });
      for (bool in_place : {false, true}) {
        for (std::size_t ai = 0; ai < std::size(algos); ++ai) {
          const algorithm a = algos[ai];
          const std::string name = fmt::format("{}: scatter {} {} root {} count {} {}", world,
                                               algorithm_name(a), dtype_name(dtype_of<E>()), root,
                                               count, in_place ? "in place" : "out of place");
          const options opt = options_for<E>(a, in_place, un * count, n);
          // Off the root, in may be empty; alternate that with a buffer that must stay as it is.
          in.assign(source.begin(), source.begin() + static_cast<std::ptrdiff_t>(
                                                         r == root || ai % 2 ? un * count : 0));
          const std::vector<E> in_before = in;
          std::span<E> result;
          if (in_place && r == root) {
            result = std::span<E>(in).subspan(base, count);
            scatter(comm, std::span<const E>(in), result, root, opt);
          } else {
            out.resize(count);
            poison(std::span<E>(out), 0xa5);
            result = std::span<E>(out);
            scatter(comm, std::span<const E>(in), result, root, opt);
            if (!in.empty() && std::memcmp(in.data(), in_before.data(), in.size() * sizeof(E)))
              log.fail(fmt::format("{}: rank {} input was modified", name, r));
          }
          check_exact(log, name, r, std::span<const E>(result), 0, count, want);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("gather conformance: linear, binomial and auto, three roots, 1..9 ranks") {
  for (int n = 1; n <= max_world; ++n) {
    const std::string world = fmt::format("{} ranks", n);
    run_world(n, world_options_for(), world, [&](loopback::communicator& comm, world_log& log) {
      for_each_type([&](auto e) { gather_matrix<decltype(e)>(comm, log, world); });
    });
  }
}

TEST_CASE("scatter conformance: linear, binomial and auto, three roots, 1..9 ranks") {
  for (int n = 1; n <= max_world; ++n) {
    const std::string world = fmt::format("{} ranks", n);
    run_world(n, world_options_for(), world, [&](loopback::communicator& comm, world_log& log) {
      for_each_type([&](auto e) { scatter_matrix<decltype(e)>(comm, log, world); });
    });
  }
}
