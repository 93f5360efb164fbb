// A rank for ringzero-run's tests: `run_helper MODE [ARGS]` behaves as the test needs.
//   env            print the launch variables (stdout) and a line on stderr
//   lines N        N lines on stdout and stderr, each written in three pieces
//   fail R CODE    rank R exits with CODE; the others wait to be stopped
//   crash R        rank R kills itself with SIGKILL; the others wait to be stopped
//   wait           print "ready", then report the signal that ends the wait
//   ignore         ignore SIGTERM, print "ready" and wait to be killed
//   sleep S        sleep S seconds
//   store          rendezvous through the store detect_launch() and make_store() find
//   elastic V      join the elastic job; member V kills itself with SIGKILL, the others form the
//                  next generation without it and print what they see
//   silent V       join the elastic job; member V stops itself (SIGSTOP); the others wait until
//                  the job declares it lost (the heartbeat), then form the next generation
//   stop R F       rank R stops itself (SIGSTOP); rank F exits 1 a moment later, as a rank whose
//                  wait gave up on R would; the others wait to be stopped
#include <signal.h>
#include <unistd.h>

#include <fmt/core.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <thread>

#include "ringzero/bootstrap/environment.hpp"
#include "ringzero/bootstrap/rendezvous.hpp"
#include "ringzero/elastic.hpp"
#include "ringzero/error.hpp"

namespace {

volatile sig_atomic_t got_signal = 0;

extern "C" void remember(int sig) {
  got_signal = sig;
}

void put(int fd, std::string_view s) {
  while (!s.empty()) {
    const ssize_t n = ::write(fd, s.data(), s.size());
    if (n <= 0) return;
    s.remove_prefix(static_cast<std::size_t>(n));
  }
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "<unset>";
}

[[noreturn]] void wait_forever() {
  for (;;) ::pause();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const int rank = std::atoi(env("RANK").c_str());
  if (mode == "env") {
    const auto li = ringzero::bootstrap::detect_launch();
    put(1, fmt::format("RANK={} WORLD_SIZE={} LOCAL_RANK={} LOCAL_WORLD_SIZE={} MASTER_ADDR={} "
                       "MASTER_PORT={} RINGZERO_TOKEN={} launcher={} stdin={}\n",
                       env("RANK"), env("WORLD_SIZE"), env("LOCAL_RANK"), env("LOCAL_WORLD_SIZE"),
                       env("MASTER_ADDR"), env("MASTER_PORT"), env("RINGZERO_TOKEN"), li.launcher,
                       std::getchar() == EOF ? "eof" : "data"));
    put(2, fmt::format("stderr from {}\n", rank));
    return 0;
  }
  if (mode == "lines" && argc > 2) {
    const int n = std::atoi(argv[2]);
    for (int i = 0; i < n; ++i)
      for (int fd : {1, 2}) {
        put(fd, fmt::format("rank {} line {} ", rank, i));
        std::this_thread::yield();
        put(fd, "part-b ");
        std::this_thread::yield();
        put(fd, "end\n");
      }
    return 0;
  }
  if ((mode == "fail" && argc > 3) || (mode == "crash" && argc > 2)) {
    if (rank == std::atoi(argv[2])) {
      put(1, fmt::format("rank {} failing\n", rank));
      if (mode == "fail") return std::atoi(argv[3]);
      ::kill(::getpid(), SIGKILL);
    }
    put(1, fmt::format("rank {} waiting\n", rank));
    wait_forever();
  }
  if (mode == "wait") {
    struct sigaction sa {};
    sa.sa_handler = remember;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGTERM, &sa, nullptr);
    ::sigaction(SIGINT, &sa, nullptr);
    // Blocked until sigsuspend, so a signal cannot slip in between the check and the wait.
    sigset_t both, none;
    sigemptyset(&both);
    sigaddset(&both, SIGTERM);
    sigaddset(&both, SIGINT);
    sigemptyset(&none);
    ::sigprocmask(SIG_BLOCK, &both, nullptr);
    put(1, fmt::format("rank {} ready\n", rank));
    while (got_signal == 0) ::sigsuspend(&none);
    put(1, fmt::format("rank {} got signal {}\n", rank, static_cast<int>(got_signal)));
    return 0;
  }
  if (mode == "ignore") {
    ::signal(SIGTERM, SIG_IGN);
    put(1, fmt::format("rank {} ready\n", rank));
    wait_forever();
  }
  if (mode == "sleep" && argc > 2) {
    std::this_thread::sleep_for(std::chrono::duration<double>(std::atof(argv[2])));
    return 0;
  }
  if (mode == "elastic" && argc > 2) {
    try {
      auto s = ringzero::elastic::session::from_env();
      const auto& m0 = s.join();
      put(1, fmt::format("member {} gen {} rank {} size {}\n", s.id(), m0.generation, m0.rank,
                         m0.size()));
      if (s.id() == std::atoi(argv[2])) ::kill(::getpid(), SIGKILL);
      const auto& m1 = s.shrink(-1);
      put(1, fmt::format("member {} gen {} rank {} size {} lost {}\n", s.id(), m1.generation,
                         m1.rank, m1.size(), m1.lost.empty() ? -1 : m1.lost[0]));
      if (m1.rank == 0) s.record("helper formed it");
      return 0;
    } catch (const std::exception& e) {
      put(2, fmt::format("member failed: {}\n", e.what()));
      return 3;
    }
  }
  if (mode == "silent" && argc > 2) {
    try {
      using keys = ringzero::elastic::session::keys;
      auto s = ringzero::elastic::session::from_env();
      s.join();
      const std::int64_t victim = std::atoi(argv[2]);
      if (s.id() == victim) ::raise(SIGSTOP);
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (s.job_store().add(keys::dead(victim), 0) == 0) {
        if (std::chrono::steady_clock::now() > until)
          throw ringzero::timeout_error("not declared lost", -1);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      const auto& m = s.shrink(-1);
      put(1, fmt::format("member {} gen {} size {} lost {}\n", s.id(), m.generation, m.size(),
                         m.lost.empty() ? -1 : m.lost[0]));
      return 0;
    } catch (const std::exception& e) {
      put(2, fmt::format("member failed: {}\n", e.what()));
      return 3;
    }
  }
  if (mode == "stop" && argc > 3) {
    if (rank == std::atoi(argv[2])) {
      put(1, fmt::format("rank {} stopping\n", rank));
      ::raise(SIGSTOP);
      put(1, fmt::format("rank {} continued\n", rank));
      wait_forever();
    }
    if (rank == std::atoi(argv[3])) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      put(1, fmt::format("rank {} gives up\n", rank));
      return 1;
    }
    wait_forever();
  }
  if (mode == "store") {
    // Several stores one after another, as a trainer building several communicators would.
    const auto li = ringzero::bootstrap::detect_launch();
    std::string line;
    for (int round = 0; round < 3; ++round) {
      auto store = ringzero::bootstrap::make_store(li, std::chrono::seconds(60));
      store->add("sum", li.rank + round);
      store->set_string(fmt::format("rank/{}", li.rank), std::to_string(li.rank + round));
      store->barrier("all", li.world_size);
      std::string seen;
      for (int r = 0; r < li.world_size; ++r) seen += store->get_string(fmt::format("rank/{}", r));
      line = fmt::format("rank {} sum {} seen {}\n", li.rank, store->get_string("sum"), seen);
    }
    put(1, line);
    return 0;
  }
  put(2, fmt::format("run_helper: unknown mode '{}'\n", mode));
  return 2;
}
