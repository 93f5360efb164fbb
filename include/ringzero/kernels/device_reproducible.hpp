// options::reproducible on device buffers as plain C++ sees it: the per-element passes of
// reduce/reproducible.hpp as function pointers that take the element type at run time, filled by
// kernels/cuda/reproducible.cuh (included by kernels/cuda/device_reduction.cuh, so the one
// include that lets schedules run on GPU buffers brings these too). Tests register a host
// stand-in that runs the same per-element functions.
#pragma once

#include <fmt/core.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ringzero/error.hpp"
#include "ringzero/types.hpp"

// CUDA's stream type (cudaStream_t is CUstream_st*), named without including a CUDA header.
struct CUstream_st;

namespace ringzero::kernels {

/// Every pointer is device memory of the current device unless it says host; every function
/// enqueues on `stream` and may throw transport_error.
struct device_reproducible {
  /// The windows of in[0, n) into win (2 int32 per block of 64, the inf/NaN flag last).
  void (*windows)(dtype type, const void* in, std::size_t n, std::int32_t* win,
                  CUstream_st* stream);
  /// Bytes of device scratch `layout` needs for a call of n elements.
  std::size_t (*layout_scratch)(std::size_t n);
  /// The digits' layout from the agreed windows of a call of n elements: off[b] for b <= blocks
  /// (the exclusive prefix sum of reproducible::block_digits, the total last) and bounds[r] =
  /// reproducible::range_position(win, off, n, r * part) for r <= parts (part * parts == n).
  /// `scratch` holds at least layout_scratch(n) bytes.
  void (*layout)(const std::int32_t* win, std::size_t n, std::size_t part, std::size_t parts,
                 std::uint64_t* off, std::uint64_t* bounds, void* scratch,
                 std::size_t scratch_bytes, CUstream_st* stream);
  /// in[0, n)'s digits into q at reproducible::segment_position(win, off, i, count, seg).
  void (*digits)(dtype type, const void* in, std::size_t n, const std::int32_t* win,
                 const std::uint64_t* off, std::size_t count, std::size_t seg, std::int64_t* q,
                 CUstream_st* stream);
  /// out[i - from] for i in [from, from + count): the digits at q + (position(i) -
  /// position(from)) rounded once, divided by `divisor` first.
  void (*round)(dtype type, const std::int64_t* q, const std::int32_t* win,
                const std::uint64_t* off, std::size_t from, std::size_t count,
                std::uint32_t divisor, void* out, CUstream_st* stream);
  /// codes[i] = reproducible::special_code(in[i]) for i < n.
  void (*special_codes)(dtype type, const void* in, std::size_t n, std::int64_t* codes,
                        CUstream_st* stream);
  /// out[i] becomes inf or NaN where codes[i] (summed over the ranks) says so, for i < n.
  void (*apply_specials)(dtype type, const std::int64_t* codes, std::size_t n, void* out,
                         CUstream_st* stream);
  /// A copy in any direction (host or device memory on either side), enqueued.
  void (*copy)(void* dst, const void* src, std::size_t bytes, CUstream_st* stream);
  /// Waits for everything enqueued on stream; throws its error.
  void (*synchronize)(CUstream_st* stream);
  /// Makes `stream` wait for the work queued on `caller` so far (null: the default stream),
  /// without a host wait: the call's passes run on a stream of their own, which would not
  /// otherwise see a buffer the trainer's kernels or copies are still writing.
  void (*after)(CUstream_st* stream, CUstream_st* caller);
};

namespace detail {

[[nodiscard]] inline std::atomic<const device_reproducible*>& device_reproducible_slot() noexcept {
  static std::atomic<const device_reproducible*> slot{nullptr};
  return slot;
}

}  // namespace detail

[[nodiscard]] inline const device_reproducible* registered_device_reproducible() noexcept {
  return detail::device_reproducible_slot().load(std::memory_order_acquire);
}

/// The registered table, or unsupported saying what to include.
[[nodiscard]] inline const device_reproducible& required_device_reproducible(
    std::string_view what) {
  if (const device_reproducible* r = registered_device_reproducible(); r != nullptr) return *r;
  throw unsupported(
      fmt::format("{}: options::reproducible on GPU buffers runs ringzero's CUDA kernels, and this "
                  "program has none: include <ringzero/kernels/cuda/device_reduction.cuh> in one "
                  ".cu file compiled by nvcc (CMake: link ringzero::cuda)",
                  what));
}

/// Makes `r` (which must outlive every use: a constant) the program's table; null removes it.
inline void register_device_reproducible(const device_reproducible* r) noexcept {
  detail::device_reproducible_slot().store(r, std::memory_order_release);
}

}  // namespace ringzero::kernels
