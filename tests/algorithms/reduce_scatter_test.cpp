#include <doctest/doctest.h>

#include <vector>

#include "conformance.hpp"

namespace {

using namespace conformance;

constexpr algorithm algos[] = {algorithm::ring, algorithm::recursive_halving_doubling,
                               algorithm::automatic};

// Each rank checks its whole output block: the blocks differ, so there is nothing to compare
// across ranks.
template <element E>
void reduce_scatter_matrix(loopback::communicator& comm, world_log& log, std::string_view world) {
  const int n = comm.size();
  const int r = comm.rank();
  const auto un = static_cast<std::size_t>(n);
  std::vector<E> pristine, in, out;
  std::vector<testing::reduced<E>> want;
  for (op o : all_ops) {
    for (std::size_t count : counts_for(n)) {
      const std::uint64_t seed = seed_of(dtype_of<E>(), o, count);
      pristine.resize(un * count);
      for (std::size_t i = 0; i < pristine.size(); ++i)
        pristine[i] = testing::input_value<E>(seed, r, i, o);
      const std::size_t base = static_cast<std::size_t>(r) * count;
      want.clear();
      for (std::size_t i = 0; i < count; ++i)
        want.push_back(testing::reduce_serial<E>(
            o, n, [&](int j) { return testing::input_value<E>(seed, j, base + i, o); }));
      for (bool in_place : {false, true}) {
        for (algorithm a : algos) {
          const std::string name = fmt::format(
              "{}: reduce_scatter {} {} {} count {} {}", world, algorithm_name(a),
              dtype_name(dtype_of<E>()), op_name(o), count, in_place ? "in place" : "out of place");
          const options opt = options_for<E>(a, in_place, un * count, n);
          in = pristine;
          std::span<E> result;
          if (in_place) {
            result = std::span<E>(in).subspan(base, count);
            reduce_scatter(comm, std::span<const E>(in), result, o, opt);
            // Only this rank's block may change.
            const std::size_t block = count * sizeof(E);
            if (count && (std::memcmp(in.data(), pristine.data(), base * sizeof(E)) != 0 ||
                          std::memcmp(in.data() + base + count, pristine.data() + base + count,
                                      in.size() * sizeof(E) - base * sizeof(E) - block) != 0))
              log.fail(fmt::format("{}: rank {} input outside its block was modified", name, r));
          } else {
            out.resize(count);
            for (std::size_t i = 0; i < count; ++i) out[i] = testing::complement(want[i].exact);
            result = std::span<E>(out);
            reduce_scatter(comm, std::span<const E>(in), result, o, opt);
            if (!in.empty() && std::memcmp(in.data(), pristine.data(), in.size() * sizeof(E)) != 0)
              log.fail(fmt::format("{}: rank {} input was modified", name, r));
          }
          check_reduced(log, name, r, std::span<const E>(result), 0, count,
                        [&](std::size_t i) { return want[i]; });
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("reduce_scatter conformance: ring, rhd and auto on 1..9 ranks") {
  for (int n = 1; n <= max_world; ++n) {
    const std::string world = fmt::format("{} ranks", n);
    run_world(n, world_options_for(), world, [&](loopback::communicator& comm, world_log& log) {
      for_each_type([&](auto e) { reduce_scatter_matrix<decltype(e)>(comm, log, world); });
    });
  }
}
