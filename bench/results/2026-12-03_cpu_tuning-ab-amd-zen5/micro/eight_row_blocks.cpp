#include "wiola/fast/decode_step_cpu.cpp"  // g++ ... -I <the checkout root>
#include "timing.h"
#include <cstdio>
#include <vector>
#include <random>
#include <cstring>
namespace {
using micro::now;

template <typename P, int NR>
__attribute__((noinline)) void block8(const uint8_t* W, const float* scale, int64_t K, const float* xt, float* y, int64_t r) {
  constexpr int64_t chunk = Packed<P>::kPer * kLanes;
  const int64_t row_bytes = Packed<P>::row_bytes(K);
  vec acc[NR][1] = {};
  for (int64_t c = 0; c < K; c += chunk) {
    uvec lanes[NR];
    for (int i = 0; i < NR; ++i) std::memcpy(&lanes[i], W + (r + i) * row_bytes + Packed<P>::row_bytes(c), sizeof(lanes[i]));
    if constexpr (Packed<P>::kScaled) {
      vec sum[NR][1] = {};
      packed_fma_rows<P, 0, NR, 1>(lanes, xt + c, K, sum);
      for (int i = 0; i < NR; ++i) acc[i][0] += sum[i][0] * Packed<P>::lane_scales(scale, r + i, K, c);
    } else {
      packed_fma_rows<P, 0, NR, 1>(lanes, xt + c, K, acc);
    }
  }
  for (int g = 0; g < NR; g += 4) {
    const vec a4[4][1] = {{acc[g][0]}, {acc[g + 1][0]}, {acc[g + 2][0]}, {acc[g + 3][0]}};
    store_sums4<false, 1>(a4, nullptr, y + r + g, 0);
  }
}
template <typename P, int NR>
__attribute__((noinline)) void rows(const uint8_t* W, const float* s, int64_t N, int64_t K, const float* xt, float* y) {
  const int64_t rb = Packed<P>::row_bytes(K);
  for (int64_t r = 0; r + NR <= N; r += NR) {
    for (int g = 0; g < NR; g += 4) prefetch_block((const char*)W, rb, r + g, N, false, 8);
    if constexpr (NR == 4) packed_block<P, NR, 1>(W, s, K, xt, K, y, 0, r); else block8<P, NR>(W, s, K, xt, y, r);
  }
}
template <typename P>
void bench(const char* name, int64_t N, int64_t K, int reps) {
  std::vector<uint8_t> W(N * Packed<P>::row_bytes(K)); std::vector<float> s(N * K / 32, 0.01f), x(K), xt(K), y4(N), y8(N);
  std::mt19937 g(1);
  for (size_t i = 0; i < W.size(); ++i) W[i] = (i % 2 && sizeof(P) == 2) ? 0x3c + g() % 4 : g();
  for (auto& v : x) v = 0.001f * (g() % 1000);
  transpose<Packed<P>::kPer>(x.data(), K, 1, K, xt.data());
  double b4 = 1e9, b8 = 1e9;
  for (int rep = 0; rep < reps; ++rep) {
    double t = now(); rows<P, 4>(W.data(), s.data(), N, K, xt.data(), y4.data()); b4 = std::min(b4, now() - t);
    t = now(); rows<P, 8>(W.data(), s.data(), N, K, xt.data(), y8.data()); b8 = std::min(b8, now() - t);
  }
  double w = double(N) * K;
  printf("%s %ldx%ld: NR4 %.1f Gw/s, NR8 %.1f Gw/s: %.2fx, %s\n", name, N, K, w / b4 / 1e9, w / b8 / 1e9, b4 / b8,
         std::memcmp(y4.data(), y8.data(), 4 * N) ? "DIFFER" : "bitwise equal");
}
}
int main() {
  for (int i = 0; i < 3; ++i) {
    bench<bf16>("bf16", 1024, 256, 400);
    bench<bf16>("bf16", 32000, 256, 30);
    bench<bf16>("bf16", 512, 512, 400);
    bench<q4>("int4", 1024, 256, 400);
    bench<q4>("int4", 32000, 256, 30);
  }
}
