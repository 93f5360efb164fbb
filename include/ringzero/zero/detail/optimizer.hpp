// The element-wise kernels of the sharded optimizer. Each rank runs them over the parameter
// elements it owns; a stage changes which buffers the pointers point into, never the arithmetic,
// so every stage computes the same bits for the same element.
#pragma once

#include <cmath>
#include <cstddef>
#include <type_traits>

#include "ringzero/types.hpp"

namespace ringzero::zero::detail {

template <class P>
[[nodiscard]] inline P to_param(float x) noexcept {
  if constexpr (std::is_same_v<P, float>)
    return x;
  else
    return P(x);
}

/// dst = src (first micro-batch) or dst += src, in the gradient's type P; an fp32 source is
/// rounded to P first, so handing over fp32 or P gradients gives the same bits.
template <class P, class S>
void accumulate(P* dst, const S* src, std::size_t n, bool first) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const P v = to_param<P>(static_cast<float>(src[i]));
    dst[i] = first ? v : to_param<P>(static_cast<float>(dst[i]) + static_cast<float>(v));
  }
}

/// Sum of squares of grad*scale (in double), and whether any of it is inf or NaN.
template <class P>
void grad_stats(const P* g, std::size_t n, float scale, double& sumsq, bool& nonfinite) noexcept {
  double s = 0.0;
  bool bad = false;
  for (std::size_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(g[i]) * scale;
    bad |= !std::isfinite(x);
    s += static_cast<double>(x) * static_cast<double>(x);
  }
  sumsq += s;
  nonfinite |= bad;
}

/// Per-step constants, computed once so every rank and stage uses the same floats.
struct step_constants {
  float grad_scale = 1.0f;  ///< unscale * average * clip
  float lr = 0.0f;
  float beta1 = 0.0f, beta2 = 0.0f, eps = 0.0f;
  float step_size = 0.0f;  ///< lr / (1 - beta1^t)
  float inv_bias2 = 1.0f;  ///< 1 / (1 - beta2^t)
  float momentum = 0.0f;
  bool nesterov = false;
  float weight_decay = 0.0f;
};

/// AdamW on n elements. `master` is the fp32 weight; `param` receives it rounded to P (null when
/// P is float and the master is the parameter itself).
template <class P>
void adamw(const P* grad, float* master, float* m, float* v, P* param, std::size_t n,
           const step_constants& c, bool decay) noexcept {
  const float keep = decay ? 1.0f - c.lr * c.weight_decay : 1.0f;
  for (std::size_t i = 0; i < n; ++i) {
    const float g = static_cast<float>(grad[i]) * c.grad_scale;
    const float mi = c.beta1 * m[i] + (1.0f - c.beta1) * g;
    const float vi = c.beta2 * v[i] + (1.0f - c.beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi * c.inv_bias2) + c.eps;
    const float p = master[i] * keep - c.step_size * mi / denom;
    master[i] = p;
    if constexpr (!std::is_same_v<P, float>) param[i] = to_param<P>(p);
  }
}

/// SGD with (optionally Nesterov) momentum and L2 weight decay.
template <class P>
void sgd(const P* grad, float* master, float* buf, P* param, std::size_t n, const step_constants& c,
         bool decay) noexcept {
  const float wd = decay ? c.weight_decay : 0.0f;
  for (std::size_t i = 0; i < n; ++i) {
    const float g = static_cast<float>(grad[i]) * c.grad_scale + wd * master[i];
    const float b = c.momentum * buf[i] + g;
    buf[i] = b;
    const float d = c.nesterov ? g + c.momentum * b : b;
    const float p = master[i] - c.lr * d;
    master[i] = p;
    if constexpr (!std::is_same_v<P, float>) param[i] = to_param<P>(p);
  }
}

}  // namespace ringzero::zero::detail
