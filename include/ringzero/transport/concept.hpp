// The transport concept: everything an algorithm may ask of a network. Algorithms post tagged,
// non-blocking sends and receives of bytes to peers and test them; they never see libfabric or
// NCCL types. Each transport also carries the alpha-beta-gamma constants the cost model uses.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "ringzero/detail/trace_state.hpp"

namespace ringzero {

/// Hockney/Thakur-style constants of a transport, in seconds: a message of m bytes costs
/// alpha + m*beta on the wire, and reducing m bytes costs m*gamma.
struct cost_params {
  double alpha = 5e-6;
  double beta = 1.0 / 5e9;
  double gamma = 1.0 / 10e9;
  /// Pipelining granularity for ring/chain/tree algorithms.
  std::size_t chunk_bytes = std::size_t{1} << 20;
  /// The smallest chunk the transport accepts, whatever options::chunk_bytes asks: above its
  /// eager threshold, so that a send completes only once the receiver has matched it. The
  /// algorithms bound their chunks in flight by waiting for sends; a send that completes on
  /// the sender alone (eager) would let it run ahead and pile early arrivals on the receiver.
  std::size_t min_chunk_bytes = 0;
};

/// Where a rank sits: ranks with the same node id share a host (hierarchical algorithms).
struct topology {
  int node = 0;
  int local_rank = 0;
  int local_size = 1;
  int node_count = 1;
};

/// A tag as algorithms build it: 52 bits. Transports add their communicator id above it.
using tag_t = std::uint64_t;
inline constexpr int tag_bits = 52;

namespace detail {

/// Per-communicator bookkeeping that every transport carries and the collectives layer uses:
/// sequence numbers keep back-to-back collectives from matching each other's messages, and the
/// scratch buffer is reused so a registering transport sees the same memory every call.
struct comm_state {
  std::uint32_t collective_seq = 0;
  std::vector<std::uint32_t> p2p_send_seq;
  std::vector<std::uint32_t> p2p_recv_seq;
  std::vector<std::byte> scratch_buffer;
  /// Sub-communicators a hierarchical algorithm built from this one, kept so they are split
  /// once per communicator rather than once per call (the algorithm knows their type).
  std::shared_ptr<void> hierarchy;
  /// Counters and the RINGZERO_TRACE file (trace.hpp).
  trace_state trace;

  std::span<std::byte> scratch(std::size_t bytes) {
    if (scratch_buffer.size() < bytes) scratch_buffer.resize(bytes);
    return {scratch_buffer.data(), bytes};
  }
};

}  // namespace detail

/// A transport: rank/size, tagged non-blocking send/recv of bytes, test, progress.
///
/// - isend/irecv return a move-only request; destroying an unfinished request cancels it, so
///   an exception unwinding an algorithm never leaves the network writing into freed memory.
/// - test(req) makes progress and returns true once req completed; it throws peer_error if the
///   peer is known to be gone and transport_error on a network failure.
/// - A receive must be posted with exactly the size the matching send carries.
template <class T>
concept transport = requires(T& t, const T& ct, int peer, tag_t tag, std::span<const std::byte> sb,
                             std::span<std::byte> rb, typename T::request& req) {
  typename T::request;
  requires std::movable<typename T::request>;
  { ct.rank() } -> std::convertible_to<int>;
  { ct.size() } -> std::convertible_to<int>;
  { t.isend(peer, tag, sb) } -> std::same_as<typename T::request>;
  { t.irecv(peer, tag, rb) } -> std::same_as<typename T::request>;
  { t.test(req) } -> std::same_as<bool>;
  {t.progress()};
  { ct.cost() } -> std::convertible_to<cost_params>;
  { ct.timeout() } -> std::convertible_to<std::chrono::nanoseconds>;
  { t.state() } -> std::same_as<detail::comm_state&>;
};

}  // namespace ringzero
