// The partition plan: where every parameter lives in one flat buffer, and which contiguous slice
// of it each rank owns.
//
//   zero::model_layout layout;
//   layout.add_layer("fc1");
//   layout.add({.name = "fc1.weight", .shape = {256, 64}, .type = dtype::bfloat16});
//   layout.add({.name = "fc1.bias", .shape = {256}, .type = dtype::bfloat16, .weight_decay =
//   false}); zero::partition_plan plan(layout, /*world_size=*/4, /*bucket_elements=*/1 << 20);
//   fmt::print("{}\n", plan);
//
// The flat buffer is a sequence of buckets. A bucket holds whole layers (consecutive parameters,
// each starting on an `alignment`-element boundary) up to `bucket_elements`, and is padded to a
// multiple of world_size * alignment so it splits into world_size equal, aligned slices. Rank r
// owns slice r of every bucket, stored back to back: its shard. With one bucket (bucket_elements
// = 0) that is exactly "rank r owns the r-th contiguous 1/N of the flat buffer"; with several,
// every reduction and gather is an even reduce_scatter / all_gather of one bucket, which lets a
// bucket be reduced as soon as backward has produced its gradients and keeps the reduction order
// of every element the same in all stages.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/types.hpp"

namespace ringzero::zero {

/// A trainable parameter as the trainer registers it. Names identify parameters in checkpoints:
/// unique, non-empty, no whitespace.
struct param_spec {
  std::string name;
  std::vector<std::size_t> shape;  ///< empty: a scalar
  dtype type = dtype::float32;     ///< must be the sharder's parameter type
  bool weight_decay = true;        ///< false for biases and norms, as usual
  int group = 0;                   ///< index into config::groups (0 when there are none)
};

/// The parameters of a model, in the order the forward pass uses them, grouped into layers.
/// A layer is the unit a stage-3 trainer gathers; parameters added outside any layer form one
/// layer each.
class model_layout {
 public:
  struct layer {
    std::string name;
    int first_param = 0;
    int param_count = 0;
    std::vector<int> shared;  ///< parameters of earlier layers this layer also uses (share())
  };

  /// Opens a layer: the parameters added next belong to it until the next add_layer.
  int add_layer(std::string name) {
    layers_.push_back({std::move(name), static_cast<int>(params_.size()), 0, {}});
    open_ = true;
    return static_cast<int>(layers_.size()) - 1;
  }

  /// Registers a parameter and returns its id (its index in registration order).
  int add(param_spec p) {
    check_name(p.name);
    for (const auto& q : params_)
      if (q.name == p.name)
        throw invalid_argument(fmt::format("parameter '{}' is registered twice", p.name));
    std::size_t n = 1;
    for (std::size_t d : p.shape) {
      if (d != 0 && n > std::numeric_limits<std::size_t>::max() / 4 / d)
        throw invalid_argument(fmt::format("parameter '{}' is too large", p.name));
      n *= d;
    }
    if (!open_) layers_.push_back({p.name, static_cast<int>(params_.size()), 0, {}});
    params_.push_back(std::move(p));
    ++layers_.back().param_count;
    return static_cast<int>(params_.size()) - 1;
  }

  /// Declares that the open layer also uses parameter `id`, registered in an earlier layer: a
  /// tied weight (a token embedding reused as the output head). It stays one parameter, with one
  /// place in the flat buffer, one shard, one optimizer state and one checkpoint entry; gathering
  /// this layer makes it present as well, and the trainer hands over one gradient per use.
  void share(int id) {
    if (id < 0 || static_cast<std::size_t>(id) >= params_.size())
      throw invalid_argument(
          fmt::format("share: parameter id {} of {} registered", id, params_.size()));
    const std::string& name = params_[static_cast<std::size_t>(id)].name;
    if (!open_)
      throw invalid_argument(
          fmt::format("share({}): no open layer; call add_layer() before share()", name));
    layer& l = layers_.back();
    if (id >= l.first_param)
      throw invalid_argument(
          fmt::format("share({}): the parameter belongs to layer '{}' itself", name, l.name));
    if (std::find(l.shared.begin(), l.shared.end(), id) != l.shared.end())
      throw invalid_argument(
          fmt::format("share({}): already shared into layer '{}'", name, l.name));
    l.shared.push_back(id);
  }

  [[nodiscard]] const std::vector<param_spec>& params() const noexcept { return params_; }
  [[nodiscard]] const std::vector<layer>& layers() const noexcept { return layers_; }

 private:
  static void check_name(std::string_view name) {
    if (name.empty()) throw invalid_argument("a parameter needs a name");
    for (char c : name)
      if (static_cast<unsigned char>(c) <= ' ' || c == '"' || c == '\\' || c == 0x7f)
        throw invalid_argument(fmt::format(
            "parameter name '{}' contains whitespace, a quote, a backslash or a control character",
            name));
  }

  std::vector<param_spec> params_;
  std::vector<layer> layers_;
  bool open_ = false;
};

[[nodiscard]] constexpr std::size_t numel_of(const std::vector<std::size_t>& shape) noexcept {
  std::size_t n = 1;
  for (std::size_t d : shape) n *= d;
  return n;
}

[[nodiscard]] constexpr std::size_t round_up(std::size_t x, std::size_t m) noexcept {
  return m == 0 ? x : (x + m - 1) / m * m;
}

struct param_info {
  std::string name;
  std::vector<std::size_t> shape;
  dtype type = dtype::float32;
  bool weight_decay = true;
  int group = 0;
  std::size_t numel = 0;
  std::size_t offset = 0;  ///< first element in the flat buffer
  int layer = 0;
  int bucket = 0;
  int uses = 1;  ///< its own layer plus every layer that share()s it: gradients per micro-batch
};

struct layer_info {
  std::string name;
  int first_param = 0;
  int param_count = 0;
  int bucket = 0;
  std::vector<int> shared;          ///< parameters of earlier layers it also uses
  std::vector<int> shared_buckets;  ///< their buckets other than `bucket`, ascending, once each
};

struct bucket_info {
  std::size_t offset = 0;        ///< first element in the flat buffer
  std::size_t used = 0;          ///< elements up to the end of the last parameter's alignment
  std::size_t padded = 0;        ///< a multiple of world_size * alignment
  std::size_t slice = 0;         ///< padded / world_size: what each rank owns
  std::size_t shard_offset = 0;  ///< where this bucket's slice starts in every rank's shard
  int first_layer = 0;
  int layer_count = 0;
  int first_param = 0;
  int param_count = 0;
};

/// A run of one parameter's elements inside one rank's slice of one bucket.
struct segment {
  int param = 0;
  std::size_t begin = 0;  ///< first element within the parameter
  std::size_t count = 0;
  std::size_t shard_offset = 0;  ///< position in the owning rank's shard
  std::size_t flat_offset = 0;   ///< position in the flat buffer
};

class partition_plan {
 public:
  partition_plan() = default;

  /// bucket_elements = 0 puts everything in one bucket. alignment is in elements (16 elements
  /// = 64 bytes of fp32); it must be a power of two.
  partition_plan(const model_layout& layout, int world_size, std::size_t bucket_elements,
                 std::size_t alignment = 16)
      : world_(world_size), alignment_(alignment), bucket_elements_(bucket_elements) {
    if (world_size < 1)
      throw invalid_argument(fmt::format("partition plan: world size {} < 1", world_size));
    if (alignment == 0 || (alignment & (alignment - 1)) != 0)
      throw invalid_argument(
          fmt::format("partition plan: alignment {} is not a power of two", alignment));
    if (layout.params().empty()) throw invalid_argument("partition plan: no parameters");
    const std::size_t unit = static_cast<std::size_t>(world_size) * alignment;

    std::size_t bucket_start = 0;  // flat offset of the open bucket
    std::size_t used = 0;          // elements placed in it
    auto close_bucket = [&] {
      bucket_info& b = buckets_.back();
      b.used = used;
      b.padded = round_up(used, unit);
      b.slice = b.padded / static_cast<std::size_t>(world_size);
      b.shard_offset = shard_size_;
      shard_size_ += b.slice;
      bucket_start += b.padded;
      used = 0;
    };

    const auto& specs = layout.params();
    for (std::size_t li = 0; li < layout.layers().size(); ++li) {
      const auto& l = layout.layers()[li];
      std::size_t layer_size = 0;
      for (int p = l.first_param; p < l.first_param + l.param_count; ++p)
        layer_size += round_up(numel_of(specs[static_cast<std::size_t>(p)].shape), alignment);
      const bool full = !buckets_.empty() && buckets_.back().layer_count > 0 &&
                        bucket_elements != 0 && used + layer_size > bucket_elements;
      if (buckets_.empty() || full) {
        if (!buckets_.empty()) close_bucket();
        bucket_info b;
        b.offset = bucket_start;
        b.first_layer = static_cast<int>(li);
        b.first_param = l.first_param;
        buckets_.push_back(b);
      }
      bucket_info& b = buckets_.back();
      ++b.layer_count;
      b.param_count += l.param_count;
      const int bucket = static_cast<int>(buckets_.size()) - 1;
      layers_.push_back({l.name, l.first_param, l.param_count, bucket, l.shared, {}});
      for (int p : l.shared) {
        const param_info& shared = params_[static_cast<std::size_t>(p)];
        auto& sb = layers_.back().shared_buckets;
        if (shared.bucket != bucket && std::find(sb.begin(), sb.end(), shared.bucket) == sb.end())
          sb.insert(std::upper_bound(sb.begin(), sb.end(), shared.bucket), shared.bucket);
        ++params_[static_cast<std::size_t>(p)].uses;
      }
      for (int p = l.first_param; p < l.first_param + l.param_count; ++p) {
        const auto& s = specs[static_cast<std::size_t>(p)];
        param_info info{s.name,
                        s.shape,
                        s.type,
                        s.weight_decay,
                        s.group,
                        numel_of(s.shape),
                        bucket_start + used,
                        static_cast<int>(li),
                        bucket,
                        1};
        used += round_up(info.numel, alignment);
        numel_ += info.numel;
        params_.push_back(std::move(info));
      }
    }
    close_bucket();
    padded_size_ = bucket_start;
  }

  [[nodiscard]] int world_size() const noexcept { return world_; }
  [[nodiscard]] std::size_t alignment() const noexcept { return alignment_; }
  [[nodiscard]] std::size_t bucket_elements() const noexcept { return bucket_elements_; }
  [[nodiscard]] const std::vector<param_info>& params() const noexcept { return params_; }
  [[nodiscard]] const std::vector<layer_info>& layers() const noexcept { return layers_; }
  [[nodiscard]] const std::vector<bucket_info>& buckets() const noexcept { return buckets_; }
  /// Real elements: the sum of every parameter's size.
  [[nodiscard]] std::size_t numel() const noexcept { return numel_; }
  /// Elements of the flat buffer, padding included: world_size() * shard_size().
  [[nodiscard]] std::size_t padded_size() const noexcept { return padded_size_; }
  /// Elements each rank owns.
  [[nodiscard]] std::size_t shard_size() const noexcept { return shard_size_; }
  /// The largest bucket, padding included.
  [[nodiscard]] std::size_t max_bucket() const noexcept {
    std::size_t m = 0;
    for (const auto& b : buckets_) m = std::max(m, b.padded);
    return m;
  }

  /// Index of the parameter called `name`, or -1.
  [[nodiscard]] int find(std::string_view name) const noexcept {
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (params_[i].name == name) return static_cast<int>(i);
    return -1;
  }

  /// The rank that owns flat element `flat` and its position in that rank's shard.
  [[nodiscard]] std::pair<int, std::size_t> owner(std::size_t flat) const {
    for (const auto& b : buckets_)
      if (flat >= b.offset && flat < b.offset + b.padded) {
        const std::size_t rel = flat - b.offset;
        return {static_cast<int>(rel / b.slice), b.shard_offset + rel % b.slice};
      }
    throw invalid_argument(
        fmt::format("flat element {} is beyond the plan's {} elements", flat, padded_size_));
  }

  /// The parameter elements rank `rank` owns, in shard order; padding is not listed.
  [[nodiscard]] std::vector<segment> segments(int rank) const {
    std::vector<segment> out;
    for (const auto& b : buckets_) {
      const std::size_t lo = b.offset + static_cast<std::size_t>(rank) * b.slice;
      const std::size_t hi = lo + b.slice;
      for (int p = b.first_param; p < b.first_param + b.param_count; ++p) {
        const auto& pi = params_[static_cast<std::size_t>(p)];
        const std::size_t a = std::max(lo, pi.offset);
        const std::size_t e = std::min(hi, pi.offset + pi.numel);
        if (a >= e) continue;
        out.push_back({p, a - pi.offset, e - a, b.shard_offset + (a - lo), a});
      }
    }
    return out;
  }

  /// Every rank's segments, rank by rank: what a stage-0 rank, which updates everything, walks.
  [[nodiscard]] std::vector<segment> all_segments() const {
    std::vector<segment> out;
    for (int r = 0; r < world_; ++r)
      for (const auto& s : segments(r)) out.push_back(s);
    return out;
  }

  /// The parameters of a padded flat buffer (padded_size() elements, as laid out by this plan)
  /// concatenated in registration order without padding: numel() elements.
  template <class T>
  [[nodiscard]] std::vector<T> unpadded(const std::vector<T>& flat) const {
    if (flat.size() != padded_size_)
      throw invalid_argument(
          fmt::format("unpadded: {} elements, the plan has {} padded", flat.size(), padded_size_));
    std::vector<T> out;
    out.reserve(numel_);
    for (const auto& p : params_)
      out.insert(out.end(), flat.begin() + static_cast<std::ptrdiff_t>(p.offset),
                 flat.begin() + static_cast<std::ptrdiff_t>(p.offset + p.numel));
    return out;
  }

  /// A human-readable description: totals, the buckets, and what each rank owns.
  [[nodiscard]] std::string to_string() const {
    std::string s;
    auto out = std::back_inserter(s);
    const double pad_pct =
        numel_ ? 100.0 * static_cast<double>(padded_size_ - numel_) / static_cast<double>(numel_)
               : 0.0;
    fmt::format_to(out,
                   "partition plan: {} parameters in {} layers, {} elements ({} padded, +{:.2f}%), "
                   "{} ranks x {} elements, alignment {} elements, {} bucket(s)\n",
                   params_.size(), layers_.size(), numel_, padded_size_, pad_pct, world_,
                   shard_size_, alignment_, buckets_.size());
    for (std::size_t bi = 0; bi < buckets_.size(); ++bi) {
      const auto& b = buckets_[bi];
      fmt::format_to(out, "  bucket {}: flat [{}, {}), {} used, {} x {} per rank, layers", bi,
                     b.offset, b.offset + b.padded, b.used, world_, b.slice);
      for (int l = b.first_layer; l < b.first_layer + b.layer_count; ++l)
        fmt::format_to(out, " {}", layers_[static_cast<std::size_t>(l)].name);
      s += '\n';
    }
    for (int r = 0; r < world_; ++r) {
      fmt::format_to(out, "  rank {}:", r);
      for (const auto& g : segments(r)) {
        const auto& p = params_[static_cast<std::size_t>(g.param)];
        if (g.count == p.numel)
          fmt::format_to(out, " {}", p.name);
        else
          fmt::format_to(out, " {}[{}:{}]", p.name, g.begin, g.begin + g.count);
      }
      s += '\n';
    }
    return s;
  }

 private:
  int world_ = 1;
  std::size_t alignment_ = 16;
  std::size_t bucket_elements_ = 0;
  std::vector<param_info> params_;
  std::vector<layer_info> layers_;
  std::vector<bucket_info> buckets_;
  std::size_t numel_ = 0;
  std::size_t padded_size_ = 0;
  std::size_t shard_size_ = 0;
};

}  // namespace ringzero::zero

template <>
struct fmt::formatter<ringzero::zero::partition_plan> : fmt::formatter<std::string_view> {
  template <class Ctx>
  auto format(const ringzero::zero::partition_plan& p, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(p.to_string(), ctx);
  }
};
