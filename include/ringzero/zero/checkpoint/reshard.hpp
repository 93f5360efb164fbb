// Reading a checkpoint into any layout: checkpoint_reader maps parameter elements from the layout
// that saved them (its world size, buckets and shards) to whatever the caller asks for, reading
// each shard file it needs once and checking its size, CRC-32C and header. So a checkpoint loads
// at any world size and stage without a conversion step. A checkpoint_image is the same files
// held in memory (sharder::snapshot()).
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/zero/checkpoint/manifest.hpp"
#include "ringzero/zero/checkpoint/shard_file.hpp"
#include "ringzero/zero/detail/crc32c.hpp"
#include "ringzero/zero/detail/file.hpp"

namespace ringzero::zero {

namespace detail {

/// Whether `data`, read from rank `rank`'s shard file, is that shard of the checkpoint `m`
/// describes.
[[nodiscard]] inline bool shard_matches(std::span<const std::byte> data,
                                        const checkpoint_manifest& m, int rank) noexcept {
  return shard_matches(data, rank, m.world_size, m.step, m.arrays.size(), m.shard_size);
}

}  // namespace detail

/// A checkpoint held in memory rather than in a directory: the manifest's text and shard files
/// by name, as save() would write them (sharder::snapshot() makes one). Loading one checks it as
/// a directory is checked (sizes, CRC-32C, headers).
struct checkpoint_image {
  std::string manifest;
  std::map<std::string, std::vector<std::byte>> files;
  [[nodiscard]] bool empty() const noexcept { return manifest.empty(); }
  /// Bytes held: what keeping it costs.
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t n = manifest.size();
    for (const auto& [name, f] : files) n += f.size();
    return n;
  }
};

class checkpoint_reader {
 public:
  /// Reads from an image instead of a directory; `image` must outlive the reader.
  explicit checkpoint_reader(const checkpoint_image& image)
      : dir_("(in-memory snapshot)"),
        manifest_(checkpoint_manifest::parse(image.manifest, dir_.string())),
        image_(&image) {
    for (const auto& sh : manifest_.shards) {
      const auto f = image.files.find(sh.file);
      if (f == image.files.end())
        throw checkpoint_error(fmt::format("{}: shard {} (rank {} of {}) is not held",
                                           dir_.string(), sh.file, sh.rank, manifest_.world_size));
      if (f->second.size() != sh.bytes)
        throw checkpoint_error(fmt::format("{}: shard {} has {} bytes, the manifest says {}",
                                           dir_.string(), sh.file, f->second.size(), sh.bytes));
    }
  }

  explicit checkpoint_reader(std::filesystem::path dir)
      : dir_(std::move(dir)), manifest_(checkpoint_manifest::read(dir_)) {
    for (const auto& sh : manifest_.shards) {
      const auto path = dir_ / sh.file;
      std::error_code ec;
      const auto size = std::filesystem::file_size(path, ec);
      if (ec)
        throw checkpoint_error(
            fmt::format("checkpoint {}: shard file {} (rank {} of {}) is missing", dir_.string(),
                        path.string(), sh.rank, manifest_.world_size));
      if (size != sh.bytes)
        throw checkpoint_error(fmt::format(
            "checkpoint {}: shard file {} has {} bytes, the manifest says {} (truncated?)",
            dir_.string(), path.string(), size, sh.bytes));
    }
  }

  [[nodiscard]] const checkpoint_manifest& manifest() const noexcept { return manifest_; }
  [[nodiscard]] const std::filesystem::path& directory() const noexcept { return dir_; }

  /// Copy elements [begin, begin + count) of manifest parameter `param`, from array `array`
  /// (0 = master weights), to dst.
  struct request {
    int param = 0;
    std::size_t begin = 0;
    std::size_t count = 0;
    int array = 0;
    float* dst = nullptr;
  };

  /// Serves every request, reading each shard file it needs once and checking its CRC-32C.
  void read(std::span<const request> requests) const {
    struct piece {
      std::size_t shard_pos;
      std::size_t count;
      int array;
      float* dst;
    };
    std::map<int, std::vector<piece>> by_rank;
    const auto world = static_cast<std::size_t>(manifest_.world_size);
    for (const auto& rq : requests) {
      const auto& p = manifest_.params.at(static_cast<std::size_t>(rq.param));
      if (rq.begin + rq.count > p.numel() || rq.array < 0 ||
          static_cast<std::size_t>(rq.array) >= manifest_.arrays.size())
        throw invalid_argument("checkpoint_reader: request outside the parameter");
      const auto& b = manifest_.buckets[static_cast<std::size_t>(p.bucket)];
      const std::size_t slice = b.padded / world;
      std::size_t e = rq.begin;
      float* dst = rq.dst;
      while (e < rq.begin + rq.count) {
        const std::size_t rel = p.offset + e - b.offset;
        const std::size_t within = rel % slice;
        const std::size_t n = std::min(rq.begin + rq.count - e, slice - within);
        by_rank[static_cast<int>(rel / slice)].push_back(
            {b.shard_offset + within, n, rq.array, dst});
        e += n;
        dst += n;
      }
    }
    for (const auto& [rank, pieces] : by_rank) {
      const auto data = load_shard(rank);
      for (const auto& pc : pieces)
        std::memcpy(pc.dst,
                    data.data() + detail::shard_header_bytes +
                        (static_cast<std::size_t>(pc.array) * manifest_.shard_size + pc.shard_pos) *
                            sizeof(float),
                    pc.count * sizeof(float));
    }
  }

  /// Every parameter's master weights, whole, in manifest order.
  [[nodiscard]] std::vector<std::vector<float>> read_all_parameters() const {
    std::vector<std::vector<float>> out(manifest_.params.size());
    std::vector<request> reqs;
    for (std::size_t i = 0; i < out.size(); ++i) {
      out[i].resize(manifest_.params[i].numel());
      reqs.push_back({static_cast<int>(i), 0, out[i].size(), 0, out[i].data()});
    }
    read(reqs);
    return out;
  }

 private:
  [[nodiscard]] std::vector<std::byte> load_shard(int rank) const {
    const auto& sh = manifest_.shards[static_cast<std::size_t>(rank)];
    const auto path = dir_ / sh.file;
    auto data = image_ != nullptr ? image_->files.at(sh.file) : detail::read_file(path);
    const std::uint32_t crc = detail::crc32c(data);
    if (crc != sh.crc || data.size() != sh.bytes)
      throw checkpoint_error(fmt::format(
          "checkpoint {}: shard file {} is corrupt: crc32c {:08x} over {} bytes, the manifest "
          "says {:08x} over {} bytes",
          dir_.string(), path.string(), crc, data.size(), sh.crc, sh.bytes));
    if (!detail::shard_matches(data, manifest_, rank))
      throw checkpoint_error(
          fmt::format("checkpoint {}: shard file {} does not belong to this checkpoint (its "
                      "header or size disagrees with the manifest)",
                      dir_.string(), path.string()));
    return data;
  }

  std::filesystem::path dir_;
  checkpoint_manifest manifest_;
  const checkpoint_image* image_ = nullptr;
};

}  // namespace ringzero::zero
