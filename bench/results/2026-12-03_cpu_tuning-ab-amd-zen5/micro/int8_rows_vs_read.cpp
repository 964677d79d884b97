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
template <typename T>
void rows(const T* W, const float* s, int64_t N, int64_t K, const float* x, float* y, int64_t ahead) {
  const char* bytes = reinterpret_cast<const char*>(W);
  for (int64_t r = 0; r + 4 <= N; r += 4) {
    if (ahead >= 0) prefetch_block(bytes, K * sizeof(T), r, N, false, ahead);
    dot_block<4, 1>(W, s, K, x, 0, y, 0, r);
  }
}
}
int main() {
  const int64_t N = 32000, K = 256;
  std::vector<int8_t> W(N * K); std::vector<float> s(N, 0.01f), x(K), y(N);
  std::mt19937 g(1);
  for (auto& w : W) w = (int8_t)(g() % 255 - 127);
  for (auto& v : x) v = 0.001f * (g() % 1000);
  volatile int sink = 0;
  for (int round = 0; round < 3; ++round) {
    double br = 1e9, bd = 1e9, bn = 1e9;
    for (int rep = 0; rep < 30; ++rep) {
      double t = now(); __m512i v = xread((const char*)W.data(), N * K); br = std::min(br, now() - t);
      sink += _mm512_reduce_add_epi32(v);
      t = now(); rows<int8_t>(W.data(), s.data(), N, K, x.data(), y.data(), 8); bd = std::min(bd, now() - t);
      t = now(); rows<int8_t>(W.data(), s.data(), N, K, x.data(), y.data(), -1); bn = std::min(bn, now() - t);
    }
    double B = double(N) * K;
    printf("8 MB int8, one thread: plain read %.1f GB/s; dot_block prefetch 8: %.1f GB/s; no prefetch: %.1f GB/s\n", B / br / 1e9, B / bd / 1e9, B / bn / 1e9);
  }
}
