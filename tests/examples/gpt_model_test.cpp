// The GPT demo's model (examples/gpt/model.hpp): every parameter's analytic gradient against
// central finite differences, in double; the loss of an untrained model; bad input.
#include <doctest/doctest.h>

#include <ringzero/error.hpp>

#include <cmath>
#include <cstddef>
#include <vector>

#include "model.hpp"

namespace {

gpt::config tiny() {
  // Two blocks, two heads, a hidden width of 32: every path of the model, small enough that
  // perturbing each of its ~2000 parameters twice takes well under a second.
  return {.vocab = 7, .context = 5, .dim = 8, .heads = 2, .layers = 2};
}

/// Parameters away from the initialisation's symmetries (unit gains, zero biases), so every
/// term of every gradient is exercised.
std::vector<std::vector<double>> random_parameters(const gpt::config& c) {
  std::vector<std::vector<double>> v;
  const auto ps = gpt::parameters(c);
  for (std::size_t id = 0; id < ps.size(); ++id) {
    std::vector<double> x(ps[id].numel());
    for (std::size_t i = 0; i < x.size(); ++i)
      x[i] = 0.6 * (gpt::uniform(99, id, i) - 0.5) + (ps[id].name.ends_with("ln1.weight") ||
                                                              ps[id].name.ends_with("ln2.weight") ||
                                                              ps[id].name == "ln_f.weight"
                                                          ? 1.0
                                                          : 0.0);
    v.push_back(std::move(x));
  }
  return v;
}

std::vector<int> tokens_of(std::size_t n, std::uint64_t salt, int vocab) {
  std::vector<int> t(n);
  for (std::size_t i = 0; i < n; ++i)
    t[i] = static_cast<int>(gpt::hash(7, salt, i) % static_cast<std::uint64_t>(vocab));
  return t;
}

}  // namespace

TEST_CASE("every parameter's gradient matches central finite differences (double)") {
  const auto c = tiny();
  // Two sequences of 4 tokens: shorter than the context, so the position embedding's last row
  // must get a zero gradient.
  const int batch = 2;
  const auto tokens = tokens_of(8, 1, c.vocab);
  const auto targets = tokens_of(8, 2, c.vocab);
  gpt::model<double> m(c);
  gpt::vector_source<double> src(random_parameters(c));
  const double scale = 0.37;  // any grad_scale: the gradient is of scale * summed loss
  const double loss = m.forward_backward(src, tokens, targets, batch, scale);
  CHECK(loss > 0);

  // In double, central differences with h = 1e-5 have truncation error ~h^2 * f''' ~ 1e-10 and
  // rounding error ~1e-16 * |f| / h ~ 1e-10 here (|f| ~ 16), far below a wrong term of the
  // backward pass (which shows up at 1e-3 and above), so 1e-7 absolute + 1e-6 relative.
  const double h = 1e-5;
  int checked = 0;
  for (std::size_t id = 0; id < src.values.size(); ++id) {
    const auto& name = m.params()[id].name;
    double worst = 0;
    for (std::size_t i = 0; i < src.values[id].size(); ++i) {
      double& w = src.values[id][i];
      const double keep = w;
      w = keep + h;
      const double up = m.loss(src, tokens, targets, batch);
      w = keep - h;
      const double down = m.loss(src, tokens, targets, batch);
      w = keep;
      const double numeric = scale * (up - down) / (2 * h);
      const double analytic = src.grads[id][i];
      const double err = std::abs(numeric - analytic);
      worst = std::max(worst, err / (1e-7 + 1e-6 * std::abs(numeric)));
      ++checked;
    }
    CHECK_MESSAGE(worst <= 1.0, name, ": gradient off by ", worst,
                  " times the tolerance (1e-7 + 1e-6 |numeric|)");
  }
  CHECK(checked == static_cast<int>([&] {
          std::size_t n = 0;
          for (const auto& p : m.params()) n += p.numel();
          return n;
        }()));
  const auto& dpe = src.grads[gpt::wpe];
  for (std::size_t j = 0; j < static_cast<std::size_t>(c.dim); ++j)
    CHECK(dpe[4 * static_cast<std::size_t>(c.dim) + j] == 0.0);
}

TEST_CASE("the float path computes the double path's gradients") {
  const auto c = tiny();
  const auto tokens = tokens_of(10, 3, c.vocab);
  const auto targets = tokens_of(10, 4, c.vocab);
  const auto pd = random_parameters(c);
  std::vector<std::vector<float>> pf;
  for (const auto& v : pd) pf.emplace_back(v.begin(), v.end());
  gpt::model<double> md(c);
  gpt::model<float> mf(c);
  gpt::vector_source<double> sd(pd);
  gpt::vector_source<float> sf(pf);
  const double ld = md.forward_backward(sd, tokens, targets, 2, 1.0);
  const double lf = mf.forward_backward(sf, tokens, targets, 2, 1.0f);
  CHECK(lf == doctest::Approx(ld).epsilon(1e-5));
  for (std::size_t id = 0; id < pd.size(); ++id)
    for (std::size_t i = 0; i < pd[id].size(); ++i)
      REQUIRE_MESSAGE(
          std::abs(sf.grads[id][i] - sd.grads[id][i]) <= 1e-4 + 1e-3 * std::abs(sd.grads[id][i]),
          md.params()[id].name, "[", i, "]: float ", sf.grads[id][i], ", double ", sd.grads[id][i]);
}

TEST_CASE("an untrained model predicts about uniformly: loss ~ ln(vocab)") {
  // The demo's shape over the demo's vocabulary size. At GPT-2's initialisation the logits have
  // a standard deviation of about 0.02 * sqrt(dim) = 0.16, which raises the expected loss above
  // ln(vocab) by about half their variance, 0.013.
  const gpt::config c{.vocab = 93, .context = 64, .dim = 64, .heads = 4, .layers = 2};
  std::vector<std::vector<float>> p;
  for (int id = 0; id < gpt::param_count(c); ++id) p.push_back(gpt::initial_value(c, id, 1));
  gpt::vector_source<float> src(p);
  gpt::model<float> m(c);
  const auto tokens = tokens_of(4 * 64, 5, c.vocab);
  const auto targets = tokens_of(4 * 64, 6, c.vocab);
  const double mean = m.loss(src, tokens, targets, 4) / static_cast<double>(tokens.size());
  CHECK(mean == doctest::Approx(std::log(93.0)).epsilon(0.01));
}

TEST_CASE("bad input is refused with a message") {
  const auto c = tiny();
  gpt::model<double> m(c);
  gpt::vector_source<double> src(random_parameters(c));
  const std::vector<int> too_long(12, 0), bad_token{0, 1, 9, 2};
  CHECK_THROWS_AS((void)m.loss(src, too_long, too_long, 2), ringzero::invalid_argument);
  CHECK_THROWS_AS((void)m.loss(src, bad_token, bad_token, 1), ringzero::invalid_argument);
  CHECK_THROWS_AS((void)m.loss(src, bad_token, bad_token, 3), ringzero::invalid_argument);
  CHECK_THROWS_AS((void)gpt::parameters({.vocab = 7, .dim = 6, .heads = 4}),
                  ringzero::invalid_argument);
}
