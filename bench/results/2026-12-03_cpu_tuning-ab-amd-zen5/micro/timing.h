// What the microbenchmarks here share (after the step's source, which they include first): a clock,
// the best of `reps` timed calls, and a plain 512-bit read of `n` bytes (four independent XOR
// chains, 256 bytes an iteration) to set a loop's rate beside.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <immintrin.h>

namespace micro {
inline double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

template <typename F>
double best(int reps, const F& f) {
  double b = 1e9;
  for (int i = 0; i < reps; ++i) {
    const double t = now();
    f();
    b = std::min(b, now() - t);
  }
  return b;
}

__attribute__((noinline)) inline __m512i xread(const void* data, int64_t n) {
  const char* p = static_cast<const char*>(data);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
  }
  return _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
}
}  // namespace micro
