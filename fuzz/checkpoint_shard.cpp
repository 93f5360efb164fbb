// A shard file checked against its manifest. The input is a manifest (as in the manifest
// target, its checksum line written by the target), a NUL byte, then the shard file's bytes;
// the shard is checked as the rank its length picks, and a shard the check accepts is read
// array by array, as the reader reads it.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "manifest_checksum.hpp"
#include "ringzero/error.hpp"
#include "ringzero/zero/checkpoint.hpp"

namespace rz = ringzero::zero;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  const auto split = all.find('\0');
  if (split == std::string_view::npos) return 0;
  std::string text(all.substr(0, split));
  fix_manifest_checksum(text);
  rz::checkpoint_manifest m;
  try {
    m = rz::checkpoint_manifest::parse(text, "fuzz");
  } catch (const ringzero::error&) {
    return 0;
  }
  const auto shard = std::as_bytes(std::span(all.substr(split + 1)));
  const int rank = static_cast<int>(shard.size() % static_cast<std::size_t>(m.world_size));
  if (!rz::detail::shard_matches(shard, m, rank)) return 0;
  // Read every array where the reader finds it: a read past the accepted bytes is an
  // AddressSanitizer report.
  const std::size_t bytes = m.shard_size * sizeof(float);
  std::vector<std::byte> array(bytes);
  for (std::size_t a = 0; a < m.arrays.size(); ++a)
    std::copy_n(shard.data() + rz::detail::shard_header_bytes + a * bytes, bytes, array.begin());
  return 0;
}
