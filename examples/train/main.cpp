// ringzero-train: a small but real data-parallel training run on the ZeRO sharder. An MLP learns
// to imitate a random teacher network; the global batch is fixed and split across ranks, so a
// run gives the same loss curve at any world size and any ZeRO stage.
//
//   ringzero-train -n 4 --stage 3 --precision bf16 --steps 20
//   ringzero-train -n 4 --steps 10 --save ckpt && ringzero-train -n 2 --steps 20 --resume ckpt
//   ringzero-train -n 4 --stage 3 --shard-group 2     (hybrid: shard in pairs, replicate across)
//   ringzero-train -n 3 --reproducible --batch 48      (the weights of -n 1, 2, 4, 6, bitwise)
//
// Ranks are threads of this process over the loopback transport (-n), or, under a launcher
// (ringzero-run -n 4 ringzero-train ...), processes over libfabric when that backend is built,
// or over the native shm transport (-T shm), where the sharder's buffers are symmetric memory
// unless --host-buffers.
#include <ringzero/bootstrap/environment.hpp>
#include <ringzero/ringzero.hpp>
#include <ringzero/transport/shm.hpp>
#include <ringzero/zero/detail/crc32c.hpp>
#include <ringzero/zero/sharder.hpp>

#include <fmt/core.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data.hpp"
#include "mlp.hpp"

#if RINGZERO_TRAIN_HAVE_LIBFABRIC
#include <ringzero/transport/libfabric.hpp>
#endif

namespace {

namespace zero = ringzero::zero;

struct args {
  int ranks = 2;
  int stage = 2;
  int shard_group = 0;
  int steps = 20;
  int batch = 64;
  int micro_batches = 1;
  bool micro_batches_given = false;
  bool reproducible = false;
  bool quantized_weights = false;    ///< ZeRO++ qwZ
  bool quantized_gradients = false;  ///< ZeRO++ qgZ
  int hpz_partition_size = 0;        ///< ZeRO++ hpZ
  std::string precision = "bf16";
  bool reduce_16bit = false;
  zero::optimizer_kind optimizer = zero::optimizer_kind::adamw;
  std::optional<float> lr;
  float weight_decay = 0.01f;
  int warmup = 0;
  float clip = 1.0f;
  float loss_scale = 65536.0f;
  train::mlp_shape shape;
  std::size_t bucket_kib = 16;
  std::uint64_t seed = 1;
  std::string save, resume;
  bool print_plan = false;
  bool comm_thread = true;
  int log_every = 1;
  std::string transport;  ///< under a launcher: libfabric or shm
  bool host_buffers = false;
};

constexpr const char* usage = R"(usage: ringzero-train [options]
  -n, --ranks N         ranks as threads of this process (loopback); default 2
  --stage S             ZeRO stage 0 (data parallel), 1, 2 or 3; default 2
  --shard-group G       hybrid sharding: shard within groups of G consecutive ranks ('node': one
                        group per node) and replicate across groups; default 0 (all ranks)
  --steps K             train until step K (counting steps restored by --resume); default 20
  --batch B             global batch, split over ranks and micro-batches; default 64
  --micro-batches M     gradient accumulation steps; default 1 (--reproducible: the micro-batches
                        of the global batch, default one per sample)
  --precision P         fp32 | bf16 | fp16 (bf16/fp16 keep fp32 master weights); default bf16
  --reduce-fp32         bf16/fp16: reduce and accumulate gradients in fp32 (the default)
  --reduce-16bit        bf16/fp16: reduce and accumulate gradients in the parameter type
  --optimizer O         adamw | sgd; default adamw
  --lr X                learning rate; default 0.003 (adamw), 0.05 (sgd)
  --weight-decay X      default 0.01 (not applied to biases)
  --warmup W            W > 0: linear warmup over W steps, then cosine to lr/10 at --steps
  --clip X              clip the gradient to this global norm (0: off); default 1
  --loss-scale X        fp16: initial dynamic loss scale; default 65536
  --hidden H, --layers L, --inputs I, --classes C   the MLP; default 128, 2, 32, 10
  --bucket-kib K        bucket size in KiB; default 16
  --seed S              dataset and initialisation seed; default 1
  --save DIR            save a checkpoint after the last step
  --resume DIR          load a checkpoint (any world size and stage) before training
  --print-plan          print the partition plan
  --no-comm-thread      run collectives on the training thread (no overlap)
  --log-every K         print every K-th step; default 1
  -T, --transport T     under a launcher: libfabric (default where built) or shm
  --host-buffers        keep the sharder's buffers in host memory (shm: not symmetric memory)
  --reproducible        the global batch is --micro-batches micro-batches, each rank takes a
                        contiguous run, and their gradients are summed exactly: the same weights,
                        bit for bit, at every world size dividing them (and every stage, group)
  --zero-quantized-weights    ZeRO++ qwZ: stage 3 gathers parameters as int8 blocks
  --zero-quantized-gradients  ZeRO++ qgZ: gradients reduced as int4 blocks, two hops over nodes
  --zero-hpz-partition-size G ZeRO++ hpZ: a secondary parameter shard in groups of G ranks,
                        which backward gathers from; 0 or 1: off
Under a launcher (ringzero-run, torchrun, srun, mpirun) every process is one rank.
)";

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "ringzero-train: %s\n%s", msg.c_str(), usage);
  std::exit(2);
}

template <class T>
T number(std::string_view flag, std::string_view s) {
  T v{};
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || p != s.data() + s.size())
    die(fmt::format("{} expects a number, got '{}'", flag, s));
  return v;
}

args parse(int argc, char** argv) {
  using setter = void (*)(args&, std::string_view flag, std::string_view value);
  struct option {
    std::string_view flag;
    setter set;
  };
  static constexpr option options[] = {
      {"-n", [](args& a, auto f, auto v) { a.ranks = number<int>(f, v); }},
      {"--ranks", [](args& a, auto f, auto v) { a.ranks = number<int>(f, v); }},
      {"--zero-hpz-partition-size",
       [](args& a, auto f, auto v) { a.hpz_partition_size = number<int>(f, v); }},
      {"--stage", [](args& a, auto f, auto v) { a.stage = number<int>(f, v); }},
      {"--shard-group",
       [](args& a, auto f, auto v) {
         a.shard_group = v == "node" ? zero::shard_group_per_node : number<int>(f, v);
       }},
      {"--steps", [](args& a, auto f, auto v) { a.steps = number<int>(f, v); }},
      {"--batch", [](args& a, auto f, auto v) { a.batch = number<int>(f, v); }},
      {"--micro-batches",
       [](args& a, auto f, auto v) {
         a.micro_batches = number<int>(f, v);
         a.micro_batches_given = true;
       }},
      {"--precision", [](args& a, auto, auto v) { a.precision = v; }},
      {"--optimizer", [](args& a, auto, auto v) { a.optimizer = zero::parse_optimizer(v); }},
      {"--lr", [](args& a, auto f, auto v) { a.lr = number<float>(f, v); }},
      {"--weight-decay", [](args& a, auto f, auto v) { a.weight_decay = number<float>(f, v); }},
      {"--warmup", [](args& a, auto f, auto v) { a.warmup = number<int>(f, v); }},
      {"--clip", [](args& a, auto f, auto v) { a.clip = number<float>(f, v); }},
      {"--loss-scale", [](args& a, auto f, auto v) { a.loss_scale = number<float>(f, v); }},
      {"--hidden", [](args& a, auto f, auto v) { a.shape.hidden = number<int>(f, v); }},
      {"--layers", [](args& a, auto f, auto v) { a.shape.depth = number<int>(f, v); }},
      {"--inputs", [](args& a, auto f, auto v) { a.shape.inputs = number<int>(f, v); }},
      {"--classes", [](args& a, auto f, auto v) { a.shape.classes = number<int>(f, v); }},
      {"--bucket-kib", [](args& a, auto f, auto v) { a.bucket_kib = number<std::size_t>(f, v); }},
      {"--seed", [](args& a, auto f, auto v) { a.seed = number<std::uint64_t>(f, v); }},
      {"--save", [](args& a, auto, auto v) { a.save = v; }},
      {"--resume", [](args& a, auto, auto v) { a.resume = v; }},
      {"--log-every", [](args& a, auto f, auto v) { a.log_every = number<int>(f, v); }},
      {"-T", [](args& a, auto, auto v) { a.transport = v; }},
      {"--transport", [](args& a, auto, auto v) { a.transport = v; }},
  };
  args a;
  for (int i = 1; i < argc; ++i) {
    const std::string_view f = argv[i];
    if (f == "-h" || f == "--help") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    if (f == "--print-plan") {
      a.print_plan = true;
      continue;
    }
    if (f == "--no-comm-thread") {
      a.comm_thread = false;
      continue;
    }
    if (f == "--reduce-fp32") {
      a.reduce_16bit = false;
      continue;
    }
    if (f == "--reduce-16bit") {
      a.reduce_16bit = true;
      continue;
    }
    if (f == "--host-buffers") {
      a.host_buffers = true;
      continue;
    }
    if (f == "--reproducible") {
      a.reproducible = true;
      continue;
    }
    if (f == "--zero-quantized-weights") {
      a.quantized_weights = true;
      continue;
    }
    if (f == "--zero-quantized-gradients") {
      a.quantized_gradients = true;
      continue;
    }
    const auto* o = std::find_if(std::begin(options), std::end(options),
                                 [&](const option& x) { return x.flag == f; });
    if (o == std::end(options)) die(fmt::format("unknown option '{}'", f));
    if (i + 1 >= argc) die(fmt::format("{} needs a value", f));
    try {
      o->set(a, f, argv[++i]);
    } catch (const ringzero::error& e) {
      die(e.what());
    }
  }
  if (a.precision != "fp32" && a.precision != "bf16" && a.precision != "fp16")
    die("--precision must be fp32, bf16 or fp16");
  if (!a.transport.empty() && a.transport != "libfabric" && a.transport != "shm")
    die("--transport must be libfabric or shm");
  if (a.ranks < 1 || a.steps < 0 || a.batch < 1 || a.micro_batches < 1 || a.log_every < 1 ||
      a.warmup < 0 || a.shape.hidden < 1 || a.shape.depth < 0 || a.shape.inputs < 1 ||
      a.shape.classes < 2)
    die("sizes and counts must be positive");
  return a;
}

std::string mib(std::size_t bytes) {
  return fmt::format("{:.3f}", static_cast<double>(bytes) / (1024.0 * 1024.0));
}

/// The ZeRO formula for this configuration, in bytes: what the table should match.
/// Gradients take `g` bytes each (fp32 by default: config::reduce_dtype).
template <class P>
double formula_bytes(int stage, double psi, double n, zero::optimizer_kind opt, double g) {
  const double p = sizeof(P);
  const double k =
      (std::is_same_v<P, float> ? 0.0 : 4.0) + (opt == zero::optimizer_kind::adamw ? 8.0 : 4.0);
  switch (stage) {
    case 0:
      return psi * (p + g + k);
    case 1:
      return psi * (p + g) + psi * k / n;
    case 2:
      return psi * p + psi * (g + k) / n;
    default:
      return psi * (p + g + k) / n;
  }
}

template <class Comm, class P, class Space = zero::memory_space_t<Comm>>
void run(Comm& comm, const args& a) {
  const int n = comm.size();
  // Micro-batches each rank accumulates, and samples in each.
  int micro = a.micro_batches;
  int per_rank = a.batch / (n * micro);
  if (a.reproducible) {
    // The global batch is a fixed list of micro-batches; rank r takes the r-th contiguous run.
    const int global = a.micro_batches_given ? a.micro_batches : a.batch;
    if (a.batch % global != 0 || global % n != 0)
      throw ringzero::invalid_argument(fmt::format(
          "--reproducible: --batch {} must split into --micro-batches {}, and those over {} "
          "ranks; choose a world size that divides the micro-batches",
          a.batch, global, n));
    micro = global / n;
    per_rank = a.batch / global;
  } else if (per_rank * n * micro != a.batch) {
    throw ringzero::invalid_argument(fmt::format(
        "--batch {} does not split into {} ranks x {} micro-batches", a.batch, n, micro));
  }
  const bool lead = comm.rank() == 0;
  const auto layout = train::make_layout(a.shape, ringzero::dtype_of<P>());
  zero::config cfg;
  cfg.stage = a.stage;
  cfg.optimizer.kind = a.optimizer;
  cfg.optimizer.lr = a.lr.value_or(a.optimizer == zero::optimizer_kind::adamw ? 3e-3f : 0.05f);
  cfg.optimizer.weight_decay = a.weight_decay;
  cfg.max_grad_norm = a.clip;
  cfg.accumulation_steps = micro;
  cfg.reproducible = a.reproducible;
  cfg.bucket_bytes = a.bucket_kib * 1024;
  cfg.comm_thread = a.comm_thread;
  cfg.scaling.initial = a.loss_scale;
  cfg.reduce_dtype = a.reduce_16bit ? ringzero::dtype_of<P>() : ringzero::dtype::float32;
  // docs-begin: hybrid
  // Shard within groups of a.shard_group consecutive ranks (a node), replicate across the
  // groups; 0 shards over every rank, zero::shard_group_per_node groups by node.
  cfg.shard_group_size = a.shard_group;
  // docs-end: hybrid
  cfg.zero_quantized_weights = a.quantized_weights;
  cfg.zero_quantized_gradients = a.quantized_gradients;
  cfg.zero_hpz_partition_size = a.hpz_partition_size;
  if (a.warmup > 0) {
    // docs-begin: schedule
    cfg.schedule = zero::warmup_cosine(static_cast<std::uint64_t>(a.warmup),
                                       static_cast<std::uint64_t>(a.steps), 0.1f);
    // docs-end: schedule
  }
  // Each rank's loss is already a share of the global mean (divided by the global batch).
  cfg.average_gradients = false;
  zero::sharder<Comm, P, Space> shd(comm, layout, cfg);
  const auto& plan = shd.plan();
  // The ranks the state is sharded over: n, or the shard group's size.
  const int shards = shd.shard_group_size();

  if (lead) {
    fmt::print(
        "ringzero-train: {} ranks{}, stage {}, {} parameters{}{}, {} lr {:g}, global batch {} "
        "({} micro-batch(es) x {} ranks x {}), clip {:g}{}\n",
        n, shards == n ? "" : fmt::format(" (sharded in groups of {})", shards), a.stage,
        a.precision, std::is_same_v<P, float> ? "" : " + fp32 master",
        std::is_same_v<P, float> || a.reduce_16bit ? "" : " + fp32 reduce",
        zero::optimizer_name(a.optimizer), cfg.optimizer.lr, a.batch, micro, n, per_rank, a.clip,
        a.reproducible ? ", reproducible" : "");
    fmt::print("model: MLP {}", a.shape.inputs);
    for (int l = 0; l < a.shape.layers(); ++l) fmt::print("-{}", a.shape.fan_out(l));
    fmt::print(", {} parameters in {} bucket(s) of <= {} KiB\n", plan.numel(),
               plan.buckets().size(), a.bucket_kib);
    if (a.print_plan) fmt::print("{}", plan);
  }

  // The same initial weights on every rank, from the seed.
  for (int l = 0; l < a.shape.layers(); ++l) {
    const float bound = 1.0f / std::sqrt(static_cast<float>(a.shape.fan_in(l)));
    for (int which = 0; which < 2; ++which) {
      const int id = 2 * l + which;
      std::vector<float> v(plan.params()[static_cast<std::size_t>(id)].numel);
      for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = bound * static_cast<float>(
                           2 * train::uniform(a.seed, 7 + static_cast<std::uint64_t>(id), i) - 1);
      shd.set_parameter(id, v);
    }
  }
  if (!a.resume.empty()) {
    shd.load(a.resume);
    if (lead) fmt::print("resumed from {} at step {}\n", a.resume, shd.step_count());
  }

  const train::teacher_dataset data(a.seed, a.shape.inputs, a.shape.classes);
  std::vector<float> x(static_cast<std::size_t>(per_rank * a.shape.inputs));
  std::vector<int> y(static_cast<std::size_t>(per_rank));
  bool memory_shown = false;
  // Steps after the first (which pays for first touches), timed on this rank.
  double timed_seconds = 0;
  int timed_steps = 0;
  // docs-begin: train-step
  while (shd.step_count() < static_cast<std::uint64_t>(a.steps)) {
    const std::uint64_t step = shd.step_count();
    const auto started = std::chrono::steady_clock::now();
    double loss = 0;
    for (int m = 0; m < micro; ++m) {
      // Reproducible: this rank's contiguous run of the batch's micro-batches.
      const int index = a.reproducible ? comm.rank() * micro + m : m * n + comm.rank();
      const std::uint64_t first =
          step * static_cast<std::uint64_t>(a.batch) + static_cast<std::uint64_t>(index * per_rank);
      for (int r = 0; r < per_rank; ++r)
        y[static_cast<std::size_t>(r)] =
            data.sample(first + static_cast<std::uint64_t>(r),
                        x.data() + static_cast<std::size_t>(r * a.shape.inputs));
      loss += train::forward_backward(shd, a.shape, x, y,
                                      shd.loss_scale() / static_cast<float>(a.batch));
      shd.end_micro_batch();
    }
    const auto r = shd.step();
    // docs-end: train-step
    if (step > 0) {
      timed_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      ++timed_steps;
    }
    // The global mean loss; the sharder is idle now, run_collective keeps to its thread anyway.
    loss = shd.run_collective([&](Comm& c) {
      double l = loss / a.batch;
      ringzero::all_reduce(c, std::span<double>(&l, 1), ringzero::op::sum,
                           cfg.collectives.all_reduce);
      return l;
    });
    if (lead && (r.step % static_cast<std::uint64_t>(a.log_every) == 0 || r.skipped || r.step == 1))
      fmt::print(
          "step {:4}  loss {:.6f}  grad-norm {:.6f}{}{}{}\n", r.step, loss, r.grad_norm,
          cfg.schedule ? fmt::format("  lr {:.3g}", cfg.optimizer.lr * cfg.schedule(r.step - 1))
                       : "",
          std::is_same_v<P, ringzero::float16> ? fmt::format("  scale {:g}", r.loss_scale) : "",
          r.skipped ? "  (skipped: inf/nan gradient)" : "");
    if (!memory_shown) {
      memory_shown = true;
      const auto mem = shd.memory();
      const std::uint64_t mine[6] = {mem.parameters, mem.gradients,    mem.optimizer,
                                     mem.buffers,    mem.peak_buffers, mem.secondary};
      std::vector<std::uint64_t> all(6 * static_cast<std::size_t>(n));
      shd.run_collective([&](Comm& c) {
        ringzero::all_gather(c, std::span<const std::uint64_t>(mine), std::span<std::uint64_t>(all),
                             cfg.collectives.all_gather);
      });
      if (lead) {
        // hpZ's secondary copy of the parameters gets a column of its own where it is kept.
        const bool hpz = mem.secondary > 0;
        fmt::print(
            "memory per rank (MiB)   parameters  gradients  optimizer  buffers(peak){}   "
            "total\n",
            hpz ? "  hpZ copy" : "");
        for (int q = 0; q < n; ++q) {
          const auto* e = all.data() + 6 * static_cast<std::size_t>(q);
          fmt::print("  rank {:<3}             {:>10}  {:>9}  {:>9}  {:>7}({}){}  {:>7}\n", q,
                     mib(e[0]), mib(e[1]), mib(e[2]), mib(e[3]), mib(e[4]),
                     hpz ? fmt::format("  {:>8}", mib(e[5])) : std::string(),
                     mib(e[0] + e[1] + e[2] + e[3] + e[5]));
        }
        const double f = formula_bytes<P>(
            a.stage, static_cast<double>(plan.numel()), shards, a.optimizer,
            static_cast<double>(ringzero::dtype_size(*shd.configuration().reduce_dtype)));
        const double measured = static_cast<double>(mem.parameters + mem.gradients + mem.optimizer);
        fmt::print(
            "  formula (stage {}, Psi = {}{}): {} MiB; measured without buffers {} MiB "
            "({:+.2f}%, padding)\n",
            a.stage, plan.numel(), shards == n ? "" : fmt::format(", sharded over {}", shards),
            mib(static_cast<std::size_t>(f)), mib(static_cast<std::size_t>(measured)),
            100.0 * (measured - f) / f);
      }
    }
  }
  if (!a.save.empty()) {
    shd.save(a.save);
    if (lead) fmt::print("saved step {} to {}\n", shd.step_count(), a.save);
  }
  if (lead && timed_steps > 0)
    fmt::print("step time: {:.3f} ms (mean of steps 2-{}, rank 0, {} buffers)\n",
               1e3 * timed_seconds / timed_steps, timed_steps + 1,
               shd.symmetric_buffers() ? "symmetric" : "host");
  const auto w = shd.full_parameters();
  if (lead)
    fmt::print("final fp32 weights: {} values, crc32c {:08x}\n", w.size(),
               zero::detail::crc32c(std::as_bytes(std::span(w))));
}

/// Whether a launcher (ringzero-run, torchrun, Slurm, Open MPI) started this process as one
/// rank of several.
bool launched() {
  return ringzero::bootstrap::detect_launch().launcher != "single";
}

template <class P>
void launch(const args& a) {
  if (launched() && a.transport == "shm") {
    auto comm = ringzero::shm::communicator::from_env();
    if (a.host_buffers)
      run<decltype(comm), P, zero::host_space>(comm, a);
    else
      run<decltype(comm), P>(comm, a);
    return;
  }
#if RINGZERO_TRAIN_HAVE_LIBFABRIC
  if (launched()) {
    auto comm = ringzero::libfabric::communicator::from_env();
    run<decltype(comm), P>(comm, a);
    return;
  }
#endif
  if (launched())
    throw ringzero::unsupported(
        "started by a launcher, but this build has no libfabric transport; use -T shm, or run it "
        "without the launcher and use -n for threads");
  ringzero::loopback::world world(a.ranks);
  world.run([&](ringzero::loopback::communicator& comm) {
    run<ringzero::loopback::communicator, P>(comm, a);
  });
}

}  // namespace

int main(int argc, char** argv) {
  // A line at a time even into a pipe or a file (a launcher's, Slurm's, `> log`): progress is
  // read while the job runs, not when it exits.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const args a = parse(argc, argv);
  try {
    if (a.precision == "fp32")
      launch<float>(a);
    else if (a.precision == "bf16")
      launch<ringzero::bfloat16>(a);
    else
      launch<ringzero::float16>(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ringzero-train: %s\n", e.what());
    return 1;
  }
  return 0;
}
