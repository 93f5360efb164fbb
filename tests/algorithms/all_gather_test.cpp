#include <doctest/doctest.h>

#include <vector>

#include "conformance.hpp"

namespace {

using namespace conformance;

constexpr algorithm algos[] = {algorithm::ring, algorithm::recursive_doubling,
                               algorithm::automatic};

template <element E>
void all_gather_matrix(loopback::communicator& comm, world_log& log, std::string_view world) {
  const int n = comm.size();
  const int r = comm.rank();
  const auto un = static_cast<std::size_t>(n);
  std::vector<E> pristine, in, out;
  for (std::size_t count : counts_for(n)) {
    const std::uint64_t seed = seed_of(dtype_of<E>(), op::sum, count);
    pristine.resize(count);
    for (std::size_t i = 0; i < count; ++i)
      pristine[i] = testing::input_value<E>(seed, r, i, op::sum);
    // This rank checks its slice [lo, hi) of the output.
    const auto [lo, hi] = slice(un * count, r, n);
    const std::vector<E> expected = tabulate<E>(lo, hi, [&](std::size_t i) {
      return testing::input_value<E>(seed, static_cast<int>(i / count), i % count, op::sum);
    });
    auto want = [&, lo = lo](std::size_t i) { return expected[i - lo]; };
    for (bool in_place : {false, true}) {
      for (algorithm a : algos) {
        const std::string name =
            fmt::format("{}: all_gather {} {} count {} {}", world, algorithm_name(a),
                        dtype_name(dtype_of<E>()), count, in_place ? "in place" : "out of place");
        const options opt = options_for<E>(a, in_place, un * count, n);
        out.resize(un * count);
        poison(std::span<E>(out), 0xa5);
        for (std::size_t i = lo; i < hi; ++i) out[i] = testing::complement(want(i));
        const std::size_t base = static_cast<std::size_t>(r) * count;
        if (in_place) {
          std::copy(pristine.begin(), pristine.end(),
                    out.begin() + static_cast<std::ptrdiff_t>(base));
          all_gather(comm, std::span<const E>(out).subspan(base, count), std::span<E>(out), opt);
        } else {
          in = pristine;
          all_gather(comm, std::span<const E>(in), std::span<E>(out), opt);
          if (count && std::memcmp(in.data(), pristine.data(), count * sizeof(E)) != 0)
            log.fail(fmt::format("{}: rank {} input was modified", name, r));
        }
        check_exact(log, name, r, std::span<const E>(out), lo, hi, want);
        log.record(r, name, digest_of(std::span<const E>(out)));
      }
    }
  }
}

}  // namespace

TEST_CASE("all_gather conformance: ring, rd (Bruck off powers of two) and auto on 1..9 ranks") {
  for (int n = 1; n <= max_world; ++n) {
    const std::string world = fmt::format("{} ranks", n);
    run_world(n, world_options_for(), world, [&](loopback::communicator& comm, world_log& log) {
      for_each_type([&](auto e) { all_gather_matrix<decltype(e)>(comm, log, world); });
    });
  }
}
