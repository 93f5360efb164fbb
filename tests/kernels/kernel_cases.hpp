// Inputs and host references shared by the host test of the element functions and the GPU
// test of the kernels: random data with the awkward values mixed in, and the host code the
// kernels must reproduce (reduce/cpu.hpp and the sharder's optimizer).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "ringzero/kernels/optimizer.hpp"
#include "ringzero/kernels/reduce.hpp"
#include "ringzero/types.hpp"
#include "ringzero/zero/optimizer_math.hpp"

namespace kernel_cases {

using ringzero::bfloat16;
using ringzero::float16;

template <class T>
[[nodiscard]] T from_bits(std::uint64_t bits) {
  T t;
  std::memcpy(static_cast<void*>(&t), &bits, sizeof(T));  // little-endian: the low bytes
  return t;
}

template <class T>
[[nodiscard]] bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

/// n values of T: for integers uniform bits; for floating types a mix of ordinary magnitudes
/// (most), random bit patterns (subnormals, huge values, inf, NaN with payloads) and signed
/// zeros, so rounding, overflow and NaN paths are all taken.
template <class T>
std::vector<T> values(std::mt19937_64& rng, std::size_t n, bool finite_only = false) {
  std::vector<T> v(n);
  std::uniform_int_distribution<int> pick(0, 9);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_int_distribution<int> expo(-30, 30);
  for (auto& x : v) {
    if constexpr (std::is_integral_v<T>) {
      x = from_bits<T>(rng());
    } else {
      const int k = pick(rng);
      if (k < 7 || finite_only) {
        const double d = std::ldexp(normal(rng), k == 6 ? expo(rng) : 0);
        if constexpr (std::is_same_v<T, double>)
          x = d;
        else
          x = T(static_cast<float>(d));
      } else if (k < 9) {
        x = from_bits<T>(rng());
      } else {
        x = T(static_cast<float>(rng() & 1 ? -0.0 : 0.0));
      }
      if (finite_only && !std::isfinite(static_cast<double>(static_cast<float>(x)))) x = T(1.0f);
    }
  }
  return v;
}

/// out[i] = combine<O>(a[i], b[i]) through the element function, for a runtime op.
template <class T>
void element_combine(ringzero::op o, const T* a, const T* b, T* out, std::size_t n) {
  namespace k = ringzero::kernels;
  using ringzero::op;
  for (std::size_t i = 0; i < n; ++i) {
    switch (o) {
      case op::sum:
      case op::avg:
        out[i] = k::combine<op::sum>(a[i], b[i]);
        break;
      case op::prod:
        out[i] = k::combine<op::prod>(a[i], b[i]);
        break;
      case op::min:
        out[i] = k::combine<op::min>(a[i], b[i]);
        break;
      case op::max:
        out[i] = k::combine<op::max>(a[i], b[i]);
        break;
    }
  }
}

/// The sharder's per-step constants and what the kernels get, from one draw (one type).
struct constants {
  ringzero::zero::step_constants host;
  ringzero::kernels::optimizer_constants kernel;
};

/// The sharder's optimizer over whole arrays, element by element exactly as
/// zero::shard_optimizer::update runs it: the reference the kernels must match bit for bit.
namespace sharder_ref {

using ringzero::zero::accumulate;
using ringzero::zero::grad_stats;

template <class P>
void adamw(const P* grad, float* master, float* m, float* v, P* param, std::size_t n,
           const ringzero::zero::step_constants& c, bool decay) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const auto s = ringzero::zero::adamw_element(static_cast<float>(grad[i]),
                                                 {master[i], m[i], v[i]}, c, decay);
    master[i] = s.w;
    m[i] = s.m;
    v[i] = s.v;
    if constexpr (!std::is_same_v<P, float>) param[i] = ringzero::zero::to_param<P>(s.w);
  }
}

template <class P>
void sgd(const P* grad, float* master, float* buf, P* param, std::size_t n,
         const ringzero::zero::step_constants& c, bool decay) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const auto s = ringzero::zero::sgd_element(static_cast<float>(grad[i]),
                                               {master[i], buf[i], 0.0f}, c, decay);
    master[i] = s.w;
    buf[i] = s.m;
    if constexpr (!std::is_same_v<P, float>) param[i] = ringzero::zero::to_param<P>(s.w);
  }
}

}  // namespace sharder_ref

inline constants random_constants(std::mt19937_64& rng, bool nesterov) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const double t = std::floor(1.0 + u(rng) * 2000.0);
  constants c;
  auto& h = c.host;
  h.grad_scale = static_cast<float>(std::ldexp(0.5 + u(rng), -static_cast<int>(u(rng) * 16)));
  h.lr = static_cast<float>(1e-5 + u(rng) * 1e-2);
  h.beta1 = static_cast<float>(0.8 + 0.19 * u(rng));
  h.beta2 = static_cast<float>(0.99 + 0.0099 * u(rng));
  h.eps = static_cast<float>(1e-8 * (1 + 9 * u(rng)));
  h.step_size = static_cast<float>(h.lr / (1.0 - std::pow(static_cast<double>(h.beta1), t)));
  h.inv_bias2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(h.beta2), t)));
  h.momentum = static_cast<float>(0.5 + 0.49 * u(rng));
  h.nesterov = nesterov;
  h.weight_decay = static_cast<float>(u(rng) * 0.1);
  c.kernel = c.host;  // one type: the sharder passes its constants to the kernels as they are
  return c;
}

/// One shard's optimizer state: gradients, fp32 master and moments (v non-negative, as Adam's
/// second moment always is) and the 16-bit parameter copy.
template <class P>
struct shard {
  std::vector<P> grad;
  std::vector<float> master, m, v;
  std::vector<P> param;

  shard(std::mt19937_64& rng, std::size_t n, bool finite_grads)
      : grad(values<P>(rng, n, finite_grads)),
        master(values<float>(rng, n, true)),
        m(values<float>(rng, n, true)),
        v(values<float>(rng, n, true)),
        param(n) {
    for (auto& x : v) x = x * x * 1e-3f;
    for (auto& x : m) x *= 1e-2f;
  }
};

}  // namespace kernel_cases
