// One element of the sharded optimizer: gradient accumulation, the gradient statistics term,
// AdamW and SGD, each operation rounded in float. The one implementation: the host sharder
// (zero/optimizer_math.hpp), the emulated device space and the CUDA kernels
// (kernels/cuda/optimizer.cuh) all call these functions, so host and device memory give the same
// bits by construction.
#pragma once

#include <cstddef>

#include "ringzero/kernels/element.hpp"

namespace ringzero::kernels {

/// Per-step constants, computed once on the host so every rank and every element uses the same
/// floats (zero::step_constants is this type; zero::make_step_constants fills it).
struct optimizer_constants {
  float grad_scale = 1.0f;  ///< unscale * average * clip
  float lr = 0.0f;
  float beta1 = 0.0f, beta2 = 0.0f, eps = 0.0f;
  float step_size = 0.0f;  ///< lr / (1 - beta1^t)
  float inv_bias2 = 1.0f;  ///< 1 / (1 - beta2^t)
  float momentum = 0.0f;
  bool nesterov = false;
  float weight_decay = 0.0f;
};

/// One contiguous run of the optimizer's elements: `count` elements of one parameter (or of
/// several with the same decay flag). `moment2` is unused by SGD (its `moment1` is the momentum
/// buffer); `param` is unused when P is float (the master is the parameter). Gradients are in G:
/// the parameter type, or float where they were reduced in fp32. Device pointers for the CUDA
/// kernels, host pointers for the emulated device space (zero::device_segment is this type).
template <class P, class G = P>
struct optimizer_segment {
  const G* grad = nullptr;
  float* master = nullptr;
  float* moment1 = nullptr;
  float* moment2 = nullptr;
  P* param = nullptr;
  std::size_t count = 0;
  bool decay = false;
};

/// The gradient element after accumulation: src rounded to P on the first micro-batch, else
/// dst + that, rounded to P. An fp32 source is rounded first, so fp32 and P gradients give the
/// same bits.
template <class P, class S>
RINGZERO_HD inline P accumulate(P dst, S src, bool first) noexcept {
  const P v = from_float<P>(to_float(src));
  return first ? v : from_float<P>(add(to_float(dst), to_float(v)));
}

/// The same with the gradient multiplied by `scale` first (1 / gradient_predivide), rounded to P
/// before the sum as the host's accumulate() does; a scale of 1 is skipped, as there.
template <class P, class S>
RINGZERO_HD inline P accumulate(P dst, S src, bool first, float scale) noexcept {
  if (scale == 1.0f) return accumulate<P>(dst, src, first);
  const P v = from_float<P>(mul(to_float(src), scale));
  return first ? v : from_float<P>(add(to_float(dst), to_float(v)));
}

/// The unscaled gradient element whose square the gradient norm sums (in double).
template <class P>
RINGZERO_HD inline float unscaled(P g, float scale) noexcept {
  return mul(to_float(g), scale);
}

/// The factor AdamW multiplies the master weight by (decoupled weight decay).
RINGZERO_HD inline float adamw_keep(const optimizer_constants& c, bool decay) noexcept {
  return decay ? sub(1.0f, mul(c.lr, c.weight_decay)) : 1.0f;
}

/// AdamW on one element; returns the new master weight (also stored in `master`).
RINGZERO_HD inline float adamw(float grad, float& master, float& m, float& v,
                               const optimizer_constants& c, float keep) noexcept {
  const float g = mul(grad, c.grad_scale);
  const float mi = add(mul(c.beta1, m), mul(sub(1.0f, c.beta1), g));
  const float vi = add(mul(c.beta2, v), mul(mul(sub(1.0f, c.beta2), g), g));
  m = mi;
  v = vi;
  const float denom = add(sqrt(mul(vi, c.inv_bias2)), c.eps);
  const float p = sub(mul(master, keep), div(mul(c.step_size, mi), denom));
  master = p;
  return p;
}

/// SGD with (optionally Nesterov) momentum and L2 weight decay `wd` (0 when the parameter is
/// not decayed); returns the new master weight (also stored in `master`).
RINGZERO_HD inline float sgd(float grad, float& master, float& buf, const optimizer_constants& c,
                             float wd) noexcept {
  const float g = add(mul(grad, c.grad_scale), mul(wd, master));
  const float b = add(mul(c.momentum, buf), g);
  buf = b;
  const float d = c.nesterov ? add(g, mul(c.momentum, b)) : b;
  const float p = sub(master, mul(c.lr, d));
  master = p;
  return p;
}

}  // namespace ringzero::kernels
