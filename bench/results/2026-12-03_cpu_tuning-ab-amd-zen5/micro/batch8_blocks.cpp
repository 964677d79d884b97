// Batch 8 on one thread, K = 256, int8 and fp32 rows: the step's blocks (4 rows x 4 batch rows, two
// passes, each weight widened once a pass) against 2 rows x 8 batch rows (one pass, 16 accumulators
// and 8 x vectors in registers), outputs checked bitwise equal; N = 1024 (from L2) and 32000 (the
// head's shape, from L3 and DRAM).
// g++ -O3 -fopenmp -ffp-contract=fast -std=c++17 -DWIOLA_ISA_AVX512 -mavx512f -mavx512bw -mavx2 -mfma
//     -mtune=native -I <checkout root> batch8_blocks.cpp && N=1024 taskset -c 1 ./a.out
#include "wiola/fast/decode_step_cpu.cpp"
#include "timing.h"
#include <cstdio>
#include <random>
#include <vector>
namespace {
using micro::best;
template <typename T>
__attribute__((noinline)) void cur(const T* W, const float* s, int64_t N, int64_t K, const float* x, float* y) {
  for (int64_t r = 0; r + 4 <= N; r += 4) {
    prefetch_block(reinterpret_cast<const char*>(W), K * sizeof(T), r, N, false, 8);
    dot_rows<4>(W, s, K, x, K, y, N, 8, r);
  }
}
template <typename T>
__attribute__((noinline)) void nb8(const T* W, const float* s, int64_t N, int64_t K, const float* x, float* y) {
  for (int64_t r = 0; r + 4 <= N; r += 4) {
    prefetch_block(reinterpret_cast<const char*>(W), K * sizeof(T), r, N, false, 8);
    dot_block<2, 8>(W, s, K, x, K, y, N, r);
    dot_block<2, 8>(W, s, K, x, K, y, N, r + 2);
  }
}
}  // namespace
int main() {
  const int64_t K = 256, N = atoi(getenv("N"));
  std::mt19937 g(1);
  std::vector<float> W(N * K), s(N, 0.5f), x(8 * K), y(8 * N), y2(8 * N);
  std::vector<int8_t> W8(N * K);
  for (auto& v : W) v = 0.001f * (g() % 1000);
  for (auto& v : W8) v = (int8_t)g();
  for (auto& v : x) v = 0.001f * (g() % 1000) - 0.5f;
  for (int round = 0; round < 3; ++round) {
    const double a = best(20, [&] { cur(W8.data(), s.data(), N, K, x.data(), y.data()); });
    const double b = best(20, [&] { nb8(W8.data(), s.data(), N, K, x.data(), y2.data()); });
    bool eq = std::memcmp(y.data(), y2.data(), y.size() * 4) == 0;
    const double c = best(20, [&] { cur(W.data(), s.data(), N, K, x.data(), y.data()); });
    const double d = best(20, [&] { nb8(W.data(), s.data(), N, K, x.data(), y2.data()); });
    bool eq2 = std::memcmp(y.data(), y2.data(), y.size() * 4) == 0;
    printf("N=%ld B8 int8: 4x4 %.1f, 2x8 %.1f GMAC/s (%.2fx, bitwise %s) | fp32: %.1f, %.1f (%.2fx, %s)\n", N,
           N * K * 8 / a / 1e9, N * K * 8 / b / 1e9, a / b, eq ? "equal" : "DIFFER", N * K * 8 / c / 1e9, N * K * 8 / d / 1e9, c / d, eq2 ? "equal" : "DIFFER");
  }
}
