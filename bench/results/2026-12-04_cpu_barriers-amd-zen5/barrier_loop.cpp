// Barriers alone, in a loop, on every thread of one OpenMP region: libgomp's `omp barrier`, a
// central counter (one line every thread increments, the last bumping a generation), and the
// step's per-thread arrival counts (wiola/fast/decode_step_cpu.cpp, Barrier: each thread stores
// its count in a line of its own and waits on every other's). ns a barrier, the best of 5 runs of
// 200,000 barriers. g++ -O2 -fopenmp barrier_loop.cpp -o barrier_loop && ./barrier_loop [threads]
#include <omp.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>

struct alignas(64) Line {
  std::atomic<long> v{0};
};
Line counter, generation, arrivals[64];

inline void pause_() { __builtin_ia32_pause(); }

void central(int nth, long& gen) {
  const long g = gen;
  if (counter.v.fetch_add(1, std::memory_order_acq_rel) == nth - 1) {
    counter.v.store(0, std::memory_order_relaxed);
    generation.v.store(g + 1, std::memory_order_release);
  } else {
    while (generation.v.load(std::memory_order_acquire) == g) pause_();
  }
  gen = g + 1;
}

void per_thread(int tid, int nth, long& reached) {
  ++reached;
  arrivals[tid].v.store(reached, std::memory_order_release);
  for (int u = 0; u < nth; ++u)
    if (u != tid)
      while (arrivals[u].v.load(std::memory_order_acquire) < reached) pause_();
}

template <typename F>
double time_ns(int nth, int n, F body) {
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(nth)
    body(omp_get_thread_num(), n);
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n;
    best = ns < best ? ns : best;
  }
  return best;
}

int main(int argc, char** argv) {
  const int nth = argc > 1 ? std::atoi(argv[1]) : 2, n = 200000;
  const double gomp = time_ns(nth, n, [](int, int n) {
    for (int i = 0; i < n; ++i) {
#pragma omp barrier
    }
  });
  const double cen = time_ns(nth, n, [nth](int, int n) {
    long gen = generation.v.load();
    for (int i = 0; i < n; ++i) central(nth, gen);
  });
  for (auto& a : arrivals) a.v.store(0);
  const double own = time_ns(nth, n, [nth](int tid, int n) {
    long reached = arrivals[tid].v.load();
    for (int i = 0; i < n; ++i) per_thread(tid, nth, reached);
  });
  std::printf("%d threads: omp barrier %.0f ns, central counter %.0f ns, per-thread arrivals %.0f ns\n", nth, gomp, cen, own);
}
