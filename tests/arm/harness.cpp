// Runs the CPU decode step (wiola/fast/decode_step_cpu.cpp, included whole: the same source the
// product builds) on arguments read from a file, for tests/test_decode_step_arm.py, which
// cross-compiles it for aarch64 and runs it under qemu-user.
//
// Input (little-endian, as tests/test_decode_step_arm.py writes it): kNumDims int64 dims, float32
// eps, int64 count of weight slots; per weight slot then per scale slot then per cache buffer
// (kNumState): int64 byte count (0: null) and the bytes; int64 step count; per step int64 slot and
// B int64 tokens. Output: each step's (B, V) fp32 logits, then the cache buffers' bytes.
//
// `harness prompt INPUT OUTPUT` runs the prompt's functions of the same source instead:
// wiola_decode_attention (every query attending), wiola_rms_norm_rows and wiola_silu_gate_rows.
// Input: 8 int64 (B, T, H, D, S, start, ld_b, ld_t), then the buffers q, k, v, g, cos, sin, k_cache, v_cache, key_mask;
// int64 rows, d, float32 eps, the buffers x, residual, gamma; int64 rows, F, the buffers up, bp;
// int64 M, N, K, the buffers x (M, K) and W (N, K).
// Output: the attention's (B, T, H, D), the caches, the RMSNorm's out and h, the SiLU gate's out,
// wiola_product_rows over all M rows, then over each row alone (M products of one row).
//
// `harness exponential INPUT OUTPUT` draws Exp(1) noise (wiola_exponential). Input: int64 n, then
// the buffer of a torch CPU generator's state. Output: int64 wiola_exponential's answer, the n fp32
// values, then the state after.
//
// `harness sampler INPUT OUTPUT` samples rows (wiola_sample_rows, no caller for the nucleus). Input:
// int64 B, V; per row float32 temperature, int64 top_k, float64 top_p; the (B, V) fp32 logits, then
// the (B, V) fp32 log-noise. Output: float64 wiola_exp_error(-708, 10^5), the B int64 tokens (-1
// where the nucleus needs the caller), the B int64 nucleus paths.
#include <cstdio>
#include <cstdlib>
#include <string>
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

float* floats(void* p) { return static_cast<float*>(p); }

int run_prompt(const char* output) {
  int64_t n[9];
  read(n, 8 * sizeof(int64_t));
  n[8] = 0;  // the first query that attends: every one
  std::vector<int64_t> sizes;
  std::vector<void*> a = read_buffers(9, &sizes);  // q k v g cos sin k_cache v_cache key_mask
  const int64_t B = n[0], T = n[1], H = n[2], D = n[3];
  std::vector<float> att(B * T * H * D), scratch(wiola_decode_attention_floats(B, H, D, n[5] + T));
  wiola_decode_attention(n, floats(a[0]), floats(a[1]), floats(a[2]), floats(a[3]), floats(a[4]), floats(a[5]),
                         floats(a[6]), floats(a[7]), static_cast<const bool*>(a[8]), att.data(), scratch.data());
  const int64_t rows = read_i64(), d = read_i64();
  float eps;
  read(&eps, sizeof(eps));
  std::vector<void*> r = read_buffers(3);  // x residual gamma
  std::vector<float> norm(rows * d), h(rows * d);
  wiola_rms_norm_rows(floats(r[0]), floats(r[1]), floats(r[2]), eps, norm.data(), h.data(), rows, d);
  const int64_t grows = read_i64(), F = read_i64();
  std::vector<void*> s = read_buffers(2);  // up bp
  std::vector<float> gate(grows * F);
  wiola_silu_gate_rows(floats(s[0]), floats(s[1]), gate.data(), grows, F);
  const int64_t M = read_i64(), N = read_i64(), K = read_i64();
  std::vector<void*> p = read_buffers(2);  // x W
  std::vector<float> all(M * N), alone(M * N);
  wiola_product_rows(floats(p[1]), N, K, floats(p[0]), M, all.data(), 8);
  float* row = static_cast<float*>(std::aligned_alloc(64, (K * sizeof(float) + 63) / 64 * 64));
  for (int64_t i = 0; i < M; ++i) {
    std::memcpy(row, floats(p[0]) + i * K, K * sizeof(float));
    wiola_product_rows(floats(p[1]), N, K, row, 1, alone.data() + i * N, 8);
  }
  FILE* out = std::fopen(output, "wb");
  if (!out) {
    std::perror(output);
    return 2;
  }
  std::fwrite(att.data(), sizeof(float), att.size(), out);
  std::fwrite(a[6], 1, sizes[6], out);
  std::fwrite(a[7], 1, sizes[7], out);
  std::fwrite(norm.data(), sizeof(float), norm.size(), out);
  std::fwrite(h.data(), sizeof(float), h.size(), out);
  std::fwrite(gate.data(), sizeof(float), gate.size(), out);
  std::fwrite(all.data(), sizeof(float), all.size(), out);
  std::fwrite(alone.data(), sizeof(float), alone.size(), out);
  return std::fclose(out) == 0 ? 0 : 1;
}

int run_exponential(const char* output) {
  const int64_t n = read_i64();
  std::vector<int64_t> sizes;
  std::vector<void*> state = read_buffers(1, &sizes);
  std::vector<float> values(n);
  const int64_t job = 0;
  const int64_t answer = wiola_exponential(reinterpret_cast<uint8_t* const*>(state.data()), sizes[0], 1, &job, 1, n,
                                           values.data());
  FILE* out = std::fopen(output, "wb");
  if (!out) {
    std::perror(output);
    return 2;
  }
  std::fwrite(&answer, sizeof(answer), 1, out);
  std::fwrite(values.data(), sizeof(float), values.size(), out);
  std::fwrite(state[0], 1, sizes[0], out);
  return std::fclose(out) == 0 ? 0 : 1;
}

int run_sampler(const char* output) {
  const int64_t B = read_i64(), V = read_i64();
  std::vector<float> temperature(B);
  std::vector<int64_t> mode(B, kSample), top_k(B), n_logprobs(B, 0), token(B), path(B);
  std::vector<double> top_p(B);
  for (int64_t i = 0; i < B; ++i) {
    read(&temperature[i], sizeof(float));
    top_k[i] = read_i64();
    read(&top_p[i], sizeof(double));
  }
  std::vector<float> logits(B * V), log_noise(B * V), scratch(wiola_sample_scratch_floats(V));
  read(logits.data(), logits.size() * sizeof(float));
  read(log_noise.data(), log_noise.size() * sizeof(float));
  wiola_sample_rows(logits.data(), B, V, mode.data(), temperature.data(), top_k.data(), top_p.data(),
                    log_noise.data(), n_logprobs.data(), 1, nullptr, token.data(), nullptr, nullptr, nullptr,
                    path.data(), scratch.data());
  const double exp_error = wiola_exp_error(-708.0, 100000);
  FILE* out = std::fopen(output, "wb");
  if (!out) {
    std::perror(output);
    return 2;
  }
  std::fwrite(&exp_error, sizeof(exp_error), 1, out);
  std::fwrite(token.data(), sizeof(int64_t), B, out);
  std::fwrite(path.data(), sizeof(int64_t), B, out);
  return std::fclose(out) == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc == 4 ? argv[1] : "";
  if (argc != 3 && mode != "prompt" && mode != "exponential" && mode != "sampler") {
    std::fprintf(stderr, "usage: %s [prompt|exponential|sampler] INPUT OUTPUT\n", argv[0]);
    return 2;
  }
  const char* input = argv[argc == 4 ? 2 : 1];
  in = std::fopen(input, "rb");
  if (!in) {
    std::perror(input);
    return 2;
  }
  if (mode == "prompt") return run_prompt(argv[3]);
  if (mode == "exponential") return run_exponential(argv[3]);
  if (mode == "sampler") return run_sampler(argv[3]);
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
