// ringzero's CUDA kernels registered for ringzero-perf -T nccl -A ring|tree (ringzero's
// schedules on NCCL reduce with them), in a build without the libfabric device runner, which
// registers them otherwise.
#include "ringzero/kernels/cuda/device_reduction.cuh"
