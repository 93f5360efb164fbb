// Element-wise reductions on device buffers, enqueued on a CUDA stream: the GPU counterpart of
// reduce/cpu.hpp, for every element type and op, with its exact arithmetic (kernels/reduce.hpp).
// Cost: one pass over the operands, 16-byte loads and stores where the three pointers are
// 16-byte aligned; memory-bound, so about (3 * n * sizeof(T)) / (the device's copy bandwidth).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "ringzero/error.hpp"
#include "ringzero/kernels/cuda/detail/launch.cuh"
#include "ringzero/kernels/reduce.hpp"
#include "ringzero/op.hpp"
#include "ringzero/types.hpp"

namespace ringzero::kernels::cuda {

namespace detail {

// No __restrict__: out may alias a or b, and each element is read before it is written.
template <op O, class T>
__global__ void combine_kernel(const T* a, const T* b, T* out, std::size_t n, bool vector) {
  constexpr int V = static_cast<int>(16 / sizeof(T));
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t tid = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  std::size_t done = 0;
  if (vector) {
    const std::size_t nv = n / V;
    for (std::size_t i = tid; i < nv; i += stride) {
      const vec<T, V> x = load<T, V>(a + i * V);
      const vec<T, V> y = load<T, V>(b + i * V);
      vec<T, V> r;
#pragma unroll
      for (int k = 0; k < V; ++k) r.v[k] = kernels::combine<O>(x.v[k], y.v[k]);
      store<T, V>(out + i * V, r);
    }
    done = nv * V;
  }
  for (std::size_t i = done + tid; i < n; i += stride) out[i] = kernels::combine<O>(a[i], b[i]);
}

template <class T>
__global__ void finish_avg_kernel(T* data, std::size_t n, int ranks, bool vector) {
  constexpr int V = static_cast<int>(16 / sizeof(T));
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t tid = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  std::size_t done = 0;
  if (vector) {
    const std::size_t nv = n / V;
    for (std::size_t i = tid; i < nv; i += stride) {
      vec<T, V> x = load<T, V>(data + i * V);
#pragma unroll
      for (int k = 0; k < V; ++k) x.v[k] = kernels::finish_avg(x.v[k], ranks);
      store<T, V>(data + i * V, x);
    }
    done = nv * V;
  }
  for (std::size_t i = done + tid; i < n; i += stride)
    data[i] = kernels::finish_avg(data[i], ranks);
}

template <op O, class T>
void launch_combine(const T* a, const T* b, T* out, std::size_t n, cudaStream_t stream) {
  constexpr std::size_t V = 16 / sizeof(T);
  const bool vector = aligned16(a) && aligned16(b) && aligned16(out);
  combine_kernel<O, T>
      <<<grid_for(vector ? n / V + n % V : n), block_threads, 0, stream>>>(a, b, out, n, vector);
  check_launch("kernels::cuda::combine");
}

}  // namespace detail

/// out[i] = a[i] (op) b[i] for i < n, enqueued on `stream`; out may alias a or b. For op::avg
/// this is the sum: call finish_avg once on the fully summed result. All three are device
/// pointers (or memory the device can address).
template <element T>
void combine(op o, const T* a, const T* b, T* out, std::size_t n, cudaStream_t stream = nullptr) {
  if (n == 0) return;
  if (a == nullptr || b == nullptr || out == nullptr)
    throw invalid_argument("kernels::cuda::combine: null buffer with " + std::to_string(n) +
                           " elements");
  switch (o) {
    case op::sum:
    case op::avg:
      return detail::launch_combine<op::sum>(a, b, out, n, stream);
    case op::prod:
      return detail::launch_combine<op::prod>(a, b, out, n, stream);
    case op::min:
      return detail::launch_combine<op::min>(a, b, out, n, stream);
    case op::max:
      return detail::launch_combine<op::max>(a, b, out, n, stream);
  }
  throw invalid_argument("unknown reduction op code " + std::to_string(static_cast<int>(o)));
}

/// Turns a sum over `ranks` contributions into their average in place, enqueued on `stream`.
template <element T>
void finish_avg(T* data, std::size_t n, int ranks, cudaStream_t stream = nullptr) {
  if (ranks < 1) throw invalid_argument("kernels::cuda::finish_avg: ranks must be at least 1");
  if (n == 0 || ranks == 1) return;
  if (data == nullptr)
    throw invalid_argument("kernels::cuda::finish_avg: null buffer with " + std::to_string(n) +
                           " elements");
  constexpr std::size_t V = 16 / sizeof(T);
  const bool vector = detail::aligned16(data);
  detail::finish_avg_kernel<T>
      <<<detail::grid_for(vector ? n / V + n % V : n), detail::block_threads, 0, stream>>>(
          data, n, ranks, vector);
  detail::check_launch("kernels::cuda::finish_avg");
}

}  // namespace ringzero::kernels::cuda
