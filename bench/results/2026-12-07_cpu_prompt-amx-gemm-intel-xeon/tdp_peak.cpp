#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <chrono>
#include <sys/syscall.h>
#include <unistd.h>
struct alignas(64) TileConfig { uint8_t palette = 1, start_row = 0, reserved[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
int main() {
  syscall(158, 0x1023, 18);
  TileConfig cfg; for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  alignas(64) static uint16_t buf[512];
  for (int i = 0; i < 512; ++i) buf[i] = 0x3f80;
  _tile_loadd(4, buf, 64); _tile_loadd(5, buf, 64); _tile_loadd(6, buf, 64); _tile_loadd(7, buf, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const long n = 2000000;
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) {
    _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 5, 6);
  }
  auto t1 = std::chrono::steady_clock::now();
  double ns = std::chrono::duration<double, std::nano>(t1 - t0).count();
  printf("4 independent sums: %.1f ns a tdpbf16ps, %.0f bf16 MACs/ns\n", ns / (4.0 * n), 4.0 * n * 8192 / ns);
  t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) { _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(0, 4, 7); _tile_dpbf16ps(0, 5, 6); }
  t1 = std::chrono::steady_clock::now();
  ns = std::chrono::duration<double, std::nano>(t1 - t0).count();
  printf("one sum: %.1f ns a tdpbf16ps\n", ns / (4.0 * n));
  _tile_release();
}
