// A small GPT (Radford et al., 2019) over characters, with forward and backward written out by
// hand: token and learned position embeddings, `layers` pre-LayerNorm transformer blocks (causal
// multi-head self-attention, then a GELU MLP, each added to the residual stream), a final
// LayerNorm, and an output head tied to the token embedding (logits = LN(x) * wte^T).
//
// Everything is templated on the arithmetic type: the demo trains in float, the gradient test
// runs the same code in double against finite differences.
//
// Weights that multiply activations are stored [in, out] (as GPT-2's original Conv1D), so the
// forward products are X * W in the axpy form of kernels.hpp. The model never owns its
// parameters: it reads them from a Source, layer by layer, and hands each gradient back to it in
// backward order, which is what a ZeRO stage-3 sharder needs to gather a layer just before use
// and to reduce a layer's gradients while backward goes on:
//
//   src.acquire(layer, backward)   make the layer's parameters readable
//   src.param(id)                  -> const Real*, valid until release(layer)
//   src.release(layer)
//   src.grad(id, span<const Real>) the parameter's gradient for this micro-batch, once per use
//
// Layers: 0 = embeddings (wte, wpe), 1..L = blocks, L+1 = the final LayerNorm and the head. The
// head uses wte again: layer L+1 makes it readable too (the sharder's layout share()s it there),
// and wte gets two gradients, the head's and then the lookup's, which the Source sums.
#pragma once

#include <ringzero/error.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "kernels.hpp"

namespace gpt {

struct config {
  int vocab = 0;
  int context = 64;  ///< longest sequence, and the size of the position embedding
  int dim = 64;
  int heads = 4;
  int layers = 2;

  [[nodiscard]] int head_dim() const noexcept { return dim / heads; }
  [[nodiscard]] int hidden() const noexcept { return 4 * dim; }

  void validate() const {
    if (vocab < 2 || context < 1 || dim < 1 || heads < 1 || layers < 0 || dim % heads != 0)
      throw ringzero::invalid_argument(fmt::format(
          "gpt: vocab {} (>= 2), context {}, dim {}, heads {} (must divide dim), layers {}", vocab,
          context, dim, heads, layers));
  }
};

/// Slots of a block's parameters, in registration order.
enum slot : int {
  ln1_w,
  ln1_b,
  qkv_w,
  qkv_b,
  attn_proj_w,
  attn_proj_b,
  ln2_w,
  ln2_b,
  fc_w,
  fc_b,
  mlp_proj_w,
  mlp_proj_b,
  slots
};

constexpr int wte = 0;
constexpr int wpe = 1;
[[nodiscard]] constexpr int block_param(int layer, int s) noexcept {
  return 2 + slots * layer + s;
}
[[nodiscard]] constexpr int lnf_w(const config& c) noexcept {
  return 2 + slots * c.layers;
}
[[nodiscard]] constexpr int lnf_b(const config& c) noexcept {
  return 3 + slots * c.layers;
}
[[nodiscard]] constexpr int param_count(const config& c) noexcept {
  return 4 + slots * c.layers;
}
[[nodiscard]] constexpr int layer_count(const config& c) noexcept {
  return c.layers + 2;
}

struct param_desc {
  std::string name;
  std::vector<std::size_t> shape;
  bool decay = false;  ///< AdamW weight decay: matrices only, not embeddings, norms or biases
  int layer = 0;
  [[nodiscard]] std::size_t numel() const noexcept {
    std::size_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

/// Every parameter, in registration (= forward) order; index = parameter id.
[[nodiscard]] inline std::vector<param_desc> parameters(const config& c) {
  c.validate();
  const auto v = static_cast<std::size_t>(c.vocab), t = static_cast<std::size_t>(c.context),
             d = static_cast<std::size_t>(c.dim), h = static_cast<std::size_t>(c.hidden());
  std::vector<param_desc> ps;
  ps.push_back({"wte", {v, d}, false, 0});
  ps.push_back({"wpe", {t, d}, false, 0});
  for (int l = 0; l < c.layers; ++l) {
    const std::string b = fmt::format("h{}.", l);
    const int layer = 1 + l;
    ps.push_back({b + "ln1.weight", {d}, false, layer});
    ps.push_back({b + "ln1.bias", {d}, false, layer});
    ps.push_back({b + "attn.qkv.weight", {d, 3 * d}, true, layer});
    ps.push_back({b + "attn.qkv.bias", {3 * d}, false, layer});
    ps.push_back({b + "attn.proj.weight", {d, d}, true, layer});
    ps.push_back({b + "attn.proj.bias", {d}, false, layer});
    ps.push_back({b + "ln2.weight", {d}, false, layer});
    ps.push_back({b + "ln2.bias", {d}, false, layer});
    ps.push_back({b + "mlp.fc.weight", {d, h}, true, layer});
    ps.push_back({b + "mlp.fc.bias", {h}, false, layer});
    ps.push_back({b + "mlp.proj.weight", {h, d}, true, layer});
    ps.push_back({b + "mlp.proj.bias", {d}, false, layer});
  }
  ps.push_back({"ln_f.weight", {d}, false, c.layers + 1});
  ps.push_back({"ln_f.bias", {d}, false, c.layers + 1});
  return ps;
}

[[nodiscard]] inline std::string layer_name(const config& c, int layer) {
  if (layer == 0) return "embed";
  if (layer == c.layers + 1) return "ln_f";
  return fmt::format("h{}", layer - 1);
}

/// splitmix64 of a combination of the inputs: a counter-based generator, so every random value
/// is a pure function of its coordinates (same on every rank, at every world size).
[[nodiscard]] inline std::uint64_t hash(std::uint64_t a, std::uint64_t b, std::uint64_t c) {
  std::uint64_t x =
      a * 0x9e3779b97f4a7c15ull + b * 0xc2b2ae3d27d4eb4full + c + 0x165667b19e3779f9ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Uniform in (0, 1).
[[nodiscard]] inline double uniform(std::uint64_t a, std::uint64_t b, std::uint64_t c) {
  return (static_cast<double>(hash(a, b, c) >> 11) + 0.5) * 0x1p-53;
}

/// GPT-2's initialisation: N(0, 0.02) for matrices and the token embedding, N(0, 0.01) for the
/// position embedding, N(0, 0.02 / sqrt(2 L)) for the projections into the residual stream,
/// zero biases, unit LayerNorm gains.
[[nodiscard]] inline std::vector<float> initial_value(const config& c, int id, std::uint64_t seed) {
  const auto ps = parameters(c);
  const auto& p = ps.at(static_cast<std::size_t>(id));
  std::vector<float> v(p.numel(), 0.0f);
  const bool gain =
      p.name.ends_with("ln1.weight") || p.name.ends_with("ln2.weight") || p.name == "ln_f.weight";
  if (gain) std::fill(v.begin(), v.end(), 1.0f);
  if (!p.decay && id != wte && id != wpe) return v;
  double std = id == wpe ? 0.01 : 0.02;
  if (p.name.ends_with("proj.weight")) std /= std::sqrt(2.0 * std::max(1, c.layers));
  for (std::size_t i = 0; i < v.size(); ++i) {
    const double u1 = uniform(seed, static_cast<std::uint64_t>(2 * id), i);
    const double u2 = uniform(seed, static_cast<std::uint64_t>(2 * id + 1), i);
    v[i] =
        static_cast<float>(std * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  return v;
}

/// A Source over plain vectors: every parameter always present, gradients summed into `grads`.
template <class Real>
struct vector_source {
  std::vector<std::vector<Real>> values;
  std::vector<std::vector<Real>> grads;

  explicit vector_source(std::vector<std::vector<Real>> v) : values(std::move(v)) {
    for (const auto& x : values) grads.emplace_back(x.size(), Real(0));
  }
  void acquire(int, bool) noexcept {}
  void release(int) noexcept {}
  [[nodiscard]] const Real* param(int id) const {
    return values[static_cast<std::size_t>(id)].data();
  }
  void grad(int id, std::span<const Real> g) {
    auto& dst = grads[static_cast<std::size_t>(id)];
    for (std::size_t i = 0; i < g.size(); ++i) dst[i] += g[i];
  }
};

template <class Real>
class model {
 public:
  explicit model(config c) : c_(c), descs_(parameters(c)) {
    blocks_.resize(static_cast<std::size_t>(c_.layers));
    for (const auto& p : descs_) grads_.emplace_back(p.numel(), Real(0));
  }

  [[nodiscard]] const config& shape() const noexcept { return c_; }
  [[nodiscard]] const std::vector<param_desc>& params() const noexcept { return descs_; }

  /// Forward and backward over `batch` sequences of tokens.size() / batch tokens each (at most
  /// the context), predicting targets (the next tokens). Hands every gradient of
  /// grad_scale * (summed loss) to src in backward order; returns the summed loss.
  template <class Source>
  double forward_backward(Source& src, std::span<const int> tokens, std::span<const int> targets,
                          int batch, Real grad_scale) {
    shape_batch(tokens, batch);
    if (targets.size() != tokens.size())
      throw ringzero::invalid_argument("gpt: one target per token");
    forward(src);
    const double loss = cross_entropy(targets, grad_scale);
    backward(src, tokens);
    return loss;
  }

  /// The summed loss alone (no gradients).
  template <class Source>
  double loss(Source& src, std::span<const int> tokens, std::span<const int> targets, int batch) {
    shape_batch(tokens, batch);
    forward(src);
    return cross_entropy(targets, Real(0));
  }

  /// The logits after the last token of one sequence (at most the context long).
  template <class Source>
  std::vector<Real> next_logits(Source& src, std::span<const int> tokens) {
    shape_batch(tokens, 1);
    forward(src);
    const auto v = static_cast<std::size_t>(c_.vocab);
    return {logits_.end() - static_cast<std::ptrdiff_t>(v), logits_.end()};
  }

 private:
  struct block_acts {
    std::vector<Real> x, ln1, mean1, rstd1, qkv, att, y, xmid, ln2, mean2, rstd2, h, g;
  };

  void shape_batch(std::span<const int> tokens, int batch) {
    if (batch < 1 || tokens.empty() || tokens.size() % static_cast<std::size_t>(batch) != 0)
      throw ringzero::invalid_argument(
          fmt::format("gpt: {} tokens do not split into {} sequences", tokens.size(), batch));
    batch_ = static_cast<std::size_t>(batch);
    len_ = tokens.size() / batch_;
    if (len_ > static_cast<std::size_t>(c_.context))
      throw ringzero::invalid_argument(
          fmt::format("gpt: sequences of {} tokens, the context is {}", len_, c_.context));
    for (int t : tokens)
      if (t < 0 || t >= c_.vocab)
        throw ringzero::invalid_argument(fmt::format("gpt: token {} outside the vocabulary", t));
    tokens_.assign(tokens.begin(), tokens.end());
  }

  [[nodiscard]] std::size_t rows() const noexcept { return batch_ * len_; }

  static void layernorm(std::size_t m, std::size_t d, const Real* x, const Real* w, const Real* b,
                        Real* y, Real* mean, Real* rstd) {
    for (std::size_t i = 0; i < m; ++i) {
      const Real* xi = x + i * d;
      Real mu = 0;
      for (std::size_t j = 0; j < d; ++j) mu += xi[j];
      mu /= static_cast<Real>(d);
      Real var = 0;
      for (std::size_t j = 0; j < d; ++j) var += (xi[j] - mu) * (xi[j] - mu);
      var /= static_cast<Real>(d);
      const Real r = Real(1) / std::sqrt(var + Real(1e-5));
      mean[i] = mu;
      rstd[i] = r;
      for (std::size_t j = 0; j < d; ++j) y[i * d + j] = (xi[j] - mu) * r * w[j] + b[j];
    }
  }

  /// dx += LN'(dy); dw, db += the gain and bias gradients.
  static void layernorm_backward(std::size_t m, std::size_t d, const Real* x, const Real* mean,
                                 const Real* rstd, const Real* w, const Real* dy, Real* dx,
                                 Real* dw, Real* db) {
    for (std::size_t i = 0; i < m; ++i) {
      const Real* xi = x + i * d;
      const Real* dyi = dy + i * d;
      Real mean_dxhat = 0, mean_dxhat_xhat = 0;
      for (std::size_t j = 0; j < d; ++j) {
        const Real xhat = (xi[j] - mean[i]) * rstd[i];
        const Real dxhat = dyi[j] * w[j];
        mean_dxhat += dxhat;
        mean_dxhat_xhat += dxhat * xhat;
        dw[j] += dyi[j] * xhat;
        db[j] += dyi[j];
      }
      mean_dxhat /= static_cast<Real>(d);
      mean_dxhat_xhat /= static_cast<Real>(d);
      for (std::size_t j = 0; j < d; ++j) {
        const Real xhat = (xi[j] - mean[i]) * rstd[i];
        dx[i * d + j] += rstd[i] * (dyi[j] * w[j] - mean_dxhat - xhat * mean_dxhat_xhat);
      }
    }
  }

  static void broadcast_rows(std::size_t m, std::size_t n, const Real* bias, Real* out) {
    for (std::size_t i = 0; i < m; ++i) std::copy_n(bias, n, out + i * n);
  }

  // GELU, tanh approximation (as GPT-2).
  static constexpr Real gelu_c = Real(0.7978845608028654);  // sqrt(2 / pi)
  static constexpr Real gelu_a = Real(0.044715);
  /// tanh through one exp: a third of libm's tanhf time here, and exact to a few ulp; saturates
  /// to +-1 (exp overflowing to inf gives 1 - 0).
  static Real tanh_of(Real u) noexcept {
    return Real(1) - Real(2) / (Real(1) + std::exp(Real(2) * u));
  }

  template <class Source>
  void forward(Source& src) {
    const std::size_t m = rows(), d = static_cast<std::size_t>(c_.dim),
                      hid = static_cast<std::size_t>(c_.hidden());
    // The residual stream, carried through the blocks.
    x_.resize(m * d);
    src.acquire(0, false);
    const Real* pe = src.param(wpe);
    for (std::size_t i = 0; i < m; ++i) {
      const Real* ti = src.param(wte) + static_cast<std::size_t>(tokens_[i]) * d;
      const Real* pi = pe + (i % len_) * d;
      for (std::size_t j = 0; j < d; ++j) x_[i * d + j] = ti[j] + pi[j];
    }
    src.release(0);
    for (int l = 0; l < c_.layers; ++l) {
      src.acquire(1 + l, false);
      auto& a = blocks_[static_cast<std::size_t>(l)];
      auto p = [&](int s) { return src.param(block_param(l, s)); };
      a.x = x_;
      a.ln1.resize(m * d);
      a.mean1.resize(m);
      a.rstd1.resize(m);
      layernorm(m, d, a.x.data(), p(ln1_w), p(ln1_b), a.ln1.data(), a.mean1.data(), a.rstd1.data());
      a.qkv.resize(m * 3 * d);
      broadcast_rows(m, 3 * d, p(qkv_b), a.qkv.data());
      kernels::gemm_nn(m, 3 * d, d, a.ln1.data(), d, p(qkv_w), 3 * d, a.qkv.data(), 3 * d);
      attention(a);
      a.xmid.resize(m * d);
      broadcast_rows(m, d, p(attn_proj_b), a.xmid.data());
      for (std::size_t i = 0; i < m * d; ++i) a.xmid[i] += a.x[i];
      kernels::gemm_nn(m, d, d, a.y.data(), d, p(attn_proj_w), d, a.xmid.data(), d);
      a.ln2.resize(m * d);
      a.mean2.resize(m);
      a.rstd2.resize(m);
      layernorm(m, d, a.xmid.data(), p(ln2_w), p(ln2_b), a.ln2.data(), a.mean2.data(),
                a.rstd2.data());
      a.h.resize(m * hid);
      broadcast_rows(m, hid, p(fc_b), a.h.data());
      kernels::gemm_nn(m, hid, d, a.ln2.data(), d, p(fc_w), hid, a.h.data(), hid);
      a.g.resize(m * hid);
      for (std::size_t i = 0; i < m * hid; ++i) {
        const Real u = a.h[i];
        a.g[i] = Real(0.5) * u * (Real(1) + tanh_of(gelu_c * (u + gelu_a * u * u * u)));
      }
      broadcast_rows(m, d, p(mlp_proj_b), x_.data());
      for (std::size_t i = 0; i < m * d; ++i) x_[i] += a.xmid[i];
      kernels::gemm_nn(m, d, hid, a.g.data(), hid, p(mlp_proj_w), d, x_.data(), d);
      src.release(1 + l);
    }
    src.acquire(c_.layers + 1, false);
    lnf_.resize(m * d);
    meanf_.resize(m);
    rstdf_.resize(m);
    layernorm(m, d, x_.data(), src.param(lnf_w(c_)), src.param(lnf_b(c_)), lnf_.data(),
              meanf_.data(), rstdf_.data());
    const auto v = static_cast<std::size_t>(c_.vocab);
    logits_.assign(m * v, Real(0));
    kernels::gemm_nt(m, v, d, lnf_.data(), d, src.param(wte), d, logits_.data(), v, scratch_);
    src.release(c_.layers + 1);
  }

  /// Causal softmax attention of one block: a.att holds the probabilities (batch, head, query,
  /// key; zero above the diagonal), a.y the heads' outputs side by side. Per sequence and head,
  /// S = Q K^T and Y = P V are full t x t products through the kernels: twice the multiply-adds
  /// the causal half needs, but vectorised, which is several times faster at this size.
  void attention(block_acts& a) {
    const std::size_t d = static_cast<std::size_t>(c_.dim),
                      hd = static_cast<std::size_t>(c_.head_dim()),
                      nh = static_cast<std::size_t>(c_.heads), t = len_;
    const Real scale = Real(1) / std::sqrt(static_cast<Real>(hd));
    a.att.assign(batch_ * nh * t * t, Real(0));
    a.y.assign(rows() * d, Real(0));
    for (std::size_t b = 0; b < batch_; ++b)
      for (std::size_t h = 0; h < nh; ++h) {
        const Real* q = a.qkv.data() + b * t * 3 * d + h * hd;
        Real* p = a.att.data() + (b * nh + h) * t * t;
        kernels::gemm_nt(t, t, hd, q, 3 * d, q + d, 3 * d, p, t, scratch_);
        for (std::size_t i = 0; i < t; ++i) {
          Real* pi = p + i * t;
          Real mx = -std::numeric_limits<Real>::infinity();
          for (std::size_t j = 0; j <= i; ++j) mx = std::max(mx, pi[j] * scale);
          Real sum = 0;
          for (std::size_t j = 0; j <= i; ++j) sum += pi[j] = std::exp(pi[j] * scale - mx);
          for (std::size_t j = 0; j <= i; ++j) pi[j] /= sum;
          std::fill(pi + i + 1, pi + t, Real(0));
        }
        kernels::gemm_nn(t, hd, t, p, t, q + 2 * d, 3 * d, a.y.data() + b * t * d + h * hd, d);
      }
  }

  /// dqkv += attention'(dy).
  void attention_backward(const block_acts& a, const Real* dy, Real* dqkv) {
    const std::size_t d = static_cast<std::size_t>(c_.dim),
                      hd = static_cast<std::size_t>(c_.head_dim()),
                      nh = static_cast<std::size_t>(c_.heads), t = len_;
    const Real scale = Real(1) / std::sqrt(static_cast<Real>(hd));
    dp_.resize(t * t);
    for (std::size_t b = 0; b < batch_; ++b)
      for (std::size_t h = 0; h < nh; ++h) {
        const Real* q = a.qkv.data() + b * t * 3 * d + h * hd;
        Real* dq = dqkv + b * t * 3 * d + h * hd;
        const Real* p = a.att.data() + (b * nh + h) * t * t;
        const Real* dyh = dy + b * t * d + h * hd;
        // dP = dY V^T, dV += P^T dY.
        std::fill(dp_.begin(), dp_.end(), Real(0));
        kernels::gemm_nt(t, t, hd, dyh, d, q + 2 * d, 3 * d, dp_.data(), t, scratch_);
        kernels::gemm_tn(t, hd, t, p, t, dyh, d, dq + 2 * d, 3 * d);
        // Through the softmax: dS = P (dP - rowsum(P dP)), times the score scale.
        for (std::size_t i = 0; i < t; ++i) {
          const Real* pi = p + i * t;
          Real* di = dp_.data() + i * t;
          Real dot = 0;
          for (std::size_t j = 0; j <= i; ++j) dot += pi[j] * di[j];
          for (std::size_t j = 0; j <= i; ++j) di[j] = pi[j] * (di[j] - dot) * scale;
          std::fill(di + i + 1, di + t, Real(0));
        }
        // dQ += dS K, dK += dS^T Q.
        kernels::gemm_nn(t, hd, t, dp_.data(), t, q + d, 3 * d, dq, 3 * d);
        kernels::gemm_tn(t, hd, t, dp_.data(), t, q, 3 * d, dq + d, 3 * d);
      }
  }

  /// Summed cross-entropy of the logits against targets; leaves the logits' gradient, times
  /// grad_scale, in dlogits_.
  double cross_entropy(std::span<const int> targets, Real grad_scale) {
    const std::size_t m = rows(), v = static_cast<std::size_t>(c_.vocab);
    dlogits_.resize(m * v);
    double loss = 0;
    for (std::size_t i = 0; i < m; ++i) {
      const int y = targets[i];
      if (y < 0 || y >= c_.vocab)
        throw ringzero::invalid_argument(fmt::format("gpt: target {} outside the vocabulary", y));
      const Real* z = logits_.data() + i * v;
      const Real mx = *std::max_element(z, z + v);
      double sum = 0;
      for (std::size_t k = 0; k < v; ++k) sum += std::exp(static_cast<double>(z[k] - mx));
      loss += std::log(sum) - static_cast<double>(z[static_cast<std::size_t>(y)] - mx);
      for (std::size_t k = 0; k < v; ++k) {
        const double p = std::exp(static_cast<double>(z[k] - mx)) / sum;
        dlogits_[i * v + k] =
            static_cast<Real>(p - (k == static_cast<std::size_t>(y) ? 1.0 : 0.0)) * grad_scale;
      }
    }
    return loss;
  }

  std::vector<Real>& zeroed(int id) {
    auto& g = grads_[static_cast<std::size_t>(id)];
    std::fill(g.begin(), g.end(), Real(0));
    return g;
  }

  template <class Source>
  void emit(Source& src, int id) {
    src.grad(id, std::span<const Real>(grads_[static_cast<std::size_t>(id)]));
  }

  template <class Source>
  void backward(Source& src, std::span<const int> tokens) {
    const std::size_t m = rows(), d = static_cast<std::size_t>(c_.dim),
                      hid = static_cast<std::size_t>(c_.hidden()),
                      v = static_cast<std::size_t>(c_.vocab);
    src.acquire(c_.layers + 1, true);
    // Head: logits = lnf * wte^T.
    auto& dte = zeroed(wte);
    kernels::gemm_tn(v, d, m, dlogits_.data(), v, lnf_.data(), d, dte.data(), d);
    dln_.assign(m * d, Real(0));
    kernels::gemm_nn(m, d, v, dlogits_.data(), v, src.param(wte), d, dln_.data(), d);
    emit(src, wte);  // the head's use; the lookup's follows in layer 0
    dx_.assign(m * d, Real(0));
    layernorm_backward(m, d, x_.data(), meanf_.data(), rstdf_.data(), src.param(lnf_w(c_)),
                       dln_.data(), dx_.data(), zeroed(lnf_w(c_)).data(), zeroed(lnf_b(c_)).data());
    emit(src, lnf_b(c_));
    emit(src, lnf_w(c_));
    src.release(c_.layers + 1);

    for (int l = c_.layers - 1; l >= 0; --l) {
      src.acquire(1 + l, true);
      const auto& a = blocks_[static_cast<std::size_t>(l)];
      auto p = [&](int s) { return src.param(block_param(l, s)); };
      auto g = [&](int s) { return zeroed(block_param(l, s)).data(); };
      // x_out = xmid + g * Wmp + bmp; dx_ is d(x_out) and flows on to xmid unchanged.
      kernels::column_sums(m, d, dx_.data(), g(mlp_proj_b));
      kernels::gemm_tn(hid, d, m, a.g.data(), hid, dx_.data(), d, g(mlp_proj_w), d);
      dh_.assign(m * hid, Real(0));
      kernels::gemm_nt(m, hid, d, dx_.data(), d, p(mlp_proj_w), d, dh_.data(), hid, scratch_);
      for (std::size_t i = 0; i < m * hid; ++i) {
        const Real u = a.h[i];
        const Real th = tanh_of(gelu_c * (u + gelu_a * u * u * u));
        const Real du = Real(0.5) * (Real(1) + th) + Real(0.5) * u * (Real(1) - th * th) * gelu_c *
                                                         (Real(1) + Real(3) * gelu_a * u * u);
        dh_[i] *= du;
      }
      kernels::column_sums(m, hid, dh_.data(), g(fc_b));
      kernels::gemm_tn(d, hid, m, a.ln2.data(), d, dh_.data(), hid, g(fc_w), hid);
      dln_.assign(m * d, Real(0));
      kernels::gemm_nt(m, d, hid, dh_.data(), hid, p(fc_w), hid, dln_.data(), d, scratch_);
      layernorm_backward(m, d, a.xmid.data(), a.mean2.data(), a.rstd2.data(), p(ln2_w), dln_.data(),
                         dx_.data(), g(ln2_w), g(ln2_b));
      // xmid = x + y * Wap + bap.
      kernels::column_sums(m, d, dx_.data(), g(attn_proj_b));
      kernels::gemm_tn(d, d, m, a.y.data(), d, dx_.data(), d, g(attn_proj_w), d);
      dy_.assign(m * d, Real(0));
      kernels::gemm_nt(m, d, d, dx_.data(), d, p(attn_proj_w), d, dy_.data(), d, scratch_);
      dqkv_.assign(m * 3 * d, Real(0));
      attention_backward(a, dy_.data(), dqkv_.data());
      kernels::column_sums(m, 3 * d, dqkv_.data(), g(qkv_b));
      kernels::gemm_tn(d, 3 * d, m, a.ln1.data(), d, dqkv_.data(), 3 * d, g(qkv_w), 3 * d);
      dln_.assign(m * d, Real(0));
      kernels::gemm_nt(m, d, 3 * d, dqkv_.data(), 3 * d, p(qkv_w), 3 * d, dln_.data(), d, scratch_);
      layernorm_backward(m, d, a.x.data(), a.mean1.data(), a.rstd1.data(), p(ln1_w), dln_.data(),
                         dx_.data(), g(ln1_w), g(ln1_b));
      for (int s = slots - 1; s >= 0; --s) emit(src, block_param(l, s));
      src.release(1 + l);
    }

    src.acquire(0, true);
    zeroed(wte);
    auto& dpe = zeroed(wpe);
    for (std::size_t i = 0; i < m; ++i) {
      Real* dt = dte.data() + static_cast<std::size_t>(tokens[i]) * d;
      Real* dp = dpe.data() + (i % len_) * d;
      for (std::size_t j = 0; j < d; ++j) {
        dt[j] += dx_[i * d + j];
        dp[j] += dx_[i * d + j];
      }
    }
    emit(src, wpe);
    emit(src, wte);
    src.release(0);
  }

  config c_;
  std::vector<param_desc> descs_;
  std::vector<std::vector<Real>> grads_;
  std::vector<block_acts> blocks_;
  std::vector<int> tokens_;
  std::size_t batch_ = 0, len_ = 0;
  std::vector<Real> x_, lnf_, meanf_, rstdf_, logits_, dlogits_;
  std::vector<Real> dx_, dln_, dh_, dy_, dqkv_, dp_, scratch_;
};

}  // namespace gpt
