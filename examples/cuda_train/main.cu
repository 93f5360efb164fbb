// ringzero-cuda-train: the sharder on GPU memory over NCCL, as a CUDA trainer uses it. Each
// layer's weights are gathered on the device, a "backward" kernel on the trainer's stream writes
// the layer's gradient into device memory, add_grad hands that buffer over (accumulated on the
// same stream, reduced on the communicator's), and step() runs the fused optimizer on the shard.
// The model fits random targets (a quadratic loss with noisy samples), so the loss must fall.
//
//   ringzero-cuda-train [--stage 0-3] [--steps N] [--micro-batches K] [--save DIR]
//                       [--checkpoint-every K] [--reproducible]
//   ringzero-run -n 2 ringzero-cuda-train --stage 3       (one rank per GPU)
//   ringzero-run -n 2 --elastic 1:2 ringzero-cuda-train --steps 200 --checkpoint-every 10
//
// The communicator makes the rank's GPU current when it is built (nccl/transport.hpp), so the
// trainer's stream and memory, made after it, are on the GPU its collectives use. Every host wait
// on the device goes through the communicator (comm.transport().wait_idle): a deadline, and an
// error naming the failure, where cudaStreamSynchronize would wait forever behind a collective
// whose peer died. Under ringzero-run --elastic a rank that dies ends its generation: the
// survivors form the next one (ncclCommShrink where NCCL has it), load the last checkpoint
// (--save, every --checkpoint-every steps) and go on; the run then ends like any other.
//
// Without a GPU it says so and exits with status 77 (a skip, for test drivers).
#include <cuda_runtime.h>
#include <fmt/core.h>

#include <ringzero/elastic.hpp>
#include <ringzero/elastic/nccl.hpp>
#include <ringzero/kernels/element.hpp>
#include <ringzero/ringzero.hpp>
#include <ringzero/transport/nccl.hpp>
#include <ringzero/zero/detail/crc32c.hpp>
#include <ringzero/zero/sharder.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace {

namespace zero = ringzero::zero;
using ringzero::bfloat16;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

__device__ float target_of(int param, std::size_t i) {
  return 0.25f * __sinf(0.37f * static_cast<float>(param + 1) * static_cast<float>(i + 1));
}

__device__ float sample_noise(int sample, std::size_t i) {
  return 0.05f * __cosf(1.3f * static_cast<float>(sample + 3) * static_cast<float>(i + 7));
}

/// grad[i] = loss_scale * mean over this rank's samples of (w[i] - target + noise), and the
/// loss 0.5 * (w - target)^2 summed into *loss.
__global__ void backward(const bfloat16* w, float* grad, float* loss, std::size_t n, int param,
                         int first_sample, int samples, float loss_scale) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float d = ringzero::kernels::to_float(w[i]) - target_of(param, i);
    float g = 0.0f;
    for (int s = first_sample; s < first_sample + samples; ++s) g += d + sample_noise(s, i);
    grad[i] = loss_scale * g / static_cast<float>(samples);
    atomicAdd(loss, 0.5f * d * d);
  }
}

/// A CUDA stream that is destroyed with its scope.
class owned_stream {
 public:
  owned_stream() {
    check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~owned_stream() { static_cast<void>(cudaStreamDestroy(s_)); }
  owned_stream(const owned_stream&) = delete;
  owned_stream& operator=(const owned_stream&) = delete;
  [[nodiscard]] cudaStream_t get() const noexcept { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

/// What each step cost the device (zero::device_counters) and how long it took, from the first
/// micro-batch to step()'s return. From the third step on, a step must wait on the host once (the
/// overflow and norm verdict), launch the statistics once, and create no event and take no
/// memory from the driver: the first two steps warm the pools.
struct step_budget {
  static constexpr int warm = 2;
  std::vector<zero::device_counters> per_step;
  std::vector<double> ms;
  std::vector<std::uint64_t> reserved;

  void add(const zero::device_counters& a, const zero::device_counters& b, std::uint64_t pool_bytes,
           std::chrono::steady_clock::duration took) {
    per_step.push_back({b.launches - a.launches, b.statistics_launches - a.statistics_launches,
                        b.host_syncs - a.host_syncs, b.events_created - a.events_created,
                        b.driver_allocations - a.driver_allocations});
    ms.push_back(std::chrono::duration<double, std::milli>(took).count());
    reserved.push_back(pool_bytes);
  }
};

struct args {
  int stage = 2;
  int steps = 20;
  int micro_batches = 2;
  std::string save;
  int checkpoint_every = 0;   ///< save to `save` every this many steps (0: at the end only)
  bool reproducible = false;  ///< config::reproducible; prints the weights' crc32c
};

args parse(int argc, char** argv) {
  args a;
  for (int i = 1; i < argc; ++i) {
    const std::string_view k = argv[i];
    if (k == "--reproducible") {
      a.reproducible = true;
      continue;
    }
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    if (v == nullptr) throw ringzero::invalid_argument(fmt::format("{} needs a value", k));
    if (k == "--stage")
      a.stage = std::atoi(v);
    else if (k == "--steps")
      a.steps = std::atoi(v);
    else if (k == "--micro-batches")
      a.micro_batches = std::atoi(v);
    else if (k == "--save")
      a.save = v;
    else if (k == "--checkpoint-every")
      a.checkpoint_every = std::atoi(v);
    else
      throw ringzero::invalid_argument(fmt::format("unknown option {}", k));
    ++i;
  }
  return a;
}

/// Pinned host memory for one value the device writes: a copy into it is asynchronous, so the
/// host waits for it only through the communicator's deadline-bounded wait.
template <class T>
class pinned {
 public:
  pinned() { check(cudaMallocHost(&p_, sizeof(T)), "cudaMallocHost"); }
  ~pinned() { static_cast<void>(cudaFreeHost(p_)); }
  pinned(const pinned&) = delete;
  pinned& operator=(const pinned&) = delete;
  [[nodiscard]] T* get() const noexcept { return p_; }

 private:
  T* p_ = nullptr;
};

/// The first sample of micro-batch m on `rank`: the global batch is world * micro_batches
/// micro-batches of `per` samples; reproducible training gives each rank a contiguous run of
/// them, so the sum over the batch does not depend on how many ranks share it.
int first_sample(const args& a, int m, int rank, int world, int per) {
  return (a.reproducible ? rank * a.micro_batches + m : m * world + rank) * per;
}

/// Prints the budget line the GPU check reads, and whether every warm step kept to it: one host
/// wait and one statistics launch a step; with --reproducible five host waits (the exact norm's
/// bins read, two words agreed through device memory) and no statistics launch
/// (test_zero_reproducible holds the emulated device to the same).
bool report_budget(int rank, const args& a, const step_budget& b) {
  const std::uint64_t waits = a.reproducible ? 5 : 1, statistics = a.reproducible ? 0 : 1;
  bool ok = true;
  double total_ms = 0;
  std::size_t warm_steps = 0;
  zero::device_counters worst{};
  for (std::size_t s = step_budget::warm; s < b.per_step.size(); ++s) {
    const auto& c = b.per_step[s];
    ok = ok && c.host_syncs == waits && c.statistics_launches == statistics &&
         c.events_created == 0 && c.driver_allocations == 0 &&
         b.reserved[s] == b.reserved[step_budget::warm - 1];
    worst.launches = std::max(worst.launches, c.launches);
    worst.statistics_launches = std::max(worst.statistics_launches, c.statistics_launches);
    worst.host_syncs = std::max(worst.host_syncs, c.host_syncs);
    worst.events_created = std::max(worst.events_created, c.events_created);
    worst.driver_allocations = std::max(worst.driver_allocations, c.driver_allocations);
    total_ms += b.ms[s];
    ++warm_steps;
  }
  if (rank == 0 && warm_steps > 0)
    fmt::print(
        "budget: stage {}, {} warm steps, {:.3f} ms per step; per step at most {} launches, {} "
        "statistics launch(es), {} host sync(s), {} events created, {} driver allocations; pool "
        "{} B -> {} B: {}\n",
        a.stage, warm_steps, total_ms / static_cast<double>(warm_steps), worst.launches,
        worst.statistics_launches, worst.host_syncs, worst.events_created, worst.driver_allocations,
        b.reserved[step_budget::warm - 1], b.reserved.back(), ok ? "ok" : "OVER BUDGET");
  return ok;
}

/// What train() returns when `regroup` asked for a new generation.
constexpr int regroup_status = -1;

/// Trains on `comm` until step a.steps, from the checkpoint in a.save when `resume` finds one
/// there; saves there every a.checkpoint_every steps and at the end. After each of those saves
/// `regroup` (collective; empty: never) may end the run early, for processes waiting to join:
/// then it returns regroup_status. Otherwise it returns the exit status.
int train(ringzero::nccl::communicator& comm, const args& a, bool resume,
          const std::function<bool()>& regroup = {}) {
  // docs-begin: setup
  // from_env() made this rank's GPU current: the stream and memory below are on it.
  const int rank = comm.rank();

  zero::model_layout layout;
  const std::vector<std::vector<std::size_t>> layers{{4096, 64}, {65536}, {1000, 3, 30000}};
  for (std::size_t l = 0; l < layers.size(); ++l) {
    layout.add_layer(fmt::format("layer{}", l));
    for (std::size_t p = 0; p < layers[l].size(); ++p)
      layout.add({.name = fmt::format("l{}.p{}", l, p),
                  .shape = {layers[l][p]},
                  .type = ringzero::dtype::bfloat16,
                  .weight_decay = p == 0});
  }
  zero::config cfg;
  cfg.stage = a.stage;
  cfg.optimizer.lr = 1e-2f;
  cfg.accumulation_steps = a.micro_batches;
  cfg.max_grad_norm = 1.0f;
  cfg.reduce_dtype = ringzero::dtype::float32;  // bf16 parameters, fp32 gradient reduction
  cfg.reproducible = a.reproducible;

  // The trainer's stream: forward and backward run there, the sharder orders its work with it.
  // Declared before the sharder so that it outlives it: the sharder's destructor waits on it and
  // frees stage-3 buckets in its order.
  const owned_stream stream;
  cudaStream_t compute = stream.get();
  zero::sharder<ringzero::nccl::communicator, bfloat16> shd(comm, layout, cfg);
  shd.space().set_compute_stream(compute);
  const auto& plan = shd.plan();
  for (std::size_t p = 0; p < plan.params().size(); ++p)
    shd.set_parameter(static_cast<int>(p), std::vector<float>(plan.params()[p].numel, 0.0f));

  // docs-end: setup
  const bool resumed =
      resume && !a.save.empty() &&
      std::filesystem::exists(std::filesystem::path(a.save) / zero::manifest_file_name);
  if (resumed) shd.load(a.save);
  // One device gradient buffer per parameter, as a framework's .grad tensors, and the loss.
  std::vector<float*> grads(plan.params().size());
  for (std::size_t p = 0; p < grads.size(); ++p)
    check(cudaMalloc(&grads[p], plan.params()[p].numel * sizeof(float)), "cudaMalloc");
  float* loss = nullptr;
  check(cudaMalloc(&loss, sizeof(float)), "cudaMalloc");
  const pinned<float> host_loss;

  constexpr int batch = 64;
  const int per = batch / (comm.size() * a.micro_batches);
  const int nl = static_cast<int>(plan.layers().size());
  float first_loss = 0.0f, last_loss = 0.0f;
  step_budget budget;
  const int first_step = static_cast<int>(shd.step_count());
  // Saves every a.checkpoint_every steps; true when `regroup` then stops the run here.
  bool regrouping = false;
  const auto checkpoint = [&](int step) {
    if (a.checkpoint_every <= 0 || a.save.empty() || (step + 1) % a.checkpoint_every != 0)
      return false;
    shd.save(a.save);
    regrouping = regroup && step + 1 < a.steps && regroup();
    return regrouping;
  };
  // docs-begin: loop
  for (int step = first_step; step < a.steps; ++step) {
    const auto before = shd.space().counters();
    const auto started = std::chrono::steady_clock::now();
    check(cudaMemsetAsync(loss, 0, sizeof(float), compute), "cudaMemsetAsync");
    for (int m = 0; m < a.micro_batches; ++m) {
      for (int l = 0; l < nl; ++l) (void)shd.gather(l);  // forward: the layer is present
      for (int l = nl - 1; l >= 0; --l) {
        auto w = shd.gather(l, zero::pass::backward);
        const auto& li = plan.layers()[static_cast<std::size_t>(l)];
        for (int p = li.first_param + li.param_count - 1; p >= li.first_param; --p) {
          const auto wp = w.param(p);
          const std::size_t n = wp.size();
          backward<<<static_cast<unsigned>((n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024), 256, 0,
                     compute>>>(wp.data(), grads[static_cast<std::size_t>(p)], loss, n, p,
                                first_sample(a, m, rank, comm.size(), per), per, shd.loss_scale());
          check(cudaGetLastError(), "backward");
          shd.add_grad(p, std::span<const float>(grads[static_cast<std::size_t>(p)], n));
        }
      }
      shd.end_micro_batch();
    }
    const auto r = shd.step();
    budget.add(before, shd.space().counters(), shd.space().pool_reserved_bytes(),
               std::chrono::steady_clock::now() - started);
    // The loss summed over ranks, on the device: the communication stream waits for the
    // backward kernels that wrote it (an event, no host wait), and the host waits for the sum
    // through the communicator, with its deadline, never with cudaStreamSynchronize.
    shd.space().wait(shd.space().comm_stream(), shd.space().record(compute));
    shd.run_collective(
        [&](auto& c) { ringzero::all_reduce(c, std::span<float>(loss, 1), ringzero::op::sum); });
    check(cudaMemcpyAsync(host_loss.get(), loss, sizeof(float), cudaMemcpyDeviceToHost,
                          comm.transport().stream()),
          "cudaMemcpyAsync");
    comm.transport().wait_idle(comm.transport().stream());
    if (rank == 0)
      fmt::print("step {:3d}  loss {:.6f}  grad norm {:.4f}{}\n", step,
                 *host_loss.get() / a.micro_batches, r.grad_norm, r.skipped ? "  (skipped)" : "");
    (step == first_step ? first_loss : last_loss) = *host_loss.get();
    if (checkpoint(step)) break;
  }
  // docs-end: loop
  if (regrouping) {
    shd.synchronize();
    for (float* g : grads) static_cast<void>(cudaFree(g));
    static_cast<void>(cudaFree(loss));
    return regroup_status;
  }
  if (!a.save.empty()) shd.save(a.save);
  if (a.reproducible) {
    // The weights' checksum: the same on every world size that divides the micro-batches.
    const auto full = shd.full_parameters();
    if (rank == 0)
      fmt::print("crc32c {:08x}\n", ringzero::zero::detail::crc32c(std::as_bytes(std::span(full))));
  }
  const auto m = shd.memory();
  if (rank == 0)
    fmt::print("rank 0 holds {} B of parameters, {} B of gradients, {} B of optimizer state\n",
               m.parameters, m.gradients, m.optimizer);
  // A fitting run lowers the loss: a sharder that dropped gradients or updates would not. A
  // generation that resumed from a checkpoint starts where the fit has already levelled out.
  const bool learned = resumed || a.steps - first_step < 2 || last_loss < 0.8f * first_loss;
  if (rank == 0 && !learned)
    std::fprintf(stderr, "ringzero-cuda-train: the loss did not fall (%g -> %g)\n", first_loss,
                 last_loss);
  shd.synchronize();
  for (float* g : grads) static_cast<void>(cudaFree(g));
  static_cast<void>(cudaFree(loss));
  const bool in_budget = report_budget(rank, a, budget);
  return learned && in_budget ? 0 : 1;
}

/// Under ringzero-run --elastic: generations of the job until one finishes the run. A failure
/// that cost a member (the launcher reaped it, its heartbeat stopped, or the error names it) ends
/// the generation; the survivors form the next one and resume from the last checkpoint.
int run_elastic(args a) {
  constexpr int batch = 64;
  const int micro = a.micro_batches;
  auto s =
      ringzero::elastic::session::from_env([micro](int n) { return batch % (n * micro) == 0; });
  s.join();
  if (a.save.empty())
    a.save = (std::filesystem::temp_directory_path() /
              fmt::format("ringzero-cuda-train-{:016x}",
                          ringzero::bootstrap::detail::fnv1a(
                              ringzero::detail::getenv_str("RINGZERO_TOKEN").value_or(""))))
                 .string();
  std::optional<ringzero::nccl::communicator> comm;
  comm.emplace(s.communicator<ringzero::nccl::communicator>());
  // At a checkpoint: whether processes wait to join (rank 0 asks, every rank acts on its answer).
  const auto arrivals = [&] {
    int waiting = comm->rank() == 0 ? s.waiting() : 0;
    ringzero::broadcast(*comm, std::span<int>(&waiting, 1), 0);
    return waiting > 0;
  };
  for (;;) {
    const ringzero::elastic::membership before = s.current();
    try {
      const int status = train(*comm, a, true, arrivals);
      if (status == regroup_status) {
        s.grow();
        comm.emplace(s.communicator<ringzero::nccl::communicator>());
        if (s.current().rank == 0)
          fmt::print("elastic: generation {}: {} ranks (took in {} member(s)), resuming from {}\n",
                     s.current().generation, s.current().size(), s.current().arrived.size(),
                     a.save);
        continue;
      }
      if (before.rank == 0) s.finish();
      return status;
    } catch (const ringzero::error& e) {
      const auto c = e.code();
      if (c != ringzero::errc::peer_failure && c != ringzero::errc::timeout &&
          c != ringzero::errc::transport)
        throw;
      int who = comm->failed_rank();
      if (who < 0)
        if (const auto* pe = dynamic_cast<const ringzero::peer_error*>(&e)) who = pe->peer();
      std::fprintf(stderr,
                   "ringzero-cuda-train: generation %llu failed (%s); the survivors go on\n",
                   static_cast<unsigned long long>(before.generation), e.what());
      s.shrink(who);
      if (s.current().lost.empty()) throw;  // nothing elasticity can fix
      comm.emplace(ringzero::nccl::next_generation(s, *comm, before));
      if (s.current().rank == 0)
        fmt::print("elastic: generation {}: {} ranks (lost {} member(s)), resuming from {}\n",
                   s.current().generation, s.current().size(), s.current().lost.size(), a.save);
    }
  }
}

int run(const args& a) {
  if (ringzero::elastic::session::enabled()) return run_elastic(a);
  auto comm = ringzero::nccl::communicator::from_env();
  return train(comm, a, false);
}

}  // namespace

int main(int argc, char** argv) {
  // A line at a time even into a pipe or a file (a launcher's, Slurm's, `> log`): progress is
  // read while the job runs, not when it exits.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  try {
    const args a = parse(argc, argv);
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      std::fprintf(stderr, "ringzero-cuda-train: skipped: no CUDA device is visible\n");
      return 77;
    }
    return run(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ringzero-cuda-train: %s\n", e.what());
    return 1;
  }
}
