// The ZeRO sharder: data-parallel training where each rank keeps only 1/N of the model state.
//
//   zero::config cfg{.stage = 2, .optimizer = {.lr = 1e-3f}, .max_grad_norm = 1.0f};
//   zero::sharder<comm_t, bfloat16> shd(comm, layout, cfg);     // comm_t: any communicator
//   for (int p = 0; p < n_params; ++p) shd.set_parameter(p, initial_values[p]);
//   for (step...) {
//     for (layer l = 0..L-1) { auto w = shd.gather(l); forward(w.param(...)); }
//     for (layer l = L-1..0) { auto w = shd.gather(l, zero::pass::backward); ...;
//                              shd.add_grad(p, grad_of_p); }
//     shd.end_micro_batch();
//     auto r = shd.step();   // r.skipped, r.grad_norm
//   }
//
// What each rank holds, for Ψ parameters of a 16-bit type trained with AdamW on N ranks:
//
//   stage 0  parameters 2Ψ, gradients 2Ψ, fp32 master + 2 moments 12Ψ      = 16Ψ
//   stage 1  parameters 2Ψ, gradients 2Ψ, optimizer state 12Ψ/N            = 4Ψ + 12Ψ/N
//   stage 2  parameters 2Ψ, gradient shard 2Ψ/N, optimizer state 12Ψ/N     = 2Ψ + 14Ψ/N
//   stage 3  parameter shard 2Ψ/N, gradient shard 2Ψ/N, optimizer 12Ψ/N    = 16Ψ/N
//
// plus, in stages 2 and 3, `reduce_buffers` gradient buckets and, in stage 3, at most
// `max_gathered_bytes` of gathered parameters. fp32 parameters need no separate master copy
// (the optimizer updates them in place): 4Ψ + 4Ψ + 8Ψ/N in stage 1, and so on.
//
// Collectives per step: stages 0 and 1 all_reduce each gradient bucket (on the last
// micro-batch); stages 2 and 3 reduce_scatter it (every micro-batch); stages 1 and 2 all_gather
// the updated parameters after the step; stage 3 all_gathers a bucket's parameters when a layer
// in it is first used in a pass. All of them run on one communication thread, so reducing bucket
// k overlaps backward computing bucket k-1, and gathering the next bucket overlaps computing
// with this one. The trainer thread must not use the communicator itself while the sharder has
// work queued; run_collective() runs a collective of its own in line with the sharder's.
//
// The sharder is a façade over its parts, each in its own header: the stage table (stage.hpp),
// the gradient reducer (gradient_reducer.hpp), the stage-3 parameter cache (parameter_cache.hpp),
// the loss scaler (loss_scaler.hpp), the shard optimizer (optimizer.hpp) and checkpoint I/O
// (checkpoint.hpp). It uses the communicator only through the collectives API
// (ringzero::all_reduce, reduce_scatter, all_gather) and comm.rank()/size().
//
// Every element is reduced along the same ring path whether its bucket is all_reduced or
// reduce_scattered, and the optimizer arithmetic is element-wise and shared, so with one
// micro-batch per step all four stages produce bitwise identical weights.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "ringzero/collectives.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/op.hpp"
#include "ringzero/trace.hpp"
#include "ringzero/types.hpp"
#include "ringzero/zero/checkpoint.hpp"
#include "ringzero/zero/detail/buffer_meter.hpp"
#include "ringzero/zero/detail/worker.hpp"
#include "ringzero/zero/gradient_reducer.hpp"
#include "ringzero/zero/loss_scaler.hpp"
#include "ringzero/zero/optimizer.hpp"
#include "ringzero/zero/options.hpp"
#include "ringzero/zero/parameter_cache.hpp"
#include "ringzero/zero/plan.hpp"
#include "ringzero/zero/stage.hpp"

namespace ringzero::zero {

template <class P>
concept parameter_type =
    std::is_same_v<P, float> || std::is_same_v<P, bfloat16> || std::is_same_v<P, float16>;

template <class Comm, parameter_type P>
class sharder {
 public:
  using param_type = P;

  /// Builds the partition plan and allocates this rank's buffers. Every parameter in `layout`
  /// must have type dtype_of<P>(). Not collective: every rank constructs with the same layout
  /// and config and computes the same plan. A config that cannot work (an algorithm that does
  /// not implement the collective it is chosen for, a loss scaling that cannot grow) is an
  /// invalid_argument here.
  sharder(Comm& comm, const model_layout& layout, config cfg)
      : comm_(comm),
        cfg_(checked(std::move(cfg), layout)),
        stage_(stage_of(cfg_.stage)),
        rank_(comm.rank()),
        world_(comm.size()),
        plan_(layout, world_, bucket_elements(cfg_), cfg_.alignment),
        own_(plan_.segments(rank_)),
        local_(stage_.sharded_optimizer ? own_ : all_segments(plan_)),
        params_(stage_.sharded_parameters ? plan_.shard_size() : plan_.padded_size(), P{}),
        optimizer_(cfg_.optimizer,
                   stage_.sharded_optimizer ? plan_.shard_size() : plan_.padded_size()),
        scaler_(cfg_.scaling, std::is_same_v<P, float16>),
        group_lr_(initial_group_lr(cfg_)),
        reducer_(make_reducer()),
        cache_(comm, plan_, std::span<const P>(params_), cfg_.collectives.all_gather,
               cfg_.max_gathered_bytes, worker_, meter_),
        worker_(cfg_.comm_thread) {
    log::info("zero: stage {}, {} parameters ({}), {}", cfg_.stage, plan_.numel(),
              dtype_name(dtype_of<P>()), memory());
  }

  sharder(const sharder&) = delete;
  sharder& operator=(const sharder&) = delete;

  [[nodiscard]] const partition_plan& plan() const noexcept { return plan_; }
  [[nodiscard]] const config& configuration() const noexcept { return cfg_; }
  [[nodiscard]] int stage() const noexcept { return cfg_.stage; }
  [[nodiscard]] const stage_layout& layout_of_stage() const noexcept { return stage_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int world_size() const noexcept { return world_; }
  /// Steps taken, skipped ones included.
  [[nodiscard]] std::uint64_t step_count() const noexcept { return step_; }
  /// Steps that updated the weights.
  [[nodiscard]] std::uint64_t optimizer_steps() const noexcept { return optimizer_steps_; }
  /// What the trainer multiplies its loss by (1 unless P is float16).
  [[nodiscard]] float loss_scale() const noexcept { return scaler_.scale(); }
  /// false for a parameter of a frozen group (hand it no gradient).
  [[nodiscard]] bool trainable(int id) const {
    const auto g = static_cast<std::size_t>(param(id, "trainable").group);
    return g >= cfg_.groups.size() || !cfg_.groups[g].frozen;
  }

  /// Sets every parameter group's base learning rate (what the schedule multiplies).
  void set_learning_rate(float lr) noexcept { std::fill(group_lr_.begin(), group_lr_.end(), lr); }
  /// Sets one group's base learning rate.
  void set_learning_rate(int group, float lr) { group_lr_.at(group_index(group)) = lr; }
  /// The learning rate group `group` uses in the next step: its base rate times the schedule at
  /// step_count(). Checkpoints keep the base rates and the step.
  [[nodiscard]] float learning_rate(int group = 0) const {
    const float base = group_lr_.at(group_index(group));
    return cfg_.schedule ? base * cfg_.schedule(step_) : base;
  }

  /// Sets a parameter's value from fp32. Every rank passes the same values (e.g. generated from
  /// the same seed); each keeps the part it needs.
  void set_parameter(int id, std::span<const float> values) {
    const auto& pi = param(id, "set_parameter");
    if (values.size() != pi.numel)
      throw invalid_argument(fmt::format("set_parameter: {} has {} elements, got {}", pi.name,
                                         pi.numel, values.size()));
    quiesce();
    if (!stage_.sharded_parameters)
      for (std::size_t i = 0; i < pi.numel; ++i) params_[pi.offset + i] = to_param<P>(values[i]);
    for (const auto& s : local_)
      if (s.param == id)
        optimizer_.set(local_of(s), param_ptr(s), values.data() + s.begin, s.count);
  }

  /// A parameter's full value in stages 0-2 (stage 3 keeps only shards: use gather()).
  [[nodiscard]] std::span<const P> parameter(int id) const {
    const auto& pi = param(id, "parameter");
    if (stage_.sharded_parameters)
      throw invalid_argument(fmt::format(
          "parameter({}): stage 3 keeps only this rank's shard; gather() the layer instead",
          pi.name));
    return {params_.data() + pi.offset, pi.numel};
  }

  /// The parameters of one bucket, present while a handle exists. In stages 0-2 every
  /// parameter is always present and the handle is free. A handle held across step() reads the
  /// updated weights afterwards (stage 3 gathers its bucket again).
  class gathered {
   public:
    gathered(gathered&& o) noexcept
        : owner_(std::exchange(o.owner_, nullptr)),
          bucket_(o.bucket_),
          base_(o.base_),
          base_offset_(o.base_offset_) {}
    gathered& operator=(gathered&& o) noexcept {
      if (this != &o) {
        release();
        owner_ = std::exchange(o.owner_, nullptr);
        bucket_ = o.bucket_;
        base_ = o.base_;
        base_offset_ = o.base_offset_;
      }
      return *this;
    }
    gathered(const gathered&) = delete;
    gathered& operator=(const gathered&) = delete;
    ~gathered() { release(); }

    /// The full value of parameter `id`, which must lie in the gathered bucket.
    [[nodiscard]] std::span<const P> param(int id) const {
      if (owner_ == nullptr) throw invalid_argument("gathered::param on a released handle");
      const auto& pi = owner_->param(id, "gathered::param");
      if (bucket_ >= 0 && pi.bucket != bucket_)
        throw invalid_argument(
            fmt::format("gathered::param: {} lives in bucket {}, this handle holds bucket {}",
                        pi.name, pi.bucket, bucket_));
      return {base_ + (pi.offset - base_offset_), pi.numel};
    }

   private:
    friend class sharder;
    gathered(sharder* owner, int bucket, const P* base, std::size_t base_offset)
        : owner_(owner), bucket_(bucket), base_(base), base_offset_(base_offset) {}
    void release() noexcept {
      if (owner_ != nullptr && bucket_ >= 0) owner_->cache_.release(bucket_);
      owner_ = nullptr;
    }
    sharder* owner_ = nullptr;
    int bucket_ = -1;
    const P* base_ = nullptr;
    std::size_t base_offset_ = 0;
  };

  /// Makes layer `layer`'s parameters present and returns a handle to them. Stage 3: all_gathers
  /// the layer's bucket unless it is still present; forward and backward passes free buckets the
  /// pass has left behind and prefetch the following buckets (in their direction) while the
  /// gathered bytes stay within max_gathered_bytes; pass::recompute (activation recomputation
  /// inside backward) does neither. Every rank must make the same sequence of gather calls.
  [[nodiscard]] gathered gather(int layer, pass direction = pass::forward) {
    if (layer < 0 || static_cast<std::size_t>(layer) >= plan_.layers().size())
      throw invalid_argument(fmt::format("gather: layer {} of {}", layer, plan_.layers().size()));
    if (!stage_.sharded_parameters) return gathered(this, -1, params_.data(), 0);
    const int b = plan_.layers()[static_cast<std::size_t>(layer)].bucket;
    const P* base = cache_.acquire(b, direction);
    return gathered(this, b, base, plan_.buckets()[static_cast<std::size_t>(b)].offset);
  }

  /// Hands over parameter `id`'s gradient for this micro-batch (each parameter at most once per
  /// micro-batch; one never handed over counts as zero). A bucket whose gradients are all in is
  /// queued for reduction at once, in descending bucket order, so handing gradients over in
  /// backward order overlaps reduction with the rest of backward.
  void add_grad(int id, std::span<const P> g) {
    check_trainable(id);
    std::visit([&](auto& r) { r.add(id, g); }, reducer_);
  }

  /// The same from fp32 gradients, rounded to P (or to the reduce_dtype) first.
  void add_grad(int id, std::span<const float> g) requires(!std::is_same_v<P, float>) {
    check_trainable(id);
    std::visit([&](auto& r) { r.add(id, g); }, reducer_);
  }

  /// Ends a micro-batch: queues the buckets still waiting (missing gradients are zero).
  void end_micro_batch() {
    std::visit([](auto& r) { r.end_micro_batch(); }, reducer_);
    if (stage_.sharded_parameters) cache_.evict_unreferenced();
  }

  /// The optimizer step, after accumulation_steps micro-batches: waits for the reductions,
  /// checks every rank's gradients for inf/NaN (all skip together), clips to the global norm,
  /// updates this rank's shard, all_gathers the new parameters (stages 1, 2) or refreshes the
  /// gathered buckets (stage 3). Collective.
  step_result step() {
    if (micro_batches() != cfg_.accumulation_steps)
      throw invalid_argument(
          fmt::format("step() after {} of {} micro-batches: call end_micro_batch() after each",
                      micro_batches(), cfg_.accumulation_steps));
    const trace::scope phase(comm_, "step", optimizer_bytes());
    worker_.drain();
    step_result res;
    res.loss_scale = scaler_.scale();
    const float divisor =
        cfg_.average_gradients ? static_cast<float>(world_ * cfg_.accumulation_steps) : 1.0f;
    const float unscale = cfg_.gradient_predivide / (scaler_.scale() * divisor);
    double sumsq = 0.0;
    bool nonfinite = false;
    std::visit(
        [&](auto& r) {
          for (const auto& s : own_) grad_stats(r.gradient(s), s.count, unscale, sumsq, nonfinite);
        },
        reducer_);
    std::int32_t overflow = nonfinite ? 1 : 0;
    run_collective([&](Comm& c) {
      ringzero::all_reduce(c, std::span<std::int32_t>(&overflow, 1), op::max,
                           cfg_.collectives.all_reduce);
      ringzero::all_reduce(c, std::span<double>(&sumsq, 1), op::sum, cfg_.collectives.all_reduce);
    });
    res.grad_norm = std::sqrt(sumsq);
    std::visit([](auto& r) { r.start_step(); }, reducer_);
    const std::uint64_t at = step_;
    ++step_;
    res.step = step_;
    scaler_.update(overflow != 0);
    if (overflow != 0) {
      res.skipped = true;
      log::info("zero: step {} skipped: non-finite gradient (loss scale now {})", step_,
                scaler_.scale());
      return res;
    }
    float clip = 1.0f;
    if (cfg_.max_grad_norm > 0 && res.grad_norm > cfg_.max_grad_norm)
      clip = static_cast<float>(cfg_.max_grad_norm / (res.grad_norm + 1e-6));
    ++optimizer_steps_;
    std::vector<step_constants> ks;
    for (std::size_t g = 0; g < group_lr_.size(); ++g) {
      auto o = group_options(cfg_.optimizer, cfg_.groups, g);
      o.lr = cfg_.schedule ? group_lr_[g] * cfg_.schedule(at) : group_lr_[g];
      ks.push_back(make_step_constants(o, optimizer_steps_, unscale * clip));
    }
    std::visit(
        [&](auto& r) {
          for (const auto& s : local_) {
            const auto& pi = plan_.params()[static_cast<std::size_t>(s.param)];
            const auto g = static_cast<std::size_t>(pi.group);
            if (g < cfg_.groups.size() && cfg_.groups[g].frozen) continue;
            optimizer_.update(r.gradient(s), local_of(s), param_ptr(s), s.count, ks[g],
                              pi.weight_decay);
          }
        },
        reducer_);
    if (stage_.gather_after_step) gather_flat_parameters();
    if (stage_.sharded_parameters) cache_.refresh();
    return res;
  }

  /// Runs f(comm) on the communication thread, after everything already queued, and returns its
  /// result: how a trainer issues collectives of its own (a loss all_reduce) safely.
  template <class F>
  decltype(auto) run_collective(F&& f) {
    using R = std::invoke_result_t<F&, Comm&>;
    if constexpr (std::is_void_v<R>) {
      worker_.wait(worker_.submit([&] { f(comm_); }));
    } else {
      std::optional<R> r;
      worker_.wait(worker_.submit([&] { r.emplace(f(comm_)); }));
      return R(std::move(*r));
    }
  }

  /// Bytes this rank holds now, by category.
  [[nodiscard]] memory_report memory() const {
    memory_report m;
    m.rank = rank_;
    m.stage = cfg_.stage;
    m.parameters = params_.capacity() * sizeof(P);
    m.gradients = std::visit([](const auto& r) { return r.gradient_bytes(); }, reducer_);
    m.optimizer = optimizer_.bytes();
    m.buffers = meter_.now;
    m.peak_buffers = meter_.peak;
    return m;
  }

  /// Every parameter's fp32 master value, concatenated in registration order, on every rank.
  /// Collective (an all_gather per bucket, except in stage 0).
  [[nodiscard]] std::vector<float> full_parameters() {
    quiesce();
    std::vector<float> out(plan_.numel());
    std::vector<std::size_t> start(plan_.params().size());
    std::size_t at = 0;
    for (std::size_t i = 0; i < start.size(); ++i) {
      start[i] = at;
      at += plan_.params()[i].numel;
    }
    if (!stage_.sharded_optimizer) {
      for (const auto& s : local_)
        std::copy_n(master_ptr(s), s.count,
                    out.begin() + static_cast<std::ptrdiff_t>(
                                      start[static_cast<std::size_t>(s.param)] + s.begin));
      return out;
    }
    const std::vector<float> mine = own_array(0);
    std::vector<float> flat(plan_.padded_size());
    run_collective([&](Comm& c) {
      for (const auto& b : plan_.buckets())
        ringzero::all_gather(c, std::span<const float>(mine.data() + b.shard_offset, b.slice),
                             std::span<float>(flat.data() + b.offset, b.padded),
                             cfg_.collectives.all_gather);
    });
    for (std::size_t i = 0; i < start.size(); ++i) {
      const auto& pi = plan_.params()[i];
      std::copy_n(flat.begin() + static_cast<std::ptrdiff_t>(pi.offset), pi.numel,
                  out.begin() + static_cast<std::ptrdiff_t>(start[i]));
    }
    return out;
  }

  /// Writes a checkpoint of the whole training state into `dir` (see checkpoint.hpp).
  /// Collective; call between steps. Raises checkpoint_error on every rank if any rank fails;
  /// whatever fails, the checkpoint `dir` held before stays loadable.
  void save(const std::filesystem::path& dir) {
    if (micro_batches() != 0)
      throw invalid_argument("save: a step is in progress; call it after step()");
    trace::scope phase(comm_, "checkpoint");
    quiesce();
    std::string failure;
    detail::written_file written;
    const std::uint64_t save_id = detail::unique_id();
    try {
      detail::create_directories_durable(dir);
      std::vector<std::vector<float>> arrays;
      for (int a = 0; a <= optimizer_.moment_count(); ++a) arrays.push_back(own_array(a));
      written = detail::write_shard(dir, rank_, world_, step_, save_id, arrays, plan_.shard_size());
      phase.set_bytes(written.bytes);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    if (auto f = agree_on_failure(failure); !f.empty()) throw checkpoint_error(f);
    const std::uint64_t mine[3] = {written.bytes, written.crc, save_id};
    std::vector<std::uint64_t> all(3 * static_cast<std::size_t>(world_));
    run_collective([&](Comm& c) {
      ringzero::all_gather(c, std::span<const std::uint64_t>(mine), std::span<std::uint64_t>(all),
                           cfg_.collectives.all_gather);
    });
    if (rank_ == 0) {
      try {
        detail::commit_manifest(
            dir, make_manifest(plan_, cfg_.stage, dtype_of<P>(), cfg_.optimizer.kind,
                               {step_, optimizer_steps_, scaler_.scale(), scaler_.good_steps()},
                               saved_groups(), all));
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    // Also the barrier that keeps a fast rank's next save from racing rank 0's cleanup.
    if (auto f = agree_on_failure(failure); !f.empty()) throw checkpoint_error(f);
    log::info("zero: saved step {} to {}", step_, dir.string());
  }

  /// Restores a checkpoint written by save() at any world size and stage: weights, optimizer
  /// moments, step counts and (for float16) the loss scaler. Collective; every rank raises
  /// checkpoint_error if any rank finds the checkpoint missing, incomplete, corrupt or
  /// incompatible with this model.
  void load(const std::filesystem::path& dir) {
    if (micro_batches() != 0)
      throw invalid_argument("load: a step is in progress; call it after step()");
    const trace::scope phase(comm_, "checkpoint", optimizer_bytes());
    quiesce();
    std::string failure;
    checkpoint_manifest m;
    // Read into staging arrays laid out as the optimizer state, so a refused checkpoint leaves
    // the current state untouched.
    const std::size_t local_size = optimizer_.local_size();
    std::vector<float> master(local_size), m1(local_size), m2(optimizer_.moment_size(2));
    try {
      const checkpoint_reader reader(dir);
      m = reader.manifest();
      check_compatible(m, plan_, cfg_.optimizer.kind, dir);
      std::vector<checkpoint_reader::request> reqs;
      for (const auto& s : local_) {
        const int mp = m.find(plan_.params()[static_cast<std::size_t>(s.param)].name);
        const std::size_t l = local_of(s);
        reqs.push_back({mp, s.begin, s.count, 0, master.data() + l});
        reqs.push_back({mp, s.begin, s.count, 1, m1.data() + l});
        if (!m2.empty()) reqs.push_back({mp, s.begin, s.count, 2, m2.data() + l});
      }
      reader.read(reqs);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    if (auto f = agree_on_failure(failure); !f.empty()) throw checkpoint_error(f);
    for (const auto& s : local_)
      optimizer_.set(local_of(s), param_ptr(s), master.data() + local_of(s), s.count);
    optimizer_.replace_moments(m1, m2);
    if (stage_.gather_after_step) gather_flat_parameters();
    step_ = m.step;
    optimizer_steps_ = m.optimizer_steps;
    if (m.precision == dtype::float16) scaler_.restore(m.loss_scale, m.good_steps);
    for (const auto& g : m.groups)
      for (std::size_t i = 0; i < group_lr_.size(); ++i)
        if (group_name(i) == g.name) group_lr_[i] = g.lr;
    log::info("zero: loaded step {} from {} (saved by {} ranks at stage {})", step_, dir.string(),
              m.world_size, m.stage);
  }

 private:
  /// The fp32 optimizer state this rank holds (master weights where P is 16-bit, and the
  /// moments): the size a step or a checkpoint of it touches, for the trace.
  [[nodiscard]] std::size_t optimizer_bytes() const noexcept {
    const std::size_t arrays = static_cast<std::size_t>(optimizer_.moment_count()) +
                               (shard_optimizer<P>::has_master ? 1 : 0);
    return optimizer_.local_size() * arrays * sizeof(float);
  }
  // Gradients reduced in the parameter type, or in float (config::reduce_dtype).
  using reducer_type = std::variant<gradient_reducer<Comm, P>, gradient_reducer<Comm, float>>;

  [[nodiscard]] reducer_type make_reducer() {
    if (cfg_.reduce_dtype == dtype::float32)
      return reducer_type(std::in_place_index<1>, comm_, plan_, stage_, cfg_, worker_, meter_);
    return reducer_type(std::in_place_index<0>, comm_, plan_, stage_, cfg_, worker_, meter_);
  }

  static std::vector<float> initial_group_lr(const config& cfg) {
    std::vector<float> lr;
    for (std::size_t g = 0; g < std::max<std::size_t>(1, cfg.groups.size()); ++g)
      lr.push_back(group_options(cfg.optimizer, cfg.groups, g).lr);
    return lr;
  }
  [[nodiscard]] std::size_t group_index(int group) const {
    if (group < 0 || static_cast<std::size_t>(group) >= group_lr_.size())
      throw invalid_argument(
          fmt::format("zero: parameter group {} of {}", group, group_lr_.size()));
    return static_cast<std::size_t>(group);
  }
  [[nodiscard]] std::string group_name(std::size_t g) const {
    return g < cfg_.groups.size() ? cfg_.groups[g].name : std::string("default");
  }
  [[nodiscard]] std::vector<checkpoint_manifest::group> saved_groups() const {
    std::vector<checkpoint_manifest::group> out;
    for (std::size_t g = 0; g < group_lr_.size(); ++g) out.push_back({group_name(g), group_lr_[g]});
    return out;
  }
  void check_trainable(int id) const {
    const auto& pi = param(id, "add_grad");
    const auto g = static_cast<std::size_t>(pi.group);
    if (g < cfg_.groups.size() && cfg_.groups[g].frozen)
      throw invalid_argument(
          fmt::format("add_grad: {} belongs to the frozen group {}", pi.name, cfg_.groups[g].name));
  }

  [[nodiscard]] int micro_batches() const {
    return std::visit([](const auto& r) { return r.micro_batches(); }, reducer_);
  }

  static config checked(config cfg, const model_layout& layout) {
    (void)stage_of(cfg.stage);
    if (cfg.accumulation_steps < 1)
      throw invalid_argument(
          fmt::format("zero: accumulation_steps {} < 1", cfg.accumulation_steps));
    if (cfg.reduce_buffers < 1)
      throw invalid_argument(fmt::format("zero: reduce_buffers {} < 1", cfg.reduce_buffers));
    if (!(cfg.optimizer.lr >= 0) || !(cfg.max_grad_norm >= 0))
      throw invalid_argument("zero: learning rate and max_grad_norm must be >= 0");
    check_scaling(cfg.scaling);
    if (cfg.reduce_dtype && *cfg.reduce_dtype != dtype_of<P>() &&
        *cfg.reduce_dtype != dtype::float32)
      throw invalid_argument(
          fmt::format("zero: reduce_dtype {} (expected the parameter type {} or float32)",
                      dtype_name(*cfg.reduce_dtype), dtype_name(dtype_of<P>())));
    if (!(cfg.gradient_predivide > 0) || !std::isfinite(cfg.gradient_predivide))
      throw invalid_argument(
          fmt::format("zero: gradient_predivide {} (expected finite > 0)", cfg.gradient_predivide));
    check_collectives(cfg.collectives, ringzero::knows_nodes<Comm>);
    check_groups(cfg.groups);
    const auto n_groups = std::max<std::size_t>(1, cfg.groups.size());
    for (const auto& p : layout.params())
      if (p.group < 0 || static_cast<std::size_t>(p.group) >= n_groups)
        throw invalid_argument(fmt::format("zero: parameter {} is in group {}, config has {}",
                                           p.name, p.group, n_groups));
    for (const auto& p : layout.params())
      if (p.type != dtype_of<P>())
        throw invalid_argument(fmt::format(
            "zero: parameter {} is registered as {} but this sharder trains {} parameters", p.name,
            dtype_name(p.type), dtype_name(dtype_of<P>())));
    return cfg;
  }

  static std::size_t bucket_elements(const config& cfg) noexcept {
    return cfg.bucket_bytes == 0 ? 0 : std::max<std::size_t>(1, cfg.bucket_bytes / sizeof(P));
  }

  static std::vector<segment> all_segments(const partition_plan& plan) {
    std::vector<segment> out;
    for (int r = 0; r < plan.world_size(); ++r)
      for (const auto& s : plan.segments(r)) out.push_back(s);
    return out;
  }

  [[nodiscard]] const param_info& param(int id, const char* what) const {
    if (id < 0 || static_cast<std::size_t>(id) >= plan_.params().size())
      throw invalid_argument(
          fmt::format("{}: parameter id {} of {}", what, id, plan_.params().size()));
    return plan_.params()[static_cast<std::size_t>(id)];
  }

  // Where a segment's optimizer state and parameters live in this stage's buffers.
  [[nodiscard]] std::size_t local_of(const segment& s) const noexcept {
    return stage_.sharded_optimizer ? s.shard_offset : s.flat_offset;
  }
  [[nodiscard]] P* param_ptr(const segment& s) noexcept {
    return params_.data() + (stage_.sharded_parameters ? s.shard_offset : s.flat_offset);
  }
  [[nodiscard]] float* master_ptr(const segment& s) noexcept {
    return optimizer_.master(local_of(s), param_ptr(s));
  }

  /// This rank's shard of the master weights (which = 0) or of optimizer moment 1 or 2, in the
  /// checkpoint layout.
  [[nodiscard]] std::vector<float> own_array(int which) {
    std::vector<float> out(plan_.shard_size(), 0.0f);
    for (const auto& s : own_) {
      const float* src = which == 0 ? master_ptr(s) : optimizer_.moment(which, local_of(s));
      std::copy_n(src, s.count, out.begin() + static_cast<std::ptrdiff_t>(s.shard_offset));
    }
    return out;
  }

  /// Waits for queued work and drops gathered buckets, before touching the weights directly.
  void quiesce() {
    worker_.drain();
    if (stage_.sharded_parameters) {
      if (cache_.any_held())
        throw invalid_argument("zero: a gathered handle is still alive; release it first");
      cache_.evict_unreferenced();
    }
  }

  /// Stages 1-2: every rank updated its slice of the full parameters; share them.
  void gather_flat_parameters() {
    run_collective([&](Comm& c) {
      for (const auto& b : plan_.buckets()) {
        std::span<P> all(params_.data() + b.offset, b.padded);
        ringzero::all_gather(
            c, std::span<const P>(all.subspan(static_cast<std::size_t>(rank_) * b.slice, b.slice)),
            all, cfg_.collectives.all_gather);
      }
    });
  }

  /// Collective: every rank learns the lowest failing rank's message (truncated), so all raise
  /// the same error instead of one raising and the others waiting in the next collective.
  [[nodiscard]] std::string agree_on_failure(const std::string& mine) {
    constexpr std::size_t width = 512;
    constexpr std::string_view prefix = "ringzero: ";
    std::string_view msg = mine;
    if (msg.starts_with(prefix)) msg.remove_prefix(prefix.size());
    std::vector<std::uint8_t> block(width, 0);
    std::vector<std::uint8_t> all(width * static_cast<std::size_t>(world_));
    if (!mine.empty()) {
      block[0] = 1;
      std::memcpy(block.data() + 1, msg.data(), std::min(msg.size(), width - 1));
    }
    run_collective([&](Comm& c) {
      ringzero::all_gather(c, std::span<const std::uint8_t>(block), std::span<std::uint8_t>(all),
                           cfg_.collectives.all_gather);
    });
    for (int r = 0; r < world_; ++r) {
      const auto* b = all.data() + static_cast<std::size_t>(r) * width;
      if (b[0] == 0) continue;
      const auto* text = reinterpret_cast<const char*>(b + 1);
      std::string out(text, std::find(text, text + width - 1, '\0'));
      if (r != rank_) out += fmt::format(" (reported by rank {})", r);
      return out;
    }
    return {};
  }

  // Construction order matters: the plan before everything sized by it; the worker last, so it
  // is joined (its queued collectives finished or dropped) before the buffers its tasks use go
  // away. The components only take the worker's address before it is constructed.
  Comm& comm_;
  config cfg_;
  const stage_layout& stage_;
  int rank_;
  int world_;
  partition_plan plan_;
  std::vector<segment> own_;    // what this rank owns, in shard order
  std::vector<segment> local_;  // what this rank's optimizer updates: own_, or everything (stage 0)
  std::vector<P> params_;       // full (stages 0-2, padded_size) or this rank's shard (stage 3)
  shard_optimizer<P> optimizer_;
  loss_scaler scaler_;
  std::vector<float> group_lr_;  // base learning rate per parameter group
  detail::buffer_meter meter_;
  reducer_type reducer_;
  parameter_cache<Comm, P> cache_;
  std::uint64_t step_ = 0;
  std::uint64_t optimizer_steps_ = 0;
  detail::worker worker_;
};

}  // namespace ringzero::zero
