// The parts of the NCCL backend that need no GPU: the type and op mapping, argument checks that
// must read exactly as the core collectives' do, and the errors a machine without a GPU gets.
#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

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

TEST_CASE("argument checks read exactly as the core collectives' on every rank") {
  // Two loopback ranks make the same mistake each; the core call and the NCCL backend's check
  // must fail with the same text, before either sends anything.
  ringzero::loopback::world(2).run([](ringzero::loopback::communicator& comm) {
    const int r = comm.rank();
    const int n = comm.size();
    std::vector<float> buf(16, 1.0f);
    const std::span<float> all(buf);
    const auto bad_op = static_cast<op>(17);
    struct scenario {
      const char* name;
      std::function<void()> core;
      std::function<void()> nccl;
    };
    const auto a = all.first(4);
    const auto b = all.subspan(2, 4);
    const std::span<const float> ca = a;
    const std::vector<scenario> scenarios = {
        {"all_reduce sizes", [&] { ringzero::all_reduce(comm, a, all.first(3), op::sum); },
         [&] { nd::check_all_reduce(ca, all.first(3), op::sum); }},
        {"all_reduce overlap", [&] { ringzero::all_reduce(comm, a, b, op::sum); },
         [&] { nd::check_all_reduce(ca, b, op::sum); }},
        {"all_reduce op", [&] { ringzero::all_reduce(comm, a, bad_op); },
         [&] { nd::check_all_reduce(ca, a, bad_op); }},
        {"reduce_scatter sizes",
         [&] { ringzero::reduce_scatter(comm, all.first(7), all.subspan(8, 3), op::sum); },
         [&] { nd::check_reduce_scatter<float>(r, n, all.first(7), all.subspan(8, 3), op::sum); }},
        {"reduce_scatter wrong block",
         [&] {
           ringzero::reduce_scatter(comm, all.first(6), all.subspan(3 * (1 - r), 3), op::sum);
         },
         [&] {
           nd::check_reduce_scatter<float>(r, n, all.first(6), all.subspan(3 * (1 - r), 3),
                                           op::sum);
         }},
        {"all_gather sizes", [&] { ringzero::all_gather(comm, all.first(3), all.subspan(8, 5)); },
         [&] { nd::check_all_gather<float>(r, n, all.first(3), all.subspan(8, 5)); }},
        {"all_gather wrong block",
         [&] { ringzero::all_gather(comm, all.subspan(3 * (1 - r), 3), all.first(6)); },
         [&] { nd::check_all_gather<float>(r, n, all.subspan(3 * (1 - r), 3), all.first(6)); }},
        {"broadcast root", [&] { ringzero::broadcast(comm, a, 2); },
         [&] { nd::check_broadcast<float>(r, n, a, a, 2); }},
        {"broadcast sizes", [&] { ringzero::broadcast(comm, a, all.first(3), r); },
         [&] { nd::check_broadcast<float>(r, n, a, all.first(3), r); }},
        {"broadcast overlap", [&] { ringzero::broadcast(comm, a, b, r); },
         [&] { nd::check_broadcast<float>(r, n, a, b, r); }},
        {"reduce op", [&] { ringzero::reduce(comm, a, bad_op, 0); },
         [&] { nd::check_reduce<float>(r, n, a, a, bad_op, 0); }},
        {"reduce root", [&] { ringzero::reduce(comm, a, op::max, -1); },
         [&] { nd::check_reduce<float>(r, n, a, a, op::max, -1); }},
        {"reduce sizes", [&] { ringzero::reduce(comm, a, all.first(5), op::sum, r); },
         [&] { nd::check_reduce<float>(r, n, a, all.first(5), op::sum, r); }},
        {"reduce overlap", [&] { ringzero::reduce(comm, a, b, op::sum, r); },
         [&] { nd::check_reduce<float>(r, n, a, b, op::sum, r); }},
        {"send to self", [&] { ringzero::send(comm, a, r); },
         [&] { nd::check_peer("send", r, n, r); }},
        {"recv from nobody", [&] { ringzero::recv(comm, a, 2); },
         [&] { nd::check_peer("recv", r, n, 2); }},
        {"send_recv bad peer", [&] { ringzero::send_recv(comm, ca, -1, b, 1 - r); },
         [&] { nd::check_peer("send_recv", r, n, -1); }},
    };
    for (const auto& s : scenarios) {
      const std::string core = message_of(s.core);
      INFO("rank ", r, ", scenario '", s.name, "'");
      CHECK(core.rfind("ringzero: ", 0) == 0);
      CHECK(message_of(s.nccl) == core);
    }
  });
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
  CHECK(message_of([&] { ringzero::nccl::communicator c(store, 2, 2); }) ==
        "ringzero: nccl::communicator: rank 2 is out of range for a 2-rank communicator");
  CHECK(message_of([&] { ringzero::nccl::communicator c(store, 0, 0); }) ==
        "ringzero: nccl::communicator: rank 0 is out of range for a 0-rank communicator");
  CHECK(message_of([&] { ringzero::nccl::communicator c(ncclComm_t{}); }) ==
        "ringzero: nccl::communicator: cannot adopt a null ncclComm_t");
}

TEST_CASE("without a GPU, creating a communicator says so") {
  if (ringzero::nccl::device_count() > 0) {
    MESSAGE("this machine has a GPU: the no-GPU error is checked on machines without one");
    return;
  }
  unreachable_store store;
  for (const auto& make : std::vector<std::function<void()>>{
           [] { static_cast<void>(ringzero::nccl::communicator::single()); },
           [] { static_cast<void>(ringzero::nccl::communicator::from_env()); },
           [&] { ringzero::nccl::communicator c(store, 0, 1); }}) {
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
