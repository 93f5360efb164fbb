// Ranks as forked processes, for transports whose ranks must be processes. The parent forks
// one child per rank before it touches the transport itself, gives them a file_store in a
// fresh directory, and waits for all of them within a deadline (killing the rest when it
// passes).
// A child reports failures on stderr and through its exit code (rank_checks): doctest's checks do
// not travel back across fork; the parent checks the outcome (require_all_passed).
#pragma once

#include <doctest/doctest.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/core.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "checks.hpp"
#include "ringzero/bootstrap/file_store.hpp"
#include "ringzero/bootstrap/store.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"

namespace multiprocess {

using test_support::contains;

/// How each rank ended: its exit code, or -signal if a signal killed it.
struct outcome {
  std::vector<int> status;
  bool timed_out = false;

  [[nodiscard]] bool all_passed() const {
    for (int s : status)
      if (s != 0) return false;
    return !timed_out;
  }
  [[nodiscard]] std::string describe() const {
    std::string s;
    for (std::size_t r = 0; r < status.size(); ++r)
      s += fmt::format("rank {}: {}; ", r,
                       status[r] == 0  ? std::string("passed")
                       : status[r] < 0 ? fmt::format("killed by signal {}", -status[r])
                                       : fmt::format("exit code {}", status[r]));
    if (timed_out) s += "the run passed its deadline and was killed";
    return s;
  }
};

/// A failed check inside a rank: printed there, and the rank's exit code says so.
struct rank_checks {
  int rank;
  int failures = 0;
  void expect(bool ok, const std::string& what) {
    if (ok) return;
    std::fprintf(stderr, "rank %d: expected %s\n", rank, what.c_str());
    ++failures;
  }
  [[nodiscard]] int code() const { return failures ? 1 : 0; }
};

/// Exit code of a rank that could not set up what its test needs (become_host()): the parent
/// skips the test when every rank returns it.
inline constexpr int rank_skipped = 77;

/// Gives this process a host name of its own, in a UTS namespace of its own, so that ranks of
/// one machine form several "nodes" (host_of() differs). Call it in a rank before anything
/// reads the host name. False where the process may not (it needs CAP_SYS_ADMIN).
[[nodiscard]] inline bool become_host(const std::string& name) {
  if (::unshare(CLONE_NEWUTS) != 0 || ::sethostname(name.data(), name.size()) != 0) return false;
  // ringzero reads the name once per process: a parent that read it before forking left its own.
  if (ringzero::log::detail::host_name() != name)
    throw ringzero::bootstrap_error(
        fmt::format("become_host({}): this process already read its host name ({})", name,
                    ringzero::log::detail::host_name()));
  return true;
}

/// The parent's check that every rank passed, with how each one ended when one did not.
inline void require_all_passed(const outcome& out) {
  INFO(out.describe());
  CHECK(out.all_passed());
}

/// Runs f() with the log raised to INFO and stderr sent to a file, and returns what was logged
/// (stderr restored). For a rank that must check what it logs: the log only goes to stderr.
/// The file is named after `name` and the process, so ranks and tests do not share one.
template <class F>
std::string capture_info_log(const std::string& name, F&& f) {
  const std::string log_path = fmt::format("ringzero-{}-{}.log", name, ::getpid());
  std::fflush(stderr);
  const int saved = ::dup(2);
  if (saved < 0 || !std::freopen(log_path.c_str(), "w", stderr))
    throw ringzero::bootstrap_error("could not send stderr to " + log_path);
  const auto quiet =
      static_cast<ringzero::log::level>(ringzero::log::detail::current_level().load());
  ringzero::log::set_level(ringzero::log::level::info);
  f();
  ringzero::log::set_level(quiet);
  std::fflush(stderr);
  std::ifstream file(log_path);
  std::stringstream log;
  log << file.rdbuf();
  std::remove(log_path.c_str());
  ::dup2(saved, 2);
  ::close(saved);
  return log.str();
}

/// Forks n ranks running f(rank, n, store) -> exit code (an exception is exit code 1, its
/// message on stderr) and waits up to `limit` for all of them.
template <class F>
outcome run(int n, std::chrono::seconds limit, F f) {
  char tmpl[] = "/tmp/ringzero-store-XXXXXX";
  if (!::mkdtemp(tmpl)) throw ringzero::bootstrap_error("mkdtemp failed");
  const std::filesystem::path dir(tmpl);
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) throw ringzero::bootstrap_error("fork failed");
    if (pid == 0) {
      // A rank that is told to stop just stops: the test framework's handlers stay with the
      // parent.
      ::signal(SIGTERM, SIG_DFL);
      ::signal(SIGINT, SIG_DFL);
      int code = 0;
      try {
        ringzero::log::detail::process_rank().store(r);
        ringzero::bootstrap::file_store store(dir, limit);
        code = f(r, n, static_cast<ringzero::bootstrap::store&>(store));
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        code = 1;
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  outcome out;
  out.status.assign(static_cast<std::size_t>(n), 0);
  std::vector<bool> reaped(static_cast<std::size_t>(n), false);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int left = n;
  while (left > 0) {
    for (int r = 0; r < n; ++r) {
      if (reaped[static_cast<std::size_t>(r)]) continue;
      int st = 0;
      if (::waitpid(pids[static_cast<std::size_t>(r)], &st, WNOHANG) <= 0) continue;
      reaped[static_cast<std::size_t>(r)] = true;
      --left;
      out.status[static_cast<std::size_t>(r)] =
          WIFEXITED(st) ? WEXITSTATUS(st) : -(WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      out.timed_out = true;
      for (int r = 0; r < n; ++r)
        if (!reaped[static_cast<std::size_t>(r)])
          ::kill(pids[static_cast<std::size_t>(r)], SIGKILL);
      for (int r = 0; r < n; ++r)
        if (!reaped[static_cast<std::size_t>(r)]) {
          int st = 0;
          ::waitpid(pids[static_cast<std::size_t>(r)], &st, 0);
          out.status[static_cast<std::size_t>(r)] = -SIGKILL;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return out;
}

}  // namespace multiprocess
