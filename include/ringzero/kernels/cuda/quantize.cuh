// options::wire's formats on device buffers: reduce/quantize.hpp's per-element steps as kernels,
// enqueued on a CUDA stream, so a segment encoded here holds the host's bytes and decodes to the
// host's values and sums (the functions are the same __host__ __device__ code; a block's largest
// magnitude is a max, which no order changes).
//   encode       one warp per block for the scales, then one thread per code byte (an int4 byte
//                may hold elements of two blocks when the block is odd), padding zeroed;
//   decode       one thread per element, rounded to E;
//   accumulate   one thread per element, acc = value or acc + value in float.
// Cost: memory-bound passes, reading E and writing about a byte (int8) per element.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ringzero/kernels/cuda/detail/launch.cuh"
#include "ringzero/kernels/reduce.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/quantize.hpp"
#include "ringzero/types.hpp"

namespace ringzero::kernels::cuda {

namespace detail {

namespace qz = ringzero::quantize;

constexpr int warp = 32;

template <class E>
__global__ void quantize_scales_kernel(const E* in, qz::segment_layout L, std::uint8_t* out) {
  const std::size_t warps = static_cast<std::size_t>(gridDim.x) * blockDim.x / warp;
  const int lane = static_cast<int>(threadIdx.x % warp);
  const int q = qz::qmax(L.format);
  for (std::size_t b = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / warp;
       b < L.blocks(); b += warps) {
    const std::size_t from = b * L.block;
    const std::size_t to = from + L.block < L.count ? from + L.block : L.count;
    float m = 0.0f;
    for (std::size_t i = from + static_cast<std::size_t>(lane); i < to; i += warp)
      m = fmaxf(m, qz::finite_magnitude(kernels::to_float(in[i])));
    for (int d = warp / 2; d > 0; d /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
    if (lane == 0) {
      const std::uint32_t u = __float_as_uint(qz::scale_of(m, q));
      for (int k = 0; k < 4; ++k) out[4 * b + k] = static_cast<std::uint8_t>(u >> (8 * k));
    }
  }
}

/// Byte j of the codes and padding: int8 code j, int4 codes 2j and 2j + 1, bf16 half of element
/// j / 2, or a zero past them.
template <class E>
__global__ void quantize_codes_kernel(const E* in, qz::segment_layout L, std::uint8_t* out) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t bytes = L.bytes() - L.scale_bytes();
  const int q = qz::qmax(L.format);
  std::uint8_t* codes = out + L.scale_bytes();
  const auto code = [&](std::size_t i) {
    const float s = qz::scale_at(out, i / L.block);
    return qz::code_of(kernels::to_float(in[i]), s, qz::inverse_of(s), q);
  };
  for (std::size_t j = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < bytes;
       j += stride) {
    std::uint8_t v = 0;
    if (j < L.code_bytes()) {
      if (L.format == wire_format::bf16) {
        const std::uint16_t b = qz::bf16_code(in[j / 2]);
        v = static_cast<std::uint8_t>(j % 2 == 0 ? b : b >> 8);
      } else if (L.format == wire_format::int8) {
        v = static_cast<std::uint8_t>(code(j));
      } else {
        v = qz::pack4(code(2 * j), 2 * j + 1 < L.count ? code(2 * j + 1) : 0);
      }
    }
    codes[j] = v;
  }
}

template <class E>
__global__ void quantize_decode_kernel(const std::uint8_t* seg, qz::segment_layout L, E* out,
                                       std::size_t limit) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < limit;
       i += stride)
    out[i] = kernels::from_float<E>(qz::value_at(L, seg, i));
}

template <class A>
__global__ void quantize_accumulate_kernel(const std::uint8_t* seg, qz::segment_layout L, A* acc,
                                           bool first) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < L.count;
       i += stride) {
    const A v = qz::value_at(L, seg, i);
    acc[i] = first ? v : kernels::combine<op::sum>(acc[i], v);
  }
}

}  // namespace detail

/// Writes `in` (L.count elements of device memory) as segment L at `out` (L.bytes() bytes of
/// device memory), enqueued on `stream`: quantize::encode's bytes.
template <element E>
void encode(const quantize::segment_layout& L, const E* in, std::uint8_t* out,
            cudaStream_t stream = nullptr) {
  if (L.bytes() == 0) return;
  if (L.blocks() > 0) {
    detail::quantize_scales_kernel<E>
        <<<detail::grid_for(L.blocks() * detail::warp), detail::block_threads, 0, stream>>>(in, L,
                                                                                            out);
    detail::check_launch("kernels::cuda::encode (scales)");
  }
  detail::quantize_codes_kernel<E>
      <<<detail::grid_for(L.bytes() - L.scale_bytes()), detail::block_threads, 0, stream>>>(in, L,
                                                                                            out);
  detail::check_launch("kernels::cuda::encode (codes)");
}

/// out[i] = segment L's value of element i rounded to E, for i < limit: quantize::decode's.
template <element E>
void decode(const quantize::segment_layout& L, const std::uint8_t* seg, E* out, std::size_t limit,
            cudaStream_t stream = nullptr) {
  if (limit == 0) return;
  detail::quantize_decode_kernel<E>
      <<<detail::grid_for(limit), detail::block_threads, 0, stream>>>(seg, L, out, limit);
  detail::check_launch("kernels::cuda::decode");
}

/// acc[i] = (first) or += segment L's value of element i: quantize::accumulate's sums.
inline void accumulate(const quantize::segment_layout& L, const std::uint8_t* seg, float* acc,
                       bool first, cudaStream_t stream = nullptr) {
  if (L.count == 0) return;
  detail::quantize_accumulate_kernel<float>
      <<<detail::grid_for(L.count), detail::block_threads, 0, stream>>>(seg, L, acc, first);
  detail::check_launch("kernels::cuda::accumulate");
}

}  // namespace ringzero::kernels::cuda
