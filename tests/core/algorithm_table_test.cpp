// The algorithm table is the one list of algorithms: these tests register an algorithm that
// exists only here, the way a new header would, and check that naming, parsing, selection,
// dispatch and error labels all follow from its descriptor alone. The last test keeps the
// table in docs/architecture.md in step with algorithms::builtin.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "ringzero/algorithms/table.hpp"
#include "ringzero/collectives.hpp"
#include "ringzero/detail/comm_state.hpp"
#include "ringzero/detail/exchange.hpp"
#include "ringzero/reduce/cpu.hpp"
#include "ringzero/transport/loopback.hpp"

using namespace ringzero;

namespace {

// An enumerator no built-in algorithm uses: a test-only algorithm needs no change to
// algorithm.hpp.
constexpr auto everyone_id = static_cast<algorithm>(200);

// docs-begin: everyone
// "Everyone sends everything to everyone": each rank posts its whole input to every peer,
// receives every peer's input, and reduces all n inputs in rank order, so every rank computes
// the same expression and ends bitwise identical. O(n) messages of the full size: only a test.
struct everyone {
  static constexpr algorithm id = everyone_id;
  static constexpr std::string_view name = "everyone";
  static constexpr algorithms::collective_set implements{collective::all_reduce};
  static constexpr bool needs_nodes = false;
  static inline std::atomic<int> runs{0};  // ranks are threads here

  // Claims to be free, so automatic selection must pick it for all_reduce and nothing else.
  template <class Table>
  [[nodiscard]] static double cost(const tuning::cost_query&) {
    return 0.0;
  }

  template <collective_comm C, element E>
  static void run(C& comm, const algorithms::call<E>& c, const options& opt) {
    ++runs;
    const int n = comm.size(), me = comm.rank();
    detail::exchange<C> ex(comm, "all_reduce", name, opt.timeout);
    std::vector<std::vector<E>> from(static_cast<std::size_t>(n), std::vector<E>(c.in.size()));
    std::vector<typename detail::exchange<C>::pending> posted;
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      posted.push_back(ex.recv(
          p, 0, 0, std::as_writable_bytes(std::span<E>(from[static_cast<std::size_t>(p)]))));
      posted.push_back(ex.send(p, 0, 0, std::as_bytes(c.in)));
    }
    ex.wait_all(posted);
    from[static_cast<std::size_t>(me)].assign(c.in.begin(), c.in.end());
    std::vector<E> acc = from[0];
    for (std::size_t p = 1; p < from.size(); ++p)
      reduction::combine(c.reduction, acc.data(), from[p].data(), acc.data(), acc.size());
    std::copy(acc.begin(), acc.end(), c.out.begin());
  }
};

using with_everyone = algorithms::builtin::with<everyone>;  // the one line that registers it
// docs-end: everyone

}  // namespace

TEST_CASE(
    "table: a registered algorithm gets its name, parsing and candidacy from its descriptor") {
  static_assert(algorithms::descriptor<everyone>);
  static_assert(with_everyone::size == algorithms::builtin::size + 1);
  CHECK(with_everyone::name(everyone_id) == "everyone");
  CHECK(with_everyone::parse("everyone") == everyone_id);
  CHECK(with_everyone::implements(collective::all_reduce, everyone_id));
  CHECK_FALSE(with_everyone::implements(collective::broadcast, everyone_id));
  // The built-in table does not know it: "everyone" is an unknown name there, listed nowhere.
  CHECK_THROWS_WITH_AS(static_cast<void>(algorithms::builtin::parse("everyone")),
                       doctest::Contains("unknown algorithm 'everyone'"), invalid_argument);
  try {
    static_cast<void>(with_everyone::parse("nope"));
    FAIL("parse accepted an unknown name");
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()).find("everyone") != std::string::npos);
  }

  const std::vector<algorithm> ar = with_everyone::candidates(collective::all_reduce, false);
  CHECK(std::find(ar.begin(), ar.end(), everyone_id) != ar.end());
  const std::vector<algorithm> bc = with_everyone::candidates(collective::broadcast, false);
  CHECK(std::find(bc.begin(), bc.end(), everyone_id) == bc.end());

  tuning::cost_query q{};
  q.c = collective::all_reduce;
  q.bytes = 1 << 20;
  q.ranks = 5;
  q.nodes = 1;
  CHECK(with_everyone::select(q) == everyone_id);
  CHECK(algorithms::builtin::select(q) != everyone_id);
  q.c = collective::broadcast;
  CHECK(with_everyone::select(q) != everyone_id);
  CHECK(with_everyone::predict(everyone_id, q) == std::numeric_limits<double>::infinity());
}

TEST_CASE("table: select() picks the first cheapest of candidates() for every query") {
  // select() walks the descriptors itself (no vector per call): it must agree with the
  // definition, the first minimum of predict() over candidates().
  for (collective c : {collective::all_reduce, collective::reduce_scatter, collective::all_gather,
                       collective::broadcast, collective::reduce, collective::all_to_all,
                       collective::gather, collective::scatter}) {
    for (int ranks : {1, 2, 3, 8, 64, 1000}) {
      for (int nodes : {1, 4}) {
        for (double bytes : {0.0, 8.0, 4096.0, 1e6, 1e9}) {
          tuning::cost_query q{};
          q.c = c;
          q.bytes = bytes;
          q.ranks = ranks;
          q.nodes = nodes;
          algorithm want = algorithm::ring;
          double best = std::numeric_limits<double>::infinity();
          for (algorithm a : algorithms::builtin::candidates(c, nodes > 1)) {
            const double t = algorithms::builtin::predict(a, q);
            if (t < best) {
              best = t;
              want = a;
            }
          }
          INFO(collective_name(c) << " ranks " << ranks << " nodes " << nodes << " bytes "
                                  << bytes);
          CHECK(algorithms::builtin::select(q) == want);
        }
      }
    }
  }
}

TEST_CASE("backoff: waits among more ranks than CPUs do not spin") {
  CHECK_FALSE(detail::oversubscribed(1));
  CHECK(detail::oversubscribed(1 << 20));
}

TEST_CASE("backoff: RINGZERO_WAIT_MODE is poll or sleep, and sleep sleeps after a few yields") {
  CHECK(detail::parse_wait_mode("") == detail::wait_mode::poll);
  CHECK(detail::parse_wait_mode("poll") == detail::wait_mode::poll);
  CHECK(detail::parse_wait_mode("sleep") == detail::wait_mode::sleep);
  try {
    (void)detail::parse_wait_mode("spin");
    FAIL("RINGZERO_WAIT_MODE=spin was accepted");
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()).find("RINGZERO_WAIT_MODE='spin'") != std::string::npos);
  }
  // Under sleep, even a waiter asked to spin sleeps once its few yields are spent: ten pauses
  // past them take at least ten 50 us sleeps (sleep_for never returns early).
  detail::backoff b(detail::backoff::default_spins, detail::wait_mode::sleep);
  for (unsigned i = 0; i < detail::backoff::sleep_yields; ++i) b.pause();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 10; ++i) b.pause();
  CHECK(std::chrono::steady_clock::now() - start >= std::chrono::microseconds(500));
}

TEST_CASE("RINGZERO_WAIT_MODE: a value that is neither fails when a communicator is made") {
  // The mode is read once per process, so the check runs in a process of its own: this program,
  // running the dispatcher's test (its first step makes a loopback world) with a bad value.
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string command =
      "RINGZERO_WAIT_MODE=spin '" + self + "' -tc='table: the dispatcher runs*' 2>&1";
  std::string out;
  FILE* p = ::popen(command.c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  for (std::size_t got; (got = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, got);
  const int status = ::pclose(p);
  INFO(out);
  CHECK(status != 0);
  CHECK(out.find("RINGZERO_WAIT_MODE='spin' is not poll or sleep") != std::string::npos);
}

TEST_CASE(
    "table: the dispatcher runs a registered algorithm, chosen or forced, on any world size") {
  for (int n : {1, 2, 3, 5}) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{13}, std::size_t{1000}}) {
      INFO("n = " << n << ", count = " << count);
      everyone::runs.store(0);
      loopback::world w(n);
      w.run([&](loopback::communicator& c) {
        const int r = c.rank();
        std::vector<std::int64_t> in(count), out(count, -1);
        for (std::size_t i = 0; i < count; ++i)
          in[i] = static_cast<std::int64_t>(i * 7 + static_cast<std::size_t>(r) * 1000 + 3);
        detail::dispatch<with_everyone>(
            c, algorithms::call<std::int64_t>{collective::all_reduce, in, out, op::sum, 0},
            options{});
        for (std::size_t i = 0; i < count; ++i) {
          std::int64_t want = 0;
          for (int p = 0; p < n; ++p)
            want += static_cast<std::int64_t>(i * 7 + static_cast<std::size_t>(p) * 1000 + 3);
          REQUIRE(out[i] == want);
        }
        // Forced through options, by its enumerator, like any built-in algorithm.
        std::vector<std::int64_t> in2(in), out2(count, -1);
        detail::dispatch<with_everyone>(
            c, algorithms::call<std::int64_t>{collective::all_reduce, in2, out2, op::max, 0},
            options{.algorithm = everyone_id});
        for (std::size_t i = 0; i < count; ++i)
          REQUIRE(out2[i] == in2[i] + static_cast<std::int64_t>(n - 1 - r) * 1000);
      });
      // The trivial cases (empty, one rank) never reach an algorithm; the rest ran it twice.
      CHECK(everyone::runs.load() == (count == 0 || n == 1 ? 0 : 2 * n));
    }
  }
}

TEST_CASE("table: forcing a registered algorithm where it does not apply names it") {
  loopback::world w(2);
  w.run([&](loopback::communicator& c) {
    std::vector<float> v(4, 1.0f);
    try {
      detail::dispatch<with_everyone>(
          c, algorithms::call<float>{collective::broadcast, v, v, op::sum, 0},
          options{.algorithm = everyone_id});
      FAIL("forcing an algorithm that does not implement broadcast was accepted");
    } catch (const invalid_argument& e) {
      CHECK(std::string(e.what()).find("broadcast") != std::string::npos);
      CHECK(std::string(e.what()).find("everyone") != std::string::npos);
    }
  });
}

namespace {

// The table docs/architecture.md must contain, generated from the descriptors.
template <class Table>
std::string expected_docs_table() {
  constexpr collective columns[] = {
      collective::all_reduce,  collective::reduce_scatter, collective::all_gather,
      collective::broadcast,   collective::reduce,         collective::all_to_all,
      collective::all_to_allv, collective::gather,         collective::scatter};
  std::string s = "| `RINGZERO_ALGO` |";
  for (collective c : columns) s += " " + std::string(collective_name(c)) + " |";
  s += " node-aware |\n|---|";
  for (std::size_t i = 0; i < std::size(columns); ++i) s += "---|";
  s += "---|\n";
  for (std::size_t i = 0; i < Table::size; ++i) {
    s += "| `" + std::string(Table::names[i]) + "` |";
    for (collective c : columns) s += Table::implements(c, Table::ids[i]) ? " ✓ |" : " |";
    s += Table::needs_nodes(Table::ids[i]) ? " ✓ |\n" : " |\n";
  }
  return s;
}

}  // namespace

TEST_CASE("table: docs/architecture.md lists exactly the built-in algorithms") {
  std::ifstream f(RINGZERO_SOURCE_DIR "/docs/architecture.md");
  REQUIRE(f);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string want = expected_docs_table<algorithms::builtin>();
  INFO("docs/architecture.md should contain this table, generated from algorithms::builtin:\n"
       << want);
  CHECK(ss.str().find(want) != std::string::npos);
}
