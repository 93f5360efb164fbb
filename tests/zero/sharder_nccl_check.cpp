// The sharder takes any communicator, NCCL's too: this file instantiates every member of
// zero::sharder over nccl::communicator, the way every NCCL translation unit is compiled (the
// host compiler with CUDA's and NCCL's headers; nvcc only builds kernels, and its front end
// cannot evaluate fmt 9's compile-time format checks), so CI fails the moment the sharder stops
// compiling over NCCL. It is built, not run: the sharder's buffers are
// host memory today, which the NCCL communicator refuses at run time with invalid_argument.
#include <ringzero/transport/nccl.hpp>
#include <ringzero/zero/sharder.hpp>

template class ringzero::zero::sharder<ringzero::nccl::communicator, float>;
template class ringzero::zero::sharder<ringzero::nccl::communicator, ringzero::bfloat16>;
