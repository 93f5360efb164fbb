// The dense kernels the GPT demo spends its time in, on the CPU, in plain C++ (no intrinsics, no
// libraries): row-major matrix products in the "axpy" form, whose innermost loop runs along a
// contiguous row of the output and of one input. That loop has no reduction, so the compiler
// vectorises it without reassociating sums (no -ffast-math), and every run computes the same bits.
//
// Blocking: four output rows share each loaded row of B, and the output row is walked in tiles of
// 64 columns, so the 4 x 64 accumulators stay in L1 while k runs over the whole depth.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace gpt::kernels {

/// C[M,N] += A[M,K] * B[K,N]; leading dimensions are row strides.
template <class Real>
void gemm_nn(std::size_t m, std::size_t n, std::size_t k, const Real* a, std::size_t lda,
             const Real* b, std::size_t ldb, Real* c, std::size_t ldc) {
  constexpr std::size_t rows = 4, cols = 64;
  for (std::size_t j0 = 0; j0 < n; j0 += cols) {
    const std::size_t nj = std::min(cols, n - j0);
    std::size_t i = 0;
    for (; i + rows <= m; i += rows) {
      Real* c0 = c + i * ldc + j0;
      Real* c1 = c0 + ldc;
      Real* c2 = c1 + ldc;
      Real* c3 = c2 + ldc;
      const Real* a0 = a + i * lda;
      for (std::size_t p = 0; p < k; ++p) {
        const Real x0 = a0[p], x1 = a0[lda + p], x2 = a0[2 * lda + p], x3 = a0[3 * lda + p];
        const Real* __restrict br = b + p * ldb + j0;
        for (std::size_t j = 0; j < nj; ++j) {
          const Real v = br[j];
          c0[j] += x0 * v;
          c1[j] += x1 * v;
          c2[j] += x2 * v;
          c3[j] += x3 * v;
        }
      }
    }
    for (; i < m; ++i) {
      Real* __restrict ci = c + i * ldc + j0;
      for (std::size_t p = 0; p < k; ++p) {
        const Real x = a[i * lda + p];
        const Real* __restrict br = b + p * ldb + j0;
        for (std::size_t j = 0; j < nj; ++j) ci[j] += x * br[j];
      }
    }
  }
}

/// C[M,N] += A^T * B, with A stored [K,M] and B [K,N]: a weight gradient X^T * dY.
template <class Real>
void gemm_tn(std::size_t m, std::size_t n, std::size_t k, const Real* a, std::size_t lda,
             const Real* b, std::size_t ldb, Real* c, std::size_t ldc) {
  constexpr std::size_t depth = 4, cols = 64;
  for (std::size_t j0 = 0; j0 < n; j0 += cols) {
    const std::size_t nj = std::min(cols, n - j0);
    std::size_t p = 0;
    // Four rows of B at a time: each output row is loaded and stored once per four products.
    for (; p + depth <= k; p += depth) {
      const Real* b0 = b + p * ldb + j0;
      const Real* b1 = b0 + ldb;
      const Real* b2 = b1 + ldb;
      const Real* b3 = b2 + ldb;
      const Real* ap = a + p * lda;
      for (std::size_t i = 0; i < m; ++i) {
        const Real x0 = ap[i], x1 = ap[lda + i], x2 = ap[2 * lda + i], x3 = ap[3 * lda + i];
        Real* __restrict ci = c + i * ldc + j0;
        for (std::size_t j = 0; j < nj; ++j)
          ci[j] += x0 * b0[j] + x1 * b1[j] + x2 * b2[j] + x3 * b3[j];
      }
    }
    for (; p < k; ++p) {
      const Real* __restrict bp = b + p * ldb + j0;
      for (std::size_t i = 0; i < m; ++i) {
        const Real x = a[p * lda + i];
        Real* __restrict ci = c + i * ldc + j0;
        for (std::size_t j = 0; j < nj; ++j) ci[j] += x * bp[j];
      }
    }
  }
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
