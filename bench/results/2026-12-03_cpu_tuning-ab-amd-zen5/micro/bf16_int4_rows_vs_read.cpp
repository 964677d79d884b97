#include "wiola/fast/decode_step_cpu.cpp"  // g++ ... -I <the checkout root>
#include <chrono>
#include <cstdio>
#include <vector>
#include <random>
namespace {
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
__attribute__((noinline)) __m512i xread(const char* p, int64_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
  }
  return _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
}
template <typename P>
__attribute__((noinline)) void rows(const uint8_t* W, const float* s, int64_t N, int64_t K, const float* xt, float* y, int64_t ahead) {
  const int64_t rb = Packed<P>::row_bytes(K);
  for (int64_t r = 0; r + 4 <= N; r += 4) {
    if (ahead >= 0) prefetch_block((const char*)W, rb, r, N, false, ahead);
    packed_rows<P, 4>(W, s, K, xt, y, 0, 1, r);
  }
}
}
int main() {
  const int64_t N = 32000, K = 256;
  std::vector<uint16_t> W(N * K); std::vector<float> s(N * K / 32, 0.01f), x(K), y(N);
  std::vector<uint8_t> W4(N * K / 2);
  std::mt19937 g(1);
  for (auto& w : W) w = 0x3c00 + g() % 256;
  for (auto& w : W4) w = g();
  for (auto& v : x) v = 0.001f * (g() % 1000);
  std::vector<float> xt(K);
  transpose<Packed<bf16>::kPer>(x.data(), K, 1, K, xt.data());
  std::vector<float> xt4(K);
  transpose<Packed<q4>::kPer>(x.data(), K, 1, K, xt4.data());
  volatile int sink = 0;
  for (int round = 0; round < 3; ++round) {
    double br = 1e9, bd = 1e9, b4 = 1e9;
    for (int rep = 0; rep < 30; ++rep) {
      double t = now(); __m512i v = xread((const char*)W.data(), N * K * 2); br = std::min(br, now() - t);
      sink += _mm512_reduce_add_epi32(v);
      t = now(); rows<bf16>((const uint8_t*)W.data(), s.data(), N, K, xt.data(), y.data(), 8); bd = std::min(bd, now() - t);
      t = now(); rows<q4>(W4.data(), s.data(), N, K, xt4.data(), y.data(), 8); b4 = std::min(b4, now() - t);
    }
    double B = double(N) * K;
    printf("one thread, 32000x256: plain read of the bf16 16 MB %.1f GB/s; bf16 rows %.1f GB/s (%.1f Gw/s); int4 rows %.1f Gw/s\n", 2 * B / br / 1e9, 2 * B / bd / 1e9, B / bd / 1e9, B / b4 / 1e9);
  }
}
