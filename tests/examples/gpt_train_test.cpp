// The GPT demo's trainer (examples/gpt/trainer.hpp) on the ZeRO sharder, ranks as loopback
// threads: with one micro-batch per step, stages 0-3 end with bitwise identical weights; a
// checkpoint saved at 4 ranks resumes at 4 (bitwise) and at 2 (same loss curve) ranks.
#include <doctest/doctest.h>

#include <ringzero/ringzero.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "trainer.hpp"

namespace {

/// A few KB of text with some structure to learn.
gpt::corpus small_text() {
  const char* words[] = {"light ",     "rays ", "of ",         "the ", "prism ",  "colours ",
                         "refracted ", "and ",  "reflected, ", "red ", "violet. "};
  std::string s;
  for (std::uint64_t i = 0; s.size() < 4000; ++i) s += words[gpt::hash(3, 4, i) % 11];
  return gpt::corpus(s);
}

gpt::train_options tiny_options() {
  gpt::train_options o;
  o.model = {.vocab = 0, .context = 16, .dim = 16, .heads = 2, .layers = 2};
  o.batch = 8;
  o.steps = 6;
  o.warmup = 2;
  o.lr = 1e-2f;
  o.bucket_kib = 4;  // one bucket per layer: gathers, prefetches and reductions per layer
  o.sample = 0;
  return o;
}

template <class P>
gpt::train_result run(int ranks, const gpt::train_options& o, const gpt::corpus& text) {
  gpt::train_result out;
  ringzero::loopback::world world(ranks);
  world.run([&](ringzero::loopback::communicator& comm) {
    auto r = gpt::train<ringzero::loopback::communicator, P>(comm, o, text, nullptr);
    if (comm.rank() == 0) out = std::move(r);
  });
  return out;
}

template <class P>
void stages_agree() {
  const auto text = small_text();
  auto o = tiny_options();
  o.stage = 0;
  const auto reference = run<P>(4, o, text);
  REQUIRE(reference.losses.size() == 6);
  CHECK_MESSAGE(reference.losses.back() < reference.losses.front() - 0.3,
                "the loss should fall: ", reference.losses.front(), " -> ",
                reference.losses.back());
  for (int stage = 1; stage <= 3; ++stage) {
    CAPTURE(stage);
    o.stage = stage;
    const auto got = run<P>(4, o, text);
    CHECK(got.losses == reference.losses);
    CHECK_MESSAGE(got.weights == reference.weights, "stage ", stage,
                  " ended with other weights than stage 0");
  }
}

}  // namespace

TEST_CASE("stages 0-3 end with identical weights (fp32 parameters, one micro-batch per step)") {
  stages_agree<float>();
}

TEST_CASE("stages 0-3 end with identical weights (bf16 parameters)") {
  stages_agree<ringzero::bfloat16>();
}

TEST_CASE("a checkpoint saved by 4 ranks resumes at 4 and at 2 ranks on the same loss curve") {
  const auto text = small_text();
  const auto dir =
      std::filesystem::temp_directory_path() / ("ringzero-gpt-test-" + std::to_string(::getpid()));
  auto o = tiny_options();
  const auto full = run<float>(4, o, text);
  o.stop_after = 3;
  o.save = dir.string();
  const auto first = run<float>(4, o, text);
  REQUIRE(first.losses.size() == 3);
  CHECK(std::vector<double>(full.losses.begin(), full.losses.begin() + 3) == first.losses);
  o.stop_after = 0;
  o.save.clear();
  o.resume = dir.string();
  const auto same = run<float>(4, o, text);
  CHECK(std::vector<double>(full.losses.begin() + 3, full.losses.end()) == same.losses);
  CHECK(same.weights == full.weights);
  // At 2 ranks each gradient element is summed in another order: float rounding, nothing more.
  const auto fewer = run<float>(2, o, text);
  REQUIRE(fewer.losses.size() == 3);
  for (std::size_t i = 0; i < 3; ++i)
    CHECK(fewer.losses[i] == doctest::Approx(full.losses[3 + i]).epsilon(1e-5));
  std::filesystem::remove_all(dir);
}

TEST_CASE("the learning rate warms up linearly, then follows a cosine to its floor") {
  gpt::train_options o;
  o.lr = 1.0f;
  o.warmup = 10;
  o.steps = 110;
  o.min_lr_ratio = 0.1f;
  CHECK(gpt::learning_rate(o, 0) == doctest::Approx(0.1));
  CHECK(gpt::learning_rate(o, 9) == doctest::Approx(1.0));
  CHECK(gpt::learning_rate(o, 60) == doctest::Approx(0.55));
  CHECK(gpt::learning_rate(o, 110) == doctest::Approx(0.1));
  CHECK(gpt::learning_rate(o, 500) == doctest::Approx(0.1));
}

TEST_CASE("a batch that does not split over the ranks is refused") {
  auto o = tiny_options();
  o.batch = 6;
  CHECK_THROWS_AS(run<float>(4, o, small_text()), ringzero::invalid_argument);
}

TEST_CASE("--eval: the final weights' loss on a fixed set of sequences falls as training goes") {
  const auto text = small_text();
  auto o = tiny_options();
  o.eval = 16;
  o.stop_after = 1;
  const auto early = run<float>(4, o, text);
  o.stop_after = 0;
  const auto trained = run<float>(4, o, text);
  // The figure is the weights' alone: evaluating them again, outside the run, gives it exactly.
  gpt::config c = o.model;
  c.vocab = text.vocab();
  CHECK(gpt::evaluate(c, text, trained.weights, o.eval, o.seed) == trained.eval_loss);
  CHECK(std::isfinite(early.eval_loss));
  CHECK_MESSAGE(trained.eval_loss < early.eval_loss - 0.1, "eval loss after 1 step ",
                early.eval_loss, ", after 6 ", trained.eval_loss);
  // Stage 3 ends with stage 0's weights bit for bit (above), so with its evaluation too.
  o.stage = 0;
  CHECK(run<float>(4, o, text).eval_loss == trained.eval_loss);
}
