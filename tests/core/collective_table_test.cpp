// The collective table is the one description of each collective: these tests register a
// collective that exists only here (an inclusive scan, MPI_Scan) with one descriptor and one
// algorithm, and check that validation, dispatch, sizes and error labels follow from them, with
// no change to the library. The rest checks the built-in descriptors against what the named
// entry points and ringzero-perf have always done.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "ringzero/algorithms/table.hpp"
#include "ringzero/collective_table.hpp"
#include "ringzero/collectives.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/transport/loopback.hpp"

using namespace ringzero;

namespace {

// docs-begin: scan
// An inclusive scan: rank r ends with in(0) ⊕ in(1) ⊕ ... ⊕ in(r), combined in rank order. An
// enumerator no built-in collective uses needs no change to collective_table.hpp.
constexpr auto scan_id = static_cast<collective>(20);
constexpr collective_descriptor scan{.id = scan_id,
                                     .name = "scan",
                                     .reduces = true,
                                     .in = {extent::one},
                                     .out = {extent::one},
                                     .bus = bus_factor::one};

// Its one algorithm: a chain, rank r receives the prefix of ranks 0..r-1 from r-1, combines its
// own input behind it and passes the result on to r+1.
struct chain_scan {
  static constexpr algorithm id = static_cast<algorithm>(201);
  static constexpr std::string_view name = "chain_scan";
  static constexpr algorithms::collective_set implements{scan_id};
  static constexpr bool needs_nodes = false;

  template <class Table>
  [[nodiscard]] static double cost(const tuning::cost_query& q) {
    return q.ranks * (q.p.alpha + q.bytes * q.p.beta);
  }

  template <collective_comm C, element E>
  static void run(C& comm, const algorithms::call<E>& c, const options& opt) {
    const int n = comm.size(), me = comm.rank();
    detail::exchange<C> ex(comm, "scan", name, opt.timeout);
    std::vector<E> prefix(c.in.size());
    if (me > 0) {
      auto r = ex.recv(me - 1, 0, 0, std::as_writable_bytes(std::span<E>(prefix)));
      ex.wait(r);
      reduction::combine(c.reduction, prefix.data(), c.in.data(), c.out.data(), c.in.size());
    } else if (c.in.data() != c.out.data()) {
      std::copy(c.in.begin(), c.in.end(), c.out.begin());
    }
    if (me + 1 < n) {
      auto s = ex.send(me + 1, 0, 0, std::as_bytes(std::span<const E>(c.out)));
      ex.wait(s);
    }
  }
};

using with_scan = algorithms::builtin::with<chain_scan>;  // registers its algorithm
// docs-end: scan

template <class E>
E input_of(int rank, std::size_t i) {
  return static_cast<E>(static_cast<long>((i * 7 + static_cast<std::size_t>(rank) * 3) % 23) - 9);
}

}  // namespace

TEST_CASE("collective table: a collective of the caller's own runs from its descriptor alone") {
  static_assert(builtin_collectives::find(scan_id) == nullptr,
                "the built-in list does not know it");
  CHECK(collective_name(scan_id) == "?");
  for (int n : {1, 2, 3, 5, 7}) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{13}, std::size_t{1009}}) {
      for (op o : {op::sum, op::max}) {
        for (bool in_place : {false, true}) {
          INFO("n " << n << ", count " << count << ", " << op_name(o) << ", in place " << in_place);
          loopback::world w(n);
          w.run([&](loopback::communicator& c) {
            const int r = c.rank();
            std::vector<std::int64_t> in(count), out(count, -1);
            std::vector<float> fin(count), fout(count, -1.0f);
            for (std::size_t i = 0; i < count; ++i) {
              in[i] = input_of<std::int64_t>(r, i);
              fin[i] = input_of<float>(r, i) * 0.37f;
            }
            if (in_place) {
              run_collective<with_scan>(c, scan, std::span<const std::int64_t>(in),
                                        std::span<std::int64_t>(in), o, 0);
              run_collective<with_scan>(c, scan, std::span<const float>(fin), std::span<float>(fin),
                                        o, 0);
              out = in;
              fout = fin;
            } else {
              run_collective<with_scan>(c, scan, std::span<const std::int64_t>(in),
                                        std::span<std::int64_t>(out), o, 0);
              run_collective<with_scan>(c, scan, std::span<const float>(fin),
                                        std::span<float>(fout), o, 0);
            }
            for (std::size_t i = 0; i < count; ++i) {
              std::int64_t want = input_of<std::int64_t>(0, i);
              float fwant = input_of<float>(0, i) * 0.37f;
              for (int p = 1; p <= r; ++p) {
                const std::int64_t x = input_of<std::int64_t>(p, i);
                const float fx = input_of<float>(p, i) * 0.37f;
                want = o == op::sum ? want + x : std::max(want, x);
                fwant = o == op::sum ? fwant + fx : std::max(fwant, fx);
              }
              REQUIRE(out[i] == want);
              REQUIRE(std::memcmp(&fout[i], &fwant, sizeof(float)) == 0);  // same order, same bits
            }
          });
        }
      }
    }
  }
}

TEST_CASE("collective table: a caller's reducing collective honours options::reproducible") {
  // Terms whose float sum depends on their order: 2^27 + 3 rounds to 2^27 (float keeps 24 bits),
  // so the chain's prefix on rank 2 is 0 where the exact sum is 3. options::reproducible gives
  // each rank its prefix summed exactly and rounded once, from the descriptor's `reduces` alone:
  // neither the dispatcher nor the reproducible path knows the scan.
  const auto term = [](int rank, std::size_t i) {
    constexpr float big = 134217728.0f;  // 2^27
    const float x[] = {big, 3.0f, -big, 0.75f, 0.0625f};
    return x[static_cast<std::size_t>(rank) % 5] * (i % 2 == 0 ? 1.0f : -1.0f) +
           static_cast<float>(i % 7) * 0.125f;
  };
  for (int n : {1, 3, 5}) {
    for (std::size_t count : {std::size_t{1}, std::size_t{70}, std::size_t{300}}) {
      INFO("n " << n << ", count " << count);
      loopback::world w(n);
      w.run([&](loopback::communicator& c) {
        const int r = c.rank();
        std::vector<float> in(count), exact(count), plain(count);
        for (std::size_t i = 0; i < count; ++i) in[i] = term(r, i);
        run_collective<with_scan>(c, scan, std::span<const float>(in), std::span<float>(exact),
                                  op::sum, 0, {.reproducible = true});
        run_collective<with_scan>(c, scan, std::span<const float>(in), std::span<float>(plain),
                                  op::sum, 0);
        bool differs = false;
        for (std::size_t i = 0; i < count; ++i) {
          double want = 0;  // exact: a few floats within 2^53 of each other
          for (int p = 0; p <= r; ++p) want += static_cast<double>(term(p, i));
          const auto rounded = static_cast<float>(want);
          REQUIRE_MESSAGE(std::memcmp(&exact[i], &rounded, sizeof(float)) == 0,
                          "element " << i << ": " << exact[i] << ", exact " << rounded);
          differs = differs || std::memcmp(&plain[i], &rounded, sizeof(float)) != 0;
        }
        // The chain's own sum is not the exact one from the third rank on: the option mattered.
        if (r == 2) CHECK(differs);
      });
    }
  }
}

TEST_CASE("collective table: a caller's collective is checked and named by its descriptor") {
  loopback::world w(3);
  w.run([&](loopback::communicator& c) {
    std::vector<float> a(4, 1.0f), b(3, 0.0f), big(8, 0.0f);
    const auto refused = [&](auto&& call, const std::string& want) {
      try {
        call();
        FAIL("accepted: " << want);
      } catch (const error& e) {
        CHECK_MESSAGE(std::string(e.what()).find(want) != std::string::npos, e.what());
      }
    };
    refused(
        [&] {
          run_collective<with_scan>(c, scan, std::span<const float>(a), std::span<float>(b),
                                    op::sum, 0);
        },
        "scan: input has 4 elements but output has 3");
    refused(
        [&] {
          run_collective<with_scan>(c, scan, std::span<const float>(big.data(), 4),
                                    std::span<float>(big.data() + 2, 4), op::sum, 0);
        },
        "scan: input and output overlap without being the same buffer");
    refused(
        [&] {
          run_collective<with_scan>(c, scan, std::span<const float>(a), std::span<float>(a),
                                    static_cast<op>(77), 0);
        },
        "scan: unknown reduction op code 77");
    // Forced to an algorithm that does not implement it, or with none that does.
    refused(
        [&] {
          run_collective<with_scan>(c, scan, std::span<const float>(a), std::span<float>(a),
                                    op::sum, 0, {.algorithm = algorithm::ring});
        },
        "scan: algorithm 'ring' does not implement this collective");
    refused(
        [&] {
          run_collective(c, scan, std::span<const float>(a), std::span<float>(a), op::sum, 0);
        },
        "scan: algorithm");
    // A descriptor whose buffers run_collective cannot size is refused by name.
    refused(
        [&] {
          run_collective(c, builtin_collectives::all_to_allv, std::span<const float>(a),
                         std::span<float>(b), op::sum, 0);
        },
        "all_to_allv: run_collective takes");
  });
}

TEST_CASE("collective table: sizes, busbw and the in-place rule of every built-in collective") {
  using detail::size_of;
  constexpr int n = 4;
  std::vector<float> buf(64);
  const auto call = [&](collective k, std::size_t in, std::size_t out, int root = 0) {
    return algorithms::call<float>{.kind = k,
                                   .in = std::span<const float>(buf.data(), in),
                                   .out = std::span<float>(buf.data() + 32, out),
                                   .root = root};
  };
  struct want {
    collective k;
    std::size_t in, out, count, model_elems;
  };
  // The counts native_call documents and the bytes the cost model has always priced.
  for (const want& x :
       {want{collective::all_reduce, 5, 5, 5, 5}, want{collective::reduce_scatter, 20, 5, 5, 20},
        want{collective::all_gather, 5, 20, 5, 20}, want{collective::broadcast, 5, 5, 5, 5},
        want{collective::reduce, 5, 5, 5, 5}, want{collective::all_to_all, 20, 20, 5, 20},
        want{collective::gather, 5, 20, 5, 20}, want{collective::scatter, 20, 5, 5, 20}}) {
    INFO(collective_name(x.k));
    const auto sz = size_of(call(x.k, x.in, x.out), n);
    CHECK(sz.count == x.count);
    CHECK(sz.model_bytes == x.model_elems * sizeof(float));
    CHECK_FALSE(sz.empty);
  }
  // Off the root, the root-only buffer may be empty: the count comes from the other one.
  CHECK(size_of(call(collective::gather, 5, 0, 1), n).count == 5);
  CHECK(size_of(call(collective::scatter, 0, 5, 1), n).count == 5);
  CHECK(size_of(call(collective::broadcast, 0, 5, 1), n).count == 5);
  CHECK(size_of(call(collective::reduce, 5, 0, 1), n).count == 5);
  CHECK(size_of(call(collective::all_reduce, 0, 0), n).empty);

  // nccl-tests' factors.
  CHECK(builtin_collectives::all_reduce.bus_bandwidth_factor(4) == doctest::Approx(1.5));
  CHECK(builtin_collectives::reduce_scatter.bus_bandwidth_factor(4) == doctest::Approx(0.75));
  CHECK(builtin_collectives::all_to_all.bus_bandwidth_factor(4) == doctest::Approx(0.75));
  CHECK(builtin_collectives::broadcast.bus_bandwidth_factor(4) == 1.0);
  CHECK(builtin_collectives::send_recv.bus_bandwidth_factor(1) == 1.0);
  CHECK(builtin_collectives::barrier.bus_bandwidth_factor(4) == 0.0);
  CHECK(builtin_collectives::all_reduce.bus_bandwidth_factor(1) == 0.0);

  // The names and flags the named entry points and ringzero-perf read.
  for (const collective_descriptor& d : builtin_collectives::all) {
    CHECK(collective_name(d.id) == d.name);
    CHECK(builtin_collectives::find(d.id) == &d);
  }
  CHECK(builtin_collectives::reduce.rooted);
  CHECK(builtin_collectives::reduce.reduces);
  CHECK_FALSE(builtin_collectives::all_gather.reduces);

  // The in-place rule: the smaller buffer is this rank's block of the larger (the root's, for
  // a rooted collective); anything else overlapping is refused, naming the collective.
  loopback::world w(3);
  w.run([&](loopback::communicator& c) {
    const int r = c.rank();
    std::vector<float> whole(9, 1.0f);
    std::span<float> mine(whole.data() + 3 * r, 3);
    CHECK_NOTHROW(all_gather(c, std::span<const float>(mine), std::span<float>(whole)));
    CHECK_NOTHROW(reduce_scatter(c, std::span<const float>(whole), mine, op::sum));
    std::span<float> wrong(whole.data() + 3 * ((r + 1) % 3), 3);
    CHECK_THROWS_WITH_AS(all_gather(c, std::span<const float>(wrong), std::span<float>(whole)),
                         doctest::Contains("all_gather: input overlaps the output but is not "
                                           "this rank's block"),
                         invalid_argument);
  });
}
