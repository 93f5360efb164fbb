// options::reproducible on device buffers: the passes of detail/reproducible_call.hpp with the
// per-element work in kernels (kernels::device_reproducible) and the collectives on device
// scratch, so they run wherever the transport moves device memory (NCCL; libfabric with
// FI_HMEM). The digits' layout is computed on the device too (a scan of the agreed windows); the
// host reads back only what sizes the int64 collective: where each rank's part starts, and
// whether any term was inf or NaN. Each pass is waited for before the next collective reads its
// output, since the transport's own stream knows nothing of ours; every such wait has the call's
// deadline. The passes run on the device the caller names (the transport's for NCCL, the
// buffers' for libfabric), current for the call whatever the calling thread's device is.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/algorithms/descriptor.hpp"
#include "ringzero/algorithms/table.hpp"
#include "ringzero/collective_table.hpp"
#include "ringzero/detail/device_executor.hpp"
#include "ringzero/detail/reproducible_call.hpp"
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

/// Which of the device cache's scratch slots holds what (slot 0 is the schedules').
enum scratch_use : std::size_t {
  windows_slot = 1,
  offsets_slot,
  digits_slot,
  mine_slot,
  codes_slot,
  my_codes_slot,
  bounds_slot,
  layout_slot,
};

/// `Table`: the algorithms of the call, which the digits' collective runs with (it is the
/// call's); the collective is any whose descriptor reduces, with an output of the input's
/// elements or of this rank's block of them (detail/reproducible_call.hpp).
template <class Table = algorithms::builtin, class Comm, class E>
void run_reproducible_device(Comm& comm, const algorithms::call<E>& c, const options& opt,
                             const kernels::device_runtime& rt,
                             const kernels::device_reproducible& k, int device) {
  namespace rp = reproducible;
  const collective_descriptor& d = algorithms::describe(c);
  const int n = comm.size();
  const auto un = static_cast<std::size_t>(n);
  const bool scatter = sums_one_block(d);
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
  const device_scope current(rt, device);
  device_cache& cache = device_cache_of(comm, rt, device);
  CUstream_st* s = cache.stream();
  const std::chrono::nanoseconds limit =
      opt.timeout.count() > 0 ? opt.timeout : std::chrono::nanoseconds(comm.timeout());
  const auto deadline = clock::now() + limit;
  const auto wait = [&] { wait_for_stream(comm, rt, s, deadline, limit, d.name); };
  // The passes read c.in on s: behind what the caller queued before the call.
  k.after(s, opt.stream);

  // 1. windows, agreed by max
  const std::size_t blocks = rp::blocks(total);
  std::int32_t* d_win = scratch_slot<std::int32_t>(cache, windows_slot, 2 * blocks + 1);
  k.windows(t, c.in.data(), total, d_win, s);
  wait();
  pass<algorithms::builtin>(comm, builtin_collectives::all_reduce,
                            std::span<const std::int32_t>(d_win, 2 * blocks + 1),
                            std::span<std::int32_t>(d_win, 2 * blocks + 1), op::max, 0, aux);

  // 2. the layout the windows give, on the device. It was read back and scanned on the host: at
  // 128 MiB, 4 MiB copied each way and a loop over 524,288 blocks in a call of 3.8 ms against
  // the plain call's 67 us on an H200 (docs/performance.md). The host needs only each part's
  // bounds and the inf/NaN flag.
  const std::size_t parts = scatter ? un : 1;
  std::uint64_t* d_off = scratch_slot<std::uint64_t>(cache, offsets_slot, blocks + 1);
  std::uint64_t* d_bounds = scratch_slot<std::uint64_t>(cache, bounds_slot, parts + 1);
  // At least a byte: a null scratch would make the scan only report the size it needs.
  const std::size_t layout_bytes = std::max<std::size_t>(k.layout_scratch(total), 1);
  std::byte* d_layout = scratch_slot<std::byte>(cache, layout_slot, layout_bytes);
  k.layout(d_win, total, count, parts, d_off, d_bounds, d_layout, layout_bytes, s);
  std::vector<std::uint64_t> bounds(parts + 1);
  std::int32_t flag = 0;
  k.copy(bounds.data(), d_bounds, bounds.size() * sizeof(std::uint64_t), s);
  k.copy(&flag, d_win + 2 * blocks, sizeof flag, s);
  wait();
  const bool special = flag != 0;

  // 3. digits, laid out by the windows, added as int64 (reduce_scatter: each rank's part in a
  // segment as long as the longest part)
  std::size_t seg = 0;
  if (scatter)
    for (std::size_t r = 0; r < un; ++r)
      seg = std::max(seg, static_cast<std::size_t>(bounds[r + 1] - bounds[r]));
  const std::size_t q_len = scatter ? seg * un : static_cast<std::size_t>(bounds[1]);
  std::int64_t* d_q = scratch_slot<std::int64_t>(cache, digits_slot, q_len);
  if (total > 0) k.digits(t, c.in.data(), total, d_win, d_off, count, seg, d_q, s);
  wait();
  std::int64_t* d_mine = d_q;
  const std::size_t from = scatter ? static_cast<std::size_t>(comm.rank()) * count : 0;
  // The call's own collective on the digits: into this rank's segment, or in place.
  if (scatter) d_mine = scratch_slot<std::int64_t>(cache, mine_slot, seg);
  pass<Table>(comm, d, std::span<const std::int64_t>(d_q, q_len),
              std::span<std::int64_t>(d_mine, scatter ? seg : q_len), op::sum, c.root, inner);
  std::int64_t* d_codes = nullptr;
  std::int64_t* d_my_codes = nullptr;
  if (special) {
    d_codes = scratch_slot<std::int64_t>(cache, codes_slot, total);
    k.special_codes(t, c.in.data(), total, d_codes, s);
    wait();
    d_my_codes = scatter ? scratch_slot<std::int64_t>(cache, my_codes_slot, count) : d_codes;
    pass<Table>(comm, d, std::span<const std::int64_t>(d_codes, total),
                std::span<std::int64_t>(d_my_codes, scatter ? count : total), op::sum, c.root, aux);
  }
  if (!d.uses_out(comm.rank(), c.root)) return;

  // 4. rounded once into out
  if (count > 0) k.round(t, d_mine, d_win, d_off, from, count, divisor, c.out.data(), s);
  if (special && count > 0) k.apply_specials(t, d_my_codes, count, c.out.data(), s);
  wait();
}

}  // namespace ringzero::detail
