// The optimizer step, once the gradients are reduced: this rank's gradient statistics made
// global (an inf or NaN on any rank skips the step on every rank, and the loss scaler backs off;
// the squared norms sum to the global norm, exactly in reproducible mode), the clipping factor,
// each parameter group's step constants (its base learning rate times the schedule), the update of
// every segment this rank updates (frozen groups left alone), and the all_gather of the updated
// parameters in stages 1-2.
//
// The stepper also keeps what steps advance and a checkpoint saves besides the arrays: the step
// counts, the loss scaler and each group's base learning rate.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "ringzero/collectives.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/op.hpp"
#include "ringzero/zero/detail/exact_sumsq.hpp"
#include "ringzero/zero/loss_scaler.hpp"
#include "ringzero/zero/model_state.hpp"
#include "ringzero/zero/optimizer.hpp"
#include "ringzero/zero/options.hpp"

namespace ringzero::zero {

/// Collective: makes `s` global, the sum of every rank's sums of squares and nonfinite if any
/// rank's is. `o` is the all_reduce's options.
template <class Comm>
void agree_gradient_stats(Comm& comm, gradient_stats& s, const ringzero::options& o) {
  std::int32_t overflow = s.nonfinite ? 1 : 0;
  ringzero::all_reduce(comm, std::span<std::int32_t>(&overflow, 1), op::max, o);
  ringzero::all_reduce(comm, std::span<double>(&s.sumsq, 1), op::sum, o);
  s.nonfinite = overflow != 0;
}

/// What a step multiplies every reduced gradient by before use: undoes the loss scale, the
/// predivide and, with average_gradients, the sum over `world` ranks and the micro-batches.
[[nodiscard]] inline float gradient_unscale(const config& cfg, int world,
                                            float loss_scale) noexcept {
  const float divisor =
      cfg.average_gradients ? static_cast<float>(world * cfg.accumulation_steps) : 1.0f;
  return cfg.gradient_predivide / (loss_scale * divisor);
}

/// The factor that brings a gradient of global norm `norm` within `max_norm` (0: no clipping).
/// The 1e-6 keeps the clipped norm just below the bound, as torch.nn.utils.clip_grad_norm_ does.
[[nodiscard]] inline float clip_factor(float max_norm, double norm) noexcept {
  if (max_norm > 0 && norm > max_norm) return static_cast<float>(max_norm / (norm + 1e-6));
  return 1.0f;
}

class stepper {
 public:
  /// `cfg` (a checked config) must outlive the stepper. `float16`: the parameters are float16,
  /// so the loss is scaled dynamically. `replicas`: the groups of hybrid sharding, each as large
  /// as the plan's world, over which the gradients are summed too.
  stepper(const config& cfg, bool float16, int replicas = 1)
      : cfg_(cfg),
        scaler_(cfg.scaling, float16),
        group_lr_(initial_group_lr(cfg)),
        replicas_(replicas) {}

  /// Steps taken, skipped ones included.
  [[nodiscard]] std::uint64_t step_count() const noexcept { return step_; }
  /// Steps that updated the weights (Adam's t).
  [[nodiscard]] std::uint64_t optimizer_steps() const noexcept { return optimizer_steps_; }
  [[nodiscard]] const loss_scaler& scaler() const noexcept { return scaler_; }
  /// Each group's base learning rate (what the schedule multiplies).
  [[nodiscard]] const std::vector<float>& group_lr() const noexcept { return group_lr_; }

  /// Sets every group's base learning rate.
  void set_learning_rate(float lr) noexcept { std::fill(group_lr_.begin(), group_lr_.end(), lr); }
  /// Sets one group's base learning rate.
  void set_learning_rate(int group, float lr) { group_lr_.at(group_index(group)) = lr; }
  /// The learning rate group `group` uses in the next step: its base rate times the schedule at
  /// step_count().
  [[nodiscard]] float learning_rate(int group) const {
    const float base = group_lr_.at(group_index(group));
    return cfg_.schedule ? base * cfg_.schedule(step_) : base;
  }

  /// Resumes at a checkpoint's step counts.
  void resume(std::uint64_t step, std::uint64_t optimizer_steps) noexcept {
    step_ = step;
    optimizer_steps_ = optimizer_steps;
  }
  /// Resumes at a checkpoint's loss scale (ignored unless this stepper scales the loss).
  void restore_loss_scale(float scale, std::uint64_t good_steps) noexcept {
    scaler_.restore(scale, good_steps);
  }

  /// One step of `state` with the reduced gradients `grads` (what a gradient_reducer offers:
  /// add_stats(), start_step(), gradient(segment)), which every rank takes together. `run(f)`
  /// calls f(comm) in line with the caller's other collectives, comm being the ranks `state` is
  /// sharded over: with hybrid sharding every group holds the same reduced gradients, so each
  /// group's norm and overflow check equal the world's. A skipped step changes only the counters
  /// and the loss scale.
  template <class P, class Space, class Grads, class Run>
  step_result take(model_state<P, Space>& state, Grads& grads, Run&& run) {
    step_result res;
    res.loss_scale = scaler_.scale();
    const float unscale =
        gradient_unscale(cfg_, state.plan().world_size() * replicas_, scaler_.scale());
    gradient_stats stats;
    if constexpr (on_device<Space>) {
      // Computed and agreed on where the gradients lie; the host reads two scalars back, the
      // one wait of a step (whether to skip it decides what is enqueued next). Reproducible:
      // the exact sum of squares, binned on the device, agreed through host words.
      stats = cfg_.reproducible
                  ? grads.agree_exact_stats(unscale, cfg_.collectives.all_reduce)
                  : grads.agree_stats(state.own(), unscale, run, cfg_.collectives.all_reduce);
    } else if (cfg_.reproducible) {
      // Exact, so the norm and the clipping factor do not depend on who holds what.
      detail::exact_sumsq sq;
      for (const auto& s : state.own()) sq.add(grads.gradient(s), s.count);
      run([&](auto& c) {
        const auto [sum, bad] = sq.agree(c, cfg_.collectives.all_reduce);
        stats.sumsq = sum * static_cast<double>(unscale) * static_cast<double>(unscale);
        stats.nonfinite = bad;
      });
    } else {
      grads.add_stats(state.own(), unscale, stats.sumsq, stats.nonfinite);
      run([&](auto& c) { agree_gradient_stats(c, stats, cfg_.collectives.all_reduce); });
    }
    res.grad_norm = std::sqrt(stats.sumsq);
    grads.start_step();
    const std::uint64_t at = step_;
    ++step_;
    res.step = step_;
    scaler_.update(stats.nonfinite);
    if (stats.nonfinite) {
      res.skipped = true;
      log::info("zero: step {} skipped: non-finite gradient (loss scale now {})", step_,
                scaler_.scale());
      return res;
    }
    ++optimizer_steps_;
    const auto ks = group_step_constants(cfg_, group_lr_, at, optimizer_steps_,
                                         unscale * clip_factor(cfg_.max_grad_norm, res.grad_norm));
    state.update_all([&](const segment& s) { return grads.gradient(s); }, ks,
                     [&](const segment& s) {
                       return frozen(
                           cfg_, state.plan().params()[static_cast<std::size_t>(s.param)].group);
                     });
    state.share_updates(run, cfg_.collectives.all_gather);
    return res;
  }

 private:
  [[nodiscard]] std::size_t group_index(int group) const {
    if (group < 0 || static_cast<std::size_t>(group) >= group_lr_.size())
      throw invalid_argument(
          fmt::format("zero: parameter group {} of {}", group, group_lr_.size()));
    return static_cast<std::size_t>(group);
  }

  const config& cfg_;
  loss_scaler scaler_;
  std::vector<float> group_lr_;
  int replicas_;
  std::uint64_t step_ = 0;
  std::uint64_t optimizer_steps_ = 0;
};

}  // namespace ringzero::zero
