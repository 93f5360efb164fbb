// A messaging transport shaped like libfabric opened with FI_HMEM, over the fake CUDA runtime
// (fake_device.hpp), so that ringzero's schedules on device buffers (detail/device_executor.hpp)
// run without a GPU: loopback moves the bytes; registrations of device memory are kept as
// libfabric's are (detail::device_declarations, with the allocation's id), to find one that
// outlived its memory; each completed receive into device memory is reported to the fake runtime
// as a NIC's write (GPUDirect RDMA ordering).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fake_device.hpp"
#include "ringzero/communicator.hpp"
#include "ringzero/transport/concept.hpp"
#include "ringzero/transport/detail/device_declarations.hpp"
#include "ringzero/transport/loopback.hpp"

namespace fake_device {

/// See the header comment.
template <ringzero::messaging Inner>
class fabric {
 public:
  struct request {
    typename Inner::request r;
    std::byte* recv = nullptr;  ///< a receive's buffer, until reported
    std::size_t bytes = 0;
  };
  explicit fabric(Inner inner) : inner_(std::move(inner)) {}

  [[nodiscard]] int rank() const { return inner_.rank(); }
  [[nodiscard]] int size() const { return inner_.size(); }
  [[nodiscard]] decltype(auto) tuning() const { return inner_.tuning(); }
  [[nodiscard]] request isend(int peer, ringzero::tag_t tag, std::span<const std::byte> data) {
    return {inner_.isend(peer, tag, data)};
  }
  [[nodiscard]] request irecv(int peer, ringzero::tag_t tag, std::span<std::byte> data) {
    return {inner_.irecv(peer, tag, data), data.data(), data.size()};
  }
  [[nodiscard]] bool test(request& q) {
    if (!inner_.test(q.r)) return false;
    if (q.recv != nullptr) remote_write(q.recv, q.bytes);
    q.recv = nullptr;
    return true;
  }
  void progress() { inner_.progress(); }

  [[nodiscard]] bool device_memory() const noexcept { return true; }
  [[nodiscard]] std::string device_memory_refusal() const { return {}; }
  void register_device_buffer(const void* p, std::size_t bytes, int device, std::uint64_t id) {
    static_cast<void>(declared_.declare(p, bytes, device, id));
  }
  void forget_memory(const void* p, std::size_t bytes) { declared_.forget(p, bytes); }
  [[nodiscard]] const ringzero::detail::device_declarations& registrations() const noexcept {
    return declared_;
  }
  /// Registrations whose allocation was freed (or replaced) without forget_memory: a NIC would
  /// still move the pages they pinned.
  [[nodiscard]] std::size_t stale_registrations() const {
    return static_cast<std::size_t>(
        std::count_if(declared_.all().begin(), declared_.all().end(), [](const auto& r) {
          return allocation_of(reinterpret_cast<const void*>(r.begin)).id != r.id;
        }));
  }

 private:
  Inner inner_;
  ringzero::detail::device_declarations declared_;
};

using fabric_communicator = ringzero::communicator<fabric<ringzero::loopback::transport>>;

/// The rank `host` is of its loopback world, as a communicator of its own over `fabric` (the two
/// must not run collectives at once: they share the world's mailboxes).
[[nodiscard]] inline fabric_communicator fabric_of(ringzero::loopback::communicator& host) {
  return fabric_communicator(fabric<ringzero::loopback::transport>(ringzero::loopback::transport(
      host.transport().shared(), host.rank(), host.transport().options())));
}

}  // namespace fake_device
