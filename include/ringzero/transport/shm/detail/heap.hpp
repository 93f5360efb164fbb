// The shm transport's symmetric memory: buffers every rank of the node addresses (one mapping,
// a stride per rank), as NCCL's ncclMemAlloc and a registered window give. comm.allocate<T>(n)
// makes one collectively; peer_address() is how a collective in the segment finds a peer's copy
// of a buffer, and so whether a call's buffers are symmetric at all.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "ringzero/transport/shm/detail/segment.hpp"
#include "ringzero/transport/shm/symmetric.hpp"

namespace ringzero::shm::detail {

/// The transport's part that allocates symmetric memory (a base of shm::transport, which it
/// reaches as T: rank, size, deadline and messages, with which rank 0 names each new mapping to
/// the others).
template <class T>
class symmetric_heap {
 public:
  /// Collective over every rank of the transport: n elements of V per rank, addressed by every
  /// rank (communicator::allocate).
  template <class V>
  [[nodiscard]] symmetric_buffer<V> allocate(std::size_t n) {
    return {allocate_memory(n * sizeof(V)), n};
  }

  /// Collective over every rank of the transport: `bytes` of memory per rank, in one mapping
  /// every rank addresses (symmetric memory, as ncclMemAlloc and a registered window give).
  [[nodiscard]] symmetric_memory allocate_memory(std::size_t bytes) {
    const std::size_t stride = round_up(std::max<std::size_t>(bytes, 1), 4096);
    const auto deadline = std::chrono::steady_clock::now() + self().default_timeout();
    const std::uint64_t tag = T::internal_tag | allocations_++;
    std::shared_ptr<mapping> m;
    std::array<char, 256> name{};
    if (self().rank() == 0) {
      m = std::make_shared<mapping>(
          mapping::create(stride * static_cast<std::size_t>(self().size())));
      std::memcpy(name.data(), m->name().c_str(), std::min(name.size() - 1, m->name().size()));
      std::vector<typename T::request> sent;
      for (int r = 1; r < self().size(); ++r)
        sent.push_back(self().isend(r, tag, std::as_bytes(std::span<const char>(name))));
      for (std::size_t i = 0; i < sent.size(); ++i)
        self().wait(sent[i], deadline, "symmetric allocation", static_cast<int>(i) + 1);
      // Every other rank answers once it mapped the memory; then the name can go.
      std::vector<std::byte> acks(static_cast<std::size_t>(self().size()));
      std::vector<typename T::request> got;
      for (int r = 1; r < self().size(); ++r)
        got.push_back(
            self().irecv(r, tag, std::span<std::byte>(&acks[static_cast<std::size_t>(r)], 1)));
      try {
        for (std::size_t i = 0; i < got.size(); ++i)
          self().wait(got[i], deadline, "symmetric allocation", static_cast<int>(i) + 1);
      } catch (...) {
        m->unlink();
        throw;
      }
      m->unlink();
    } else {
      auto q = self().irecv(0, tag, std::as_writable_bytes(std::span<char>(name)));
      self().wait(q, deadline, "symmetric allocation", 0);
      name.back() = '\0';
      m = std::make_shared<mapping>(
          mapping::open(name.data(), stride * static_cast<std::size_t>(self().size())));
      const std::byte ack{1};
      auto a = self().isend(0, tag, std::span<const std::byte>(&ack, 1));
      self().wait(a, deadline, "symmetric allocation", 0);
    }
    std::erase_if(allocations_live_, [](const auto& w) { return w.expired(); });
    allocations_live_.push_back(m);
    return {std::move(m), bytes, stride, self().rank(), self().size()};
  }

  /// Where rank `peer` holds the byte that p addresses in this rank's part of a live symmetric
  /// allocation; nullptr if p is not in one. How a collective finds a peer's copy of a
  /// symmetric buffer.
  [[nodiscard]] std::byte* peer_address(const void* p, int peer) const {
    const auto* b = static_cast<const std::byte*>(p);
    for (const auto& w : allocations_live_) {
      const auto m = w.lock();
      if (!m) continue;
      const std::size_t stride = m->size() / static_cast<std::size_t>(self().size());
      const std::byte* mine = m->data() + static_cast<std::size_t>(self().rank()) * stride;
      if (b >= mine && b < mine + stride)
        return m->data() + static_cast<std::size_t>(peer) * stride +
               static_cast<std::size_t>(b - mine);
    }
    return nullptr;
  }

 private:
  [[nodiscard]] T& self() noexcept { return static_cast<T&>(*this); }
  [[nodiscard]] const T& self() const noexcept { return static_cast<const T&>(*this); }

  std::uint64_t allocations_ = 0;
  std::vector<std::weak_ptr<mapping>> allocations_live_;
};

}  // namespace ringzero::shm::detail
