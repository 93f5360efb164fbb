// What the algorithms may ask of a communicator, and the per-communicator bookkeeping behind it.
// ringzero::communicator<Transport> is the one type that provides it; the concept exists so the
// algorithms say exactly what they use.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "ringzero/detail/trace_state.hpp"
#include "ringzero/transport/concept.hpp"

namespace ringzero::detail {

class device_cache;

/// Sequence numbers keep back-to-back collectives from matching each other's messages, and the
/// scratch buffer is reused so a registering transport sees the same memory every call.
struct comm_state {
  std::uint32_t collective_seq = 0;
  std::vector<std::uint32_t> p2p_send_seq;
  std::vector<std::uint32_t> p2p_recv_seq;
  /// isend()/irecv() with a tag other than 0 (p2p.hpp): the next sequence number per (peer,
  /// tag). Tag 0 shares p2p_send_seq/p2p_recv_seq with send() and recv().
  std::map<std::pair<int, std::uint32_t>, std::uint32_t> p2p_tagged_send_seq;
  std::map<std::pair<int, std::uint32_t>, std::uint32_t> p2p_tagged_recv_seq;
  std::vector<std::byte> scratch_buffer;
  /// The stream and registered scratch of calls on device buffers (detail/device_executor.hpp),
  /// made by the first one.
  std::shared_ptr<device_cache> device;
  /// Counters and the RINGZERO_TRACE file (trace.hpp).
  trace_state trace;

  std::span<std::byte> scratch(std::size_t bytes) {
    if (scratch_buffer.size() < bytes) scratch_buffer.resize(bytes);
    return {scratch_buffer.data(), bytes};
  }
};

}  // namespace ringzero::detail

namespace ringzero {

/// A communicator the algorithms can run on: messaging in its own rank numbering, plus the
/// tuning policy, the deadline and the per-communicator state.
template <class C>
concept collective_comm = messaging<C> && requires(C& c, const C& cc) {
  { cc.tuning() } -> std::convertible_to<tuning::policy>;
  { cc.timeout() } -> std::convertible_to<std::chrono::nanoseconds>;
  { c.state() } -> std::same_as<detail::comm_state&>;
};

}  // namespace ringzero
