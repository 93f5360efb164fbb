// The optimizer's per-element arithmetic: AdamW and SGD on one element, gradient accumulation and
// statistics, rounding to the parameter type. Scalars in, scalars out, no formatting and no
// allocation, so CUDA translation units (the kernels and their tests) include it as it is and
// the host tests check what the device runs.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ringzero/kernels/optimizer.hpp"
#include "ringzero/types.hpp"

namespace ringzero::zero {

template <class P>
[[nodiscard]] inline P to_param(float x) noexcept {
  if constexpr (std::is_same_v<P, float>)
    return x;
  else
    return P(x);
}

/// Per-step constants, computed once so every rank and stage uses the same floats: the kernels'
/// own type (kernels/optimizer.hpp), so the host and the device take one struct.
using step_constants = kernels::optimizer_constants;

/// One element's fp32 optimizer state.
struct element_state {
  float w = 0.0f;  ///< master weight
  float m = 0.0f;  ///< adamw exp_avg / sgd momentum buffer
  float v = 0.0f;  ///< adamw exp_avg_sq
};

/// AdamW with decoupled weight decay on one element; `g` is the raw (scaled, summed) gradient.
/// The arithmetic is kernels::adamw's, the one the CUDA kernels run.
[[nodiscard]] inline element_state adamw_element(float g_raw, element_state s,
                                                 const step_constants& c, bool decay) noexcept {
  kernels::adamw(g_raw, s.w, s.m, s.v, c, kernels::adamw_keep(c, decay));
  return s;
}

/// SGD with (optionally Nesterov) momentum and L2 weight decay on one element (kernels::sgd).
[[nodiscard]] inline element_state sgd_element(float g_raw, element_state s,
                                               const step_constants& c, bool decay) noexcept {
  kernels::sgd(g_raw, s.w, s.m, c, decay ? c.weight_decay : 0.0f);
  return s;
}

/// dst = src*scale (first) or dst += src*scale, in the gradient's type G; the product is rounded
/// to G first, so handing over fp32 or G gradients gives the same bits (scale 1 is exact).
template <class G, class S>
void accumulate(G* dst, const S* src, std::size_t n, bool first, float scale = 1.0f) noexcept {
  // Both choices are made once per call, not per element: GCC unswitches loops only at -O3.
  auto run = [&](auto first_c, auto scaled_c) {
    for (std::size_t i = 0; i < n; ++i) {
      const float x = static_cast<float>(src[i]);
      G v;
      if constexpr (decltype(scaled_c)::value)
        v = to_param<G>(x * scale);
      else
        v = to_param<G>(x);
      if constexpr (decltype(first_c)::value)
        dst[i] = v;
      else
        dst[i] = to_param<G>(static_cast<float>(dst[i]) + static_cast<float>(v));
    }
  };
  // A multiply by 1 is exact, except that it quiets a signalling NaN: skipping it keeps the bits
  // a plain copy (and the kernels) would give, whatever the optimizer does.
  const bool scaled = scale != 1.0f;
  if (first) {
    if (scaled)
      run(std::true_type{}, std::true_type{});
    else
      run(std::true_type{}, std::false_type{});
  } else {
    if (scaled)
      run(std::false_type{}, std::true_type{});
    else
      run(std::false_type{}, std::false_type{});
  }
}

/// Sum of squares of grad*scale (in double), and whether any of it is inf or NaN.
template <class G>
void grad_stats(const G* g, std::size_t n, float scale, double& sumsq, bool& nonfinite) noexcept {
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

}  // namespace ringzero::zero
