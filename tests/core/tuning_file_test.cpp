#include <doctest/doctest.h>

#include <unistd.h>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "ringzero/model/cost_model.hpp"
#include "ringzero/ringzero.hpp"
#include "ringzero/trace.hpp"
#include "ringzero/tuning/tuning_file.hpp"

using namespace ringzero;
using tuning::tuning_file;
using tuning::tuning_section;

namespace {

/// A file under the temporary directory, removed at the end of the test.
struct temp_file {
  std::string path;
  explicit temp_file(const std::string& text) {
    path =
        (std::filesystem::temp_directory_path() /
         ("ringzero_tuning_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++)))
            .string();
    std::ofstream(path) << text;
  }
  ~temp_file() { std::remove(path.c_str()); }
  temp_file(const temp_file&) = delete;
  temp_file& operator=(const temp_file&) = delete;
  static int& counter() {
    static int n = 0;
    return n;
  }
};

/// Sets RINGZERO_TUNING for the scope.
struct tuning_env {
  explicit tuning_env(const std::string& path) { ::setenv("RINGZERO_TUNING", path.c_str(), 1); }
  ~tuning_env() { ::unsetenv("RINGZERO_TUNING"); }
  tuning_env(const tuning_env&) = delete;
  tuning_env& operator=(const tuning_env&) = delete;
};

std::string message_of(const std::string& text) {
  try {
    (void)tuning::parse_tuning(text, "t.conf");
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return "(parsed)";
}

bool same_bits(double a, double b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

}  // namespace

TEST_CASE("tuning file: what format_tuning writes, parse_tuning reads back bit for bit") {
  tuning_file f;
  f.sections.push_back(tuning_section{.name = "shm",
                                      .alpha = 4.123456789012345e-7,
                                      .beta = 1.0 / 7.3e9,
                                      .gamma = 1.0 / 11.1e9,
                                      .one_phase_bytes = 16384,
                                      .one_phase_ranks = 2,
                                      .measured = "2 ranks on host-a, 2026-11-25"});
  f.sections.push_back(tuning_section{.name = "libfabric:tcp;ofi_rxm", .alpha = 9.5e-6});
  f.sections.push_back(tuning_section{.name = "loopback", .chunk_bytes = 65536});
  const tuning_file g = tuning::parse_tuning(tuning::format_tuning(f), "mem");
  REQUIRE(g.sections.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    const auto& a = f.sections[i];
    const auto& b = g.sections[i];
    CHECK(a.name == b.name);
    CHECK(a.measured == b.measured);
    CHECK(a.alpha.has_value() == b.alpha.has_value());
    CHECK(a.beta.has_value() == b.beta.has_value());
    CHECK(a.gamma.has_value() == b.gamma.has_value());
    CHECK(a.chunk_bytes == b.chunk_bytes);
    CHECK(a.one_phase_bytes == b.one_phase_bytes);
    CHECK(a.one_phase_ranks == b.one_phase_ranks);
    if (a.alpha) CHECK(same_bits(*a.alpha, *b.alpha));
    if (a.beta) CHECK(same_bits(*a.beta, *b.beta));
    if (a.gamma) CHECK(same_bits(*a.gamma, *b.gamma));
  }
  // Through the file system as well, replacing one section and keeping the others.
  temp_file t("");
  tuning::write_tuning(t.path, g);
  tuning_file h = tuning::read_tuning(t.path);
  h.put(tuning_section{.name = "shm", .alpha = 1e-6});
  h.put(tuning_section{.name = "libfabric:shm", .beta = 1e-10});
  tuning::write_tuning(t.path, h);
  const tuning_file k = tuning::read_tuning(t.path);
  REQUIRE(k.sections.size() == 4);
  CHECK(*k.find("shm")->alpha == 1e-6);
  CHECK_FALSE(k.find("shm")->beta.has_value());
  CHECK(*k.find("libfabric:tcp;ofi_rxm")->alpha == 9.5e-6);
  CHECK(*k.find("libfabric:shm")->beta == 1e-10);
}

TEST_CASE("tuning file: a malformed file names the file, the line and what is wrong") {
  struct bad {
    const char* text;
    const char* says;
  };
  const bad cases[] = {
      {"", "line 1: no 'version = 1' line"},
      {"[shm]\nalpha = 1e-6\n", "line 1: a section before the 'version = 1' line"},
      {"version = 2\n", "line 1: version 2 is not the version this ringzero reads (1)"},
      {"version = x\n", "line 1: version 'x' is not an integer"},
      {"version = 1\nversion = 1\n", "line 2: 'version' must come once"},
      {"version = 1\nalpha = 1e-6\n", "line 2: 'alpha' outside a section"},
      {"version = 1\n[shm\n", "line 2: '[shm' opens a section but does not close it"},
      {"version = 1\n[ ]\n", "line 2: a section without a name"},
      {"version = 1\n[shm]\nalpha = 1e-6\n[shm]\nbeta = 1e-9\n",
       "line 4: section [shm] appears twice"},
      {"version = 1\n[shm]\nalpha = fast\n", "line 3: alpha = 'fast' is not a number"},
      {"version = 1\n[shm]\nalpha = 1e-6 s\n", "line 3: alpha = '1e-6 s' is not a number"},
      {"version = 1\n[shm]\nalpha = -1e-6\n", "line 3: alpha = -1e-6 is outside [0, 1) seconds"},
      {"version = 1\n[shm]\nbeta = 0\n", "line 3: beta = 0 is outside (0, 1) seconds"},
      {"version = 1\n[shm]\ngamma = inf\n", "line 3: gamma = inf is outside [0, 1) seconds"},
      {"version = 1\n[shm]\ngamma = nan\n", "line 3: gamma = nan is outside [0, 1) seconds"},
      {"version = 1\n[shm]\nalpha = 1e-6\nalpha = 2e-6\n", "line 4: 'alpha' is set twice in [shm]"},
      {"version = 1\n[shm]\nchunk_bytes = 0\n", "line 3: chunk_bytes = '0' is not a positive"},
      {"version = 1\n[shm]\nchunk_bytes = 1.5\n", "line 3: chunk_bytes = '1.5' is not a positive"},
      {"version = 1\n[shm]\ndelta = 1\n", "line 3: unknown key 'delta'"},
      {"version = 1\n[shm]\none_phase_bytes = 8192\n",
       "line 2: section [shm] sets one of one_phase_bytes and one_phase_ranks"},
      {"version = 1\n[shm]\nalpha = 1e-6\none_phase_ranks = 2\n",
       "line 2: section [shm] sets one of one_phase_bytes and one_phase_ranks"},
      {"version = 1\n[shm]\none_phase_bytes = -4\n",
       "line 3: one_phase_bytes = '-4' is not a positive integer"},
      {"version = 1\n[shm]\none_phase_bytes = 8192\none_phase_ranks = 0\n",
       "line 4: one_phase_ranks = '0' is not a positive integer"},
      {"version = 1\n[shm]\none_phase_bytes = 8192\none_phase_ranks = 4294967296\n",
       "line 4: one_phase_ranks = 4294967296 is more than 1073741824"},
      {"version = 1\n[shm]\njust words\n", "line 3: 'just words' is neither"},
      {"version = 1\n\n# a comment\n[shm]\nmeasured = today\n[tcp]\nalpha = 1e-5\n",
       "line 4: section [shm] sets none of alpha, beta, gamma, chunk_bytes, one_phase_bytes"},
      {"version = 1\n[shm]\n", "line 2: section [shm] sets none"},
  };
  for (const auto& c : cases) {
    INFO(c.text);
    const std::string m = message_of(c.text);
    CHECK(m.find("ringzero: tuning file t.conf: ") == 0);
    CHECK(m.find(c.says) != std::string::npos);
  }
  // Comments, blank lines, spaces and CRLF line ends are fine.
  const auto ok = tuning::parse_tuning(
      "# header\r\n\r\n  version = 1  \r\n[ shm ]\r\n  # note\r\nbeta=2e-10\r\n", "crlf");
  REQUIRE(ok.find("shm") != nullptr);
  CHECK(*ok.find("shm")->beta == 2e-10);

  CHECK_THROWS_WITH_AS((void)tuning::read_tuning("/nonexistent/ringzero.tuning"),
                       doctest::Contains("tuning file /nonexistent/ringzero.tuning: cannot open"),
                       invalid_argument);
}

TEST_CASE("tuning file: a section replaces only the constants it sets, for its transport only") {
  const tuning_file f = tuning::parse_tuning(
      "version = 1\n[shm]\nalpha = 3e-7\n[loopback]\nbeta = 1e-9\nchunk_bytes = 4096\n", "f");
  const tuning::policy defaults = loopback::world_options{}.tuning;
  REQUIRE(f.find("loopback") != nullptr);
  CHECK(f.find("libfabric:shm") == nullptr);
  const tuning::policy p = f.find("loopback")->apply(defaults);
  CHECK(p.alpha == defaults.alpha);
  CHECK(p.beta == 1e-9);
  CHECK(p.gamma == defaults.gamma);
  CHECK(p.chunk_bytes == 4096);
  CHECK(p.burst == defaults.burst);
  CHECK(p.inflight == defaults.inflight);
  CHECK(f.find("shm")->apply(defaults).alpha == 3e-7);
  CHECK(p.one_phase_bytes == 0);  // not set: the transport's rule stays

  // The segment's one-phase limit holds at the world size it was measured at.
  const tuning::policy q =
      tuning::parse_tuning("version = 1\n[shm]\none_phase_bytes = 8192\none_phase_ranks = 2\n", "g")
          .find("shm")
          ->apply(defaults);
  CHECK(q.alpha == defaults.alpha);
  CHECK(tuning::one_phase_limit(q, 2) == 8192);
  CHECK(tuning::one_phase_limit(q, 4) == 0);
  CHECK(tuning::one_phase_limit(defaults, 2) == 0);

  temp_file t("version = 1\n[shm]\nalpha = 3e-7\n");
  const auto none = tuning::load_tuning(t.path, "loopback", defaults);
  CHECK(none.what == tuning::tuning_outcome::kind::no_section);
  CHECK(none.values.alpha == defaults.alpha);
  const auto some = tuning::load_tuning(t.path, "shm", defaults);
  CHECK(some.what == tuning::tuning_outcome::kind::applied);
  CHECK(some.values.alpha == 3e-7);
  const auto failed = tuning::load_tuning(t.path + ".missing", "shm", defaults);
  CHECK(failed.what == tuning::tuning_outcome::kind::failed);
  CHECK(failed.error.find(t.path + ".missing") != std::string::npos);
}

TEST_CASE("RINGZERO_TUNING: the file's constants change what auto picks on a communicator") {
  constexpr int n = 4;
  const double bytes = 64.0 * 1024;
  const tuning::policy defaults = loopback::world_options{}.tuning;
  const algorithm before = tuning::select(collective::all_reduce, bytes, n, defaults);
  // Constants under which another algorithm is the cheapest: messages nearly free and bytes
  // dear favour the fewest bytes (ring, rhd), the opposite the fewest messages.
  tuning_section sec{.name = "loopback", .alpha = 1e-9, .beta = 1e-6, .gamma = 1e-9};
  if (tuning::select(collective::all_reduce, bytes, n, sec.apply(defaults)) == before)
    sec = tuning_section{.name = "loopback", .alpha = 0.5, .beta = 1e-12, .gamma = 1e-12};
  const algorithm after = tuning::select(collective::all_reduce, bytes, n, sec.apply(defaults));
  REQUIRE(after != before);

  tuning_file f;
  f.put(tuning_section{.name = "shm", .alpha = 0.9});
  f.put(sec);
  temp_file t("");
  tuning::write_tuning(t.path, f);
  tuning_env env(t.path);
  std::atomic<int> ok{0};
  loopback::world(n).run([&](loopback::communicator& comm) {
    CHECK(comm.tuning().alpha == *sec.alpha);
    CHECK(comm.tuning().beta == *sec.beta);
    CHECK(comm.tuning().chunk_bytes == defaults.chunk_bytes);
    std::vector<float> v(static_cast<std::size_t>(bytes / sizeof(float)), 1.0f);
    all_reduce(comm, std::span<float>(v), op::sum);
    CHECK(v.front() == static_cast<float>(n));
    const auto rows = trace::counters(comm);
    REQUIRE(rows.size() == 1);
    CHECK(rows[0].algo == after);
    // A split keeps the constants the world agreed on.
    auto half = comm.split(comm.rank() % 2, comm.rank());
    REQUIRE(half.has_value());
    CHECK(half->tuning().alpha == *sec.alpha);
    ++ok;
  });
  CHECK(ok == n);
}

TEST_CASE("RINGZERO_TUNING: without a section for the transport the defaults stay") {
  temp_file t("version = 1\n[shm]\nalpha = 0.9\n");
  tuning_env env(t.path);
  loopback::world(2).run([&](loopback::communicator& comm) {
    CHECK(comm.tuning().alpha == loopback::world_options{}.tuning.alpha);
  });
}

TEST_CASE("RINGZERO_TUNING: a file no rank can use is an error on every rank") {
  {
    tuning_env env("/nonexistent/ringzero.tuning");
    CHECK_THROWS_WITH_AS(loopback::world(3).run([](loopback::communicator&) {}),
                         doctest::Contains("/nonexistent/ringzero.tuning: cannot open"),
                         invalid_argument);
  }
  temp_file t("version = 1\n[loopback]\nalpha = slow\n");
  tuning_env env(t.path);
  const std::string says = t.path + ": line 3: alpha = 'slow' is not a number";
  CHECK_THROWS_WITH_AS(loopback::world(2).run([](loopback::communicator&) {}),
                       doctest::Contains(says.c_str()), invalid_argument);
}

TEST_CASE("agree_tuning: ranks that read differently all stop, naming the rank") {
  constexpr int n = 3;
  const tuning::policy defaults = loopback::world_options{}.tuning;
  tuning::tuning_outcome good;
  good.what = tuning::tuning_outcome::kind::applied;
  good.values = defaults;
  good.values.alpha = 1e-7;

  SUBCASE("one rank has other values") {
    std::atomic<int> mismatches{0};
    loopback::world(n).run([&](loopback::communicator& comm) {
      auto mine = good;
      if (comm.rank() == 2) mine.values.beta = 1e-9;
      try {
        (void)tuning::agree_tuning(comm, "shared.tuning", "loopback", mine);
      } catch (const mismatch_error& e) {
        const std::string m = e.what();
        CHECK(m.find("RINGZERO_TUNING=shared.tuning: rank 2 read [loopback]") != std::string::npos);
        ++mismatches;
      }
    });
    CHECK(mismatches == n);
  }
  SUBCASE("one rank measured another one-phase limit") {
    std::atomic<int> mismatches{0};
    loopback::world(n).run([&](loopback::communicator& comm) {
      auto mine = good;
      mine.values.one_phase_bytes = comm.rank() == 1 ? 8192 : 16384;
      mine.values.one_phase_ranks = 2;
      try {
        (void)tuning::agree_tuning(comm, "f", "loopback", mine);
      } catch (const mismatch_error& e) {
        CHECK(std::string(e.what()).find("one_phase_bytes 8192 at 2 ranks") != std::string::npos);
        ++mismatches;
      }
    });
    CHECK(mismatches == n);
  }
  SUBCASE("one rank has no section") {
    std::atomic<int> mismatches{0};
    loopback::world(n).run([&](loopback::communicator& comm) {
      auto mine = good;
      if (comm.rank() == 1) {
        mine.what = tuning::tuning_outcome::kind::no_section;
        mine.values = defaults;
      }
      try {
        (void)tuning::agree_tuning(comm, "f", "loopback", mine);
      } catch (const mismatch_error& e) {
        CHECK(std::string(e.what()).find("rank 1 read [loopback] as no section") !=
              std::string::npos);
        ++mismatches;
      }
    });
    CHECK(mismatches == n);
  }
  SUBCASE("one rank cannot read the file") {
    std::atomic<int> failures{0};
    loopback::world(n).run([&](loopback::communicator& comm) {
      auto mine = good;
      if (comm.rank() == 1) {
        mine.what = tuning::tuning_outcome::kind::failed;
        mine.error = "tuning file f: cannot open it: Permission denied";
      }
      try {
        (void)tuning::agree_tuning(comm, "f", "loopback", mine);
      } catch (const invalid_argument& e) {
        CHECK(std::string(e.what()).find("rank 1") != std::string::npos);
        CHECK(std::string(e.what()).find("Permission denied") != std::string::npos);
        ++failures;
      }
    });
    CHECK(failures == n);
  }
  SUBCASE("all agree") {
    loopback::world(n).run([&](loopback::communicator& comm) {
      CHECK(tuning::agree_tuning(comm, "f", "loopback", good).alpha == 1e-7);
    });
  }
}
