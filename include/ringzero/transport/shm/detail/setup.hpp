// The shm transport's segment, from its birth to the last rank's mapping: rank 0 creates it
// with the geometry every rank's options must agree on, the others open it by the name rank 0
// publishes (through the store, or another communicator's messages: transport::join), every rank
// publishes itself in it and waits for the rest, and the last to map it removes its name, so the
// segment disappears with the last process however the processes end.
#pragma once

#include <fmt/core.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "ringzero/detail/backoff.hpp"
#include "ringzero/error.hpp"
#include "ringzero/log.hpp"
#include "ringzero/transport/shm/detail/engine.hpp"
#include "ringzero/transport/shm/detail/segment.hpp"
#include "ringzero/transport/shm/options.hpp"
#include "ringzero/tuning/policy.hpp"

namespace ringzero::shm::detail {

inline void check_options(const options& opt) {
  ringzero::tuning::check(opt.tuning, "shm transport");
  const segment_options& t = opt.segment;
  if (t.slots < 2 || t.slot_bytes < 2 * cache_line || t.slot_bytes % cache_line != 0 ||
      t.slot_bytes > (std::size_t{1} << 30))
    throw invalid_argument(fmt::format(
        "shm transport: {} slots of {} bytes: need at least 2 slots of a multiple of 64 bytes, "
        "at least 128",
        t.slots, t.slot_bytes));
}

[[nodiscard]] inline mapping create_segment(int size, const segment_options& geometry) {
  const layout l{static_cast<std::size_t>(size), geometry.slots, geometry.slot_bytes};
  mapping seg = mapping::create(l.bytes());
  auto* h = reinterpret_cast<segment_header*>(seg.data());
  h->ranks = static_cast<std::uint32_t>(size);
  h->slots = static_cast<std::uint32_t>(geometry.slots);
  h->slot_bytes = geometry.slot_bytes;
  h->bytes = l.bytes();
  h->magic = segment_magic;
  return seg;
}

/// `where`: "name bytes", as rank 0 publishes it.
[[nodiscard]] inline mapping open_segment(std::string_view where, int size) {
  const auto space = where.find(' ');
  if (space == std::string_view::npos)
    throw transport_error(fmt::format("shm: '{}' does not name a segment", where));
  mapping seg = mapping::open(std::string(where.substr(0, space)),
                              std::stoull(std::string(where.substr(space + 1))));
  const auto* h = reinterpret_cast<const segment_header*>(seg.data());
  if (h->magic != segment_magic || h->ranks != static_cast<std::uint32_t>(size))
    throw transport_error(
        fmt::format("shm: segment {} is not a {}-rank ringzero segment", seg.name(), size));
  return seg;
}

// Publishes this rank in the mapped segment and waits, until `deadline`, for every rank to
// have mapped it; the last one to map it removes its name.
[[nodiscard]] inline std::shared_ptr<engine> attach(mapping seg, int rank, int size,
                                                    std::chrono::steady_clock::time_point deadline,
                                                    std::chrono::nanoseconds timeout) {
  auto eng = std::make_shared<engine>(std::move(seg), rank, size);
  auto& me = eng->record(rank);
  const process_id self = self_process();
  me.pid.store(self.pid, std::memory_order_relaxed);
  me.start.store(self.start, std::memory_order_relaxed);
  me.state.store(rank_running, std::memory_order_release);
  // From the last mapping on, the segment disappears with the last process that maps it,
  // however the processes end.
  auto& mapped = eng->header()->mapped;
  if (mapped.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<std::uint32_t>(size))
    eng->unlink_segment();
  ringzero::detail::backoff b;
  while (mapped.load(std::memory_order_acquire) < static_cast<std::uint32_t>(size)) {
    if (std::chrono::steady_clock::now() > deadline) {
      eng->unlink_segment();
      throw timeout_error(
          fmt::format("shm: only {} of {} ranks mapped the segment within {:g} s", mapped.load(),
                      size, std::chrono::duration<double>(timeout).count()),
          -1);
    }
    b.pause();
  }
  log::info("shm: rank {} of {}, {} slots of {} bytes per pair of ranks", rank, size,
            eng->geometry().slots, eng->geometry().slot_bytes);
  return eng;
}

}  // namespace ringzero::shm::detail
