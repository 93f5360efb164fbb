// The parts of the NCCL backend that need no GPU: the type and op mapping, the one collectives
// API handing validated calls to a native backend, and the errors a machine without a GPU gets.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ringzero/executor.hpp"
#include "ringzero/ringzero.hpp"
#include "ringzero/transport/nccl.hpp"

namespace nd = ringzero::nccl::detail;
using ringzero::op;

namespace {

// The message an invalid_argument carried, or a marker saying what happened instead.
std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ringzero::invalid_argument& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not invalid_argument: ") + e.what() + ">";
  }
  return "<no exception>";
}

// A store that must never be reached: the checks it guards come first.
class unreachable_store : public ringzero::bootstrap::store {
 public:
  void set(std::string_view, std::span<const std::byte>) override { FAIL("store::set called"); }
  std::vector<std::byte> get(std::string_view) override {
    FAIL("store::get called");
    return {};
  }
  std::int64_t add(std::string_view, std::int64_t) override {
    FAIL("store::add called");
    return 0;
  }
  void wait(std::span<const std::string>) override { FAIL("store::wait called"); }
};

}  // namespace

TEST_CASE("every element type and op maps to its NCCL enum") {
  using ringzero::dtype;
  CHECK(nd::to_nccl(dtype::int8) == ncclInt8);
  CHECK(nd::to_nccl(dtype::uint8) == ncclUint8);
  CHECK(nd::to_nccl(dtype::int32) == ncclInt32);
  CHECK(nd::to_nccl(dtype::uint32) == ncclUint32);
  CHECK(nd::to_nccl(dtype::int64) == ncclInt64);
  CHECK(nd::to_nccl(dtype::uint64) == ncclUint64);
  CHECK(nd::to_nccl(dtype::float16) == ncclFloat16);
  CHECK(nd::to_nccl(dtype::float32) == ncclFloat32);
  CHECK(nd::to_nccl(dtype::float64) == ncclFloat64);
  CHECK(nd::to_nccl(dtype::bfloat16) == ncclBfloat16);
  CHECK(nd::to_nccl(op::sum) == ncclSum);
  CHECK(nd::to_nccl(op::prod) == ncclProd);
  CHECK(nd::to_nccl(op::min) == ncclMin);
  CHECK(nd::to_nccl(op::max) == ncclMax);
  CHECK(nd::to_nccl(op::avg) == ncclAvg);
  static_assert(nd::nccl_type_v<float> == ncclFloat32);
  static_assert(nd::nccl_type_v<const ringzero::bfloat16> == ncclBfloat16);
  static_assert(nd::nccl_type_v<std::uint64_t> == ncclUint64);
}

namespace {

// A transport with native collectives, as NCCL is, that records what it is handed: what the NCCL
// backend receives from the one collectives API, observable without a GPU.
struct recording_native {
  int rank_ = 0;
  int size_ = 2;
  std::vector<ringzero::native_call>* calls = nullptr;
  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int size() const { return size_; }
  [[nodiscard]] ringzero::tuning::policy tuning() const { return {}; }
  void run_native(const ringzero::native_call& c, const ringzero::options&) { calls->push_back(c); }
  void all_gather_bytes(std::span<const std::byte> mine, std::span<std::byte> all,
                        const ringzero::options&) {
    for (std::size_t r = 0; r < all.size() / mine.size(); ++r)
      std::memcpy(all.data() + r * mine.size(), mine.data(), mine.size());
  }
};
static_assert(ringzero::native_collectives<recording_native>);
static_assert(ringzero::native_collectives<ringzero::nccl::transport>);

// A native transport that splits itself, as NCCL does through ncclCommSplit: the new world's
// rank is the key, of three.
struct splitting_native : recording_native {
  std::vector<std::pair<int, int>>* asked = nullptr;
  [[nodiscard]] std::optional<splitting_native> split(int color, int key) {
    asked->emplace_back(color, key);
    if (color < 0) return std::nullopt;
    splitting_native sub = *this;
    sub.rank_ = key;
    sub.size_ = 3;
    return sub;
  }
};
static_assert(ringzero::detail::splits_itself<splitting_native>);
static_assert(ringzero::detail::splits_itself<ringzero::nccl::transport>);
static_assert(!ringzero::detail::splits_itself<recording_native>);

}  // namespace

TEST_CASE("a native backend gets the core's validation and only validated calls") {
  // The same mistakes on a loopback rank and on a native (NCCL-like) communicator fail with the
  // same text, and none of them reaches the backend.
  ringzero::loopback::world(2).run([](ringzero::loopback::communicator& comm) {
    const int r = comm.rank();
    std::vector<ringzero::native_call> calls;
    ringzero::communicator<recording_native> native(recording_native{r, 2, &calls});
    std::vector<float> buf(16, 1.0f);
    const std::span<float> all(buf);
    const auto bad_op = static_cast<op>(17);
    const auto a = all.first(4);
    const auto b = all.subspan(2, 4);
    const std::span<const float> ca = a;
    // Each scenario is run on both communicators through the same generic lambda.
    const auto check_both = [&](const char* name, auto&& call) {
      const std::string core = message_of([&] { call(comm); });
      INFO("rank ", r, ", scenario '", name, "'");
      CHECK(core.rfind("ringzero: ", 0) == 0);
      CHECK(message_of([&] { call(native); }) == core);
    };
    check_both("all_reduce sizes",
               [&](auto& c) { ringzero::all_reduce(c, a, all.first(3), op::sum); });
    check_both("all_reduce overlap", [&](auto& c) { ringzero::all_reduce(c, a, b, op::sum); });
    check_both("all_reduce op", [&](auto& c) { ringzero::all_reduce(c, a, bad_op); });
    check_both("reduce_scatter sizes", [&](auto& c) {
      ringzero::reduce_scatter(c, all.first(7), all.subspan(8, 3), op::sum);
    });
    check_both("reduce_scatter wrong block", [&](auto& c) {
      ringzero::reduce_scatter(c, all.first(6), all.subspan(3 * (1 - r), 3), op::sum);
    });
    check_both("all_gather sizes",
               [&](auto& c) { ringzero::all_gather(c, all.first(3), all.subspan(8, 5)); });
    check_both("all_gather wrong block", [&](auto& c) {
      ringzero::all_gather(c, all.subspan(3 * (1 - r), 3), all.first(6));
    });
    check_both("broadcast root", [&](auto& c) { ringzero::broadcast(c, a, 2); });
    check_both("broadcast sizes", [&](auto& c) { ringzero::broadcast(c, a, all.first(3), r); });
    check_both("broadcast overlap", [&](auto& c) { ringzero::broadcast(c, a, b, r); });
    check_both("reduce op", [&](auto& c) { ringzero::reduce(c, a, bad_op, 0); });
    check_both("reduce root", [&](auto& c) { ringzero::reduce(c, a, op::max, -1); });
    check_both("reduce sizes", [&](auto& c) { ringzero::reduce(c, a, all.first(5), op::sum, r); });
    check_both("reduce overlap", [&](auto& c) { ringzero::reduce(c, a, b, op::sum, r); });
    check_both("send to self", [&](auto& c) { ringzero::send(c, ca, r); });
    check_both("recv from nobody", [&](auto& c) { ringzero::recv(c, a, 2); });
    check_both("send_recv bad peer", [&](auto& c) { ringzero::send_recv(c, ca, -1, b, 1 - r); });
    CHECK(calls.empty());

    // Valid calls arrive whole, in the backend's terms.
    ringzero::all_reduce(native, a, op::max);
    ringzero::reduce_scatter(native, std::span<const float>(all.first(8)), all.subspan(4 * r, 4),
                             op::sum);
    ringzero::broadcast(native, a, 1);
    ringzero::all_reduce(native, all.first(0), op::sum);  // empty: nothing to hand over
    CHECK_THROWS_AS(
        ringzero::all_reduce(native, a, op::sum, {.algorithm = ringzero::algorithm::ring}),
        ringzero::unsupported);
    REQUIRE(calls.size() == 3);
    CHECK(calls[0].kind == ringzero::collective::all_reduce);
    CHECK(calls[0].in == a.data());
    CHECK(calls[0].out == a.data());
    CHECK(calls[0].count == 4);
    CHECK(calls[0].type == ringzero::dtype::float32);
    CHECK(calls[0].reduction == op::max);
    CHECK(calls[1].kind == ringzero::collective::reduce_scatter);
    CHECK(calls[1].count == 4);
    CHECK(calls[2].kind == ringzero::collective::broadcast);
    CHECK(calls[2].root == 1);
  });
}

TEST_CASE("a native backend's calls are counted as every call is") {
  // Counters and traces open their scope before the call reaches the backend, so what NCCL runs
  // shows in trace::counters like any transport's calls: empty calls, barriers and
  // point-to-point included, a refused call not.
  std::vector<ringzero::native_call> calls;
  ringzero::communicator<recording_native> native(recording_native{0, 2, &calls});
  std::vector<float> buf(16, 1.0f);
  const std::span<float> all(buf);
  ringzero::all_reduce(native, all.first(4), op::sum);
  ringzero::all_reduce(native, all.first(0), op::sum);  // counted, never handed over
  ringzero::all_gather(native, std::span<const float>(all.first(4)), all.first(8));
  ringzero::barrier(native);
  ringzero::send_recv(native, std::span<const float>(all.first(2)), 1, all.subspan(8, 3), 1);
  CHECK_THROWS_AS(ringzero::reduce(native, all.first(4), op::sum, 5), ringzero::invalid_argument);
  CHECK(calls.size() == 4);
  const auto rows = ringzero::trace::counters(native);
  const auto row = [&](ringzero::collective k) {
    for (const auto& r : rows)
      if (r.kind == k) return r;
    return ringzero::trace::counter{.kind = k};
  };
  CHECK(row(ringzero::collective::all_reduce).calls == 2);
  CHECK(row(ringzero::collective::all_reduce).bytes == 16);
  CHECK(row(ringzero::collective::all_reduce).algo == ringzero::algorithm::automatic);
  CHECK(row(ringzero::collective::all_gather).calls == 1);
  CHECK(row(ringzero::collective::all_gather).bytes == 32);
  CHECK(row(ringzero::collective::barrier).calls == 1);
  CHECK(row(ringzero::collective::send_recv).calls == 1);
  CHECK(row(ringzero::collective::send_recv).bytes == 20);
  CHECK(row(ringzero::collective::reduce).calls == 0);
}

TEST_CASE("split() on a native backend is the transport's own, with the parent's deadline") {
  std::vector<ringzero::native_call> calls;
  std::vector<std::pair<int, int>> asked;
  splitting_native t;
  t.rank_ = 1;
  t.size_ = 4;
  t.calls = &calls;
  t.asked = &asked;
  ringzero::communicator<splitting_native> world(t, std::chrono::seconds(7));
  CHECK_FALSE(world.split(-1, 5));
  std::optional<ringzero::communicator<splitting_native>> sub = world.split(2, 1);
  REQUIRE(sub);
  CHECK(sub->rank() == 1);
  CHECK(sub->size() == 3);
  CHECK(sub->timeout() == std::chrono::seconds(7));
  CHECK(asked == std::vector<std::pair<int, int>>{{-1, 5}, {2, 1}});
  std::vector<float> buf(4, 1.0f);
  ringzero::all_reduce(*sub, std::span<float>(buf), op::sum);
  REQUIRE(calls.size() == 1);
  CHECK(calls[0].kind == ringzero::collective::all_reduce);
  CHECK(calls[0].count == 4);
}

namespace {

// The executor a one-rank scheduling_native offers: a world of one only copies.
template <class E>
struct solo_executor {
  [[nodiscard]] int rank() const { return 0; }
  [[nodiscard]] int size() const { return 1; }
  void exchange(std::span<const ringzero::transfer<const E>>,
                std::span<const ringzero::transfer<E>>) {
    FAIL("a world of one exchanged messages");
  }
  void combine(op, const E*, const E*, E*, std::size_t) { FAIL("a world of one reduced"); }
  void finish_avg(E*, std::size_t, int) { FAIL("a world of one averaged"); }
  void copy(E* dst, const E* src, std::size_t n) { std::memcpy(dst, src, n * sizeof(E)); }
};
static_assert(ringzero::executor<solo_executor<float>, float>);

// A native transport that also runs ringzero's schedules, as NCCL does: what reaches
// with_device_executor() and what stays with run_native().
struct scheduling_native : recording_native {
  std::vector<ringzero::algorithm>* scheduled = nullptr;
  template <ringzero::element E, class Body>
  void with_device_executor(const ringzero::native_call& c, const ringzero::options& o,
                            std::string_view, std::size_t scratch_elems, Body&& body) {
    calls->push_back(c);
    scheduled->push_back(o.algorithm);
    solo_executor<E> x;
    std::vector<E> scratch(scratch_elems);
    body(x, std::span<E>(scratch));
  }
};
static_assert(ringzero::scheduled_collectives<scheduling_native>);
static_assert(!ringzero::scheduled_collectives<recording_native>);
static_assert(ringzero::scheduled_collectives<ringzero::nccl::transport>);

}  // namespace

TEST_CASE("a forced algorithm runs as a schedule where one exists, and is refused by name else") {
  using ringzero::algorithm;
  using ringzero::collective;
  std::vector<ringzero::native_call> calls;
  std::vector<algorithm> scheduled;
  scheduling_native t;
  t.calls = &calls;
  t.scheduled = &scheduled;
  t.size_ = 1;
  ringzero::communicator<scheduling_native> comm(t);
  std::vector<float> buf(8, 1.0f);
  const std::span<float> all(buf);

  ringzero::all_reduce(comm, all, op::sum, {.algorithm = algorithm::ring});
  ringzero::all_reduce(comm, all, op::avg, {.algorithm = algorithm::tree});
  ringzero::reduce_scatter(comm, all.first(4), all.subspan(4, 4), op::max,
                           {.algorithm = algorithm::ring});
  ringzero::all_gather(comm, all.first(4), all.subspan(4, 4), {.algorithm = algorithm::ring});
  ringzero::broadcast(comm, all, 0, {.algorithm = algorithm::tree});
  ringzero::reduce(comm, all, op::min, 0, {.algorithm = algorithm::tree});
  ringzero::all_reduce(comm, all, op::sum);  // automatic: the backend's own collective
  ringzero::all_reduce(comm, all.first(0), op::sum, {.algorithm = algorithm::ring});  // empty
  REQUIRE(calls.size() == 7);
  REQUIRE(scheduled.size() == 6);
  CHECK(scheduled[0] == algorithm::ring);
  CHECK(scheduled[1] == algorithm::tree);
  CHECK(calls[1].reduction == op::avg);
  CHECK(calls[2].kind == collective::reduce_scatter);
  CHECK(calls[2].count == 4);
  CHECK(calls[3].kind == collective::all_gather);
  CHECK(calls[4].kind == collective::broadcast);
  CHECK(calls[5].kind == collective::reduce);
  CHECK(calls[6].kind == collective::all_reduce);

  // No schedule for the pair: unsupported, naming the algorithm, the collective and what exists.
  const auto refused = [&](auto&& call, const std::string& algo, const std::string& what) {
    try {
      call();
      FAIL("expected unsupported for ", algo, " on ", what);
    } catch (const ringzero::unsupported& e) {
      const std::string msg = e.what();
      CHECK_MESSAGE(msg.find(what + ": algorithm '" + algo +
                             "' does not run on this backend's "
                             "buffers; ringzero's algorithms there are ring (all_reduce, "
                             "reduce_scatter, all_gather) and tree (all_reduce, "
                             "broadcast, reduce)") != std::string::npos,
                    msg);
    }
  };
  refused(
      [&] {
        ringzero::all_reduce(comm, all, op::sum, {.algorithm = algorithm::recursive_doubling});
      },
      "rd", "all_reduce");
  refused([&] { ringzero::broadcast(comm, all, 0, {.algorithm = algorithm::ring}); }, "ring",
          "broadcast");
  refused(
      [&] {
        ringzero::all_gather(comm, all.first(4), all.subspan(4, 4), {.algorithm = algorithm::tree});
      },
      "tree", "all_gather");
  refused([&] { ringzero::all_to_all(comm, all, {.algorithm = algorithm::pairwise}); }, "pairwise",
          "all_to_all");
  CHECK(message_of([&] {
          ringzero::all_reduce(comm, all, op::sum, {.algorithm = static_cast<algorithm>(99)});
        }) == "ringzero: all_reduce: options::algorithm holds 99, which names no algorithm");
  CHECK(calls.size() == 7);
}

TEST_CASE("host memory is refused before NCCL could see it") {
  std::vector<float> host(8);
  const std::string msg = message_of([&] {
    nd::check_device_buffer("all_reduce", "input", host.data(), host.size() * sizeof(float), 0);
  });
  CHECK_MESSAGE(msg.find("all_reduce: the start of the input") != std::string::npos, msg);
  CHECK_MESSAGE(msg.find("is not memory a GPU can address") != std::string::npos, msg);
  CHECK(message_of([&] { nd::check_device_buffer("all_reduce", "input", host.data(), 0, 0); }) ==
        "<no exception>");
}

TEST_CASE("communicator arguments are checked before any store or CUDA call") {
  unreachable_store store;
  CHECK(message_of([&] { ringzero::nccl::transport c(store, 2, 2); }) ==
        "ringzero: nccl::communicator: rank 2 is out of range for a 2-rank communicator");
  CHECK(message_of([&] { ringzero::nccl::transport c(store, 0, 0); }) ==
        "ringzero: nccl::communicator: rank 0 is out of range for a 0-rank communicator");
  CHECK(message_of([&] { ringzero::nccl::transport c(ncclComm_t{}); }) ==
        "ringzero: nccl::communicator: cannot adopt a null ncclComm_t");
}

TEST_CASE("without a GPU, creating a communicator says so") {
  if (ringzero::nccl::device_count() > 0) {
    MESSAGE("this machine has a GPU: the no-GPU error is checked on machines without one");
    return;
  }
  unreachable_store store;
  for (const auto& make : std::vector<std::function<void()>>{
           [] { static_cast<void>(ringzero::nccl::transport::single()); },
           [] { static_cast<void>(ringzero::nccl::communicator::from_env()); },
           [&] { ringzero::nccl::transport c(store, 0, 1); }}) {
    try {
      make();
      FAIL("expected ringzero::unsupported");
    } catch (const ringzero::unsupported& e) {
      CHECK_MESSAGE(std::string(e.what()).find("no CUDA device is visible") != std::string::npos,
                    e.what());
      CHECK(e.code() == ringzero::errc::unsupported);
    }
  }
}
