// Several ranks, each on a GPU of its own, without a GPU: the fake CUDA runtime
// (support/fake_device.hpp) models one device per rank, a current device per thread, memory and
// streams owned by a device, and refuses what a GPU without peer access would fault on. Ranks are
// threads over loopback, through an NCCL-shaped transport (native collectives on its device's
// memory) and a libfabric-shaped one (messages that move device memory; ringzero's schedules
// with the fake kernels), as support/fake_nccl.hpp describes. Every bug of this kind seen so far
// passed a one-rank world, where every rank's device is device 0.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "fake_device.hpp"
#include "fake_fabric.hpp"
#include "fake_nccl.hpp"
#include "ringzero/collectives.hpp"
#include "ringzero/detail/rank_device.hpp"
#include "ringzero/reduce/reproducible.hpp"
#include "ringzero/transport/loopback.hpp"
#include "zero_harness.hpp"

namespace {

namespace rz = ringzero;
using fake_device::fabric_communicator;
using fake_device::nccl_communicator;
using fake_device::nccl_transport;
using rz::op;

/// The ranks choose their devices by rank here: a launcher's local rank in this process's
/// environment would choose for every thread alike.
void forget_launcher() {
  for (const char* name : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"})
    ::unsetenv(name);
}

/// Each rank of a loopback world of n, as a new process would start: no device chosen yet on its
/// thread (rank 0 runs on the caller's).
template <class F>
void on_ranks(int n, F&& f) {
  rz::loopback::world(n).run([&](rz::loopback::communicator& host) {
    rz::detail::thread_rank_device() = -1;
    fake_device::current = 0;
    f(rz::loopback::transport(host.transport().shared(), host.rank(), host.transport().options()));
  });
}

/// n ranks of the NCCL-shaped transport.
template <class F>
void nccl_ranks(int n, F&& f) {
  on_ranks(n, [&](rz::loopback::transport t) {
    nccl_communicator comm(nccl_transport(std::move(t)));
    f(comm);
  });
}

/// n ranks of the libfabric-shaped transport, rank r's buffers on device r: that transport does
/// not choose a device (libfabric's follows the buffers), so the test does, as a trainer would.
template <class F>
void fabric_ranks(int n, F&& f) {
  rz::loopback::world(n).run([&](rz::loopback::communicator& host) {
    fabric_communicator comm = fake_device::fabric_of(host);
    fake_device::set_device(comm.rank());
    f(comm);
  });
}

/// Rank r's i-th input: small integers, so every sum is exact in float.
float term(int r, std::size_t i) {
  return static_cast<float>((r + 1) * 3 + static_cast<int>(i % 29)) - 14.0f;
}
float sum_of_terms(int n, std::size_t i) {
  float s = 0.0f;
  for (int r = 0; r < n; ++r) s += term(r, i);
  return s;
}

/// Device memory of the current device holding `v`.
std::unique_ptr<fake_device::buffer<float>> on_device(const std::vector<float>& v) {
  auto b = std::make_unique<fake_device::buffer<float>>(v.size());
  if (!v.empty()) std::memcpy(b->data(), v.data(), v.size() * sizeof(float));
  return b;
}

/// Failures of every rank, reported by the main thread.
struct failures {
  std::mutex m;
  std::vector<std::string> list;
  void add(std::string s) {
    std::lock_guard lock(m);
    list.push_back(std::move(s));
  }
  void report() {
    for (const auto& f : list) FAIL_CHECK(f);
    for (const auto& f : fake_device::faults()) FAIL_CHECK(f);
  }
};

}  // namespace

TEST_CASE("NCCL-shaped: a rank's device is current in its thread from construction") {
  // What a trainer allocates after building its communicator (cudaMalloc, on the current
  // device) must be memory its collectives take: on rank r > 0 it was device 0 before.
  forget_launcher();
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    const fake_device::installed fake(n);
    failures bad;
    nccl_ranks(n, [&](nccl_communicator& comm) {
      const int r = comm.rank();
      if (comm.transport().device() != r || fake_device::current_device() != r)
        bad.add(fmt::format("rank {}: transport on device {}, device {} current", r,
                            comm.transport().device(), fake_device::current_device()));
      constexpr std::size_t count = 1000;
      std::vector<float> in(count * static_cast<std::size_t>(n));
      for (std::size_t i = 0; i < in.size(); ++i) in[i] = term(r, i);
      const auto d = on_device(in);
      rz::all_reduce(comm, std::span<float>(d->data(), count), op::sum);
      const auto scattered = on_device(std::vector<float>(count));
      rz::reduce_scatter(comm, std::span<const float>(d->data(), in.size()), scattered->span(),
                         op::sum);
      for (std::size_t i = 0; i < count; ++i)
        if (d->data()[i] != sum_of_terms(n, i)) {
          bad.add(fmt::format("rank {}: all_reduce element {} is {}", r, i, d->data()[i]));
          break;
        }
    });
    bad.report();
  }
}

TEST_CASE("reproducible sums run on the transport's device, not the calling thread's") {
  // A trainer thread that made another device current (a second GPU's work, a library that
  // switched) still gets its sum on the communicator's device: NCCL-shaped (the transport's
  // device) and libfabric-shaped (the buffers' device). Before, the passes' stream, scratch and
  // kernels went to whatever device was current.
  forget_launcher();
  constexpr std::size_t count = 777;
  for (int n : {2, 3}) {
    CAPTURE(n);
    const fake_device::installed fake(n);
    failures bad;
    std::vector<float> want(count);
    std::vector<std::vector<float>> inputs(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
      auto& v = inputs[static_cast<std::size_t>(r)];
      v.resize(count);
      for (std::size_t i = 0; i < count; ++i)
        v[i] = std::ldexp(term(r, i),
                          static_cast<int>((i * 7 + static_cast<std::size_t>(r)) % 60) - 30);
    }
    // The reference: the host path over loopback.
    on_ranks(n, [&](rz::loopback::transport t) {
      rz::loopback::communicator comm(std::move(t));
      std::vector<float> out(count);
      rz::all_reduce(comm, std::span<const float>(inputs[static_cast<std::size_t>(comm.rank())]),
                     std::span<float>(out), op::sum, {.reproducible = true});
      if (comm.rank() == 0) want = out;
    });
    const auto check = [&](auto& comm, const char* shape) {
      const int r = comm.rank();
      const auto d = on_device(inputs[static_cast<std::size_t>(r)]);
      const auto out = on_device(std::vector<float>(count));
      const int other = (r + 1) % n;
      fake_device::set_device(other);
      rz::all_reduce(comm, std::span<const float>(d->span()), out->span(), op::sum,
                     {.reproducible = true});
      if (fake_device::current_device() != other)
        bad.add(fmt::format("{} rank {}: the call left device {} current, not {}", shape, r,
                            fake_device::current_device(), other));
      if (std::memcmp(out->data(), want.data(), count * sizeof(float)) != 0)
        bad.add(fmt::format("{} rank {}: the bits differ from the host's", shape, r));
    };
    nccl_ranks(n, [&](nccl_communicator& comm) { check(comm, "NCCL-shaped"); });
    fabric_ranks(n, [&](fabric_communicator& comm) { check(comm, "libfabric-shaped"); });
    bad.report();
  }
}

TEST_CASE("libfabric-shaped: ringzero's schedules on each rank's own device") {
  // Every schedule reads and writes only its rank's device; a device whose GPUDirect RDMA
  // writes are not ordered gets a flush before a kernel reads received data (the fake runtime
  // refuses such a read otherwise).
  forget_launcher();
  for (bool ordered : {true, false})
    for (int n : {2, 3, 4}) {
      CAPTURE(n);
      CAPTURE(ordered);
      const fake_device::installed fake(n);
      if (!ordered)
        for (int d = 0; d < n; ++d) fake_device::unordered_remote_writes(d);
      failures bad;
      fabric_ranks(n, [&](fabric_communicator& comm) {
        const int r = comm.rank();
        constexpr std::size_t count = 301;
        for (rz::algorithm a : {rz::algorithm::ring, rz::algorithm::tree}) {
          std::vector<float> v(count);
          for (std::size_t i = 0; i < count; ++i) v[i] = term(r, i);
          const auto d = on_device(v);
          rz::all_reduce(comm, d->span(), op::sum, {.algorithm = a});
          for (std::size_t i = 0; i < count; ++i)
            if (d->data()[i] != sum_of_terms(n, i)) {
              bad.add(fmt::format("rank {} {}: all_reduce element {} is {}", r,
                                  rz::algorithm_name(a), i, d->data()[i]));
              break;
            }
        }
        const auto mine = on_device(std::vector<float>(count, static_cast<float>(r)));
        const auto all = on_device(std::vector<float>(count * static_cast<std::size_t>(n)));
        rz::all_gather(comm, std::span<const float>(mine->span()), all->span());
        for (int p = 0; p < n; ++p)
          if (all->data()[static_cast<std::size_t>(p) * count] != static_cast<float>(p))
            bad.add(fmt::format("rank {}: all_gather block {} wrong", r, p));
      });
      bad.report();
      if (!ordered) CHECK(fake_device::global().flushes > 0);
    }
}

TEST_CASE("a rank keeps its device across elastic generations") {
  // Generation 0 has three ranks on devices 0-2; rank 0 leaves, and the survivors are ranks 0
  // and 1 of generation 1. No launcher names a local rank here (as an arrival without
  // LOCAL_RANK, or ranks started by hand): each survivor must stay on the device its memory is
  // on, not move to the device of its new rank.
  forget_launcher();
  const fake_device::installed fake(3);
  failures bad;
  auto gen0 = std::make_shared<rz::loopback::detail::shared_state>(3);
  auto gen1 = std::make_shared<rz::loopback::detail::shared_state>(2);
  // A member that fails leaves the others waiting in its collective: they give up soon.
  const rz::loopback::world_options quick{.timeout = std::chrono::seconds(5)};
  std::vector<std::thread> members;
  for (int id = 0; id < 3; ++id)
    members.emplace_back([&, id] {
      try {
        std::unique_ptr<fake_device::buffer<float>> kept;
        {
          nccl_communicator comm(nccl_transport(rz::loopback::transport(gen0, id, quick)));
          kept = on_device(std::vector<float>(64, static_cast<float>(id)));
          rz::all_reduce(comm, kept->span(), op::sum);
        }
        if (id == 0) return;
        nccl_communicator next(nccl_transport(rz::loopback::transport(gen1, id - 1, quick)));
        if (next.transport().device() != id)
          bad.add(fmt::format("member {} moved from device {} to device {}", id, id,
                              next.transport().device()));
        rz::all_reduce(next, kept->span(), op::sum);
        if (kept->data()[0] != 6.0f)
          bad.add(fmt::format("member {}: generation 1 summed {}", id, kept->data()[0]));
      } catch (const std::exception& e) {
        bad.add(fmt::format("member {}: {}", id, e.what()));
      }
    });
  for (auto& t : members) t.join();
  bad.report();
}

TEST_CASE("the device cache forgets registrations through the transport after a move") {
  // A communicator moved after its first device call keeps its cache, whose callback dropped
  // the transport's registration of scratch memory before freeing it through the old object:
  // after a move that object refused, and the registration outlived its memory.
  forget_launcher();
  const fake_device::installed fake(2);
  failures bad;
  fabric_ranks(2, [&](fabric_communicator& first) {
    const auto call = [&](fabric_communicator& comm, std::size_t count) {
      const auto in = on_device(std::vector<float>(count, 1.5f));
      const auto out = on_device(std::vector<float>(count));
      rz::all_reduce(comm, std::span<const float>(in->span()), out->span(), op::sum,
                     {.reproducible = true});
      if (out->data()[count - 1] != 3.0f) bad.add("wrong sum");
      comm.transport().forget_memory(in->data(), in->span().size_bytes());
      comm.transport().forget_memory(out->data(), out->span().size_bytes());
    };
    call(first, 100);
    fabric_communicator moved(std::move(first));
    call(moved, 100000);  // grows the scratch: the first call's blocks are freed
    if (const std::size_t stale = moved.transport().stale_registrations(); stale != 0)
      bad.add(fmt::format("rank {}: {} registrations outlived their memory", moved.rank(), stale));
  });
  bad.report();
}

TEST_CASE("libfabric-shaped: a new allocation at a freed one's addresses is registered anew") {
  // A buffer freed without forget_memory and allocated again at the same addresses (what
  // cudaFree and cudaMalloc of one size may do) is another allocation: reusing the old
  // registration would let the NIC move the freed pages. The allocation's id tells them apart.
  forget_launcher();
  const fake_device::installed fake(2);
  failures bad;
  fabric_ranks(2, [&](fabric_communicator& comm) {
    const auto d = on_device(std::vector<float>(1000, 1.0f));
    rz::all_reduce(comm, d->span(), op::sum, {.algorithm = rz::algorithm::ring});
    fake_device::reallocate(d->data());
    std::fill_n(d->data(), 1000, 1.0f);
    rz::all_reduce(comm, d->span(), op::sum, {.algorithm = rz::algorithm::ring});
    if (d->data()[999] != 2.0f) bad.add(fmt::format("rank {}: wrong sum", comm.rank()));
    if (const std::size_t stale = comm.transport().stale_registrations(); stale != 0)
      bad.add(fmt::format("rank {}: {} registrations of a freed allocation in use", comm.rank(),
                          stale));
  });
  bad.report();
}

TEST_CASE("host transports refuse device buffers with a clear error") {
  // loopback, shm and sockets move host memory: a GPU buffer would be read on the host (a
  // segfault on a real GPU) unless refused first.
  const fake_device::installed fake(1);
  rz::loopback::world(2).run([&](rz::loopback::communicator& comm) {
    fake_device::buffer<float> d(16);
    std::vector<float> host(16, 1.0f);
    std::string what;
    try {
      rz::all_reduce(comm, d.span(), op::sum);
    } catch (const rz::invalid_argument& e) {
      what = e.what();
    }
    CHECK_MESSAGE(what.find("all_reduce: the input is memory of CUDA device 0, and this "
                            "transport moves host memory only") != std::string::npos,
                  what);
    what.clear();
    try {
      rz::send_recv(comm, std::span<const float>(host), 1 - comm.rank(), d.span(), 1 - comm.rank());
    } catch (const rz::invalid_argument& e) {
      what = e.what();
    }
    CHECK_MESSAGE(what.find("receive buffer is memory of CUDA device 0") != std::string::npos,
                  what);
    rz::all_reduce(comm, std::span<float>(host), op::sum);
    CHECK(host[0] == 2.0f);
  });
}

TEST_CASE("the sharder at stages 0-3 with each rank on its own device") {
  // The sharder over the NCCL-shaped transport, its buffers on each rank's device and its
  // element work refused on any other memory: the trainer's gradients come from memory it
  // allocated after building the communicator. The weights must be bitwise those of host
  // memory over loopback (the transport runs the ring, as the host sharder does).
  forget_launcher();
  const auto layout = zt::make_layout<float>({{37, 5}, {129}, {3, 61, 1}});
  for (int stage = 0; stage <= 3; ++stage)
    for (int n : {2, 3}) {
      CAPTURE(stage);
      CAPTURE(n);
      const fake_device::installed fake(n);
      zt::run_options o;
      o.world = n;
      o.stage = stage;
      o.accumulation = 2;
      const auto host = zt::train<float>(layout, o);
      o.device_gradient = [](std::size_t k) {
        auto* p = static_cast<float*>(fake_device::allocate(std::max<std::size_t>(k, 1) * 4));
        return std::shared_ptr<float[]>(p, [](float* q) { fake_device::release(q); });
      };
      zt::run_result dev;
      dev.params.resize(static_cast<std::size_t>(n));
      dev.memory.resize(static_cast<std::size_t>(n));
      dev.held.resize(static_cast<std::size_t>(n));
      nccl_ranks(n, [&](nccl_communicator& comm) {
        zt::train_rank<rz::zero::sharder<nccl_communicator, float>>(comm, layout, o, dev,
                                                                    [](auto&) {});
      });
      for (int r = 0; r < n; ++r)
        CHECK_MESSAGE(dev.params[static_cast<std::size_t>(r)] == host.params[0], "rank ", r,
                      ": weights differ from host memory's");
      for (const auto& f : fake_device::faults()) FAIL_CHECK(f);
    }
}

TEST_CASE("reproducible training gives one bit pattern on 1-4 devices, stages 0 and 3") {
  forget_launcher();
  const auto layout = zt::make_layout<float>({{37, 5}, {129}});
  std::optional<std::vector<float>> first;
  for (int stage : {0, 3})
    for (int n : {1, 2, 3, 4}) {
      CAPTURE(stage);
      CAPTURE(n);
      const fake_device::installed fake(n);
      zt::run_options o;
      o.world = n;
      o.stage = stage;
      o.accumulation = 12 / n;
      o.contiguous = true;
      o.configure = [](rz::zero::config& c) { c.reproducible = true; };
      o.device_gradient = [](std::size_t k) {
        auto* p = static_cast<float*>(fake_device::allocate(std::max<std::size_t>(k, 1) * 4));
        return std::shared_ptr<float[]>(p, [](float* q) { fake_device::release(q); });
      };
      zt::run_result dev;
      dev.params.resize(static_cast<std::size_t>(n));
      dev.memory.resize(static_cast<std::size_t>(n));
      dev.held.resize(static_cast<std::size_t>(n));
      nccl_ranks(n, [&](nccl_communicator& comm) {
        zt::train_rank<rz::zero::sharder<nccl_communicator, float>>(comm, layout, o, dev,
                                                                    [](auto&) {});
      });
      if (!first) first = dev.params[0];
      for (int r = 0; r < n; ++r)
        CHECK_MESSAGE(dev.params[static_cast<std::size_t>(r)] == *first, "rank ", r,
                      ": weights differ from the first run's");
      for (const auto& f : fake_device::faults()) FAIL_CHECK(f);
    }
}

TEST_CASE("the sharder's teardown after an abort waits for the compute stream") {
  // The communicator is aborted with a gradient still queued on the (slow) compute stream: its
  // host waits are refused from then on, and the sharder must still drain both streams before
  // freeing the buffers that work writes. Half of the bucket is handed over, so no collective
  // is in flight.
  forget_launcher();
  const auto layout = zt::make_layout<float>({{4096, 4096}});
  const fake_device::installed fake(2);
  failures bad;
  on_ranks(2, [&](rz::loopback::transport t) {
    nccl_communicator comm(
        nccl_transport(std::move(t), {.compute_latency = std::chrono::microseconds(20000)}));
    const auto grad = on_device(std::vector<float>(4096, 0.25f));
    {
      rz::zero::config cfg;
      cfg.stage = 2;
      rz::zero::sharder<nccl_communicator, float> shd(comm, layout, cfg);
      shd.add_grad(1, std::span<const float>(grad->span()));
      comm.abort("a peer died");
    }
  });
  bad.report();
}
