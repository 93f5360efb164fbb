// ringzero-export: writes a sharded ZeRO checkpoint's full fp32 model to one safetensors file,
// or describes the checkpoint. Needs no communicator and no GPU; reads every shard once and
// checks every checksum.
//
//   ringzero-export CHECKPOINT_DIR OUT.safetensors
//   ringzero-export --info CHECKPOINT_DIR
#include <ringzero/zero/checkpoint.hpp>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <exception>
#include <string_view>

namespace {

constexpr const char* usage =
    "usage: ringzero-export CHECKPOINT_DIR OUT.safetensors\n"
    "       ringzero-export --info CHECKPOINT_DIR\n";

void info(const char* dir) {
  const auto m = ringzero::zero::checkpoint_manifest::read(dir);
  fmt::print(
      "checkpoint {}: step {} ({} optimizer steps), saved by {} ranks at stage {}, {} "
      "parameters, {} optimizer, loss scale {:g}\n",
      dir, m.step, m.optimizer_steps, m.world_size, m.stage, ringzero::dtype_name(m.precision),
      ringzero::zero::optimizer_name(m.optimizer), m.loss_scale);
  std::size_t total = 0;
  for (const auto& p : m.params) {
    fmt::print("  {:<32} [{}] {}\n", p.name, fmt::join(p.shape, ", "),
               ringzero::dtype_name(p.type));
    total += p.numel();
  }
  fmt::print("  {} tensors, {} elements\n", m.params.size(), total);
  for (const auto& s : m.shards)
    fmt::print("  shard {}: {} ({} bytes, crc32c {:08x})\n", s.rank, s.file, s.bytes, s.crc);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 3 && std::string_view(argv[1]) == "--info") {
      info(argv[2]);
      return 0;
    }
    if (argc != 3 || std::string_view(argv[1]).starts_with("-")) {
      std::fputs(usage, stderr);
      return 2;
    }
    const auto bytes = ringzero::zero::export_fp32(argv[1], argv[2]);
    fmt::print("wrote {} ({} bytes)\n", argv[2], bytes);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ringzero-export: %s\n", e.what());
    return 1;
  }
  return 0;
}
