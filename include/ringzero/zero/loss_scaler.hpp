// Dynamic loss scaling for float16 training, as PyTorch's GradScaler: the trainer multiplies its
// loss by scale(); a step whose gradients hold an inf or NaN on any rank is skipped and the scale
// backs off; `growth_interval` clean steps in a row grow it, but only to a finite value.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ringzero/zero/options.hpp"

namespace ringzero::zero {

class loss_scaler {
 public:
  /// enabled = false (parameters other than float16): the scale stays 1.
  loss_scaler(const loss_scaling& cfg, bool enabled) : cfg_(cfg), enabled_(enabled) {
    check_scaling(cfg_);
    if (enabled_) scale_ = cfg_.initial;
  }

  [[nodiscard]] float scale() const noexcept { return scale_; }
  /// Clean steps since the scale last changed (what a checkpoint keeps).
  [[nodiscard]] std::uint64_t good_steps() const noexcept { return good_steps_; }
  [[nodiscard]] bool enabled() const noexcept { return enabled_; }

  /// After every step: `overflow` = some rank saw a non-finite gradient (the step was skipped).
  void update(bool overflow) noexcept {
    if (overflow) {
      good_steps_ = 0;
      if (enabled_ && cfg_.dynamic) scale_ = std::max(cfg_.min_scale, scale_ * cfg_.backoff);
      return;
    }
    if (!enabled_ || !cfg_.dynamic) return;
    if (++good_steps_ < static_cast<std::uint64_t>(std::max(1, cfg_.growth_interval))) return;
    // At inf every gradient would overflow and every later step be skipped.
    if (const float grown = scale_ * cfg_.growth; std::isfinite(grown)) scale_ = grown;
    good_steps_ = 0;
  }

  /// Resumes from a checkpoint's scale (ignored when disabled).
  void restore(float scale, std::uint64_t good_steps) noexcept {
    if (!enabled_) return;
    scale_ = scale;
    good_steps_ = good_steps;
  }

 private:
  loss_scaling cfg_;
  bool enabled_;
  float scale_ = 1.0f;
  std::uint64_t good_steps_ = 0;
};

}  // namespace ringzero::zero
