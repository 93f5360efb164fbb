// The ZeRO sharder: data-parallel training where each rank keeps only 1/N of the model state.
//
//   zero::config cfg{.stage = 2, .optimizer = {.lr = 1e-3f}, .max_grad_norm = 1.0f};
//   zero::sharder<comm_t, bfloat16> shd(comm, layout, cfg);
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
// Every element is reduced along the same ring path whether its bucket is all_reduced or
// reduce_scattered, and the optimizer arithmetic is element-wise and shared, so with one
// micro-batch per step all four stages produce bitwise identical weights.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

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
#include <vector>

#include "ringzero/collectives.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/op.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/types.hpp"
#include "ringzero/zero/checkpoint.hpp"
#include "ringzero/zero/detail/optimizer.hpp"
#include "ringzero/zero/detail/worker.hpp"
#include "ringzero/zero/options.hpp"
#include "ringzero/zero/plan.hpp"

namespace ringzero::zero {

/// Which way a pass walks the layers; stage 3 prefetches the next buckets in that direction.
enum class pass : std::uint8_t { forward, backward };

template <class P>
concept parameter_type =
    std::is_same_v<P, float> || std::is_same_v<P, bfloat16> || std::is_same_v<P, float16>;

template <class T, parameter_type P>
class sharder {
 public:
  using param_type = P;

  /// Builds the partition plan and allocates this rank's buffers. Every parameter in `layout`
  /// must have type dtype_of<P>(). Not collective: every rank constructs with the same layout
  /// and config and computes the same plan.
  sharder(T& comm, const model_layout& layout, config cfg)
      : comm_(comm), cfg_(std::move(cfg)), rank_(comm.rank()), world_(comm.size()) {
    check_config(layout);
    const std::size_t bucket_elems =
        cfg_.bucket_bytes == 0 ? 0 : std::max<std::size_t>(1, cfg_.bucket_bytes / sizeof(P));
    plan_ = partition_plan(layout, world_, bucket_elems, cfg_.alignment);
    own_ = plan_.segments(rank_);
    if (cfg_.stage == 0) {
      for (int r = 0; r < world_; ++r)
        for (const auto& s : plan_.segments(r)) local_.push_back(s);
    } else {
      local_ = own_;
    }
    const std::size_t local_size = cfg_.stage == 0 ? plan_.padded_size() : plan_.shard_size();
    if (cfg_.stage <= 2)
      flat_params_.assign(plan_.padded_size(), P{});
    else
      shard_params_.assign(plan_.shard_size(), P{});
    if (cfg_.stage <= 1)
      flat_grads_.assign(plan_.padded_size(), P{});
    else
      shard_grads_.assign(plan_.shard_size(), P{});
    if constexpr (!std::is_same_v<P, float>) master_.assign(local_size, 0.0f);
    moment1_.assign(local_size, 0.0f);
    if (cfg_.optimizer.kind == optimizer_kind::adamw) moment2_.assign(local_size, 0.0f);
    if (cfg_.stage >= 2)
      for (int i = 0; i < cfg_.reduce_buffers; ++i)
        pool_.push_back({std::vector<P>(plan_.max_bucket()), 0, -1});
    const auto nb = plan_.buckets().size();
    missing_.resize(nb);
    bucket_buffer_.assign(nb, -1);
    gathered_.resize(nb);
    got_.assign(plan_.params().size(), 0);
    max_gathered_ =
        cfg_.max_gathered_bytes ? cfg_.max_gathered_bytes : 2 * plan_.max_bucket() * sizeof(P);
    if constexpr (std::is_same_v<P, float16>) scale_ = cfg_.scaling.initial;
    reset_micro_batch();
    note_buffers();
    worker_.emplace(cfg_.comm_thread);
    log::info("zero: stage {}, {} parameters ({}), {}", cfg_.stage, plan_.numel(),
              dtype_name(dtype_of<P>()), memory());
  }

  sharder(const sharder&) = delete;
  sharder& operator=(const sharder&) = delete;

  [[nodiscard]] const partition_plan& plan() const noexcept { return plan_; }
  [[nodiscard]] const config& configuration() const noexcept { return cfg_; }
  [[nodiscard]] int stage() const noexcept { return cfg_.stage; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int world_size() const noexcept { return world_; }
  /// Steps taken, skipped ones included.
  [[nodiscard]] std::uint64_t step_count() const noexcept { return step_; }
  /// Steps that updated the weights.
  [[nodiscard]] std::uint64_t optimizer_steps() const noexcept { return optimizer_steps_; }
  /// What the trainer multiplies its loss by (1 unless P is float16).
  [[nodiscard]] float loss_scale() const noexcept { return scale_; }
  void set_learning_rate(float lr) noexcept { cfg_.optimizer.lr = lr; }

  /// Sets a parameter's value from fp32. Every rank passes the same values (e.g. generated from
  /// the same seed); each keeps the part it needs.
  void set_parameter(int id, std::span<const float> values) {
    const auto& pi = param(id, "set_parameter");
    if (values.size() != pi.numel)
      throw invalid_argument(fmt::format("set_parameter: {} has {} elements, got {}", pi.name,
                                         pi.numel, values.size()));
    quiesce();
    if (cfg_.stage <= 2)
      for (std::size_t i = 0; i < pi.numel; ++i)
        flat_params_[pi.offset + i] = detail::to_param<P>(values[i]);
    for (const auto& s : local_) {
      if (s.param != id) continue;
      float* m = master_ptr(s);
      P* p = param_ptr(s);
      for (std::size_t k = 0; k < s.count; ++k) {
        m[k] = values[s.begin + k];
        p[k] = detail::to_param<P>(values[s.begin + k]);
      }
    }
  }

  /// A parameter's full value in stages 0-2 (stage 3 keeps only shards: use gather()).
  [[nodiscard]] std::span<const P> parameter(int id) const {
    const auto& pi = param(id, "parameter");
    if (cfg_.stage == 3)
      throw invalid_argument(fmt::format(
          "parameter({}): stage 3 keeps only this rank's shard; gather() the layer instead",
          pi.name));
    return {flat_params_.data() + pi.offset, pi.numel};
  }

  /// The parameters of one bucket, present while a handle exists. In stages 0-2 every
  /// parameter is always present and the handle is free.
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
      if (owner_ != nullptr && bucket_ >= 0)
        --owner_->gathered_[static_cast<std::size_t>(bucket_)].refs;
      owner_ = nullptr;
    }
    sharder* owner_ = nullptr;
    int bucket_ = -1;
    const P* base_ = nullptr;
    std::size_t base_offset_ = 0;
  };

  /// Makes layer `layer`'s parameters present and returns a handle to them. Stage 3: all_gathers
  /// the layer's bucket unless it is still present, frees buckets the pass has left behind, and
  /// prefetches the following buckets (in `direction`) while the gathered bytes stay within
  /// max_gathered_bytes. Every rank must make the same sequence of gather calls.
  [[nodiscard]] gathered gather(int layer, pass direction = pass::forward) {
    if (layer < 0 || static_cast<std::size_t>(layer) >= plan_.layers().size())
      throw invalid_argument(fmt::format("gather: layer {} of {}", layer, plan_.layers().size()));
    if (cfg_.stage < 3) return gathered(this, -1, flat_params_.data(), 0);
    const int b = plan_.layers()[static_cast<std::size_t>(layer)].bucket;
    const int dir = direction == pass::forward ? 1 : -1;
    const int nb = static_cast<int>(plan_.buckets().size());
    for (int c = 0; c < nb; ++c) {
      auto& g = gathered_[static_cast<std::size_t>(c)];
      if (g.resident && g.refs == 0 && c != b && (dir > 0 ? c < b : c > b)) evict(c);
    }
    start_gather(b);
    for (int c = b + dir; c >= 0 && c < nb; c += dir) {
      if (gathered_[static_cast<std::size_t>(c)].resident) continue;
      if (gathered_bytes_ + bucket_bytes(c) > max_gathered_) break;
      start_gather(c);
    }
    auto& g = gathered_[static_cast<std::size_t>(b)];
    worker_->wait(g.ticket);
    ++g.refs;
    const auto& bk = plan_.buckets()[static_cast<std::size_t>(b)];
    return gathered(this, b, g.data.data(), bk.offset);
  }

  /// Hands over parameter `id`'s gradient for this micro-batch (each parameter at most once per
  /// micro-batch; one never handed over counts as zero). A bucket whose gradients are all in is
  /// queued for reduction at once, in descending bucket order, so handing gradients over in
  /// backward order overlaps reduction with the rest of backward.
  void add_grad(int id, std::span<const P> g) { deliver(id, g); }

  /// The same from fp32 gradients, rounded to P first.
  void add_grad(int id, std::span<const float> g) requires(!std::is_same_v<P, float>) {
    deliver(id, g);
  }

  /// Ends a micro-batch: queues the buckets still waiting (missing gradients are zero).
  void end_micro_batch() {
    if (micro_ >= cfg_.accumulation_steps)
      throw invalid_argument(
          fmt::format("end_micro_batch: all {} micro-batches of this step are done; call step()",
                      cfg_.accumulation_steps));
    for (int b = next_bucket_; b >= 0; --b) {
      const auto& bk = plan_.buckets()[static_cast<std::size_t>(b)];
      if (cfg_.stage <= 1 && micro_ == 0)
        for (int p = bk.first_param; p < bk.first_param + bk.param_count; ++p)
          if (!got_[static_cast<std::size_t>(p)]) {
            const auto& pi = plan_.params()[static_cast<std::size_t>(p)];
            std::fill_n(flat_grads_.begin() + static_cast<std::ptrdiff_t>(pi.offset), pi.numel,
                        P{});
          }
      submit_bucket(b);
    }
    ++micro_;
    reset_micro_batch();
    if (cfg_.stage == 3) evict_unreferenced();
  }

  /// The optimizer step, after accumulation_steps micro-batches: waits for the reductions,
  /// checks every rank's gradients for inf/NaN (all skip together), clips to the global norm,
  /// updates this rank's shard and (stages 1, 2) all_gathers the new parameters. Collective.
  step_result step() {
    if (micro_ != cfg_.accumulation_steps)
      throw invalid_argument(
          fmt::format("step() after {} of {} micro-batches: call end_micro_batch() after each",
                      micro_, cfg_.accumulation_steps));
    worker_->drain();
    step_result res;
    res.loss_scale = scale_;
    const float divisor =
        cfg_.average_gradients ? static_cast<float>(world_ * cfg_.accumulation_steps) : 1.0f;
    const float unscale = 1.0f / (scale_ * divisor);
    double sumsq = 0.0;
    bool nonfinite = false;
    for (const auto& s : own_) detail::grad_stats(grad_ptr(s), s.count, unscale, sumsq, nonfinite);
    std::int32_t overflow = nonfinite ? 1 : 0;
    run_collective([&](T& c) {
      ringzero::all_reduce(c, std::span<std::int32_t>(&overflow, 1), op::max, cfg_.collectives);
      ringzero::all_reduce(c, std::span<double>(&sumsq, 1), op::sum, cfg_.collectives);
    });
    res.grad_norm = std::sqrt(sumsq);
    micro_ = 0;
    ++step_;
    res.step = step_;
    if (overflow != 0) {
      res.skipped = true;
      good_steps_ = 0;
      if (std::is_same_v<P, float16> && cfg_.scaling.dynamic)
        scale_ = std::max(cfg_.scaling.min_scale, scale_ * cfg_.scaling.backoff);
      log::info("zero: step {} skipped: non-finite gradient (loss scale now {})", step_, scale_);
      return res;
    }
    const auto& o = cfg_.optimizer;
    float clip = 1.0f;
    if (cfg_.max_grad_norm > 0 && res.grad_norm > cfg_.max_grad_norm)
      clip = static_cast<float>(cfg_.max_grad_norm / (res.grad_norm + 1e-6));
    ++optimizer_steps_;
    const auto t = static_cast<double>(optimizer_steps_);
    detail::step_constants k;
    k.grad_scale = unscale * clip;
    k.lr = o.lr;
    k.beta1 = o.beta1;
    k.beta2 = o.beta2;
    k.eps = o.eps;
    k.step_size = static_cast<float>(o.lr / (1.0 - std::pow(static_cast<double>(o.beta1), t)));
    k.inv_bias2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(o.beta2), t)));
    k.momentum = o.momentum;
    k.nesterov = o.nesterov;
    k.weight_decay = o.weight_decay;
    for (const auto& s : local_) {
      const bool decay = plan_.params()[static_cast<std::size_t>(s.param)].weight_decay;
      const std::size_t l = local_of(s);
      if (o.kind == optimizer_kind::adamw)
        detail::adamw(grad_ptr(s), master_ptr(s), moment1_.data() + l, moment2_.data() + l,
                      param_ptr(s), s.count, k, decay);
      else
        detail::sgd(grad_ptr(s), master_ptr(s), moment1_.data() + l, param_ptr(s), s.count, k,
                    decay);
    }
    if (cfg_.stage == 1 || cfg_.stage == 2) gather_flat_parameters();
    if (std::is_same_v<P, float16> && cfg_.scaling.dynamic &&
        ++good_steps_ >= static_cast<std::uint64_t>(std::max(1, cfg_.scaling.growth_interval))) {
      scale_ *= cfg_.scaling.growth;
      good_steps_ = 0;
    }
    return res;
  }

  /// Runs f(comm) on the communication thread, after everything already queued, and returns its
  /// result: how a trainer issues collectives of its own (a loss all_reduce) safely.
  template <class F>
  decltype(auto) run_collective(F&& f) {
    using R = std::invoke_result_t<F&, T&>;
    if constexpr (std::is_void_v<R>) {
      worker_->wait(worker_->submit([&] { f(comm_); }));
    } else {
      std::optional<R> r;
      worker_->wait(worker_->submit([&] { r.emplace(f(comm_)); }));
      return R(std::move(*r));
    }
  }

  /// Bytes this rank holds now, by category.
  [[nodiscard]] memory_report memory() const {
    memory_report m;
    m.rank = rank_;
    m.stage = cfg_.stage;
    m.parameters = (flat_params_.capacity() + shard_params_.capacity()) * sizeof(P);
    m.gradients = (flat_grads_.capacity() + shard_grads_.capacity()) * sizeof(P);
    m.optimizer = (master_.capacity() + moment1_.capacity() + moment2_.capacity()) * sizeof(float);
    m.buffers = buffer_bytes();
    m.peak_buffers = peak_buffers_;
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
    if (cfg_.stage == 0) {
      for (const auto& s : local_)
        std::copy_n(master_ptr(s), s.count,
                    out.begin() + static_cast<std::ptrdiff_t>(
                                      start[static_cast<std::size_t>(s.param)] + s.begin));
      return out;
    }
    const std::vector<float> mine = own_array(-1);
    std::vector<float> flat(plan_.padded_size());
    run_collective([&](T& c) {
      for (const auto& b : plan_.buckets())
        ringzero::all_gather(c, std::span<const float>(mine.data() + b.shard_offset, b.slice),
                             std::span<float>(flat.data() + b.offset, b.padded), cfg_.collectives);
    });
    for (std::size_t i = 0; i < start.size(); ++i) {
      const auto& pi = plan_.params()[i];
      std::copy_n(flat.begin() + static_cast<std::ptrdiff_t>(pi.offset), pi.numel,
                  out.begin() + static_cast<std::ptrdiff_t>(start[i]));
    }
    return out;
  }

  /// Writes a checkpoint of the whole training state into `dir` (see checkpoint.hpp).
  /// Collective; call between steps. Raises checkpoint_error on every rank if any rank fails.
  void save(const std::filesystem::path& dir) {
    if (micro_ != 0) throw invalid_argument("save: a step is in progress; call it after step()");
    quiesce();
    std::string failure;
    detail::written_file written;
    try {
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      std::vector<std::vector<float>> arrays{own_array(-1), own_array(1)};
      if (cfg_.optimizer.kind == optimizer_kind::adamw) arrays.push_back(own_array(2));
      written = detail::write_shard(dir, rank_, world_, step_, arrays, plan_.shard_size());
    } catch (const std::exception& e) {
      failure = e.what();
    }
    if (auto f = agree_on_failure(failure); !f.empty()) throw checkpoint_error(f);
    const std::uint64_t mine[2] = {written.bytes, written.crc};
    std::vector<std::uint64_t> all(2 * static_cast<std::size_t>(world_));
    run_collective([&](T& c) {
      ringzero::all_gather(c, std::span<const std::uint64_t>(mine), std::span<std::uint64_t>(all),
                           cfg_.collectives);
    });
    if (rank_ == 0) {
      try {
        detail::commit_manifest(dir, make_manifest(all));
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
    if (micro_ != 0) throw invalid_argument("load: a step is in progress; call it after step()");
    quiesce();
    std::string failure;
    checkpoint_manifest m;
    // Read into staging arrays (laid out as moment1_) so a refused checkpoint leaves the
    // current state untouched.
    const std::size_t local_size = moment1_.size();
    std::vector<float> master(local_size), m1(local_size), m2(moment2_.size());
    try {
      const checkpoint_reader reader(dir);
      m = reader.manifest();
      check_compatible(m, dir);
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
    for (const auto& s : local_) {
      const std::size_t l = local_of(s);
      std::copy_n(master.data() + l, s.count, master_ptr(s));
      if constexpr (!std::is_same_v<P, float>) {
        P* dst = param_ptr(s);
        for (std::size_t k = 0; k < s.count; ++k) dst[k] = detail::to_param<P>(master[l + k]);
      }
    }
    moment1_.swap(m1);
    moment2_.swap(m2);
    if (cfg_.stage == 1 || cfg_.stage == 2) gather_flat_parameters();
    step_ = m.step;
    optimizer_steps_ = m.optimizer_steps;
    if (std::is_same_v<P, float16> && m.precision == dtype::float16) {
      scale_ = m.loss_scale;
      good_steps_ = m.good_steps;
    }
    log::info("zero: loaded step {} from {} (saved by {} ranks at stage {})", step_, dir.string(),
              m.world_size, m.stage);
  }

 private:
  struct pool_entry {
    std::vector<P> data;
    detail::worker::ticket busy = 0;  ///< free once this ticket completed
    int bucket = -1;                  ///< the bucket filling it, or -1
  };
  struct gathered_bucket {
    std::vector<P> data;
    detail::worker::ticket ticket = 0;
    int refs = 0;
    bool resident = false;
  };

  void check_config(const model_layout& layout) const {
    if (cfg_.stage < 0 || cfg_.stage > 3)
      throw invalid_argument(fmt::format("zero: stage {} (expected 0, 1, 2 or 3)", cfg_.stage));
    if (cfg_.accumulation_steps < 1)
      throw invalid_argument(
          fmt::format("zero: accumulation_steps {} < 1", cfg_.accumulation_steps));
    if (cfg_.reduce_buffers < 1)
      throw invalid_argument(fmt::format("zero: reduce_buffers {} < 1", cfg_.reduce_buffers));
    if (!(cfg_.optimizer.lr >= 0) || !(cfg_.max_grad_norm >= 0))
      throw invalid_argument("zero: learning rate and max_grad_norm must be >= 0");
    for (const auto& p : layout.params())
      if (p.type != dtype_of<P>())
        throw invalid_argument(fmt::format(
            "zero: parameter {} is registered as {} but this sharder trains {} parameters", p.name,
            dtype_name(p.type), dtype_name(dtype_of<P>())));
  }

  [[nodiscard]] const param_info& param(int id, const char* what) const {
    if (id < 0 || static_cast<std::size_t>(id) >= plan_.params().size())
      throw invalid_argument(
          fmt::format("{}: parameter id {} of {}", what, id, plan_.params().size()));
    return plan_.params()[static_cast<std::size_t>(id)];
  }

  // Where a segment's data lives in this stage's buffers.
  [[nodiscard]] std::size_t local_of(const segment& s) const noexcept {
    return cfg_.stage == 0 ? s.flat_offset : s.shard_offset;
  }
  [[nodiscard]] P* param_ptr(const segment& s) noexcept {
    return cfg_.stage <= 2 ? flat_params_.data() + s.flat_offset
                           : shard_params_.data() + s.shard_offset;
  }
  [[nodiscard]] float* master_ptr(const segment& s) noexcept {
    if constexpr (std::is_same_v<P, float>)
      return param_ptr(s);
    else
      return master_.data() + local_of(s);
  }
  [[nodiscard]] P* grad_ptr(const segment& s) noexcept {
    return cfg_.stage <= 1 ? flat_grads_.data() + s.flat_offset
                           : shard_grads_.data() + s.shard_offset;
  }

  /// This rank's shard of the master weights (which = -1) or of optimizer moment 1 or 2, in the
  /// checkpoint layout.
  [[nodiscard]] std::vector<float> own_array(int which) {
    std::vector<float> out(plan_.shard_size(), 0.0f);
    for (const auto& s : own_) {
      const float* src = which < 0    ? master_ptr(s)
                         : which == 1 ? moment1_.data() + local_of(s)
                                      : moment2_.data() + local_of(s);
      std::copy_n(src, s.count, out.begin() + static_cast<std::ptrdiff_t>(s.shard_offset));
    }
    return out;
  }

  template <class S>
  void deliver(int id, std::span<const S> g) {
    const auto& pi = param(id, "add_grad");
    if (g.size() != pi.numel)
      throw invalid_argument(fmt::format("add_grad: {} has {} elements, the gradient {}", pi.name,
                                         pi.numel, g.size()));
    if (micro_ >= cfg_.accumulation_steps)
      throw invalid_argument(
          fmt::format("add_grad({}): all {} micro-batches of this step are done; call step()",
                      pi.name, cfg_.accumulation_steps));
    auto& got = got_[static_cast<std::size_t>(id)];
    if (got)
      throw invalid_argument(
          fmt::format("add_grad: {} was already added in this micro-batch", pi.name));
    got = 1;
    const auto b = static_cast<std::size_t>(pi.bucket);
    if (cfg_.stage <= 1) {
      detail::accumulate(flat_grads_.data() + pi.offset, g.data(), pi.numel, micro_ == 0);
    } else {
      if (bucket_buffer_[b] < 0) acquire_buffer(pi.bucket);
      P* bucket = pool_[static_cast<std::size_t>(bucket_buffer_[b])].data.data();
      detail::accumulate(bucket + (pi.offset - plan_.buckets()[b].offset), g.data(), pi.numel,
                         true);
    }
    if (--missing_[b] == 0)
      while (next_bucket_ >= 0 && missing_[static_cast<std::size_t>(next_bucket_)] == 0)
        submit_bucket(next_bucket_--);
  }

  void reset_micro_batch() {
    std::fill(got_.begin(), got_.end(), 0);
    for (std::size_t b = 0; b < plan_.buckets().size(); ++b)
      missing_[b] = plan_.buckets()[b].param_count;
    next_bucket_ = static_cast<int>(plan_.buckets().size()) - 1;
  }

  /// Queues bucket b's reduction: all_reduce in place (stages 0-1, last micro-batch only) or
  /// reduce_scatter of its filled buffer, added into the gradient shard (stages 2-3).
  void submit_bucket(int b) {
    const auto& bk = plan_.buckets()[static_cast<std::size_t>(b)];
    if (cfg_.stage <= 1) {
      if (micro_ + 1 < cfg_.accumulation_steps) return;
      std::span<P> grads(flat_grads_.data() + bk.offset, bk.padded);
      worker_->submit(
          [this, grads] { ringzero::all_reduce(comm_, grads, op::sum, cfg_.collectives); });
      return;
    }
    if (bucket_buffer_[static_cast<std::size_t>(b)] < 0) acquire_buffer(b);
    const int k = bucket_buffer_[static_cast<std::size_t>(b)];
    auto& entry = pool_[static_cast<std::size_t>(k)];
    P* buf = entry.data.data();
    const bool first = micro_ == 0;
    entry.busy = worker_->submit([this, buf, b, first] {
      const auto& bucket = plan_.buckets()[static_cast<std::size_t>(b)];
      std::span<P> own(buf + static_cast<std::size_t>(rank_) * bucket.slice, bucket.slice);
      ringzero::reduce_scatter(comm_, std::span<P>(buf, bucket.padded), own, op::sum,
                               cfg_.collectives);
      detail::accumulate(shard_grads_.data() + bucket.shard_offset, own.data(), bucket.slice,
                         first);
    });
    entry.bucket = -1;
    bucket_buffer_[static_cast<std::size_t>(b)] = -1;
  }

  /// A zeroed gradient buffer for bucket b: a free one, else the one whose reduction finishes
  /// first, else (every buffer is held by a bucket still filling) a new one.
  void acquire_buffer(int b) {
    int pick = -1;
    for (std::size_t i = 0; i < pool_.size() && pick < 0; ++i)
      if (pool_[i].bucket < 0 && worker_->done(pool_[i].busy)) pick = static_cast<int>(i);
    if (pick < 0) {
      for (std::size_t i = 0; i < pool_.size(); ++i)
        if (pool_[i].bucket < 0 &&
            (pick < 0 || pool_[i].busy < pool_[static_cast<std::size_t>(pick)].busy))
          pick = static_cast<int>(i);
      if (pick >= 0) worker_->wait(pool_[static_cast<std::size_t>(pick)].busy);
    }
    if (pick < 0) {
      log::warn(
          "zero: gradients arrive for {} buckets at once; adding a gradient buffer "
          "(hand gradients over in backward order, or raise reduce_buffers)",
          pool_.size() + 1);
      pool_.push_back({std::vector<P>(plan_.max_bucket()), 0, -1});
      pick = static_cast<int>(pool_.size()) - 1;
      note_buffers();
    }
    auto& e = pool_[static_cast<std::size_t>(pick)];
    std::fill(e.data.begin(), e.data.end(), P{});
    e.bucket = b;
    bucket_buffer_[static_cast<std::size_t>(b)] = pick;
  }

  [[nodiscard]] std::size_t bucket_bytes(int b) const noexcept {
    return plan_.buckets()[static_cast<std::size_t>(b)].padded * sizeof(P);
  }

  void start_gather(int b) {
    auto& g = gathered_[static_cast<std::size_t>(b)];
    if (g.resident) return;
    const auto& bk = plan_.buckets()[static_cast<std::size_t>(b)];
    g.data.resize(bk.padded);
    g.resident = true;
    gathered_bytes_ += bucket_bytes(b);
    note_buffers();
    std::span<const P> in(shard_params_.data() + bk.shard_offset, bk.slice);
    std::span<P> out(g.data);
    g.ticket = worker_->submit(
        [this, in, out] { ringzero::all_gather(comm_, in, out, cfg_.collectives); });
  }

  void evict(int b) {
    auto& g = gathered_[static_cast<std::size_t>(b)];
    if (!g.resident) return;
    worker_->wait(g.ticket);
    std::vector<P>().swap(g.data);
    g.resident = false;
    gathered_bytes_ -= bucket_bytes(b);
  }

  void evict_unreferenced() {
    for (int b = 0; b < static_cast<int>(gathered_.size()); ++b)
      if (gathered_[static_cast<std::size_t>(b)].refs == 0) evict(b);
  }

  /// Waits for queued work and drops gathered buckets, before touching the weights directly.
  void quiesce() {
    worker_->drain();
    if (cfg_.stage == 3) {
      for (const auto& g : gathered_)
        if (g.refs != 0)
          throw invalid_argument("zero: a gathered handle is still alive; release it first");
      evict_unreferenced();
    }
  }

  /// Stages 1-2: every rank updated its slice of the flat parameters; share them.
  void gather_flat_parameters() {
    run_collective([&](T& c) {
      for (const auto& b : plan_.buckets()) {
        std::span<P> all(flat_params_.data() + b.offset, b.padded);
        ringzero::all_gather(
            c, std::span<const P>(all.subspan(static_cast<std::size_t>(rank_) * b.slice, b.slice)),
            all, cfg_.collectives);
      }
    });
  }

  [[nodiscard]] std::size_t buffer_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& e : pool_) n += e.data.capacity() * sizeof(P);
    for (const auto& g : gathered_) n += g.data.capacity() * sizeof(P);
    return n;
  }
  void note_buffers() noexcept { peak_buffers_ = std::max(peak_buffers_, buffer_bytes()); }

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
    run_collective([&](T& c) {
      ringzero::all_gather(c, std::span<const std::uint8_t>(block), std::span<std::uint8_t>(all),
                           cfg_.collectives);
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

  void check_compatible(const checkpoint_manifest& m, const std::filesystem::path& dir) const {
    const auto& ps = plan_.params();
    if (m.params.size() != ps.size())
      throw checkpoint_error(fmt::format("checkpoint {} holds {} parameters, this model has {}",
                                         dir.string(), m.params.size(), ps.size()));
    for (const auto& p : ps) {
      const int i = m.find(p.name);
      if (i < 0)
        throw checkpoint_error(
            fmt::format("checkpoint {} has no parameter {}", dir.string(), p.name));
      const auto& q = m.params[static_cast<std::size_t>(i)];
      if (q.shape != p.shape)
        throw checkpoint_error(
            fmt::format("checkpoint {}: parameter {} has shape [{}], the model "
                        "registers [{}]",
                        dir.string(), p.name, fmt::join(q.shape, ", "), fmt::join(p.shape, ", ")));
    }
    const std::size_t arrays = cfg_.optimizer.kind == optimizer_kind::adamw ? 3 : 2;
    if (m.optimizer != cfg_.optimizer.kind || m.arrays.size() != arrays)
      throw checkpoint_error(fmt::format("checkpoint {} holds {} state, this run uses {}",
                                         dir.string(), optimizer_name(m.optimizer),
                                         optimizer_name(cfg_.optimizer.kind)));
  }

  [[nodiscard]] checkpoint_manifest make_manifest(const std::vector<std::uint64_t>& written) const {
    checkpoint_manifest m;
    m.world_size = world_;
    m.stage = cfg_.stage;
    m.precision = dtype_of<P>();
    m.step = step_;
    m.optimizer_steps = optimizer_steps_;
    m.optimizer = cfg_.optimizer.kind;
    m.loss_scale = scale_;
    m.good_steps = good_steps_;
    m.alignment = plan_.alignment();
    m.shard_size = plan_.shard_size();
    m.arrays = {"master"};
    if (cfg_.optimizer.kind == optimizer_kind::adamw) {
      m.arrays.emplace_back("exp_avg");
      m.arrays.emplace_back("exp_avg_sq");
    } else {
      m.arrays.emplace_back("momentum");
    }
    for (const auto& b : plan_.buckets()) m.buckets.push_back({b.offset, b.padded, b.shard_offset});
    for (const auto& p : plan_.params())
      m.params.push_back({p.name, p.type, p.weight_decay, p.offset, p.bucket, p.shape});
    for (int r = 0; r < world_; ++r) {
      const auto i = 2 * static_cast<std::size_t>(r);
      m.shards.push_back({r, detail::shard_file_name(r, world_, step_), written[i],
                          static_cast<std::uint32_t>(written[i + 1])});
    }
    return m;
  }

  T& comm_;
  config cfg_;
  int rank_;
  int world_;
  partition_plan plan_;
  std::vector<segment> own_;    // what this rank owns, in shard order
  std::vector<segment> local_;  // what this rank's optimizer updates: own_, or everything (stage 0)

  std::vector<P> flat_params_;   // stages 0-2
  std::vector<P> shard_params_;  // stage 3
  std::vector<P> flat_grads_;    // stages 0-1
  std::vector<P> shard_grads_;   // stages 2-3
  std::vector<float> master_;    // 16-bit P only
  std::vector<float> moment1_;   // adamw exp_avg / sgd momentum
  std::vector<float> moment2_;   // adamw exp_avg_sq

  std::vector<pool_entry> pool_;
  std::vector<int> bucket_buffer_;
  std::vector<int> missing_;
  std::vector<char> got_;
  int next_bucket_ = -1;
  int micro_ = 0;

  std::vector<gathered_bucket> gathered_;
  std::size_t gathered_bytes_ = 0;
  std::size_t max_gathered_ = 0;
  std::size_t peak_buffers_ = 0;

  float scale_ = 1.0f;
  std::uint64_t good_steps_ = 0;
  std::uint64_t step_ = 0;
  std::uint64_t optimizer_steps_ = 0;

  std::optional<detail::worker> worker_;  // last: joined before the buffers its tasks use go away
};

}  // namespace ringzero::zero
