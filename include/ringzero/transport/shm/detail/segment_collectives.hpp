// The shm transport's collectives in its shared segment (try_native, transport/native.hpp): which
// calls run there and how (through the workspace, on symmetric buffers in place, or reading
// across processes), and the workspace they share, allocated by the first of them. The
// collectives themselves are shm/detail/collectives.hpp's and cross_memory.hpp's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>

#include "ringzero/algorithm.hpp"
#include "ringzero/collective_table.hpp"
#include "ringzero/op.hpp"
#include "ringzero/transport/native.hpp"
#include "ringzero/transport/shm/detail/collectives.hpp"
#include "ringzero/transport/shm/detail/cross_memory.hpp"
#include "ringzero/transport/shm/workspace.hpp"
#include "ringzero/types.hpp"

namespace ringzero::shm::detail {

/// The transport's part that runs collectives in the segment (a base of shm::transport, which it
/// reaches as T: rank, size, deadline, segment options, engine, symmetric memory).
template <class T>
class segment_collectives : public cross_memory_reads<T> {
 public:
  /// Whether a collective ran in the segment yet (the first one allocates its workspace).
  [[nodiscard]] bool segment_used() const noexcept { return ws_ != nullptr; }
  /// The phases the last collective run in the segment posted: for an all_reduce through the
  /// workspace one per piece in one phase, two per piece in two (tuning::policy::one_phase_bytes).
  [[nodiscard]] int segment_phases() const noexcept { return segment_phases_; }

  /// Runs a validated call of a world communicator (ranks are the transport's) in the segment
  /// and returns true where that path applies: all_reduce up to
  /// segment_options::all_reduce_segment_bytes (unbounded by default), broadcast, all_gather and
  /// reduce_scatter up to segment_options::segment_bytes, all_to_all up to
  /// segment_options::all_to_all_segment_bytes, all_reduce of any size on symmetric
  /// buffers (read in place from symmetric_min_bytes up), all_gather and all_to_all of
  /// any size from segment_options::cross_memory_bytes per block (read across processes),
  /// barrier. False leaves the call to ringzero's algorithms over messages. The decision depends
  /// only on what every rank passes alike (kind, size, whether the buffers are symmetric), so all
  /// ranks take the same path.
  [[nodiscard]] bool try_native(const native_call& c, const ringzero::options& opt) {
    if (self().size() == 1) return false;
    if (c.reproducible && !runs_reproducible(c)) return false;
    // Only what the kind uses: the fields it ignores may differ across ranks harmlessly.
    const collective_descriptor* d = builtin_collectives::find(c.kind);
    if (d == nullptr) return false;  // a collective of the caller's own: never a segment's
    const bool reduces = d->reduces;
    const bool barrier = c.kind == collective::barrier;
    segment_call call{
        .what = d->name,
        .desc = {.kind = static_cast<std::uint8_t>(c.kind),
                 .type = barrier ? std::uint8_t{0} : static_cast<std::uint8_t>(c.type),
                 .reduction = reduces ? static_cast<std::uint8_t>(c.reduction) : std::uint8_t{0},
                 .reproducible = static_cast<std::uint8_t>(c.reproducible ? 1 : 0),
                 .root = d->rooted ? c.root : 0,
                 .count = barrier ? 0 : c.count},
        .sequence = c.sequence,
        .timeout = opt.timeout.count() > 0 ? opt.timeout : self().default_timeout()};
    if (barrier) {
      shm::detail::barrier(workspace(), call);
      return true;
    }
    const auto divisor =
        static_cast<std::uint32_t>(c.reduction == ringzero::op::avg ? self().size() : 1);
    const bool ran =
        c.reproducible
            ? run_segment<float>(c, call, exact_float_sum{divisor})
            : visit_dtype(c.type, [&]<class E>(E) {
                return run_segment<E>(c, call, in_rank_order<E>{c.reduction, c.one_phase_bytes});
              });
    if (ran) segment_phases_ = call.step;
    return ran;
  }

  /// Whether try_native runs `c`, a call with options::reproducible: a float sum or average,
  /// all_reduce up to segment_options::all_reduce_segment_bytes (or on symmetric buffers) and
  /// reduce_scatter up to segment_options::segment_bytes, as the plain calls; the segment then
  /// sums each element's terms exactly where they meet (exact_float_sum).
  [[nodiscard]] bool runs_reproducible(const native_call& c) const {
    return self().size() > 1 && c.type == dtype::float32 &&
           (c.reduction == ringzero::op::sum || c.reduction == ringzero::op::avg) &&
           segment_reduces<float>(c);
  }

  /// The segment collectives' workspace, allocated (collectively) by the first of them.
  [[nodiscard]] shm::workspace& workspace() {
    if (!ws_)
      ws_ = std::make_unique<shm::workspace>(
          self().engine_ptr(),
          self().allocate_memory(shm::workspace::bytes_for(self().segment().workspace_bytes)),
          self().segment().workspace_bytes, self().segment().streaming_bytes);
    return *ws_;
  }

 protected:
  /// Whether run_segment runs `c`, an all_reduce (on symmetric buffers, or up to
  /// segment_options::all_reduce_segment_bytes) or a reduce_scatter (up to
  /// segment_options::segment_bytes); false for the other kinds. runs_reproducible asks it ahead.
  template <element E>
  [[nodiscard]] bool segment_reduces(const native_call& c) const {
    if (c.kind == collective::all_reduce)
      // The size first: it is unbounded by default, and the symmetric test scans allocations.
      return c.count * sizeof(E) <= self().segment().all_reduce_segment_bytes ||
             symmetric_call<E>(c);
    if (c.kind == collective::reduce_scatter)
      return c.count * static_cast<std::size_t>(self().size()) * sizeof(E) <=
             self().segment().segment_bytes;
    return false;
  }

  /// Whether an all_reduce's buffers are both symmetric memory, read and written in place.
  template <element E>
  [[nodiscard]] bool symmetric_call(const native_call& c) const {
    const auto* in = static_cast<const E*>(c.in);
    const auto* out = static_cast<const E*>(c.out);
    return c.count * sizeof(E) >= symmetric_min_bytes && self().peer_address(in, 0) &&
           self().peer_address(out, 0) && self().peer_address(in + c.count - 1, 0) &&
           self().peer_address(out + c.count - 1, 0);
  }

  /// `combine`: how the ranks' contributions to an all_reduce or reduce_scatter combine
  /// (in_rank_order or exact_float_sum).
  template <element E, class Combine>
  [[nodiscard]] bool run_segment(const native_call& c, segment_call& call, const Combine& combine) {
    const auto n = static_cast<std::size_t>(self().size());
    const auto* in = static_cast<const E*>(c.in);
    auto* out = static_cast<E*>(c.out);
    switch (c.kind) {
      case collective::all_reduce:
        if (symmetric_call<E>(c)) {
          call.desc.path = ringzero::detail::call_path::symmetric;
          all_reduce_symmetric<E>(
              workspace(),
              [&](int q) { return reinterpret_cast<const E*>(self().peer_address(in, q)); },
              [&](int q) { return reinterpret_cast<E*>(self().peer_address(out, q)); }, c.count,
              combine, call);
          return true;
        }
        if constexpr (std::is_same_v<Combine, in_rank_order<E>>)
          if (this->template reduce_across_processes<E>(c, call, combine)) return true;
        if (!segment_reduces<E>(c)) return false;
        all_reduce<E>(workspace(), std::span<const E>(in, c.count), std::span<E>(out, c.count),
                      combine, call);
        return true;
      case collective::broadcast:
        if (c.count * sizeof(E) > self().segment().segment_bytes) return false;
        broadcast<E>(workspace(),
                     std::span<const E>(self().rank() == c.root ? in : nullptr,
                                        self().rank() == c.root ? c.count : 0),
                     std::span<E>(out, c.count), c.root, call);
        return true;
      case collective::all_gather:
        if (this->across_processes(reinterpret_cast<const std::byte*>(in), 0, c.count * sizeof(E),
                                   reinterpret_cast<std::byte*>(out), call))
          return true;
        if (c.count * n * sizeof(E) > self().segment().segment_bytes) return false;
        all_gather<E>(workspace(), std::span<const E>(in, c.count), std::span<E>(out, c.count * n),
                      call);
        return true;
      case collective::reduce_scatter:
        if (!segment_reduces<E>(c)) return false;
        reduce_scatter<E>(workspace(), std::span<const E>(in, c.count * n),
                          std::span<E>(out, c.count), combine, call);
        return true;
      case collective::all_to_all: {
        // In place, a peer would read this rank's slices while this rank overwrites them with
        // its own reads: it publishes a copy instead (the other ranks cannot tell).
        const std::size_t block = c.count * sizeof(E);
        const auto* base = reinterpret_cast<const std::byte*>(in);
        if (this->on_ && block >= self().segment().cross_memory_bytes &&
            static_cast<const void*>(in) == static_cast<const void*>(out)) {
          this->staged_.assign(base, base + block * n);
          base = this->staged_.data();
        }
        if (this->across_processes(base, block, block, reinterpret_cast<std::byte*>(out), call))
          return true;
        if (c.count * n * sizeof(E) > self().segment().all_to_all_segment_bytes) return false;
        all_to_all<E>(workspace(), std::span<const E>(in, c.count * n),
                      std::span<E>(out, c.count * n), call);
        return true;
      }
      default:
        return false;
    }
  }

 private:
  [[nodiscard]] T& self() noexcept { return static_cast<T&>(*this); }
  [[nodiscard]] const T& self() const noexcept { return static_cast<const T&>(*this); }

  std::unique_ptr<shm::workspace> ws_;
  int segment_phases_ = 0;
};

}  // namespace ringzero::shm::detail
