// Where the sharder keeps the flat buffers its collectives read and write: the parameters, the
// gradients and gradient buckets, the stage-3 gathered buckets. The communicator chooses, through
// memory_space_for(comm):
//
//   host_space        plain host memory: loopback, libfabric, a communicator split from another
//   symmetric_space   the node's shared segment where the communicator can allocate there (shm):
//                     every rank addresses every rank's buffer, so the transport runs all_reduce
//                     on it in place (peers' inputs read where they lie, outputs written with
//                     streaming stores), about 2·S bytes of memory traffic per rank instead of
//                     the 3.5·S+ of copying through messages
//
// A space is a small copyable handle with allocate<T>(n), returning an owning buffer<T> of n
// zeroed elements. Where `collective()` is true (symmetric memory), allocate is collective over
// every rank of the transport: every rank must allocate the same sizes in the same order, and no
// other thread may use the communicator meanwhile. allocate_local<T>(n) is never collective (a
// buffer only this rank decides to need; on symmetric_space it is host memory, which collectives
// accept as well). `host_accessible` says the CPU may read and write the memory directly; a CUDA
// device space (ncclMemAlloc, asynchronous copies) will be the first space where it is false.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

namespace ringzero::zero {

/// n elements of T owned by the buffer, which the CPU addresses. Moving keeps the address; a
/// buffer from symmetric memory keeps its mapping alive for as long as it lives.
template <class T>
class buffer {
 public:
  buffer() = default;
  /// `owner` keeps `view`'s memory alive; `symmetric`: it lies in symmetric memory.
  buffer(std::span<T> view, std::shared_ptr<void> owner, bool symmetric) noexcept
      : view_(view), owner_(std::move(owner)), symmetric_(symmetric) {}

  [[nodiscard]] std::span<T> span() const noexcept { return view_; }
  [[nodiscard]] T* data() const noexcept { return view_.data(); }
  [[nodiscard]] std::size_t size() const noexcept { return view_.size(); }
  [[nodiscard]] std::size_t bytes() const noexcept { return view_.size_bytes(); }
  [[nodiscard]] bool empty() const noexcept { return view_.empty(); }
  /// Whether every rank of the node addresses it (collectives on it may take the in-place path).
  [[nodiscard]] bool symmetric() const noexcept { return symmetric_; }
  T& operator[](std::size_t i) const noexcept { return view_[i]; }

 private:
  std::span<T> view_;
  std::shared_ptr<void> owner_;
  bool symmetric_ = false;
};

/// Whether the CPU reads and writes a space's memory directly (the sharder's host loops need it).
template <class Space>
inline constexpr bool host_accessible = Space::host_accessible;

template <class S>
concept memory_space = std::copy_constructible<S> && requires(const S& s, std::size_t n) {
  { s.template allocate<float>(n) } -> std::same_as<buffer<float>>;
  { s.template allocate_local<float>(n) } -> std::same_as<buffer<float>>;
  { s.collective() } -> std::convertible_to<bool>;
  { host_accessible<S> } -> std::convertible_to<bool>;
};

/// Plain host memory, zeroed.
struct host_space {
  static constexpr bool host_accessible = true;
  [[nodiscard]] static constexpr bool collective() noexcept { return false; }
  template <class T>
  [[nodiscard]] static buffer<T> allocate(std::size_t n) {
    auto v = std::make_shared<std::vector<T>>(n, T{});
    const std::span<T> view(*v);
    return {view, std::move(v), false};
  }
  template <class T>
  [[nodiscard]] static buffer<T> allocate_local(std::size_t n) {
    return allocate<T>(n);
  }
};

/// Symmetric memory of a world communicator that can allocate it (comm.allocate<T>(n), the shm
/// transport), or host memory where it may not be used: a communicator split from another
/// (symmetric memory spans every rank of the transport), or a world of one rank (nothing to share).
/// The communicator must outlive the space and every buffer from it.
template <class Comm>
class symmetric_space {
 public:
  static constexpr bool host_accessible = true;

  /// Symmetric where `comm` allows it, host memory otherwise.
  explicit symmetric_space(Comm& comm) noexcept
      : comm_(comm.comm_id() == 0 && comm.size() > 1 ? &comm : nullptr) {}

  /// Whether allocate() is collective (the memory is symmetric).
  [[nodiscard]] bool collective() const noexcept { return comm_ != nullptr; }

  /// Collective over every rank of the transport when collective(): see the header comment.
  template <class T>
  [[nodiscard]] buffer<T> allocate(std::size_t n) const {
    if (comm_ == nullptr) return host_space::allocate<T>(n);
    auto mem =
        std::make_shared<decltype(comm_->template allocate<T>(n))>(comm_->template allocate<T>(n));
    const std::span<T> view = mem->local();
    // The segment is zero when mapped; this also sets T's own zero where that is not all bits 0.
    std::fill(view.begin(), view.end(), T{});
    return {view, std::move(mem), true};
  }
  template <class T>
  [[nodiscard]] static buffer<T> allocate_local(std::size_t n) {
    return host_space::allocate<T>(n);
  }

 private:
  Comm* comm_;
};

namespace detail::space_lookup {

void memory_space_for() = delete;  // only the overloads argument-dependent lookup finds

template <class Comm>
concept has_own = requires(Comm& c) {
  memory_space_for(c);
};

template <class Comm>
concept allocates_symmetric = requires(Comm& c, std::size_t n) {
  c.template allocate<float>(n);
  { c.comm_id() } -> std::convertible_to<std::uint32_t>;
};

struct memory_space_for_fn {
  template <class Comm>
  [[nodiscard]] auto operator()(Comm& comm) const {
    if constexpr (has_own<Comm>)
      return memory_space_for(comm);
    else if constexpr (allocates_symmetric<Comm>)
      return symmetric_space<Comm>(comm);
    else
      return host_space{};
  }
};

}  // namespace detail::space_lookup

/// The memory space the sharder allocates its buffers in on `comm`: an overload of
/// memory_space_for(comm) found by argument-dependent lookup (how a backend names its own, as
/// NCCL's device memory will), else symmetric_space where the communicator can allocate
/// symmetric memory, else host_space.
inline constexpr detail::space_lookup::memory_space_for_fn memory_space_for{};

/// The space memory_space_for gives on a Comm.
template <class Comm>
using memory_space_t = decltype(memory_space_for(std::declval<Comm&>()));

}  // namespace ringzero::zero
