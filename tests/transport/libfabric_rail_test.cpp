// Rails of the libfabric transport: a NIC is a rail (libfabric/rail.hpp) under one operation
// engine (libfabric/engine.hpp), and more NICs are more rails with no change to the engine. Two
// rails on loopback stand in for two NICs here (each rail is an endpoint, address vector and
// registration cache of its own). The typed transport suite runs every behaviour and the
// conformance matrix over them ("libfabric rails" in transport_conformance_test.cpp); this file
// checks what is the rails' own: where messages go (whole on their tag's rail, or from
// options::stripe_bytes cut into one piece per rail), rails from the environment (discovery
// between hosts runs on the namespace bed: tests/tools/netbed_test.sh), and the configurations
// that cannot work, refused naming what is wrong.
#include <doctest/doctest.h>
#include <stdlib.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "multiprocess.hpp"
#include "ringzero/ringzero.hpp"
#include "ringzero/transport/detail/delivery.hpp"
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

TEST_CASE("a striped message's pieces: consecutive, aligned, in proportion to the shares") {
  using rail_engine = fabric::detail::engine;
  constexpr std::size_t align = fabric::detail::engine_limits::piece_alignment;
  const std::vector<std::vector<std::uint64_t>> all_shares = {
      {1, 1}, {1, 1, 1}, {3, 1}, {100000, 25000}, {1, 1, 1, 1, 1, 1, 1, 1}, {7}};
  for (const auto& shares : all_shares) {
    std::uint64_t total = 0;
    for (const auto s : shares) total += s;
    for (const std::size_t bytes :
         {std::size_t{1}, std::size_t{63}, std::size_t{64}, std::size_t{1009},
          std::size_t{128} << 10, (std::size_t{1} << 20) + 7, std::size_t{3} << 30}) {
      CAPTURE(bytes);
      CAPTURE(shares.size());
      const auto parts = rail_engine::stripe(bytes, shares);
      REQUIRE_FALSE(parts.empty());
      std::size_t next = 0;
      std::size_t last_rail = 0;
      for (std::size_t i = 0; i < parts.size(); ++i) {
        const auto& p = parts[i];
        CHECK(p.offset == next);  // consecutive: every byte in one piece
        CHECK(p.length > 0);
        CHECK(p.offset % align == 0);
        CHECK(p.rail < shares.size());
        if (i > 0) CHECK(p.rail > last_rail);  // one piece per rail at most, in rail order
        last_rail = p.rail;
        next = p.offset + p.length;
        // In proportion, within an alignment step at each of its two ends.
        const double exact = static_cast<double>(bytes) * static_cast<double>(shares[p.rail]) /
                             static_cast<double>(total);
        CHECK(static_cast<double>(p.length) <= exact + 2.0 * align);
        CHECK(static_cast<double>(p.length) + 2.0 * align >= exact);
      }
      CHECK(next == bytes);
      // Large enough, every rail carries a piece.
      if (bytes >= (std::size_t{128} << 10)) CHECK(parts.size() == shares.size());
      CHECK(rail_engine::stripe(bytes, shares).size() == parts.size());  // a function of its inputs
    }
  }
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

namespace {

/// Three rails on loopback: one can fail and two are left, so "the others" means something.
fabric::options three_rails() {
  return {.provider = tcp, .rails = {"lo", "lo", "lo"}};
}

template <class Q>
void drive(fabric::communicator& comm, Q& q, int peer) {
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!comm.test(q))
    if (std::chrono::steady_clock::now() > deadline) throw ringzero::timeout_error("stuck", peer);
}

bool contains(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

}  // namespace

TEST_CASE("a rail that fails under a striped message: its piece goes over the rails left") {
  auto out = multiprocess::run(2, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    fabric::communicator comm(fabric::transport(s, r, n, three_rails()));
    const auto& eng = comm.transport().engine();
    const int peer = 1 - r;
    constexpr std::size_t count = std::size_t{24} << 20;
    std::vector<std::uint8_t> data(count);
    for (std::size_t i = 0; i < count; ++i) data[i] = static_cast<std::uint8_t>((i * 131) >> 7);
    std::string log = multiprocess::capture_info_log("fabric-rail", [&] {
      if (r == 0) {
        auto q = comm.isend(1, 1, std::as_bytes(std::span<const std::uint8_t>(data)));
        // A few progress calls put the pieces on their way, then rail 1 fails under them.
        for (int i = 0; i < 3; ++i)
          if (comm.test(q)) break;
        comm.transport().fail_rail(1, "the test pulled it");
        drive(comm, q, 1);
      } else {
        std::vector<std::uint8_t> in(count, 0);
        auto q = comm.irecv(0, 1, std::as_writable_bytes(std::span<std::uint8_t>(in)));
        drive(comm, q, 0);
        check.expect(in == data, "the message whole and unchanged");
      }
      // The message may be whole before this side hears of the failure.
      const auto until = std::chrono::steady_clock::now() + 10s;
      while (eng.rail_in_use(peer, 1) && std::chrono::steady_clock::now() < until)
        comm.transport().progress();
    });
    check.expect(!eng.rail_in_use(peer, 1) && eng.rail_in_use(peer, 0) && eng.rail_in_use(peer, 2),
                 "rail 1 given up toward the peer on both sides, rails 0 and 2 kept");
    const std::string warned = r == 0 ? "rail lo failed toward rank 1 (the test pulled it)"
                                      : "rail lo failed toward rank 0 (rank 0 gave it up)";
    check.expect(contains(log, warned) && contains(log, "and the others left"),
                 fmt::format("a warning naming the failed rail, got '{}'", log));
    // Collectives go on over the two left, bitwise as before, and rail 1 carries none of them.
    const auto before = eng.rail_messages(1);
    std::vector<float> v(1 << 20), want(1 << 20);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.25f * static_cast<float>(i % 1000 + r);
    for (std::size_t i = 0; i < v.size(); ++i)
      want[i] = 0.25f * static_cast<float>(i % 1000) + 0.25f * static_cast<float>(i % 1000 + 1);
    ringzero::all_reduce(comm, std::span<float>(v), op::sum);
    check.expect(v == want, "an all_reduce over the remaining rails");
    check.expect(eng.rail_messages(1) == before,
                 fmt::format("nothing more on rail 1, got {} more", eng.rail_messages(1) - before));
    // The other two fail, seen from both ends as links found down are: both ranks' next call
    // fails naming the peer and the last rail. First everything sent so far is acknowledged
    // (a small send completes on return): a rank that failed its rails before its last barrier
    // message left would keep it, and the peer would wait for it instead.
    ringzero::barrier(comm);
    const auto settled = std::chrono::steady_clock::now() + 10s;
    while (eng.unacknowledged(peer) > 0 && std::chrono::steady_clock::now() < settled)
      comm.transport().progress();
    check.expect(eng.unacknowledged(peer) == 0, "everything acknowledged before the rails fail");
    // Both quiet; each keeps acknowledging the other's last messages until it is.
    s.add("quiet", 1);
    while (s.add("quiet", 0) < 2 && std::chrono::steady_clock::now() < settled)
      comm.transport().progress();
    comm.transport().fail_rail(0, "the test pulled it");
    comm.transport().fail_rail(2, "the test pulled it");
    int named = -2;
    std::string what;
    try {
      ringzero::all_reduce(comm, std::span<float>(v), op::sum, {.timeout = 20s});
    } catch (const ringzero::peer_error& e) {
      named = e.peer();
      what = e.what();
    }
    check.expect(named == peer && contains(what, fmt::format("rank {}", peer)) &&
                     contains(what, "its last rail, lo, failed"),
                 fmt::format("a peer_error naming rank {} and its last rail, got {}: '{}'", peer,
                             named, what));
    return check.code();
  });
  require_all_passed(out);
}

TEST_CASE("small sends complete on return; their copies go again when their rail fails") {
  auto out = multiprocess::run(2, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    fabric::communicator comm(fabric::transport(s, r, n, three_rails()));
    const auto& eng = comm.transport().engine();
    constexpr int messages = 30;
    constexpr std::size_t bytes = 512;
    const auto value = [](int m, std::size_t i) {
      return static_cast<std::uint8_t>(m * 7 + i * 13);
    };
    const auto tag = [](int m) { return 100 + static_cast<ringzero::tag_t>(m); };
    const std::string sent = "sent";
    // Connections up on every rail first (ofi_rxm makes them on first use, and the peer takes
    // part): a message pieces over all three rails, both ways.
    std::vector<float> warm(std::size_t{1} << 18, 1.0f);
    ringzero::all_reduce(comm, std::span<float>(warm), op::sum);
    if (r == 0) {
      std::vector<std::vector<std::uint8_t>> src(static_cast<std::size_t>(messages));
      for (int m = 0; m < messages; ++m) {
        auto& v = src[static_cast<std::size_t>(m)];
        for (std::size_t i = 0; i < bytes; ++i) v.push_back(value(m, i));
        auto q = comm.isend(1, tag(m), std::as_bytes(std::span<const std::uint8_t>(v)));
        check.expect(comm.test(q), "a small send complete at once, copied");
      }
      // What goes again after the rail fails must be the engine's copies, not these.
      for (auto& v : src) std::fill(v.begin(), v.end(), std::uint8_t{0xEE});
      check.expect(eng.unacknowledged(1) == messages,
                   fmt::format("{} unacknowledged, got {}", messages, eng.unacknowledged(1)));
      // On their way (with the provider, none waiting in the engine for a connection), so
      // those on rail 1 reach rank 1's end of it, where nothing will match them.
      const auto posted = std::chrono::steady_clock::now() + 10s;
      while (eng.waiting_operations() > 0 && std::chrono::steady_clock::now() < posted)
        comm.transport().progress();
      check.expect(eng.waiting_operations() == 0, "every copy with the provider");
      std::uint8_t word = 0;
      const std::string log = multiprocess::capture_info_log("fabric-copies", [&] {
        comm.transport().fail_rail(1, "the test pulled it");
        s.set(sent, std::as_bytes(std::span<const char>("1", 1)));
        auto q = comm.irecv(1, 99, std::as_writable_bytes(std::span<std::uint8_t>(&word, 1)));
        drive(comm, q, 1);
      });
      check.expect(word == 1, "rank 1's word that it read every message");
      // Rank 1 had received nothing when it gave rail 1 up: what went there goes again.
      check.expect(contains(log, "unacknowledged messages to rank 1 sent again"),
                   fmt::format("the failed rail's messages sent again, got '{}'", log));
    } else {
      s.wait(std::span<const std::string>(&sent, 1));
      // Once rank 1 has given rail 1 up too, the messages that went there (and wait there,
      // unmatched) can only reach it sent again over the other rails.
      const auto until = std::chrono::steady_clock::now() + 10s;
      while (eng.rail_in_use(0, 1) && std::chrono::steady_clock::now() < until)
        comm.transport().progress();
      check.expect(!eng.rail_in_use(0, 1), "rank 1 heard that rail 1 failed");
      std::size_t wrong = 0;
      for (int m = 0; m < messages; ++m) {
        std::vector<std::uint8_t> in(bytes, 0);
        auto q = comm.irecv(0, tag(m), std::as_writable_bytes(std::span<std::uint8_t>(in)));
        drive(comm, q, 0);
        for (std::size_t i = 0; i < bytes; ++i) wrong += in[i] != value(m, i);
      }
      check.expect(wrong == 0, fmt::format("every message as sent, {} bytes wrong", wrong));
      const std::uint8_t word = 1;
      auto q = comm.isend(0, 99, std::as_bytes(std::span<const std::uint8_t>(&word, 1)));
      drive(comm, q, 0);
    }
    return check.code();
  });
  require_all_passed(out);
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

TEST_CASE("delivery's bookkeeping: what arrived, as one statement that survives the wire") {
  namespace delivery = ringzero::detail::delivery;
  delivery::received_set got;
  // Out of order: runs above the mark until the gap fills.
  for (const std::uint64_t s : {0u, 1u, 3u, 4u, 7u}) CHECK(got.add(s));
  CHECK_FALSE(got.add(3));  // twice is once
  CHECK(got.low() == 2);
  CHECK(got.runs() == std::map<std::uint64_t, std::uint64_t>{{3, 5}, {7, 8}});
  CHECK(got.contains(1));
  CHECK(got.contains(4));
  CHECK_FALSE(got.contains(2));
  CHECK_FALSE(got.contains(5));
  CHECK(got.add(2));
  CHECK(got.low() == 5);
  CHECK(got.runs() == std::map<std::uint64_t, std::uint64_t>{{7, 8}});
  CHECK(got.add(6));
  CHECK(got.add(5));
  CHECK(got.low() == 8);
  CHECK(got.runs().empty());

  // Sequence numbers travel as 31 bits; the receiver puts the rest back from its mark.
  delivery::received_set far;
  far.assign((std::uint64_t{1} << 31) - 3, {});
  const std::uint64_t next = (std::uint64_t{1} << 31) + 5;  // past a wrap of the low bits
  CHECK(far.expand(delivery::cq_word::make(next, true)) == next);
  CHECK(far.expand(delivery::cq_word::make(far.low(), false)) == far.low());
  CHECK(delivery::cq_word::urgent(delivery::cq_word::make(next, true)));
  CHECK_FALSE(delivery::cq_word::urgent(delivery::cq_word::make(next, false)));

  // The statement round-trips, and what is not one is refused.
  got.add(10);
  got.add(12);
  const std::vector<std::uint64_t> cut{9, 11};
  const auto bytes = delivery::control::encode(3, 0b101, got, cut);
  const auto back = delivery::control::decode(bytes);
  REQUIRE(back.has_value());
  CHECK(back->from == 3);
  CHECK(back->dead == 0b101);
  CHECK(back->received.low() == got.low());
  CHECK(back->received.runs() == got.runs());
  CHECK(back->cut == cut);
  CHECK_FALSE(delivery::control::decode(std::span(bytes).first(bytes.size() - 1)));
  auto wrong = bytes;
  wrong[0] = std::byte{0};
  CHECK_FALSE(delivery::control::decode(wrong));

  // A failed rail's messages go to the next rail up that is left, alike from both ends.
  CHECK(delivery::substitute(1, 0b000, 3) == 1);
  CHECK(delivery::substitute(1, 0b010, 3) == 2);
  CHECK(delivery::substitute(2, 0b100, 3) == 0);
  CHECK(delivery::substitute(1, 0b110, 3) == 0);
  CHECK(delivery::substitute(0, 0b111, 3) == -1);
  // Moving twice lands where moving once over both failures would.
  CHECK(delivery::substitute(static_cast<std::size_t>(delivery::substitute(0, 0b001, 4)), 0b011,
                             4) == delivery::substitute(0, 0b011, 4));
}

TEST_CASE("messages with one tag keep their order across a failover") {
  // Sends with one (peer, tag) match receives in posting order, also when some went to a rail
  // that failed and must go again while later ones are posted: those wait and follow them.
  auto out = multiprocess::run(2, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    rank_checks check{r};
    fabric::transport t(s, r, n, three_rails());
    const auto& eng = t.engine();
    constexpr ringzero::tag_t tag = 7;
    const std::size_t home = fabric::detail::engine::rail_for(tag, 3);
    constexpr int messages = 12;
    // Copied (512 B), acknowledged whole (100 KiB), striped (300 KiB), in turn.
    const auto size = [](int m) {
      return std::array<std::size_t, 3>{512, 100 << 10, 300 << 10}[static_cast<std::size_t>(m % 3)];
    };
    const auto value = [](int m, std::size_t i) {
      return static_cast<std::uint8_t>(m * 37 + (i >> 6));
    };
    const auto run = [&](fabric::transport::request& q, int peer) {
      const auto deadline = std::chrono::steady_clock::now() + 60s;
      while (!t.test(q))
        if (std::chrono::steady_clock::now() > deadline)
          throw ringzero::timeout_error("stuck", peer);
    };
    const std::string posted = "ready";
    {
      // Connections up on every rail first: a striped message each way.
      std::vector<std::byte> out(300 << 10), back(300 << 10);
      auto q1 = t.isend(1 - r, 1, out);
      auto q2 = t.irecv(1 - r, 1, back);
      run(q1, 1 - r);
      run(q2, 1 - r);
    }
    if (r == 0) {
      std::vector<std::vector<std::uint8_t>> src(messages);
      for (int m = 0; m < messages; ++m)
        for (std::size_t i = 0; i < size(m); ++i)
          src[static_cast<std::size_t>(m)].push_back(value(m, i));
      s.wait(std::span<const std::string>(&posted, 1));
      std::vector<fabric::transport::request> sends;
      const auto send = [&](int m) {
        sends.push_back(t.isend(
            1, tag,
            std::as_bytes(std::span<const std::uint8_t>(src[static_cast<std::size_t>(m)]))));
      };
      // A quarter goes before the failure, while rank 1 has posted nothing: what of it went to
      // the failed rail waits there unmatched and must go again, and the rest must not overtake
      // it (those are held until rank 1 has given the rail up too).
      for (int m = 0; m < messages / 4; ++m) send(m);
      const auto until = std::chrono::steady_clock::now() + 10s;
      while (eng.waiting_operations() > 0 && std::chrono::steady_clock::now() < until) t.progress();
      t.fail_rail(home, "the test pulled it");
      for (int m = messages / 4; m < messages; ++m) send(m);
      for (auto& q : sends) run(q, 1);
    } else {
      std::vector<std::vector<std::uint8_t>> in(messages);
      std::vector<fabric::transport::request> recvs;
      const auto receive = [&](int m) {
        auto& buf = in[static_cast<std::size_t>(m)];
        buf.assign(size(m), 0);
        recvs.push_back(t.irecv(0, tag, std::as_writable_bytes(std::span<std::uint8_t>(buf))));
      };
      s.set(posted, std::as_bytes(std::span<const char>("1", 1)));
      const auto until = std::chrono::steady_clock::now() + 10s;
      while (eng.rail_in_use(0, home) && std::chrono::steady_clock::now() < until) t.progress();
      check.expect(!eng.rail_in_use(0, home), "rank 1 heard that the tag's rail failed");
      for (int m = 0; m < messages; ++m) receive(m);
      for (auto& q : recvs) run(q, 0);
      std::size_t wrong = 0;
      for (int m = 0; m < messages; ++m)
        for (std::size_t i = 0; i < size(m); ++i)
          wrong += in[static_cast<std::size_t>(m)][i] != value(m, i);
      check.expect(wrong == 0, fmt::format("every message in its place, {} bytes wrong", wrong));
    }
    return check.code();
  });
  require_all_passed(out);
}
