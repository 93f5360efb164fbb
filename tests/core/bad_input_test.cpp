// Bad input and collectives that disagree across ranks, on the loopback transport: every case
// ends in a ringzero::error of the documented type whose message names the offending value, and
// never in a crash, a hang or a write outside the caller's buffers. docs/errors.md lists each
// case with the test case here that tries it; the last test case checks that list.
//
// Some cases hand a collective a span that claims more memory than exists (a null pointer with
// elements, a count whose bytes pass SIZE_MAX): what a wrapped subtraction or a stale pointer
// gives a trainer. Validation must refuse them without touching the memory, so the tests only
// build such spans over small buffers they own, and nothing ever reads through them.
#include <doctest/doctest.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "checks.hpp"
#include "ringzero/bootstrap/environment.hpp"
#include "ringzero/bootstrap/rendezvous.hpp"
#include "ringzero/bootstrap/tcp_store.hpp"
#include "ringzero/ringzero.hpp"
#include "ringzero/zero/sharder.hpp"

using namespace ringzero;
using namespace std::chrono_literals;
using test_support::bad_call;
using test_support::check_still_works;
using test_support::contains;
using test_support::error_of;
using test_support::scoped_env;
using test_support::try_all;

namespace {

/// Checks that f throws Error with a message containing every one of `parts`.
template <class Error, class F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  const std::string what = error_of<Error>(std::forward<F>(f));
  for (const auto& part : parts) {
    INFO("message: " << what);
    CHECK_MESSAGE(contains(what, part), "expected the message to name '", part, "'");
  }
}

template <class E>
std::span<E> null_span(std::size_t n) {
  return std::span<E>(static_cast<E*>(nullptr), n);
}

/// Runs f on every rank of a world of n threads with a deadline far beyond what any case here
/// needs: a case that would hang fails by timing out instead of blocking CTest.
template <class F>
void on_world(int n, F&& f, std::chrono::nanoseconds timeout = 20s) {
  loopback::world w(n, {.timeout = timeout});
  w.run(std::forward<F>(f));
}

}  // namespace

TEST_CASE("bad input: a null pointer with elements names the buffer and its count") {
  for (int n : {1, 3}) {
    on_world(n, [&](loopback::communicator& c) {
      const auto un = static_cast<std::size_t>(n);
      std::vector<float> buf(4 * un, 1.0f);
      const std::span<float> ok(buf), four = ok.first(4);
      const auto nul4 = null_span<float>(4), nul_all = null_span<float>(4 * un);
      std::vector<std::size_t> counts(un, 1), displs(un, 0);
      for (std::size_t i = 0; i < un; ++i) displs[i] = i;
      const std::span<const std::size_t> cs(counts), ds(displs);
      const auto nul_counts = null_span<const std::size_t>(un);
      const int peer = (c.rank() + 1) % n;
      std::vector<bad_call> calls = {
          {"all_reduce in place",
           [&] { all_reduce(c, nul4, op::sum); },
           {"all_reduce: input", "null pointer with 4 elements"}},
          {"all_reduce output",
           [&] { all_reduce(c, std::span<const float>(four), nul4, op::sum); },
           {"all_reduce: output is a null pointer with 4 elements"}},
          {"reduce_scatter input",
           [&] { reduce_scatter(c, std::span<const float>(nul_all), four, op::sum); },
           {"reduce_scatter: input is a null pointer"}},
          {"all_gather output",
           [&] { all_gather(c, std::span<const float>(four), nul_all); },
           {"all_gather: output is a null pointer"}},
          {"broadcast",
           [&] { broadcast(c, nul4, 0); },
           {"broadcast: input is a null pointer with 4 elements"}},
          {"reduce",
           [&] { reduce(c, nul4, op::max, 0); },
           {"reduce: input is a null pointer with 4 elements"}},
          {"all_to_all", [&] { all_to_all(c, nul_all); }, {"all_to_all: input is a null pointer"}},
          {"all_to_allv counts",
           [&] {
             all_to_allv(c, std::span<const float>(ok), nul_counts, ds, ok.first(un), cs, ds);
           },
           {"all_to_allv: send counts is a null pointer"}},
          {"gather",
           [&] { gather(c, std::span<const float>(nul4), ok, 0); },
           {"gather: input is a null pointer with 4 elements"}},
          {"scatter",
           [&] { scatter(c, std::span<const float>(ok), nul4, 0); },
           {"scatter: output is a null pointer with 4 elements"}},
      };
      if (n > 1) {
        calls.push_back({"send",
                         [&] { send(c, std::span<const float>(nul4), peer); },
                         {"send: send buffer is a null pointer with 4 elements"}});
        calls.push_back({"recv",
                         [&] { recv(c, nul4, peer); },
                         {"recv: receive buffer is a null pointer with 4 elements"}});
      }
      try_all(c, calls);
      // A null pointer without elements is an empty buffer, as everywhere in C++.
      all_reduce(c, null_span<float>(0), op::sum);
    });
  }
}

TEST_CASE("bad input: spans of the wrong size name both sizes") {
  on_world(3, [&](loopback::communicator& c) {
    const bool root = c.rank() == 2;
    std::vector<float> a(16, 1.0f), b(16, 0.0f);
    const std::span<float> in(a), out(b);
    std::vector<std::size_t> two(2, 1), three(3, 1), displs{0, 1, 2};
    const std::span<const std::size_t> ds(displs), cs(three);
    std::vector<bad_call> calls = {
        {"all_reduce",
         [&] { all_reduce(c, std::span<const float>(in.first(4)), out.first(3), op::sum); },
         {"input has 4 elements but output has 3"}},
        {"reduce_scatter",
         [&] { reduce_scatter(c, std::span<const float>(in.first(11)), out.first(4), op::sum); },
         {"(3 * 4 = 12), got 11"}},
        {"all_gather",
         [&] { all_gather(c, std::span<const float>(in.first(4)), out.first(13)); },
         {"(3 * 4 = 12), got 13"}},
        {"all_to_all",
         [&] { all_to_all(c, std::span<const float>(in.first(7)), out.first(7)); },
         {"7 elements do not split into 3 equal blocks"}},
        {"all_to_allv",
         [&] {
           all_to_allv(c, std::span<const float>(in.first(3)), std::span<const std::size_t>(two),
                       ds, out.first(3), cs, ds);
         },
         {"send counts has 2 entries, expected one per rank (3)"}},
    };
    calls.push_back({"broadcast root",
                     [&] { broadcast(c, std::span<const float>(in.first(4)), out.first(5), 2); },
                     {"root's input has 4 elements but output has 5"},
                     root});
    calls.push_back(
        {"reduce root",
         [&] { reduce(c, std::span<const float>(in.first(4)), out.first(2), op::sum, 2); },
         {"root's input has 4 elements but output has 2"},
         root});
    calls.push_back({"gather root",
                     [&] { gather(c, std::span<const float>(in.first(2)), out.first(5), 2); },
                     {"(3 * 2 = 6), got 5"},
                     root});
    calls.push_back({"scatter root",
                     [&] { scatter(c, std::span<const float>(in.first(7)), out.first(2), 2); },
                     {"(3 * 2 = 6), got 7"},
                     root});
    try_all(c, calls);
  });
}

TEST_CASE("bad input: partially overlapping buffers are refused, the in-place forms are not") {
  on_world(3, [&](loopback::communicator& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    const bool root = c.rank() == 0;
    std::vector<float> a(32, 1.0f);
    const std::span<float> s(a);
    std::vector<std::size_t> counts(3, 1), displs{0, 1, 2};
    const std::span<const std::size_t> cs(counts), ds(displs);
    std::vector<bad_call> calls = {
        {"all_reduce",
         [&] { all_reduce(c, std::span<const float>(s.first(4)), s.subspan(1, 4), op::sum); },
         {"all_reduce: input and output overlap", "starting 4 bytes after the input"}},
        {"reduce_scatter",
         [&] {
           reduce_scatter(c, std::span<const float>(s.first(12)), s.subspan(4 * r + 1, 4), op::sum);
         },
         {"reduce_scatter: output overlaps the input but is not this rank's block", "48 bytes at"}},
        {"all_gather",
         [&] { all_gather(c, std::span<const float>(s.subspan(4 * r + 2, 4)), s.first(12)); },
         {"all_gather: input overlaps the output but is not this rank's block", "16 bytes at"}},
        {"all_to_all",
         [&] { all_to_all(c, std::span<const float>(s.first(6)), s.subspan(3, 6)); },
         {"all_to_all: input and output overlap", "starting 12 bytes after the input"}},
        {"all_to_allv",
         [&] {
           all_to_allv(c, std::span<const float>(s.first(3)), cs, ds, s.subspan(2, 3), cs, ds);
         },
         {"all_to_allv: input and output overlap", "starting 8 bytes after the input"}},
    };
    calls.push_back({"broadcast",
                     [&] { broadcast(c, std::span<const float>(s.subspan(2, 4)), s.first(4), 0); },
                     {"broadcast: input and output overlap", "starting 8 bytes before the input"},
                     root});
    calls.push_back(
        {"reduce",
         [&] { reduce(c, std::span<const float>(s.first(4)), s.subspan(3, 4), op::sum, 0); },
         {"reduce: input and output overlap", "starting 12 bytes after the input"},
         root});
    calls.push_back({"gather",
                     [&] { gather(c, std::span<const float>(s.subspan(1, 2)), s.first(6), 0); },
                     {"gather: input overlaps the root's output but is not the root's block"},
                     root});
    calls.push_back({"scatter",
                     [&] { scatter(c, std::span<const float>(s.first(6)), s.subspan(1, 2), 0); },
                     {"scatter: output overlaps the root's input but is not the root's block"},
                     root});
    try_all(c, calls);

    // The in-place forms overlap exactly as documented, and work.
    std::vector<float> v(12, float(c.rank() + 1));
    all_reduce(c, std::span<float>(v).first(4), op::sum);
    CHECK(v[0] == 6.0f);
    reduce_scatter(c, std::span<const float>(std::span<float>(v).first(12)),
                   std::span<float>(v).subspan(4 * r, 4), op::sum);
    std::vector<float> g(6, 0.0f);
    g[2 * r] = g[2 * r + 1] = float(c.rank());
    all_gather(c, std::span<const float>(std::span<float>(g).subspan(2 * r, 2)),
               std::span<float>(g));
    CHECK(g == std::vector<float>{0, 0, 1, 1, 2, 2});
  });
}

namespace {

template <class E>
constexpr bool all_reduce_accepts = requires(loopback::communicator& c, std::span<E> s) {
  all_reduce(c, s, op::sum);
};

}  // namespace

TEST_CASE("bad input: op codes outside the enum; element types outside the ten are not callable") {
  // Every (element type, op) pair of the API is supported and checked against the serial
  // reference in reduce_test.cpp; what a caller can still get wrong is an op value cast from
  // an integer, and a type the reductions do not know, which must not compile.
  static_assert(!element<bool> && !element<char> && !element<long double> &&
                !element<std::string> && !element<std::int16_t>);
  static_assert(!all_reduce_accepts<std::int16_t> && !all_reduce_accepts<bool>);
  static_assert(all_reduce_accepts<std::int32_t> && all_reduce_accepts<bfloat16>);
  on_world(2, [&](loopback::communicator& c) {
    std::vector<double> v(8, 1.0), w(16, 1.0);
    const auto bad = static_cast<op>(7);
    try_all(c, {
                   {"all_reduce",
                    [&] { all_reduce(c, std::span<double>(v), bad); },
                    {"all_reduce: unknown reduction op code 7"}},
                   {"reduce_scatter",
                    [&] { reduce_scatter(c, std::span<double>(w), std::span<double>(v), bad); },
                    {"reduce_scatter: unknown reduction op code 7"}},
                   {"reduce",
                    [&] { reduce(c, std::span<double>(v), bad, 0); },
                    {"reduce: unknown reduction op code 7"}},
                   {"unknown algorithm",
                    [&] {
                      all_reduce(c, std::span<double>(v), op::sum,
                                 {.algorithm = static_cast<algorithm>(42)});
                    },
                    {"all_reduce"}},
                   {"algorithm without the collective",
                    [&] {
                      broadcast(c, std::span<double>(v), 0,
                                {.algorithm = algorithm::recursive_doubling});
                    },
                    {"broadcast: algorithm 'rd' does not implement this collective"}},
               });
  });
}

TEST_CASE("bad input: a root out of range names the root and the world size") {
  on_world(3, [&](loopback::communicator& c) {
    std::vector<float> v(4, 1.0f), all(12, 0.0f);
    const std::span<float> s(v), a(all);
    try_all(c,
            {
                {"broadcast -1",
                 [&] { broadcast(c, s, -1); },
                 {"broadcast: root -1 is out of range for a 3-rank communicator"}},
                {"broadcast 3",
                 [&] { broadcast(c, s, 3); },
                 {"broadcast: root 3 is out of range for a 3-rank communicator"}},
                {"reduce 3", [&] { reduce(c, s, op::sum, 3); }, {"reduce: root 3 is out of range"}},
                {"gather 7",
                 [&] { gather(c, std::span<const float>(s), a, 7); },
                 {"gather: root 7 is out of range"}},
                {"scatter -2",
                 [&] { scatter(c, std::span<const float>(a), s, -2); },
                 {"scatter: root -2 is out of range"}},
                {"send to self",
                 [&] { send(c, std::span<const float>(s), c.rank()); },
                 {"send: peer", "is not another rank of this 3-rank communicator"}},
                {"recv from 3", [&] { recv(c, s, 3); }, {"recv: peer 3 is not another rank"}},
            });
  });
}

TEST_CASE("bad input: byte counts past SIZE_MAX and wrapping block products are refused") {
  // Spans that claim more memory than exists (see the top of this file): only their sizes are
  // looked at before the call is refused.
  on_world(3, [&](loopback::communicator& c) {
    std::vector<std::uint8_t> small(64, 0);
    std::vector<float> f(64, 0.0f);
    constexpr std::size_t too_many_floats = std::numeric_limits<std::size_t>::max() / 4 + 1;
    // 3 * (2^63 - 1) wraps to 2^63 - 3: an output of that size passed a multiplying check.
    constexpr std::size_t half = std::numeric_limits<std::size_t>::max() / 2;  // 2^63 - 1
    const std::span<float> huge(f.data(), too_many_floats);
    const std::span<const std::uint8_t> in_half(small.data(), half);
    const std::span<std::uint8_t> out_wrapped(small.data(), half - 2);
    try_all(c, {
                   {"all_reduce",
                    [&] { all_reduce(c, huge, op::sum); },
                    {"all_reduce: input holds 4611686018427387904 elements of 4 bytes, more than "
                     "any buffer can (2305843009213693951 at most)"}},
                   {"broadcast",
                    [&] { broadcast(c, huge, 0); },
                    {"broadcast: input holds 4611686018427387904 elements"}},
                   {"all_gather wraps",
                    [&] { all_gather(c, in_half, out_wrapped); },
                    {"(3 * 9223372036854775807, which overflows), got 9223372036854775805"}},
                   {"reduce_scatter wraps",
                    [&] {
                      reduce_scatter(c, std::span<const std::uint8_t>(out_wrapped),
                                     std::span<std::uint8_t>(small.data(), half), op::sum);
                    },
                    {"(3 * 9223372036854775807, which overflows), got 9223372036854775805"}},
               });
  });
}

namespace {

/// A transport whose messages complete at once and move no bytes; it remembers the byte range
/// of every send and receive, so that a test can check an algorithm's offsets on buffers that
/// nothing may touch. Every rank runs on its own: nothing is ever waited for.
class ledger_transport {
 public:
  struct request {};
  struct range {
    std::uintptr_t begin;
    std::size_t bytes;
  };

  ledger_transport(int rank, int size) : rank_(rank), size_(size) {}
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] tuning::policy tuning() const noexcept { return {}; }
  [[nodiscard]] request isend(int, tag_t, std::span<const std::byte> d) {
    sent.push_back({reinterpret_cast<std::uintptr_t>(d.data()), d.size()});
    return {};
  }
  [[nodiscard]] request irecv(int, tag_t, std::span<std::byte> d) {
    received.push_back({reinterpret_cast<std::uintptr_t>(d.data()), d.size()});
    return {};
  }
  [[nodiscard]] bool test(request&) noexcept { return true; }
  void progress() noexcept {}

  std::vector<range> sent, received;

 private:
  int rank_, size_;
};

/// Whether `ranges` tile [begin, begin + bytes) exactly: no gap, no byte twice.
bool tiles(std::vector<ledger_transport::range> ranges, std::uintptr_t begin, std::size_t bytes) {
  std::sort(ranges.begin(), ranges.end(),
            [](const auto& a, const auto& b) { return a.begin < b.begin; });
  std::uintptr_t at = begin;
  for (const auto& r : ranges) {
    if (r.bytes == 0) continue;
    if (r.begin != at) return false;
    at += r.bytes;
  }
  return at == begin + bytes;
}

/// Address space for `bytes` that nothing may read or write: a touch is a segmentation fault,
/// not a silent pass, and no memory is committed.
class reserved {
 public:
  explicit reserved(std::size_t bytes) : bytes_(bytes) {
    p_ = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    REQUIRE(p_ != MAP_FAILED);
  }
  ~reserved() { ::munmap(p_, bytes_); }
  reserved(const reserved&) = delete;
  reserved& operator=(const reserved&) = delete;
  template <class E>
  [[nodiscard]] std::span<E> as(std::size_t n) const {
    return std::span<E>(static_cast<E*>(p_), n);
  }

 private:
  void* p_;
  std::size_t bytes_;
};

}  // namespace

TEST_CASE("bad input: counts past 2^31 elements reach every element") {
  // Counts are size_t all the way down: a broadcast and an in-place all_gather of 2^31 + 64
  // floats (8 GiB and a bit, past 2^32 bytes too) post messages that cover the buffer exactly,
  // on every rank and with every algorithm that runs them. The buffer is address space that
  // nothing may touch, and the transport moves no bytes, so this costs no memory and no time.
  constexpr std::size_t count = (std::size_t{1} << 31) + 64;
  const reserved space(count * sizeof(float));
  const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(space.as<float>(count).data());
  constexpr int n = 2;
  for (algorithm a : {algorithm::ring, algorithm::tree}) {
    for (int r = 0; r < n; ++r) {
      CAPTURE(algorithm_name(a));
      CAPTURE(r);
      communicator<ledger_transport> c(ledger_transport(r, n), 10s);
      broadcast(c, space.as<float>(count), 0, {.algorithm = a});
      const auto& t = c.transport();
      CHECK(tiles(r == 0 ? t.sent : t.received, base, count * sizeof(float)));
    }
  }
  for (algorithm a : {algorithm::ring, algorithm::recursive_doubling}) {
    for (int r = 0; r < n; ++r) {
      CAPTURE(algorithm_name(a));
      CAPTURE(r);
      communicator<ledger_transport> c(ledger_transport(r, n), 10s);
      const auto all = space.as<float>(count);
      const std::size_t block = count / n;
      all_gather(c, std::span<const float>(all.subspan(block * static_cast<std::size_t>(r), block)),
                 all, {.algorithm = a});
      const auto& t = c.transport();
      const std::uintptr_t mine = base + block * sizeof(float) * static_cast<std::size_t>(r);
      CHECK(tiles(t.sent, mine, block * sizeof(float)));
      CHECK(tiles(t.received, r == 0 ? mine + block * sizeof(float) : base, block * sizeof(float)));
    }
  }
}

TEST_CASE("bad input: calls on a moved-from communicator name the call") {
  on_world(2, [&](loopback::communicator& c) {
    loopback::communicator moved(std::move(c));
    std::vector<float> v(4, 1.0f);
    // NOLINTBEGIN(bugprone-use-after-move): the moved-from object is what is tried.
    try_all(moved,
            {
                {"all_reduce",
                 [&] { all_reduce(c, std::span<float>(v), op::sum); },
                 {"all_reduce: this communicator was moved from"}},
                {"empty all_reduce",
                 [&] { all_reduce(c, std::span<float>(), op::sum); },
                 {"all_reduce: this communicator was moved from"}},
                {"barrier", [&] { barrier(c); }, {"barrier: this communicator was moved from"}},
                {"send",
                 [&] { send(c, std::span<const float>(v), 1 - c.rank()); },
                 {"send: this communicator was moved from"}},
                {"split", [&] { (void)c.split(0, 0); }, {"moved from"}},
                {"abort", [&] { c.abort("late"); }, {"abort(): this communicator was moved from"}},
            });
    CHECK_FALSE(c.valid());
    // NOLINTEND(bugprone-use-after-move)
    CHECK(moved.valid());
  });
}

TEST_CASE("bad input: a communicator split from one destroyed since keeps working") {
  // Using a destroyed communicator cannot be detected (the object is gone); what can happen
  // safely is destroying a parent while a communicator split from it lives on: the transport
  // is shared, so the child keeps working.
  on_world(3, [&](loopback::communicator& c) {
    auto parent = std::make_unique<loopback::communicator>(std::move(c));
    auto child = parent->split(parent->rank() % 2, 0);
    parent.reset();
    REQUIRE(child);
    std::vector<int> v(5, 1);
    all_reduce(*child, std::span<int>(v), op::sum);
    CHECK(v[0] == child->size());
  });
}

TEST_CASE("bad input: calls on an aborted communicator fail with the reason") {
  on_world(2, [&](loopback::communicator& c) {
    auto sub = c.split(0, 0);
    REQUIRE(sub);
    c.abort(fmt::format("rank {} gave up", c.rank()));
    c.abort("a second reason is ignored");
    const std::string reason =
        fmt::format("this communicator was aborted: rank {} gave up", c.rank());
    std::vector<float> v(4, 1.0f);
    auto expect = [&](const char* what, const std::function<void()>& f) {
      INFO(what);
      const std::string msg = error_of<peer_error>(f);
      INFO("message: " << msg);
      CHECK(contains(msg, reason));
    };
    expect("all_reduce", [&] { all_reduce(c, std::span<float>(v), op::sum); });
    expect("empty all_reduce", [&] { all_reduce(c, std::span<float>(), op::sum); });
    expect("barrier", [&] { barrier(c); });
    expect("send", [&] { send(c, std::span<const float>(v), 1 - c.rank()); });
    expect("split", [&] { (void)c.split(0, 0); });
    // Communicators split from it share its transport, so the abort reaches them too.
    expect("sub-communicator", [&] { all_reduce(*sub, std::span<float>(v), op::sum); });
    CHECK(c.transport().abort_reason() == fmt::format("rank {} gave up", c.rank()));
  });
}

TEST_CASE("abort() from another thread unblocks every waiter on the communicator") {
  // Rank 0 blocks in two collectives at once, on the world and on a communicator split from
  // it, in two threads; rank 1 never joins them. A third thread's abort() must end both at
  // once with the reason, long before the 30 s deadline.
  std::atomic<bool> rank0_done{false};
  on_world(
      2,
      [&](loopback::communicator& c) {
        auto sub = c.split(0, 0);
        REQUIRE(sub);
        if (c.rank() == 1) {
          while (!rank0_done.load()) std::this_thread::sleep_for(1ms);
          return;
        }
        std::vector<std::string> caught(2);
        std::vector<float> a(1000, 1.0f), b(1000, 1.0f);
        const auto start = std::chrono::steady_clock::now();
        std::thread on_world_comm([&] {
          caught[0] = error_of<peer_error>([&] { all_reduce(c, std::span<float>(a), op::sum); });
        });
        std::thread on_sub([&] { caught[1] = error_of<peer_error>([&] { barrier(*sub); }); });
        std::this_thread::sleep_for(100ms);
        std::thread stopper([&] { c.abort("stopped by the operator"); });
        stopper.join();
        on_world_comm.join();
        on_sub.join();
        const auto took = std::chrono::steady_clock::now() - start;
        for (const auto& what : caught) {
          INFO("message: " << what);
          CHECK(contains(what, "the communicator was aborted: stopped by the operator"));
        }
        CHECK(took < 10s);
        // And every call after.
        CHECK(contains(error_of<peer_error>([&] { all_reduce(c, std::span<float>(a), op::sum); }),
                       "stopped by the operator"));
        rank0_done = true;
      },
      30s);
}

namespace {

using sharder_t = zero::sharder<loopback::communicator, float>;

zero::model_layout tiny_model() {
  zero::model_layout l;
  l.add_layer("layer0");
  l.add({.name = "w", .shape = {40}, .type = dtype::float32});
  l.add({.name = "b", .shape = {7}, .type = dtype::float32});
  return l;
}

/// One micro-batch and a step, with a gradient of ones.
void train_step(sharder_t& shd) {
  const auto& layer = shd.plan().layers()[0];
  (void)shd.gather(0);
  {
    auto g = shd.gather(0, zero::pass::backward);
    for (int p = layer.first_param; p < layer.first_param + layer.param_count; ++p) {
      std::vector<float> grad(shd.plan().params()[static_cast<std::size_t>(p)].numel, 1.0f);
      shd.add_grad(p, std::span<const float>(grad));
    }
  }
  shd.end_micro_batch();
  (void)shd.step();
}

}  // namespace

TEST_CASE("a sharder whose communicator was aborted fails its next call cleanly") {
  // Stage 3 with the communication thread: rank 0 aborts from another thread while its step
  // waits on rank 1, which has stopped taking part. The blocked call and every later call
  // that communicates raise peer_error with the reason at once, and the sharder is destroyed
  // without waiting. Rank 1 then aborts its own communicator and finds the same.
  std::atomic<bool> rank0_done{false};
  on_world(
      2,
      [&](loopback::communicator& c) {
        zero::config cfg;
        cfg.stage = 3;
        cfg.bucket_bytes = 64;
        const auto start = std::chrono::steady_clock::now();
        {
          sharder_t shd(c, tiny_model(), cfg);
          train_step(shd);  // both ranks: the sharder works
          std::vector<std::string> caught;
          auto record = [&](const std::function<void()>& f) {
            caught.push_back(error_of<peer_error>(f));
          };
          if (c.rank() == 0) {
            std::thread stopper([&] {
              std::this_thread::sleep_for(100ms);
              c.abort("the trainer is shutting down");
            });
            record([&] { train_step(shd); });
            stopper.join();
          } else {
            while (!rank0_done.load()) std::this_thread::sleep_for(1ms);
            c.abort("the trainer is shutting down");
            record([&] { train_step(shd); });
          }
          record([&] { shd.run_collective([](loopback::communicator& x) { barrier(x); }); });
          record([&] { (void)shd.full_parameters(); });
          record([&] { train_step(shd); });
          for (const auto& what : caught) {
            INFO("rank " << c.rank() << ": " << what);
            CHECK(contains(what, "communicator was aborted: the trainer is shutting down"));
          }
        }
        CHECK(std::chrono::steady_clock::now() - start < 10s);
        if (c.rank() == 0) rank0_done = true;
      },
      30s);
}

TEST_CASE("bad input: malformed environment variables name the variable and the value") {
  // The launcher variables detect_launch() reads, as torchrun sets them (the other launchers'
  // are tried in tests/bootstrap/environment_test.cpp).
  const char* const launch[] = {
      "RANK",        "WORLD_SIZE",  "LOCAL_RANK",           "LOCAL_WORLD_SIZE",
      "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
      "SLURM_PROCID"};
  std::vector<std::unique_ptr<scoped_env>> clean;
  for (const char* name : launch) clean.push_back(std::make_unique<scoped_env>(name, nullptr));
  auto launch_with = [](std::initializer_list<std::pair<const char*, const char*>> vars) {
    std::vector<std::unique_ptr<scoped_env>> set;
    for (auto [k, v] : vars) set.push_back(std::make_unique<scoped_env>(k, v));
    (void)bootstrap::detect_launch();
  };
  expect_error<invalid_argument>(
      [&] {
        launch_with({{"RANK", "abc"}, {"WORLD_SIZE", "2"}});
      },
      {"RANK='abc' is not an integer"});
  expect_error<bootstrap_error>(
      [&] {
        launch_with({{"RANK", "0"}, {"WORLD_SIZE", "0"}});
      },
      {"WORLD_SIZE=0 must be at least 1"});
  expect_error<bootstrap_error>(
      [&] {
        launch_with({{"RANK", "2"}, {"WORLD_SIZE", "2"}});
      },
      {"RANK=2 is not in [0, WORLD_SIZE=2)"});
  expect_error<invalid_argument>(
      [&] {
        launch_with({{"RANK", "0"}, {"WORLD_SIZE", "99999999999"}});
      },
      {"WORLD_SIZE=99999999999 is out of range"});
  expect_error<invalid_argument>(
      [&] {
        launch_with(
            {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}});
      },
      {"MASTER_PORT=70000 is not a TCP port"});
  expect_error<invalid_argument>(
      [&] {
        launch_with({{"OMPI_COMM_WORLD_RANK", "1x"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
      },
      {"OMPI_COMM_WORLD_RANK='1x' is not an integer"});

  // RINGZERO_TIMEOUT: read when a communicator is created.
  for (const char* bad : {"-1", "0", "abc", "10s", "nan", "inf", "1e-12", "2e9"}) {
    CAPTURE(bad);
    scoped_env env("RINGZERO_TIMEOUT", bad);
    expect_error<invalid_argument>(
        [] { loopback::world(1).run([](auto&) {}); },
        {fmt::format("RINGZERO_TIMEOUT='{}' is not a number of seconds", bad)});
  }
  {
    scoped_env env("RINGZERO_TIMEOUT", "0.25");
    CHECK(detail::env_timeout() == 250ms);
  }
  // A deadline given in code that the clock arithmetic would overflow.
  expect_error<invalid_argument>(
      [] { loopback::world(1, {.timeout = std::chrono::nanoseconds::max()}).run([](auto&) {}); },
      {"communicator: the transport's timeout is 9223372036854775807 ns, longer than"});
  on_world(1, [&](loopback::communicator& c) {
    std::vector<float> v(4);
    expect_error<invalid_argument>(
        [&] {
          all_reduce(c, std::span<float>(v), op::sum, {.timeout = std::chrono::hours(1'000'000)});
        },
        {"all_reduce: options::timeout is 3600000000000000000 ns"});
  });

  // RINGZERO_CHECK and RINGZERO_ALGO: read by every collective.
  on_world(1, [&](loopback::communicator& c) {
    std::vector<float> v(4);
    {
      scoped_env env("RINGZERO_CHECK", "yes");
      expect_error<invalid_argument>([&] { all_reduce(c, std::span<float>(v), op::sum); },
                                     {"RINGZERO_CHECK='yes' is not an integer"});
    }
    {
      scoped_env env("RINGZERO_ALGO", "butterfly");
      expect_error<invalid_argument>([&] { all_reduce(c, std::span<float>(v), op::sum); },
                                     {"RINGZERO_ALGO='butterfly': unknown algorithm 'butterfly'"});
    }
  });
  // RINGZERO_RAILS: read by the socket and libfabric transports before they open anything.
  for (const auto& rails : {std::pair{"lo,,lo", 2}, std::pair{"lo,", 2}, std::pair{",lo", 1}}) {
    // Named copies, not a structured binding: CAPTURE's lambda may not refer to one (Clang 14).
    const char* const bad = rails.first;
    const int item = rails.second;
    CAPTURE(bad);
    scoped_env env("RINGZERO_RAILS", bad);
    expect_error<invalid_argument>(
        [] { (void)detail::getenv_list("RINGZERO_RAILS"); },
        {fmt::format(
            "RINGZERO_RAILS='{}': item {} is empty (a doubled, leading or trailing comma?)", bad,
            item)});
  }
  {
    // The same NIC twice is two rails on it, as documented (docs/environment.md).
    scoped_env env("RINGZERO_RAILS", "lo,lo");
    CHECK(detail::getenv_list("RINGZERO_RAILS") == std::vector<std::string>{"lo", "lo"});
  }
  // RINGZERO_DEBUG: read at the first log line, so its parser is tried directly.
  expect_error<invalid_argument>(
      [] { (void)log::detail::parse_level("loud"); },
      {"RINGZERO_DEBUG='loud' is not one of NONE, ERROR, WARN, INFO, TRACE"});
  // ERROR lines (a process ending on purpose: the watchdog's verdict) print at every level but
  // NONE, the default WARN included.
  CHECK(log::detail::parse_level("ERROR") == log::level::error);
  for (const auto lvl : {log::level::error, log::level::warn, log::level::info}) {
    log::set_level(lvl);
    CHECK(log::enabled(log::level::error));
  }
  log::set_level(log::level::error);
  CHECK_FALSE(log::enabled(log::level::warn));
  log::set_level(log::level::none);
  CHECK_FALSE(log::enabled(log::level::error));
  log::set_level(log::level::warn);
  // RINGZERO_TRACE: a directory that cannot be created fails the first collective.
  {
    scoped_env env("RINGZERO_TRACE", "/proc/self/no/such/dir");
    on_world(1, [&](loopback::communicator& c) {
      std::vector<float> v(4);
      expect_error<invalid_argument>(
          [&] { all_reduce(c, std::span<float>(v), op::sum); },
          {"RINGZERO_TRACE=/proc/self/no/such/dir: cannot create the directory"});
    });
  }
  // RINGZERO_STORE and RINGZERO_TOKEN: read by from_env(), refused before any connection.
  bootstrap::launch_info li;
  li.rank = 1;
  li.world_size = 2;
  li.master_port = 1;
  li.token = "t";
  {
    scoped_env env("RINGZERO_STORE", "ftp://host");
    expect_error<invalid_argument>(
        [&] { (void)bootstrap::make_store(li, 1s); },
        {"RINGZERO_STORE='ftp://host' is neither 'tcp' nor 'file:DIRECTORY'"});
  }
  li.token = std::string(300, 'x');
  expect_error<invalid_argument>([&] { (void)bootstrap::make_store(li, 1s); },
                                 {"the token is 300 bytes; at most 256 allowed"});
}

namespace {

/// What each rank of a world caught: the type's code and the message.
struct outcomes {
  std::mutex m;
  std::vector<std::string> what;
  std::vector<errc> code;
  explicit outcomes(int n) : what(static_cast<std::size_t>(n)), code(static_cast<std::size_t>(n)) {}
  void set(int r, const error& e) {
    std::lock_guard lock(m);
    what[static_cast<std::size_t>(r)] = e.what();
    code[static_cast<std::size_t>(r)] = e.code();
  }
};

/// Runs `call` on 3 ranks, each recording the ringzero::error it raises into `got`. With
/// `propagate` the error then ends the rank, as it would end a process: world::run fails the
/// waits of the others at once with a peer_error naming it.
template <class F>
void disagree(outcomes& got, F&& call, std::chrono::nanoseconds timeout, bool propagate) {
  try {
    on_world(
        3,
        [&](loopback::communicator& c) {
          try {
            call(c);
          } catch (const error& e) {
            got.set(c.rank(), e);
            if (propagate) throw;
          }
        },
        timeout);
  } catch (const error&) {
    if (!propagate) throw;
  }
}

}  // namespace

TEST_CASE("disagreeing collectives: RINGZERO_CHECK=1 reports both sides on every rank") {
  scoped_env check("RINGZERO_CHECK", "1");
  struct mismatch_case {
    const char* what;
    std::function<void(loopback::communicator&)> call;
    std::vector<std::string> names;
  };
  const std::vector<mismatch_case> cases = {
      {"kind",
       [](loopback::communicator& c) {
         std::vector<float> v(4, 1.0f), out(12);
         if (c.rank() == 1)
           all_gather(c, std::span<const float>(v), std::span<float>(out));
         else
           all_reduce(c, std::span<float>(v), op::sum);
       },
       {"rank 0 called all_reduce (count 4, type float, op sum, root 0, algorithm auto) "
        "but rank "
        "1 called all_gather (count 4"}},
      {"barrier against a collective",
       [](loopback::communicator& c) {
         std::vector<float> v(4, 1.0f);
         if (c.rank() == 2)
           barrier(c);
         else
           all_reduce(c, std::span<float>(v), op::sum);
       },
       {"rank 0 called all_reduce (count 4", "but rank 2 called barrier (count 0"}},
      {"count",
       [](loopback::communicator& c) {
         std::vector<float> v(c.rank() == 2 ? 5 : 4, 1.0f);
         all_reduce(c, std::span<float>(v), op::sum);
       },
       {"rank 0 called all_reduce (count 4", "rank 2 called all_reduce (count 5"}},
      {"type",
       [](loopback::communicator& c) {
         if (c.rank() == 1) {
           std::vector<std::int32_t> v(4, 1);
           all_reduce(c, std::span<std::int32_t>(v), op::sum);
         } else {
           std::vector<float> v(4, 1.0f);
           all_reduce(c, std::span<float>(v), op::sum);
         }
       },
       {"(count 4, type float", "rank 1 called all_reduce (count 4, type int32"}},
      {"op",
       [](loopback::communicator& c) {
         std::vector<float> v(4, 1.0f);
         all_reduce(c, std::span<float>(v), c.rank() == 2 ? op::max : op::sum);
       },
       {"op sum", "rank 2 called all_reduce (count 4, type float, op max"}},
      {"root",
       [](loopback::communicator& c) {
         std::vector<float> v(4, 1.0f);
         broadcast(c, std::span<float>(v), c.rank() == 0 ? 0 : 1);
       },
       {"rank 0 called broadcast (count 4, type float, op sum, root 0",
        "rank 1 called broadcast (count 4, type float, op sum, root 1"}},
      {"algorithm",
       [](loopback::communicator& c) {
         std::vector<float> v(4, 1.0f);
         all_reduce(c, std::span<float>(v), op::sum,
                    {.algorithm = c.rank() == 1 ? algorithm::tree : algorithm::ring});
       },
       {"algorithm ring) but rank 1", "algorithm tree)"}},
  };
  for (const auto& mc : cases) {
    INFO(std::string(mc.what));
    const auto start = std::chrono::steady_clock::now();
    outcomes got(3);
    disagree(
        got,
        [&](loopback::communicator& c) {
          try {
            mc.call(c);
          } catch (const mismatch_error&) {
            // Every rank stopped at the same check, so the ranks are still in step.
            check_still_works(c);
            throw;
          }
        },
        20s, false);
    CHECK(std::chrono::steady_clock::now() - start < 5s);
    for (int r = 0; r < 3; ++r) {
      INFO("rank " << r << ": " << got.what[static_cast<std::size_t>(r)]);
      CHECK(got.code[static_cast<std::size_t>(r)] == errc::mismatch);
      for (const auto& part : mc.names)
        CHECK(contains(got.what[static_cast<std::size_t>(r)], part));
    }
  }
}

TEST_CASE("disagreement without RINGZERO_CHECK: a size mismatch errors, never corrupts") {
  // Rank 2 passes one element more than the others (or none at all). Where a message carries
  // the wrong size both ends raise transport_error naming both sizes, at once; the rank that
  // raised ends, so the others' waits fail with peer_error naming it. A rank with nothing to
  // send returns, and the others time out naming it. Nothing is written past any rank's buffer
  // (the guard elements around it keep their values), and nothing waits past the deadline.
  scoped_env check("RINGZERO_CHECK", nullptr);
  constexpr std::size_t guard = 64;
  constexpr float canary = -7.0f;
  constexpr auto deadline = 1s;
  struct size_case {
    const char* what;
    std::function<void(loopback::communicator&, std::span<float>)> call;
    std::size_t count;  // elements on ranks 0 and 1; rank 2 passes count + 1
    bool all_raise;     // every rank needs rank 2's data (else a rank may finish untouched)
    bool times_out;     // the mismatch is a missing message, found at the deadline
  };
  const std::vector<size_case> cases = {
      {"all_reduce ring",
       [](auto& c, std::span<float> s) {
         all_reduce(c, s, op::sum, {.algorithm = algorithm::ring});
       },
       3000, true, false},
      {"all_reduce tree",
       [](auto& c, std::span<float> s) {
         all_reduce(c, s, op::sum, {.algorithm = algorithm::tree});
       },
       3000, true, false},
      {"all_reduce rd",
       [](auto& c, std::span<float> s) {
         all_reduce(c, s, op::sum, {.algorithm = algorithm::recursive_doubling});
       },
       3000, true, false},
      {"all_reduce rhd",
       [](auto& c, std::span<float> s) {
         all_reduce(c, s, op::sum, {.algorithm = algorithm::recursive_halving_doubling});
       },
       3000, true, false},
      {"reduce_scatter",
       [](auto& c, std::span<float> s) {
         std::vector<float> out(s.size() / 3 + (c.rank() == 2 ? 1 : 0));
         reduce_scatter(c, std::span<const float>(s.first(3 * out.size())), std::span<float>(out),
                        op::sum);
       },
       3000, true, false},
      {"all_gather",
       [](auto& c, std::span<float> s) {
         std::vector<float> out(3 * s.size());
         all_gather(c, std::span<const float>(s), std::span<float>(out));
       },
       999, true, false},
      {"broadcast", [](auto& c, std::span<float> s) { broadcast(c, s, 0); }, 3000, false, false},
      {"reduce", [](auto& c, std::span<float> s) { reduce(c, s, op::sum, 1); }, 3000, false, false},
      {"all_reduce, rank 2 empty",
       [](auto& c, std::span<float> s) {
         all_reduce(c, c.rank() == 2 ? s.first(0) : s.first(s.size() - 1), op::sum);
       },
       3000, false, true},
  };
  for (const auto& sc : cases) {
    INFO(std::string(sc.what));
    std::mutex m;
    std::vector<bool> guards_intact(3, false);
    outcomes got(3);
    const auto start = std::chrono::steady_clock::now();
    disagree(
        got,
        [&](loopback::communicator& c) {
          const std::size_t n = sc.count + (c.rank() == 2 ? 1 : 0);
          std::vector<float> buf(n + 2 * guard, canary);
          for (std::size_t i = 0; i < n; ++i) buf[guard + i] = float(c.rank() + 1);
          auto check_guards = [&] {
            bool ok = true;
            for (std::size_t i = 0; i < guard; ++i)
              ok = ok && buf[i] == canary && buf[guard + n + i] == canary;
            std::lock_guard lock(m);
            guards_intact[static_cast<std::size_t>(c.rank())] = ok;
          };
          try {
            sc.call(c, std::span<float>(buf).subspan(guard, n));
          } catch (...) {
            check_guards();
            throw;
          }
          check_guards();
        },
        deadline, true);
    const auto took = std::chrono::steady_clock::now() - start;
    CHECK(took < (sc.times_out ? deadline + 2s : 500ms));
    for (int r = 0; r < 3; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      INFO("rank " << r << ": " << got.what[ur]);
      CHECK(guards_intact[ur]);
      if (sc.times_out) {
        // The first to time out ends, so the other may fail on it instead: both name rank 2.
        if (r != 2)
          CHECK(((got.code[ur] == errc::timeout || got.code[ur] == errc::peer_failure) &&
                 contains(got.what[ur], "waiting for rank 2")));
        continue;
      }
      // Every error traces back to a message of the wrong size: a rank's own, or (as a
      // peer_error) the first rank's that failed on one.
      if (!got.what[ur].empty()) CHECK(contains(got.what[ur], "message size mismatch"));
      if (r == 2 || sc.all_raise) CHECK_FALSE(got.what[ur].empty());
    }
  }
}

TEST_CASE("docs/errors.md: every case it lists names a test case that exists") {
  std::ifstream doc(RINGZERO_SOURCE_DIR "/docs/errors.md");
  REQUIRE(doc.good());
  // Rows end with  | `tests/<file>` "<test case name>" |
  const std::regex row(R"re(\| `(tests/[a-z_/]+\.cpp)` "([^"]+)" \|\s*$)re");
  std::map<std::string, std::string> sources;
  std::set<std::string> cited;
  int rows = 0;
  for (std::string line; std::getline(doc, line);) {
    std::smatch m;
    if (!std::regex_search(line, m, row)) continue;
    ++rows;
    const std::string file = m[1], name = m[2];
    if (!sources.count(file)) {
      std::ifstream src(RINGZERO_SOURCE_DIR "/" + file);
      INFO(file);
      REQUIRE(src.good());
      std::stringstream ss;
      ss << src.rdbuf();
      sources[file] = ss.str();
    }
    INFO(file << ": " << name);
    // A typed case (one per transport, TEST_CASE_TEMPLATE) counts as well as a plain one.
    CHECK((contains(sources[file], "TEST_CASE(\"" + name + "\"") ||
           contains(sources[file], "TEST_CASE_TEMPLATE(\"" + name + "\"")));
    if (file == "tests/core/bad_input_test.cpp") cited.insert(name);
  }
  CHECK(rows >= 40);
  // And the other way: every test case of this file is cited by some row.
  std::ifstream self(RINGZERO_SOURCE_DIR "/tests/core/bad_input_test.cpp");
  const std::regex test_case(R"re(^TEST_CASE\("([^"]+)")re");
  for (std::string line; std::getline(self, line);) {
    std::smatch m;
    if (std::regex_search(line, m, test_case) && !contains(m[1], "docs/errors.md")) {
      INFO(m[1]);
      CHECK(cited.count(m[1]) == 1);
    }
  }
}
