// CPU reduction loops. Every combine takes its operands in a fixed order (the lower-ranked
// contribution first) so that all ranks computing the same partial get the same bits.
//
// The arithmetic per element is kernels::combine (kernels/reduce.hpp), the one definition host
// loops and CUDA kernels share: integer sum and product wrap modulo 2^bits, as NCCL's do; 16-bit
// floats compute in float and round once; min/max keep the first operand on ties and NaN. The
// loops run on the path active_simd() picked (reduce/simd.hpp): AVX-512, AVX2 or scalar, with
// the same bits on each.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

#include "ringzero/error.hpp"
#include "ringzero/kernels/reduce.hpp"
#include "ringzero/op.hpp"
#include "ringzero/reduce/detail/x86.hpp"
#include "ringzero/reduce/simd.hpp"
#include "ringzero/types.hpp"

namespace ringzero::reduction {

namespace detail {

template <op O, class T>
void scalar_combine(const T* a, const T* b, T* out, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) out[i] = kernels::combine<O>(a[i], b[i]);
}

template <op O, class T>
void combine_on(simd path, const T* a, const T* b, T* out, std::size_t n) noexcept {
#if RINGZERO_X86_SIMD
  if (path == simd::avx512) return x86::avx512::combine<O>(a, b, out, n);
  if (path == simd::avx2) return x86::avx2::combine<O>(a, b, out, n);
#else
  (void)path;
#endif
  scalar_combine<O>(a, b, out, n);
}

template <element T>
void combine_path(simd path, op o, const T* a, const T* b, T* out, std::size_t n) {
  switch (o) {
    case op::sum:
    case op::avg:
      return combine_on<op::sum>(path, a, b, out, n);
    case op::prod:
      return combine_on<op::prod>(path, a, b, out, n);
    case op::min:
      return combine_on<op::min>(path, a, b, out, n);
    case op::max:
      return combine_on<op::max>(path, a, b, out, n);
  }
  throw invalid_argument("unknown reduction op code " + std::to_string(static_cast<int>(o)));
}

template <element T>
void finish_avg_path(simd path, T* data, std::size_t n, int ranks) noexcept {
  if (ranks <= 1) return;
#if RINGZERO_X86_SIMD
  if constexpr (!std::is_integral_v<T>) {
    if (path == simd::avx512) return x86::avx512::finish_avg(data, n, ranks);
    if (path == simd::avx2) return x86::avx2::finish_avg(data, n, ranks);
  }
#endif
  (void)path;
  for (std::size_t i = 0; i < n; ++i) data[i] = kernels::finish_avg(data[i], ranks);
}

inline void require_supported(simd path) {
  if (!simd_supported(path))
    throw invalid_argument("reduction path " + std::string(simd_name(path)) + " (code " +
                           std::to_string(static_cast<int>(path)) +
                           ") cannot run on this CPU or build");
}

}  // namespace detail

/// out[i] = a[i] (op) b[i] on active_simd()'s path; out may be a or b (the same pointer), or not
/// overlap them. For op::avg this is the sum: call finish_avg once on the fully summed result.
template <element T>
void combine(op o, const T* a, const T* b, T* out, std::size_t n) {
  detail::combine_path(active_simd(), o, a, b, out, n);
}

template <element T>
void combine(op o, std::span<const T> a, std::span<const T> b, std::span<T> out) {
  combine(o, a.data(), b.data(), out.data(), std::min({a.size(), b.size(), out.size()}));
}

/// combine on a given path (tests and benchmarks compare them); a path that simd_supported
/// denies is an invalid_argument.
template <element T>
void combine(simd path, op o, const T* a, const T* b, T* out, std::size_t n) {
  detail::require_supported(path);
  detail::combine_path(path, o, a, b, out, n);
}

/// Turns a sum over `ranks` contributions into their average (truncating for integers) on
/// active_simd()'s path. Integer division has no vector instruction: integers take the scalar
/// loop on every path.
template <element T>
void finish_avg(T* data, std::size_t n, int ranks) {
  detail::finish_avg_path(active_simd(), data, n, ranks);
}

/// finish_avg on a given path; a path that simd_supported denies is an invalid_argument.
template <element T>
void finish_avg(simd path, T* data, std::size_t n, int ranks) {
  detail::require_supported(path);
  detail::finish_avg_path(path, data, n, ranks);
}

}  // namespace ringzero::reduction
