// The demo's model: a multi-layer perceptron (Linear + ReLU, then Linear to class logits) with a
// softmax cross-entropy loss, forward and backward written out by hand in fp32. Weights come in
// the training type P (what the sharder holds, gathered in stage 3) and are widened to fp32 per
// layer; gradients leave in fp32 and the sharder rounds them to P.
#pragma once

#include <ringzero/zero/sharder.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace train {

struct mlp_shape {
  int inputs = 32;
  int hidden = 128;
  int depth = 2;  ///< hidden layers
  int classes = 10;

  [[nodiscard]] int layers() const noexcept { return depth + 1; }
  [[nodiscard]] int fan_in(int l) const noexcept { return l == 0 ? inputs : hidden; }
  [[nodiscard]] int fan_out(int l) const noexcept { return l == depth ? classes : hidden; }
  [[nodiscard]] std::size_t parameters() const noexcept {
    std::size_t n = 0;
    for (int l = 0; l < layers(); ++l)
      n += static_cast<std::size_t>(fan_out(l)) * static_cast<std::size_t>(fan_in(l) + 1);
    return n;
  }
};

/// Registers fc{l}.weight [out, in] and fc{l}.bias [out] for every layer, in forward order:
/// parameter 2l is layer l's weight, 2l + 1 its bias.
inline ringzero::zero::model_layout make_layout(const mlp_shape& s, ringzero::dtype type) {
  ringzero::zero::model_layout layout;
  for (int l = 0; l < s.layers(); ++l) {
    const auto out = static_cast<std::size_t>(s.fan_out(l));
    const auto in = static_cast<std::size_t>(s.fan_in(l));
    layout.add_layer("fc" + std::to_string(l));
    layout.add({.name = "fc" + std::to_string(l) + ".weight", .shape = {out, in}, .type = type});
    layout.add({.name = "fc" + std::to_string(l) + ".bias",
                .shape = {out},
                .type = type,
                .weight_decay = false});
  }
  return layout;
}

/// Forward and backward over one micro-batch of `rows` samples, handing every parameter's
/// gradient to the sharder in backward order. Returns the sum of the samples' losses.
template <class Sharder>
double forward_backward(Sharder& shd, const mlp_shape& s, std::span<const float> x,
                        std::span<const int> labels, float grad_scale) {
  const int rows = static_cast<int>(labels.size());
  const int nl = s.layers();
  // acts[l]: input of layer l (rows x fan_in(l)); acts[nl]: the logits.
  std::vector<std::vector<float>> acts(static_cast<std::size_t>(nl + 1));
  acts[0].assign(x.begin(), x.end());
  std::vector<float> w, b;
  auto widen = [&](typename Sharder::gathered& g, int l) {
    const auto wp = g.param(2 * l);
    const auto bp = g.param(2 * l + 1);
    w.resize(wp.size());
    b.resize(bp.size());
    std::transform(wp.begin(), wp.end(), w.begin(), [](auto v) { return static_cast<float>(v); });
    std::transform(bp.begin(), bp.end(), b.begin(), [](auto v) { return static_cast<float>(v); });
  };

  for (int l = 0; l < nl; ++l) {
    auto g = shd.gather(l);
    widen(g, l);
    const int in = s.fan_in(l), out = s.fan_out(l);
    const auto& a = acts[static_cast<std::size_t>(l)];
    auto& z = acts[static_cast<std::size_t>(l + 1)];
    z.assign(static_cast<std::size_t>(rows * out), 0.0f);
    for (int r = 0; r < rows; ++r)
      for (int o = 0; o < out; ++o) {
        float acc = b[static_cast<std::size_t>(o)];
        const float* wr = w.data() + static_cast<std::size_t>(o * in);
        const float* ar = a.data() + static_cast<std::size_t>(r * in);
        for (int i = 0; i < in; ++i) acc += wr[i] * ar[i];
        z[static_cast<std::size_t>(r * out + o)] = l + 1 < nl ? std::max(acc, 0.0f) : acc;
      }
  }

  // Softmax cross-entropy; dz = (softmax - onehot) * grad_scale.
  const int c = s.classes;
  auto& logits = acts[static_cast<std::size_t>(nl)];
  std::vector<float> dz(logits.size());
  double loss = 0;
  for (int r = 0; r < rows; ++r) {
    const float* zr = logits.data() + static_cast<std::size_t>(r * c);
    const float m = *std::max_element(zr, zr + c);
    double sum = 0;
    for (int k = 0; k < c; ++k) sum += std::exp(static_cast<double>(zr[k] - m));
    const int y = labels[static_cast<std::size_t>(r)];
    loss += std::log(sum) - static_cast<double>(zr[y] - m);
    for (int k = 0; k < c; ++k) {
      const double p = std::exp(static_cast<double>(zr[k] - m)) / sum;
      dz[static_cast<std::size_t>(r * c + k)] =
          static_cast<float>((p - (k == y ? 1.0 : 0.0)) * grad_scale);
    }
  }

  std::vector<float> dw, db, da;
  for (int l = nl - 1; l >= 0; --l) {
    auto g = shd.gather(l, ringzero::zero::pass::backward);
    widen(g, l);
    const int in = s.fan_in(l), out = s.fan_out(l);
    const auto& a = acts[static_cast<std::size_t>(l)];
    dw.assign(static_cast<std::size_t>(out * in), 0.0f);
    db.assign(static_cast<std::size_t>(out), 0.0f);
    for (int r = 0; r < rows; ++r)
      for (int o = 0; o < out; ++o) {
        const float d = dz[static_cast<std::size_t>(r * out + o)];
        if (d == 0.0f) continue;
        db[static_cast<std::size_t>(o)] += d;
        float* dwr = dw.data() + static_cast<std::size_t>(o * in);
        const float* ar = a.data() + static_cast<std::size_t>(r * in);
        for (int i = 0; i < in; ++i) dwr[i] += d * ar[i];
      }
    if (l > 0) {
      // Through this layer's weights and the previous layer's ReLU (a > 0 where it passed).
      da.assign(static_cast<std::size_t>(rows * in), 0.0f);
      for (int r = 0; r < rows; ++r)
        for (int o = 0; o < out; ++o) {
          const float d = dz[static_cast<std::size_t>(r * out + o)];
          if (d == 0.0f) continue;
          const float* wr = w.data() + static_cast<std::size_t>(o * in);
          float* dar = da.data() + static_cast<std::size_t>(r * in);
          for (int i = 0; i < in; ++i) dar[i] += d * wr[i];
        }
      for (std::size_t i = 0; i < da.size(); ++i)
        if (a[i] <= 0.0f) da[i] = 0.0f;
      dz.swap(da);
    }
    shd.add_grad(2 * l + 1, std::span<const float>(db));
    shd.add_grad(2 * l, std::span<const float>(dw));
  }
  return loss;
}

}  // namespace train
