// int8 rows of the 13m head's shape (32000 x 256, 8 MB, from L3) on one thread, in one process: the
// step's widening rows (dot_block: vpmovsxbd, vcvtdq2ps, FMA) against exact fixed-point rows through
// AVX-512 VNNI (each x as four signed byte planes of a 31-bit fixed point, held in registers; the
// weights' bytes XOR 0x80 as vpdpbusd's unsigned operand; the planes' int32 sums combined in pairs,
// then four rows reduced by one shuffle tree), at batch 1 and 8 (VNNI: one pass per batch row),
// beside a plain 512-bit read. Only the speed is measured here (the planes are random bytes).
// g++ -O3 -fopenmp -ffp-contract=fast -std=c++17 -DWIOLA_ISA_AVX512 -mavx512f -mavx512bw -mavx512vl
//     -mavx512vnni -mavx2 -mfma -mtune=native -I <checkout root> int8_vnni_rows.cpp && K=256 taskset -c 1 ./a.out
#include "wiola/fast/decode_step_cpu.cpp"
#include "timing.h"
#include <cstdio>
#include <random>
#include <vector>
namespace {
using micro::best;
using micro::xread;
__attribute__((noinline)) void int8_rows(const int8_t* W, const float* s, int64_t N, int64_t K, const float* x, float* y) {
  for (int64_t r = 0; r + 4 <= N; r += 4) {
    prefetch_block(reinterpret_cast<const char*>(W), K, r, N, false, 32);
    dot_block<4, 1>(W, s, K, x, 0, y, 0, r);
  }
}
// 4 limbs: xl[l*K + k] signed digit l of q_k. W bytes xor 0x80 -> unsigned. K <= 4096.
inline __m128i isum4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
  __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));  // 0 1 0 1 | per 128
  __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));  // 2 3 2 3
  __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));   // 0 1 2 3 per 128
  __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
template <int NB>
__attribute__((noinline)) void vnni_rows(const int8_t* W, const float* s, int64_t N, int64_t K, const int8_t* xl, float* y, int B) {
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  for (int64_t r = 0; r + 4 <= N; r += 4) {
    prefetch_block(reinterpret_cast<const char*>(W), K, r, N, false, 32);
    for (int b = 0; b < B; ++b) {
    const int8_t* xb = xl + b * 4 * K;
    __m512i acc[4][4];
    for (int i = 0; i < 4; ++i) for (int l = 0; l < 4; ++l) acc[i][l] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 64) {
      __m512i xv[4];
      for (int l = 0; l < 4; ++l) { xv[l] = _mm512_loadu_si512(xb + l * K + k); WIOLA_PIN(xv[l]); }
      for (int i = 0; i < 4; ++i) {
        __m512i w = _mm512_xor_si512(_mm512_loadu_si512(W + (r + i) * K + k), flip);
        WIOLA_PIN(w);
        for (int l = 0; l < 4; ++l) acc[i][l] = _mm512_dpbusd_epi32(acc[i][l], w, xv[l]);
      }
    }
    __m512i A[4], Bv[4];
    for (int i = 0; i < 4; ++i) {
      A[i] = _mm512_add_epi32(acc[i][0], _mm512_slli_epi32(acc[i][1], 8));
      Bv[i] = _mm512_add_epi32(acc[i][2], _mm512_slli_epi32(acc[i][3], 8));
    }
    alignas(16) int32_t a4[4], b4[4];
    _mm_store_si128((__m128i*)a4, isum4(A[0], A[1], A[2], A[3]));
    _mm_store_si128((__m128i*)b4, isum4(Bv[0], Bv[1], Bv[2], Bv[3]));
    for (int i = 0; i < 4; ++i) {
      int64_t t = (int64_t)a4[i] + ((int64_t)b4[i] << 16);
      y[b * N + r + i] = (float)((double)t * s[r + i]);
    }
    }
  }
}
}  // namespace
int main() {
  const int64_t K = atoi(getenv("K")), N = 32000 * 256 / K;
  const double w = double(N) * K;
  std::mt19937 g(1);
  std::vector<int8_t> W8(N * K), xl(32 * K);
  for (auto& v : W8) v = static_cast<int8_t>(g() % 255 - 127);
  for (auto& v : xl) v = static_cast<int8_t>(g());
  std::vector<float> s(N, 0.01f), x(8 * K), y(8 * N);
  for (auto& v : x) v = 0.001f * (g() % 1000);
  volatile int sink = 0;
  for (int round = 0; round < 4; ++round) {
    const double r8 = best(30, [&] { sink = sink + _mm512_reduce_add_epi32(xread(W8.data(), N * K)); });
    const double i8 = best(30, [&] { int8_rows(W8.data(), s.data(), N, K, x.data(), y.data()); });
    const double v4 = best(30, [&] { vnni_rows<1>(W8.data(), s.data(), N, K, xl.data(), y.data(), 1); });
    const double v8 = best(10, [&] { vnni_rows<1>(W8.data(), s.data(), N, K, xl.data(), y.data(), 8); });
    const double i88 = best(10, [&] { for (int64_t r = 0; r + 4 <= N; r += 4) { prefetch_block(reinterpret_cast<const char*>(W8.data()), K, r, N, false, 32); dot_rows<4>(W8.data(), s.data(), K, x.data(), K, y.data(), N, 8, r); } });
    printf("read %.1f GB/s | B1: fma rows %.1f | vnni4 %.1f GB/s || B8: fma %.1f vnni4 %.1f Gw/s\n", w / r8 / 1e9, w / i8 / 1e9, w / v4 / 1e9, w / i88 / 1e9, w / v8 / 1e9);
  }
}
