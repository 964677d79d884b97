#include <vector>
#include <sys/syscall.h>
#include <unistd.h>
// One thread, each phase of amx_gemm.patch's product timed: build from the checkout root with
//   g++ -O3 -std=c++17 -fopenmp -ffp-contract=fast -DWIOLA_ISA_AVX512 -DWIOLA_ISA_AMX -mavx512f -mavx2 -mfma \
//     -mamx-tile -mamx-bf16 -mavx512bf16 -mtune=native -I. bench/results/2026-12-07_cpu_prompt-amx-gemm-intel-xeon/gemm_phases.cpp
#include "wiola/fast/decode_step_cpu.cpp"
#include <cstdio>
int main() {
  syscall(158, 0x1023, 18);
  for (auto [M, K, N] : std::vector<std::tuple<int64_t,int64_t,int64_t>>{{512, 256, 768}, {512, 768, 2304}, {512, 256, 32000}}) {
    std::vector<float> x(M * K), W(N * K), y(M * N);
    for (auto& v : x) v = (rand() % 2000 - 1000) * 0.001f;
    for (auto& v : W) v = (rand() % 2000 - 1000) * 0.0001f;
    std::vector<uint16_t> a(wiola_gemm_amx_halves(M, K) + 64), b(wiola_gemm_amx_halves(N, K) + 64);
    uint16_t* ap = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(a.data()) + 63) / 64 * 64);
    uint16_t* bp = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(b.data()) + 63) / 64 * 64);
    auto us = [](auto a, auto b) { return std::chrono::duration<double, std::micro>(b - a).count(); };
    for (int rep = 0; rep < 3; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      gemm_a_tiles(x.data(), K, M, K, ap, 0, (M + 15) / 16);
      auto t1 = std::chrono::steady_clock::now();
      gemm_b_tiles(W.data(), K, N, K, bp, 0, (N + 15) / 16);
      auto t2 = std::chrono::steady_clock::now();
      gemm_tiles(ap, bp, M, N, K, y.data(), N, 0, (N + 15) / 16);
      auto t3 = std::chrono::steady_clock::now();
      double macs = double(M) * N * K;
      printf("%ldx%ldx%ld one thread: A %.0f us, B %.0f us, tiles %.0f us (%.0f GMAC/s fp32, %.0f bf16 MACs/ns)\n", (long)M, (long)K, (long)N, us(t0, t1), us(t1, t2), us(t2, t3), macs / us(t2, t3) / 1e3, 9 * macs / us(t2, t3) / 1e3);
    }
  }
}
