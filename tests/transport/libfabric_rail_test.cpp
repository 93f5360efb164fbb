// Rails of the libfabric transport: a NIC is a rail (libfabric/rail.hpp) under one operation
// engine (libfabric/engine.hpp), and more NICs are more rails with no change to the engine. Two
// rails on loopback stand in for two NICs here (each rail is an endpoint, address vector and
// registration cache of its own). The typed transport suite runs every behaviour and the
// conformance matrix over them ("libfabric rails" in transport_conformance_test.cpp); this file
// checks what is the rails' own: where messages go, rails from the environment, and the
// configurations that cannot work, refused naming what is wrong.
#include <doctest/doctest.h>
#include <stdlib.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "multiprocess.hpp"
#include "ringzero/ringzero.hpp"
#include "ringzero/transport/libfabric.hpp"

using namespace std::chrono_literals;
using ringzero::op;
namespace fabric = ringzero::libfabric;
using multiprocess::rank_checks;
using multiprocess::require_all_passed;

namespace {

const char* const tcp = "tcp;ofi_rxm";

/// Two rails, both on loopback: the provider names the interface "lo" as its domain.
fabric::options two_rails() {
  return {.provider = tcp, .rails = {"lo", "lo"}};
}

}  // namespace

TEST_CASE("a message's rail is a function of its tag that spreads a collective over the rails") {
  using ringzero::tag_layout;
  using rail_engine = fabric::detail::engine;
  for (std::size_t rails : {1u, 2u, 3u, 4u}) {
    CAPTURE(rails);
    std::vector<std::size_t> per_rail(rails);
    // The tags of a long pipelined collective: every step, every chunk, a few sequence numbers.
    for (std::uint64_t seq = 0; seq < 4; ++seq)
      for (std::uint64_t step = 0; step < 16; ++step)
        for (std::uint64_t chunk = 0; chunk < 16; ++chunk) {
          const auto tag = tag_layout::make(false, seq, step, chunk);
          const auto r = rail_engine::rail_for(tag, rails);
          REQUIRE(r < rails);
          CHECK(r == rail_engine::rail_for(tag, rails));  // both ends compute the same
          ++per_rail[r];
        }
    const std::size_t total = 4 * 16 * 16;
    for (std::size_t r = 0; r < rails; ++r) {
      CAPTURE(r);
      // Within a quarter of an even share: no rail idles while another carries the collective.
      CHECK(per_rail[r] * rails * 4 >= total * 3);
      CHECK(per_rail[r] * rails * 4 <= total * 5);
    }
  }
}

TEST_CASE("two rails: a collective's messages go over both") {
  auto out = multiprocess::run(3, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    fabric::communicator comm(fabric::transport(s, r, n, two_rails()));
    const auto& eng = comm.transport().engine();
    check.expect(eng.rails() == 2, fmt::format("two rails, got {}", eng.rails()));
    check.expect(eng.rail_domain(0) == "lo" && eng.rail_domain(1) == "lo", "both on lo");
    // A pipelined ring: many chunks and steps, so many tags.
    std::vector<float> v(1 << 20, static_cast<float>(r + 1));
    ringzero::all_reduce(comm, std::span<float>(v), op::sum,
                         {.algorithm = ringzero::algorithm::ring, .chunk_bytes = 64 << 10});
    check.expect(v.front() == 6.0f && v.back() == 6.0f, "the sum 1 + 2 + 3 everywhere");
    for (std::size_t i = 0; i < eng.rails(); ++i)
      check.expect(eng.rail_messages(i) > 10,
                   fmt::format("rail {} to carry its share, it carried {} messages", i,
                               eng.rail_messages(i)));
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("RINGZERO_RAILS opens the rails; shm has no NIC and keeps one") {
  ::setenv("RINGZERO_RAILS", "lo,lo,lo", 1);
  for (const char* provider : {tcp, "shm"}) {
    CAPTURE(provider);
    const std::size_t expected = std::string(provider) == "shm" ? 1 : 3;
    auto out = multiprocess::run(2, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
      rank_checks check{r};
      fabric::communicator comm(fabric::transport(s, r, n, {.provider = provider}));
      check.expect(comm.transport().engine().rails() == expected,
                   fmt::format("{} rails, got {}", expected, comm.transport().engine().rails()));
      std::vector<double> v(100000, r + 1.0);
      ringzero::all_reduce(comm, std::span<double>(v), op::sum);
      check.expect(v.front() == 3.0 && v.back() == 3.0, "the sum 1 + 2 everywhere");
      return check.code();
    });
    require_all_passed(out);
  }
  ::unsetenv("RINGZERO_RAILS");
}

TEST_CASE("rails that cannot work are refused naming what is wrong") {
  SUBCASE("a NIC the provider does not have: the error lists the ones it has") {
    auto out = multiprocess::run(2, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
      rank_checks check{r};
      std::string what;
      try {
        fabric::transport t(s, r, n, {.provider = tcp, .rails = {"lo", "no-such-nic0"}});
      } catch (const ringzero::error& e) {
        what = e.what();
      }
      check.expect(what.find("no domain named 'no-such-nic0'") != std::string::npos &&
                       what.find("lo") != std::string::npos,
                   fmt::format("the missing NIC and those on offer named, got '{}'", what));
      return check.code();
    });
    require_all_passed(out);
  }
  SUBCASE("ranks that open different numbers of rails") {
    auto out = multiprocess::run(2, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
      rank_checks check{r};
      fabric::options opt{.provider = tcp, .rails = {"lo"}};
      if (r == 1) opt.rails = {"lo", "lo"};
      std::string what;
      try {
        fabric::transport t(s, r, n, opt);
      } catch (const ringzero::invalid_argument& e) {
        what = e.what();
      }
      const std::string other = r == 0 ? "rank 1 opened 2 libfabric rails and this rank 1"
                                       : "rank 0 opened 1 libfabric rail and this rank 2";
      check.expect(what.find(other) != std::string::npos,
                   fmt::format("'{}' in the error, got '{}'", other, what));
      return check.code();
    });
    require_all_passed(out);
  }
}
