// The messaging device executor (detail/device_executor.hpp: what runs ringzero's schedules on
// device buffers over libfabric with FI_HMEM), on the host: loopback ranks move the messages,
// and a stand-in for the CUDA runtime (fake_device.hpp) runs "kernels" only as their events are
// polled. Every schedule, on 1 to 5 ranks, in place and out of place, must give the bits of the
// host executor (algorithms/schedule/host_executor.hpp), which tests/algorithms/schedule_test.cpp
// holds to the host ring and tree. A send posted before the reduction that made it finished, a
// receive landing in a slot a reduction still reads, or a call returning before its last kernel
// would show here as wrong bits.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "fake_device.hpp"
#include "ringzero/algorithms/schedule.hpp"
#include "ringzero/algorithms/schedule/host_executor.hpp"
#include "ringzero/detail/device_executor.hpp"
#include "ringzero/executor.hpp"
#include "ringzero/transport/loopback.hpp"

namespace {

namespace rz = ringzero;
namespace sched = ringzero::algorithms::schedule;
using rz::algorithm;
using rz::collective;
using rz::op;

static_assert(rz::executor<rz::detail::device_executor<rz::loopback::communicator, float>, float>);

template <class E>
E value(int rank, std::size_t i) {
  if constexpr (std::is_floating_point_v<E>)
    return static_cast<E>(0.1 * (rank + 1) + 0.37 * static_cast<double>(i % 101));
  else
    return static_cast<E>(rank * 3 + static_cast<int>(i % 17));
}

struct shape {
  std::size_t in;
  std::size_t out;
};

shape shape_of(collective k, std::size_t count, int n, int rank, int root) {
  const auto w = static_cast<std::size_t>(n);
  switch (k) {
    case collective::reduce_scatter:
      return {count * w, count};
    case collective::all_gather:
      return {count, count * w};
    case collective::broadcast:
      return {count, count};  // in is read on the root only; in place it is the output
    case collective::reduce:
      return {count, rank == root ? count : 0};
    default:
      return {count, count};
  }
}

/// Runs `k` with schedule `a` on this rank twice, through the host executor and through the
/// device executor on fake device memory, and checks they agree bit for bit.
template <class E>
void agree(rz::loopback::communicator& comm, rz::detail::device_cache& cache, algorithm a,
           collective k, op o, std::size_t count, int root, bool in_place, std::mutex& log,
           std::vector<std::string>& failures) {
  const int n = comm.size();
  const int r = comm.rank();
  const shape sh = shape_of(k, count, n, r, root);
  const bool same = in_place && (k == collective::all_reduce || k == collective::broadcast ||
                                 (k == collective::reduce && r == root));
  std::vector<E> in(sh.in);
  for (std::size_t i = 0; i < sh.in; ++i) in[i] = value<E>(r, i);

  std::vector<E> host_in = in;
  std::vector<E> host_out(same ? 0 : sh.out, E{});
  std::span<E> hout = same ? std::span<E>(host_in) : std::span<E>(host_out);
  sched::run_on_host(comm, a, rz::algorithms::call<E>{k, host_in, hout, o, root});

  fake_device::buffer<E> din(sh.in);
  fake_device::buffer<E> dout(same ? 0 : sh.out);
  if (sh.in > 0) std::memcpy(din.data(), in.data(), sh.in * sizeof(E));
  if (!same && sh.out > 0) std::memset(static_cast<void*>(dout.data()), 0, sh.out * sizeof(E));
  const std::span<E> dev_out = same ? din.span() : dout.span();
  const rz::algorithms::call<E> c{k, std::span<const E>(din.data(), sh.in), dev_out, o, root};
  const std::size_t elems = sched::scratch_elems(a, c, n);
  E* scratch =
      elems > 0
          ? reinterpret_cast<E*>(cache.scratch(elems * sizeof(E), [](const void*, std::size_t) {}))
          : nullptr;
  rz::detail::device_executor<rz::loopback::communicator, E> x(
      comm, cache, &fake_device::reductions, rz::collective_name(k), rz::algorithm_name(a));
  sched::run(x, a, c, std::span<E>(scratch, elems));
  x.finish();

  const bool out_ok =
      hout.size() == dev_out.size() &&
      (hout.empty() || std::memcmp(hout.data(), dev_out.data(), hout.size_bytes()) == 0);
  const bool in_ok =
      same || sh.in == 0 || std::memcmp(din.data(), in.data(), sh.in * sizeof(E)) == 0;
  if (out_ok && in_ok) return;
  std::lock_guard lock(log);
  failures.push_back(fmt::format("{} {} {} count {} root {} on rank {} of {}{}: {}",
                                 rz::collective_name(k), rz::algorithm_name(a), rz::op_name(o),
                                 count, root, r, n, same ? " in place" : "",
                                 out_ok ? "the input was written" : "bits differ from the host"));
}

}  // namespace

TEST_CASE("the device executor gives the host executor's bits for every schedule") {
  const fake_device::installed fake;
  const std::size_t polls_before = fake_device::global().polls;
  struct pair {
    algorithm a;
    collective k;
  };
  const pair pairs[] = {
      {algorithm::ring, collective::all_reduce}, {algorithm::ring, collective::reduce_scatter},
      {algorithm::ring, collective::all_gather}, {algorithm::tree, collective::all_reduce},
      {algorithm::tree, collective::broadcast},  {algorithm::tree, collective::reduce}};
  std::mutex log;
  std::vector<std::string> failures;
  for (int n = 1; n <= 5; ++n) {
    rz::loopback::world(n).run([&](rz::loopback::communicator& comm) {
      rz::detail::device_cache cache(fake_device::runtime, 0, [](const void*, std::size_t) {});
      for (const pair& p : pairs)
        for (std::size_t count : {std::size_t{1}, std::size_t{7}, std::size_t{1001}})
          for (bool in_place : {false, true}) {
            const int root = comm.size() - 1;
            for (op o : {op::sum, op::avg, op::max})
              agree<float>(comm, cache, p.a, p.k, o, count, root, in_place, log, failures);
            agree<std::int32_t>(comm, cache, p.a, p.k, op::sum, count, 0, in_place, log, failures);
          }
    });
  }
  for (const auto& f : failures) FAIL_CHECK(f);
  CHECK(failures.empty());
  // The kernels ran only as the executor polled their events: nothing was synchronized.
  CHECK(fake_device::global().polls > polls_before);
}

TEST_CASE("a device executor unwinding after an error waits for its kernels") {
  const fake_device::installed fake;
  rz::loopback::world(2).run([&](rz::loopback::communicator& comm) {
    rz::detail::device_cache cache(fake_device::runtime, 0, [](const void*, std::size_t) {});
    fake_device::buffer<float> a(64), b(64);
    std::memset(static_cast<void*>(a.data()), 0, 64 * sizeof(float));
    std::memset(static_cast<void*>(b.data()), 0, 64 * sizeof(float));
    bool threw = false;
    try {
      rz::detail::device_executor<rz::loopback::communicator, float> x(
          comm, cache, &fake_device::reductions, "all_reduce", "ring");
      x.copy(b.data(), a.data(), 64);
      // An id past the tag's step bits is refused before anything is posted.
      const rz::transfer<const float> bad{1 - comm.rank(), rz::max_message_ids, a.data(), 1};
      x.exchange(std::span<const rz::transfer<const float>>(&bad, 1), {});
    } catch (const rz::invalid_argument&) {
      threw = true;
    }
    CHECK(threw);
    // The copy was drained by the executor's destructor: the stream holds nothing more.
    CHECK(reinterpret_cast<fake_device::stream*>(cache.stream())->work.empty());
  });
}
