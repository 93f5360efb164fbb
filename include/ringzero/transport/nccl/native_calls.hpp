// The NCCL transport's collectives as NCCL's own calls (nccl::transport::run_native): which NCCL
// call each collective is, the buffers each must find on the communicator's GPU (small blocking
// calls on host memory staged through it), and how the block collectives NCCL lacks
// (all_to_all, all_to_allv, gather, scatter) are made of groups of sends and receives.
#pragma once

#include <cuda_runtime.h>
#include <fmt/core.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <span>
#include <string_view>
#include <vector>

#include "ringzero/algorithm.hpp"
#include "ringzero/collective_table.hpp"
#include "ringzero/error.hpp"
#include "ringzero/transport/native.hpp"
#include "ringzero/transport/nccl/detail.hpp"
#include "ringzero/types.hpp"

namespace ringzero::nccl::detail {

/// Runs `c` on transport `t` (nccl::transport) on device copies of its buffers when they are small,
/// plain host memory and the call is blocking (T::host_staging_bytes); returns false to leave it to
/// the normal path (which refuses host memory). The in-place forms keep their meaning: an input
/// inside the output is copied with it.
template <class T>
bool staged_through_device(T& t, const native_call& c, const ringzero::options& opt) {
  if (opt.async || c.count == 0) return false;
  const std::size_t es = dtype_size(c.type);
  if (c.kind != collective::all_reduce && c.kind != collective::reduce_scatter &&
      c.kind != collective::all_gather && c.kind != collective::broadcast)
    return false;
  const collective_descriptor& desc = *builtin_collectives::find(c.kind);
  const std::size_t in_len = desc.in_elems(c.count, t.size_, t.rank_, c.root);
  const std::size_t out_len = desc.out_elems(c.count, t.size_, t.rank_, c.root);
  const std::size_t in_bytes = in_len * es, out_bytes = out_len * es;
  const auto* in = static_cast<const std::byte*>(c.in);
  auto* out = static_cast<std::byte*>(c.out);
  const bool in_inside = in_len > 0 && in >= out && in + in_bytes <= out + out_bytes;
  if (in_bytes + out_bytes > T::host_staging_bytes || !plain_host(out, out_bytes) ||
      (in_len > 0 && !in_inside && !plain_host(in, in_bytes)))
    return false;
  const std::string_view what = collective_name(c.kind);
  t.ensure_usable(what);
  device_guard guard(t.device_);
  cudaStream_t s = t.stream_for(opt);
  const stream_scratch scratch(t.device_, s, out_bytes + (in_inside ? 0 : in_bytes));
  auto* dout = static_cast<std::byte*>(scratch.data());
  std::byte* din = in_inside ? dout + (in - out) : dout + out_bytes;
  if (in_inside)
    check_cuda(cudaMemcpyAsync(dout, out, out_bytes, cudaMemcpyHostToDevice, s),
               "nccl: staging host memory");
  else if (in_len > 0)
    check_cuda(cudaMemcpyAsync(din, in, in_bytes, cudaMemcpyHostToDevice, s),
               "nccl: staging host memory");
  native_call d = c;
  d.in = in_len > 0 ? din : dout;
  d.out = dout;
  t.run_native(d, {.timeout = opt.timeout, .stream = s});
  check_cuda(cudaMemcpyAsync(out, dout, out_bytes, cudaMemcpyDeviceToHost, s),
             "nccl: staging host memory");
  const std::chrono::nanoseconds limit = opt.timeout.count() > 0 ? opt.timeout : t.timeout_;
  t.wait("staging host memory", s, std::chrono::steady_clock::now() + limit, limit);
  return true;
}

/// Refuses any buffer of a call (not all_to_allv, barrier or send_recv) that this rank's GPU
/// cannot address; the one the call shares in place is checked once.
template <class T>
void check_operands(const T& t, const native_call& c) {
  // Every buffer this rank uses must be this GPU's memory, as large as the descriptor's
  // extent says; in place, the smaller one lies inside the larger and is covered by it.
  const collective_descriptor& d = *builtin_collectives::find(c.kind);
  const std::size_t es = dtype_size(c.type);
  const auto* in = static_cast<const std::byte*>(c.in);
  const auto* out = static_cast<const std::byte*>(c.out);
  const bool uses_in = d.uses_in(t.rank_, c.root), uses_out = d.uses_out(t.rank_, c.root);
  const bool in_place = uses_in && uses_out && d.in_place(in, out, c.count * es, t.rank_);
  const bool in_is_part = in_place && d.out.size == extent::blocks && d.in.size != extent::blocks;
  if (uses_in && !in_is_part)
    check_device_buffer(d.name, "input", in, d.in_elems(c.count, t.size_, t.rank_, c.root) * es,
                        t.device_);
  if (uses_out && !(in_place && !in_is_part))
    check_device_buffer(d.name, "output", out, d.out_elems(c.count, t.size_, t.rank_, c.root) * es,
                        t.device_);
}

/// One validated collective on transport `t` (nccl::transport, whose rank, size, device, stream,
/// scratch, operand checks and enqueue it uses).
template <class T>
void run_native(T& t, const native_call& c, const ringzero::options& opt) {
  if (staged_through_device(t, c, opt)) return;
  const std::string_view what = collective_name(c.kind);
  const std::size_t es = dtype_size(c.type);
  const ncclDataType_t type = to_nccl(c.type);
  const auto n = static_cast<std::size_t>(t.size_);
  const bool is_root = t.rank_ == c.root;
  const auto* in = static_cast<const std::byte*>(c.in);
  auto* out = static_cast<std::byte*>(c.out);
  const auto check = [&](std::string_view name, const void* p, std::size_t elems) {
    check_device_buffer(what, name, p, elems * es, t.device_);
  };
  switch (c.kind) {
    case collective::all_reduce:
      check_operands(t, c);
      return t.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
        return ncclAllReduce(in, out, c.count, type, to_nccl(c.reduction), h, s);
      });
    case collective::reduce_scatter:
      check_operands(t, c);
      return t.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
        return ncclReduceScatter(in, out, c.count, type, to_nccl(c.reduction), h, s);
      });
    case collective::all_gather:
      check_operands(t, c);
      return t.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
        return ncclAllGather(in, out, c.count, type, h, s);
      });
    case collective::broadcast:
      check_operands(t, c);
      return t.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
        return ncclBroadcast(is_root ? in : out, out, c.count, type, c.root, h, s);
      });
    case collective::reduce:
      check_operands(t, c);
      return t.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
        return ncclReduce(in, is_root ? out : nullptr, c.count, type, to_nccl(c.reduction), c.root,
                          h, s);
      });
    case collective::barrier: {
      // A one-element all_reduce, always waited for: only the deadline of opt applies.
      const std::span<std::byte> buf = t.scratch();
      return t.enqueue(what, {.timeout = opt.timeout}, [&](ncclComm_t h, cudaStream_t s) {
        return ncclAllReduce(buf.data(), buf.data(), 1, ncclInt32, ncclSum, h, s);
      });
    }
    case collective::send_recv:
      if (c.peer >= 0) check("send buffer", in, c.count);
      if (c.from >= 0) check("receive buffer", out, c.recv_count);
      // One NCCL group, so a ring of ranks each sending to the next cannot deadlock.
      return t.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
        if (const ncclResult_t r = ncclGroupStart(); r != ncclSuccess) return r;
        ncclResult_t rr = ncclSuccess, sr = ncclSuccess;
        if (c.from >= 0) rr = ncclRecv(out, c.recv_count, type, c.from, h, s);
        if (c.peer >= 0) sr = ncclSend(in, c.count, type, c.peer, h, s);
        const ncclResult_t er = ncclGroupEnd();
        return rr != ncclSuccess ? rr : sr != ncclSuccess ? sr : er;
      });
    case collective::all_to_all: {
      // c.count is one rank's block. In place the input is first copied to a stream-ordered
      // temporary, since a peer may write a block before this rank has sent it.
      const std::size_t total = c.count * n;
      check_operands(t, c);
      std::vector<std::size_t> counts(n, c.count), displs(n);
      for (std::size_t i = 0; i < n; ++i) displs[i] = i * c.count;
      if (out != in)
        return t.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
          return exchange_blocks(h, s, t.size_, type, es, in, counts, displs, out, counts, displs);
        });
      const stream_scratch copy(t.device_, opt.stream != nullptr ? opt.stream : t.stream_,
                                total * es);
      return t.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
        if (const ncclResult_t r = cuda_status(
                cudaMemcpyAsync(copy.data(), in, total * es, cudaMemcpyDeviceToDevice, s));
            r != ncclSuccess)
          return r;
        return exchange_blocks(h, s, t.size_, type, es, static_cast<const std::byte*>(copy.data()),
                               counts, displs, out, counts, displs);
      });
    }
    case collective::all_to_allv: {
      std::size_t in_len = 0, out_len = 0;
      for (std::size_t r = 0; r < n; ++r) {
        in_len = std::max(in_len, c.send_displs[r] + c.send_counts[r]);
        out_len = std::max(out_len, c.recv_displs[r] + c.recv_counts[r]);
      }
      if (in_len > 0) check("input", in, in_len);
      if (out_len > 0) check("output", out, out_len);
      return t.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
        return exchange_blocks(h, s, t.size_, type, es, in, c.send_counts, c.send_displs, out,
                               c.recv_counts, c.recv_displs);
      });
    }
    case collective::gather: {
      std::byte* own = is_root ? out + c.count * es * static_cast<std::size_t>(c.root) : nullptr;
      check_operands(t, c);
      return t.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
        if (!is_root) return ncclSend(in, c.count, type, c.root, h, s);
        if (own != in)
          if (const ncclResult_t r =
                  cuda_status(cudaMemcpyAsync(own, in, c.count * es, cudaMemcpyDeviceToDevice, s));
              r != ncclSuccess)
            return r;
        return root_group(t.size_, c.root, [&](int p) {
          return ncclRecv(out + c.count * es * static_cast<std::size_t>(p), c.count, type, p, h, s);
        });
      });
    }
    case collective::scatter: {
      const std::byte* own =
          is_root ? in + c.count * es * static_cast<std::size_t>(c.root) : nullptr;
      check_operands(t, c);
      return t.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
        if (!is_root) return ncclRecv(out, c.count, type, c.root, h, s);
        if (own != out)
          if (const ncclResult_t r =
                  cuda_status(cudaMemcpyAsync(out, own, c.count * es, cudaMemcpyDeviceToDevice, s));
              r != ncclSuccess)
            return r;
        return root_group(t.size_, c.root, [&](int p) {
          return ncclSend(in + c.count * es * static_cast<std::size_t>(p), c.count, type, p, h, s);
        });
      });
    }
  }
  throw unsupported(fmt::format("nccl: {} has no NCCL collective", what));
}

}  // namespace ringzero::nccl::detail
