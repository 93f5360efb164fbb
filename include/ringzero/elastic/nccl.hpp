// Elastic generations on NCCL: the next generation's communicator made from the last one's with
// ncclCommShrink where that can be done, else through the session's store.
//
//   auto before = s.current();
//   try { train(comm); }
//   catch (const ringzero::error&) {
//     s.shrink(comm.failed_rank());                     // the survivors agree on who is left
//     comm = ringzero::nccl::next_generation(s, comm, before);
//   }
//
// A shrink needs every survivor to hold the old handle: NCCL 2.27 or later for ncclCommShrink,
// and after a dead rank was found NCCL 2.28 or later, whose ncclCommRevoke stopped the work and
// kept the handle (an older NCCL aborts it). The survivors agree through the new generation's
// store whether all of them can, so that they all take the same way; a generation with arrivals
// (grow) always forms through the store. Each rank keeps its device either way (shrink keeps the
// handle's device; the store's way chooses as every constructor does, detail/rank_device.hpp).
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ringzero/elastic.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/nccl.hpp"

namespace ringzero::nccl {

/// The communicator of the session's current generation, which `before` (the generation
/// `previous` was made for) became by session::shrink(): see the header comment. Collective over
/// the current generation. `cfg` applies where a new communicator is created.
[[nodiscard]] inline communicator next_generation(elastic::session& s, communicator& previous,
                                                  const elastic::membership& before,
                                                  const config& cfg = {}) {
  const elastic::membership& now = s.current();
  // Ranks of `before` that are not in the new generation: those the shrink excludes.
  std::vector<int> excluded;
  bool only_lost = now.arrived.empty();
  for (int r = 0; r < before.size(); ++r) {
    const std::int64_t id = before.members[static_cast<std::size_t>(r)];
    if (std::find(now.members.begin(), now.members.end(), id) == now.members.end())
      excluded.push_back(r);
  }
  for (const std::int64_t id : now.members)
    only_lost = only_lost &&
                std::find(before.members.begin(), before.members.end(), id) != before.members.end();
  const bool can = NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0) && only_lost && previous.valid() &&
                   previous.transport().native_handle() != nullptr &&
                   previous.size() == before.size();
  // Every survivor says whether it can; all shrink only if all can.
  auto st = s.generation_store();
  st->set_string(fmt::format("nccl/shrink/{}", now.rank), can ? "1" : "0");
  bool all = true;
  for (int r = 0; r < now.size(); ++r)
    all = all && st->get_string(fmt::format("nccl/shrink/{}", r)) == "1";
  if (all) {
    communicator next(
        previous.transport().shrink(excluded, cfg.dead_rank ? cfg.dead_rank : s.dead_rank_probe()),
        previous.timeout());
    if (next.rank() != now.rank || next.size() != now.size())
      throw transport_error(fmt::format(
          "nccl: the shrunk communicator has this process as rank {} of {}, but generation {} "
          "made it rank {} of {}",
          next.rank(), next.size(), now.generation, now.rank, now.size()));
    log::info("nccl: generation {} made by ncclCommShrink ({} ranks excluded)", now.generation,
              excluded.size());
    return next;
  }
  return s.communicator<communicator>(cfg);
}

}  // namespace ringzero::nccl
