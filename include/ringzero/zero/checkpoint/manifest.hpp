// A checkpoint's manifest: the parameters (names, shapes, types, where each lives in the flat
// buffer), the buckets, the world size, stage, step and optimizer, the arrays every shard holds,
// and the name, size and CRC-32C of every shard file; it ends with its own CRC-32C. Parsing checks
// every count, size and offset before anything is sized by it, and names the file and the line.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "ringzero/error.hpp"
#include "ringzero/types.hpp"
#include "ringzero/zero/checkpoint/shard_file.hpp"
#include "ringzero/zero/detail/crc32c.hpp"
#include "ringzero/zero/detail/file.hpp"
#include "ringzero/zero/options.hpp"
#include "ringzero/zero/plan.hpp"

namespace ringzero::zero {

inline constexpr const char* manifest_file_name = "manifest.txt";

namespace detail {

/// Reads the manifest's line-oriented text, naming the file and line in every error.
class line_reader {
 public:
  line_reader(std::string_view text, const std::string& where) : text_(text), where_(where) {}

  void expect(std::string_view key) {
    next_line();
    const auto w = word();
    if (w != key) throw error(fmt::format("expected '{}', found '{}'", key, w));
  }
  [[nodiscard]] std::string word() {
    skip_spaces();
    const std::size_t b = pos_;
    while (pos_ < line_.size() && line_[pos_] != ' ') ++pos_;
    if (b == pos_) throw error("missing field");
    return std::string(line_.substr(b, pos_ - b));
  }
  [[nodiscard]] std::uint64_t integer() {
    const auto w = word();
    std::uint64_t v = 0;
    const auto [p, ec] = std::from_chars(w.data(), w.data() + w.size(), v);
    if (ec != std::errc{} || p != w.data() + w.size())
      throw error(fmt::format("'{}' is not a non-negative integer", w));
    return v;
  }
  [[nodiscard]] std::uint32_t hex32() {
    const auto w = word();
    std::uint32_t v = 0;
    const auto [p, ec] = std::from_chars(w.data(), w.data() + w.size(), v, 16);
    if (ec != std::errc{} || p != w.data() + w.size())
      throw error(fmt::format("'{}' is not a hexadecimal checksum", w));
    return v;
  }
  [[nodiscard]] float real() {
    const auto w = word();
    float v = 0;
    const auto [p, ec] = std::from_chars(w.data(), w.data() + w.size(), v);
    if (ec != std::errc{} || p != w.data() + w.size())
      throw error(fmt::format("'{}' is not a number", w));
    return v;
  }
  [[nodiscard]] dtype type() {
    return call([](std::string_view s) { return parse_dtype(s); });
  }
  template <class F>
  [[nodiscard]] std::invoke_result_t<F&, std::string_view> call(F f) {
    const auto w = word();
    try {
      return f(w);
    } catch (const ringzero::error& e) {
      throw error(e.what());
    }
  }
  [[nodiscard]] bool at_line_end() {
    skip_spaces();
    return pos_ >= line_.size();
  }
  void expect_end() {
    if (!at_line_end()) throw error("unexpected trailing fields");
    if (next_ < text_.size()) throw error("unexpected lines after the shard list");
  }

 private:
  void next_line() {
    if (!line_.empty() && !at_line_end()) throw error("unexpected trailing fields");
    if (next_ >= text_.size()) throw error("unexpected end of file");
    const auto e = text_.find('\n', next_);
    const auto end = e == std::string_view::npos ? text_.size() : e;
    line_ = text_.substr(next_, end - next_);
    next_ = end + 1;
    pos_ = 0;
    ++line_no_;
  }
  void skip_spaces() {
    while (pos_ < line_.size() && line_[pos_] == ' ') ++pos_;
  }
  [[nodiscard]] checkpoint_error error(const std::string& why) const {
    return checkpoint_error(fmt::format("{}: line {}: {}", where_, line_no_, why));
  }

  std::string_view text_;
  const std::string& where_;
  std::string_view line_;
  std::size_t next_ = 0;
  std::size_t pos_ = 0;
  int line_no_ = 0;
};

}  // namespace detail

struct checkpoint_manifest {
  struct bucket {
    std::size_t offset = 0;
    std::size_t padded = 0;
    std::size_t shard_offset = 0;
  };
  struct param {
    std::string name;
    dtype type = dtype::float32;
    bool weight_decay = true;
    std::size_t offset = 0;
    int bucket = 0;
    std::vector<std::size_t> shape;
    [[nodiscard]] std::size_t numel() const noexcept { return numel_of(shape); }
  };
  /// A parameter group's base learning rate when saved (the schedule's position is `step`).
  struct group {
    std::string name;
    float lr = 0.0f;
  };
  struct shard {
    int rank = 0;
    std::string file;
    std::uint64_t bytes = 0;
    std::uint32_t crc = 0;
  };

  int world_size = 1;
  int stage = 0;
  dtype precision = dtype::float32;
  std::uint64_t step = 0;
  std::uint64_t optimizer_steps = 0;  ///< steps that updated the weights (Adam's t)
  optimizer_kind optimizer = optimizer_kind::adamw;
  float loss_scale = 1.0f;
  std::uint64_t good_steps = 0;
  std::size_t alignment = 16;
  std::size_t shard_size = 0;
  std::vector<std::string> arrays;  ///< what each shard file holds, in order
  std::vector<group> groups;
  std::vector<bucket> buckets;
  std::vector<param> params;
  std::vector<shard> shards;

  /// The manifest's text, ending with a line holding the CRC-32C of everything before it.
  [[nodiscard]] std::string serialize() const {
    std::string s;
    auto out = std::back_inserter(s);
    fmt::format_to(out, "ringzero-zero-checkpoint {}\n", checkpoint_format_version);
    fmt::format_to(out, "world_size {}\nstage {}\nprecision {}\nstep {}\noptimizer_steps {}\n",
                   world_size, stage, dtype_name(precision), step, optimizer_steps);
    fmt::format_to(out, "optimizer {}\nloss_scale {} {}\nalignment {}\nshard_size {}\narrays",
                   optimizer_name(optimizer), loss_scale, good_steps, alignment, shard_size);
    for (const auto& a : arrays) fmt::format_to(out, " {}", a);
    fmt::format_to(out, "\ngroups {}\n", groups.size());
    for (const auto& g : groups) fmt::format_to(out, "group {} {}\n", g.name, g.lr);
    fmt::format_to(out, "buckets {}\n", buckets.size());
    for (const auto& b : buckets)
      fmt::format_to(out, "bucket {} {} {}\n", b.offset, b.padded, b.shard_offset);
    fmt::format_to(out, "params {}\n", params.size());
    for (const auto& p : params) {
      fmt::format_to(out, "param {} {} {} {} {} {}", p.name, dtype_name(p.type),
                     p.weight_decay ? 1 : 0, p.offset, p.bucket, p.shape.size());
      for (auto d : p.shape) fmt::format_to(out, " {}", d);
      s += '\n';
    }
    fmt::format_to(out, "shards {}\n", shards.size());
    for (const auto& sh : shards)
      fmt::format_to(out, "shard {} {} {} {:08x}\n", sh.rank, sh.file, sh.bytes, sh.crc);
    fmt::format_to(out, "crc32c {:08x}\n", detail::crc32c(std::as_bytes(std::span(s))));
    return s;
  }

  /// Parses and checks a manifest; `where` names it in errors.
  [[nodiscard]] static checkpoint_manifest parse(std::string_view text, const std::string& where) {
    const auto tail = text.rfind("crc32c ");
    if (tail == std::string_view::npos || (tail != 0 && text[tail - 1] != '\n'))
      throw checkpoint_error(fmt::format("{}: no checksum line (truncated manifest?)", where));
    const std::uint32_t computed = detail::crc32c(std::as_bytes(std::span(text.substr(0, tail))));
    detail::line_reader in(text.substr(0, tail), where);
    {
      detail::line_reader tl(text.substr(tail), where);
      tl.expect("crc32c");
      const auto stored = tl.hex32();
      if (stored != computed)
        throw checkpoint_error(fmt::format("{} is corrupt: crc32c {:08x}, the file says {:08x}",
                                           where, computed, stored));
    }
    // A count read from the file sizes a vector: each entry takes at least one byte of text, so
    // a count larger than the text is a corrupt file, not a reason to allocate.
    const auto count = [&](std::string_view what) {
      const auto n = in.integer();
      if (n > text.size())
        throw checkpoint_error(
            fmt::format("{}: {} {} in a {}-byte file", where, n, what, text.size()));
      return static_cast<std::size_t>(n);
    };
    checkpoint_manifest m;
    in.expect("ringzero-zero-checkpoint");
    const auto version = in.integer();
    if (version < 1 || version > checkpoint_format_version)
      throw checkpoint_error(fmt::format("{}: format version {} (this build reads 1 to {})", where,
                                         version, checkpoint_format_version));
    in.expect("world_size");
    m.world_size = static_cast<int>(in.integer());
    in.expect("stage");
    m.stage = static_cast<int>(in.integer());
    in.expect("precision");
    m.precision = in.type();
    in.expect("step");
    m.step = in.integer();
    in.expect("optimizer_steps");
    m.optimizer_steps = in.integer();
    in.expect("optimizer");
    m.optimizer = in.call([](std::string_view s) { return parse_optimizer(s); });
    in.expect("loss_scale");
    m.loss_scale = in.real();
    m.good_steps = in.integer();
    in.expect("alignment");
    m.alignment = in.integer();
    in.expect("shard_size");
    m.shard_size = in.integer();
    in.expect("arrays");
    while (!in.at_line_end()) m.arrays.emplace_back(in.word());
    if (version >= 2) {
      in.expect("groups");
      m.groups.resize(count("groups"));
      for (auto& g : m.groups) {
        in.expect("group");
        g.name = in.word();
        g.lr = in.real();
      }
    }
    in.expect("buckets");
    m.buckets.resize(count("buckets"));
    for (auto& b : m.buckets) {
      in.expect("bucket");
      b.offset = in.integer();
      b.padded = in.integer();
      b.shard_offset = in.integer();
    }
    in.expect("params");
    m.params.resize(count("params"));
    for (auto& p : m.params) {
      in.expect("param");
      p.name = in.word();
      p.type = in.type();
      p.weight_decay = in.integer() != 0;
      p.offset = in.integer();
      p.bucket = static_cast<int>(in.integer());
      p.shape.resize(count("dimensions"));
      for (auto& d : p.shape) d = in.integer();
    }
    in.expect("shards");
    m.shards.resize(count("shards"));
    for (auto& sh : m.shards) {
      in.expect("shard");
      sh.rank = static_cast<int>(in.integer());
      sh.file = in.word();
      sh.bytes = in.integer();
      sh.crc = in.hex32();
    }
    in.expect_end();
    m.validate(where);
    return m;
  }

  [[nodiscard]] static checkpoint_manifest read(const std::filesystem::path& dir) {
    const auto path = dir / manifest_file_name;
    if (!std::filesystem::exists(path))
      throw checkpoint_error(fmt::format(
          "checkpoint {}: {} is missing (not a checkpoint, or the save did not complete)",
          dir.string(), path.string()));
    const auto bytes = detail::read_file(path);
    return parse(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                 path.string());
  }

  /// Index of the parameter called `name`, or -1.
  [[nodiscard]] int find(std::string_view name) const noexcept {
    for (std::size_t i = 0; i < params.size(); ++i)
      if (params[i].name == name) return static_cast<int>(i);
    return -1;
  }

 private:
  void validate(const std::string& where) const {
    auto bad = [&](const std::string& why) {
      return checkpoint_error(fmt::format("{}: inconsistent manifest: {}", where, why));
    };
    if (world_size < 1) throw bad("world_size < 1");
    if (static_cast<int>(shards.size()) != world_size)
      throw bad(fmt::format("{} shard entries for world size {}", shards.size(), world_size));
    if (arrays.empty()) throw bad("no arrays");
    // Every sum and product below is checked: the numbers come from a file, and a wrapped
    // one would let a parameter pass for lying inside its bucket while it does not.
    std::size_t shard_total = 0;
    for (const auto& b : buckets) {
      std::size_t end = 0;
      if (__builtin_add_overflow(b.offset, b.padded, &end)) throw bad("a bucket overflows");
      if (b.padded % static_cast<std::size_t>(world_size) != 0)
        throw bad("a bucket does not split evenly");
      if (b.shard_offset != shard_total) throw bad("bucket slices are not back to back");
      if (__builtin_add_overflow(shard_total, b.padded / static_cast<std::size_t>(world_size),
                                 &shard_total))
        throw bad("the buckets overflow");
    }
    if (shard_total != shard_size) throw bad("shard_size does not match the buckets");
    for (const auto& p : params) {
      if (p.bucket < 0 || static_cast<std::size_t>(p.bucket) >= buckets.size())
        throw bad(fmt::format("parameter {} names bucket {}", p.name, p.bucket));
      const auto& b = buckets[static_cast<std::size_t>(p.bucket)];
      std::size_t numel = 1;
      for (const std::size_t d : p.shape)
        if (__builtin_mul_overflow(numel, d, &numel))
          throw bad(fmt::format("parameter {} has too many elements", p.name));
      std::size_t end = 0;
      if (p.offset < b.offset || __builtin_add_overflow(p.offset, numel, &end) ||
          end > b.offset + b.padded)
        throw bad(fmt::format("parameter {} lies outside its bucket", p.name));
    }
    for (std::size_t r = 0; r < shards.size(); ++r) {
      const auto& sh = shards[r];
      if (sh.rank != static_cast<int>(r)) throw bad("shard entries out of order");
      if (sh.file.find('/') != std::string::npos || sh.file.starts_with("."))
        throw bad(fmt::format("shard file name '{}' is not a plain name", sh.file));
    }
  }
};

/// What a training run is at, as a checkpoint records it.
struct training_position {
  std::uint64_t step = 0;             ///< steps taken, skipped ones included
  std::uint64_t optimizer_steps = 0;  ///< steps that updated the weights (Adam's t)
  float loss_scale = 1.0f;
  std::uint64_t good_steps = 0;
};

/// The manifest of a checkpoint of `plan` saved by its world_size() ranks; `written` holds
/// (bytes, crc, save id) of every rank's shard file, rank after rank.
[[nodiscard]] inline checkpoint_manifest make_manifest(
    const partition_plan& plan, int stage, dtype precision, optimizer_kind kind,
    const training_position& at, std::vector<checkpoint_manifest::group> groups,
    std::span<const std::uint64_t> written) {
  checkpoint_manifest m;
  m.groups = std::move(groups);
  m.world_size = plan.world_size();
  m.stage = stage;
  m.precision = precision;
  m.step = at.step;
  m.optimizer_steps = at.optimizer_steps;
  m.optimizer = kind;
  m.loss_scale = at.loss_scale;
  m.good_steps = at.good_steps;
  m.alignment = plan.alignment();
  m.shard_size = plan.shard_size();
  m.arrays = {"master"};
  const optimizer_descriptor& opt = describe(kind);
  for (int i = 0; i < opt.moments; ++i)
    m.arrays.emplace_back(opt.moment_names[static_cast<std::size_t>(i)]);
  for (const auto& b : plan.buckets()) m.buckets.push_back({b.offset, b.padded, b.shard_offset});
  for (const auto& p : plan.params())
    m.params.push_back({p.name, p.type, p.weight_decay, p.offset, p.bucket, p.shape});
  for (int r = 0; r < m.world_size; ++r) {
    const auto i = 3 * static_cast<std::size_t>(r);
    m.shards.push_back({r, detail::shard_file_name(r, m.world_size, at.step, written[i + 2]),
                        written[i], static_cast<std::uint32_t>(written[i + 1])});
  }
  return m;
}

/// Each group's base learning rate under its name, as a checkpoint keeps them.
[[nodiscard]] inline std::vector<checkpoint_manifest::group> saved_groups(
    const config& cfg, const std::vector<float>& group_lr) {
  std::vector<checkpoint_manifest::group> out;
  for (std::size_t g = 0; g < group_lr.size(); ++g)
    out.push_back({group_name(cfg, g), group_lr[g]});
  return out;
}

/// Sets the base learning rate of each group of `cfg` that checkpoint `m` saved, by name; a
/// group the checkpoint does not name keeps its rate.
inline void restore_groups(const checkpoint_manifest& m, const config& cfg,
                           std::vector<float>& group_lr) {
  for (const auto& g : m.groups)
    for (std::size_t i = 0; i < group_lr.size(); ++i)
      if (group_name(cfg, i) == g.name) group_lr[i] = g.lr;
}

/// Throws checkpoint_error unless the checkpoint in `dir` holds every parameter of `plan` with
/// the same shape, and state for the optimizer `kind`.
inline void check_compatible(const checkpoint_manifest& m, const partition_plan& plan,
                             optimizer_kind kind, const std::filesystem::path& dir) {
  const auto& ps = plan.params();
  if (m.params.size() != ps.size())
    throw checkpoint_error(fmt::format("checkpoint {} holds {} parameters, this model has {}",
                                       dir.string(), m.params.size(), ps.size()));
  for (const auto& p : ps) {
    const int i = m.find(p.name);
    if (i < 0)
      throw checkpoint_error(
          fmt::format("checkpoint {} has no parameter {}", dir.string(), p.name));
    const auto& q = m.params[static_cast<std::size_t>(i)];
    if (q.shape != p.shape)
      throw checkpoint_error(
          fmt::format("checkpoint {}: parameter {} has shape [{}], the model registers [{}]",
                      dir.string(), p.name, fmt::join(q.shape, ", "), fmt::join(p.shape, ", ")));
  }
  const auto arrays = static_cast<std::size_t>(1 + describe(kind).moments);
  if (m.optimizer != kind || m.arrays.size() != arrays)
    throw checkpoint_error(fmt::format("checkpoint {} holds {} state, this run uses {}",
                                       dir.string(), optimizer_name(m.optimizer),
                                       optimizer_name(kind)));
}

}  // namespace ringzero::zero
