#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "ringzero/bootstrap/file_store.hpp"

namespace rb = ringzero::bootstrap;
using namespace std::chrono_literals;

namespace {

struct temp_dir {
  std::filesystem::path path;
  temp_dir() {
    char tmpl[] = "/tmp/ringzero-file-store-XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() { std::filesystem::remove_all(path); }
};

}  // namespace

TEST_CASE("file_store round trips values, counters and odd keys") {
  temp_dir dir;
  rb::file_store s(dir.path / "nested" / "store", 10s);
  s.set_string("a", "first");
  CHECK(s.get_string("a") == "first");
  s.set_string("a", "second");
  CHECK(s.get_string("a") == "second");
  s.set("empty", {});
  CHECK(s.get("empty").empty());
  CHECK(s.add("n", 2) == 2);
  CHECK(s.add("n", 3) == 5);
  CHECK(s.get_string("n") == "5");
  CHECK_THROWS_WITH_AS(s.add("a", 1), doctest::Contains("not an integer"),
                       ringzero::bootstrap_error);
  for (const std::string key : {"a/b", "..", ".", "with space", "100%", "k.tmp", "\xff\x01"}) {
    CAPTURE(key);
    s.set_string(key, "v:" + key);
    CHECK(s.get_string(key) == "v:" + key);
  }
  const std::vector<std::string> keys = {"a", "n", "a/b"};
  s.wait(keys);
  CHECK_THROWS_AS(s.set_string("", "x"), ringzero::invalid_argument);
  CHECK_THROWS_AS(s.set_string(std::string(rb::file_store::max_key_bytes + 1, 'k'), "x"),
                  ringzero::invalid_argument);
  // Only key files remain: no temporary or lock file is left behind.
  for (const auto& e : std::filesystem::directory_iterator(s.directory()))
    CHECK(e.path().filename().string().starts_with("k."));
}

TEST_CASE("file_store counts correctly across threads and processes") {
  temp_dir dir;
  constexpr int threads = 4, processes = 3, adds = 40;
  std::vector<pid_t> pids;
  for (int p = 0; p < processes; ++p) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      int code = 0;
      try {
        rb::file_store s(dir.path, 20s);
        for (int i = 0; i < adds; ++i) s.add("count", 1);
        s.set_string("proc/" + std::to_string(p), "done");
      } catch (...) {
        code = 1;
      }
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  rb::file_store s(dir.path, 20s);
  std::vector<std::vector<std::int64_t>> got(threads);
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      for (int i = 0; i < adds; ++i) got[static_cast<std::size_t>(t)].push_back(s.add("count", 1));
    });
  for (auto& t : ts) t.join();
  for (pid_t pid : pids) {
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
  std::set<std::int64_t> all;
  for (const auto& v : got) all.insert(v.begin(), v.end());
  CHECK(all.size() == static_cast<std::size_t>(threads * adds));  // no value handed out twice
  CHECK(s.get_string("count") == std::to_string((threads + processes) * adds));
  const std::vector<std::string> keys = {"proc/0", "proc/1", "proc/2"};
  s.wait(keys);
}

TEST_CASE("a get waits for a later set") {
  temp_dir dir;
  rb::file_store s(dir.path, 10s);
  std::string got;
  std::thread reader([&] { got = rb::file_store(dir.path, 10s).get_string("late"); });
  std::this_thread::sleep_for(30ms);
  s.set_string("late", "here");
  reader.join();
  CHECK(got == "here");
}

TEST_CASE("file_store timeouts name the key, and a stale lock names its file") {
  temp_dir dir;
  rb::file_store s(dir.path, 100ms);
  CHECK_THROWS_WITH_AS(static_cast<void>(s.get("never")),
                       doctest::Contains("waiting for key 'never'"), ringzero::timeout_error);
  const std::vector<std::string> keys = {"never-either"};
  CHECK_THROWS_WITH_AS(s.wait(keys), doctest::Contains("'never-either'"), ringzero::timeout_error);
  const auto lock = dir.path / "l.counter";
  const std::string lock_name = lock.string();
  ::close(::open(lock.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644));
  CHECK_THROWS_WITH_AS(s.add("counter", 1), doctest::Contains(lock_name.c_str()),
                       ringzero::timeout_error);
  std::filesystem::remove(lock);
  CHECK(s.add("counter", 1) == 1);
}
