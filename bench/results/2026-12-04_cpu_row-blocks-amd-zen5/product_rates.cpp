// One thread's rate through share_product (the step's own product path: stream_rows, prefetch,
// blocks, the final sums) for each weight type, at one batch row, over matrices of 256-weight rows
// from L1-sized to L3-sized; the best of 9 timed loops. Build against a source of the step:
//   g++ -O3 -fopenmp -ffp-contract=fast -std=c++17 -DWIOLA_ISA_AVX512 -mavx512f -mavx2 -mfma \
//       -mtune=native -DWIOLA_SOURCE='"../../../wiola/fast/decode_step_cpu.cpp"' product_rates.cpp
#include WIOLA_SOURCE
#include <chrono>
#include <cstdio>
#include <vector>

using namespace std::chrono;

template <typename F>
double best(F f, int reps) {
  double b = 1e30;
  for (int t = 0; t < 9; ++t) {
    auto t0 = steady_clock::now();
    for (int i = 0; i < reps; ++i) f();
    b = std::min(b, duration<double>(steady_clock::now() - t0).count() / reps);
  }
  return b;
}

template <typename T>
void rate(const char* name, int64_t N, int64_t K, int64_t bytes_per_row, int64_t ahead) {
  std::vector<uint8_t> W(N * bytes_per_row);
  for (auto& b : W) b = rand() & 0x3F;  // small bf16 exponents; any bytes for int8 and int4
  std::vector<float> scale(N * K / 32 + N, 0.01f), x(K), y(N);
  for (auto& v : x) v = (rand() % 1000) * 1e-3f;
  const Split split;
  auto f = [&] {
    share_product<T>(split, reinterpret_cast<const T*>(W.data()), scale.data(), N, K, x.data(), K, y.data(), N, 1, 0,
                     1, false, ahead);
  };
  const double s = best(f, std::max<int64_t>(1, 40000000 / (N * K)));
  printf("%-5s %8.0f KB  %6.1f G weights/s  %6.1f GB/s\n", name, N * bytes_per_row / 1024.0, N * K / s * 1e-9,
         N * bytes_per_row / s * 1e-9);
}

int main() {
  const int64_t K = 256;
  for (int64_t N : {64, 1024, 8192, 32768}) {
    rate<int8_t>("int8", N, K, K, 32);
    rate<q4>("int4", N, K, K / 2, 64);
    rate<bf16>("bf16", N, K, 2 * K, 16);
    rate<float>("fp32", N, K, 4 * K, 8);
  }
}
