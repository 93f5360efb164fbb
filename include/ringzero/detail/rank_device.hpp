// Which GPU a rank of this process uses, decided in one place for every backend that puts a rank
// on a GPU (NCCL; the tests' stand-in for it). The backend then makes it the calling thread's
// current device and leaves it so: a rank's device is current in the caller's thread from the
// communicator's construction, so the trainer's cudaMalloc, streams and kernels land on the GPU
// its collectives use, as NCCL users who call cudaSetDevice(local_rank) first expect.
#pragma once

#include <fmt/core.h>

#include "ringzero/bootstrap/environment.hpp"
#include "ringzero/error.hpp"

namespace ringzero::detail {

/// The device last chosen for a rank on this thread, or -1.
[[nodiscard]] inline int& thread_rank_device() noexcept {
  thread_local int device = -1;
  return device;
}

/// The device of rank `rank` (of its communicator) among `devices` visible ones: `requested`
/// where it is not negative; else the launcher's local rank (bootstrap::local_rank_from_env);
/// else the device a rank on this thread used before, so that a rank keeps its GPU, and the
/// memory it holds there, through the generations of an elastic job; else `rank`. The last two
/// modulo `devices`, as the local rank. Remembered for this thread.
[[nodiscard]] inline int choose_rank_device(int requested, int devices, int rank) {
  if (devices < 1) throw unsupported("no CUDA device is visible to this process");
  if (requested >= devices)
    throw invalid_argument(
        fmt::format("device {} was requested but only {} are visible", requested, devices));
  int d = requested;
  if (d < 0) {
    if (const auto local = bootstrap::local_rank_from_env())
      d = *local % devices;
    else if (thread_rank_device() >= 0)
      d = thread_rank_device() % devices;
    else
      d = rank % devices;
  }
  thread_rank_device() = d;
  return d;
}

}  // namespace ringzero::detail
