// int4 at batch 8: each chunk widened once for all 8 batch rows (q4_scratch) against the step's
// packed_rows, which widens it again for every pair of batch rows; one thread, a 1024 x 256
// product, outputs compared bitwise. Build from this folder:
//   g++ -O3 -fopenmp -ffp-contract=fast -std=c++17 -DWIOLA_ISA_AVX512 -mavx512f -mavx2 -mfma \
//       -mtune=native int4_widened_once.cpp
#include "../../../wiola/fast/decode_step_cpu.cpp"
#include <chrono>
#include <cstdio>
#include <vector>
using namespace std::chrono;
template <typename F> double best(F f, int reps) {
  double b = 1e30;
  for (int t = 0; t < 9; ++t) { auto t0 = steady_clock::now(); for (int i = 0; i < reps; ++i) f(); b = std::min(b, duration<double>(steady_clock::now() - t0).count() / reps); }
  return b;
}
// int4 rows [r, r+4) for B (even) batch rows: each chunk's parts widened once into registers'
// memory (wq), then every pair of batch rows multiplies them.
template <int NR>
void q4_scratch(const uint8_t* W, const float* scale, int64_t K, const float* xt, float* y, int64_t ldy, int64_t B, int64_t r) {
  using P = Packed<q4>;
  constexpr int64_t chunk = P::kPer * kLanes;
  const int64_t row_bytes = P::row_bytes(K);
  vec wq[NR][8];
  vec acc[NR][8] = {};
  for (int64_t c = 0; c < K; c += chunk) {
    vec s[NR];
    for (int i = 0; i < NR; ++i) {
      uvec lanes;
      std::memcpy(&lanes, W + (r + i) * row_bytes + P::row_bytes(c), sizeof(lanes));
      WIOLA_PIN(lanes);
      wq[i][0] = P::part<0>(lanes); wq[i][1] = P::part<1>(lanes); wq[i][2] = P::part<2>(lanes); wq[i][3] = P::part<3>(lanes);
      wq[i][4] = P::part<4>(lanes); wq[i][5] = P::part<5>(lanes); wq[i][6] = P::part<6>(lanes); wq[i][7] = P::part<7>(lanes);
      s[i] = P::lane_scales(scale, r + i, K, c);
    }
    for (int64_t b = 0; b < B; b += 2) {
      vec sum[NR][2] = {};
      for (int J = 0; J < 8; ++J) {
        vec x0 = load(xt + b * K + c + J * kLanes), x1 = load(xt + (b + 1) * K + c + J * kLanes);
        WIOLA_PIN(x0); WIOLA_PIN(x1);
        for (int i = 0; i < NR; ++i) { sum[i][0] += wq[i][J] * x0; sum[i][1] += wq[i][J] * x1; }
      }
      for (int i = 0; i < NR; ++i) { acc[i][b] += sum[i][0] * s[i]; acc[i][b + 1] += sum[i][1] * s[i]; }
    }
  }
  for (int64_t b = 0; b < B; b += 2) {
    vec a2[4][2];
    for (int i = 0; i < 4; ++i) { a2[i][0] = acc[i][b]; a2[i][1] = acc[i][b + 1]; }
    store_sums4<false>(a2, nullptr, y + b * ldy + r, ldy);
  }
}
int main() {
  const int64_t N = 1024, K = 256, B = 8;
  std::vector<uint8_t> W(N * K / 2); std::vector<float> sc(N * K / 32, 0.01f), x(B * K), xt(B * K), y(B * N), y2(B * N);
  for (auto& b : W) b = rand(); for (auto& v : sc) v = (rand() % 100 + 1) * 1e-3f; for (auto& v : x) v = (rand() % 1000) * 1e-3f - 0.5f;
  transpose<8>(x.data(), K, B, K, xt.data());
  auto a = [&] { for (int64_t r = 0; r < N; r += 4) packed_rows<q4, 4>(W.data(), sc.data(), K, xt.data(), y.data(), N, B, r); };
  auto b = [&] { for (int64_t r = 0; r < N; r += 4) q4_scratch<4>(W.data(), sc.data(), K, xt.data(), y2.data(), N, B, r); };
  a(); b();
  printf("bitwise same: %d\n", std::memcmp(y.data(), y2.data(), y.size() * 4) == 0);
  for (int rep = 0; rep < 3; ++rep) printf("current %.1f us  scratch %.1f us\n", best(a, 200) * 1e6, best(b, 200) * 1e6);
}
