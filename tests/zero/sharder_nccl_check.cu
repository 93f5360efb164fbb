// The sharder over NCCL as a CUDA trainer compiles it: this file is what a trainer's .cu writes.
// nvcc compiles it as CUDA, instantiating every member of zero::sharder over nccl::communicator
// on its device memory space (zero/cuda_space.cuh: device buffers, streams and events, the
// kernels of kernels/cuda/), for every parameter type and both gradient types (the reducers of
// the parameter type and of fp32 are both instantiated), so CI fails the moment any of it stops
// compiling under nvcc. It is built, not run: running needs a GPU (examples/cuda_train runs it).
#include <ringzero/transport/nccl.hpp>
#include <ringzero/zero/sharder.hpp>

#include <type_traits>

static_assert(std::is_same_v<ringzero::zero::memory_space_t<ringzero::nccl::communicator>,
                             ringzero::zero::cuda_device_space>,
              "a CUDA translation unit gets the NCCL communicator's device memory space");
static_assert(ringzero::zero::device_space<ringzero::zero::cuda_device_space>);

template class ringzero::zero::sharder<ringzero::nccl::communicator, float>;
template class ringzero::zero::sharder<ringzero::nccl::communicator, ringzero::bfloat16>;
template class ringzero::zero::sharder<ringzero::nccl::communicator, ringzero::float16>;
