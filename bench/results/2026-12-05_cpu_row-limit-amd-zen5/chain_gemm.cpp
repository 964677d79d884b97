#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <cstring>
#include <algorithm>
// y (M,N) = x (M,K) W(N,K)^T; each output one FMA chain over k = 0..K-1.
constexpr int MR = 32;  // rows of x per panel: two zmm
constexpr int NR = 12;  // outputs per micro-tile
template <int nr>
static inline void tile(const float* xp, const float* W, int64_t K, int64_t n0, float* y, int64_t ldy, int64_t m0, int64_t mrows) {
  __m512 acc0[nr], acc1[nr];
  for (int j = 0; j < nr; ++j) { acc0[j] = _mm512_setzero_ps(); acc1[j] = _mm512_setzero_ps(); }
  const float* w = W + n0 * K;
  for (int64_t k = 0; k < K; ++k) {
    __m512 a0 = _mm512_load_ps(xp + k * MR), a1 = _mm512_load_ps(xp + k * MR + 16);
#pragma GCC unroll 12
    for (int j = 0; j < nr; ++j) {
      __m512 b = _mm512_set1_ps(w[j * K + k]);
      acc0[j] = _mm512_fmadd_ps(a0, b, acc0[j]);
      acc1[j] = _mm512_fmadd_ps(a1, b, acc1[j]);
    }
  }
  alignas(64) float t[nr][MR];
  for (int j = 0; j < nr; ++j) { _mm512_store_ps(t[j], acc0[j]); _mm512_store_ps(t[j] + 16, acc1[j]); }
  for (int64_t i = 0; i < mrows; ++i)
    for (int j = 0; j < nr; ++j) y[(m0 + i) * ldy + n0 + j] = t[j][i];
}
template <int nr>
static void tail(const float* xp, const float* W, int64_t K, int64_t n0, float* y, int64_t ldy, int64_t m0, int64_t mrows, int r) {
  if constexpr (nr > 0) {
    if (r == nr) tile<nr>(xp, W, K, n0, y, ldy, m0, mrows); else tail<nr - 1>(xp, W, K, n0, y, ldy, m0, mrows, r);
  }
}
extern "C" void gk(const float* W, int64_t N, int64_t K, const float* x, int64_t M, float* y) {
  const int64_t panels = (M + MR - 1) / MR;
  float* xp = static_cast<float*>(aligned_alloc(64, panels * K * MR * sizeof(float) + 64));
  #pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    float* d = xp + p * K * MR;
    for (int64_t k = 0; k < K; ++k)
      for (int i = 0; i < MR; ++i) { int64_t m = p * MR + i; d[k * MR + i] = m < M ? x[m * K + k] : 0.f; }
  }
  const int64_t nblocks = (N + NR - 1) / NR;
  #pragma omp parallel for schedule(static) collapse(2)
  for (int64_t nb = 0; nb < nblocks; ++nb)
    for (int64_t p = 0; p < panels; ++p) {
      int64_t n0 = nb * NR, r = std::min<int64_t>(NR, N - n0), m0 = p * MR, mrows = std::min<int64_t>(MR, M - m0);
      if (r == NR) tile<NR>(xp + p * K * MR, W, K, n0, y, N, m0, mrows);
      else tail<NR - 1>(xp + p * K * MR, W, K, n0, y, N, m0, mrows, (int)r);
    }
  free(xp);
}
