// The pieces every messaging transport takes from transport/detail/ instead of writing its own:
// the request handle, the abort state, the pending-message report and the process watch. Each
// transport's tests exercise them through the transport; these pin down what the pieces promise on
// their own.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/abort_state.hpp"
#include "ringzero/transport/detail/pending_report.hpp"
#include "ringzero/transport/detail/process_watch.hpp"
#include "ringzero/transport/detail/request.hpp"

namespace {

using ringzero::tag_layout;

/// An engine that records which operations its requests abandoned.
struct recording_engine {
  std::vector<int> abandoned;
  void abandon(int*& op) noexcept { abandoned.push_back(*op); }
};

/// The transport that owns the handle's fields, as transport::isend does.
struct fake_transport {
  using request = ringzero::detail::transport_request<fake_transport, recording_engine, int*>;
  static request post(std::shared_ptr<recording_engine> eng, int* op, bool done = false) {
    request r;
    r.eng_ = std::move(eng);
    r.op_ = op;
    r.done_ = done;
    return r;
  }
  static void complete(request& r) { r.op_ = nullptr; }
};

}  // namespace

TEST_CASE("a request abandons its pending operation once, whoever holds it last") {
  auto eng = std::make_shared<recording_engine>();
  int a = 1, b = 2, c = 3;
  {
    auto r1 = fake_transport::post(eng, &a);
    auto moved = std::move(r1);  // the moved-from handle abandons nothing
    CHECK(eng->abandoned.empty());
    auto r2 = fake_transport::post(eng, &b);
    moved = std::move(r2);  // assigning over a pending handle abandons its operation first
    REQUIRE(eng->abandoned.size() == 1);
    CHECK(eng->abandoned[0] == 1);
    auto done = fake_transport::post(eng, &c);
    fake_transport::complete(done);  // completed: nothing left to abandon
  }
  // `moved` (holding b) went out of scope pending; the completed one abandoned nothing.
  CHECK(eng->abandoned == std::vector<int>{1, 2});
  // The handle keeps the engine alive past the last other owner.
  std::weak_ptr<recording_engine> weak = eng;
  auto last = fake_transport::post(eng, &a);
  eng.reset();
  CHECK_FALSE(weak.expired());
}

TEST_CASE("abort_state keeps the first reason and publishes it with the flag") {
  ringzero::detail::abort_state s;
  CHECK_FALSE(s.is_set());
  CHECK(s.reason().empty());
  CHECK_FALSE(s.reason_if_set().has_value());
  // Many threads abort at once while others read: one reason wins, and a reader that sees the
  // flag sees a reason (ThreadSanitizer checks the publication).
  std::vector<std::thread> threads;
  std::vector<std::string> seen(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&s, t] { s.set("abort " + std::to_string(t)); });
    threads.emplace_back([&s, &seen, t] {
      while (!s.is_set()) std::this_thread::yield();
      seen[static_cast<std::size_t>(t)] = s.reason();
    });
  }
  for (auto& th : threads) th.join();
  const std::string winner = s.reason();
  CHECK(winner.starts_with("abort "));
  for (const auto& r : seen) CHECK(r == winner);
  s.set("later");
  CHECK(s.reason() == winner);
  CHECK(s.reason_if_set() == std::optional<std::string>(winner));
}

TEST_CASE("the pending report decodes tags with tag_layout and caps its lines") {
  ringzero::detail::pending_report r;
  const auto tag = tag_layout::with_comm_id(5, tag_layout::make(false, 1234, 56, 7));
  r.add(true, 1, 4096, tag);
  r.add(false, 2, 8, tag, 9, " (queued)");
  r.add(false, 3, 8, tag, 3);
  CHECK(r.count() == 3);
  CHECK(r.lines() ==
        "\n  send to rank 1, 4096 bytes, sequence 1234, step 56, chunk 7"
        "\n  receive from rank 2 (world 9), 8 bytes, sequence 1234, step 56, chunk 7 (queued)"
        "\n  receive from rank 3, 8 bytes, sequence 1234, step 56, chunk 7");
  ringzero::detail::pending_report many;
  for (int i = 0; i < 70; ++i) many.add(true, i, 1, tag);
  CHECK(many.count() == 70);
  const std::string text = many.lines();
  CHECK(text.find("rank 63,") != std::string::npos);
  CHECK(text.find("rank 64,") == std::string::npos);
  CHECK(text.ends_with("\n  ... and 6 more"));
}

// --- process watch ------------------------------------------------------------------------------

namespace {

using ringzero::detail::parse_process_stat;
using ringzero::detail::read_process_stat;

// A stat line as the kernel writes it (fields 3 to 22, then more), with a command name that
// holds parentheses and spaces: the fields count from its last ')'.
constexpr std::string_view stat_line =
    "4242 (a) b (c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 9000 100 "
    "18446744073709551615\n";
static_assert(parse_process_stat(stat_line)->state == 'S');
static_assert(parse_process_stat(stat_line)->start == 987654);

/// Waits until `pid`'s state letter is one of `want` (the kernel updates it asynchronously).
char wait_for_state(pid_t pid, std::string_view want) {
  for (int i = 0; i < 2000; ++i) {
    if (const auto st = read_process_stat(pid);
        st && want.find(st->state) != std::string_view::npos)
      return st->state;
    ::usleep(1000);
  }
  const auto st = read_process_stat(pid);
  return st ? st->state : '-';
}

}  // namespace

TEST_CASE("process watch: a stat line parses from the command name's last parenthesis") {
  CHECK_FALSE(parse_process_stat("4242 cat R 1 2 3").has_value());        // no ')'
  CHECK_FALSE(parse_process_stat("4242 (cat) R 1 2 3 4 5").has_value());  // cut before field 22
  CHECK_FALSE(parse_process_stat("4242 (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 12a4")
                  .has_value());  // a start time that is not a number
  const auto z = parse_process_stat("7 (x) Z 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 99");
  REQUIRE(z);
  CHECK(z->ended());
  CHECK(z->start == 99);
  CHECK(parse_process_stat("7 (x) t 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 99")->stopped());
}

TEST_CASE("process watch: a live, a stopped, a killed and a reaped process, told apart") {
  const auto self = read_process_stat(::getpid());
  REQUIRE(self);
  CHECK(self->state == 'R');
  CHECK(self->start > 0);
  CHECK(read_process_stat(::getpid())->start == self->start);

  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::prctl(PR_SET_NAME, "rz) (watch", 0, 0, 0);  // parentheses and a space in the name
    for (;;) ::pause();
  }
  CHECK(wait_for_state(child, "S") == 'S');
  const auto alive = read_process_stat(child);
  REQUIRE(alive);
  CHECK(alive->start >= self->start);
  CHECK_FALSE(alive->ended());
  ::kill(child, SIGSTOP);
  CHECK(wait_for_state(child, "Tt") == 'T');
  CHECK(read_process_stat(child)->stopped());
  CHECK(read_process_stat(child)->start == alive->start);
  ::kill(child, SIGKILL);
  CHECK(wait_for_state(child, "ZX") == 'Z');  // killed, not yet reaped
  CHECK(read_process_stat(child)->ended());
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK_FALSE(read_process_stat(child).has_value());  // reaped: no such process
}
