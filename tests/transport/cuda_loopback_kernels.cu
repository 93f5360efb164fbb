// ringzero's CUDA kernels (reductions, options::reproducible's passes) and runtime table,
// registered for test_cuda_loopback, whose own source is plain C++.
#include "ringzero/kernels/cuda/device_reduction.cuh"
