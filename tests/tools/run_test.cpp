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

TEST_CASE("every rank gets the launch environment, and its output lines its rank") {
  std::string first_token;
  for (int run = 0; run < 2; ++run) {
    launch l({"-n", "3", RUN_HELPER_EXE, "env"});
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
  launch l({"-n", std::to_string(ranks), RUN_HELPER_EXE, "lines", std::to_string(count)});
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
    launch l({"-n", "3", RUN_HELPER_EXE, "fail", "1", "7"});
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
    launch l({"-n", "3", RUN_HELPER_EXE, "wait"});
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
  launch l({"-n", "4", RUN_HELPER_EXE, "store"});
  const int status = l.finish();
  INFO("stdout:\n", l.out(), "stderr:\n", l.err());
  CHECK(exit_code(status) == 0);
  for (int r = 0; r < 4; ++r)
    CHECK(contains(l.out(), fmt::format("[{}] rank {} sum 14 seen 2345\n", r, r)));
}

TEST_CASE("usage") {
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
