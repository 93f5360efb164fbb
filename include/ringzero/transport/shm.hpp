// The shm transport's communicator: ranks as processes on one host, talking through one
// shared-memory segment (the transport: transport/shm/transport.hpp).
//
//   auto comm = ringzero::shm::communicator::from_env();   // ringzero-run, torchrun, Slurm, ...
//   auto grads = comm.allocate<float>(n);                 // optional: symmetric memory
//   ringzero::all_reduce(comm, grads.local(), ringzero::op::sum);
#pragma once

#include "ringzero/communicator.hpp"
#include "ringzero/transport/shm/transport.hpp"

namespace ringzero::shm {

using communicator = ringzero::communicator<transport>;

}  // namespace ringzero::shm
