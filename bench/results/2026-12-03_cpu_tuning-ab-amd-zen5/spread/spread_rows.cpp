// One thread's product loop over an fp32 and an int8 matrix of K = 256 (N rows: N=32000 is the 13m
// head, 32 MB fp32 from L3 and DRAM; N=2048 is 2 MB, from L3) at batch 1, 4 and 8: the step's loop
// (dot_rows, the block AHEAD rows on prefetched at once before each block of 4 rows) against the
// same loop prefetching that block a line per row for every 64 bytes read (dot_block_pf, the first
// batch pass only). Also an FMA issue loop (latency-bound as written: ignore its figure).
// g++ -O3 -fopenmp -ffp-contract=fast -std=c++17 -DWIOLA_ISA_AVX512 -mavx512f -mavx512bw -mavx2 -mfma
//     -mtune=native -I <checkout root> spread_rows.cpp && N=32000 AHEAD=8 taskset -c 1 ./a.out
#include "wiola/fast/decode_step_cpu.cpp"
#include "../micro/timing.h"
#include <cstdio>
#include <random>
#include <vector>
namespace {
using micro::best;
bool g_nt; int64_t g_ahead;
template <int NR, int NB, typename T>
inline void dot_block_pf(const T* W, const float* scale, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy,
                      int64_t r, const char* pf) {
  vec acc[NR][NB] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if (pf && ((k * (int64_t)sizeof(T)) & 63) == 0)
      for (int i = 0; i < NR; ++i) __builtin_prefetch(pf + ((i * K + k) * (int64_t)sizeof(T)), 0, 3);
    vec xv[NB];
    for (int b = 0; b < NB; ++b) { xv[b] = load(x + b * ldx + k); WIOLA_PIN(xv[b]); }
    for (int i = 0; i < NR; ++i) {
      vec w = Weight<T>::load(W + (r + i) * K + k);
      WIOLA_PIN(w);
      for (int b = 0; b < NB; ++b) acc[i][b] += w * xv[b];
    }
  }
  store_sums4<Weight<T>::kScaled>(acc, scale + r, y + r, ldy);
}
template <typename T>
__attribute__((noinline)) void rows_pf(const T* W, const float* s, int64_t N, int64_t K, const float* x, float* y, int64_t B) {
  for (int64_t r = 0; r + 4 <= N; r += 4) {
    const int64_t p = r + g_ahead + 4 <= N ? r + g_ahead : -1;
    const char* pf = p < 0 ? nullptr : reinterpret_cast<const char*>(W + p * K);
    if (B == 1) dot_block_pf<4, 1>(W, s, K, x, K, y, N, r, pf);
    else { dot_block_pf<4, 4>(W, s, K, x, K, y, N, r, pf); if (B == 8) dot_block_pf<4, 4>(W, s, K, x + 4 * K, K, y + 4 * N, N, r, nullptr); }
  }
}
template <typename T>
__attribute__((noinline)) void rows(const T* W, const float* s, int64_t N, int64_t K, const float* x, float* y, int64_t B) {
  for (int64_t r = 0; r + 4 <= N; r += 4) {
    prefetch_block(reinterpret_cast<const char*>(W), K * sizeof(T), r, N, g_nt, g_ahead);
    dot_rows<4>(W, s, K, x, K, y, N, B, r);
  }
}
__attribute__((noinline)) vec fmapeak(int64_t n, vec a) {
  vec acc[12] = {};
  for (int64_t i = 0; i < n; ++i) for (int j = 0; j < 12; ++j) { acc[j] = acc[j] * a + a; WIOLA_PIN(acc[j]); }
  vec s = {}; for (int j = 0; j < 12; ++j) s += acc[j]; return s;
}
}  // namespace
int main() {
  g_nt = getenv("NT") != nullptr; g_ahead = atoi(getenv("AHEAD"));
  const int64_t K = 256, N = atoi(getenv("N"));
  std::mt19937 g(1);
  std::vector<float> W(N * K), s(N, 1.f), x(8 * K), y(8 * N);
  std::vector<int8_t> W8(N * K);
  for (auto& v : W) v = 0.001f * (g() % 1000);
  for (auto& v : W8) v = (int8_t)g();
  for (auto& v : x) v = 0.001f * (g() % 1000);
  volatile float sink = 0;
  vec a = {}; a += 0.999f;
  const double tf = best(10, [&] { sink = sink + fmapeak(1000000, a)[0]; });
  printf("FMA peak %.1f GFMA/s (%.2f GHz if 2 pipes)\n", 12e6 * 16 / tf / 1e9, 12e6 / 2 / tf / 1e9);
  for (int B : {1, 4, 8}) {
    const double t = best(30, [&] { rows(W.data(), s.data(), N, K, x.data(), y.data(), B); });
    const double t8 = best(30, [&] { rows(W8.data(), s.data(), N, K, x.data(), y.data(), B); });
    const double tp = best(30, [&] { rows_pf(W.data(), s.data(), N, K, x.data(), y.data(), B); });
    const double tp8 = best(30, [&] { rows_pf(W8.data(), s.data(), N, K, x.data(), y.data(), B); });
    printf("   in-loop prefetch: fp32 %.1f GFMA/s int8 %.1f\n", double(N) * K * B / tp / 1e9, double(N) * K * B / tp8 / 1e9);
    printf("N=%ld B=%d fp32 %.1f GFMA/s (%.1f GB/s) | int8 %.1f GFMA/s\n", N, B, double(N) * K * B / t / 1e9, double(N) * K * 4 / t / 1e9, double(N) * K * B / t8 / 1e9);
  }
}
