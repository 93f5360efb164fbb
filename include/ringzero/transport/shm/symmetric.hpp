// Symmetric memory of the shm transport: one mapping every rank of the node addresses, rank r's
// part at r * stride, as ncclMemAlloc plus window registration give on GPUs. Collectives on such
// buffers read the peers' data in place.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <utility>

#include "ringzero/transport/shm/detail/segment.hpp"

namespace ringzero::shm {

/// Memory mapped by every rank of the transport: rank r's part starts at r * stride. Ranks
/// read and write each other's parts directly (collectives on symmetric buffers do so).
class symmetric_memory {
 public:
  symmetric_memory() = default;
  symmetric_memory(std::shared_ptr<detail::mapping> m, std::size_t bytes, std::size_t stride,
                   int rank, int size)
      : map_(std::move(m)), bytes_(bytes), stride_(stride), rank_(rank), size_(size) {}

  /// This rank's part.
  [[nodiscard]] std::span<std::byte> local() const noexcept { return peer(rank_); }
  /// Rank r's part, as this process addresses it.
  [[nodiscard]] std::span<std::byte> peer(int r) const noexcept {
    return {map_->data() + static_cast<std::size_t>(r) * stride_, bytes_};
  }
  /// Which rank's part holds p (-1 if none): lets a collective find a buffer's peers' copies.
  [[nodiscard]] int owner(const void* p) const noexcept {
    const auto* b = static_cast<const std::byte*>(p);
    if (!map_ || b < map_->data() || b >= map_->data() + stride_ * static_cast<std::size_t>(size_))
      return -1;
    const auto r = static_cast<std::size_t>(b - map_->data()) / stride_;
    return b < map_->data() + r * stride_ + bytes_ ? static_cast<int>(r) : -1;
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }

 private:
  std::shared_ptr<detail::mapping> map_;
  std::size_t bytes_ = 0;
  std::size_t stride_ = 0;
  int rank_ = 0;
  int size_ = 0;
};

/// Memory of n elements of T per rank that every rank of the node addresses.
template <class T>
class symmetric_buffer {
 public:
  symmetric_buffer() = default;
  symmetric_buffer(symmetric_memory m, std::size_t n) : mem_(std::move(m)), n_(n) {}

  /// This rank's elements.
  [[nodiscard]] std::span<T> local() const noexcept { return peer(mem_.rank()); }
  /// Rank r's elements, read and written in place.
  [[nodiscard]] std::span<T> peer(int r) const noexcept {
    return {reinterpret_cast<T*>(mem_.peer(r).data()), n_};
  }
  [[nodiscard]] std::size_t size() const noexcept { return n_; }
  [[nodiscard]] const symmetric_memory& memory() const noexcept { return mem_; }

 private:
  symmetric_memory mem_;
  std::size_t n_ = 0;
};

}  // namespace ringzero::shm
