// As 0.2 documented it, unchanged (its examples/docs/zero_tied.cpp at 3087dec); built by
// tests/package/CMakeLists.txt with deprecation warnings allowed.
// The tied weight and the activation recomputation docs/zero.md shows, trained by two loopback
// ranks at stage 3; the program checks that the tied weight moved by the sum of both uses'
// gradients, so the documentation cannot drift from what the sharder does.
#include <ringzero/ringzero.hpp>
#include <ringzero/zero/sharder.hpp>

#include <fmt/core.h>

#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace zero = ringzero::zero;
using comm_t = ringzero::loopback::communicator;

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("zero_tied: " + what);
}

constexpr std::size_t vocab = 8, dim = 4;

}  // namespace

int main() {
  try {
    ringzero::log::set_level(ringzero::log::level::none);
    // docs-begin: tied-layout
    zero::model_layout layout;
    layout.add_layer("embed");
    const int wte = layout.add({.name = "wte", .shape = {vocab, dim}});
    layout.add_layer("block");
    const int block_w = layout.add({.name = "block.w", .shape = {dim, dim}});
    layout.add_layer("head");
    layout.share(wte);  // logits = x · wteᵀ: the embedding, used a second time
    const int head_b = layout.add({.name = "head.b", .shape = {vocab}, .weight_decay = false});
    // docs-end: tied-layout

    ringzero::loopback::world world(2);
    world.run([&](comm_t& comm) {
      zero::config cfg;
      cfg.stage = 3;
      cfg.optimizer = {.kind = zero::optimizer_kind::sgd, .lr = 1.0f, .momentum = 0.0f};
      cfg.bucket_bytes = 64;  // one bucket per layer: the head must gather the embedding's too
      zero::sharder<comm_t, float> shd(comm, layout, cfg);
      for (int id : {wte, block_w, head_b}) {
        const std::vector<float> ones(shd.plan().params()[static_cast<std::size_t>(id)].numel,
                                      1.0f);
        shd.set_parameter(id, ones);
      }
      const std::vector<float> d_head(vocab * dim, 0.25f), d_lookup(vocab * dim, 0.5f),
          d_w(dim * dim, 1.0f), d_b(vocab, 1.0f);

      for (int l = 0; l < 3; ++l) (void)shd.gather(l);  // forward
      // docs-begin: tied-backward
      {
        auto head = shd.gather(2, zero::pass::backward);
        expect(head.param(wte).size() == vocab * dim, "the head's handle holds wte");
        shd.add_grad(head_b, std::span<const float>(d_b));
        shd.add_grad(wte, std::span<const float>(d_head));  // wte's first use
      }
      // docs-begin: recompute
      // Activation checkpointing: the block's activations were not kept, so its forward runs
      // again before its backward. pass::recompute gathers without freeing or prefetching, so
      // what backward has prefetched stays.
      (void)shd.gather(1, zero::pass::recompute);
      // docs-end: recompute
      {
        auto block = shd.gather(1, zero::pass::backward);
        shd.add_grad(block_w, std::span<const float>(d_w));
      }
      {
        auto embed = shd.gather(0, zero::pass::backward);
        shd.add_grad(wte, std::span<const float>(d_lookup));  // its second use: summed
      }
      shd.end_micro_batch();
      (void)shd.step();
      // docs-end: tied-backward

      // Both ranks hand over the same gradients, averaged over 2 ranks: wte moved by their sum.
      const auto w = shd.full_parameters();
      for (std::size_t i = 0; i < vocab * dim; ++i)
        expect(w[i] == 1.0f - (0.25f + 0.5f), "wte moved by the sum of both uses");
      expect(shd.plan().numel() == vocab * dim + dim * dim + vocab, "wte is counted once");
    });
    fmt::print("zero_tied: the tied weight took the sum of both uses' gradients\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
