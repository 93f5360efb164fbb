// The sharded optimizer's kernels on device buffers: a fused multi-tensor optimizer step (fp32
// master weights and moments, the parameters written back in their own type), the gradient
// statistics (unscale, non-finite check and sum of squares into a device scalar, one pass), and
// gradient accumulation. Each element's arithmetic is the optimizer rule's
// (zero/optimizer_table.hpp, over kernels/optimizer.hpp), shared with the host.
//
// Bytes moved per element (the floor at the device's copy bandwidth): AdamW reads the gradient,
// master and both moments and writes master, moments and the parameter: 2*sizeof(P) + 24 with
// 16-bit parameters, 28 with fp32 (no separate parameter). SGD: sizeof(P) + 16 (+ sizeof(P)).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include "ringzero/detail/cuda_runtime.hpp"
#include "ringzero/detail/env.hpp"
#include "ringzero/error.hpp"
#include "ringzero/kernels/cuda/detail/launch.cuh"
#include "ringzero/kernels/optimizer.hpp"
#include "ringzero/types.hpp"

namespace ringzero::kernels::cuda {

/// One contiguous run of the shard (kernels/optimizer.hpp), all device pointers.
using kernels::optimizer_segment;

/// The device-resident result of the gradient statistics: the sum of squares of the unscaled
/// gradient and whether any element was inf or NaN. Both can be all_reduced where they lie
/// (sum over `sumsq`, max over `nonfinite`) before the host reads them.
struct grad_stats {
  double sumsq = 0.0;
  std::int32_t nonfinite = 0;
};
static_assert(sizeof(grad_stats) <= 16, "the accumulator keeps the result in its first 16 bytes");

namespace detail {

// Small enough that a launch of `capacity` mid-sized segments still fills every SM, large
// enough that finding the chunk's segment is noise next to moving its bytes.
inline constexpr std::size_t chunk_elems = 4096;

// Four elements per thread and step: the fp32 arrays (24 of AdamW's 28 bytes per element) move
// as 16-byte words, the 16-bit gradient and parameter as 8-byte ones, and consecutive threads
// touch consecutive words in every array. (Eight elements per thread, to load the 16-bit arrays
// 16 bytes at a time, ran at 40 % of the copy bandwidth on an H100 against 93 % for this.)
inline constexpr int optimizer_vector = 4;

/// Up to `Capacity` segments travel as one kernel argument. Short lists use the small batch
/// (under 4 KB); long ones the large (under the 32 KB that CUDA 12.1+ accepts on sm_70 and
/// newer), so a shard of many tensors is one launch per 400 of them: each launch ends with a
/// partly idle wave, which cost half the bandwidth with 1000 tensors in batches of 48.
template <class P, class G, int Capacity>
struct segment_batch {
  static constexpr int capacity = Capacity;
  struct entry {
    const G* grad;
    float* master;
    float* moment1;
    float* moment2;
    P* param;
    std::size_t count;
    bool decay;
    bool vector;
  };
  entry seg[Capacity];
  std::size_t first_chunk[Capacity + 1];
  int size;
};

// R is an optimizer rule (zero/optimizer_table.hpp): R::descriptor.moments, R::factor (once per
// segment) and R::step (per element), the functions the host runs.
template <class R>
inline constexpr bool two_moments = R::descriptor.moments > 1;

template <class P, class R, class Entry>
__device__ __forceinline__ void update(const Entry& s, std::size_t i, const optimizer_constants& c,
                                       float factor) {
  float master = s.master[i];
  float m1 = s.moment1[i];
  float m2 = 0.0f;
  if constexpr (two_moments<R>) m2 = s.moment2[i];
  const float p = R::step(to_float(s.grad[i]), master, m1, m2, c, factor);
  if constexpr (two_moments<R>) s.moment2[i] = m2;
  s.master[i] = master;
  s.moment1[i] = m1;
  if constexpr (!std::is_same_v<P, float>) s.param[i] = from_float<P>(p);
}

// Each block takes an equal run of consecutive chunks (of at most chunk_elems elements, never
// spanning two segments) and its threads stride through each chunk. A run, not every
// gridDim.x-th chunk, so that a block looks its first segment up once and then only steps
// forward: the segment table is a kernel argument, and a binary search per chunk in a table of
// 400 segments (dependent constant-cache misses) held 1000 tensors to 52 % of the copy
// bandwidth on an H100, against 67 % with runs (docs/performance.md).
template <class P, class G, class R, int Capacity>
__global__ void __launch_bounds__(block_threads)
    optimizer_kernel(const segment_batch<P, G, Capacity> b, const optimizer_constants c) {
  constexpr int V = optimizer_vector;
  const std::size_t total = b.first_chunk[b.size];
  const std::size_t per_block = (total + gridDim.x - 1) / gridDim.x;
  const std::size_t first = blockIdx.x * per_block;
  const std::size_t last = first + per_block < total ? first + per_block : total;
  if (first >= last) return;
  int si = segment_of(b.first_chunk, b.size, first);
  for (std::size_t chunk = first; chunk < last; ++chunk) {
    while (b.first_chunk[si + 1] <= chunk) ++si;
    const auto& s = b.seg[si];
    const std::size_t begin = (chunk - b.first_chunk[si]) * chunk_elems;
    const std::size_t end = begin + chunk_elems < s.count ? begin + chunk_elems : s.count;
    const float k = R::factor(c, s.decay);
    std::size_t i = begin + threadIdx.x * static_cast<std::size_t>(V);
    if (s.vector) {
      for (; i + V <= end; i += static_cast<std::size_t>(blockDim.x) * V) {
        const vec<G, V> g = load<G, V>(s.grad + i);
        vec<float, V> ma = load<float, V>(s.master + i);
        vec<float, V> m1 = load<float, V>(s.moment1 + i);
        vec<float, V> m2{};
        if constexpr (two_moments<R>) m2 = load<float, V>(s.moment2 + i);
        vec<P, V> out;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float p = R::step(to_float(g.v[e]), ma.v[e], m1.v[e], m2.v[e], c, k);
          if constexpr (!std::is_same_v<P, float>) out.v[e] = from_float<P>(p);
        }
        store<float, V>(s.master + i, ma);
        store<float, V>(s.moment1 + i, m1);
        if constexpr (two_moments<R>) store<float, V>(s.moment2 + i, m2);
        if constexpr (!std::is_same_v<P, float>) store<P, V>(s.param + i, out);
      }
      // The chunk's last count % V elements, one per thread.
      for (std::size_t j = end - (end - begin) % V + threadIdx.x; j < end; j += blockDim.x)
        update<P, R>(s, j, c, k);
    } else {
      for (std::size_t j = begin + threadIdx.x; j < end; j += blockDim.x) update<P, R>(s, j, c, k);
    }
  }
}

template <class P, class G, class R, int Capacity>
void launch_batches(std::span<const optimizer_segment<P, G>> segments, const optimizer_constants& c,
                    cudaStream_t stream, const char* what) {
  constexpr std::size_t V = optimizer_vector;
  static_assert(sizeof(segment_batch<P, G, Capacity>) + sizeof(optimizer_constants) <= 32000,
                "kernel arguments are limited to 32 KB");
  segment_batch<P, G, Capacity> b{};
  auto flush = [&] {
    if (b.size == 0 || b.first_chunk[b.size] == 0) {
      b.size = 0;
      return;
    }
    optimizer_kernel<P, G, R, Capacity>
        <<<grid_for(b.first_chunk[b.size] * block_threads), block_threads, 0, stream>>>(b, c);
    check_launch(what);
    b.size = 0;
  };
  for (const auto& s : segments) {
    if (s.count == 0) continue;
    const bool need_v = two_moments<R>;
    const bool need_param = !std::is_same_v<P, float>;
    if (s.grad == nullptr || s.master == nullptr || s.moment1 == nullptr ||
        (need_v && s.moment2 == nullptr) || (need_param && s.param == nullptr))
      throw invalid_argument(std::string(what) + ": a segment of " + std::to_string(s.count) +
                             " elements has a null buffer");
    // The vector path needs every array aligned at the same element. A segment that starts
    // misaligned (a tensor at an odd offset of a flat buffer) is split: up to three elements
    // one by one, the rest four at a time.
    auto vector_at = [&](std::size_t h) {
      return aligned(s.grad + h, V * sizeof(G)) && aligned16(s.master + h) &&
             aligned16(s.moment1 + h) && (!need_v || aligned16(s.moment2 + h)) &&
             (!need_param || aligned(s.param + h, V * sizeof(P)));
    };
    std::size_t head = 0;
    while (head < V && head < s.count && !vector_at(head)) ++head;
    const bool split = head < V && head < s.count;
    auto push = [&](std::size_t from, std::size_t count, bool vector) {
      if (count == 0) return;
      auto& e = b.seg[b.size];
      e.grad = s.grad + from;
      e.master = s.master + from;
      e.moment1 = s.moment1 + from;
      e.moment2 = need_v ? s.moment2 + from : nullptr;
      e.param = need_param ? s.param + from : nullptr;
      e.count = count;
      e.decay = s.decay;
      e.vector = vector;
      if (b.size == 0) b.first_chunk[0] = 0;
      b.first_chunk[b.size + 1] = b.first_chunk[b.size] + (count + chunk_elems - 1) / chunk_elems;
      if (++b.size == Capacity) flush();
    };
    if (split) {
      push(0, head, false);
      push(head, s.count - head, true);
    } else {
      push(0, s.count, false);
    }
  }
  flush();
}

template <class P, class G, class R>
void launch_optimizer(std::span<const optimizer_segment<P, G>> segments,
                      const optimizer_constants& c, cudaStream_t stream, const char* what) {
  if (segments.size() <= 16)  // at most 32 entries once misaligned segments are split
    launch_batches<P, G, R, 32>(segments, c, stream, what);
  else
    launch_batches<P, G, R, 400>(segments, c, stream, what);
}

/// Up to `Capacity` gradient runs for one statistics launch, laid out in chunks as the
/// optimizer's segment_batch lays out its segments.
template <class P, int Capacity>
struct stats_batch {
  static constexpr int capacity = Capacity;
  struct entry {
    const P* g;
    std::size_t count;
    bool vector;
  };
  entry seg[Capacity];
  std::size_t first_chunk[Capacity + 1];
  int size;
};

/// The sum of squares and the non-finite flag of every run of `b`, added into `out`. Each block
/// takes an equal run of consecutive chunks (as optimizer_kernel does), sums it with a fixed
/// tree, and the last block to finish adds the blocks' partial sums in block order: the same
/// bits on every run with the same segments and grid.
template <class P, int Capacity>
__global__ void __launch_bounds__(block_threads)
    grad_stats_kernel(const stats_batch<P, Capacity> b, float scale, double* partial,
                      std::int32_t* partial_bad, unsigned* done, grad_stats* out) {
  constexpr int V = static_cast<int>(16 / sizeof(P));
  const std::size_t total = b.first_chunk[b.size];
  const std::size_t per_block = (total + gridDim.x - 1) / gridDim.x;
  const std::size_t first = blockIdx.x * per_block;
  const std::size_t last = first + per_block < total ? first + per_block : total;
  double s = 0.0;
  bool bad = false;
  auto one = [&](float f) {
    bad |= !is_finite(f);
    s = add(s, mul(static_cast<double>(f), static_cast<double>(f)));
  };
  if (first < last) {
    int si = segment_of(b.first_chunk, b.size, first);
    for (std::size_t chunk = first; chunk < last; ++chunk) {
      while (b.first_chunk[si + 1] <= chunk) ++si;
      const auto& e = b.seg[si];
      const std::size_t begin = (chunk - b.first_chunk[si]) * chunk_elems;
      const std::size_t end = begin + chunk_elems < e.count ? begin + chunk_elems : e.count;
      std::size_t from = begin;
      if (e.vector) {
        // chunk_elems is a multiple of V, so every chunk of an aligned run starts aligned.
        const std::size_t whole = begin + (end - begin) / V * V;
        for (std::size_t i = begin + threadIdx.x * static_cast<std::size_t>(V); i < whole;
             i += static_cast<std::size_t>(blockDim.x) * V) {
          const vec<P, V> x = load<P, V>(e.g + i);
#pragma unroll
          for (int k = 0; k < V; ++k) one(unscaled(x.v[k], scale));
        }
        from = whole;
      }
      for (std::size_t i = from + threadIdx.x; i < end; i += blockDim.x)
        one(unscaled(e.g[i], scale));
    }
  }
  // A fixed tree per block and a fixed order over blocks: the same bits on every run.
  __shared__ double sh[block_threads];
  __shared__ bool last_block;
  sh[threadIdx.x] = s;
  const int any_bad = __syncthreads_or(bad ? 1 : 0);
  for (int w = block_threads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w)
      sh[threadIdx.x] = add(sh[threadIdx.x], sh[threadIdx.x + w]);
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = sh[0];
    partial_bad[blockIdx.x] = any_bad;
    __threadfence();
    last_block = atomicAdd(done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  const volatile double* vp = partial;
  const volatile std::int32_t* vb = partial_bad;
  double t = 0.0;
  bool tb = false;
  for (unsigned i = threadIdx.x; i < gridDim.x; i += blockDim.x) {
    t = add(t, vp[i]);
    tb |= vb[i] != 0;
  }
  sh[threadIdx.x] = t;
  const int total_bad = __syncthreads_or(tb ? 1 : 0);
  for (int w = block_threads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w)
      sh[threadIdx.x] = add(sh[threadIdx.x], sh[threadIdx.x + w]);
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    out->sumsq = add(out->sumsq, sh[0]);
    if (total_bad) out->nonfinite = 1;
    *done = 0;  // ready for the next launch on this stream
  }
}

template <class P, class S>
__global__ void accumulate_kernel(P* __restrict__ dst, const S* __restrict__ src, std::size_t n,
                                  bool first, bool vector, float scale) {
  constexpr int V = static_cast<int>(16 / sizeof(P));
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t tid = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  std::size_t from = 0;
  if (vector) {
    const std::size_t nv = n / V;
    for (std::size_t i = tid; i < nv; i += stride) {
      const vec<S, V> x = load<S, V>(src + i * V);
      vec<P, V> d{};
      if (!first) d = load<P, V>(dst + i * V);
#pragma unroll
      for (int k = 0; k < V; ++k) d.v[k] = kernels::accumulate<P>(d.v[k], x.v[k], first, scale);
      store<P, V>(dst + i * V, d);
    }
    from = nv * V;
  }
  for (std::size_t i = from + tid; i < n; i += stride)
    dst[i] = kernels::accumulate<P>(first ? P{} : dst[i], src[i], first, scale);
}

}  // namespace detail

/// One step of optimizer rule R (zero/optimizer_table.hpp: zero::adamw_rule, zero::sgd_rule or
/// any other) over every segment, enqueued on `stream` (one launch per 32 segments, or per 400 in
/// long lists). P and G are named, not deduced (G defaults to P), so a vector of segments
/// converts to the span.
template <class R, class P, class G = P>
void optimizer_step(std::type_identity_t<std::span<const optimizer_segment<P, G>>> segments,
                    const optimizer_constants& c, cudaStream_t stream = nullptr) {
  detail::launch_optimizer<P, G, R>(segments, c, stream, "kernels::cuda::optimizer_step");
}

/// dst = src * scale (first micro-batch) or dst += src * scale in P, enqueued on `stream` (S is P
/// or float, or any 16-bit type into fp32; a scale of 1 multiplies nothing, as on the host).
template <class P, class S>
void accumulate(P* dst, const S* src, std::size_t n, bool first, cudaStream_t stream = nullptr,
                float scale = 1.0f) {
  static_assert(std::is_same_v<S, P> || std::is_same_v<S, float> || std::is_same_v<P, float>,
                "gradients come as P or float (or, into fp32 gradients, as any parameter type)");
  if (n == 0) return;
  if (dst == nullptr || src == nullptr)
    throw invalid_argument("kernels::cuda::accumulate: null buffer with " + std::to_string(n) +
                           " elements");
  constexpr std::size_t V = 16 / sizeof(P);
  const bool vector = detail::aligned16(dst) && detail::aligned16(src);
  detail::accumulate_kernel<P, S>
      <<<detail::grid_for(vector ? n / V + n % V : n), detail::block_threads, 0, stream>>>(
          dst, src, n, first, vector, scale);
  detail::check_launch("kernels::cuda::accumulate");
}

/// One run of gradients for the statistics: `count` elements at device pointer `data`.
template <class P>
struct stats_segment {
  const P* data = nullptr;
  std::size_t count = 0;
};

/// Device memory for the gradient statistics: the result and each block's partial sums. One
/// accumulator serves one stream at a time (its launches share the partials).
class grad_stats_accumulator {
 public:
  /// The memory is zeroed in `stream`'s order (a plain cudaMemset would be ordered only with
  /// the legacy default stream, not with a non-blocking or per-thread one).
  explicit grad_stats_accumulator(cudaStream_t stream = nullptr) {
    blocks_ = static_cast<unsigned>(detail::multiprocessors()) * 8;
    const std::size_t bytes = sizeof(grad_stats) +
                              blocks_ * (sizeof(double) + sizeof(std::int32_t)) + sizeof(unsigned) +
                              16;
    detail::check_cuda(cudaMalloc(&mem_, bytes), "grad_stats_accumulator: cudaMalloc");
    detail::check_cuda(cudaMemsetAsync(mem_, 0, bytes, stream),
                       "grad_stats_accumulator: cudaMemsetAsync");
  }
  grad_stats_accumulator(const grad_stats_accumulator&) = delete;
  grad_stats_accumulator& operator=(const grad_stats_accumulator&) = delete;
  ~grad_stats_accumulator() { cudaFree(mem_); }

  /// The device-resident result (all_reduce its fields in place, or read() it).
  [[nodiscard]] grad_stats* result() const noexcept { return static_cast<grad_stats*>(mem_); }

  /// Zeroes the result, enqueued on `stream`.
  void reset(cudaStream_t stream = nullptr) {
    detail::check_cuda(cudaMemsetAsync(result(), 0, sizeof(grad_stats), stream),
                       "grad_stats_accumulator::reset");
  }

  /// Adds the squares of g[i] * scale over every segment to sumsq (summed in double) and sets
  /// nonfinite if any is inf or NaN, enqueued on `stream`: one pass over the gradients and one
  /// launch per 400 segments (a shard's segments together, not a launch each).
  template <class P>
  void add(std::type_identity_t<std::span<const stats_segment<P>>> segments, float scale,
           cudaStream_t stream = nullptr) {
    if (segments.size() <= 16)
      add_batches<P, 16>(segments, scale, stream);
    else
      add_batches<P, 400>(segments, scale, stream);
  }

  /// The same for one run of n elements.
  template <class P>
  void add(const P* g, std::size_t n, float scale, cudaStream_t stream = nullptr) {
    const stats_segment<P> one{g, n};
    add<P>(std::span<const stats_segment<P>>(&one, 1), scale, stream);
  }

  /// Copies the result to the host; waits for `stream`, within RINGZERO_TIMEOUT (a stream
  /// behind a collective whose peer died never drains).
  [[nodiscard]] grad_stats read(cudaStream_t stream = nullptr) const {
    grad_stats r;
    detail::check_cuda(cudaMemcpyAsync(&r, result(), sizeof r, cudaMemcpyDeviceToHost, stream),
                       "grad_stats_accumulator::read");
    ringzero::detail::wait_stream(stream, ringzero::detail::env_timeout(),
                                  "grad_stats_accumulator::read");
    return r;
  }

 private:
  [[nodiscard]] double* partial() const noexcept {
    return reinterpret_cast<double*>(static_cast<char*>(mem_) + 16);
  }
  [[nodiscard]] std::int32_t* partial_bad() const noexcept {
    return reinterpret_cast<std::int32_t*>(partial() + blocks_);
  }
  [[nodiscard]] unsigned* counter() const noexcept {
    return reinterpret_cast<unsigned*>(partial_bad() + blocks_);
  }

  template <class P, int Capacity>
  void add_batches(std::span<const stats_segment<P>> segments, float scale, cudaStream_t stream) {
    constexpr std::size_t V = 16 / sizeof(P);
    static_assert(detail::chunk_elems % V == 0, "aligned runs keep every chunk aligned");
    static_assert(sizeof(detail::stats_batch<P, Capacity>) <= 30000,
                  "kernel arguments are limited to 32 KB");
    detail::stats_batch<P, Capacity> b{};
    auto flush = [&] {
      const std::size_t chunks = b.size == 0 ? 0 : b.first_chunk[b.size];
      if (chunks > 0) {
        const auto wanted = static_cast<unsigned>(chunks < static_cast<std::size_t>(blocks_)
                                                      ? chunks
                                                      : static_cast<std::size_t>(blocks_));
        detail::grad_stats_kernel<P, Capacity><<<wanted, detail::block_threads, 0, stream>>>(
            b, scale, partial(), partial_bad(), counter(), result());
        detail::check_launch("grad_stats_accumulator::add");
      }
      b.size = 0;
    };
    for (const auto& s : segments) {
      if (s.count == 0) continue;
      if (s.data == nullptr)
        throw invalid_argument("grad_stats_accumulator::add: null buffer with " +
                               std::to_string(s.count) + " elements");
      auto& e = b.seg[b.size];
      e.g = s.data;
      e.count = s.count;
      e.vector = detail::aligned16(s.data);
      if (b.size == 0) b.first_chunk[0] = 0;
      b.first_chunk[b.size + 1] =
          b.first_chunk[b.size] + (s.count + detail::chunk_elems - 1) / detail::chunk_elems;
      if (++b.size == Capacity) flush();
    }
    flush();
  }

  void* mem_ = nullptr;
  unsigned blocks_ = 0;
};

}  // namespace ringzero::kernels::cuda
