// The checkpoint manifest parser and its consistency checks. A manifest ends with the CRC-32C of
// everything before it, which random mutations almost never get right; so for inputs whose
// first byte is odd the target writes the right checksum line itself, and the fuzzer reaches
// the parser behind the checksum. A manifest that parses must serialize to text that parses
// back to the same manifest.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "manifest_checksum.hpp"
#include "ringzero/error.hpp"
#include "ringzero/zero/checkpoint.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if ((data[0] & 1) != 0) fix_manifest_checksum(text);
  ringzero::zero::checkpoint_manifest m;
  try {
    m = ringzero::zero::checkpoint_manifest::parse(text, "fuzz");
  } catch (const ringzero::error&) {
    return 0;
  }
  const std::string again = m.serialize();
  if (ringzero::zero::checkpoint_manifest::parse(again, "fuzz (serialized)").serialize() != again)
    std::abort();
  return 0;
}
