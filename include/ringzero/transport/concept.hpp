// What a transport is: the messaging a network offers, the capabilities it advertises and its
// tuning policy as data. Its words (topology, tag_t, tag_layout) are ringzero/base.hpp's.
// Everything collective (sequence numbers, scratch, deadlines, split(), topology, the hierarchy)
// belongs to ringzero::communicator<Transport> (communicator.hpp), so a transport author writes
// messaging code only.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "ringzero/base.hpp"
#include "ringzero/tuning/policy.hpp"

namespace ringzero {

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
