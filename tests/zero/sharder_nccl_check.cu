// The sharder takes any communicator, NCCL's too, and a CUDA program can use it: this file is
// what a trainer's .cu writes. nvcc compiles it as CUDA, instantiating every member of
// zero::sharder over nccl::communicator, so CI fails the moment the sharder stops compiling over
// NCCL or ringzero's headers stop compiling under nvcc (fmt's format strings included: see
// FMT_USE_CONSTEXPR in CMakeLists.txt). It is built, not run: the sharder's buffers are host
// memory today, which the NCCL communicator refuses at run time with invalid_argument.
#include <ringzero/transport/nccl.hpp>
#include <ringzero/zero/sharder.hpp>

template class ringzero::zero::sharder<ringzero::nccl::communicator, float>;
template class ringzero::zero::sharder<ringzero::nccl::communicator, ringzero::bfloat16>;
