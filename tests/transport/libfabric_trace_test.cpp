// RINGZERO_TRACE across processes over libfabric shm: a rank that SIGKILLs itself mid-run leaves
// a file that still parses, and the survivors' files record the call that failed.
#include <doctest/doctest.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "analysis.hpp"
#include "multiprocess.hpp"
#include "ringzero/ringzero.hpp"
#include "ringzero/transport/libfabric.hpp"
#include "trace_file.hpp"

using namespace std::chrono_literals;
namespace fabric = ringzero::libfabric;
namespace tt = ringzero::trace_tool;

TEST_CASE("a rank killed mid-run over libfabric shm leaves a trace that still parses") {
  char tmpl[] = "/tmp/ringzero-trace-kill-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::filesystem::path dir(tmpl);
  ::setenv("RINGZERO_TRACE", dir.c_str(), 1);
  auto out = multiprocess::run(3, 120s, [&](int r, int n, ringzero::bootstrap::store& s) {
    fabric::communicator comm(fabric::transport(s, r, n, {.provider = "shm"}));
    std::vector<float> v(1024, 1.0f);
    for (int i = 0; i < 5; ++i) ringzero::all_reduce(comm, std::span<float>(v), ringzero::op::sum);
    ringzero::barrier(comm);
    if (r == 1) ::kill(::getpid(), SIGKILL);
    try {
      // Rank 1 is gone: this fails (timeout or peer error) instead of hanging.
      ringzero::all_reduce(comm, std::span<float>(v), ringzero::op::sum, {.timeout = 2s});
      return 3;
    } catch (const ringzero::error&) {
      return 0;
    }
  });
  ::unsetenv("RINGZERO_TRACE");
  INFO(out.describe());
  CHECK(out.status == std::vector<int>{0, -SIGKILL, 0});

  const auto files = tt::read_inputs({dir.string()});
  REQUIRE(files.size() == 3);
  for (const auto& f : files) {
    CAPTURE(f.path);
    std::vector<const tt::json*> calls;
    for (const auto& e : f.events)
      if (e.string_or("cat", "") == "collective") calls.push_back(&e);
    if (f.rank == 1) {
      // Killed: no closing bracket, and exactly the calls it finished.
      CHECK_FALSE(f.closed);
      CHECK(calls.size() == 6);
    } else {
      // Survivors closed their files; the failed call is recorded as such.
      CHECK(f.closed);
      REQUIRE(calls.size() == 7);
      const tt::json* args = calls.back()->find("args");
      REQUIRE(args != nullptr);
      const tt::json* failed = args->find("error");
      CHECK((failed != nullptr && failed->b));
    }
  }
  // Merging and reporting work on what the killed rank left.
  CHECK_NOTHROW((void)tt::parse_json(tt::merge(files)));
  const auto kinds = tt::straggler_summary(files);
  CHECK_FALSE(kinds.empty());
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}
