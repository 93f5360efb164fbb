// The sharded optimizer: fp32 master weights and moments for the elements a rank updates, and
// the per-element update arithmetic. A stage changes which buffers the pointers point into, never
// the arithmetic, so every stage computes the same bits for the same element.
//
// The per-element functions are in optimizer_math.hpp, which CUDA code includes on its own.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ringzero/types.hpp"
#include "ringzero/zero/optimizer_math.hpp"
#include "ringzero/zero/options.hpp"

namespace ringzero::zero {

/// The constants of optimizer step t (1-based, applied steps only) with gradients multiplied by
/// grad_scale before use.
[[nodiscard]] inline step_constants make_step_constants(const optimizer_options& o, std::uint64_t t,
                                                        float grad_scale) {
  const auto td = static_cast<double>(t);
  step_constants k;
  k.grad_scale = grad_scale;
  k.lr = o.lr;
  k.beta1 = o.beta1;
  k.beta2 = o.beta2;
  k.eps = o.eps;
  k.step_size = static_cast<float>(o.lr / (1.0 - std::pow(static_cast<double>(o.beta1), td)));
  k.inv_bias2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(o.beta2), td)));
  k.momentum = o.momentum;
  k.nesterov = o.nesterov;
  k.weight_decay = o.weight_decay;
  return k;
}

/// The optimizer settings of parameter group `g` (groups empty: `base` for group 0).
[[nodiscard]] inline optimizer_options group_options(const optimizer_options& base,
                                                     const std::vector<param_group>& groups,
                                                     std::size_t g) {
  optimizer_options o = base;
  if (g < groups.size()) {
    const auto& pg = groups[g];
    o.lr = pg.lr.value_or(o.lr);
    o.weight_decay = pg.weight_decay.value_or(o.weight_decay);
    o.beta1 = pg.beta1.value_or(o.beta1);
    o.beta2 = pg.beta2.value_or(o.beta2);
  }
  return o;
}

/// Each parameter group's base learning rate before any set_learning_rate (one entry for a
/// config without groups).
[[nodiscard]] inline std::vector<float> initial_group_lr(const config& cfg) {
  std::vector<float> lr;
  for (std::size_t g = 0; g < std::max<std::size_t>(1, cfg.groups.size()); ++g)
    lr.push_back(group_options(cfg.optimizer, cfg.groups, g).lr);
  return lr;
}

/// Every group's step constants for optimizer step `t` (1-based, skipped steps not counted):
/// its base rate `group_lr[g]` times the schedule at step `at` (0-based, skipped steps counted),
/// with gradients multiplied by `grad_scale` (unscaling and clipping in one factor).
[[nodiscard]] inline std::vector<step_constants> group_step_constants(
    const config& cfg, const std::vector<float>& group_lr, std::uint64_t at, std::uint64_t t,
    float grad_scale) {
  std::vector<step_constants> ks;
  for (std::size_t g = 0; g < group_lr.size(); ++g) {
    auto o = group_options(cfg.optimizer, cfg.groups, g);
    o.lr = cfg.schedule ? group_lr[g] * cfg.schedule(at) : group_lr[g];
    ks.push_back(make_step_constants(o, t, grad_scale));
  }
  return ks;
}

/// One optimizer step of rule R over n elements: gradients `grad`, fp32 master weights `w`,
/// moments `m` and `v` (v unused by a one-moment rule), parameters `param` (written with the new
/// master rounded to P; for an fp32 P, `param` is `w`).
template <optimizer_rule R, class P, class G>
void update_run(const G* grad, float* w, float* m, float* v, P* param, std::size_t n,
                const step_constants& c, bool decay) noexcept {
  constexpr bool has_master = !std::is_same_v<P, float>;
  const float f = R::factor(c, decay);
  for (std::size_t i = 0; i < n; ++i) {
    float m2 = 0.0f;
    if constexpr (R::descriptor.moments > 1) m2 = v[i];
    const float p = R::step(static_cast<float>(grad[i]), w[i], m[i], m2, c, f);
    if constexpr (R::descriptor.moments > 1) v[i] = m2;
    if constexpr (has_master) param[i] = to_param<P>(p);
  }
}

/// The same for the rule of `kind` in Table: the loop the host sharder and the emulated device
/// space both run. Throws invalid_argument for a kind Table does not have.
template <class P, class G, class Table = builtin_optimizers>
void update_elements(optimizer_kind kind, const G* grad, float* w, float* m, float* v, P* param,
                     std::size_t n, const step_constants& c, bool decay) {
  Table::visit(kind, [&]<class R>(std::type_identity<R>) {
    update_run<R>(grad, w, m, v, param, n, c, decay);
  });
}

/// The fp32 state of the elements one rank updates (its shard, or everything in stage 0),
/// addressed by local position: master weights (only for 16-bit P; an fp32 parameter is its own
/// master) and the moments its rule in Table keeps.
template <class P, class Table = builtin_optimizers>
class shard_optimizer {
 public:
  static constexpr bool has_master = !std::is_same_v<P, float>;

  /// Throws invalid_argument when Table has no rule for o.kind.
  shard_optimizer(const optimizer_options& o, std::size_t local_size)
      : kind_(o.kind), moments_(Table::at(o.kind).moments) {
    if constexpr (has_master) master_.assign(local_size, 0.0f);
    m1_.assign(local_size, 0.0f);
    if (moments_ > 1) m2_.assign(local_size, 0.0f);
  }

  [[nodiscard]] optimizer_kind kind() const noexcept { return kind_; }
  [[nodiscard]] std::size_t local_size() const noexcept { return m1_.size(); }
  /// Moments a checkpoint keeps (the rule's moment_names).
  [[nodiscard]] int moment_count() const noexcept { return moments_; }

  /// The master weights of `n` elements at local position `local`, whose parameters (in P) are
  /// at `param`.
  [[nodiscard]] float* master(std::size_t local, P* param) noexcept {
    if constexpr (has_master)
      return master_.data() + local;
    else
      return param;
  }
  /// Moment 1 or 2 at local position `local`.
  [[nodiscard]] float* moment(int which, std::size_t local) noexcept {
    return (which == 1 ? m1_.data() : m2_.data()) + local;
  }

  /// Sets n elements' master weights and parameters from fp32 values.
  void set(std::size_t local, P* param, const float* values, std::size_t n) noexcept {
    float* m = master(local, param);
    for (std::size_t k = 0; k < n; ++k) {
      m[k] = values[k];
      param[k] = to_param<P>(values[k]);
    }
  }

  /// One optimizer step over n elements: gradients `grad`, parameters `param` (receive the
  /// updated master rounded to P).
  template <class G>
  void update(const G* grad, std::size_t local, P* param, std::size_t n, const step_constants& c,
              bool decay) {
    update_elements<P, G, Table>(kind_, grad, master(local, param), m1_.data() + local,
                                 moment_count() > 1 ? m2_.data() + local : nullptr, param, n, c,
                                 decay);
  }

  /// Replaces the moments with staged copies laid out as local positions (a checkpoint load
  /// that passed every check; the master weights go through set()).
  void replace_moments(std::vector<float>& m1, std::vector<float>& m2) noexcept {
    m1_.swap(m1);
    m2_.swap(m2);
  }
  [[nodiscard]] std::size_t moment_size(int which) const noexcept {
    return which == 1 ? m1_.size() : m2_.size();
  }

  [[nodiscard]] std::size_t bytes() const noexcept {
    return (master_.capacity() + m1_.capacity() + m2_.capacity()) * sizeof(float);
  }

 private:
  optimizer_kind kind_;
  int moments_;
  std::vector<float> master_;
  std::vector<float> m1_;
  std::vector<float> m2_;
};

}  // namespace ringzero::zero
