// A shard file checked against its manifest. The input is a manifest (as in the manifest
// target, its checksum line written by the target), a NUL byte, then the shard file's bytes;
// the shard is checked as the rank its length picks. A shard the check accepts must hold every
// array of the manifest's shard size after its header.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "ringzero/error.hpp"
#include "ringzero/zero/checkpoint.hpp"

namespace rz = ringzero::zero;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  const auto split = all.find('\0');
  if (split == std::string_view::npos) return 0;
  std::string text(all.substr(0, split));
  if (const auto tail = text.rfind("crc32c "); tail != std::string::npos) text.resize(tail);
  if (!text.empty() && text.back() != '\n') text += '\n';
  text += fmt::format("crc32c {:08x}\n", rz::detail::crc32c(std::as_bytes(std::span(text))));
  rz::checkpoint_manifest m;
  try {
    m = rz::checkpoint_manifest::parse(text, "fuzz");
  } catch (const ringzero::error&) {
    return 0;
  }
  const auto shard = std::as_bytes(std::span(all.substr(split + 1)));
  const int rank = static_cast<int>(shard.size() % static_cast<std::size_t>(m.world_size));
  if (!rz::detail::shard_matches(shard, m, rank)) return 0;
  if (shard.size() !=
      rz::detail::shard_header_bytes + m.arrays.size() * m.shard_size * sizeof(float))
    std::abort();
  return 0;
}
