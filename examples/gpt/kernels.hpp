// The dense kernels the GPT demo spends its time in, on the CPU, in plain C++: row-major matrix
// products C += A * B where every output element is accumulated over k in ascending order, so
// every run computes the same bits whatever the blocking.
//
// For float, a 4 x 8 tile of C lives in eight 4-wide vector registers (GCC/Clang vector
// extensions, which lower to SSE, NEON or scalar code) while k runs over the whole depth: per k,
// two loads of B and four broadcasts of A feed 32 multiply-adds. B's 8-column panel is reused by
// every row tile, so it stays in L1. Edges (and double, used by the tests) take the scalar loop.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

namespace gpt::kernels {

namespace detail {

typedef float v4f __attribute__((vector_size(16)));

inline v4f load(const float* p) noexcept {
  v4f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, v4f v) noexcept {
  std::memcpy(p, &v, sizeof v);
}
inline v4f splat(float x) noexcept {
  return v4f{x, x, x, x};
}

/// C[0..4, 0..8] += sum over p of A(r, p) * B[p, 0..8], with A(r, p) = a[r * si + p * sp].
inline void tile_4x8(std::size_t k, const float* a, std::size_t si, std::size_t sp, const float* b,
                     std::size_t ldb, float* c, std::size_t ldc) noexcept {
  v4f c00 = load(c), c01 = load(c + 4);
  v4f c10 = load(c + ldc), c11 = load(c + ldc + 4);
  v4f c20 = load(c + 2 * ldc), c21 = load(c + 2 * ldc + 4);
  v4f c30 = load(c + 3 * ldc), c31 = load(c + 3 * ldc + 4);
  for (std::size_t p = 0; p < k; ++p) {
    const v4f b0 = load(b + p * ldb), b1 = load(b + p * ldb + 4);
    const float* ap = a + p * sp;
    const v4f a0 = splat(ap[0]), a1 = splat(ap[si]), a2 = splat(ap[2 * si]), a3 = splat(ap[3 * si]);
    c00 += a0 * b0;
    c01 += a0 * b1;
    c10 += a1 * b0;
    c11 += a1 * b1;
    c20 += a2 * b0;
    c21 += a2 * b1;
    c30 += a3 * b0;
    c31 += a3 * b1;
  }
  store(c, c00);
  store(c + 4, c01);
  store(c + ldc, c10);
  store(c + ldc + 4, c11);
  store(c + 2 * ldc, c20);
  store(c + 2 * ldc + 4, c21);
  store(c + 3 * ldc, c30);
  store(c + 3 * ldc + 4, c31);
}

/// One row of C, eight columns: the row tail of tile_4x8.
inline void tile_1x8(std::size_t k, const float* a, std::size_t sp, const float* b, std::size_t ldb,
                     float* c) noexcept {
  v4f c0 = load(c), c1 = load(c + 4);
  for (std::size_t p = 0; p < k; ++p) {
    const v4f x = splat(a[p * sp]);
    c0 += x * load(b + p * ldb);
    c1 += x * load(b + p * ldb + 4);
  }
  store(c, c0);
  store(c + 4, c1);
}

/// C[M,N] += A * B[K,N] with A(i, p) = a[i * si + p * sp].
template <class Real>
void gemm(std::size_t m, std::size_t n, std::size_t k, const Real* a, std::size_t si,
          std::size_t sp, const Real* b, std::size_t ldb, Real* c, std::size_t ldc) {
  std::size_t j0 = 0;
  if constexpr (std::is_same_v<Real, float>) {
    for (; j0 + 8 <= n; j0 += 8) {
      std::size_t i = 0;
      for (; i + 4 <= m; i += 4)
        tile_4x8(k, a + i * si, si, sp, b + j0, ldb, c + i * ldc + j0, ldc);
      for (; i < m; ++i) tile_1x8(k, a + i * si, sp, b + j0, ldb, c + i * ldc + j0);
    }
  }
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = j0; j < n; ++j) {
      Real s = c[i * ldc + j];
      for (std::size_t p = 0; p < k; ++p) s += a[i * si + p * sp] * b[p * ldb + j];
      c[i * ldc + j] = s;
    }
}

}  // namespace detail

/// C[M,N] += A[M,K] * B[K,N]; leading dimensions are row strides.
template <class Real>
void gemm_nn(std::size_t m, std::size_t n, std::size_t k, const Real* a, std::size_t lda,
             const Real* b, std::size_t ldb, Real* c, std::size_t ldc) {
  detail::gemm(m, n, k, a, lda, 1, b, ldb, c, ldc);
}

/// C[M,N] += A^T * B, with A stored [K,M] and B [K,N]: a weight gradient X^T * dY.
template <class Real>
void gemm_tn(std::size_t m, std::size_t n, std::size_t k, const Real* a, std::size_t lda,
             const Real* b, std::size_t ldb, Real* c, std::size_t ldc) {
  detail::gemm(m, n, k, a, 1, lda, b, ldb, c, ldc);
}

/// C[M,N] += A[M,K] * B^T with B stored [N,K]: B is transposed into `scratch` (N*K values, cheap
/// next to the M*N*K product) so the product runs in the axpy form.
template <class Real>
void gemm_nt(std::size_t m, std::size_t n, std::size_t k, const Real* a, std::size_t lda,
             const Real* b, std::size_t ldb, Real* c, std::size_t ldc, std::vector<Real>& scratch) {
  scratch.resize(n * k);
  constexpr std::size_t tile = 32;
  for (std::size_t i0 = 0; i0 < n; i0 += tile)
    for (std::size_t p0 = 0; p0 < k; p0 += tile)
      for (std::size_t i = i0; i < std::min(n, i0 + tile); ++i)
        for (std::size_t p = p0; p < std::min(k, p0 + tile); ++p)
          scratch[p * n + i] = b[i * ldb + p];
  gemm_nn(m, n, k, a, lda, scratch.data(), n, c, ldc);
}

/// out[j] += sum over rows of x[i, j]: a bias gradient.
template <class Real>
void column_sums(std::size_t m, std::size_t n, const Real* x, Real* out) {
  for (std::size_t i = 0; i < m; ++i) {
    const Real* __restrict xi = x + i * n;
    for (std::size_t j = 0; j < n; ++j) out[j] += xi[j];
  }
}

}  // namespace gpt::kernels
