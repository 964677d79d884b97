// Runs the CPU decode step (wiola/fast/decode_step_cpu.cpp, included whole: the same source the
// product builds) on arguments read from a file, for tests/test_decode_step_arm.py, which
// cross-compiles it for aarch64 and runs it under qemu-user.
//
// Input (little-endian, as tests/test_decode_step_arm.py writes it): kNumDims int64 dims, float32
// eps, int64 count of weight slots; per weight slot then per scale slot then per cache buffer
// (kNumState): int64 byte count (0: null) and the bytes; int64 step count; per step int64 slot and
// B int64 tokens. Output: each step's (B, V) fp32 logits, then the cache buffers' bytes.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "wiola/fast/decode_step_cpu.cpp"

namespace {

FILE* in;

void read(void* p, size_t n) {
  if (n && std::fread(p, 1, n, in) != n) {
    std::fprintf(stderr, "harness: input file ends early\n");
    std::exit(2);
  }
}

int64_t read_i64() {
  int64_t v;
  read(&v, sizeof(v));
  return v;
}

// One buffer of each slot (empty for null), 64-byte aligned like torch's allocations.
std::vector<void*> read_buffers(int64_t count, std::vector<int64_t>* sizes = nullptr) {
  std::vector<void*> out;
  for (int64_t i = 0; i < count; ++i) {
    int64_t n = read_i64();
    void* p = nullptr;
    if (n > 0) {
      p = std::aligned_alloc(64, (n + 63) / 64 * 64);
      read(p, n);
    }
    out.push_back(p);
    if (sizes) sizes->push_back(n);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s INPUT OUTPUT\n", argv[0]);
    return 2;
  }
  in = std::fopen(argv[1], "rb");
  if (!in) {
    std::perror(argv[1]);
    return 2;
  }
  int64_t n[kNumDims];
  read(n, sizeof(n));
  float eps;
  read(&eps, sizeof(eps));
  int64_t slots = read_i64();
  std::vector<void*> weights = read_buffers(slots);
  std::vector<void*> scales = read_buffers(slots);
  std::vector<int64_t> state_bytes;
  std::vector<void*> state = read_buffers(kNumState, &state_bytes);
  const int64_t B = n[kB], V = n[kV];
  std::vector<int64_t> tokens(B);
  std::vector<float> logits(B * V), work(wiola_workspace_floats(n));
  FILE* out = std::fopen(argv[2], "wb");
  if (!out) {
    std::perror(argv[2]);
    return 2;
  }
  for (int64_t steps = read_i64(); steps > 0; --steps) {
    int64_t slot = read_i64();
    read(tokens.data(), B * sizeof(int64_t));
    int rc = wiola_decode_step(n, weights.data(), reinterpret_cast<const float* const*>(scales.data()), state.data(),
                               tokens.data(), slot, eps, logits.data(), work.data());
    if (rc != 0) {
      std::fprintf(stderr, "harness: wiola_decode_step returned %d\n", rc);
      return 1;
    }
    std::fwrite(logits.data(), sizeof(float), logits.size(), out);
  }
  for (int i = 0; i < kNumState; ++i) std::fwrite(state[i], 1, state_bytes[i], out);
  return std::fclose(out) == 0 ? 0 : 1;
}
