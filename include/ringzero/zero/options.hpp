// What a trainer configures on a sharder, and what it reads back: the stage, the optimizer, loss
// scaling, clipping, buckets, and the per-rank memory report.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/error.hpp"
#include "ringzero/model/cost_model.hpp"
#include "ringzero/types.hpp"
#include "ringzero/zero/optimizer_table.hpp"
#include "ringzero/zero/plan.hpp"
#include "ringzero/zero/stage.hpp"

namespace ringzero::zero {

[[nodiscard]] constexpr std::string_view optimizer_name(optimizer_kind k) noexcept {
  return describe(k).name;
}

/// The kind a name or alias of one of Table's optimizers stands for; throws invalid_argument
/// naming the ones it knows.
template <class Table = builtin_optimizers>
[[nodiscard]] optimizer_kind parse_optimizer(std::string_view s) {
  std::string known;
  for (const optimizer_descriptor& d : Table::rows) {
    if (s == d.name || (!d.alias.empty() && s == d.alias)) return d.kind;
    known += fmt::format("{}{}", known.empty() ? "" : " or ", d.name);
  }
  throw invalid_argument(fmt::format("unknown optimizer '{}' (expected {})", s, known));
}

struct optimizer_options {
  optimizer_kind kind = optimizer_kind::adamw;
  float lr = 1e-3f;
  float beta1 = 0.9f;     ///< adamw
  float beta2 = 0.999f;   ///< adamw
  float eps = 1e-8f;      ///< adamw
  float momentum = 0.9f;  ///< sgd
  bool nesterov = false;  ///< sgd
  /// adamw: decoupled (p -= lr*wd*p); sgd: L2 added to the gradient. Parameters registered with
  /// weight_decay = false are exempt.
  float weight_decay = 0.0f;
};

/// Optimizer settings for a group of parameters (param_spec::group indexes config::groups).
/// An unset field takes config::optimizer's value. A frozen parameter is never updated and takes
/// no gradient (add_grad refuses it); its optimizer state is still allocated.
struct param_group {
  std::string name = {};  ///< names the group in checkpoints: unique, no whitespace
  std::optional<float> lr = std::nullopt;
  std::optional<float> weight_decay = std::nullopt;
  std::optional<float> beta1 = std::nullopt;
  std::optional<float> beta2 = std::nullopt;
  bool frozen = false;
};

/// Throws invalid_argument for a group without a unique whitespace-free name, or with a learning
/// rate or weight decay < 0 or a beta outside [0, 1).
inline void check_groups(const std::vector<param_group>& groups) {
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto& pg = groups[g];
    if (pg.name.empty() || pg.name.find_first_of(" \t\r\n") != std::string::npos)
      throw invalid_argument(fmt::format("zero: group {} needs a name without whitespace", g));
    for (std::size_t h = 0; h < g; ++h)
      if (groups[h].name == pg.name)
        throw invalid_argument(fmt::format("zero: two groups are called {}", pg.name));
    auto check = [&](const std::optional<float>& v, const char* what, float below) {
      if (v && !(*v >= 0 && *v < below))
        throw invalid_argument(fmt::format("zero: group {}: {} {} (expected 0 <= {} < {})", pg.name,
                                           what, *v, what, below));
    };
    constexpr float unbounded = std::numeric_limits<float>::infinity();
    check(pg.lr, "lr", unbounded);
    check(pg.weight_decay, "weight_decay", unbounded);
    check(pg.beta1, "beta1", 1.0f);
    check(pg.beta2, "beta2", 1.0f);
  }
}

/// A learning-rate schedule: the factor every group's learning rate is multiplied by at a step
/// (0-based: the step about to be taken, skipped steps counted), as PyTorch's LambdaLR.
using lr_schedule = std::function<float(std::uint64_t step)>;

/// Linear warmup from 0 over `warmup` steps, then a cosine from 1 down to `min_factor` at step
/// `total` (and min_factor after it).
[[nodiscard]] inline lr_schedule warmup_cosine(std::uint64_t warmup, std::uint64_t total,
                                               float min_factor = 0.0f) {
  return [=](std::uint64_t step) -> float {
    if (step < warmup) return static_cast<float>(step + 1) / static_cast<float>(warmup);
    if (step >= total || total <= warmup) return min_factor;
    const double progress =
        static_cast<double>(step - warmup) / static_cast<double>(total - warmup);
    constexpr double pi = 3.14159265358979323846;
    return static_cast<float>(min_factor +
                              (1.0 - min_factor) * 0.5 * (1.0 + std::cos(pi * progress)));
  };
}

/// Dynamic loss scaling for float16 parameters (ignored otherwise: the scale stays 1). The
/// trainer multiplies its loss by loss_scale(); an overflow on any rank makes every rank skip
/// the step and multiply the scale by backoff; growth_interval clean steps multiply it by growth.
struct loss_scaling {
  float initial = 65536.0f;
  float growth = 2.0f;
  float backoff = 0.5f;
  int growth_interval = 1000;
  float min_scale = 1.0f;
  bool dynamic =
      true;  ///< false: the scale stays at `initial`, overflowing steps are still skipped
};

/// Options for each kind of collective the sharder issues. all_reduce: gradient buckets in stages
/// 0-1 and the step's overflow flag and norm; reduce_scatter: gradient buckets in stages 2-3;
/// all_gather: parameters (stages 1-3), full_parameters(), and the agreement on save/load
/// outcomes. An algorithm must implement its kind (checked when the sharder is built).
/// The ring for all three keeps the reduction order of an element the same whether it is
/// all_reduced (stages 0-1) or reduce_scattered (2-3): the stages then agree bit for bit.
/// Left at algorithm::automatic (the default), each is what the shard communicator's
/// fixed_order_algorithm() names: its own collectives where the transport runs them itself
/// (NCCL; the native shm transport's world), else the ring. An algorithm named here is run as
/// named: `ring` on NCCL is ringzero's fixed-order ring, not NCCL's choice (configuration() shows
/// what was resolved).
struct collective_options {
  ringzero::options all_reduce{};
  ringzero::options reduce_scatter{};
  ringzero::options all_gather{};
};

/// Throws invalid_argument naming the field whose algorithm cannot run its kind of collective.
/// `hierarchical`: the communicator knows node placement (algorithm::hierarchical is possible).
inline void check_collectives(const collective_options& c, bool hierarchical) {
  const std::pair<collective, const ringzero::options*> kinds[] = {
      {collective::all_reduce, &c.all_reduce},
      {collective::reduce_scatter, &c.reduce_scatter},
      {collective::all_gather, &c.all_gather}};
  for (const auto& [kind, opt] : kinds) {
    const algorithm a = opt->algorithm;
    if (a == algorithm::automatic) continue;
    if (!tuning::applies(kind, a, true))
      throw invalid_argument(fmt::format(
          "zero: config::collectives.{}: algorithm '{}' does not implement {} (choose one of {})",
          collective_name(kind), algorithm_name(a), collective_name(kind), [k = kind] {
            std::string names = "auto";
            for (algorithm x : tuning::candidates(k, true))
              names += fmt::format(", {}", algorithm_name(x));
            return names;
          }()));
    if (a == algorithm::hierarchical && !hierarchical)
      throw invalid_argument(fmt::format(
          "zero: config::collectives.{}: algorithm 'hier' needs a communicator with node topology",
          collective_name(kind)));
  }
}

/// Throws invalid_argument for a loss-scaling setting that cannot work.
inline void check_scaling(const loss_scaling& s) {
  if (!(s.initial > 0) || !std::isfinite(s.initial))
    throw invalid_argument(
        fmt::format("zero: loss_scaling.initial {} (expected finite > 0)", s.initial));
  if (!(s.growth >= 1) || !std::isfinite(s.growth))
    throw invalid_argument(
        fmt::format("zero: loss_scaling.growth {} (expected finite >= 1)", s.growth));
  if (!(s.backoff > 0 && s.backoff <= 1))
    throw invalid_argument(
        fmt::format("zero: loss_scaling.backoff {} (expected in (0, 1])", s.backoff));
  if (!(s.min_scale > 0) || !std::isfinite(s.min_scale))
    throw invalid_argument(
        fmt::format("zero: loss_scaling.min_scale {} (expected finite > 0)", s.min_scale));
}

struct config {
  /// 0: data parallel (all_reduce, full optimizer state everywhere); 1: optimizer state sharded;
  /// 2: gradients too (reduce_scatter); 3: parameters too (all_gather before use).
  int stage = 2;
  optimizer_options optimizer;
  /// Parameter groups (per-group learning rate, weight decay, betas, frozen). Empty: one group,
  /// config::optimizer's settings for every parameter.
  std::vector<param_group> groups;
  /// Multiplies every group's learning rate at each step; empty: constant.
  lr_schedule schedule;
  /// Target bucket size in bytes of the parameter type: the unit of reduction, of stage-3
  /// gathers and of overlap. A layer larger than this gets a bucket of its own. 0: one bucket.
  std::size_t bucket_bytes = std::size_t{4} << 20;
  /// Every parameter and every slice starts on a multiple of this many elements.
  std::size_t alignment = 16;
  /// Micro-batches per optimizer step. Stages 0 and 1 accumulate locally and reduce once, on the
  /// last micro-batch; stages 2 and 3 reduce every micro-batch into the gradient shard.
  int accumulation_steps = 1;
  /// > 0: clip the gradient to this global L2 norm.
  float max_grad_norm = 0.0f;
  /// true: the step uses the gradient averaged over ranks and micro-batches (each rank's
  /// gradient being a mean over its micro-batch); false: summed (the trainer divides its loss by
  /// the global batch).
  bool average_gradients = true;
  loss_scaling scaling;
  /// Stage 3: bytes of gathered parameters allowed at once, prefetched buckets included.
  /// 0: two of the largest bucket.
  std::size_t max_gathered_bytes = 0;
  /// Gradient buckets in flight (stages 2 and 3): backward fills one while the communication
  /// thread reduces another.
  int reduce_buffers = 2;
  /// Run collectives on a communication thread so they overlap backward; false runs them inline.
  bool comm_thread = true;
  /// The type gradients are reduced and accumulated in: the parameter type or dtype::float32.
  /// Empty (the default) is float32: the sum of N ranks' and K micro-batches' 16-bit gradients
  /// is then neither rounded after every micro-batch (bf16) nor overflowed (fp16), as DeepSpeed's
  /// fp32 gradient accumulation and FSDP's MixedPrecisionPolicy(reduce_dtype=float32) do. The
  /// cost, for 16-bit parameters: twice the gradient memory and twice the bytes each gradient
  /// collective moves. Name the parameter type to reduce in 16 bits (half the memory and
  /// traffic, rounding as it goes). check_config() resolves the default.
  std::optional<dtype> reduce_dtype;
  /// Every gradient is multiplied by 1/gradient_predivide before it is reduced, and the step
  /// multiplies it back: with fp16 gradients reduced in fp16, a predivide of N*K (a power of two
  /// keeps it exact) keeps the sum of N*K scaled gradients below fp16's 65504.
  float gradient_predivide = 1.0f;
  /// Options for each kind of collective the sharder issues (see collective_options).
  collective_options collectives;
  /// Hybrid sharding (shard_group.hpp): shard the state over groups of this many consecutive
  /// ranks and replicate it across the groups. 0 or the world size: one group of every rank.
  /// Must divide the world size. -1 (zero::shard_group_per_node): one group per node.
  int shard_group_size = 0;
  /// Reproducible training: the same weights, bit for bit, at every world size (and every
  /// stage, shard group size and transport), provided the global batch is a fixed list of
  /// micro-batches, every rank takes a contiguous run of it (accumulation_steps of them), and
  /// each micro-batch's gradient is computed the same way whoever computes it. Each micro-batch's
  /// gradients go, as they are, to the ranks that own them, which add them exactly into an
  /// accumulator of their shard (zero/exact_gradients.hpp); each element is rounded once, on
  /// the last micro-batch; the global norm is an exact sum of squares, rounded once; the loss
  /// scaler's overflow check reads the rounded gradients. The sum of the global batch's
  /// gradients is then the same bits whatever the world size, and so is everything after it.
  /// The cost: about 8.25 bytes of accumulator per element of this rank's shard in every stage
  /// (memory_report::accumulator), over which stages 2-3 keep their gradient shard; each
  /// micro-batch moves (N-1)/N of every bucket in G per rank (stages 0-1 too, where the plain
  /// mode reduces once per step), a bucket whose parameters are used u times u such layers. On a
  /// device space the accumulators, their adds and the exact norm's squares stay on the device;
  /// a step reads 4 KiB of the norm's bins back.
  bool reproducible = false;
  /// ZeRO++ qwZ (zero/zeropp.hpp): stage 3 gathers the parameters as int8 blocks
  /// (collectives.all_gather.wire_block elements per scale; 0: 256). DeepSpeed's name.
  bool zero_quantized_weights = false;
  /// ZeRO++ qgZ: gradient buckets are reduced as int4 blocks (collectives.reduce_scatter's and
  /// all_reduce's wire_block) through the two-hop all-to-all over the nodes, added in float.
  bool zero_quantized_gradients = false;
  /// ZeRO++ hpZ (stage 3): > 1 keeps a secondary copy of the parameters sharded within groups of
  /// this many consecutive ranks (normally the ranks of a node; it must divide the shard group),
  /// from which backward gathers inside the group. 0 or 1: off.
  int zero_hpz_partition_size = 0;
};

/// Throws invalid_argument for ZeRO++ settings that cannot work (zero/zeropp.hpp): qwZ and hpZ
/// without stage 3, a negative hpZ group, qgZ with reproducible training, or a wire format named
/// in config::collectives instead.
inline void check_zeropp(const config& cfg) {
  if (cfg.zero_quantized_weights && cfg.stage != 3)
    throw invalid_argument(
        fmt::format("zero: zero_quantized_weights quantizes stage 3's parameter gathers (stage {})",
                    cfg.stage));
  if (cfg.zero_hpz_partition_size < 0)
    throw invalid_argument(fmt::format("zero: zero_hpz_partition_size {} (expected 0, 1 or more)",
                                       cfg.zero_hpz_partition_size));
  if (cfg.zero_hpz_partition_size > 1 && cfg.stage != 3)
    throw invalid_argument(fmt::format(
        "zero: zero_hpz_partition_size shards stage 3's parameters a second time (stage {})",
        cfg.stage));
  if (cfg.zero_quantized_gradients && cfg.reproducible)
    throw invalid_argument(
        "zero: zero_quantized_gradients and reproducible exclude each other (an exact sum of "
        "quantized gradients is not the exact sum of the gradients)");
  for (const ringzero::options* o :
       {&cfg.collectives.all_reduce, &cfg.collectives.reduce_scatter, &cfg.collectives.all_gather})
    if (o->wire != wire_format::full)
      throw invalid_argument(fmt::format(
          "zero: config::collectives names wire format {}; the sharder quantizes through "
          "zero_quantized_weights and zero_quantized_gradients",
          wire_format_name(o->wire)));
}

/// The config a sharder of `param_type` parameters trains `layout` with, or invalid_argument
/// naming the first setting that cannot work. `hierarchical`: the communicator knows its nodes,
/// so the 'hier' algorithm can run.
[[nodiscard]] inline config check_config(config cfg, const model_layout& layout, dtype param_type,
                                         bool hierarchical) {
  (void)stage_of(cfg.stage);
  if (cfg.accumulation_steps < 1)
    throw invalid_argument(fmt::format("zero: accumulation_steps {} < 1", cfg.accumulation_steps));
  if (cfg.reduce_buffers < 1)
    throw invalid_argument(fmt::format("zero: reduce_buffers {} < 1", cfg.reduce_buffers));
  if (!(cfg.optimizer.lr >= 0) || !(cfg.max_grad_norm >= 0))
    throw invalid_argument("zero: learning rate and max_grad_norm must be >= 0");
  check_scaling(cfg.scaling);
  if (cfg.reduce_dtype && *cfg.reduce_dtype != param_type && *cfg.reduce_dtype != dtype::float32)
    throw invalid_argument(
        fmt::format("zero: reduce_dtype {} (expected the parameter type {} or float32)",
                    dtype_name(*cfg.reduce_dtype), dtype_name(param_type)));
  if (!cfg.reduce_dtype) cfg.reduce_dtype = dtype::float32;
  if (!(cfg.gradient_predivide > 0) || !std::isfinite(cfg.gradient_predivide))
    throw invalid_argument(
        fmt::format("zero: gradient_predivide {} (expected finite > 0)", cfg.gradient_predivide));
  check_collectives(cfg.collectives, hierarchical);
  check_zeropp(cfg);
  check_groups(cfg.groups);
  const auto n_groups = std::max<std::size_t>(1, cfg.groups.size());
  for (const auto& p : layout.params())
    if (p.group < 0 || static_cast<std::size_t>(p.group) >= n_groups)
      throw invalid_argument(fmt::format("zero: parameter {} is in group {}, config has {}", p.name,
                                         p.group, n_groups));
  for (const auto& p : layout.params())
    if (p.type != param_type)
      throw invalid_argument(fmt::format(
          "zero: parameter {} is registered as {} but this sharder trains {} parameters", p.name,
          dtype_name(p.type), dtype_name(param_type)));
  return cfg;
}

/// Whether parameters of group `group` are frozen (take no gradient, are never updated).
[[nodiscard]] inline bool frozen(const config& cfg, int group) noexcept {
  const auto g = static_cast<std::size_t>(group);
  return g < cfg.groups.size() && cfg.groups[g].frozen;
}

/// Throws invalid_argument for a gradient handed over for `p` when its group is frozen, so a
/// trainer that forgot to detach a frozen parameter hears of it instead of the gradient
/// vanishing.
inline void check_trainable(const config& cfg, const param_info& p) {
  if (frozen(cfg, p.group))
    throw invalid_argument(fmt::format("add_grad: {} belongs to the frozen group {}", p.name,
                                       cfg.groups[static_cast<std::size_t>(p.group)].name));
}

/// The name a group's learning rate is saved under in checkpoints ("default" for the one group
/// of a config without groups).
[[nodiscard]] inline std::string group_name(const config& cfg, std::size_t g) {
  return g < cfg.groups.size() ? cfg.groups[g].name : std::string("default");
}

/// Bytes this rank holds, by category: the sizes of the buffers the sharder allocated.
struct memory_report {
  int rank = 0;
  int stage = 0;
  std::size_t parameters = 0;  ///< parameters in their training type (full, or a shard in stage 3)
  std::size_t gradients = 0;   ///< gradients (full in stages 0-1, a shard in 2-3)
  /// Of `gradients`: reproducible training's exact accumulators, a shard in every stage (in
  /// stages 2-3 the gradient shard lies over them).
  std::size_t accumulator = 0;
  std::size_t optimizer = 0;  ///< fp32 master weights (16-bit types) and optimizer moments
  std::size_t buffers = 0;    ///< gradient buckets and gathered parameters, now
  std::size_t peak_buffers = 0;
  std::size_t secondary = 0;  ///< hpZ's secondary copy of the parameters (zero_hpz_partition_size)
  [[nodiscard]] std::size_t total() const noexcept {
    return parameters + gradients + optimizer + buffers + secondary;
  }
  [[nodiscard]] std::string to_string() const {
    constexpr double mib = 1024.0 * 1024.0;
    return fmt::format(
        "rank {} stage {}: parameters {:.3f} MiB, gradients {:.3f} MiB{}, optimizer {:.3f} MiB, "
        "buffers {:.3f} MiB (peak {:.3f}){}, total {:.3f} MiB",
        rank, stage, static_cast<double>(parameters) / mib, static_cast<double>(gradients) / mib,
        accumulator == 0
            ? std::string()
            : fmt::format(" (exact accumulator {:.3f})", static_cast<double>(accumulator) / mib),
        static_cast<double>(optimizer) / mib, static_cast<double>(buffers) / mib,
        static_cast<double>(peak_buffers) / mib,
        secondary == 0
            ? std::string()
            : fmt::format(", hpZ secondary {:.3f} MiB", static_cast<double>(secondary) / mib),
        static_cast<double>(total()) / mib);
  }
};

/// What step() did.
struct step_result {
  bool skipped = false;    ///< a non-finite gradient on some rank: nothing was updated
  double grad_norm = 0.0;  ///< global L2 norm of the (unscaled, averaged) gradient, before clipping
  float loss_scale = 1.0f;  ///< the scale this step's gradients carried
  std::uint64_t step = 0;   ///< steps taken so far, skipped ones included
};

}  // namespace ringzero::zero

template <>
struct fmt::formatter<ringzero::zero::memory_report> : fmt::formatter<std::string_view> {
  template <class Ctx>
  auto format(const ringzero::zero::memory_report& m, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(m.to_string(), ctx);
  }
};
