// The kernels of reduce.cuh behind kernels::device_reduction's run-time table, registered when
// the program starts. Include this in one .cu file of a program (CMake: link ringzero::cuda)
// to let the NCCL backend run ringzero's reducing schedules on GPU buffers (options::algorithm
// ring or tree); a program without it gets an error naming this header instead. Instantiates
// combine and finish_avg for every element type and op.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "ringzero/kernels/cuda/reduce.cuh"
#include "ringzero/kernels/device_reduction.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::kernels::cuda {

namespace detail {

inline void combine_any(dtype type, op o, const void* a, const void* b, void* out, std::size_t n,
                        CUstream_st* stream) {
  visit_dtype(type, [&](auto zero) {
    using T = decltype(zero);
    cuda::combine<T>(o, static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), n,
                     stream);
  });
}

inline void finish_avg_any(dtype type, void* data, std::size_t n, int ranks, CUstream_st* stream) {
  visit_dtype(type, [&](auto zero) {
    using T = decltype(zero);
    cuda::finish_avg<T>(static_cast<T*>(data), n, ranks, stream);
  });
}

}  // namespace detail

/// The table this header registers.
inline constexpr device_reduction device_reductions{&detail::combine_any, &detail::finish_avg_any};

namespace detail {

// Registration at start-up, so that merely including this header in a .cu file is enough: the
// collectives are plain C++ and cannot name a kernel themselves.
inline const bool device_reductions_registered =
    (register_device_reduction(device_reductions), true);

}  // namespace detail

}  // namespace ringzero::kernels::cuda
