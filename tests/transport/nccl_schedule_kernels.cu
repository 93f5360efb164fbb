// Compiled by nvcc into test_nccl_gpu, wherever CMake finds nvcc and NCCL (so CI compiles it on
// machines without a GPU): it registers ringzero's CUDA reductions for the program, as a user's
// .cu file would, and instantiates the NCCL executor with every schedule and the forced-
// algorithm path of every collective the schedules implement, for every element type.
#include <cstdint>
#include <span>

#include "ringzero/algorithms/schedule.hpp"
#include "ringzero/collectives.hpp"
#include "ringzero/kernels/cuda/device_reduction.cuh"
#include "ringzero/transport/nccl.hpp"
#include "ringzero/types.hpp"

namespace {

/// What nccl::transport::with_device_executor hands the executor: a callable taking each
/// group's status.
struct settle_status {
  void operator()(ncclResult_t) const {}
};

}  // namespace

namespace rz = ringzero;

#define RINGZERO_CHECK_SCHEDULES(E)                                                                \
  static_assert(                                                                                   \
      rz::algorithms::schedule::executor<rz::nccl::detail::executor<E, settle_status>, E>);        \
  template void rz::algorithms::schedule::run<E, rz::nccl::detail::executor<E, settle_status>>(    \
      rz::nccl::detail::executor<E, settle_status>&, rz::algorithm,                                \
      const rz::algorithms::call<E>&, std::span<E>);                                               \
  template void rz::all_reduce<rz::nccl::transport, E>(rz::communicator<rz::nccl::transport>&,     \
                                                       std::span<const E>, std::span<E>, rz::op,   \
                                                       const rz::options&);                        \
  template void rz::reduce_scatter<rz::nccl::transport, E>(rz::communicator<rz::nccl::transport>&, \
                                                           std::span<const E>, std::span<E>,       \
                                                           rz::op, const rz::options&);            \
  template void rz::all_gather<rz::nccl::transport, E>(rz::communicator<rz::nccl::transport>&,     \
                                                       std::span<const E>, std::span<E>,           \
                                                       const rz::options&);                        \
  template void rz::broadcast<rz::nccl::transport, E>(rz::communicator<rz::nccl::transport>&,      \
                                                      std::span<const E>, std::span<E>, int,       \
                                                      const rz::options&);                         \
  template void rz::reduce<rz::nccl::transport, E>(rz::communicator<rz::nccl::transport>&,         \
                                                   std::span<const E>, std::span<E>, rz::op, int,  \
                                                   const rz::options&);

RINGZERO_CHECK_SCHEDULES(std::int8_t)
RINGZERO_CHECK_SCHEDULES(std::uint8_t)
RINGZERO_CHECK_SCHEDULES(std::int32_t)
RINGZERO_CHECK_SCHEDULES(std::uint32_t)
RINGZERO_CHECK_SCHEDULES(std::int64_t)
RINGZERO_CHECK_SCHEDULES(std::uint64_t)
RINGZERO_CHECK_SCHEDULES(rz::float16)
RINGZERO_CHECK_SCHEDULES(float)
RINGZERO_CHECK_SCHEDULES(double)
RINGZERO_CHECK_SCHEDULES(rz::bfloat16)
