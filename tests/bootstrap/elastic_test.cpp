// elastic::session's membership protocol, with members as threads over one file_store: who is
// in each generation, what rank each gets, who is lost or arrived, and the clear failures
// (below the minimum, left out).
#include <doctest/doctest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ringzero/bootstrap/file_store.hpp"
#include "ringzero/elastic.hpp"

namespace rb = ringzero::bootstrap;
namespace re = ringzero::elastic;
using namespace std::chrono_literals;

namespace {

struct temp_dir {
  std::filesystem::path path;
  temp_dir() {
    char tmpl[] = "/tmp/ringzero-elastic-XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() { std::filesystem::remove_all(path); }
};

re::limits bounds(int min, int max, std::function<bool(int)> allowed = {}) {
  re::limits l;
  l.min = min;
  l.max = max;
  if (allowed) l.allowed = std::move(allowed);
  return l;
}

// Runs body(id, session) for every id on its own thread; each thread's outcome is kept.
struct outcome {
  std::optional<re::membership> m;
  std::string error;
};

std::map<std::int64_t, outcome> run_all(const std::vector<std::int64_t>& ids,
                                        const std::function<re::membership(std::int64_t)>& body) {
  std::map<std::int64_t, outcome> out;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (const std::int64_t id : ids)
    threads.emplace_back([&, id] {
      outcome o;
      try {
        o.m = body(id);
      } catch (const ringzero::error& e) {
        o.error = e.what();
      }
      std::lock_guard lock(mu);
      out[id] = std::move(o);
    });
  for (auto& t : threads) t.join();
  return out;
}

std::shared_ptr<rb::store> open(const temp_dir& d) {
  return std::make_shared<rb::file_store>(d.path / "store", 20s);
}

}  // namespace

TEST_CASE("elastic limits parse MIN:MAX, N and MIN:, and refuse the rest") {
  CHECK(re::parse_limits("2:4").min == 2);
  CHECK(re::parse_limits("2:4").max == 4);
  CHECK(re::parse_limits("3").min == 3);
  CHECK(re::parse_limits("3").max == 3);
  CHECK(re::parse_limits("2:").max == INT_MAX);
  for (const char* bad : {"", "0:2", "4:2", "a:b", "2:x", "-1:3", ":3"})
    CHECK_THROWS_AS(static_cast<void>(re::parse_limits(bad)), ringzero::invalid_argument);
}

TEST_CASE("elastic: generation 0 gives the initial members ranks in id order") {
  temp_dir d;
  auto st = open(d);
  const auto out = run_all({0, 1, 2, 3}, [&](std::int64_t id) {
    re::session s(st, id, 4, bounds(1, 4), 5s);
    return s.join();
  });
  for (const auto& [id, result] : out) {
    const auto& o = result;  // REQUIRE_MESSAGE's lambda captures a variable, not a binding
    REQUIRE_MESSAGE(o.m, o.error);
    CHECK(o.m->generation == 0);
    CHECK(o.m->rank == id);
    CHECK(o.m->members == std::vector<std::int64_t>{0, 1, 2, 3});
  }
}

TEST_CASE("elastic: survivors of a death form the next generation, rank 0 included") {
  for (const std::int64_t victim : {0, 1, 3}) {
    CAPTURE(victim);
    temp_dir d;
    auto st = open(d);
    std::vector<std::int64_t> alive;
    for (std::int64_t i = 0; i < 4; ++i)
      if (i != victim) alive.push_back(i);
    // Generation 0 first, all four; then the victim stops, and the others are told which rank
    // failed (as a collective's error tells them), except one that learns nothing.
    std::vector<std::unique_ptr<re::session>> s(4);
    run_all({0, 1, 2, 3}, [&](std::int64_t id) {
      s[static_cast<std::size_t>(id)] = std::make_unique<re::session>(st, id, 4, bounds(2, 4), 20s);
      return s[static_cast<std::size_t>(id)]->join();
    });
    const auto out = run_all(alive, [&](std::int64_t id) {
      const int hint = id == alive.back() ? -1 : static_cast<int>(victim);
      return s[static_cast<std::size_t>(id)]->shrink(hint);
    });
    for (std::size_t k = 0; k < alive.size(); ++k) {
      const auto& o = out.at(alive[k]);
      REQUIRE_MESSAGE(o.m, o.error);
      CHECK(o.m->generation == 1);
      CHECK(o.m->members == alive);
      CHECK(o.m->rank == static_cast<int>(k));
      CHECK(o.m->lost == std::vector<std::int64_t>{victim});
      CHECK(o.m->arrived.empty());
      // Everyone named the victim or saw it marked: nobody waited for the settle time.
      CHECK(o.m->formed_in < 10s);
    }
  }
}

TEST_CASE("elastic: a death nobody names is settled after the settle time") {
  temp_dir d;
  auto st = open(d);
  std::vector<std::unique_ptr<re::session>> s(3);
  run_all({0, 1, 2}, [&](std::int64_t id) {
    s[static_cast<std::size_t>(id)] = std::make_unique<re::session>(st, id, 3, bounds(1, 3), 300ms);
    return s[static_cast<std::size_t>(id)]->join();
  });
  const auto out =
      run_all({0, 2}, [&](std::int64_t id) { return s[static_cast<std::size_t>(id)]->shrink(-1); });
  for (const std::int64_t id : {0, 2}) {
    const auto& o = out.at(id);
    REQUIRE_MESSAGE(o.m, o.error);
    CHECK(o.m->members == std::vector<std::int64_t>{0, 2});
    CHECK(o.m->lost == std::vector<std::int64_t>{1});
    CHECK(o.m->formed_in >= 300ms);
  }
}

TEST_CASE("elastic: below the minimum every survivor fails, naming the lost members") {
  temp_dir d;
  auto st = open(d);
  std::vector<std::unique_ptr<re::session>> s(4);
  run_all({0, 1, 2, 3}, [&](std::int64_t id) {
    s[static_cast<std::size_t>(id)] = std::make_unique<re::session>(st, id, 4, bounds(3, 4), 20s);
    return s[static_cast<std::size_t>(id)]->join();
  });
  st->add(re::session::keys::dead(1), 1);
  st->add(re::session::keys::dead(2), 1);
  const auto out =
      run_all({0, 3}, [&](std::int64_t id) { return s[static_cast<std::size_t>(id)]->shrink(-1); });
  for (const std::int64_t id : {0, 3}) {
    const auto& o = out.at(id);
    CHECK_FALSE(o.m);
    CHECK(o.error.find("below the minimum of 3") != std::string::npos);
    CHECK(o.error.find("lost: 1, 2") != std::string::npos);
  }
}

TEST_CASE("elastic: members enough but no size allowed says so, not that too few remain") {
  // ringzero-gpt -n 3 --elastic 3:3 --batch 4: three members, and 4 sequences do not split over 3.
  temp_dir d;
  auto st = open(d);
  const auto splits_4 = [](int n) { return 4 % n == 0; };
  const auto out = run_all({0, 1, 2}, [&](std::int64_t id) {
    re::session s(st, id, 3, bounds(3, 3, splits_4), 20s);
    return s.join();
  });
  for (const std::int64_t id : {0, 1, 2}) {
    const auto& o = out.at(id);
    CHECK_FALSE(o.m);
    CHECK(o.error.find("3 members for generation 0, and the job allows no size from 3 to 3") !=
          std::string::npos);
    CHECK(o.error.find("below the minimum") == std::string::npos);
  }
}

TEST_CASE("elastic: the size is the largest allowed one, and a member left out is told") {
  temp_dir d;
  auto st = open(d);
  const auto even = [](int n) { return n % 2 == 0; };
  std::vector<std::unique_ptr<re::session>> s(4);
  run_all({0, 1, 2, 3}, [&](std::int64_t id) {
    s[static_cast<std::size_t>(id)] =
        std::make_unique<re::session>(st, id, 4, bounds(1, 4, even), 20s);
    return s[static_cast<std::size_t>(id)]->join();
  });
  const auto out = run_all(
      {0, 2, 3}, [&](std::int64_t id) { return s[static_cast<std::size_t>(id)]->shrink(1); });
  CHECK(out.at(0).m->members == std::vector<std::int64_t>{0, 2});
  CHECK(out.at(2).m->rank == 1);
  CHECK_FALSE(out.at(3).m);
  CHECK(out.at(3).error.find("formed without member 3") != std::string::npos);
}

TEST_CASE("elastic: an arrival waits until the members grow at a step boundary") {
  temp_dir d;
  auto st = open(d);
  std::vector<std::unique_ptr<re::session>> s(3);
  run_all({0, 1}, [&](std::int64_t id) {
    s[static_cast<std::size_t>(id)] = std::make_unique<re::session>(st, id, 2, bounds(1, 3), 20s);
    return s[static_cast<std::size_t>(id)]->join();
  });
  CHECK(s[0]->waiting() == 0);
  std::atomic<bool> joined{false};
  outcome arrival;
  std::thread a([&] {
    try {
      s[2] = std::make_unique<re::session>(st, 2, 0, bounds(1, 3), 20s);
      arrival.m = s[2]->join();
    } catch (const ringzero::error& e) {
      arrival.error = e.what();
    }
    joined = true;
  });
  // The members train on; the arrival is counted but not taken in until they grow.
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (s[0]->waiting() == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(5ms);
  REQUIRE(s[0]->waiting() == 1);
  std::this_thread::sleep_for(100ms);
  CHECK_FALSE(joined.load());
  const auto out =
      run_all({0, 1}, [&](std::int64_t id) { return s[static_cast<std::size_t>(id)]->grow(); });
  a.join();
  REQUIRE_MESSAGE(arrival.m, arrival.error);
  CHECK(arrival.m->generation == 1);
  CHECK(arrival.m->rank == 2);
  CHECK(out.at(0).m->members == std::vector<std::int64_t>{0, 1, 2});
  CHECK(out.at(1).m->arrived == std::vector<std::int64_t>{2});
  CHECK(s[0]->waiting() == 0);
}

TEST_CASE("elastic: an arrival is told when the job finished without it") {
  temp_dir d;
  auto st = open(d);
  re::session m(st, 0, 1, bounds(1, 2), 20s);
  m.join();
  std::string error;
  std::thread a([&] {
    try {
      re::session s(st, 1, 0, bounds(1, 2), 20s);
      s.join();
    } catch (const ringzero::error& e) {
      error = e.what();
    }
  });
  while (m.waiting() == 0) std::this_thread::sleep_for(5ms);
  m.finish();
  a.join();
  CHECK(error.find("job finished before member 1 was taken in") != std::string::npos);
}

TEST_CASE("elastic: each generation's store is its own key space") {
  temp_dir d;
  auto st = open(d);
  re::session s(st, 0, 1, bounds(1, 1), 1s);
  s.join();
  s.generation_store()->set_string("addr/0", "old");
  s.grow();
  CHECK(s.current().generation == 1);
  CHECK(s.generation_store()->add("addr/0", 0) == 0);
  CHECK(st->get_string("g0/addr/0") == "old");
}

TEST_CASE("elastic: a session refuses ids outside the initial members") {
  temp_dir d;
  auto st = open(d);
  CHECK_THROWS_AS(re::session(st, 4, 4, bounds(1, 4)), ringzero::invalid_argument);
  CHECK_THROWS_AS(re::session(st, -1, 4, bounds(1, 4)), ringzero::invalid_argument);
  CHECK_THROWS_AS(re::session(nullptr, 0, 4, bounds(1, 4)), ringzero::invalid_argument);
}

TEST_CASE("elastic: a wait in a generation's store ends when a member is marked dead") {
  temp_dir d;
  auto st = open(d);
  std::vector<std::unique_ptr<re::session>> s(2);
  run_all({0, 1}, [&](std::int64_t id) {
    s[static_cast<std::size_t>(id)] = std::make_unique<re::session>(st, id, 2, bounds(1, 2), 20s);
    return s[static_cast<std::size_t>(id)]->join();
  });
  auto g = s[0]->generation_store();
  std::thread marker([&] {
    std::this_thread::sleep_for(300ms);
    st->add(re::session::keys::dead(1), 1);
  });
  const auto t0 = std::chrono::steady_clock::now();
  try {
    (void)g->get("addr/1");
    FAIL("the wait did not end");
  } catch (const ringzero::peer_error& e) {
    CHECK(e.peer() == 1);
    CHECK(std::string(e.what()).find("rank 1 (member 1) of generation 0 was declared lost") !=
          std::string::npos);
  }
  marker.join();
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  // A key that is there is read at once.
  g->set_string("addr/0", "here");
  CHECK(g->get_string("addr/0") == "here");
}

TEST_CASE("elastic: without a launcher, a member whose heartbeat stops is found in a wait") {
  temp_dir d;
  auto st = open(d);
  std::vector<std::unique_ptr<re::session>> s(2);
  run_all({0, 1}, [&](std::int64_t id) {
    s[static_cast<std::size_t>(id)] = std::make_unique<re::session>(st, id, 2, bounds(1, 2), 500ms);
    return s[static_cast<std::size_t>(id)]->join();
  });
  auto g = s[0]->generation_store();
  s[1].reset();  // its process is gone: nobody marks it, its heart stops
  const auto t0 = std::chrono::steady_clock::now();
  try {
    (void)g->get("addr/1");
    FAIL("the wait did not end");
  } catch (const ringzero::peer_error& e) {
    CHECK(e.peer() == 1);
    // Found by the wait itself, or by member 0's heartbeat watch (member 1 is next to it).
    const std::string what = e.what();
    CHECK((what.find("stopped its heartbeat") != std::string::npos ||
           what.find("heartbeat stopped") != std::string::npos));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  // It is marked dead for the others, and the survivor forms the next generation alone.
  CHECK(st->add(re::session::keys::dead(1), 0) == 1);
  CHECK(s[0]->shrink(1).members == std::vector<std::int64_t>{0});
}

TEST_CASE(
    "elastic: at its maximum the job is not asked to grow; the arrival waits until a member "
    "leaves") {
  // Before, waiting() counted the arrival, and a trainer regrouped at every step for nothing.
  temp_dir d;
  auto st = open(d);
  std::vector<std::unique_ptr<re::session>> s(3);
  run_all({0, 1}, [&](std::int64_t id) {
    s[static_cast<std::size_t>(id)] = std::make_unique<re::session>(st, id, 2, bounds(1, 2), 20s);
    return s[static_cast<std::size_t>(id)]->join();
  });
  outcome arrival;
  std::thread a([&] {
    try {
      s[2] = std::make_unique<re::session>(st, 2, 0, bounds(1, 2), 20s);
      arrival.m = s[2]->join();
    } catch (const ringzero::error& e) {
      arrival.error = e.what();
    }
  });
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (st->add(re::session::keys::waiting(), 0) == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(5ms);
  REQUIRE(st->add(re::session::keys::waiting(), 0) == 1);
  CHECK(s[0]->waiting() == 0);
  CHECK(s[1]->waiting() == 0);
  // Member 1 leaves: the next generation takes the arrival in its place.
  st->add(re::session::keys::dead(1), 1);
  const auto out =
      run_all({0}, [&](std::int64_t id) { return s[static_cast<std::size_t>(id)]->shrink(-1); });
  a.join();
  REQUIRE_MESSAGE(arrival.m, arrival.error);
  CHECK(out.at(0).m->members == std::vector<std::int64_t>{0, 2});
  CHECK(arrival.m->members == std::vector<std::int64_t>{0, 2});
}

TEST_CASE("elastic: a member whose heartbeat stops while the others train is declared lost") {
  // settle 1 s: beats every 200 ms, silence after 1 s. Member 1's session goes away (its beats
  // stop, as a stopped process's would); its predecessor, member 0, declares it lost.
  temp_dir d;
  auto st = open(d);
  std::vector<std::unique_ptr<re::session>> s(3);
  run_all({0, 1, 2}, [&](std::int64_t id) {
    s[static_cast<std::size_t>(id)] = std::make_unique<re::session>(st, id, 3, bounds(2, 3), 1s);
    return s[static_cast<std::size_t>(id)]->join();
  });
  const auto t0 = std::chrono::steady_clock::now();
  s[1].reset();
  while (st->add(re::session::keys::dead(1), 0) == 0 && std::chrono::steady_clock::now() < t0 + 20s)
    std::this_thread::sleep_for(10ms);
  const double found = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO("declared lost after ", found, " s");
  CHECK(st->add(re::session::keys::dead(1), 0) == 1);
  CHECK(st->add(re::session::keys::deaths(), 0) >= 1);
  CHECK(found < 5);  // settle (1 s) and a beat, with room for a loaded machine
  const auto out =
      run_all({0, 2}, [&](std::int64_t id) { return s[static_cast<std::size_t>(id)]->shrink(-1); });
  CHECK(out.at(0).m->members == std::vector<std::int64_t>{0, 2});
  CHECK(out.at(2).m->lost == std::vector<std::int64_t>{1});
}

TEST_CASE("elastic: when the launcher dies, the session says so instead of forming generations") {
  temp_dir d;
  auto st = open(d);
  const pid_t launcher = ::fork();
  REQUIRE(launcher >= 0);
  if (launcher == 0) {
    ::pause();
    ::_exit(0);
  }
  re::session s(st, 0, 1, bounds(1, 2), 5s);
  s.watch_launcher(launcher);
  s.join();
  CHECK_FALSE(s.launcher_gone());
  ::kill(launcher, SIGKILL);
  ::waitpid(launcher, nullptr, 0);
  CHECK(s.launcher_gone());
  std::this_thread::sleep_for(300ms);  // the heart looks every 100 ms
  CHECK_THROWS_WITH_AS(static_cast<void>(s.grow()), doctest::Contains("launcher (pid"),
                       ringzero::bootstrap_error);
}
