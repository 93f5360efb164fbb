// How an NCCL communicator is created (nccl::transport's constructors take it): the rank's
// device, the deadline, the store key, NCCL's own configuration and the dead-rank probe.
#pragma once

#include <nccl.h>

#include <chrono>
#include <functional>
#include <string>

namespace ringzero::nccl {

/// How a communicator is created.
struct config {
  /// CUDA device of this rank; -1 picks the launcher's local rank, else the device a rank on
  /// this thread used before, else the rank, modulo the number of visible devices (see
  /// transport.hpp). Current in the constructing thread from construction on. NCCL allows one
  /// rank per GPU per communicator on one host (see docs/nccl.md for several ranks on one GPU).
  int device = -1;
  /// Deadline for creation and the default for every blocking call; 0 = RINGZERO_TIMEOUT
  /// (default 300 s).
  std::chrono::nanoseconds timeout{0};
  /// Store key prefix under which rank 0 publishes the NCCL unique id; empty =
  /// "ringzero/nccl/<size>". Groups of different ranks that create communicators through one
  /// store at the same time need different keys.
  std::string key{};
  /// Handed to ncclCommInitRankConfig (CTA counts, network name, ...); ringzero sets blocking = 0.
  ncclConfig_t nccl = NCCL_CONFIG_INITIALIZER;
  /// Asked, at most every 100 ms while a call waits and before the communicator is closed, for a
  /// rank of this communicator known dead (-1: none): what a launcher that reaped a process or a
  /// heartbeat that stopped knows before NCCL would. elastic::session::communicator fills it in.
  std::function<int()> dead_rank{};
};

/// Whether an adopted ncclComm_t is destroyed with the communicator.
enum class ownership { owned, borrowed };

}  // namespace ringzero::nccl
