// One thread's int8 product rate: rows of K int8 weights times one fp32 activation vector.
//  fma4 / fma8: widen each weight to int32, convert to fp32, FMA with x (what the step does), blocks of 4 / 8 rows.
//  vnniP: x written exactly as integers in P byte planes (x_i = (m_i - 2^(8P-1)) * 2^e, m_i unsigned),
//         vpdpbusd per plane, the planes' int32 sums combined exactly in int64, one rounding to float.
// g++ -O3 -march=native -std=c++17 vnni_rates.cpp
#include <immintrin.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#ifndef NOFINAL
#define NOFINAL 0
#endif
using namespace std::chrono;

static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

void fma_rows(int B, const int8_t* W, const float* scale, int N, int K, const float* x, float* y) {
  for (int r = 0; r < N; r += B) {
    __m512 acc[8];
    for (int b = 0; b < B; ++b) acc[b] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
      __m512 xv = _mm512_loadu_ps(x + k);
      for (int b = 0; b < B; ++b) {
        __m128i w = _mm_loadu_si128((const __m128i*)(W + (int64_t)(r + b) * K + k));
        acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(w)), xv, acc[b]);
      }
    }
    for (int b = 0; b < B; ++b) y[r + b] = hsum(acc[b]) * scale[r + b];
  }
}

// x planes: P arrays of K unsigned bytes; rowsum[r] = sum of row r's weights (for the offset).
template <int P>
void vnni_rows(const int8_t* W, const float* scale, const int64_t* rowsum, int N, int K, const uint8_t* planes,
               float xscale, float* y) {
  const int64_t offset = (int64_t)1 << (8 * P - 1);
  for (int r = 0; r < N; r += 4) {
    __m512i acc[4][P];
    for (int b = 0; b < 4; ++b)
      for (int p = 0; p < P; ++p) acc[b][p] = _mm512_setzero_si512();
    for (int k = 0; k < K; k += 64) {
      __m512i xp[P];
      for (int p = 0; p < P; ++p) xp[p] = _mm512_loadu_si512(planes + p * K + k);
      for (int b = 0; b < 4; ++b) {
        __m512i w = _mm512_loadu_si512(W + (int64_t)(r + b) * K + k);
        for (int p = 0; p < P; ++p) acc[b][p] = _mm512_dpbusd_epi32(acc[b][p], xp[p], w);
      }
    }
    if (NOFINAL) {
      __m512i t = acc[0][0];
      for (int b = 0; b < 4; ++b)
        for (int p = 0; p < P; ++p) t = _mm512_xor_si512(t, acc[b][p]);
      y[r] = (float)_mm_cvtsi128_si32(_mm512_castsi512_si128(t));
      continue;
    }
    for (int b = 0; b < 4; ++b) {
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (int p = 0; p < P; ++p) {  // int32 lanes widened to int64, shifted by their plane's 8p bits
        __m512i a = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc[b][p]));
        __m512i c = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc[b][p], 1));
        lo = _mm512_add_epi64(lo, _mm512_slli_epi64(a, 8 * p));
        hi = _mm512_add_epi64(hi, _mm512_slli_epi64(c, 8 * p));
      }
      int64_t I = _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi)) - offset * rowsum[r + b];
      y[r + b] = (float)I * (scale[r + b] * xscale);
    }
  }
}

template <typename F>
double best(F f, int reps) {
  double b = 1e30;
  for (int t = 0; t < 9; ++t) {
    auto t0 = steady_clock::now();
    for (int i = 0; i < reps; ++i) f();
    b = std::min(b, duration<double>(steady_clock::now() - t0).count() / reps);
  }
  return b;
}

int main(int argc, char** argv) {
  const bool narrow = argc > 1 && !strcmp(argv[1], "narrow");  // x within 2 binary orders: 4 planes suffice
  const int K = 256;
  std::vector<float> x(K);
  srand(1);
  for (auto& v : x)  // default: 0.001 to 4 (12 binary orders, 5 planes); narrow: 1 to 4 with 7-bit mantissas
    v = narrow ? ((rand() % 2) ? 1.f : -1.f) * (1 + (rand() % 128) / 128.f) * (1 + (rand() % 2))
               : ((rand() % 2001) - 1000) * 1e-3f * (1 + (rand() % 4));
  // Exact planes for P bytes: e such that max|x| * 2^-e < 2^(8P-1) - 1 with every x_i a multiple of 2^e.
  auto make_planes = [&](int P, std::vector<uint8_t>& planes, float& xscale) -> bool {
    int emax = -1000, emin = 1000;
    for (float v : x) {
      if (v == 0) continue;
      int e;
      std::frexp(v, &e);  // |v| in [2^(e-1), 2^e)
      emax = std::max(emax, e);
      emin = std::min(emin, e - 24);  // ulp of v's 24-bit mantissa
    }
    const int bits = emax - emin;  // |m| < 2^bits
    if (bits > 8 * P - 1) return false;
    xscale = std::ldexp(1.0f, emin);
    planes.assign(P * K, 0);
    for (int i = 0; i < K; ++i) {
      int64_t m = (int64_t)std::ldexp((double)x[i], -emin) + ((int64_t)1 << (8 * P - 1));
      for (int p = 0; p < P; ++p) planes[p * K + i] = (m >> (8 * p)) & 0xFF;
    }
    return true;
  };
  for (int N : {768, 8192, 32000}) {
    std::vector<int8_t> W((size_t)N * K);
    for (auto& w : W) w = (int8_t)((rand() % 255) - 127);
    std::vector<float> scale(N, 0.01f), y(N), yv(N);
    std::vector<int64_t> rowsum(N, 0);
    for (int r = 0; r < N; ++r)
      for (int k = 0; k < K; ++k) rowsum[r] += W[(size_t)r * K + k];
    const int reps = std::max(1, 40000000 / (N * K));
    for (int B : {4, 8}) {
      double s = best([&] { fma_rows(B, W.data(), scale.data(), N, K, x.data(), y.data()); }, reps);
      printf("N %5d %6.0f KB  fma%d   %6.1f G weights/s\n", N, N * K / 1024.0, B, N * K / s * 1e-9);
    }
    for (int P : {4, 5}) {
      std::vector<uint8_t> planes;
      float xscale;
      if (!make_planes(P, planes, xscale)) {
        printf("P %d: the activations' range needs more planes\n", P);
        continue;
      }
      auto f = [&] {
        if (P == 4) vnni_rows<4>(W.data(), scale.data(), rowsum.data(), N, K, planes.data(), xscale, yv.data());
        else vnni_rows<5>(W.data(), scale.data(), rowsum.data(), N, K, planes.data(), xscale, yv.data());
      };
      double s = best(f, reps);
      // exactness: against a float64 dot, |error| over sum |w x|
      double worst = 0;
      for (int r = 0; r < N; ++r) {
        double d = 0, a = 0;
        for (int k = 0; k < K; ++k) d += (double)W[(size_t)r * K + k] * x[k], a += std::fabs((double)W[(size_t)r * K + k] * x[k]);
        worst = std::max(worst, std::fabs(yv[r] - d * scale[r]) / (a * scale[r]));
      }
      printf("N %5d %6.0f KB  vnni%d  %6.1f G weights/s   worst |err|/sum|wx| %.2e\n", N, N * K / 1024.0, P,
             N * K / s * 1e-9, worst);
    }
  }
}
