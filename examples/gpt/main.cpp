// ringzero-gpt: a small GPT-style character model, trained data-parallel with the ZeRO sharder on
// a public-domain text (Newton's Opticks), printing the loss as it falls, each rank's memory next
// to the ZeRO formula, tokens per second and a sample of generated text.
//
//   ringzero-run -n 4 ringzero-gpt                        # 4 processes over libfabric
//   ringzero-gpt -n 4 --stage 0 --steps 50               # 4 threads over loopback
//   ringzero-run -n 4 ringzero-gpt --stop-after 150 --save ckpt
//   ringzero-run -n 2 ringzero-gpt --resume ckpt          # the same loss curve, on 2 ranks
//   ringzero-gpt -n 3 --reproducible --batch 24           # the weights of -n 1, 2, 4, 6, bitwise
//   ringzero-run -n 4 --elastic 2:4 ringzero-gpt --reproducible --batch 24
//                                  # a rank may die: the rest go on, to the same weights
//   bench/netbed --ranks-per-host 2 run -- ringzero-gpt --zero-quantized-weights
//       --zero-quantized-gradients --zero-hpz-partition-size 2     # ZeRO++ between hosts
#include <ringzero/bootstrap/environment.hpp>
#include <ringzero/elastic.hpp>
#include <ringzero/ringzero.hpp>
#include <ringzero/transport/socket.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>

#include "trainer.hpp"

#if RINGZERO_GPT_HAVE_LIBFABRIC
#include <ringzero/transport/libfabric.hpp>
#include <ringzero/transport/shm.hpp>
#endif

namespace {

struct args {
  int ranks = 4;
  std::string precision = "bf16";
  std::string text = RINGZERO_GPT_TEXT;
  std::optional<int> checkpoint_every;
  std::string transport = "auto";  ///< under a launcher: auto, socket, libfabric or shm
  gpt::train_options train;
  std::vector<std::string> command;  ///< argv, for the command that resumes a job
};

constexpr const char* usage = R"(usage: ringzero-gpt [options]
  -n, --ranks N         ranks as threads of this process (loopback); default 4
  --stage S             ZeRO stage 0-3; default 3
  --precision P         fp32 | bf16 | fp16 parameters (16-bit keep fp32 master weights); default bf16
  --steps K             length of the learning-rate schedule; training ends there; default 300
  --stop-after K        stop after step K (then --save), as if interrupted
  --batch B             global batch in sequences, split over the ranks; default 16
  --lr X                peak learning rate; default 0.003
  --warmup K            linear warmup steps; default 30
  --min-lr-ratio X      cosine floor as a fraction of --lr; default 0.1
  --weight-decay X      AdamW decay of the matrices (not embeddings, norms, biases); default 0.1
  --clip X              global gradient-norm clip (0: off); default 1
  --context T, --dim D, --heads H, --layers L   the model; default 64, 64, 4, 2
  --bucket-kib K        sharder bucket size in KiB; default 64
  --seed S              initialisation and batch seed; default 1
  --text FILE           training text; default the shipped Opticks
  --save DIR            save a checkpoint after the last step
  --resume DIR          load a checkpoint (any world size and stage) before training
  --log-every K         print every K-th step; default 10
  --sample N            characters to generate at the end; default 300
  --eval N              the final weights' loss on N sequences no training step draws; default 0
  --temperature X       sampling temperature; default 0.8
  --prompt S            text the sample starts from; default "Light"
  --no-comm-thread      run collectives on the training thread (no overlap)
  --shard-group G       hybrid sharding: shard within groups of G ranks, replicate across them
  --zero-quantized-weights    ZeRO++ qwZ: stage 3 gathers parameters as int8 blocks
  --zero-quantized-gradients  ZeRO++ qgZ: gradients reduced as int4 blocks, two hops over nodes
  --zero-hpz-partition-size G ZeRO++ hpZ: a secondary parameter shard in groups of G ranks (a
                        node's), which backward gathers from; 0 or 1: off
  --reproducible        one micro-batch per sequence, summed exactly: the same weights, bit for
                        bit, at every world size dividing --batch (and every stage, shard group)
  --transport T         under a launcher: auto (default: ringzero's socket transport when the
                        ranks span hosts and neither FI_PROVIDER nor an EFA NIC asks for
                        libfabric, else libfabric), socket, libfabric or shm (the native
                        shared-memory transport, one host)
  --checkpoint DIR      save a checkpoint to DIR every --checkpoint-every steps
  --checkpoint-every K  default 10 under ringzero-run --elastic, else 0 (never)
  --peer-copy K         under ringzero-run --elastic: every K steps keep the training state in a
                        ring peer's memory too (twice a rank's optimizer state), and recover
                        from it when it covers the ranks lost; default 0 (off)
Under a launcher (ringzero-run, torchrun, srun, mpirun) every process is one rank (--transport).
Under ringzero-run --elastic MIN:MAX a rank that dies does not end the job: the others form a
new world (sizes that divide --batch), load the last checkpoint (--checkpoint, by default a
directory under /tmp removed at the end) and go on; processes started with ringzero-run --join
are taken in at the next step boundary.
)";

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "ringzero-gpt: %s\n%s", msg.c_str(), usage);
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
      {"--stage", [](args& a, auto f, auto v) { a.train.stage = number<int>(f, v); }},
      {"--precision", [](args& a, auto, auto v) { a.precision = v; }},
      {"--steps", [](args& a, auto f, auto v) { a.train.steps = number<int>(f, v); }},
      {"--stop-after", [](args& a, auto f, auto v) { a.train.stop_after = number<int>(f, v); }},
      {"--batch", [](args& a, auto f, auto v) { a.train.batch = number<int>(f, v); }},
      {"--lr", [](args& a, auto f, auto v) { a.train.lr = number<float>(f, v); }},
      {"--warmup", [](args& a, auto f, auto v) { a.train.warmup = number<int>(f, v); }},
      {"--min-lr-ratio",
       [](args& a, auto f, auto v) { a.train.min_lr_ratio = number<float>(f, v); }},
      {"--weight-decay",
       [](args& a, auto f, auto v) { a.train.weight_decay = number<float>(f, v); }},
      {"--clip", [](args& a, auto f, auto v) { a.train.clip = number<float>(f, v); }},
      {"--context", [](args& a, auto f, auto v) { a.train.model.context = number<int>(f, v); }},
      {"--dim", [](args& a, auto f, auto v) { a.train.model.dim = number<int>(f, v); }},
      {"--heads", [](args& a, auto f, auto v) { a.train.model.heads = number<int>(f, v); }},
      {"--layers", [](args& a, auto f, auto v) { a.train.model.layers = number<int>(f, v); }},
      {"--bucket-kib",
       [](args& a, auto f, auto v) { a.train.bucket_kib = number<std::size_t>(f, v); }},
      {"--seed", [](args& a, auto f, auto v) { a.train.seed = number<std::uint64_t>(f, v); }},
      {"--text", [](args& a, auto, auto v) { a.text = v; }},
      {"--save", [](args& a, auto, auto v) { a.train.save = v; }},
      {"--resume", [](args& a, auto, auto v) { a.train.resume = v; }},
      {"--log-every", [](args& a, auto f, auto v) { a.train.log_every = number<int>(f, v); }},
      {"--sample", [](args& a, auto f, auto v) { a.train.sample = number<int>(f, v); }},
      {"--eval", [](args& a, auto f, auto v) { a.train.eval = number<int>(f, v); }},
      {"--temperature", [](args& a, auto f, auto v) { a.train.temperature = number<float>(f, v); }},
      {"--prompt", [](args& a, auto, auto v) { a.train.prompt = v; }},
      {"--shard-group", [](args& a, auto f, auto v) { a.train.shard_group = number<int>(f, v); }},
      {"--zero-hpz-partition-size",
       [](args& a, auto f, auto v) { a.train.hpz_partition_size = number<int>(f, v); }},
      {"--checkpoint", [](args& a, auto, auto v) { a.train.checkpoint = v; }},
      {"--transport", [](args& a, auto, auto v) { a.transport = v; }},
      {"--peer-copy", [](args& a, auto f, auto v) { a.train.peer_copy_every = number<int>(f, v); }},
      {"--checkpoint-every",
       [](args& a, auto f, auto v) { a.checkpoint_every = number<int>(f, v); }},
  };
  args a;
  a.command.assign(argv, argv + argc);
  for (int i = 1; i < argc; ++i) {
    const std::string_view f = argv[i];
    if (f == "-h" || f == "--help") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    if (f == "--no-comm-thread") {
      a.train.comm_thread = false;
      continue;
    }
    if (f == "--reproducible") {
      a.train.reproducible = true;
      continue;
    }
    if (f == "--zero-quantized-weights") {
      a.train.quantized_weights = true;
      continue;
    }
    if (f == "--zero-quantized-gradients") {
      a.train.quantized_gradients = true;
      continue;
    }
    const auto* o = std::find_if(std::begin(options), std::end(options),
                                 [&](const option& x) { return x.flag == f; });
    if (o == std::end(options)) die(fmt::format("unknown option '{}'", f));
    if (i + 1 >= argc) die(fmt::format("{} needs a value", f));
    o->set(a, f, argv[++i]);
  }
  const auto& t = a.train;
  if (a.transport != "auto" && a.transport != "socket" && a.transport != "libfabric" &&
      a.transport != "shm")
    die("--transport must be auto, socket, libfabric or shm");
  if (a.precision != "fp32" && a.precision != "bf16" && a.precision != "fp16")
    die("--precision must be fp32, bf16 or fp16");
  if (a.ranks < 1 || t.steps < 0 || t.stop_after < 0 || t.batch < 1 || t.warmup < 1 ||
      t.shard_group < 0 || t.hpz_partition_size < 0 || t.log_every < 1 || t.sample < 0 ||
      t.eval < 0 || !(t.temperature > 0) || !(t.lr >= 0) || a.checkpoint_every.value_or(0) < 0 ||
      t.peer_copy_every < 0)
    die("sizes, counts, the learning rate and the temperature must be positive");
  a.train.checkpoint_every = a.checkpoint_every.value_or(0);
  if (a.train.checkpoint_every > 0 && a.train.checkpoint.empty())
    die("--checkpoint-every needs --checkpoint DIR");
  return a;
}

bool launched() {
  return ringzero::bootstrap::detect_launch().launcher != "single";
}

#if RINGZERO_GPT_HAVE_LIBFABRIC
[[nodiscard]] std::string transport_name(ringzero::libfabric::communicator& c) {
  return "libfabric " + c.transport().provider();
}
[[nodiscard]] std::string transport_name(ringzero::shm::communicator&) {
  return "native shm";
}

// A job that cannot go on keeps its last checkpoint: one rank says where, and how to resume.
void tell_kept_checkpoint(const args& a, ringzero::elastic::session& s, const std::string& dir) {
  using keys = ringzero::elastic::session::keys;
  if (!std::filesystem::exists(std::filesystem::path(dir) / "manifest.txt")) return;
  try {
    auto& st = s.job_store();
    if (st.add_within(keys::finished(), 0, std::chrono::seconds(1)) > 0 ||
        st.add_within("ringzero-gpt/kept-told", 1, std::chrono::seconds(1)) != 1)
      return;
  } catch (const ringzero::error&) {
    // The store does not answer: every rank says it, rather than none.
  }
  std::string command;
  for (std::size_t i = 0; i < a.command.size(); ++i) {
    if (a.command[i] == "--resume" && i + 1 < a.command.size()) {
      ++i;
      continue;
    }
    command += (command.empty() ? "" : " ") + a.command[i];
  }
  const auto& lim = s.bounds();
  fmt::print(stderr,
             "ringzero-gpt: the job's last checkpoint is kept in {}; resume with:\n  ringzero-run "
             "-n {} --elastic {}:{} -- {} --resume {}\n",
             dir, lim.max == INT_MAX ? s.current().size() : lim.max, lim.min,
             lim.max == INT_MAX ? std::string() : std::to_string(lim.max), command, dir);
  std::fflush(stderr);
}

// The generations of an elastic job, until it finishes or cannot go on.
template <class P, class Comm>
void elastic_generations(const args& a, const gpt::corpus& text, ringzero::elastic::session& s,
                         const gpt::train_options& o, bool own_dir) {
  using clock = std::chrono::steady_clock;
  const auto manifest = std::filesystem::path(o.checkpoint) / "manifest.txt";
  std::optional<clock::time_point> failed_at;
  std::string failure;
  int fruitless = 0;
  ringzero::zero::checkpoint_image peer_copy;  // this rank's share of the last peer snapshot
  std::string resumed_from;
  for (;;) {
    const auto& m = s.current();
    std::FILE* log = m.rank == 0 ? stdout : nullptr;
    if (log != nullptr && m.generation > 0)
      fmt::print(log, "elastic: generation {}: {} ranks{}{} (formed in {:.2f} s)\n", m.generation,
                 m.size(),
                 m.lost.empty() ? "" : fmt::format(", lost member(s) {}", fmt::join(m.lost, ", ")),
                 m.arrived.empty()
                     ? ""
                     : fmt::format(", took in member(s) {}", fmt::join(m.arrived, ", ")),
                 std::chrono::duration<double>(m.formed_in).count());
    std::optional<Comm> comm;
    try {
      comm.emplace(s.template communicator<Comm>());
      auto g = o;
      g.transport = "elastic processes, " + transport_name(*comm);
      // The job's own last checkpoint, once it has one; before that --resume, if given.
      g.resume = std::filesystem::exists(manifest) ? o.checkpoint : a.train.resume;
      g.arrivals = [&s] { return s.waiting(); };
      g.peer_copy = &peer_copy;
      g.resumed_from = &resumed_from;
      bool first = true;
      g.after_step = [&](std::uint64_t step) {
        if (!first) return;
        first = false;
        if (!failed_at) return;
        const double took = std::chrono::duration<double>(clock::now() - *failed_at).count();
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::system_clock::now().time_since_epoch())
                            .count();
        const std::string what = fmt::format(
            "recovered: step {} done {:.2f} s after the failure was seen ({}), "
            "resumed from {}",
            step, took, failure, resumed_from.empty() ? std::string("the start") : resumed_from);
        if (log != nullptr) fmt::print(log, "elastic: {} (unix ms {})\n", what, ms);
        if (m.rank == 0) s.record(what);
        failed_at.reset();
      };
      const auto res = gpt::train<Comm, P>(*comm, g, text, log);
      if (res.regroup) {
        comm.reset();
        s.grow();
        continue;
      }
      if (m.rank == 0) {
        s.finish();
        if (own_dir) std::filesystem::remove_all(o.checkpoint);
      }
      return;
    } catch (const ringzero::error& e) {
      const auto c = e.code();
      if (c != ringzero::errc::peer_failure && c != ringzero::errc::timeout &&
          c != ringzero::errc::transport)
        throw;
      int who = -1;
      if constexpr (requires(const Comm& c) { c.failed_rank(); })
        if (comm) who = comm->failed_rank();
      if (who < 0)
        if (const auto* pe = dynamic_cast<const ringzero::peer_error*>(&e)) who = pe->peer();
      if (!failed_at) failed_at = clock::now();
      failure = who >= 0 ? fmt::format("member {} lost", m.members[static_cast<std::size_t>(who)])
                         : std::string("a member lost");
      fmt::print(stderr, "ringzero-gpt: elastic: generation {} failed: {}; the survivors go on\n",
                 m.generation, e.what());
      comm.reset();
      s.shrink(who);
      // A failure that cost no member (a timeout on a slow peer) is retried once; twice in a
      // row is no fault elasticity can fix.
      if (s.current().lost.empty() && ++fruitless > 1) throw;
      if (!s.current().lost.empty()) fruitless = 0;
    }
  }
}
// An elastic job: each generation of the job trains from the last checkpoint until it finishes,
// a rank dies (the survivors form the next generation and go on) or processes arrive (every
// rank saves, and the next generation takes them in).
template <class P, class Comm>
void run_elastic(const args& a, const gpt::corpus& text) {
  const int batch = a.train.batch, group = a.train.shard_group;
  // Sizes the batch splits over, in whole shard groups.
  auto s = ringzero::elastic::session::from_env(
      [batch, group](int n) { return batch % n == 0 && (group == 0 || n % group == 0); });
  s.join();
  auto o = a.train;
  // Without --checkpoint the job keeps its checkpoints in a directory of its own, named after
  // the job's token so that every rank, arrivals included, finds the same one.
  const bool own_dir = o.checkpoint.empty();
  if (own_dir)
    o.checkpoint = (std::filesystem::temp_directory_path() /
                    fmt::format("ringzero-gpt-elastic-{:016x}",
                                ringzero::bootstrap::detail::fnv1a(
                                    ringzero::detail::getenv_str("RINGZERO_TOKEN").value_or(""))))
                       .string();
  if (o.checkpoint_every == 0 && !a.checkpoint_every) o.checkpoint_every = 10;
  try {
    elastic_generations<P, Comm>(a, text, s, o, own_dir);
  } catch (...) {
    if (s.launcher_gone()) {
      // The job ends with its launcher: nothing of it stays behind (the endpoints' shared
      // memory goes as the exception unwinds, the job's own checkpoints here).
      if (own_dir) std::filesystem::remove_all(o.checkpoint);
      throw;
    }
    tell_kept_checkpoint(a, s, o.checkpoint);
    throw;
  }
}

#endif

[[nodiscard]] std::string transport_name(ringzero::socket::communicator& c) {
  std::string rails;
  for (int r = 0; r < c.transport().rails(); ++r)
    rails += fmt::format("{}{}", r ? "," : "", c.transport().rail_name(r));
  return fmt::format("socket, rails {}", rails);
}

/// The transport of a launched rank: --transport, or for auto ringzero's socket transport
/// between hosts unless something asks for libfabric (bootstrap::prefer_socket_between_hosts),
/// else libfabric where this build has it.
[[nodiscard]] std::string launched_transport(const args& a) {
  if (a.transport != "auto") return a.transport;
  bool efa = false;
#if RINGZERO_GPT_HAVE_LIBFABRIC
  efa = ringzero::libfabric::detail::provider_available("efa");
  if (!ringzero::bootstrap::prefer_socket_between_hosts(ringzero::bootstrap::detect_launch(), efa))
    return "libfabric";
#endif
  (void)efa;
  return "socket";
}

/// Trains over a communicator a launcher's environment describes.
template <class P, class Comm>
void train_launched(const args& a, const gpt::corpus& text) {
  auto comm = Comm::from_env();
  auto o = a.train;
  o.transport = "processes, " + transport_name(comm);
  gpt::train<Comm, P>(comm, o, text, comm.rank() == 0 ? stdout : nullptr);
}

template <class P>
void launch(const args& a, const gpt::corpus& text) {
#if RINGZERO_GPT_HAVE_LIBFABRIC
  // Before the launcher's variables are read: an elastic member's rank comes from the job's
  // rendezvous (a member started without a launcher has WORLD_SIZE but no RANK), and auto is
  // libfabric there.
  if (ringzero::elastic::session::enabled()) {
    if (a.transport == "socket")
      throw ringzero::unsupported(
          "elastic jobs run over libfabric or shm (--transport libfabric or shm)");
    return a.transport == "shm" ? run_elastic<P, ringzero::shm::communicator>(a, text)
                                : run_elastic<P, ringzero::libfabric::communicator>(a, text);
  }
#endif
  const std::string t = launched() ? launched_transport(a) : a.transport;
#if RINGZERO_GPT_HAVE_LIBFABRIC
  if (launched() && t == "shm") return train_launched<P, ringzero::shm::communicator>(a, text);
  if (launched() && t == "libfabric")
    return train_launched<P, ringzero::libfabric::communicator>(a, text);
#endif
  if (launched() && t == "socket")
    return train_launched<P, ringzero::socket::communicator>(a, text);
  if (launched())
    throw ringzero::unsupported(fmt::format(
        "--transport {}: this build has no libfabric transport; use --transport socket, or run "
        "it without the launcher and use -n for threads",
        t));
  ringzero::loopback::world world(a.ranks);
  world.run([&](ringzero::loopback::communicator& comm) {
    gpt::train<ringzero::loopback::communicator, P>(comm, a.train, text,
                                                    comm.rank() == 0 ? stdout : nullptr);
  });
}

}  // namespace

int main(int argc, char** argv) {
  // A line at a time even into a pipe or a file (a launcher's, Slurm's, `> log`): progress is
  // read while the job runs, not when it exits.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const args a = parse(argc, argv);
  try {
    const auto text = gpt::corpus::from_file(a.text);
    if (a.precision == "fp32")
      launch<float>(a, text);
    else if (a.precision == "bf16")
      launch<ringzero::bfloat16>(a, text);
    else
      launch<ringzero::float16>(a, text);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ringzero-gpt: %s\n", e.what());
    return 1;
  }
  return 0;
}
