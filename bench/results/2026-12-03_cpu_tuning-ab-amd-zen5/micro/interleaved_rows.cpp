// bf16 rows at batch 1 over the 13m head's shape (32000 x 256, 16 MB: from L3), in blocks of 4 rows
// read in the step's order and arithmetic (Packed<bf16>'s parts, packed_fma_rows, store_sums4),
// from two layouts of the same weights: row-major as stored (a block reads 4 streams, one a row)
// and block-interleaved (a block's 4 rows' chunks side by side: one stream). The same kernel with
// two strides, so only the layout differs; sums asserted bitwise equal. One thread and two (each a
// contiguous half of the rows), the block 16 rows ahead prefetched (the Zen 5 distance for bf16),
// beside a plain read of the same bytes (timing.h).
#include "wiola/fast/decode_step_cpu.cpp"  // g++ ... -I <the checkout root>
#include "timing.h"
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include <omp.h>
namespace {
using micro::now;
volatile int sink[32];  // the reads' results, a cache line a thread
constexpr int64_t kChunk = 2 * kLanes;  // bf16 weights a chunk (64 bytes)

// Rows [r0, r1): row r's chunk c at W + (r / 4) * block + (r % 4) * ri + c * cs.
__attribute__((noinline)) void rows(const uint8_t* W, int64_t r0, int64_t r1, int64_t K, int64_t ri, int64_t cs,
                                    const float* xt, float* y, int64_t ahead) {
  const int64_t block = 4 * 2 * K, chunks = K / kChunk;
  for (int64_t r = r0; r < r1; r += 4) {
    const uint8_t* base = W + (r / 4) * block;
    const uint8_t* next = W + std::min(r + ahead, r1 - 4) / 4 * block;
    for (int64_t off = 0; off < block; off += 64) __builtin_prefetch(next + off, 0, 3);
    vec acc[4][1] = {};
    for (int64_t c = 0; c < chunks; ++c) {
      uvec lanes[4];
      for (int i = 0; i < 4; ++i) {
        std::memcpy(&lanes[i], base + i * ri + c * cs, sizeof(lanes[i]));
        WIOLA_PIN(lanes[i]);
      }
      packed_fma_rows<bf16, 0, 4, 1>(lanes, xt + c * kChunk, K, acc);
    }
    store_sums4<false, 1>(acc, nullptr, y + r, 0);
  }
}

void run(int nth, int64_t N, int64_t K, const uint8_t* W, int64_t ri, int64_t cs, const float* xt, float* y) {
#pragma omp parallel num_threads(nth)
  {
    const int t = omp_get_thread_num();
    const int64_t blocks = N / 4, r0 = blocks * t / nth * 4, r1 = blocks * (t + 1) / nth * 4;
    rows(W, r0, r1, K, ri, cs, xt, y, 16);
  }
}
}  // namespace

int main() {
  const int64_t N = 32000, K = 256, rb = 2 * K, bytes = N * rb;
  std::vector<uint8_t> A(bytes), B(bytes);
  std::mt19937 g(1);
  for (int64_t i = 0; i < bytes; ++i) A[i] = (i % 2) ? 0x3c + g() % 4 : g();  // bf16 near 0.01
  for (int64_t r = 0; r < N; ++r)  // B: block r/4, chunk c, row r%4
    for (int64_t c = 0; c < K / kChunk; ++c)
      std::memcpy(&B[(r / 4) * 4 * rb + (c * 4 + r % 4) * 64], &A[r * rb + c * 64], 64);
  std::vector<float> x(K), xt(K), ya(N), yb(N);
  for (auto& v : x) v = 0.001f * (g() % 1000);
  transpose<2>(x.data(), K, 1, K, xt.data());
  for (int round = 0; round < 3; ++round) {
    for (int nth : {1, 2}) {
      double ta = 1e9, tb = 1e9, tr = 1e9;
      // The layouts alternate in order, each read once a round (both 16 MB buffers fit the 32 MiB
      // L3 together); the plain read of each layout's own bytes after, in a loop of its own.
      for (int rep = 0; rep < 40; ++rep) {
        const auto a = [&] { ta = std::min(ta, micro::best(1, [&] { run(nth, N, K, A.data(), rb, 64, xt.data(), ya.data()); })); };
        const auto b = [&] { tb = std::min(tb, micro::best(1, [&] { run(nth, N, K, B.data(), 64, 256, xt.data(), yb.data()); })); };
        if (rep % 2) a(), b(); else b(), a();
      }
      for (int rep = 0; rep < 40; ++rep) {
        const uint8_t* buf = rep % 2 ? A.data() : B.data();
        tr = std::min(tr, micro::best(1, [&] {
#pragma omp parallel num_threads(nth)
          {
            const int t = omp_get_thread_num();
            sink[t * 16] = sink[t * 16] + _mm512_reduce_add_epi32(micro::xread(buf + bytes * t / nth, bytes / nth));
          }
        }));
      }
      std::printf("%d thread(s), 32000 x 256 bf16 (%.1f MB): row-major %.1f GB/s, interleaved %.1f GB/s (%.2fx), "
                  "plain read %.1f GB/s; sums %s\n", nth, bytes / 1e6, bytes / ta / 1e9, bytes / tb / 1e9, ta / tb,
                  bytes / tr / 1e9, std::memcmp(ya.data(), yb.data(), 4 * N) ? "DIFFER" : "bitwise equal");
    }
  }
}
