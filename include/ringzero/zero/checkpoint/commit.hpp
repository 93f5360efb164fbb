// Saving and loading as collectives. A save writes every rank's shard to a unique temporary name,
// fsyncs and renames it; the ranks agree that every shard is durable; rank 0 then renames the
// manifest into place (commit_manifest) and removes what no manifest refers to any more. So a
// directory holds either the previous checkpoint or the new one, whatever fails when. Every rank
// learns the lowest failing rank's message and raises the same error, and a failed save takes
// its finished shard with it. A load reads and checks on every rank, and agrees before any rank
// uses what it read.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "ringzero/collectives.hpp"
#include "ringzero/error.hpp"
#include "ringzero/zero/checkpoint/manifest.hpp"
#include "ringzero/zero/checkpoint/reshard.hpp"
#include "ringzero/zero/checkpoint/shard_file.hpp"
#include "ringzero/zero/detail/file.hpp"
#include "ringzero/zero/options.hpp"
#include "ringzero/zero/plan.hpp"

namespace ringzero::zero {

namespace detail {

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

}  // namespace ringzero::zero
