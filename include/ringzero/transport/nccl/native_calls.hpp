// The NCCL transport's collectives as NCCL's own calls (nccl::transport::run_native): which NCCL
// call each collective is, the buffers each must find on the communicator's GPU, and how the
// block collectives NCCL lacks (all_to_all, all_to_allv, gather, scatter) are made of groups of
// sends and receives.
#pragma once

#include <cuda_runtime.h>
#include <fmt/core.h>
#include <nccl.h>

#include <algorithm>
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

/// One validated collective on transport `t` (nccl::transport, whose rank, size, device, stream,
/// scratch, operand checks and enqueue it uses).
template <class T>
void run_native(T& t, const native_call& c, const ringzero::options& opt) {
  if (t.staged_through_device(c, opt)) return;
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
      t.check_operands(c);
      return t.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
        return ncclAllReduce(in, out, c.count, type, to_nccl(c.reduction), h, s);
      });
    case collective::reduce_scatter:
      t.check_operands(c);
      return t.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
        return ncclReduceScatter(in, out, c.count, type, to_nccl(c.reduction), h, s);
      });
    case collective::all_gather:
      t.check_operands(c);
      return t.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
        return ncclAllGather(in, out, c.count, type, h, s);
      });
    case collective::broadcast:
      t.check_operands(c);
      return t.enqueue(what, opt, [&](ncclComm_t h, cudaStream_t s) {
        return ncclBroadcast(is_root ? in : out, out, c.count, type, c.root, h, s);
      });
    case collective::reduce:
      t.check_operands(c);
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
      t.check_operands(c);
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
      t.check_operands(c);
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
      t.check_operands(c);
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
