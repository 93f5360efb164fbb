// Sharded checkpoints, in parts:
//   checkpoint/shard_file.hpp  one rank's file: header, master weights, moments
//   checkpoint/manifest.hpp    what a checkpoint holds, where, and every shard's size and CRC-32C
//   checkpoint/reshard.hpp     reading any element back, whatever world size and stage saved it
//   checkpoint/commit.hpp      save and load as collectives; the manifest renamed into place last
// and here, the export of the full fp32 model to safetensors.
//
// A checkpoint is a directory:
//   manifest.txt                                        written by rank 0, last
//   shard-00000-of-00004.step-120.5c1f0e9a2b7d4c31.bin  one per rank: its slice of the fp32
//   ...                                                 master weights and of each moment
// The manifest records the parameters (names, shapes, types, where each lives in the flat
// buffer), the buckets, the world size, stage, step and optimizer, and the name, size and
// CRC-32C of every shard file; it ends with its own CRC-32C. Every file is written to a unique
// temporary name, fsynced and renamed, and the manifest is renamed into place only after every
// rank's shard is durable, so a directory holds either the previous checkpoint or the new one.
// Shard file names carry the step and a random save id, so no save (not even one of the same
// step) ever writes over a file the live manifest refers to; the files the new manifest no
// longer lists, and temporaries of interrupted saves, are removed after it is in place.
//
// Loading maps each parameter element from the saved layout to the loading rank's layout, so a
// checkpoint loads at any world size and stage without a conversion step. A missing, truncated
// or corrupt file raises checkpoint_error naming it.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "ringzero/zero/checkpoint/commit.hpp"
#include "ringzero/zero/checkpoint/manifest.hpp"
#include "ringzero/zero/checkpoint/reshard.hpp"
#include "ringzero/zero/checkpoint/shard_file.hpp"
#include "ringzero/zero/detail/file.hpp"

namespace ringzero::zero {

/// Writes a checkpoint's full fp32 model to one safetensors file (the format the Hugging Face
/// libraries, PyTorch and JAX read): tensors named and shaped as registered, in registration
/// order. Needs no communicator. Returns the number of bytes written.
inline std::uint64_t export_fp32(const std::filesystem::path& checkpoint_dir,
                                 const std::filesystem::path& out) {
  const checkpoint_reader reader(checkpoint_dir);
  const auto& m = reader.manifest();
  const auto tensors = reader.read_all_parameters();
  std::string header = "{\"__metadata__\":{\"format\":\"pt\",\"producer\":\"ringzero\",";
  fmt::format_to(std::back_inserter(header), "\"step\":\"{}\"}}", m.step);
  std::size_t offset = 0;
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    const std::size_t bytes = tensors[i].size() * sizeof(float);
    fmt::format_to(std::back_inserter(header),
                   ",\"{}\":{{\"dtype\":\"F32\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                   m.params[i].name, fmt::join(m.params[i].shape, ","), offset, offset + bytes);
    offset += bytes;
  }
  header += '}';
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::uint64_t header_len = header.size();
  std::vector<std::byte> payload(offset);
  std::size_t at = 0;
  for (const auto& t : tensors) {
    if (!t.empty()) std::memcpy(payload.data() + at, t.data(), t.size() * sizeof(float));
    at += t.size() * sizeof(float);
  }
  const auto w = detail::write_file_atomic(
      out, {std::as_bytes(std::span(&header_len, 1)), std::as_bytes(std::span(header)),
            std::span<const std::byte>(payload)});
  return w.bytes;
}

}  // namespace ringzero::zero
