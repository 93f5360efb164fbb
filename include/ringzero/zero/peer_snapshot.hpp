// Training state kept in the memory of other ranks, so that losing a rank does not send the job
// back to storage (the idea of Gemini, SOSP 2023: checkpoints in peers' CPU memory).
//
//   auto snap = shd.snapshot();                          // this rank's shard, in memory
//   shd.run_collective([&](auto& c) { zero::keep_with_peer(c, snap); });
//   ...                                                  // a rank dies; a new world forms
//   if (zero::gather_snapshot(new_comm, snap)) new_shd.load(snap);   // else: the disk
//
// keep_with_peer sends each rank's shard to the next rank of a ring and keeps the previous
// rank's: two shards per rank, so the memory it costs is twice a rank's share of the optimizer
// state (master weights and moments) — checkpoint_image::bytes() says how much. Any one loss,
// and any losses of ranks not next to each other in the ring, leave every shard somewhere.
// gather_snapshot, over the survivors' new communicator, finds who holds each shard of the
// newest complete snapshot and hands every survivor the whole of it (every rank then holds the
// full state once, transiently, while load() reads its new layout from it); it returns false on
// every rank alike when the survivors' copies do not cover one snapshot, and the caller falls
// back to a checkpoint on disk.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "ringzero/collectives.hpp"
#include "ringzero/error.hpp"
#include "ringzero/zero/checkpoint.hpp"
#include "ringzero/zero/detail/crc32c.hpp"

namespace ringzero::zero {

namespace detail {

[[nodiscard]] inline std::span<const std::uint8_t> as_u8(std::span<const std::byte> b) {
  return {reinterpret_cast<const std::uint8_t*>(b.data()), b.size()};
}
[[nodiscard]] inline std::span<std::uint8_t> as_u8(std::span<std::byte> b) {
  return {reinterpret_cast<std::uint8_t*>(b.data()), b.size()};
}

// Sends `out` to `to` and receives into `in` (sized by the sender's length, sent first) from
// `from`, over comm.
template <class Comm>
std::vector<std::byte> swap_bytes(Comm& comm, std::span<const std::byte> out, int to, int from) {
  std::uint64_t out_len = out.size(), in_len = 0;
  ringzero::send_recv(comm, std::span<const std::uint64_t>(&out_len, 1), to,
                      std::span<std::uint64_t>(&in_len, 1), from);
  std::vector<std::byte> in(in_len);
  ringzero::send_recv(comm, as_u8(out), to, as_u8(std::span<std::byte>(in)), from);
  return in;
}

template <class Comm>
std::vector<std::byte> broadcast_bytes(Comm& comm, std::vector<std::byte> mine, int root) {
  std::uint64_t len = mine.size();
  ringzero::broadcast(comm, std::span<std::uint64_t>(&len, 1), root);
  mine.resize(len);
  if (len > 0) ringzero::broadcast(comm, as_u8(std::span<std::byte>(mine)), root);
  return mine;
}

}  // namespace detail

/// Collective over `comm` (every rank that took the snapshot, in any order the caller likes, as
/// long as all pass the same communicator): sends this rank's shard in `image` to rank
/// (rank + 1) % size and adds the shard of rank (rank - 1 + size) % size to `image`. A world of
/// one keeps only its own.
template <class Comm>
void keep_with_peer(Comm& comm, checkpoint_image& image) {
  if (image.files.size() != 1)
    throw invalid_argument(fmt::format(
        "keep_with_peer: the image holds {} shards; pass a fresh snapshot()", image.files.size()));
  const int n = comm.size();
  if (n == 1) return;
  const int r = comm.rank();
  const auto& [name, own] = *image.files.begin();
  const std::string own_name = name;
  const auto name_bytes = std::as_bytes(std::span(own_name));
  std::vector<std::byte> peer_name =
      detail::swap_bytes(comm, name_bytes, (r + 1) % n, (r - 1 + n) % n);
  std::vector<std::byte> peer = detail::swap_bytes(comm, own, (r + 1) % n, (r - 1 + n) % n);
  image.files.emplace(
      std::string(reinterpret_cast<const char*>(peer_name.data()), peer_name.size()),
      std::move(peer));
}

/// Collective over the survivors' communicator: true, on every rank, if the images the ranks
/// hold cover every shard of one snapshot (the newest such), and then `image` on every rank holds
/// all of it, ready for sharder::load(image). False, on every rank, otherwise (`image` is left as
/// it was). An empty image (a rank that arrived) takes part and holds nothing.
template <class Comm>
[[nodiscard]] bool gather_snapshot(Comm& comm, checkpoint_image& image) {
  const int n = comm.size();
  // Round 1: which snapshot each rank holds.
  std::uint64_t mine[3] = {0, 0, 0};  // held, step, manifest crc
  checkpoint_manifest m;
  if (!image.empty()) {
    try {
      m = checkpoint_manifest::parse(image.manifest, "(in-memory snapshot)");
      mine[0] = 1;
      mine[1] = m.step;
      mine[2] = detail::crc32c(std::as_bytes(std::span(image.manifest)));
    } catch (const checkpoint_error&) {
      // A corrupt image counts as none.
    }
  }
  std::vector<std::uint64_t> all(3 * static_cast<std::size_t>(n));
  ringzero::all_gather(comm, std::span<const std::uint64_t>(mine), std::span<std::uint64_t>(all));
  int source = -1;  // the lowest rank holding the newest snapshot's manifest
  for (int q = 0; q < n; ++q) {
    const auto* e = all.data() + 3 * static_cast<std::size_t>(q);
    if (e[0] == 1 && (source < 0 || e[1] > all[3 * static_cast<std::size_t>(source) + 1]))
      source = q;
  }
  if (source < 0) return false;
  const std::uint64_t step = all[3 * static_cast<std::size_t>(source) + 1];
  const std::uint64_t crc = all[3 * static_cast<std::size_t>(source) + 2];
  // The manifest, to everyone (so every rank knows the shard names and sizes).
  std::vector<std::byte> text(image.manifest.size());
  // An arrival's image is empty, and memcpy must not see the null pointer of an empty vector.
  if (!text.empty()) std::memcpy(text.data(), image.manifest.data(), text.size());
  text = detail::broadcast_bytes(
      comm, comm.rank() == source ? std::move(text) : std::vector<std::byte>{}, source);
  const std::string manifest(reinterpret_cast<const char*>(text.data()), text.size());
  const checkpoint_manifest chosen = checkpoint_manifest::parse(manifest, "(in-memory snapshot)");
  // Round 2: who holds which shard of it.
  const auto shards = chosen.shards.size();
  const bool same = mine[0] == 1 && mine[1] == step && mine[2] == crc;
  std::vector<std::uint8_t> held(shards, 0), every(shards * static_cast<std::size_t>(n));
  for (std::size_t k = 0; k < shards; ++k)
    held[k] = same && image.files.contains(chosen.shards[k].file) ? 1 : 0;
  ringzero::all_gather(comm, std::span<const std::uint8_t>(held), std::span<std::uint8_t>(every));
  std::vector<int> holder(shards, -1);
  for (std::size_t k = 0; k < shards; ++k)
    for (int q = 0; q < n && holder[k] < 0; ++q)
      if (every[static_cast<std::size_t>(q) * shards + k] != 0) holder[k] = q;
  if (std::find(holder.begin(), holder.end(), -1) != holder.end()) return false;
  checkpoint_image whole;
  whole.manifest = manifest;
  for (std::size_t k = 0; k < shards; ++k) {
    const auto& file = chosen.shards[k].file;
    std::vector<std::byte> bytes;
    if (comm.rank() == holder[k]) bytes = image.files.at(file);
    whole.files.emplace(file, detail::broadcast_bytes(comm, std::move(bytes), holder[k]));
  }
  image = std::move(whole);
  return true;
}

}  // namespace ringzero::zero
