// options::reproducible on device buffers: the passes of detail/reproducible_call.hpp with the
// per-element work in kernels (kernels::device_reproducible) and the collectives on device
// scratch, so they run wherever the transport moves device memory (NCCL; libfabric with
// FI_HMEM). The host reads the agreed windows back once per call: the digits' layout, and the
// length of the int64 collective, depend on them. Each pass is waited for before the next
// collective reads its output, since the transport's own stream knows nothing of ours.
#pragma once

#include <fmt/core.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/detail/device_executor.hpp"
#include "ringzero/error.hpp"
#include "ringzero/kernels/device_reproducible.hpp"
#include "ringzero/kernels/device_runtime.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/reproducible.hpp"

namespace ringzero::detail {

/// n elements of T in scratch slot `index` of the communicator's device cache; null for none.
template <class T>
[[nodiscard]] T* scratch_slot(device_cache& cache, std::size_t index, std::size_t n) {
  if (n == 0) return nullptr;
  return reinterpret_cast<T*>(cache.scratch(
      n * sizeof(T), [](const void*, std::size_t) {}, index));
}

/// The exclusive prefix sum of each block's digits (blocks of block_elems elements, the last
/// shorter), from the agreed windows; returns the total.
inline std::uint64_t block_offsets(const std::vector<std::int32_t>& win, std::size_t n,
                                   std::vector<std::uint64_t>& off) {
  const std::size_t blocks = (n + reproducible::block_elems - 1) / reproducible::block_elems;
  off.resize(blocks + 1);
  std::uint64_t at = 0;
  for (std::size_t b = 0; b < blocks; ++b) {
    off[b] = at;
    const std::size_t len = std::min(reproducible::block_elems, n - b * reproducible::block_elems);
    at += len *
          static_cast<std::uint64_t>(reproducible::words(reproducible::window_at(win.data(), b)));
  }
  off[blocks] = at;
  return at;
}

template <class Comm, class E>
void run_reproducible_device(Comm& comm, const algorithms::call<E>& c, const options& opt,
                             const kernels::device_runtime& rt,
                             const kernels::device_reproducible& k) {
  namespace rp = reproducible;
  const int n = comm.size();
  const auto un = static_cast<std::size_t>(n);
  const bool scatter = c.kind == collective::reduce_scatter;
  const std::size_t total = c.in.size();
  const std::size_t count = scatter ? c.out.size() : total;
  const auto divisor = static_cast<std::uint32_t>(c.reduction == op::avg ? n : 1);
  const dtype t = dtype_of<E>();
  // The host reads the windows between the passes, so each inner collective completes before
  // it returns (options::async does not carry over) and runs on the communicator's own stream.
  options inner = opt;
  inner.reproducible = false;
  inner.async = false;
  inner.stream = nullptr;
  options aux = inner;
  aux.algorithm = algorithm::automatic;
  // The scratch and stream stay with the communicator (device_cache, as the schedules'): a
  // fresh allocation and stream per call cost about 100 us on an H200, and memory a transport
  // registered (libfabric FI_HMEM) is forgotten there before it is freed.
  const int device = rt.current_device();
  device_cache& cache =
      device_cache_of(comm, rt, device, [&comm](const void* p, std::size_t bytes) {
        if constexpr (requires { comm.transport().forget_memory(p, bytes); })
          comm.transport().forget_memory(p, bytes);
        else
          (void)comm, (void)p, (void)bytes;  // nothing registered: nothing to forget
      });
  CUstream_st* s = cache.stream();
  // The passes read c.in on s: behind what the caller queued before the call.
  k.after(s, opt.stream);

  // 1. windows, agreed by max
  const std::size_t blocks = (total + rp::block_elems - 1) / rp::block_elems;
  std::int32_t* d_win = scratch_slot<std::int32_t>(cache, 1, 2 * blocks + 1);
  k.windows(t, c.in.data(), total, d_win, s);
  k.synchronize(s);
  all_reduce(comm, std::span<std::int32_t>(d_win, 2 * blocks + 1), op::max, aux);
  std::vector<std::int32_t> win(2 * blocks + 1);
  k.copy(win.data(), d_win, win.size() * sizeof(std::int32_t), s);
  k.synchronize(s);
  const bool special = win.back() != 0;

  // 2. digits, laid out by the windows, added as int64
  std::vector<std::uint64_t> off;
  const std::uint64_t words = block_offsets(win, total, off);
  std::size_t seg = 0;
  if (scatter) {
    const auto pos = [&](std::size_t i) {
      return i == total ? off[blocks] : rp::digit_position(win.data(), off.data(), i);
    };
    for (std::size_t r = 0; r < un; ++r)
      seg = std::max(seg, static_cast<std::size_t>(pos((r + 1) * count) - pos(r * count)));
  }
  const std::size_t q_len = scatter ? seg * un : static_cast<std::size_t>(words);
  std::uint64_t* d_off = scratch_slot<std::uint64_t>(cache, 2, off.size());
  std::int64_t* d_q = scratch_slot<std::int64_t>(cache, 3, q_len);
  if (!off.empty()) k.copy(d_off, off.data(), off.size() * sizeof(std::uint64_t), s);
  if (total > 0) k.digits(t, c.in.data(), total, d_win, d_off, count, seg, d_q, s);
  k.synchronize(s);
  std::int64_t* d_mine = d_q;
  const std::size_t from = scatter ? static_cast<std::size_t>(comm.rank()) * count : 0;
  if (scatter) {
    d_mine = scratch_slot<std::int64_t>(cache, 4, seg);
    reduce_scatter(comm, std::span<const std::int64_t>(d_q, q_len),
                   std::span<std::int64_t>(d_mine, seg), op::sum, inner);
  } else if (c.kind == collective::all_reduce) {
    all_reduce(comm, std::span<std::int64_t>(d_q, q_len), op::sum, inner);
  } else {
    reduce(comm, std::span<std::int64_t>(d_q, q_len), op::sum, c.root, inner);
  }
  std::int64_t* d_codes = nullptr;
  std::int64_t* d_my_codes = nullptr;
  if (special) {
    d_codes = scratch_slot<std::int64_t>(cache, 5, total);
    k.special_codes(t, c.in.data(), total, d_codes, s);
    k.synchronize(s);
    d_my_codes = d_codes;
    if (scatter) {
      d_my_codes = scratch_slot<std::int64_t>(cache, 6, count);
      reduce_scatter(comm, std::span<const std::int64_t>(d_codes, total),
                     std::span<std::int64_t>(d_my_codes, count), op::sum, aux);
    } else if (c.kind == collective::all_reduce) {
      all_reduce(comm, std::span<std::int64_t>(d_codes, total), op::sum, aux);
    } else {
      reduce(comm, std::span<std::int64_t>(d_codes, total), op::sum, c.root, aux);
    }
  }
  if (c.kind == collective::reduce && comm.rank() != c.root) return;

  // 3. rounded once into out
  if (count > 0) k.round(t, d_mine, d_win, d_off, from, count, divisor, c.out.data(), s);
  if (special && count > 0) k.apply_specials(t, d_my_codes, count, c.out.data(), s);
  k.synchronize(s);
}

}  // namespace ringzero::detail
