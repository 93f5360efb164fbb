// ringzero-run, driven as a user would: the launcher runs run_helper ranks and this test reads
// what comes out.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;

namespace {

using clock_type = std::chrono::steady_clock;

// One run of ringzero-run with its stdout and stderr captured.
class launch {
 public:
  explicit launch(std::vector<std::string> args) {
    args.insert(args.begin(), RINGZERO_RUN_EXE);
    int out[2], err[2];
    REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(err, O_CLOEXEC) == 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_adddup2(&fa, err[1], 2);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    REQUIRE(::posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ) == 0);
    posix_spawn_file_actions_destroy(&fa);
    ::close(out[1]);
    ::close(err[1]);
    fds_[0] = out[0];
    fds_[1] = err[0];
  }
  launch(const launch&) = delete;
  launch& operator=(const launch&) = delete;
  ~launch() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    for (int fd : fds_)
      if (fd >= 0) ::close(fd);
  }

  /// Reads until stdout holds `count` lines containing `what` (false on EOF or after 60 s).
  bool wait_for(const std::string& what, int count) {
    const auto deadline = clock_type::now() + std::chrono::seconds(60);
    while (occurrences(out_, what) < count) {
      if (clock_type::now() >= deadline || !pump(deadline)) return false;
    }
    return true;
  }

  void signal(int sig) const { ::kill(pid_, sig); }

  /// Reads everything and returns the launcher's wait status.
  int finish() {
    const auto deadline = clock_type::now() + std::chrono::seconds(120);
    while (pump(deadline)) {
    }
    int status = 0;
    REQUIRE(::waitpid(pid_, &status, 0) == pid_);
    pid_ = -1;
    return status;
  }

  [[nodiscard]] const std::string& out() const { return out_; }
  [[nodiscard]] const std::string& err() const { return err_; }

 private:
  static int occurrences(const std::string& s, const std::string& what) {
    int n = 0;
    for (std::size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
    return n;
  }

  // Reads what is available; false once both pipes are at end of file or the deadline passed.
  bool pump(clock_type::time_point deadline) {
    pollfd p[2];
    int n = 0;
    for (int fd : fds_)
      if (fd >= 0) p[n++] = {fd, POLLIN, 0};
    if (n == 0) return false;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now());
    if (left.count() <= 0) return false;
    if (::poll(p, static_cast<nfds_t>(n), static_cast<int>(left.count())) <= 0) return false;
    for (int i = 0; i < n; ++i) {
      if (p[i].revents == 0) continue;
      char buf[4096];
      const ssize_t got = ::read(p[i].fd, buf, sizeof buf);
      const int which = p[i].fd == fds_[0] ? 0 : 1;
      if (got <= 0) {
        ::close(fds_[which]);
        fds_[which] = -1;
      } else {
        (which == 0 ? out_ : err_).append(buf, static_cast<std::size_t>(got));
      }
    }
    return true;
  }

  pid_t pid_ = -1;
  int fds_[2] = {-1, -1};
  std::string out_, err_;
};

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

int exit_code(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

TEST_CASE("every rank gets the launch environment, and --tag-output lines its rank") {
  std::string first_token;
  for (int run = 0; run < 2; ++run) {
    launch l({"-n", "3", "--tag-output", RUN_HELPER_EXE, "env"});
    const int status = l.finish();
    INFO("stdout:\n", l.out(), "stderr:\n", l.err());
    REQUIRE(exit_code(status) == 0);
    const auto out = lines(l.out());
    REQUIRE(out.size() == 3);
    std::set<std::string> ports, tokens;
    for (int r = 0; r < 3; ++r) {
      const auto it = std::find_if(out.begin(), out.end(), [&](const std::string& s) {
        return s.starts_with(fmt::format("[{}] RANK={} ", r, r));
      });
      REQUIRE(it != out.end());
      std::istringstream words(it->substr(it->find(' ') + 1));
      std::string w;
      std::vector<std::string> fields;
      while (words >> w) fields.push_back(w);
      REQUIRE(fields.size() == 9);
      CHECK(fields[1] == "WORLD_SIZE=3");
      CHECK(fields[2] == fmt::format("LOCAL_RANK={}", r));
      CHECK(fields[3] == "LOCAL_WORLD_SIZE=3");
      CHECK(fields[4] == "MASTER_ADDR=127.0.0.1");
      CHECK(fields[7] == "launcher=ringzero-run");
      CHECK(fields[8] == "stdin=eof");
      ports.insert(fields[5]);
      tokens.insert(fields[6]);
      CHECK(contains(l.err(), fmt::format("[{}] stderr from {}\n", r, r)));
    }
    CHECK(ports.size() == 1);
    REQUIRE(tokens.size() == 1);
    const std::string token = tokens.begin()->substr(std::string("RINGZERO_TOKEN=").size());
    CHECK(token.size() == 32);
    if (run == 0)
      first_token = token;
    else
      CHECK(token != first_token);  // fresh per job
  }
}

TEST_CASE("lines written in pieces come out whole, never interleaved") {
  constexpr int ranks = 4, count = 150;
  launch l({"-n", std::to_string(ranks), "--tag-output", RUN_HELPER_EXE, "lines",
            std::to_string(count)});
  REQUIRE(exit_code(l.finish()) == 0);
  for (const std::string* stream : {&l.out(), &l.err()}) {
    const auto ls = lines(*stream);
    CHECK(ls.size() == static_cast<std::size_t>(ranks * count));
    std::vector<int> next(ranks, 0);
    for (const auto& line : ls) {
      int r = -1, i = -1;
      REQUIRE(std::sscanf(line.c_str(), "[%d] rank %*d line %d", &r, &i) == 2);
      REQUIRE(r >= 0);
      REQUIRE(r < ranks);
      CHECK(line == fmt::format("[{}] rank {} line {} part-b end", r, r,
                                next[static_cast<std::size_t>(r)]));
      ++next[static_cast<std::size_t>(r)];
    }
  }
}

TEST_CASE("a failing rank stops the job and is named") {
  {
    launch l({"-n", "3", "--tag-output", RUN_HELPER_EXE, "fail", "1", "7"});
    const int status = l.finish();
    INFO("stderr:\n", l.err());
    CHECK(exit_code(status) == 7);
    CHECK(contains(l.err(), "ringzero-run: rank 1 (pid "));
    CHECK(contains(l.err(), "exited with status 7; stopping the other ranks"));
    CHECK(contains(l.out(), "[1] rank 1 failing\n"));
  }
  {
    launch l({"-n", "2", RUN_HELPER_EXE, "crash", "0"});
    const int status = l.finish();
    INFO("stderr:\n", l.err());
    CHECK(exit_code(status) == 128 + SIGKILL);
    CHECK(contains(l.err(), "rank 0 (pid "));
    CHECK(contains(l.err(), "was killed by signal 9"));
  }
}

TEST_CASE("SIGTERM and SIGINT reach every rank") {
  for (int sig : {SIGTERM, SIGINT}) {
    CAPTURE(sig);
    launch l({"-n", "3", "--tag-output", RUN_HELPER_EXE, "wait"});
    REQUIRE(l.wait_for("ready", 3));
    l.signal(sig);
    const int status = l.finish();
    INFO("stdout:\n", l.out(), "stderr:\n", l.err());
    CHECK(exit_code(status) == 128 + sig);
    for (int r = 0; r < 3; ++r)
      CHECK(contains(l.out(), fmt::format("[{}] rank {} got signal {}\n", r, r, sig)));
  }
}

TEST_CASE("ranks that ignore SIGTERM are killed after the grace period") {
  launch l({"-n", "2", "--grace", "0.3", RUN_HELPER_EXE, "ignore"});
  REQUIRE(l.wait_for("ready", 2));
  l.signal(SIGTERM);
  const int status = l.finish();
  INFO("stderr:\n", l.err());
  CHECK(exit_code(status) == 128 + SIGTERM);
  CHECK(contains(l.err(), "rank(s) 0, 1 still running"));
}

TEST_CASE("--timeout stops a job that runs too long") {
  launch l({"-n", "2", "--timeout", "0.5", "--", RUN_HELPER_EXE, "sleep", "60"});
  const int status = l.finish();
  INFO("stderr:\n", l.err());
  CHECK(exit_code(status) == 124);
  CHECK(contains(l.err(), "ran past --timeout 0.5 s"));
}

TEST_CASE("ranks rendezvous through the store the environment describes") {
  launch l({"-n", "4", "--tag-output", RUN_HELPER_EXE, "store"});
  const int status = l.finish();
  INFO("stdout:\n", l.out(), "stderr:\n", l.err());
  CHECK(exit_code(status) == 0);
  for (int r = 0; r < 4; ++r)
    CHECK(contains(l.out(), fmt::format("[{}] rank {} sum 14 seen 2345\n", r, r)));
}

TEST_CASE("into a pipe, lines come out untouched unless --tag-output asks") {
  for (const char* flag : {"", "--no-tag-output"}) {
    CAPTURE(flag);
    std::vector<std::string> args{"-n", "3"};
    if (*flag != '\0') args.emplace_back(flag);
    args.insert(args.end(), {RUN_HELPER_EXE, "env"});
    launch l(args);
    REQUIRE(exit_code(l.finish()) == 0);
    INFO("stdout:\n", l.out(), "stderr:\n", l.err());
    const auto out = lines(l.out());
    REQUIRE(out.size() == 3);
    for (int r = 0; r < 3; ++r) {
      // Exactly what the rank wrote: a parser anchored at the start of the line still matches.
      CHECK(std::count_if(out.begin(), out.end(), [&](const std::string& s) {
              return s.starts_with(fmt::format("RANK={} WORLD_SIZE=3 ", r));
            }) == 1);
      CHECK(contains(l.err(), fmt::format("stderr from {}\n", r)));
    }
    CHECK_FALSE(contains(l.out(), "["));
    CHECK_FALSE(contains(l.err(), "["));
  }
}

TEST_CASE("on a terminal, lines carry their rank by default") {
  // stdout is a pseudo-terminal, as in an interactive shell; stderr stays a pipe.
  const int master = ::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
  REQUIRE(master >= 0);
  REQUIRE(::grantpt(master) == 0);
  REQUIRE(::unlockpt(master) == 0);
  const int tty = ::open(::ptsname(master), O_RDWR | O_NOCTTY | O_CLOEXEC);
  REQUIRE(tty >= 0);
  int err[2];
  REQUIRE(::pipe2(err, O_CLOEXEC) == 0);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, tty, 1);
  posix_spawn_file_actions_adddup2(&fa, err[1], 2);
  std::string exe = RINGZERO_RUN_EXE, helper = RUN_HELPER_EXE, n = "-n", three = "3", mode = "env";
  char* argv[] = {exe.data(), n.data(), three.data(), helper.data(), mode.data(), nullptr};
  pid_t pid = -1;
  REQUIRE(::posix_spawn(&pid, argv[0], &fa, nullptr, argv, environ) == 0);
  posix_spawn_file_actions_destroy(&fa);
  ::close(tty);
  ::close(err[1]);
  std::string out, errs;
  char buf[4096];
  for (ssize_t got; (got = ::read(err[0], buf, sizeof buf)) > 0;)
    errs.append(buf, static_cast<std::size_t>(got));
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  // The terminal keeps what was written after the writer is gone; read it without blocking.
  ::fcntl(master, F_SETFL, O_NONBLOCK);
  for (ssize_t got; (got = ::read(master, buf, sizeof buf)) > 0;)
    out.append(buf, static_cast<std::size_t>(got));
  ::close(master);
  ::close(err[0]);
  INFO("terminal:\n", out, "stderr:\n", errs);
  CHECK(exit_code(status) == 0);
  for (int r = 0; r < 3; ++r) {
    CHECK(contains(out, fmt::format("[{}] RANK={} ", r, r)));
    // The pipe is decided on its own: untagged.
    CHECK(contains(errs, fmt::format("stderr from {}\n", r)));
  }
  CHECK_FALSE(contains(errs, "["));
}

TEST_CASE("--output DIR writes each rank's output to DIR/rank<R>.log") {
  char tmpl[] = "/tmp/ringzero-run-output-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::filesystem::path dir = std::filesystem::path(tmpl) / "logs";
  {
    launch l({"-n", "3", "--tag-output", "--output", dir.string(), RUN_HELPER_EXE, "env"});
    REQUIRE(exit_code(l.finish()) == 0);
    // The console still shows every rank, tagged as asked.
    for (int r = 0; r < 3; ++r) CHECK(contains(l.out(), fmt::format("[{}] RANK={} ", r, r)));
  }
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    std::ifstream in(dir / fmt::format("rank{}.log", r));
    REQUIRE(in.good());
    std::stringstream text;
    text << in.rdbuf();
    const auto ls = lines(text.str());
    // Its own stdout and stderr lines, untagged, and no other rank's.
    REQUIRE(ls.size() == 2);
    CHECK(std::count_if(ls.begin(), ls.end(), [&](const std::string& s) {
            return s.starts_with(fmt::format("RANK={} WORLD_SIZE=3 ", r));
          }) == 1);
    CHECK(std::count(ls.begin(), ls.end(), fmt::format("stderr from {}", r)) == 1);
  }
  std::error_code ec;
  std::filesystem::remove_all(tmpl, ec);
  {
    launch l({"-n", "2", "--output", "/proc/no-such-dir/logs", RUN_HELPER_EXE, "env"});
    CHECK(exit_code(l.finish()) == 1);
    CHECK(contains(l.err(), "--output /proc/no-such-dir/logs"));
  }
}

TEST_CASE("--elastic: a rank that dies does not stop the others, and the summary says so") {
  {
    launch l({"-n", "3", "--elastic", "2:3", RUN_HELPER_EXE, "elastic", "1"});
    const int status = l.finish();
    INFO("stdout:\n", l.out(), "stderr:\n", l.err());
    CHECK(exit_code(status) == 0);
    CHECK(contains(l.err(), "rank 1 (pid "));
    CHECK(contains(l.err(), "was killed by signal 9"));
    CHECK(contains(l.err(), "generation 1 formed at"));
    CHECK(contains(l.err(), "elastic job (2:3): 3 ranks started, 1 lost"));
    CHECK(contains(l.err(), "generation 1: 2 ranks (members 0,2); helper formed it"));
    CHECK(contains(l.out(), "member 0 gen 1 rank 0 size 2 lost 1\n"));
    CHECK(contains(l.out(), "member 2 gen 1 rank 1 size 2 lost 1\n"));
  }
  {
    // Below the minimum: the survivor fails naming the lost member, and the job exits with the
    // launcher's own status for an elastic job that did not finish (before: 137, the killed
    // rank's).
    launch l({"-n", "2", "--elastic", "2:2", RUN_HELPER_EXE, "elastic", "0"});
    const int status = l.finish();
    INFO("stderr:\n", l.err());
    CHECK(exit_code(status) == 3);
    CHECK(contains(l.err(), "below the minimum of 2"));
    CHECK(contains(l.err(), "lost: 0"));
    CHECK(contains(l.err(), "the elastic job ended without finishing (exit status 3)"));
  }
}

TEST_CASE("--elastic: a stopped member is declared lost by the job's heartbeat and ended") {
  // Member 1 stops itself (SIGSTOP). Before, nothing found it (the heartbeat acted only while
  // the ranks met) and the launcher waited for it forever.
  const auto t0 = clock_type::now();
  ::setenv("RINGZERO_ELASTIC_SETTLE", "1", 1);
  launch l({"-n", "3", "--elastic", "2:3", RUN_HELPER_EXE, "silent", "1"});
  const int status = l.finish();
  ::unsetenv("RINGZERO_ELASTIC_SETTLE");
  const double took = std::chrono::duration<double>(clock_type::now() - t0).count();
  INFO("stdout:\n", l.out(), "stderr:\n", l.err(), "took ", took, " s");
  CHECK(exit_code(status) == 0);
  CHECK(contains(l.err(), "has not beaten for"));
  CHECK(contains(l.err(), "rank 1 (pid "));
  CHECK(contains(l.err(), "was declared lost by the job (it is stopped"));
  CHECK(contains(l.out(), "member 0 gen 1 size 2 lost 1\n"));
  CHECK(contains(l.out(), "member 2 gen 1 size 2 lost 1\n"));
  CHECK(took < 30);
}

TEST_CASE("a stopped rank is named as the culprit, and continued so that it ends") {
  // Rank 1 stops itself; rank 2 gives up on it. Before, the launcher named rank 2 and waited out
  // the grace period (20 s here) on the stopped rank before killing it.
  const auto t0 = clock_type::now();
  launch l({"-n", "3", "--grace", "20", RUN_HELPER_EXE, "stop", "1", "2"});
  REQUIRE(l.wait_for("rank 1 stopping", 1));
  const int status = l.finish();
  const double took = std::chrono::duration<double>(clock_type::now() - t0).count();
  INFO("stdout:\n", l.out(), "stderr:\n", l.err(), "took ", took, " s");
  CHECK(exit_code(status) == 1);
  CHECK(contains(l.err(), "rank 1 (pid "));
  CHECK(contains(l.err(), "is stopped (SIGSTOP or a debugger); rank 2 (pid "));
  CHECK(took < 10);
}

TEST_CASE("--redirect DIR: the ranks' lines go to DIR/rank<R>.log only") {
  char tmpl[] = "/tmp/ringzero-run-redirect-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  {
    launch l({"-n", "2", "--redirect", tmpl, RUN_HELPER_EXE, "lines", "2"});
    REQUIRE(exit_code(l.finish()) == 0);
    CHECK(l.out().empty());
    CHECK_FALSE(contains(l.err(), "line"));
  }
  for (int r = 0; r < 2; ++r) {
    std::ifstream in(std::filesystem::path(tmpl) / fmt::format("rank{}.log", r));
    std::stringstream text;
    text << in.rdbuf();
    CHECK(lines(text.str()).size() == 4);  // two lines on each of stdout and stderr
  }
  std::error_code ec;
  std::filesystem::remove_all(tmpl, ec);
}

TEST_CASE("usage") {
  {
    launch l({"-n", "2", "--elastic", "4:2", RUN_HELPER_EXE});
    CHECK(exit_code(l.finish()) == 2);
    CHECK(contains(l.err(), "MIN is above MAX"));
  }
  {
    launch l({"-n", "2", "--job-file", "x", RUN_HELPER_EXE});
    CHECK(exit_code(l.finish()) == 2);
    CHECK(contains(l.err(), "--job-file needs --elastic"));
  }
  {
    launch l({"-n", "5", "--elastic", "2:4", RUN_HELPER_EXE});
    CHECK(exit_code(l.finish()) == 2);
    CHECK(contains(l.err(), "above the --elastic maximum"));
  }
  {
    // Before: accepted, and the ranks failed with "only 2 members remain ... (lost: )".
    launch l({"-n", "2", "--elastic", "4:8", RUN_HELPER_EXE});
    CHECK(exit_code(l.finish()) == 2);
    CHECK(contains(l.err(), "-n 2 is below the --elastic minimum 4"));
  }
  {
    launch l({"-n", "1", "--join", "/nonexistent/job", RUN_HELPER_EXE});
    CHECK(exit_code(l.finish()) == 1);
    CHECK(contains(l.err(), "--join /nonexistent/job"));
  }
  {
    launch l({"--help"});
    CHECK(exit_code(l.finish()) == 0);
    CHECK(l.out().starts_with("usage: ringzero-run -n N"));
  }
  {
    launch l({RUN_HELPER_EXE, "env"});
    CHECK(exit_code(l.finish()) == 2);
    CHECK(contains(l.err(), "-n N (the number of ranks) is required"));
  }
  {
    launch l({"-n", "0", RUN_HELPER_EXE});
    CHECK(exit_code(l.finish()) == 2);
  }
  {
    launch l({"-n2", "--bogus", RUN_HELPER_EXE});
    CHECK(exit_code(l.finish()) == 2);
    CHECK(contains(l.err(), "unknown option '--bogus'"));
  }
  {
    launch l({"-n", "2", "/nonexistent/program"});
    CHECK(exit_code(l.finish()) == 127);
    CHECK(contains(l.err(), "cannot start '/nonexistent/program'"));
  }
}
