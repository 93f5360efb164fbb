// The executor (ringzero/executor.hpp) that runs ringzero's schedules on GPU buffers over an
// NCCL communicator: each step is one NCCL group of ncclRecv/ncclSend, and the local
// work (reductions, copies) is enqueued on the same stream after it, so the stream orders
// everything and the host never waits for the device inside a call. Reductions go through the
// run-time table kernels/cuda/device_reduction.cuh registers, since this header is plain C++.
//
// A non-blocking NCCL communicator may answer ncclGroupEnd before the group's work is on the
// stream; a kernel enqueued then would run ahead of the receive it reads. So after every group
// the executor hands NCCL's status to `settle`, which waits (on the host, with the call's
// deadline) until NCCL has enqueued the group: nccl::transport::with_device_executor passes its
// own.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <span>

#include "ringzero/error.hpp"
#include "ringzero/executor.hpp"
#include "ringzero/kernels/device_reduction.hpp"
#include "ringzero/op.hpp"
#include "ringzero/transport/nccl/detail.hpp"
#include "ringzero/types.hpp"

namespace ringzero::nccl::detail {

/// Settle: invocable with the ncclResult_t of each group; returns once the group is enqueued,
/// throws (after aborting the communicator) on an error or a missed deadline.
template <element E, class Settle>
class executor {
 public:
  using transfer_in = ringzero::transfer<const E>;
  using transfer_out = ringzero::transfer<E>;

  /// `kernels` may be null for schedules that do not reduce.
  executor(ncclComm_t comm, cudaStream_t stream, int rank, int size,
           const kernels::device_reduction* kernels, Settle& settle) noexcept
      : comm_(comm),
        stream_(stream),
        rank_(rank),
        size_(size),
        kernels_(kernels),
        settle_(settle) {}

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }

  void exchange(std::span<const transfer_in> sends, std::span<const transfer_out> recvs) {
    constexpr ncclDataType_t type = nccl_type_v<E>;
    ncclResult_t first = ncclGroupStart();
    if (first == ncclSuccess) {
      for (const auto& t : recvs)
        if (first == ncclSuccess) first = ncclRecv(t.data, t.count, type, t.peer, comm_, stream_);
      for (const auto& t : sends)
        if (first == ncclSuccess) first = ncclSend(t.data, t.count, type, t.peer, comm_, stream_);
      const ncclResult_t end = ncclGroupEnd();
      if (first == ncclSuccess) first = end;
    }
    settle_(first);
  }

  void combine(op o, const E* a, const E* b, E* out, std::size_t n) {
    reductions().combine(dtype_of<E>(), o, a, b, out, n, stream_);
  }

  void finish_avg(E* data, std::size_t n, int ranks) {
    reductions().finish_avg(dtype_of<E>(), data, n, ranks, stream_);
  }

  void copy(E* dst, const E* src, std::size_t n) {
    check_cuda(cudaMemcpyAsync(dst, src, n * sizeof(E), cudaMemcpyDeviceToDevice, stream_),
               "nccl: cudaMemcpyAsync in a schedule");
  }

 private:
  // Reached only by a schedule that reduces without a table: collectives.hpp refuses such a
  // call first, so this is a guard, not the error users see.
  [[nodiscard]] const kernels::device_reduction& reductions() const {
    if (kernels_ == nullptr)
      throw unsupported("nccl: a schedule reduced without ringzero's CUDA kernels registered");
    return *kernels_;
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_;
  int size_;
  const kernels::device_reduction* kernels_;
  Settle& settle_;
};

}  // namespace ringzero::nccl::detail
