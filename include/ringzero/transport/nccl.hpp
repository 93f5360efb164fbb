// The NCCL backend: ringzero's collectives on GPU buffers, computed by NCCL. Link ringzero::nccl.
//
//   #include <ringzero/ringzero.hpp>
//   #include <ringzero/transport/nccl.hpp>
//   auto comm = ringzero::nccl::communicator::from_env();
//   ringzero::all_reduce(comm, std::span<float>(d_grads, n), ringzero::op::avg);      // in place
//   ringzero::all_gather(comm, d_shard, d_full, {.stream = s, .async = true});
//
// The calls are collectives.hpp's, with its signatures, validation and messages; the
// communicator hands each validated call to NCCL (nccl::transport::run_native), so NCCL picks
// its own algorithm and protocol (NCCL_ALGO and NCCL_PROTO steer it). options::algorithm ring or
// tree runs ringzero's algorithm instead, over ncclSend/ncclRecv with ringzero's kernels
// (on nccl::transport::with_device_executor; a fixed reduction order, which NCCL does not
// promise): the reducing ones need <ringzero/kernels/cuda/device_reduction.cuh> in one .cu file
// of the program. On top of NCCL:
//   - every buffer is checked to be memory the communicator's GPU can address before anything
//     is enqueued (invalid_argument);
//   - by default a call returns once the result is in place, and a call that misses its deadline
//     aborts the communicator and throws timeout_error; options::async returns once enqueued
//     (comm.transport().synchronize() waits with the deadline);
//   - RINGZERO_CHECK=1 compares (collective, count, type, op, root) across ranks first.
// Cost: NCCL's (ring or tree over NVLink/PCIe/network, reduction in NCCL's kernels) plus, per
// call, two cudaPointerGetAttributes per distinct buffer (about 1.5 us for an out-of-place call
// on an H100 host) and, when blocking, polling the stream.
#pragma once

#include "ringzero/communicator.hpp"
#include "ringzero/transport/nccl/detail.hpp"
#include "ringzero/transport/nccl/transport.hpp"

namespace ringzero::nccl {

/// ringzero's communicator over NCCL: communicator::from_env() joins the job;
/// communicator::single() is a one-rank world for tests and single-GPU runs.
using communicator = ringzero::communicator<transport>;

}  // namespace ringzero::nccl
