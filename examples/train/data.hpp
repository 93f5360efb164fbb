// The demo's dataset: inputs drawn from N(0, 1) and labelled by a fixed random "teacher" network,
// so there is something real to learn. Every value is a pure function of (seed, sample index),
// so any rank can produce any sample, and a run at any world size sees the same global batches.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace train {

/// splitmix64 of a combination of the inputs: a counter-based generator.
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

[[nodiscard]] inline float gaussian(std::uint64_t a, std::uint64_t b, std::uint64_t c) {
  const double u1 = uniform(a, b, 2 * c), u2 = uniform(a, b, 2 * c + 1);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

class teacher_dataset {
 public:
  teacher_dataset(std::uint64_t seed, int inputs, int classes, int hidden = 64)
      : seed_(seed),
        inputs_(inputs),
        classes_(classes),
        hidden_(hidden),
        w1_(static_cast<std::size_t>(hidden * inputs)),
        w2_(static_cast<std::size_t>(classes * hidden)) {
    for (std::size_t i = 0; i < w1_.size(); ++i)
      w1_[i] = gaussian(seed_, 1001, i) / std::sqrt(static_cast<float>(inputs));
    for (std::size_t i = 0; i < w2_.size(); ++i)
      w2_[i] = gaussian(seed_, 1002, i) / std::sqrt(static_cast<float>(hidden));
  }

  [[nodiscard]] int inputs() const noexcept { return inputs_; }
  [[nodiscard]] int classes() const noexcept { return classes_; }

  /// Sample `index`: writes inputs() features to x and returns its label.
  int sample(std::uint64_t index, float* x) const {
    for (int j = 0; j < inputs_; ++j) x[j] = gaussian(seed_, index, static_cast<std::uint64_t>(j));
    std::vector<float> h(static_cast<std::size_t>(hidden_));
    for (int i = 0; i < hidden_; ++i) {
      float s = 0;
      for (int j = 0; j < inputs_; ++j) s += w1_[static_cast<std::size_t>(i * inputs_ + j)] * x[j];
      h[static_cast<std::size_t>(i)] = std::tanh(s);
    }
    int best = 0;
    float best_v = -INFINITY;
    for (int c = 0; c < classes_; ++c) {
      float s = 0;
      for (int i = 0; i < hidden_; ++i)
        s += w2_[static_cast<std::size_t>(c * hidden_ + i)] * h[static_cast<std::size_t>(i)];
      if (s > best_v) {
        best_v = s;
        best = c;
      }
    }
    return best;
  }

 private:
  std::uint64_t seed_;
  int inputs_, classes_, hidden_;
  std::vector<float> w1_, w2_;
};

}  // namespace train
