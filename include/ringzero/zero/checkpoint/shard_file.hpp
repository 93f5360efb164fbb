// One rank's shard file of a checkpoint: a 64-byte header (magic, format version, rank, world
// size, array count, shard size, step), then each array (the fp32 master weights, then each
// optimizer moment) of shard_size floats, little-endian. The file is named after the rank, the
// world size, the step and a random save id, so no save writes over a file a live manifest
// refers to. The manifest (manifest.hpp) lists every shard with its size and CRC-32C.
#pragma once

#include <fmt/core.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/zero/detail/file.hpp"

namespace ringzero::zero {

static_assert(std::endian::native == std::endian::little,
              "checkpoint files are little-endian; a big-endian host needs byte swapping");

/// 2 added the parameter groups' learning rates; version 1 checkpoints still load.
inline constexpr int checkpoint_format_version = 2;

namespace detail {

inline constexpr char shard_magic[8] = {'R', 'Z', 'S', 'H', 'A', 'R', 'D', '1'};
inline constexpr std::size_t shard_header_bytes = 64;

struct shard_header {
  char magic[8];
  std::uint32_t version;
  std::uint32_t rank;
  std::uint32_t world;
  std::uint32_t arrays;
  std::uint64_t shard_size;
  std::uint64_t step;
  std::byte reserved[24];
};
static_assert(sizeof(shard_header) == shard_header_bytes);

/// `save_id` is fresh for every save, so two saves of the same step never share a name.
[[nodiscard]] inline std::string shard_file_name(int rank, int world, std::uint64_t step,
                                                 std::uint64_t save_id) {
  return fmt::format("shard-{:05}-of-{:05}.step-{}.{:016x}.bin", rank, world, step, save_id);
}

[[nodiscard]] inline shard_header make_shard_header(int rank, int world, std::uint64_t step,
                                                    std::size_t arrays, std::size_t shard_size) {
  shard_header h{};
  std::memcpy(h.magic, shard_magic, sizeof h.magic);
  h.version = static_cast<std::uint32_t>(checkpoint_format_version);
  h.rank = static_cast<std::uint32_t>(rank);
  h.world = static_cast<std::uint32_t>(world);
  h.arrays = static_cast<std::uint32_t>(arrays);
  h.shard_size = shard_size;
  h.step = step;
  return h;
}

inline void check_shard_arrays(std::span<const std::vector<float>> arrays, std::size_t shard_size) {
  for (const auto& a : arrays)
    if (a.size() != shard_size)
      throw invalid_argument(
          fmt::format("write_shard: array of {} elements, shard has {}", a.size(), shard_size));
}

/// Writes one rank's shard file: a header, then each array of shard_size floats.
inline written_file write_shard(const std::filesystem::path& dir, int rank, int world,
                                std::uint64_t step, std::uint64_t save_id,
                                std::span<const std::vector<float>> arrays,
                                std::size_t shard_size) {
  check_shard_arrays(arrays, shard_size);
  const shard_header h = make_shard_header(rank, world, step, arrays.size(), shard_size);
  std::vector<std::span<const std::byte>> parts{std::as_bytes(std::span(&h, 1))};
  for (const auto& a : arrays) parts.push_back(std::as_bytes(std::span(a)));
  return write_file_atomic(dir / shard_file_name(rank, world, step, save_id), parts);
}

/// The bytes write_shard would write, in memory.
[[nodiscard]] inline std::vector<std::byte> shard_image(int rank, int world, std::uint64_t step,
                                                        std::span<const std::vector<float>> arrays,
                                                        std::size_t shard_size) {
  check_shard_arrays(arrays, shard_size);
  const shard_header h = make_shard_header(rank, world, step, arrays.size(), shard_size);
  std::vector<std::byte> out(shard_header_bytes + arrays.size() * shard_size * sizeof(float));
  std::memcpy(out.data(), &h, sizeof h);
  std::size_t at = shard_header_bytes;
  for (const auto& a : arrays) {
    if (!a.empty()) std::memcpy(out.data() + at, a.data(), a.size() * sizeof(float));
    at += a.size() * sizeof(float);
  }
  return out;
}

/// Whether `data`, read from rank `rank`'s shard file, is the shard a manifest describes: its
/// header, and a size of exactly the header plus every array. The manifest's sizes come from a
/// file too, so the expected size is computed without overflow.
[[nodiscard]] inline bool shard_matches(std::span<const std::byte> data, int rank, int world,
                                        std::uint64_t step, std::size_t arrays,
                                        std::size_t shard_size) noexcept {
  std::size_t elements = 0;
  std::size_t want = 0;
  if (__builtin_mul_overflow(arrays, shard_size, &elements) ||
      __builtin_mul_overflow(elements, sizeof(float), &want) ||
      __builtin_add_overflow(want, shard_header_bytes, &want) || data.size() != want)
    return false;
  shard_header h{};
  std::memcpy(&h, data.data(), sizeof h);
  return std::memcmp(h.magic, shard_magic, sizeof h.magic) == 0 &&
         h.rank == static_cast<std::uint32_t>(rank) &&
         h.world == static_cast<std::uint32_t>(world) && h.shard_size == shard_size &&
         h.arrays == arrays && h.step == step;
}

}  // namespace detail

}  // namespace ringzero::zero
