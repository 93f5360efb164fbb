// What a transport is: the messaging a network offers, the capabilities it advertises and its
// tuning policy as data. Everything collective (sequence numbers, scratch, deadlines, split(),
// topology, the hierarchy) belongs to ringzero::communicator<Transport> (communicator.hpp), so a
// transport author writes messaging code only.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "ringzero/tuning/policy.hpp"

namespace ringzero {

/// Where a rank sits: ranks with the same node id share a host (hierarchical algorithms).
struct topology {
  int node = 0;
  int local_rank = 0;
  int local_size = 1;
  int node_count = 1;
};

/// A message tag: 64 bits, of which the algorithm's part is the low 52.
using tag_t = std::uint64_t;

/// The wire format of a tag, in one place:
///   [comm id : 12][p2p : 1][sequence : 23][step : 12][chunk : 16]
/// The communicator fills the top 12 bits with its id, so communicators that share a
/// transport (split()) never match each other's messages; the exchange fills the rest.
/// Steps and chunks wrap: two messages between the same pair of ranks share a tag only if they
/// are 4096 steps or 65536 chunks apart within one collective, which the pipelines never are.
struct tag_layout {
  static constexpr int chunk_bits = 16;
  static constexpr int step_bits = 12;
  static constexpr int sequence_bits = 23;
  static constexpr int p2p_bits = 1;
  static constexpr int comm_id_bits = 12;

  static constexpr int chunk_shift = 0;
  static constexpr int step_shift = chunk_shift + chunk_bits;
  static constexpr int sequence_shift = step_shift + step_bits;
  static constexpr int p2p_shift = sequence_shift + sequence_bits;
  /// Bits an algorithm's tag uses; the communicator id sits above them.
  static constexpr int algorithm_bits = p2p_shift + p2p_bits;
  static constexpr int total_bits = algorithm_bits + comm_id_bits;

  static constexpr std::uint32_t chunk_mask = (1u << chunk_bits) - 1;
  static constexpr std::uint32_t step_mask = (1u << step_bits) - 1;
  static constexpr std::uint32_t sequence_mask = (1u << sequence_bits) - 1;
  static constexpr tag_t algorithm_mask = (tag_t{1} << algorithm_bits) - 1;
  /// The most chunks one message of a collective may be cut into (chunk ids must fit).
  static constexpr std::size_t max_chunks = std::size_t{1} << chunk_bits;
  /// Communicator ids one transport can tell apart.
  static constexpr std::uint32_t max_comm_ids = 1u << comm_id_bits;

  [[nodiscard]] static constexpr tag_t make(bool p2p, std::uint32_t sequence, std::uint32_t step,
                                            std::uint32_t chunk) noexcept {
    return (static_cast<tag_t>(p2p) << p2p_shift) |
           (static_cast<tag_t>(sequence & sequence_mask) << sequence_shift) |
           (static_cast<tag_t>(step & step_mask) << step_shift) |
           (static_cast<tag_t>(chunk & chunk_mask) << chunk_shift);
  }
  [[nodiscard]] static constexpr tag_t with_comm_id(std::uint32_t id, tag_t tag) noexcept {
    return (static_cast<tag_t>(id) << algorithm_bits) | (tag & algorithm_mask);
  }
  [[nodiscard]] static constexpr std::uint32_t sequence_of(tag_t tag) noexcept {
    return static_cast<std::uint32_t>(tag >> sequence_shift) & sequence_mask;
  }
  [[nodiscard]] static constexpr std::uint32_t step_of(tag_t tag) noexcept {
    return static_cast<std::uint32_t>(tag >> step_shift) & step_mask;
  }
  [[nodiscard]] static constexpr std::uint32_t chunk_of(tag_t tag) noexcept {
    return static_cast<std::uint32_t>(tag >> chunk_shift) & chunk_mask;
  }
};

static_assert(tag_layout::total_bits == 64, "the tag layout fills exactly 64 bits");
static_assert(tag_layout::algorithm_bits == 52, "transports reserve 12 bits above 52");
static_assert(tag_layout::make(true, tag_layout::sequence_mask, tag_layout::step_mask,
                               tag_layout::chunk_mask) == tag_layout::algorithm_mask,
              "the algorithm fields tile their 52 bits without gaps or overlap");
static_assert(tag_layout::sequence_of(tag_layout::make(false, 7, 300, 9)) == 7 &&
                  tag_layout::step_of(tag_layout::make(false, 7, 300, 9)) == 300 &&
                  tag_layout::chunk_of(tag_layout::make(false, 7, 300, 9)) == 9,
              "fields read back what was written");

/// Bits of an algorithm's tag (the communicator id goes above them).
inline constexpr int tag_bits = tag_layout::algorithm_bits;

/// Point-to-point messaging, the one thing every ringzero algorithm needs from a network.
///
/// - Peers are the transport's own ranks (0 .. size()-1 of the job it was opened for); the
///   communicator maps its ranks onto them.
/// - isend/irecv return a move-only request; destroying an unfinished request cancels it, so an
///   exception unwinding an algorithm never leaves the network writing into freed memory.
/// - A receive is posted with exactly the size its matching send carries; messages with the same
///   (peer, tag) match in posting order.
/// - test(req) makes progress and returns true once req completed; it throws peer_error if the
///   peer is known to be gone and transport_error on a network failure.
/// - Progress: test(req) must move every operation of the transport that can move, not only
///   req. Algorithms wait on one request at a time while others are posted (a ring waits on its
///   receive while its send is in flight; recursive doubling on its send while its receive is),
///   so a transport whose test(req) advances only req deadlocks them until the deadline.
///   progress() moves everything without a request in hand; ringzero's algorithms never call
///   it (communicator::progress() passes it on to programs that wait on their own requests),
///   and it must be safe to call at any time.
/// - The library keeps requests in arrays and default-constructs them as "nothing posted", so
///   a request must be default-constructible; test() is never called on such a request.
template <class T>
concept messaging = requires(T& t, const T& ct, int peer, tag_t tag, std::span<const std::byte> sb,
                             std::span<std::byte> rb, typename T::request& req) {
  typename T::request;
  requires std::movable<typename T::request>;
  requires std::default_initializable<typename T::request>;
  { ct.rank() } -> std::convertible_to<int>;
  { ct.size() } -> std::convertible_to<int>;
  { t.isend(peer, tag, sb) } -> std::same_as<typename T::request>;
  { t.irecv(peer, tag, rb) } -> std::same_as<typename T::request>;
  { t.test(req) } -> std::same_as<bool>;
  {t.progress()};
};

/// A transport: messaging (or, for a backend such as NCCL, native collectives; see
/// native_transport in communicator.hpp) plus its tuning policy.
///
/// Optional capabilities, detected by the communicator when present:
///   host_of(rank) -> a value equal for ranks on one host      (node topology, hierarchy)
///   comm_id_bits() -> int                                      (fewer than 12 tag bits free)
///   default_timeout() -> std::chrono::nanoseconds, 0 = unset   (a deadline it was opened with)
///   tuning_name() -> std::string                               (its RINGZERO_TUNING section)
template <class T>
concept transport = requires(const T& ct) {
  { ct.rank() } -> std::convertible_to<int>;
  { ct.size() } -> std::convertible_to<int>;
  { ct.tuning() } -> std::convertible_to<tuning::policy>;
};

/// A messaging transport that moves CUDA device memory itself (libfabric with FI_HMEM): the
/// communicator runs ringzero's schedules on device buffers over it, with the messaging
/// executor of detail/device_executor.hpp. device_memory(): opened for it; otherwise
/// device_memory_refusal() says why device buffers are refused, naming the provider.
/// register_device_buffer(p, n, device, id) registers memory of CUDA device `device` in the
/// allocation with id `id` (0: unknown; a new allocation at a freed one's addresses has a new
/// one, and must be registered anew); the communicator registers the allocations of the buffers
/// it is given, whole, and its scratch. forget_memory(p, n) drops a registration before the
/// memory is freed.
template <class T>
concept device_memory_transport = messaging<T> &&
    requires(T& t, const T& ct, const void* p, std::size_t n, int device, std::uint64_t id) {
  { ct.device_memory() } -> std::convertible_to<bool>;
  { ct.device_memory_refusal() } -> std::convertible_to<std::string>;
  t.register_device_buffer(p, n, device, id);
  t.forget_memory(p, n);
};

/// Node placement capability: every rank can name the host each peer runs on.
template <class T>
concept has_hosts = requires(const T& ct, int r) {
  {ct.host_of(r)};
  { ct.host_of(r) == ct.host_of(r) } -> std::convertible_to<bool>;
};

}  // namespace ringzero
