// Sharded checkpoints.
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

#include <algorithm>
#include <bit>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "ringzero/collectives.hpp"
#include "ringzero/error.hpp"
#include "ringzero/types.hpp"
#include "ringzero/zero/detail/crc32c.hpp"
#include "ringzero/zero/detail/file.hpp"
#include "ringzero/zero/options.hpp"
#include "ringzero/zero/plan.hpp"

namespace ringzero::zero {

static_assert(std::endian::native == std::endian::little,
              "checkpoint files are little-endian; a big-endian host needs byte swapping");

inline constexpr const char* manifest_file_name = "manifest.txt";
/// 2 added the parameter groups' learning rates; version 1 checkpoints still load.
inline constexpr int checkpoint_format_version = 2;

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

/// Writes the manifest (after every shard is durable) and then removes shard files that no
/// manifest refers to any more (the previous checkpoint's) and temporaries of interrupted saves.
/// Every rank's writes of this save are complete by then, so no temporary here is in use.
inline void commit_manifest(const std::filesystem::path& dir, const checkpoint_manifest& m) {
  const std::string text = m.serialize();
  write_file_atomic(dir / manifest_file_name, {std::as_bytes(std::span(text))});
  std::set<std::string> keep;
  for (const auto& sh : m.shards) keep.insert(sh.file);
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const bool ours = name.starts_with("shard-") || name.starts_with(manifest_file_name);
    const bool temporary = name.find(temporary_marker) != std::string::npos;
    if (ours && (temporary || (name.ends_with(".bin") && !keep.contains(name))))
      std::filesystem::remove(e.path(), ec);
  }
}

/// Removes this rank's shard file of a save that failed, unless the manifest in place lists it
/// (a commit that renamed the manifest and then failed to sync the directory still refers to
/// it). Without this, a save that fails because the disk is full leaves every finished shard
/// under its final name, and the disk stays full until a later save succeeds.
inline void discard_failed_shard(const std::filesystem::path& dir,
                                 const std::string& file) noexcept {
  if (file.empty()) return;
  try {
    const checkpoint_manifest live = checkpoint_manifest::read(dir);
    for (const auto& sh : live.shards)
      if (sh.file == file) return;
  } catch (const std::exception&) {
    // No manifest, or one that cannot be read: nothing in place refers to the file.
  }
  std::error_code ec;
  std::filesystem::remove(dir / file, ec);
}

}  // namespace detail

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
  if (kind == optimizer_kind::adamw) {
    m.arrays.emplace_back("exp_avg");
    m.arrays.emplace_back("exp_avg_sq");
  } else {
    m.arrays.emplace_back("momentum");
  }
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

namespace detail {

/// Collective over `comm`: every rank learns the lowest failing rank's message (truncated; ""
/// when no rank failed), so all raise the same error instead of one raising and the others
/// waiting in the next collective. `gather` is the all_gather's collective_options.
template <class Comm, class Options>
[[nodiscard]] std::string agree_on_failure(Comm& comm, const std::string& mine,
                                           const Options& gather) {
  constexpr std::size_t width = 512;
  constexpr std::string_view prefix = "ringzero: ";
  std::string_view msg = mine;
  if (msg.starts_with(prefix)) msg.remove_prefix(prefix.size());
  std::vector<std::uint8_t> block(width, 0);
  std::vector<std::uint8_t> all(width * static_cast<std::size_t>(comm.size()));
  if (!mine.empty()) {
    block[0] = 1;
    std::memcpy(block.data() + 1, msg.data(), std::min(msg.size(), width - 1));
  }
  ringzero::all_gather(comm, std::span<const std::uint8_t>(block), std::span<std::uint8_t>(all),
                       gather);
  for (int r = 0; r < comm.size(); ++r) {
    const auto* b = all.data() + static_cast<std::size_t>(r) * width;
    if (b[0] == 0) continue;
    const auto* text = reinterpret_cast<const char*>(b + 1);
    std::string out(text, std::find(text, text + width - 1, '\0'));
    if (r != comm.rank()) out += fmt::format(" (reported by rank {})", r);
    return out;
  }
  return {};
}

}  // namespace detail

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
  const std::size_t arrays = kind == optimizer_kind::adamw ? 3 : 2;
  if (m.optimizer != kind || m.arrays.size() != arrays)
    throw checkpoint_error(fmt::format("checkpoint {} holds {} state, this run uses {}",
                                       dir.string(), optimizer_name(m.optimizer),
                                       optimizer_name(kind)));
}

/// Reads parameter elements out of a checkpoint, whatever layout saved them.
namespace detail {

/// Whether `data`, read from rank `rank`'s shard file, is that shard of the checkpoint `m`
/// describes: its header, and a size of exactly the header plus every array. The manifest's
/// sizes come from a file too, so the expected size is computed without overflow.
[[nodiscard]] inline bool shard_matches(std::span<const std::byte> data,
                                        const checkpoint_manifest& m, int rank) noexcept {
  std::size_t elements = 0;
  std::size_t want = 0;
  if (__builtin_mul_overflow(m.arrays.size(), m.shard_size, &elements) ||
      __builtin_mul_overflow(elements, sizeof(float), &want) ||
      __builtin_add_overflow(want, shard_header_bytes, &want) || data.size() != want)
    return false;
  shard_header h{};
  std::memcpy(&h, data.data(), sizeof h);
  return std::memcmp(h.magic, shard_magic, sizeof h.magic) == 0 &&
         h.rank == static_cast<std::uint32_t>(rank) &&
         h.world == static_cast<std::uint32_t>(m.world_size) && h.shard_size == m.shard_size &&
         h.arrays == m.arrays.size() && h.step == m.step;
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

namespace detail {

/// Collective, through `run` (run(f) calls f(comm) in line with the caller's other
/// collectives): raises checkpoint_error on every rank if any rank's `mine` is not empty.
template <class Run, class Options>
void raise_if_any_failed(Run& run, const Options& gather, const std::string& mine) {
  const std::string f = run([&](auto& c) { return agree_on_failure(c, mine, gather); });
  if (!f.empty()) throw checkpoint_error(f);
}

}  // namespace detail

/// The collective steps of a save, on one rank: writes the shard arrays `shard_arrays()` returns
/// (master weights, then the moments, each plan.shard_size() long) into `dir`, reports the bytes
/// to `on_written`, shares every rank's (bytes, crc, save id), and has rank 0 commit the manifest
/// `manifest_for(records)` builds. `run(f)` calls f(comm) in line with the caller's other
/// collectives; `gather` is the all_gather's options. Raises checkpoint_error on every rank if
/// any rank fails; the manifest is written last, so the checkpoint `dir` held stays loadable.
template <class Run, class Options, class Arrays, class Manifest, class OnWritten>
void save_checkpoint(Run&& run, const Options& gather, const std::filesystem::path& dir,
                     const partition_plan& plan, int rank, std::uint64_t step,
                     Arrays&& shard_arrays, Manifest&& manifest_for, OnWritten&& on_written) {
  std::string failure;
  detail::written_file written;
  const std::uint64_t save_id = detail::unique_id();
  std::string mine_file;  // this rank's shard, once it is on disk under its final name
  // Every rank's verdict; a failed save takes this rank's finished shard with it.
  const auto agree = [&] {
    try {
      detail::raise_if_any_failed(run, gather, failure);
    } catch (const checkpoint_error&) {
      detail::discard_failed_shard(dir, mine_file);
      throw;
    }
  };
  try {
    detail::create_directories_durable(dir);
    written = detail::write_shard(dir, rank, plan.world_size(), step, save_id, shard_arrays(),
                                  plan.shard_size());
    mine_file = detail::shard_file_name(rank, plan.world_size(), step, save_id);
    on_written(written.bytes);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  agree();
  const std::uint64_t mine[3] = {written.bytes, written.crc, save_id};
  std::vector<std::uint64_t> all(3 * static_cast<std::size_t>(plan.world_size()));
  run([&](auto& c) {
    ringzero::all_gather(c, std::span<const std::uint64_t>(mine), std::span<std::uint64_t>(all),
                         gather);
  });
  if (rank == 0) {
    try {
      detail::commit_manifest(dir, manifest_for(all));
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  // Also the barrier that keeps a fast rank's next save from racing rank 0's cleanup.
  agree();
}

/// The collective steps of a load, on one rank: reads the manifest in `source` (a directory, or
/// a checkpoint_image), checks that it
/// holds `plan`'s parameters and state for optimizer `kind`, and reads the pieces
/// `requests_for(manifest)` asks for. Raises checkpoint_error on every rank if any rank fails,
/// before any rank uses what it read. `run` and `gather` as for save_checkpoint.
template <class Run, class Options, class Source, class Requests>
[[nodiscard]] checkpoint_manifest read_checkpoint(Run&& run, const Options& gather,
                                                  const Source& source, const partition_plan& plan,
                                                  optimizer_kind kind, Requests&& requests_for) {
  std::string failure;
  checkpoint_manifest m;
  try {
    const checkpoint_reader reader(source);
    m = reader.manifest();
    check_compatible(m, plan, kind, reader.directory());
    reader.read(requests_for(m));
  } catch (const std::exception& e) {
    failure = e.what();
  }
  detail::raise_if_any_failed(run, gather, failure);
  return m;
}

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
