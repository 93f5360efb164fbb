// The libfabric transport: ranks as processes, on one host or many, over any FI_EP_RDM
// provider with tagged messages (efa on AWS, shm inside a node, tcp;ofi_rxm or verbs;ofi_rxm
// anywhere, sockets as a fallback). Link ringzero::libfabric.
//
//   auto comm = ringzero::libfabric::communicator::from_env();  // torchrun, Slurm, Open MPI,
//   ringzero::all_reduce(comm, std::span<float>(grads), ringzero::op::sum);  // ringzero-run
//
// Provider: options::provider, else FI_PROVIDER, else efa where present, else shm when every
// rank is on one host, else tcp;ofi_rxm. Rank 0 decides and the others follow, so all ranks
// use the same one.
//
// Rails: options::rails, else RINGZERO_RAILS=eth0,eth1 (the NICs as the provider names its
// domains: interfaces for tcp, devices for efa; alike on every host) opens one endpoint per NIC.
// A message travels on one of them, chosen from its tag, or from options::stripe_bytes (128 KiB)
// up is cut into one piece per rail (libfabric/engine.hpp).
//
// A communicator is used from one thread at a time; it and the communicators split from it
// share one engine (the transport) and may be used from different threads (calls are
// serialized).
// Progress is manual: messages move while some rank's thread is inside test() or progress(),
// which every blocking collective calls.
//
// CUDA device buffers (the EFA GPUDirect RDMA case): open with options::device_memory, include
// <ringzero/kernels/cuda/device_reduction.cuh> in one .cu file of the program, and pass them to
// ringzero::all_reduce and friends: the communicator registers them (register_device_buffer)
// and runs ringzero's schedules on them, the provider reading and writing device memory
// directly and ringzero's kernels reducing. See docs/efa.md.
#pragma once

#include "ringzero/communicator.hpp"
#include "ringzero/transport/libfabric/transport.hpp"

namespace ringzero::libfabric {

/// ringzero's communicator over libfabric: communicator::from_env() joins the job.
using communicator = ringzero::communicator<transport>;

}  // namespace ringzero::libfabric
