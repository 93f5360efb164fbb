#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "analysis.hpp"
#include "ringzero/ringzero.hpp"
#include "ringzero/trace.hpp"
#include "ringzero/zero/sharder.hpp"
#include "trace_file.hpp"

using namespace ringzero;
namespace tt = ringzero::trace_tool;
namespace fs = std::filesystem;

namespace {

/// A fresh directory, removed with its files at the end of the test.
class temp_dir {
 public:
  temp_dir() {
    char tmpl[] = "/tmp/ringzero-trace-test-XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    path_ = tmpl;
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  [[nodiscard]] const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

/// RINGZERO_TRACE for one scope; set before a world starts its threads, which read it at their
/// communicator's first collective.
class scoped_trace {
 public:
  explicit scoped_trace(const std::string& value) { ::setenv("RINGZERO_TRACE", value.c_str(), 1); }
  ~scoped_trace() { ::unsetenv("RINGZERO_TRACE"); }
  scoped_trace(const scoped_trace&) = delete;
  scoped_trace& operator=(const scoped_trace&) = delete;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

/// The events of one kind ("collective", "phase", "p2p") in file order.
std::vector<const tt::json*> events_of(const tt::rank_file& f, std::string_view cat) {
  std::vector<const tt::json*> out;
  for (const auto& e : f.events)
    if (e.string_or("cat", "") == cat) out.push_back(&e);
  return out;
}

const tt::json& args_of(const tt::json& e) {
  const tt::json* a = e.find("args");
  REQUIRE(a != nullptr);
  return *a;
}

/// The scripted sequence: one call of each collective, a phase around two of them, a
/// point-to-point pair.
void scripted(loopback::communicator& c) {
  const int r = c.rank();
  const int n = c.size();
  std::vector<float> f(1000, static_cast<float>(r));
  all_reduce(c, std::span<float>(f), op::sum, {.algorithm = algorithm::ring});
  // docs-begin: trace-scope
  {
    trace::scope phase(c, "step", 4000);
    std::vector<float> block(10);
    std::vector<float> full(10 * static_cast<std::size_t>(n), 1.0f);
    reduce_scatter(c, std::span<const float>(full), std::span<float>(block), op::sum);
    all_gather(c, std::span<const float>(block), std::span<float>(full));
  }
  // docs-end: trace-scope
  std::vector<std::int32_t> v(7, r);
  broadcast(c, std::span<std::int32_t>(v), 1);
  reduce(c, std::span<std::int32_t>(v), op::max, 2);
  barrier(c);
  std::vector<double> d(3, 1.0);
  all_reduce(c, std::span<double>(d), op::avg, {.algorithm = algorithm::tree});
  if (r == 0) send(c, std::span<const double>(d), 1);
  if (r == 1) recv(c, std::span<double>(d), 0);
}

}  // namespace

TEST_CASE("a scripted sequence on 3 ranks leaves one valid JSON trace per rank") {
  temp_dir dir;
  {
    scoped_trace env(dir.path().string());
    loopback::world(3).run(scripted);
  }
  const char* expected[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                            "reduce",     "barrier",        "all_reduce"};
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    const fs::path p = dir.path() / fmt::format("rank{}.json", r);
    REQUIRE(fs::exists(p));
    // The whole file is one strict JSON array: the process closed it.
    const tt::json doc = tt::parse_json(slurp(p));
    REQUIRE(doc.k == tt::json::kind::array);

    const tt::rank_file f = tt::read_rank_file(p.string());
    CHECK(f.closed);
    CHECK(f.rank == r);
    CHECK(f.size == 3);
    CHECK(f.events.size() == doc.arr.size());
    if (r == 0) CHECK(f.offset_us == 0);
    // Threads of one process share the clock: the measured offset is within a round trip.
    CHECK(std::abs(f.offset_us) <= f.rtt_us + 1.0);

    const auto coll = events_of(f, "collective");
    REQUIRE(coll.size() == std::size(expected));
    double prev_end = 0;
    for (std::size_t i = 0; i < coll.size(); ++i) {
      const tt::json& e = *coll[i];
      CHECK(e.string_or("name", "") == expected[i]);
      CHECK(e.string_or("ph", "") == "X");
      CHECK(e.number_or("pid", -1) == r);
      CHECK(args_of(e).number_or("seq", -1) == static_cast<double>(i));
      CHECK(args_of(e).number_or("ranks", 0) == 3);
      CHECK(e.number_or("dur", -1) >= 0);
      CHECK(e.number_or("ts", 0) >= prev_end);
      prev_end = e.number_or("ts", 0) + e.number_or("dur", 0);
    }
    const tt::json& first = args_of(*coll[0]);
    CHECK(first.number_or("bytes", 0) == 4000);
    CHECK(first.string_or("type", "") == "float");
    CHECK(first.string_or("op", "") == "sum");
    CHECK(first.string_or("algorithm", "") == "ring");
    CHECK(first.number_or("chunks", 0) == 1);
    // Every rank of a 3-rank ring receives before it finishes.
    CHECK(first.number_or("wait_us", -1) >= 0);
    CHECK(first.number_or("wait_us", -1) <= coll[0]->number_or("dur", 0));
    CHECK(args_of(*coll[1]).number_or("bytes", 0) == 120);  // reduce_scatter: the full input
    CHECK(args_of(*coll[2]).number_or("bytes", 0) == 120);  // all_gather: the full output
    CHECK(args_of(*coll[3]).string_or("type", "") == "int32");
    CHECK(args_of(*coll[4]).string_or("op", "") == "max");
    CHECK(args_of(*coll[5]).number_or("bytes", -1) == 0);
    CHECK(args_of(*coll[6]).string_or("algorithm", "") == "tree");
    CHECK(args_of(*coll[6]).string_or("op", "") == "avg");

    const auto phases = events_of(f, "phase");
    REQUIRE(phases.size() == 1);
    const tt::json& ph = *phases[0];
    CHECK(ph.string_or("name", "") == "step");
    CHECK(args_of(ph).number_or("bytes", 0) == 4000);
    // The phase encloses the two collectives run inside it.
    CHECK(ph.number_or("ts", 0) <= coll[1]->number_or("ts", 0));
    CHECK(ph.number_or("ts", 0) + ph.number_or("dur", 0) >=
          coll[2]->number_or("ts", 0) + coll[2]->number_or("dur", 0));

    const auto p2p = events_of(f, "p2p");
    CHECK(p2p.size() == (r < 2 ? 1u : 0u));
    if (r == 0) CHECK(p2p[0]->string_or("name", "") == "send");
    if (r == 1) CHECK(p2p[0]->string_or("name", "") == "recv");
  }
}

TEST_CASE("the sharder records its gather, reduce, step and checkpoint phases") {
  temp_dir dir;
  zero::model_layout layout;
  for (int l = 0; l < 3; ++l) {
    layout.add_layer(fmt::format("layer{}", l));
    layout.add({.name = fmt::format("w{}", l), .shape = {64}, .type = dtype::float32});
  }
  {
    scoped_trace env(dir.path().string());
    loopback::world(2).run([&](loopback::communicator& c) {
      zero::config cfg;
      cfg.stage = 3;
      cfg.bucket_bytes = 256;  // one layer per bucket
      zero::sharder<loopback::communicator, float> shd(c, layout, cfg);
      for (int l = 0; l < 3; ++l) (void)shd.gather(l);
      const std::vector<float> g(64, 0.5f);
      for (int l = 2; l >= 0; --l) shd.add_grad(l, std::span<const float>(g));
      shd.end_micro_batch();
      (void)shd.step();
      shd.save(dir.path() / "ckpt");
    });
  }
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    const tt::rank_file f =
        tt::read_rank_file((dir.path() / fmt::format("rank{}.json", r)).string());
    std::map<std::string, std::vector<double>> bytes;
    std::map<std::string, std::set<double>> tids;
    for (const tt::json* e : events_of(f, "phase")) {
      bytes[e->string_or("name", "")].push_back(args_of(*e).number_or("bytes", -1));
      tids[e->string_or("name", "")].insert(e->number_or("tid", -1));
    }
    // reduce runs on the communication thread, around its reduce_scatter: the collectives'
    // track. The caller's phases overlap those without nesting: a track of their own.
    CHECK(tids["reduce"] == std::set<double>{1});
    CHECK(tids["gather"] == std::set<double>{0});
    CHECK(tids["step"] == std::set<double>{0});
    // Chrome's format: the slices of one track nest (or are disjoint). The file's times have
    // three decimals, hence the nanosecond of slack.
    std::map<double, std::vector<std::pair<double, double>>> tracks;
    for (const auto& e : f.events)
      if (e.string_or("ph", "") == "X")
        tracks[e.number_or("tid", -1)].emplace_back(e.number_or("ts", 0),
                                                    e.number_or("ts", 0) + e.number_or("dur", 0));
    for (auto& [tid, slices] : tracks) {
      const double track = tid;  // CAPTURE's lambda takes a variable, not a structured binding
      CAPTURE(track);
      std::sort(slices.begin(), slices.end(), [](const auto& a, const auto& b) {
        return a.first != b.first ? a.first < b.first : a.second > b.second;
      });
      std::vector<double> open_ends;
      for (const auto& [begin, end] : slices) {
        while (!open_ends.empty() && open_ends.back() <= begin + 1e-3) open_ends.pop_back();
        if (!open_ends.empty()) CHECK(end <= open_ends.back() + 1e-3);
        open_ends.push_back(end);
      }
    }
    // The first gather waits for its bucket; later ones may find theirs prefetched, but still
    // record the (empty) wait.
    CHECK(bytes["gather"] == std::vector<double>{256, 256, 256});
    CHECK(bytes["reduce"] == std::vector<double>{256, 256, 256});
    // The AdamW state of three layers of 64 fp32, half of each on this rank: two moments (an
    // fp32 parameter is its own master weight).
    CHECK(bytes["step"] == std::vector<double>{2 * 3 * 32 * 4});
    REQUIRE(bytes["checkpoint"].size() == 1);
    CHECK(bytes["checkpoint"][0] > 3 * 32 * 4);
  }
}

TEST_CASE("merge puts each rank on its own track, on one clock") {
  temp_dir dir;
  {
    scoped_trace env(dir.path().string());
    loopback::world(3).run(scripted);
  }
  const auto files = tt::read_inputs({dir.path().string()});
  REQUIRE(files.size() == 3);
  const tt::json merged = tt::parse_json(tt::merge(files));
  REQUIRE(merged.k == tt::json::kind::array);
  std::map<int, int> collectives_per_pid;
  std::map<int, std::string> process_names;
  double min_ts = 1e300;
  for (const auto& e : merged.arr) {
    const int pid = static_cast<int>(e.number_or("pid", -1));
    if (e.string_or("name", "") == "process_name")
      process_names[pid] = args_of(e).string_or("name", "");
    if (e.string_or("cat", "") == "collective") {
      ++collectives_per_pid[pid];
      min_ts = std::min(min_ts, e.number_or("ts", 0));
    }
  }
  CHECK(process_names == std::map<int, std::string>{{0, "rank 0"}, {1, "rank 1"}, {2, "rank 2"}});
  CHECK(collectives_per_pid == std::map<int, int>{{0, 7}, {1, 7}, {2, 7}});
  // Aligned and rebased: the first event starts near zero, not at the machine's uptime.
  CHECK(min_ts >= 0);
  CHECK(min_ts < 1e6);
}

TEST_CASE("counters match the calls made") {
  ::unsetenv("RINGZERO_TRACE");
  loopback::world(3).run([](loopback::communicator& c) {
    std::vector<float> v(256, 1.0f);
    for (int i = 0; i < 5; ++i)
      all_reduce(c, std::span<float>(v), op::sum, {.algorithm = algorithm::ring});
    for (int i = 0; i < 2; ++i)
      all_reduce(c, std::span<float>(v), op::sum, {.algorithm = algorithm::recursive_doubling});
    std::vector<float> full(3 * 256);
    for (int i = 0; i < 3; ++i)
      all_gather(c, std::span<const float>(v), std::span<float>(full),
                 {.algorithm = algorithm::ring});
    barrier(c);

    // docs-begin: counters
    const std::vector<trace::counter> rows = trace::counters(c);
    // docs-end: counters
    REQUIRE(rows.size() == 4);
    CHECK(rows[0].kind == collective::all_reduce);
    CHECK(rows[0].algo == algorithm::ring);
    CHECK(rows[0].calls == 5);
    CHECK(rows[0].bytes == 5 * 1024);
    CHECK(rows[0].seconds > 0);
    CHECK(rows[0].busbw_gbps ==
          doctest::Approx(5 * 1024 / rows[0].seconds * 4.0 / 3.0 / 1e9).epsilon(1e-9));
    CHECK(rows[1].kind == collective::all_reduce);
    CHECK(rows[1].algo == algorithm::recursive_doubling);
    CHECK(rows[1].calls == 2);
    CHECK(rows[2].kind == collective::all_gather);
    CHECK(rows[2].calls == 3);
    CHECK(rows[2].bytes == 3 * 3 * 1024);
    CHECK(rows[3].kind == collective::barrier);
    CHECK(rows[3].calls == 1);

    const std::string table = trace::counters_table(c);
    CHECK(table.find("all_reduce     ring              5") != std::string::npos);
    CHECK(table.find("all_gather     ring              3") != std::string::npos);

    trace::reset_counters(c);
    CHECK(trace::counters(c).empty());
  });
}

// The counters hold a cell per (collective, algorithm): one past the last of each must be a
// value with no name, or a newer enumerator would count outside them.
static_assert(collective_name(static_cast<collective>(detail::traced_collectives)) == "?");
static_assert(algorithm_name(static_cast<algorithm>(detail::traced_algorithms - 1)) != "?");
static_assert(algorithm_name(static_cast<algorithm>(detail::traced_algorithms)) == "?");

TEST_CASE("counters cover the last collective and the last algorithm") {
  ::unsetenv("RINGZERO_TRACE");
  loopback::world(3).run([](loopback::communicator& c) {
    std::vector<float> block(4, 1.0f), all(3 * 4);
    scatter(c, std::span<const float>(all), std::span<float>(block), 2,
            {.algorithm = algorithm::linear});
    all_to_all(c, std::span<const float>(all), std::span<float>(all),
               {.algorithm = algorithm::pairwise});
    const std::vector<trace::counter> rows = trace::counters(c);
    REQUIRE(rows.size() == 2);
    CHECK(rows[0].kind == collective::all_to_all);
    CHECK(rows[0].algo == algorithm::pairwise);
    CHECK(rows[0].calls == 1);
    CHECK(rows[1].kind == collective::scatter);
    CHECK(rows[1].algo == algorithm::linear);
    CHECK(rows[1].calls == 1);
  });
}

TEST_CASE("the report names a rank that arrives late on purpose") {
  temp_dir dir;
  {
    scoped_trace env(dir.path().string());
    loopback::world(3).run([](loopback::communicator& c) {
      std::vector<float> v(64, 1.0f);
      all_reduce(c, std::span<float>(v), op::sum);  // opens the file and measures clocks
      for (int i = 0; i < 6; ++i) {
        if (c.rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        all_reduce(c, std::span<float>(v), op::sum);
      }
    });
  }
  const auto files = tt::read_inputs({dir.path().string()});
  const auto kinds = tt::straggler_summary(files);
  REQUIRE(kinds.size() == 1);
  CHECK(kinds[0].kind == "all_reduce");
  CHECK(kinds[0].calls == 7);
  CHECK(kinds[0].straggler() == 2);
  // On a busy machine another rank may be descheduled past the sleep once in a while.
  CHECK(kinds[0].last_count.at(2) >= 4);
  // Late by about the sleep, on average.
  CHECK(kinds[0].late_sum_us.at(2) / static_cast<double>(kinds[0].last_count.at(2)) > 25e3);
  const std::string text = tt::format_report(files, kinds);
  CHECK(text.find("all_reduce: rank 2 arrived last in") != std::string::npos);
}

TEST_CASE("a process killed mid-run leaves a trace that still parses") {
  temp_dir dir;
  const std::string pattern = (dir.path() / "rank%r.json").string();
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::setenv("RINGZERO_TRACE", pattern.c_str(), 1);
    loopback::world(3).run([](loopback::communicator& c) {
      std::vector<float> v(64, 1.0f);
      for (int i = 0; i < 5; ++i) all_reduce(c, std::span<float>(v), op::sum);
      barrier(c);
      if (c.rank() == 1) ::kill(::getpid(), SIGKILL);
      for (int i = 0; i < 1000; ++i) all_reduce(c, std::span<float>(v), op::sum);
    });
    ::_exit(3);  // reached only if the kill did not happen
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGKILL);
  const auto files = tt::read_inputs({dir.path().string()});
  REQUIRE(files.size() == 3);
  for (const auto& f : files) {
    CAPTURE(f.path);
    CHECK_FALSE(f.closed);
    // Every call that ended before the kill is on disk: rank 1's five all_reduces and its
    // barrier; the others may not have left the barrier when rank 1 killed the process.
    const auto n = events_of(f, "collective").size();
    if (f.rank == 1)
      CHECK(n == 6);
    else
      CHECK((n == 5 || n == 6));
    // Closing the array is all a strict parser needs.
    std::string text = slurp(f.path);
    if (f.torn_tail) text.erase(text.rfind('\n', text.size() - 2) + 1);
    CHECK_NOTHROW((void)tt::parse_json(text + "]"));
  }
  CHECK_NOTHROW((void)tt::parse_json(tt::merge(files)));
}
