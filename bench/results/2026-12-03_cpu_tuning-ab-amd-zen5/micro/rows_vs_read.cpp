// The step's product loops at batch 1 over the 13m head's shape (32000 x 256, from L3) against a
// plain 512-bit read of the same bytes, one thread, in one process: int8 rows (dot_block, 8 MB; with
// and without the software prefetch), bf16 rows (packed_block, 16 MB) and int4 rows (4 MB).
// g++ -O3 -fopenmp -ffp-contract=fast -std=c++17 -DWIOLA_ISA_AVX512 -mavx512f -mavx512bw -mavx2
//     -mfma -mtune=native -I <checkout root> rows_vs_read.cpp && taskset -c 1 ./a.out
#include "wiola/fast/decode_step_cpu.cpp"
#include "timing.h"
#include <cstdio>
#include <random>
#include <vector>
namespace {
using micro::best;
using micro::xread;
// Rows in blocks of 4 as stream_rows takes them, the block `ahead` rows on prefetched (none if < 0).
__attribute__((noinline)) void int8_rows(const int8_t* W, const float* s, int64_t N, int64_t K, const float* x, float* y,
                                         int64_t ahead) {
  for (int64_t r = 0; r + 4 <= N; r += 4) {
    if (ahead >= 0) prefetch_block(reinterpret_cast<const char*>(W), K, r, N, false, ahead);
    dot_block<4, 1>(W, s, K, x, 0, y, 0, r);
  }
}
template <typename P>
__attribute__((noinline)) void packed(const uint8_t* W, const float* s, int64_t N, int64_t K, const float* xt, float* y) {
  const int64_t rb = Packed<P>::row_bytes(K);
  for (int64_t r = 0; r + 4 <= N; r += 4) {
    prefetch_block(reinterpret_cast<const char*>(W), rb, r, N, false, 8);
    packed_rows<P, 4>(W, s, K, xt, y, 0, 1, r);
  }
}
}  // namespace
int main() {
  const int64_t N = 32000, K = 256;
  const double w = double(N) * K;
  std::mt19937 g(1);
  std::vector<int8_t> W8(N * K);
  std::vector<uint16_t> W16(N * K);
  std::vector<uint8_t> W4(N * K / 2);
  for (auto& v : W8) v = static_cast<int8_t>(g() % 255 - 127);
  for (auto& v : W16) v = 0x3c00 + g() % 256;
  for (auto& v : W4) v = g();
  std::vector<float> s(N * K / 32, 0.01f), x(K), xt2(K), xt8(K), y(N);
  for (auto& v : x) v = 0.001f * (g() % 1000);
  transpose<Packed<bf16>::kPer>(x.data(), K, 1, K, xt2.data());
  transpose<Packed<q4>::kPer>(x.data(), K, 1, K, xt8.data());
  volatile int sink = 0;
  const auto read = [&](const void* p, int64_t n) { return [&, p, n] { sink = sink + _mm512_reduce_add_epi32(xread(p, n)); }; };
  for (int round = 0; round < 3; ++round) {
    const double r8 = best(30, read(W8.data(), N * K)), r16 = best(30, read(W16.data(), 2 * N * K));
    const double i8 = best(30, [&] { int8_rows(W8.data(), s.data(), N, K, x.data(), y.data(), 8); });
    const double i8n = best(30, [&] { int8_rows(W8.data(), s.data(), N, K, x.data(), y.data(), -1); });
    const double b16 = best(30, [&] { packed<bf16>(reinterpret_cast<const uint8_t*>(W16.data()), s.data(), N, K, xt2.data(), y.data()); });
    const double q4r = best(30, [&] { packed<q4>(W4.data(), s.data(), N, K, xt8.data(), y.data()); });
    printf("int8 8 MB: plain read %.1f GB/s, rows %.1f GB/s (no prefetch %.1f) | bf16 16 MB: plain read %.1f GB/s, "
           "rows %.1f GB/s (%.1f Gw/s) | int4 rows %.1f Gw/s\n",
           w / r8 / 1e9, w / i8 / 1e9, w / i8n / 1e9, 2 * w / r16 / 1e9, 2 * w / b16 / 1e9, w / b16 / 1e9, w / q4r / 1e9);
  }
}
