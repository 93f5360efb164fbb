// The element work of reproducible training's accumulators on a device space
// (zero/exact_gradients.hpp), each call enqueued on a stream of the space: add a slice of terms,
// clear, round, bin the squares for the exact norm, copy. This primary template is the emulated
// device's (device_space.hpp): the space runs what it is given on the stream's thread, so the work
// is the host's own loops over the __host__ __device__ functions of reduce/reproducible_compact.hpp
// and detail/exact_sumsq.hpp. The CUDA device space has its kernels (zero/cuda_exact.cuh), which
// run those same functions.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "ringzero/reduce/reproducible_compact.hpp"
#include "ringzero/zero/detail/exact_sumsq.hpp"

namespace ringzero::zero::detail {

template <class Space>
struct exact_ops {
  /// v's n elements take terms[0, n).
  template <class G>
  static void add(const Space& sp, typename Space::stream s, reproducible::compact_view v,
                  const G* terms) {
    sp.enqueue(s, [v, terms](auto) {
      for (std::size_t b = 0; b < reproducible::blocks(v.n); ++b) {
        const std::size_t from = b * reproducible::block_elems;
        const std::size_t len = std::min(reproducible::block_elems, v.n - from);
        // A full pool is marked in v.pool.counts, which the step reads.
        (void)reproducible::compact_block_add(v, b, terms + from, 0, len);
      }
    });
  }
  /// Every block of v empty.
  static void clear(const Space& sp, typename Space::stream s, reproducible::compact_view v) {
    sp.enqueue(s, [v](auto) {
      for (std::size_t b = 0; b < reproducible::blocks(v.n); ++b)
        v.heads[b] = reproducible::compact_head{};
    });
  }
  /// out[i] = element i of v, rounded.
  template <class G>
  static void round(const Space& sp, typename Space::stream s, reproducible::compact_view v,
                    G* out) {
    sp.enqueue(s, [v, out](auto) {
      for (std::size_t i = 0; i < v.n; ++i) out[i] = reproducible::compact_round<G>(v, i);
    });
  }
  /// bins (device_bins words, zeroed before) take the squares of g[0, n) as exact_sumsq bins
  /// them: the step's exact norm without the gradients leaving the device.
  template <class G>
  static void sumsq(const Space& sp, typename Space::stream s, const G* g, std::size_t n,
                    std::uint64_t* bins) {
    sp.enqueue(s, [g, n, bins](auto) {
      for (std::size_t i = 0; i < n; ++i) {
        std::uint32_t e = 0;
        std::uint64_t m2 = 0;
        if (!square_of(g[i], e, m2)) {
          bins[512] = 1;
          continue;
        }
        bins[2 * e] += m2;
        bins[2 * e + 1] += bins[2 * e] < m2 ? 1 : 0;  // the carry out of the low word
      }
    });
  }
  /// n elements from src to dst, both device memory.
  template <class T>
  static void copy(const Space& sp, typename Space::stream s, T* dst, const T* src, std::size_t n) {
    sp.enqueue(s, [dst, src, n](auto) { std::memcpy(dst, src, n * sizeof(T)); });
  }
};

}  // namespace ringzero::zero::detail

#if defined(__CUDACC__)
#include "ringzero/zero/cuda_exact.cuh"
#endif
