// Training the GPT demo's model with the ZeRO sharder: one function that every rank calls with
// its communicator. The global batch is fixed and split over the ranks, the learning rate is a
// function of the step (linear warmup, then cosine decay), and a checkpoint saved at one world
// size resumes at another on the same loss curve.
//
// With `reproducible` every sequence of the global batch is one micro-batch: rank r of N takes
// sequences [r B/N, (r+1) B/N), runs forward and backward on each alone and hands its gradients
// to the sharder's exact accumulator (zero::config::reproducible), so the weights are the same
// bits at every world size that divides the batch, at every stage and shard group size.
#pragma once

#include <ringzero/ringzero.hpp>
#include <ringzero/zero/detail/crc32c.hpp>
#include <ringzero/zero/peer_snapshot.hpp>
#include <ringzero/zero/sharder.hpp>

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <numbers>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "model.hpp"
#include "text.hpp"

namespace gpt {

struct train_options {
  config model{.vocab = 0, .context = 64, .dim = 64, .heads = 4, .layers = 2};
  int stage = 3;
  int batch = 16;      ///< global batch, in sequences of model.context tokens
  int steps = 300;     ///< length of the learning-rate schedule, and where training ends
  int stop_after = 0;  ///< > 0: stop (and save) after this step, as if interrupted
  float lr = 3e-3f;
  float min_lr_ratio = 0.1f;  ///< the cosine decays to lr * this at the last step
  int warmup = 30;
  float weight_decay = 0.1f;
  float clip = 1.0f;
  std::size_t bucket_kib = 64;
  std::uint64_t seed = 1;
  std::string save, resume;
  int log_every = 10;
  int sample = 300;  ///< characters to generate at the end (0: none)
  int eval = 0;      ///< sequences the final weights are evaluated on (0: none)
  float temperature = 0.8f;
  std::string prompt = "Light";
  bool comm_thread = true;
  bool reproducible = false;                   ///< one micro-batch per sequence, reduced exactly
  int shard_group = 0;                         ///< hybrid sharding: ranks per shard group (0: all)
  bool quantized_weights = false;              ///< ZeRO++ qwZ (zero_quantized_weights)
  bool quantized_gradients = false;            ///< ZeRO++ qgZ (zero_quantized_gradients)
  int hpz_partition_size = 0;                  ///< ZeRO++ hpZ (zero_hpz_partition_size)
  std::string transport = "loopback threads";  ///< for the header line
  /// Save a checkpoint to `checkpoint` every this many steps (0: never): what an elastic job
  /// resumes from when a rank dies.
  int checkpoint_every = 0;
  std::string checkpoint;
  /// Elastic jobs: asked on rank 0 at every step boundary how many processes wait to join; when
  /// any do, every rank saves a checkpoint and train() returns with `regroup` set.
  std::function<int()> arrivals;
  /// Called on every rank after each step (an elastic job times its recovery with it).
  std::function<void(std::uint64_t step)> after_step;
  /// Every this many steps (0: never) keep a snapshot of the training state with a ring peer, in
  /// `peer_copy` (zero/peer_snapshot.hpp). At the start, if the ranks' copies cover one snapshot,
  /// training resumes from it rather than from `resume`.
  int peer_copy_every = 0;
  ringzero::zero::checkpoint_image* peer_copy = nullptr;
  /// Set to where training resumed from ("" if it started afresh).
  std::string* resumed_from = nullptr;
};

struct train_result {
  std::vector<double> losses;  ///< the global mean loss of each step this run took
  std::vector<float> weights;  ///< every parameter's fp32 master value at the end
  std::string sample;
  double eval_loss = 0;  ///< the final weights' mean loss per token on the --eval sequences
  double tokens_per_second = 0;
  bool regroup = false;  ///< stopped at a step boundary to take in arrivals (checkpoint saved)
};

/// Linear warmup to lr over `warmup` steps, then a cosine down to lr * min_lr_ratio at `steps`.
/// `step` counts from 0; a function of the step alone, so a resumed run continues the schedule.
[[nodiscard]] inline float learning_rate(const train_options& o, std::uint64_t step) {
  const auto s = static_cast<double>(step);
  if (s < o.warmup) return static_cast<float>(o.lr * (s + 1) / o.warmup);
  const double span = std::max(1, o.steps - o.warmup);
  const double progress = std::min(1.0, (s - o.warmup) / span);
  const double floor = o.lr * o.min_lr_ratio;
  return static_cast<float>(floor +
                            (o.lr - floor) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
}

/// The sharder as a model Source: acquire() gathers a layer (stage 3 all_gathers its bucket and
/// prefetches the next; stages 0-2 return views), widens it to fp32, and release() drops the
/// handle; grad() hands a gradient over, and the sharder reduces each bucket as it completes.
template <class Sharder>
class sharder_source {
 public:
  using P = typename Sharder::param_type;

  sharder_source(Sharder& shd, const std::vector<param_desc>& params)
      : shd_(shd), held_(shd.plan().layers().size()), ptr_(params.size()), wide_(params.size()) {
    // Layers hold consecutive ids: layer l is [first_of_layer_[l], first_of_layer_[l + 1]).
    first_of_layer_.assign(static_cast<std::size_t>(params.back().layer) + 2,
                           static_cast<int>(params.size()));
    for (std::size_t id = params.size(); id-- > 0;)
      first_of_layer_[static_cast<std::size_t>(params[id].layer)] = static_cast<int>(id);
  }

  void acquire(int layer, bool backward) {
    auto& h = held_[static_cast<std::size_t>(layer)];
    if (h) return;
    h.emplace(shd_.gather(
        layer, backward ? ringzero::zero::pass::backward : ringzero::zero::pass::forward));
    auto ids = shd_.plan().layers()[static_cast<std::size_t>(layer)].shared;
    for (int id = first_of_layer_[static_cast<std::size_t>(layer)];
         id < first_of_layer_[static_cast<std::size_t>(layer) + 1]; ++id)
      ids.push_back(id);
    for (int id : ids) {
      const auto v = h->param(id);
      if constexpr (std::is_same_v<P, float>) {
        ptr_[static_cast<std::size_t>(id)] = v.data();
      } else {
        auto& w = wide_[static_cast<std::size_t>(id)];
        w.resize(v.size());
        for (std::size_t i = 0; i < v.size(); ++i) w[i] = static_cast<float>(v[i]);
        ptr_[static_cast<std::size_t>(id)] = w.data();
      }
    }
  }
  void release(int layer) {
    if (!keep_) held_[static_cast<std::size_t>(layer)].reset();
  }
  /// While kept, release() keeps the layer present: a step of many micro-batches then gathers
  /// (stage 3) and widens each layer once. Ending it releases every layer.
  void keep(bool on) {
    keep_ = on;
    if (!on)
      for (auto& h : held_) h.reset();
  }
  [[nodiscard]] const float* param(int id) const { return ptr_[static_cast<std::size_t>(id)]; }
  void grad(int id, std::span<const float> g) { shd_.add_grad(id, g); }

 private:
  Sharder& shd_;
  std::vector<std::optional<typename Sharder::gathered>> held_;
  std::vector<const float*> ptr_;
  std::vector<std::vector<float>> wide_;
  std::vector<int> first_of_layer_;
  bool keep_ = false;
};

[[nodiscard]] inline ringzero::zero::model_layout make_layout(const config& c, ringzero::dtype t) {
  ringzero::zero::model_layout layout;
  int open = -1;
  for (const auto& p : parameters(c)) {
    if (p.layer != open) {
      layout.add_layer(layer_name(c, open = p.layer));
      if (open == c.layers + 1) layout.share(wte);  // the head is the embedding, transposed
    }
    layout.add({.name = p.name, .shape = p.shape, .type = t, .weight_decay = p.decay});
  }
  return layout;
}

/// The header line's note of the ZeRO++ options a config turns on, "" for none.
[[nodiscard]] inline std::string zeropp_line(const ringzero::zero::config& cfg) {
  std::string s;
  if (cfg.zero_quantized_weights) s += ", qwZ (int8 weight gathers)";
  if (cfg.zero_quantized_gradients) s += ", qgZ (int4 gradient reduction)";
  if (cfg.zero_hpz_partition_size > 1)
    s += fmt::format(", hpZ (secondary shard in groups of {})", cfg.zero_hpz_partition_size);
  return s;
}

/// ZeRO's bytes per rank for this configuration: parameters in P, gradients of `g` bytes each
/// (fp32 by default: config::reduce_dtype), fp32 master weights (16-bit P) and AdamW's two fp32
/// moments, each sharded or not as the stage says.
template <class P>
[[nodiscard]] double zero_formula_bytes(int stage, double psi, double n, double g) {
  const double p = sizeof(P);
  const double k = (std::is_same_v<P, float> ? 0.0 : 4.0) + 8.0;
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

/// The model's values from `flat`, every parameter in registration order (as full_parameters()
/// returns them).
[[nodiscard]] inline vector_source<float> source_of(const config& c,
                                                    const std::vector<float>& flat) {
  std::vector<std::vector<float>> values;
  std::size_t at = 0;
  for (const auto& p : parameters(c)) {
    values.emplace_back(flat.begin() + static_cast<std::ptrdiff_t>(at),
                        flat.begin() + static_cast<std::ptrdiff_t>(at + p.numel()));
    at += p.numel();
  }
  return vector_source<float>(std::move(values));
}

/// The mean loss per token of the model with weights `flat` on `count` sequences that no
/// training step draws (a step number past any schedule): one fixed set for every run of a
/// seed, so two runs' final models are compared on the same text, not on their last batches.
[[nodiscard]] inline double evaluate(const config& c, const corpus& text,
                                     const std::vector<float>& flat, int count,
                                     std::uint64_t seed) {
  constexpr std::uint64_t eval_step = std::uint64_t{1} << 40;
  auto src = source_of(c, flat);
  model<float> m(c);
  const auto len = static_cast<std::size_t>(c.context);
  std::vector<int> tokens(len), targets(len);
  double sum = 0;
  for (int i = 0; i < count; ++i) {
    text.sequence(seed, eval_step, static_cast<std::uint64_t>(i), c.context, tokens.data(),
                  targets.data());
    sum += m.loss(src, tokens, targets, 1);
  }
  return sum / (static_cast<double>(count) * static_cast<double>(len));
}

/// Samples `count` bytes after `prompt` from the model with weights `flat` (registration order,
/// as full_parameters() returns them), at `temperature`, with a counter-based generator.
[[nodiscard]] inline std::string generate(const config& c, const corpus& text,
                                          const std::vector<float>& flat, const std::string& prompt,
                                          int count, float temperature, std::uint64_t seed) {
  auto src = source_of(c, flat);
  model<float> m(c);
  std::vector<int> ctx;
  for (unsigned char ch : prompt)
    if (text.token(ch) >= 0) ctx.push_back(text.token(ch));
  if (ctx.empty()) ctx.push_back(0);
  std::string out;
  for (int i = 0; i < count; ++i) {
    const std::size_t keep = std::min(ctx.size(), static_cast<std::size_t>(c.context));
    const auto logits =
        m.next_logits(src, std::span<const int>(ctx).subspan(ctx.size() - keep, keep));
    const float mx = *std::max_element(logits.begin(), logits.end());
    std::vector<double> p(logits.size());
    double sum = 0;
    for (std::size_t k = 0; k < p.size(); ++k)
      sum += p[k] = std::exp(static_cast<double>(logits[k] - mx) / temperature);
    double u = uniform(seed, 0x5a3b1e, static_cast<std::uint64_t>(i)) * sum;
    int pick = static_cast<int>(p.size()) - 1;
    for (std::size_t k = 0; k < p.size(); ++k)
      if ((u -= p[k]) <= 0) {
        pick = static_cast<int>(k);
        break;
      }
    ctx.push_back(pick);
    out.push_back(text.byte(pick));
  }
  return out;
}

/// fmt::print to `log` unless it is null (ranks other than the lead print nothing).
template <class... A>
void say(std::FILE* log, fmt::format_string<A...> f, A&&... a) {
  if (log != nullptr) fmt::print(log, f, std::forward<A>(a)...);
}

/// Trains on `text` with this rank's communicator; `log` (the lead's stdout, or nullptr) gets
/// the progress. Collective: every rank calls it with the same options.
template <class Comm, class P>
train_result train(Comm& comm, const train_options& o, const corpus& text, std::FILE* log) {
  namespace zero = ringzero::zero;
  const int n = comm.size();
  config c = o.model;
  c.vocab = text.vocab();
  if (o.batch % n != 0)
    throw ringzero::invalid_argument(
        o.reproducible
            ? fmt::format("--reproducible: the global batch is {} micro-batches (one sequence "
                          "each), which {} ranks cannot split evenly; choose a world size that "
                          "divides --batch",
                          o.batch, n)
            : fmt::format("the global batch of {} sequences does not split over {} ranks", o.batch,
                          n));
  const int per_rank = o.batch / n;
  const auto len = static_cast<std::size_t>(c.context);

  zero::config cfg;
  cfg.stage = o.stage;
  cfg.optimizer.kind = zero::optimizer_kind::adamw;
  cfg.optimizer.lr = learning_rate(o, 0);
  cfg.optimizer.beta2 = 0.99f;
  cfg.optimizer.weight_decay = o.weight_decay;
  cfg.max_grad_norm = o.clip;
  cfg.bucket_bytes = o.bucket_kib * 1024;
  cfg.comm_thread = o.comm_thread;
  cfg.shard_group_size = o.shard_group;
  cfg.zero_quantized_weights = o.quantized_weights;
  cfg.zero_quantized_gradients = o.quantized_gradients;
  cfg.zero_hpz_partition_size = o.hpz_partition_size;
  if (o.reproducible) {
    cfg.reproducible = true;
    cfg.accumulation_steps = per_rank;  // this rank's run of the batch's sequences
  }
  // Each rank's loss is its share of the global mean: summed, divided by the global tokens.
  cfg.average_gradients = false;
  zero::sharder<Comm, P> shd(comm, make_layout(c, ringzero::dtype_of<P>()), cfg);
  model<float> m(c);
  sharder_source src(shd, m.params());
  const auto& plan = shd.plan();

  say(log,
      "gpt: {} ranks ({}), ZeRO stage {}, {} parameters{}, AdamW (weight decay {:g} on matrices), "
      "lr {:g} (warmup {}, cosine to {:g} at step {}), global batch {} x {} tokens{}{}{}\n",
      n, o.transport, o.stage, ringzero::dtype_name(ringzero::dtype_of<P>()),
      std::is_same_v<P, float> ? "" : " + fp32 master", o.weight_decay, o.lr, o.warmup,
      o.lr * o.min_lr_ratio, o.steps, o.batch, c.context,
      shd.shard_group_size() == n
          ? ""
          : fmt::format(", sharded in groups of {}", shd.shard_group_size()),
      o.reproducible ? ", reproducible (one micro-batch per sequence)" : "", zeropp_line(cfg));
  say(log,
      "model: vocab {} (bytes of the text, {} KB), context {}, {} layers, {} heads, dim {}: {} "
      "parameters in {} buckets\n",
      c.vocab, text.size() / 1000, c.context, c.layers, c.heads, c.dim, plan.numel(),
      plan.buckets().size());

  for (int id = 0; id < param_count(c); ++id) shd.set_parameter(id, initial_value(c, id, o.seed));
  std::string from;
  const auto keep_copy = [&] {
    auto img = shd.snapshot();
    shd.run_collective([&](Comm& cm) { zero::keep_with_peer(cm, img); });
    if (o.peer_copy->empty())
      say(log, "peer copy: {} KiB per rank (its shard and its ring predecessor's)\n",
          img.bytes() / 1024);
    *o.peer_copy = std::move(img);
  };
  // Every rank asks, with a copy or without (an arrival has none): the answer is collective.
  const bool copies = o.peer_copy != nullptr && o.peer_copy_every > 0;
  const bool whole = copies && shd.run_collective([&](Comm& cm) {
    return zero::gather_snapshot(cm, *o.peer_copy);
  });
  // A checkpoint on disk newer than the copies (saved to take in arrivals) wins; every rank
  // reads the same manifest, so every rank decides alike.
  const auto step_of = [](const zero::checkpoint_manifest& m) { return m.step; };
  const bool disk_newer =
      whole && !o.resume.empty() &&
      std::filesystem::exists(std::filesystem::path(o.resume) / zero::manifest_file_name) &&
      step_of(zero::checkpoint_manifest::read(o.resume)) >
          step_of(zero::checkpoint_manifest::parse(o.peer_copy->manifest, "peer copy"));
  if (whole && !disk_newer) {
    shd.load(*o.peer_copy);
    from = "peers' memory";
    say(log, "resumed from peers' memory at step {}\n", shd.step_count());
    keep_copy();  // back to two shards per rank, in this world's layout
  } else if (!o.resume.empty()) {
    shd.load(o.resume);
    from = o.resume;
    say(log, "resumed from {} at step {}\n", o.resume, shd.step_count());
  }
  if (o.resumed_from != nullptr) *o.resumed_from = from;
  // A fresh copy in this world's layout (what a gather left is the whole state, N shards).
  if (copies && from != "peers' memory") keep_copy();

  train_result res;
  std::vector<int> tokens(static_cast<std::size_t>(per_rank) * len),
      targets(static_cast<std::size_t>(per_rank) * len);
  const double global_tokens = static_cast<double>(o.batch) * static_cast<double>(len);
  std::vector<double> seq_loss(static_cast<std::size_t>(per_rank)),
      batch_loss(static_cast<std::size_t>(o.batch));
  const auto last =
      static_cast<std::uint64_t>(o.stop_after > 0 ? std::min(o.stop_after, o.steps) : o.steps);
  bool memory_shown = false;
  std::uint64_t trained = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (shd.step_count() < last) {
    const std::uint64_t step = shd.step_count();
    shd.set_learning_rate(learning_rate(o, step));
    for (int i = 0; i < per_rank; ++i) {
      const auto at = static_cast<std::size_t>(i) * len;
      text.sequence(o.seed, step, static_cast<std::uint64_t>(comm.rank() * per_rank + i), c.context,
                    tokens.data() + at, targets.data() + at);
    }
    const float grad_scale = shd.loss_scale() / static_cast<float>(global_tokens);
    double local = 0;
    if (o.reproducible) {
      src.keep(true);
      for (int i = 0; i < per_rank; ++i) {
        const auto at = static_cast<std::size_t>(i) * len;
        seq_loss[static_cast<std::size_t>(i)] =
            m.forward_backward(src, std::span<const int>(tokens).subspan(at, len),
                               std::span<const int>(targets).subspan(at, len), 1, grad_scale);
        shd.end_micro_batch();
      }
      src.keep(false);
    } else {
      local = m.forward_backward(src, tokens, targets, per_rank, grad_scale);
      shd.end_micro_batch();
    }
    const auto r = shd.step();
    const double loss = shd.run_collective([&](Comm& cm) {
      if (o.reproducible) {
        // Every sequence's loss, summed in batch order: the same bits at every world size.
        ringzero::all_gather(cm, std::span<const double>(seq_loss), std::span<double>(batch_loss),
                             cfg.collectives.all_gather);
        double l = 0;
        for (double x : batch_loss) l += x;
        return l / global_tokens;
      }
      double l = local / global_tokens;
      ringzero::all_reduce(cm, std::span<double>(&l, 1), ringzero::op::sum,
                           cfg.collectives.all_reduce);
      return l;
    });
    res.losses.push_back(loss);
    ++trained;
    if (o.checkpoint_every > 0 && r.step % static_cast<std::uint64_t>(o.checkpoint_every) == 0 &&
        r.step < last)
      shd.save(o.checkpoint);
    if (o.peer_copy != nullptr && o.peer_copy_every > 0 &&
        r.step % static_cast<std::uint64_t>(o.peer_copy_every) == 0 && r.step < last)
      keep_copy();
    if (o.after_step) o.after_step(r.step);
    if (o.arrivals && r.step < last) {
      int waiting = comm.rank() == 0 ? o.arrivals() : 0;
      shd.run_collective(
          [&](Comm& cm) { ringzero::broadcast(cm, std::span<int>(&waiting, 1), 0); });
      if (waiting > 0) {
        shd.save(o.checkpoint);
        say(log, "step {}: {} process(es) wait to join; saved to {} to regroup\n", r.step, waiting,
            o.checkpoint);
        res.regroup = true;
        return res;
      }
    }
    if (r.step % static_cast<std::uint64_t>(o.log_every) == 0 || r.step == 1 || r.step == last) {
      say(log, "step {:4}  loss {:.4f}  lr {:.2e}  grad-norm {:.3f}{}\n", r.step, loss,
          learning_rate(o, step), r.grad_norm, r.skipped ? "  (skipped: inf/nan gradient)" : "");
    }
    if (!memory_shown) {
      memory_shown = true;
      const auto mem = shd.memory();
      const std::uint64_t mine[6] = {mem.parameters, mem.gradients,    mem.optimizer,
                                     mem.buffers,    mem.peak_buffers, mem.secondary};
      std::vector<std::uint64_t> all(6 * static_cast<std::size_t>(n));
      shd.run_collective([&](Comm& cm) {
        ringzero::all_gather(cm, std::span<const std::uint64_t>(mine),
                             std::span<std::uint64_t>(all), cfg.collectives.all_gather);
      });
      const auto mib = [](std::uint64_t b) {
        return fmt::format("{:.3f}", static_cast<double>(b) / (1024.0 * 1024.0));
      };
      const bool hpz = mem.secondary > 0;
      say(log,
          "memory per rank (MiB)   parameters  gradients  optimizer  buffers(peak){}   total\n",
          hpz ? "  hpZ copy" : "");
      for (int q = 0; q < n; ++q) {
        const auto* e = all.data() + 6 * static_cast<std::size_t>(q);
        say(log, "  rank {:<3}             {:>10}  {:>9}  {:>9}  {:>7}({}){}  {:>7}\n", q,
            mib(e[0]), mib(e[1]), mib(e[2]), mib(e[3]), mib(e[4]),
            hpz ? fmt::format("  {:>8}", mib(e[5])) : std::string(),
            mib(e[0] + e[1] + e[2] + e[3] + e[5]));
      }
      const double f = zero_formula_bytes<P>(
          o.stage, static_cast<double>(plan.numel()), n,
          static_cast<double>(ringzero::dtype_size(*shd.configuration().reduce_dtype)));
      const double measured = static_cast<double>(mem.parameters + mem.gradients + mem.optimizer);
      say(log,
          "  ZeRO formula (stage {}, Psi = {}, N = {}): {} MiB per rank; measured without "
          "buffers {} MiB ({:+.2f}%, padding{})\n",
          o.stage, plan.numel(), n, mib(static_cast<std::uint64_t>(f)),
          mib(static_cast<std::uint64_t>(measured)), 100.0 * (measured - f) / f,
          o.reproducible ? " and the exact gradient accumulator" : "");
      if (o.reproducible)
        say(log,
            "  of the gradients, the exact accumulator of this rank's shard: {} MiB, {:.2f} bytes "
            "per element of the shard\n",
            mib(mem.accumulator),
            static_cast<double>(mem.accumulator) / static_cast<double>(plan.shard_size()));
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  res.tokens_per_second = seconds > 0 ? static_cast<double>(trained) * global_tokens / seconds : 0;
  if (trained > 0)
    say(log, "trained {} steps in {:.1f} s: {:.0f} tokens/s ({:.0f} per rank)\n", trained, seconds,
        res.tokens_per_second, res.tokens_per_second / n);
  if (!o.save.empty()) {
    shd.save(o.save);
    say(log, "saved step {} to {}\n", shd.step_count(), o.save);
  }
  res.weights = shd.full_parameters();
  say(log, "final fp32 weights: {} values, crc32c {:08x}\n", res.weights.size(),
      zero::detail::crc32c(std::as_bytes(std::span(res.weights))));
  if (o.eval > 0 && comm.rank() == 0) {
    // After the last collective, as the sample: the other ranks need not wait for it.
    res.eval_loss = evaluate(c, text, res.weights, o.eval, o.seed);
    say(log, "eval loss {:.4f} over {} sequences of {} tokens\n", res.eval_loss, o.eval, c.context);
  }
  if (o.sample > 0 && comm.rank() == 0) {
    res.sample = generate(c, text, res.weights, o.prompt, o.sample, o.temperature, o.seed);
    say(log, "sample (temperature {:g}):\n{}{}\n", o.temperature, o.prompt, res.sample);
  }
  return res;
}

}  // namespace gpt
