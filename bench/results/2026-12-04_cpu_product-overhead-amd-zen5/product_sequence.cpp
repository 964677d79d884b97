// The 13m step's products alone, bf16 or int8, 2 threads: the 43 products of one step (6 layers of
// W_q, W_k, W_v, W_o, W_up, W_bp, W_down, then the head; 25.8 MB in bf16) in sequence, each shared
// between the threads as the step shared them (Shares::run), against one product over the same
// bytes (one matrix of 256 columns), alternated 400 times; medians and bests printed. Nothing else
// of the step runs (no attention, norms or sampling), so the difference is what splitting the
// bytes into 43 products costs: the claims, the threads' meeting at each product's end, each
// product's start.
//
//   git show 9ed7159:wiola/fast/decode_step_cpu.cpp > /tmp/base.cpp
//   g++ -O3 -fopenmp -ffp-contract=fast -std=c++17 -DWIOLA_ISA_AVX512 -mavx512f -mavx2 -mfma \
//     -mtune=native -DSOURCE='"/tmp/base.cpp"' product_sequence.cpp -o product_sequence
//   ./product_sequence TYPE AHEAD STREAM_HEAD BARRIER [STACKED [LAYERS_ONLY]]
//
// SOURCE: the step's source as of 9ed7159 (the threads claiming their rows through Shares), or a
// copy of it with one of the patches here applied (fixed_split.patch: even cuts, no claims), as
// an absolute path. TYPE: bf16 or int8 (random weights; int8 with per-row scales). AHEAD: rows
// prefetched ahead (16 and 32: the Zen 5's choice for bf16 and int8). STREAM_HEAD: 1 for the
// non-temporal head (the Zen 5's choice for bf16; 0 for int8). BARRIER: 1 for the step's barrier
// after each product. STACKED: 1 for W_q, W_k, W_v as one 768-row matrix and W_up, W_bp as one of
// 1,536. LAYERS_ONLY: 1 to leave the head out (the layers' 42 products: 9.4 MB in bf16).
#ifndef SOURCE
#error "-DSOURCE='\"PATH\"': the step's source as of 9ed7159 (its Shares) or a patched copy of it"
#endif
#include SOURCE
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

template <typename T>
int run(int argc, char** argv) {
  using clock = std::chrono::steady_clock;
  const int64_t d = 256, F = 512, V = 32000, L = 6;
  const int64_t ahead = argc > 2 ? atoi(argv[2]) : 16;
  const bool stream = argc > 3 ? atoi(argv[3]) : 1;
  const bool barrier = argc > 4 ? atoi(argv[4]) : 1;
  const bool stacked = argc > 5 ? atoi(argv[5]) : 0;
  const bool layers_only = argc > 6 ? atoi(argv[6]) : 0;
  const int nth = 2;
  struct Matrix {
    int64_t N, K;
    size_t at;
  };
  std::vector<Matrix> ms;
  size_t total = 0;
  const std::vector<std::pair<int64_t, int64_t>> layer =
      stacked ? std::vector<std::pair<int64_t, int64_t>>{{3 * d, d}, {d, d}, {3 * F, d}, {d, F}}
              : std::vector<std::pair<int64_t, int64_t>>{{d, d}, {d, d}, {d, d}, {d, d}, {2 * F, d}, {F, d}, {d, F}};
  for (int l = 0; l < L; ++l)
    for (auto [N, K] : layer) ms.push_back({N, K, total}), total += N * K;
  if (!layers_only) {
    ms.push_back({V, d, total});
    total += V * d;
  }
  std::vector<T> W(total);
  std::vector<float> scale(total / d + 1, 0.01f);  // per row (int8), more than enough for every matrix
  std::mt19937 g(1);
  for (auto& w : W) {
    if constexpr (std::is_same_v<T, bf16>)
      w = 0x3c00 | (g() & 0x7f) | ((g() & 1) << 15);  // normal bf16 values
    else
      w = static_cast<T>(static_cast<int>(g() % 255) - 127);
  }
  const float* sc = std::is_same_v<T, int8_t> ? scale.data() : nullptr;
  std::vector<float> x(F, 0.01f), y(V), y_all(total / d);
  std::vector<Share> slots((ms.size() + 1) * nth);
  std::vector<Arrival> arrivals(nth);
  Shares shares;
  shares.slots = slots.data(), shares.nth = nth;
  omp_set_num_threads(nth);
  const auto sequence = [&] {
    for (size_t i = 0; i < ms.size(); ++i) shares.init(i, ms[i].N);
    for (auto& a : arrivals) a.reached.store(0);
    parallel(nth, [&](int tid, int n) {
      Barrier bar{arrivals.data(), tid, n};
      for (size_t i = 0; i < ms.size(); ++i) {
        share_product(shares, i, W.data() + ms[i].at, sc, ms[i].N, ms[i].K, x.data(), ms[i].K, y.data(), V, 1, tid,
                      stream && i + 1 == ms.size(), ahead);
        if (barrier) bar.wait();
      }
    });
  };
  const auto one = [&] {
    shares.init(0, total / d);
    parallel(nth, [&](int tid, int) {
      share_product(shares, 0, W.data(), sc, static_cast<int64_t>(total / d), d, x.data(), d, y_all.data(), 0, 1, tid,
                    stream, ahead);
    });
  };
  for (int w = 0; w < 20; ++w) sequence(), one();
  std::vector<double> a, b;
  for (int r = 0; r < 400; ++r) {
    auto t0 = clock::now();
    sequence();
    a.push_back(std::chrono::duration<double>(clock::now() - t0).count());
    t0 = clock::now();
    one();
    b.push_back(std::chrono::duration<double>(clock::now() - t0).count());
  }
  std::sort(a.begin(), a.end()), std::sort(b.begin(), b.end());
  std::printf("%s, %zu products%s (%.1f MB): median %.1f us (best %.1f); one product: median %.1f us (best %.1f); %.3fx\n",
              argv[1], ms.size(), barrier ? " with barriers" : "", total * sizeof(T) / 1e6, a[200] * 1e6, a[0] * 1e6,
              b[200] * 1e6, b[0] * 1e6, a[200] / b[200]);
  return 0;
}

int main(int argc, char** argv) {
  const std::string type = argc > 1 ? argv[1] : "bf16";
  if (type == "bf16") return run<bf16>(argc, argv);
  if (type == "int8") return run<int8_t>(argc, argv);
  std::fprintf(stderr, "TYPE: bf16 or int8, not %s\n", type.c_str());
  return 2;
}
