// The sharder on a real GPU (zero::cuda_device_space over a one-rank NCCL communicator): what only
// a device shows. Built wherever nvcc and NCCL are, run by scripts/gpu_check.sh; without a GPU
// every case says so and CTest reports a skip. The same file is compiled a second time with
// --default-stream per-thread (test_zero_sharder_cuda_per_thread), where the default stream a
// trainer's unqualified work goes to is the thread's own and not the legacy stream. That second
// build also instantiates every member of the sharder over NCCL on the CUDA space for each
// parameter type (the end of this file), so CI fails the moment any of it stops compiling under
// nvcc, tested or not.
//
//   - the weights equal those of host memory, bit for bit, at every stage (one rank, no
//     clipping: every value is element-wise arithmetic the kernels share with the host);
//   - in reproducible mode (config::reproducible, clipped) they equal host memory's at 1, 2 and
//     3 ranks;
//   - a warm step waits on the host once, launches the statistics once, creates no event and
//     takes no memory from the driver (device_counters and the pool's reserved bytes); that pool
//     is the space's own, the device's default one left as it was;
//   - a stream that never drains makes step(), synchronize() and the destructor raise
//     timeout_error within the deadline instead of hanging, and destroying the sharder after
//     the abort does not reach the freed NCCL communicator.
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include "stream_gate.hpp"

#include <ringzero/transport/loopback.hpp>
#include <ringzero/transport/nccl.hpp>
#include <ringzero/zero/sharder.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

using test_support::stream_gate;

namespace {

namespace zero = ringzero::zero;
namespace nccl = ringzero::nccl;
using ringzero::bfloat16;
using namespace std::chrono_literals;

bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) return true;
  static_cast<void>(cudaGetLastError());
  MESSAGE("no CUDA device is visible; skipping");
  return false;
}

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) FAIL(what << ": " << cudaGetErrorString(e));
}

zero::model_layout layout() {
  zero::model_layout l;
  const std::vector<std::vector<std::size_t>> layers{{4096, 63}, {20000}, {1000, 3, 7001}};
  for (std::size_t li = 0; li < layers.size(); ++li) {
    l.add_layer("layer" + std::to_string(li));
    for (std::size_t p = 0; p < layers[li].size(); ++p)
      l.add({.name = "l" + std::to_string(li) + ".p" + std::to_string(p),
             .shape = {layers[li][p]},
             .type = ringzero::dtype::bfloat16,
             .weight_decay = p == 0});
  }
  return l;
}

zero::config config(int stage) {
  zero::config c;
  c.stage = stage;
  c.optimizer.lr = 1e-2f;
  c.accumulation_steps = 2;
  c.bucket_bytes = 16 << 10;  // several buckets, so stage 3 gathers and frees each step
  return c;
}

/// The gradient of element i of parameter p at (step, micro-batch): any fixed values do.
float grad_value(int p, std::size_t i, int step, int micro) {
  const auto x = static_cast<std::uint32_t>(i * 2654435761u + static_cast<std::uint32_t>(p) * 97u +
                                            static_cast<std::uint32_t>(step * 31 + micro));
  return static_cast<float>(static_cast<int>(x % 2001u) - 1000) * 1e-3f;
}

float initial_value(int p, std::size_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + static_cast<std::size_t>(p) * 13) % 101) -
                            50) *
         1e-2f;
}

/// Trains `steps` steps and returns the final parameters (as float, in layout order). `after`
/// sees the sharder after each step. Each step takes `micros` micro-batches, numbered from
/// `first_micro` (a rank's contiguous run of the global batch in reproducible training).
template <class Comm, class Hand, class After>
std::vector<float> train(zero::sharder<Comm, bfloat16>& shd, int steps, Hand&& hand, After&& after,
                         int micros = 2, int first_micro = 0) {
  const auto& plan = shd.plan();
  const int n = static_cast<int>(plan.params().size());
  for (int p = 0; p < n; ++p) {
    std::vector<float> v(plan.params()[static_cast<std::size_t>(p)].numel);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = initial_value(p, i);
    shd.set_parameter(p, v);
  }
  for (int s = 0; s < steps; ++s) {
    for (int m = first_micro; m < first_micro + micros; ++m) {
      for (int l = static_cast<int>(plan.layers().size()) - 1; l >= 0; --l) {
        auto held = shd.gather(l, zero::pass::backward);
        const auto& li = plan.layers()[static_cast<std::size_t>(l)];
        for (int p = li.first_param + li.param_count - 1; p >= li.first_param; --p) {
          std::vector<float> g(plan.params()[static_cast<std::size_t>(p)].numel);
          for (std::size_t i = 0; i < g.size(); ++i) g[i] = grad_value(p, i, s, m);
          hand(p, g);
        }
      }
      shd.end_micro_batch();
    }
    (void)shd.step();
    after(s);
  }
  return shd.full_parameters();
}

std::vector<float> on_host(int stage, int steps) {
  std::vector<float> r;
  ringzero::loopback::world w(1);
  w.run([&](ringzero::loopback::communicator& comm) {
    zero::sharder<ringzero::loopback::communicator, bfloat16> shd(comm, layout(), config(stage));
    r = train(
        shd, steps, [&](int p, const std::vector<float>& g) { shd.add_grad(p, std::span(g)); },
        [](int) {});
  });
  return r;
}

/// Hands gradient g of parameter p over from device memory `dev`, as a trainer whose backward
/// wrote it there on the compute stream. The pageable copy returns once the source is read; the
/// next one may reuse dev only after add_grad's work, which is ordered behind it on that stream
/// (or, in reproducible mode, done before add_grad returns).
template <class Comm>
void hand_from_device(zero::sharder<Comm, bfloat16>& shd, float* dev, int p,
                      const std::vector<float>& g) {
  ok(cudaMemcpyAsync(dev, g.data(), g.size() * sizeof(float), cudaMemcpyHostToDevice,
                     shd.space().compute_stream()),
     "cudaMemcpyAsync");
  shd.add_grad(p, std::span<const float>(dev, g.size()));
}

/// Reproducible training: a global batch of 6 micro-batches, each of `world` ranks taking a
/// contiguous run, clipped (the exact global norm decides the factor).
zero::config exact_config(int stage, int world) {
  zero::config c = config(stage);
  c.accumulation_steps = 6 / world;
  c.reproducible = true;
  c.max_grad_norm = 1.0f;
  return c;
}

/// The same training on host memory over `world` loopback ranks: rank 0's weights.
std::vector<float> exact_on_host(int stage, int world, int steps) {
  std::vector<float> r;
  ringzero::loopback::world w(world);
  w.run([&](ringzero::loopback::communicator& comm) {
    zero::sharder<ringzero::loopback::communicator, bfloat16> shd(comm, layout(),
                                                                  exact_config(stage, world));
    const int micros = 6 / world;
    auto got = train(
        shd, steps, [&](int p, const std::vector<float>& g) { shd.add_grad(p, std::span(g)); },
        [](int) {}, micros, comm.rank() * micros);
    if (comm.rank() == 0) r = std::move(got);
  });
  return r;
}

std::size_t bits_differ(const std::vector<float>& a, const std::vector<float>& b) {
  std::size_t d = a.size() == b.size() ? 0 : std::max(a.size(), b.size());
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    d += std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i]);
  return d;
}

}  // namespace

TEST_CASE("on a GPU: reproducible training gives the bits of host memory at 1, 2 and 3 ranks") {
  if (!have_gpu()) return;
  constexpr int steps = 3;
  for (int stage : {0, 3}) {
    CAPTURE(stage);
    const auto host1 = exact_on_host(stage, 1, steps);
    // The host runs agree among themselves (what config::reproducible promises), so the GPU's
    // single rank is compared with every world size at once.
    CHECK(bits_differ(exact_on_host(stage, 2, steps), host1) == 0);
    CHECK(bits_differ(exact_on_host(stage, 3, steps), host1) == 0);
    auto comm = nccl::communicator::single();
    float* dev = nullptr;
    ok(cudaMalloc(&dev, 20000 * sizeof(float)), "cudaMalloc");
    const auto on_gpu = [&](bool reproducible) {
      zero::config c = exact_config(stage, 1);
      c.reproducible = reproducible;
      zero::sharder<nccl::communicator, bfloat16> shd(comm, layout(), c);
      return train(
          shd, steps, [&](int p, const std::vector<float>& g) { hand_from_device(shd, dev, p, g); },
          [](int) {}, 6, 0);
    };
    const auto got = on_gpu(true);
    const std::size_t differ = bits_differ(got, host1);
    CHECK_MESSAGE(differ == 0, differ, " of ", got.size(), " weights differ from host memory's");
    // Without the option the device sums in float, in its own order: for comparison only.
    MESSAGE("stage ", stage, ": without config::reproducible ", bits_differ(on_gpu(false), host1),
            " of ", got.size(), " weights differ");
    ok(cudaFree(dev), "cudaFree");
  }
}

TEST_CASE(
    "on a GPU: every stage gives the weights of host memory, and a warm step keeps to its budget") {
  if (!have_gpu()) return;
  constexpr int steps = 6;
  for (int stage = 0; stage <= 3; ++stage) {
    CAPTURE(stage);
    const auto host = on_host(stage, steps);
    auto comm = nccl::communicator::single();
    zero::sharder<nccl::communicator, bfloat16> shd(comm, layout(), config(stage));
    // The trainer's work goes to this translation unit's default stream (the compute stream's
    // default): the legacy stream, or the thread's own under --default-stream per-thread.
    float* dev = nullptr;
    ok(cudaMalloc(&dev, 20000 * sizeof(float)), "cudaMalloc");
    std::vector<zero::device_counters> per_step;
    std::vector<std::uint64_t> reserved;
    zero::device_counters before = shd.space().counters();
    const auto got = train(
        shd, steps, [&](int p, const std::vector<float>& g) { hand_from_device(shd, dev, p, g); },
        [&](int) {
          const auto now = shd.space().counters();
          per_step.push_back(
              {now.launches - before.launches, now.statistics_launches - before.statistics_launches,
               now.host_syncs - before.host_syncs, now.events_created - before.events_created,
               now.driver_allocations - before.driver_allocations});
          reserved.push_back(shd.space().pool_reserved_bytes());
          before = now;
        });
    REQUIRE(got.size() == host.size());
    std::size_t differ = 0;
    for (std::size_t i = 0; i < got.size(); ++i)
      differ += std::bit_cast<std::uint32_t>(got[i]) != std::bit_cast<std::uint32_t>(host[i]);
    CHECK_MESSAGE(differ == 0, differ, " of ", got.size(), " weights differ from host memory's");
    for (std::size_t s = 2; s < per_step.size(); ++s) {
      CAPTURE(s);
      CHECK(per_step[s].host_syncs == 1);
      CHECK(per_step[s].statistics_launches == 1);
      CHECK(per_step[s].events_created == 0);
      CHECK(per_step[s].driver_allocations == 0);
      CHECK(reserved[s] == reserved[1]);
    }
    MESSAGE("stage ", stage, ": a warm step launches ", per_step.back().launches,
            " kernels or memsets, waits on the host ", per_step.back().host_syncs,
            " time(s); pool ", reserved.back(), " B");
    ok(cudaFree(dev), "cudaFree");
  }
}

TEST_CASE(
    "on a GPU: the space's buckets come from a pool of its own, the default pool left as it was") {
  if (!have_gpu()) return;
  // The device's default pool is the process's: NCCL's stream-ordered scratch and the trainer's
  // cudaMallocAsync come from it. Its release threshold stays where it was (0 unless the program
  // changed it), so what they free goes back to the driver, within reach of NCCL's own buffers.
  auto comm = nccl::communicator::single();
  cudaMemPool_t shared = nullptr;
  ok(cudaDeviceGetDefaultMemPool(&shared, comm.transport().device()), "default pool");
  std::uint64_t before = 0, after = 0;
  ok(cudaMemPoolGetAttribute(shared, cudaMemPoolAttrReleaseThreshold, &before), "threshold");
  {
    zero::sharder<nccl::communicator, bfloat16> shd(comm, layout(), config(3));
    for (int l = 0; l < static_cast<int>(shd.plan().layers().size()); ++l) (void)shd.gather(l);
    shd.synchronize();
    const std::uint64_t held = shd.space().pool_reserved_bytes();
    CHECK(held > 0);
    shd.space().trim_pool();  // hands back what no bucket the cache keeps uses
    MESSAGE("the space's pool: ", held, " B, ", shd.space().pool_reserved_bytes(),
            " B after trim_pool()");
    CHECK(shd.space().pool_reserved_bytes() <= held);
    ok(cudaMemPoolGetAttribute(shared, cudaMemPoolAttrReleaseThreshold, &after), "threshold");
    CHECK(after == before);
  }
}

TEST_CASE("on a GPU: a stream that never drains times out in step(), and the sharder closes") {
  if (!have_gpu()) return;
  // in_step: the communication stream is held, so step()'s statistics never arrive; otherwise
  // the trainer's stream is held and synchronize() waits on it. Before the waits had deadlines,
  // both returned normally once the gate opened (or never, had it stayed shut).
  for (const bool in_step : {true, false}) {
    CAPTURE(in_step);
    auto comm = nccl::communicator(nccl::transport::single({.timeout = 1s}));
    cudaStream_t trainer = nullptr;
    ok(cudaStreamCreateWithFlags(&trainer, cudaStreamNonBlocking), "cudaStreamCreate");
    float* dev = nullptr;
    ok(cudaMalloc(&dev, 20000 * sizeof(float)), "cudaMalloc");
    stream_gate gate;
    std::thread opener;
    {
      zero::config cfg = config(0);
      cfg.accumulation_steps = 1;
      for (auto* o : {&cfg.collectives.all_reduce, &cfg.collectives.reduce_scatter,
                      &cfg.collectives.all_gather})
        o->timeout = 1s;
      zero::sharder<nccl::communicator, bfloat16> shd(comm, layout(), cfg);
      shd.space().set_compute_stream(trainer);
      const auto start = std::chrono::steady_clock::now();
      ok(cudaLaunchHostFunc(in_step ? comm.transport().stream() : trainer, &stream_gate::hold,
                            &gate),
         "cudaLaunchHostFunc");
      // Opens the gate late whatever happens: ncclCommAbort waits for the work queued ahead of
      // NCCL's on its stream, so the abort returns once the gate opens.
      opener = std::thread([&] {
        std::this_thread::sleep_for(4s);
        gate.open = true;
      });
      try {
        if (in_step) {
          const auto& plan = shd.plan();
          for (int p = static_cast<int>(plan.params().size()) - 1; p >= 0; --p)
            shd.add_grad(
                p, std::span<const float>(dev, plan.params()[static_cast<std::size_t>(p)].numel));
          shd.end_micro_batch();
          (void)shd.step();
        } else {
          shd.synchronize();
        }
        FAIL("expected timeout_error");
      } catch (const ringzero::timeout_error& e) {
        const auto waited = std::chrono::steady_clock::now() - start;
        MESSAGE("raised after ",
                std::chrono::duration_cast<std::chrono::milliseconds>(waited).count(),
                " ms: ", e.what());
      }
      CHECK(comm.transport().aborted());
      // The sharder goes here, after the abort freed the communicator: its registered memory
      // must not be deregistered through the freed handle, and its destructor must not hang.
    }
    opener.join();
    ok(cudaStreamSynchronize(trainer), "cudaStreamSynchronize");
    ok(cudaStreamDestroy(trainer), "cudaStreamDestroy");
    ok(cudaFree(dev), "cudaFree");
  }
}

#ifdef RINGZERO_SHARDER_EVERY_MEMBER
// What a trainer's .cu writes: every member of zero::sharder over nccl::communicator on its
// device memory space (zero/cuda_space.cuh: device buffers, streams and events, the kernels of
// kernels/cuda/), for every parameter type and both gradient types (the reducers of the
// parameter type and of fp32 are both instantiated). Here and not in a file of its own: nvcc
// parses the sharder three times per file (cudafe++, cicc, the host compiler), so a separate
// file cost 38 s of CPU where this costs 6.
static_assert(std::is_same_v<ringzero::zero::memory_space_t<ringzero::nccl::communicator>,
                             ringzero::zero::cuda_device_space>,
              "a CUDA translation unit gets the NCCL communicator's device memory space");
static_assert(ringzero::zero::device_space<ringzero::zero::cuda_device_space>);

template class ringzero::zero::sharder<ringzero::nccl::communicator, float>;
template class ringzero::zero::sharder<ringzero::nccl::communicator, ringzero::bfloat16>;
template class ringzero::zero::sharder<ringzero::nccl::communicator, ringzero::float16>;
#endif
