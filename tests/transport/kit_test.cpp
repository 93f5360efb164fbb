// The pieces every messaging transport takes from transport/detail/ instead of writing its own:
// the request handle, the abort state and the pending-message report. Each transport's tests
// exercise them through the transport; these pin down what the pieces promise on their own.
#include <doctest/doctest.h>

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/abort_state.hpp"
#include "ringzero/transport/detail/pending_report.hpp"
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
