// Rails of the libfabric transport: a NIC is a rail (libfabric/rail.hpp) under the transport
// kit's engine (transport/detail/rail_engine.hpp), and more NICs are more rails with no change to
// the engine. Two rails on loopback stand in for two NICs here (each rail is an endpoint, address
// vector and registration cache of its own). The typed transport suite runs every behaviour and
// the conformance matrix over them ("libfabric rails" in transport_conformance_test.cpp), and a
// rail that fails on three ("libfabric failover"); the kit's own tests (rail_engine_test.cpp)
// check striping and delivery in themselves. This file checks what is libfabric's: where its
// messages go (whole on their tag's rail, or from options::stripe_bytes cut into one piece per
// rail by the link speeds both ends agreed), rails from the environment (discovery between hosts
// runs on the namespace bed: tests/tools/netbed_test.sh), and the configurations that cannot
// work, refused naming what is wrong.
#include <doctest/doctest.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
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

TEST_CASE("two rails: a collective's messages go over both") {
  auto out = multiprocess::run(3, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    fabric::communicator comm(fabric::transport(s, r, n, two_rails()));
    const auto& eng = comm.transport().engine();
    check.expect(eng.rails() == 2, fmt::format("two rails, got {}", eng.rails()));
    check.expect(eng.rail_name(0) == "lo" && eng.rail_name(1) == "lo", "both on lo");
    const auto base = ringzero::tuning::libfabric_default(comm.transport().provider()).value;
    check.expect(comm.tuning().alpha == base.alpha && comm.tuning().beta == base.beta / 2,
                 fmt::format("priced as two rails (beta {} against one rail's {}), got alpha {}",
                             base.beta / 2, base.beta, comm.tuning().alpha));
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

TEST_CASE("one large message travels in a piece on every rail; a small one whole on one") {
  auto out = multiprocess::run(2, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    fabric::communicator comm(fabric::transport(s, r, n, two_rails()));
    const auto& eng = comm.transport().engine();
    check.expect(eng.stripe_bytes() == (std::size_t{128} << 10),
                 fmt::format("striped from 128 KiB by default, got {}", eng.stripe_bytes()));
    const auto carried = [&] {
      std::vector<std::uint64_t> v;
      for (std::size_t i = 0; i < eng.rails(); ++i) v.push_back(eng.rail_messages(i));
      return v;
    };
    for (const std::size_t bytes : {(std::size_t{1} << 20) + 4, std::size_t{64} << 10}) {
      std::vector<std::byte> buf(bytes);
      const auto before = carried();
      if (r == 0) {
        for (std::size_t i = 0; i < bytes; ++i) buf[i] = static_cast<std::byte>(i * 131 + 7);
        auto q = comm.isend(1, 3, buf);
        while (!comm.test(q)) {
        }
      } else {
        auto q = comm.irecv(0, 3, buf);
        while (!comm.test(q)) {
        }
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < bytes; ++i)
          wrong += buf[i] != static_cast<std::byte>(i * 131 + 7);
        check.expect(wrong == 0, fmt::format("{} bytes intact, {} wrong", bytes, wrong));
      }
      const auto after = carried();
      std::vector<std::uint64_t> added(after.size());
      for (std::size_t i = 0; i < after.size(); ++i) added[i] = after[i] - before[i];
      const auto expected = bytes >= eng.stripe_bytes() ? std::vector<std::uint64_t>{1, 1}
                                                        : std::vector<std::uint64_t>{};
      if (!expected.empty())
        check.expect(added == expected,
                     fmt::format("{} bytes: a piece on each rail, got {} and {} messages", bytes,
                                 added[0], added[1]));
      else
        check.expect(added[0] + added[1] == 1,
                     fmt::format("{} bytes: one message on one rail, got {} and {}", bytes,
                                 added[0], added[1]));
    }
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("ranks that stripe from different sizes are refused naming both; a bad size too") {
  SUBCASE("options") {
    auto out = multiprocess::run(2, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
      rank_checks check{r};
      auto opt = two_rails();
      if (r == 1) opt.stripe_bytes = 4096;
      std::string what;
      try {
        fabric::transport t(s, r, n, opt);
      } catch (const ringzero::invalid_argument& e) {
        what = e.what();
      }
      const std::string other =
          r == 0 ? "rank 1 stripes messages of 4096 bytes and more over its rails, this rank "
                   "from 131072"
                 : "rank 0 stripes messages of 131072 bytes and more over its rails, this rank "
                   "from 4096";
      check.expect(what.find(other) != std::string::npos,
                   fmt::format("'{}' in the error, got '{}'", other, what));
      return check.code();
    });
    require_all_passed(out);
  }
  SUBCASE("RINGZERO_STRIPE_BYTES") {
    for (const char* value : {"-1", "12k"}) {
      CAPTURE(value);
      ::setenv("RINGZERO_STRIPE_BYTES", value, 1);
      auto out = multiprocess::run(1, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
        rank_checks check{r};
        std::string what;
        try {
          fabric::transport t(s, r, n, two_rails());
        } catch (const ringzero::invalid_argument& e) {
          what = e.what();
        }
        check.expect(what.find(std::string("RINGZERO_STRIPE_BYTES")) != std::string::npos &&
                         what.find(value) != std::string::npos,
                     fmt::format("the variable and its value named, got '{}'", what));
        return check.code();
      });
      require_all_passed(out);
    }
    ::setenv("RINGZERO_STRIPE_BYTES", "4096", 1);
    auto out = multiprocess::run(1, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
      rank_checks check{r};
      fabric::transport t(s, r, n, two_rails());
      check.expect(t.engine().stripe_bytes() == 4096,
                   fmt::format("4096 from the variable, got {}", t.engine().stripe_bytes()));
      return check.code();
    });
    require_all_passed(out);
    ::unsetenv("RINGZERO_STRIPE_BYTES");
  }
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

TEST_CASE("RINGZERO_RAILS=auto with every rank on one host is one rail") {
  ::setenv("RINGZERO_RAILS", "auto", 1);
  auto out = multiprocess::run(2, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    fabric::communicator comm(fabric::transport(s, r, n, {.provider = tcp}));
    check.expect(comm.transport().engine().rails() == 1,
                 fmt::format("one rail, got {}", comm.transport().engine().rails()));
    std::vector<double> v(100000, r + 1.0);
    ringzero::all_reduce(comm, std::span<double>(v), op::sum);
    check.expect(v.front() == 3.0 && v.back() == 3.0, "the sum 1 + 2 everywhere");
    return check.code();
  });
  ::unsetenv("RINGZERO_RAILS");
  require_all_passed(out);
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
  SUBCASE("a GPU named by something that is no PCI address, as an option or a variable") {
    ::setenv("RINGZERO_GPU_BUS_ID", "gpu0", 1);
    auto out = multiprocess::run(1, 60s, [&](int r, int n, ringzero::bootstrap::store& s) {
      rank_checks check{r};
      for (const bool from_env : {false, true}) {
        fabric::options opt{.provider = tcp, .rails = {"auto"}};
        if (!from_env) opt.gpu_bus_id = "0000:53:00";
        std::string what;
        try {
          fabric::transport t(s, r, n, opt);
        } catch (const ringzero::invalid_argument& e) {
          what = e.what();
        }
        const std::string named = from_env ? "RINGZERO_GPU_BUS_ID: 'gpu0' is not a GPU's PCI"
                                           : "gpu_bus_id: '0000:53:00' is not a GPU's PCI";
        check.expect(what.find(named) != std::string::npos,
                     fmt::format("'{}' in the error, got '{}'", named, what));
      }
      return check.code();
    });
    ::unsetenv("RINGZERO_GPU_BUS_ID");
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

TEST_CASE("what a peer received is acknowledged: sends complete, copies are let go") {
  auto out = multiprocess::run(3, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    fabric::communicator comm(fabric::transport(s, r, n, two_rails()));
    const auto& eng = comm.transport().engine();
    // Messages of every class (the ring moves a third of the vector per step): copied (8 B,
    // 16 KiB), acknowledged whole (64 KiB + 4 B), striped (256 KiB).
    for (const std::size_t count :
         {std::size_t{2}, std::size_t{12} << 10, std::size_t{49155}, std::size_t{3} << 16}) {
      std::vector<float> v(count, static_cast<float>(r + 1));
      for (int round = 0; round < 3; ++round)
        ringzero::all_reduce(comm, std::span<float>(v), op::sum);
      check.expect(v.front() == 6.0f * 9.0f && v.back() == 6.0f * 9.0f,
                   fmt::format("{} floats: 6 · 3² everywhere, got {}", count, v.front()));
    }
    // Acknowledgements of copied sends are batched; within ack_delay they all arrive.
    ringzero::barrier(comm);
    const auto until = std::chrono::steady_clock::now() + 5s;
    const auto outstanding = [&] {
      std::size_t k = 0;
      for (int p = 0; p < n; ++p) k += eng.unacknowledged(p);
      return k;
    };
    while (outstanding() > 0 && std::chrono::steady_clock::now() < until)
      comm.transport().progress();
    check.expect(outstanding() == 0,
                 fmt::format("every send acknowledged, {} outstanding", outstanding()));
    return check.code();
  });
  require_all_passed(out);
}
