// One decoding step of the whole Wiola model on a CPU, in fp32 arithmetic: every layer and the tied
// head for B rows of one new token each, reading the model's weights and writing the static cache in
// place. The matrices (the embedding/head and every layer's projections) are fp32, bf16, int8 with
// one fp32 scale per output row, or int4 with one fp32 scale per group of kQ4Group weights of a row
// (weight-only quantization, wiola/fast/quantize.py): one body of every product for the first three,
// the weight type a template parameter (Weight<T> below), and one for int4 (q4_block), all widened to
// fp32 in registers.
// Built and loaded by wiola/fast/decode_step_cpu.py (g++ -O3 -fopenmp, ctypes); the math is docs/SPEC.md's,
// the same as wiola.model.WiolaModel.forward with a cache and T = 1.
//
// Why C++: decoding one token is bound by reading the weights (52 MB for the 13m preset), yet the
// PyTorch path spends as long again on ~2,000 small ATen calls, and MKL's matrix-vector product is
// single-threaded. Here every product streams its rows once, split between the threads of torch's
// own OpenMP pool (libgomp is loaded once, by torch, so the two share it), and the small ops run
// as plain loops between barriers of one parallel region.
//
// One source, three instruction sets, chosen by the builder with a macro:
//   WIOLA_ISA_AVX512  16 fp32 lanes (zmm), 32 vector registers: 4 weight rows x 4 batch rows
//   WIOLA_ISA_AVX2     8 fp32 lanes (ymm, with FMA), 16 registers: 4 weight rows x 2 batch rows
//   neither            portable: 4 lanes of GCC's generic vectors (SSE2, NEON, or scalar code),
//                      no x86 assembly, compiles for any target
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(WIOLA_ISA_AVX512) || defined(WIOLA_ISA_AVX2)
#include <immintrin.h>
#endif

namespace {

typedef float v4 __attribute__((vector_size(16)));

#if defined(WIOLA_ISA_AVX512)
#if !defined(__AVX512F__)
#error "WIOLA_ISA_AVX512 needs -mavx512f"
#endif
typedef float v8 __attribute__((vector_size(32)));
typedef float vec __attribute__((vector_size(64)));
constexpr int kLanes = 16;
constexpr int kBatchBlock = 4;  // 16 accumulators + 4 x + 1 w of 32 registers
#define WIOLA_PIN(x) asm("" : "+v"(x))
#elif defined(WIOLA_ISA_AVX2)
#if !defined(__AVX2__) || !defined(__FMA__)
#error "WIOLA_ISA_AVX2 needs -mavx2 -mfma"
#endif
typedef float v8 __attribute__((vector_size(32)));
typedef v8 vec;
constexpr int kLanes = 8;
constexpr int kBatchBlock = 2;  // 8 accumulators + 2 x + 1 w of 16 registers
#define WIOLA_PIN(x) asm("" : "+x"(x))
#else
typedef v4 vec;
constexpr int kLanes = 4;
constexpr int kBatchBlock = 2;
#define WIOLA_PIN(x) ((void)0)
#endif

// Loads and stores through memcpy: unaligned, and no aliasing assumption.
inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }

// Horizontal sums, halving the width each time (the halves taken through memcpy, which GCC and
// Clang of any version turn into one extract).
inline float hsum(v4 b) { return (b[0] + b[2]) + (b[1] + b[3]); }
#if defined(WIOLA_ISA_AVX512) || defined(WIOLA_ISA_AVX2)
template <typename Half, typename Full>
inline Half fold(Full v) {
  Half lo, hi;
  std::memcpy(&lo, &v, sizeof(Half));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(Half), sizeof(Half));
  return lo + hi;
}
inline float hsum(v8 a) { return hsum(fold<v4>(a)); }
#endif
#if defined(WIOLA_ISA_AVX512)
inline float hsum(vec v) { return hsum(fold<v8>(v)); }
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  vec acc = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) acc += load(a + k) * load(b + k);
  float s = hsum(acc);
  for (; k < n; ++k) s += a[k] * b[k];
  return s;
}

// How a weight type is read: `load` widens kLanes consecutive weights to one fp32 vector, `at` one
// weight; a scaled type's products are multiplied by the row's scale once, after the sum.
using bf16 = uint16_t;  // the upper half of an fp32 (torch.bfloat16's bits)
template <typename T>
struct Weight;
template <>
struct Weight<float> {
  static constexpr bool kScaled = false;
  static vec load(const float* p) { return ::load(p); }
  static float at(const float* p) { return *p; }
};
template <>
struct Weight<int8_t> {
  static constexpr bool kScaled = true;
  typedef int8_t raw __attribute__((vector_size(kLanes)));
  typedef int32_t wide __attribute__((vector_size(4 * kLanes)));
  // GCC 12 scalarises the sign extension of a generic int8 vector: the x86 variants say it directly.
  static vec load(const int8_t* p) {
#if defined(WIOLA_ISA_AVX512)
    return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(WIOLA_ISA_AVX2)
    return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
    raw r;
    std::memcpy(&r, p, sizeof(r));
    return __builtin_convertvector(__builtin_convertvector(r, wide), vec);  // sign-extend, then convert
#endif
  }
  static float at(const int8_t* p) { return static_cast<float>(*p); }
};
template <>
struct Weight<bf16> {
  static constexpr bool kScaled = false;
  typedef uint16_t raw __attribute__((vector_size(2 * kLanes)));
  typedef uint32_t wide __attribute__((vector_size(4 * kLanes)));
  static vec load(const bf16* p) {
    raw r;
    std::memcpy(&r, p, sizeof(r));
    wide w = __builtin_convertvector(r, wide) << 16;
    vec v;
    std::memcpy(&v, &w, sizeof(v));
    return v;
  }
  static float at(const bf16* p) {
    uint32_t u = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
};

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// y[b, r] = <W[r, :], x[b, :]> for rows r in [r0, r1) and every b < B: W (N, K) row-major as
// nn.Linear stores it, so each thread streams one contiguous slice of the matrix exactly once.
// Four rows at a time (independent FMA chains), the batch in groups of up to kBatchBlock rows of x,
// which stay in L1 while a group of W rows is reused from L1 for every group of x.
template <int NR, int NB, typename T>
inline void dot_block(const T* W, const float* scale, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy,
                      int64_t r) {
  vec acc[NR][NB] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    vec xv[NB];
    for (int b = 0; b < NB; ++b) {
      xv[b] = load(x + b * ldx + k);
      WIOLA_PIN(xv[b]);  // keep it in a register: GCC would reload it for every FMA
    }
    for (int i = 0; i < NR; ++i) {
      vec w = Weight<T>::load(W + (r + i) * K + k);
      WIOLA_PIN(w);
      for (int b = 0; b < NB; ++b) acc[i][b] += w * xv[b];
    }
  }
  for (int i = 0; i < NR; ++i) {
    const T* w = W + (r + i) * K;
    for (int b = 0; b < NB; ++b) {
      float s = hsum(acc[i][b]);
      for (int64_t kk = k; kk < K; ++kk) s += Weight<T>::at(w + kk) * x[b * ldx + kk];
      if constexpr (Weight<T>::kScaled) s *= scale[r + i];
      y[b * ldy + r + i] = s;
    }
  }
}

template <int NR, typename T>
inline void dot_rows(const T* W, const float* scale, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t B,
                     int64_t r) {
  for (int64_t b = 0; b < B; b += kBatchBlock) {
    const float* xb = x + b * ldx;
    float* yb = y + b * ldy;
    switch (B - b < kBatchBlock ? B - b : kBatchBlock) {
      case 1: dot_block<NR, 1>(W, scale, K, xb, ldx, yb, ldy, r); break;
#if defined(WIOLA_ISA_AVX512)
      case 2: dot_block<NR, 2>(W, scale, K, xb, ldx, yb, ldy, r); break;
      case 3: dot_block<NR, 3>(W, scale, K, xb, ldx, yb, ldy, r); break;
#endif
      default: dot_block<NR, kBatchBlock>(W, scale, K, xb, ldx, yb, ldy, r); break;
    }
  }
}

// Rows [r0, r1) of y = x Wᵀ, the block of 4 rows 8 rows ahead prefetched. The layers' weights
// (19 MB for the 13m preset) mostly come from L3, into L1 here: the hardware prefetcher alone
// does not keep up (measured on this machine's EPYC, one thread: the AVX2 step took about a
// third longer without it, the AVX-512 one about a tenth). With `stream` (the tied head, larger
// than the last-level cache) the prefetch is non-temporal, which keeps the head from evicting
// the layers' weights from L3 and halves the step (see the benchmark notes). For the head, 8 rows
// ahead ran about 5% faster than 16 on one thread in interleaved runs (level with 4, 32 and 64
// within the noise of a loaded machine) and level on two.
template <typename T>
void gemv_rows(const T* W, const float* scale, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t B,
               int64_t r0, int64_t r1, bool stream) {
  constexpr int64_t ahead = 8;
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    int64_t p0 = r + ahead, p1 = r + ahead + 4 < r1 ? r + ahead + 4 : r1;
    const char* p = reinterpret_cast<const char*>(W + (p0 < r1 ? p0 : r1) * K);
    for (int64_t off = 0; p0 < p1 && off < (p1 - p0) * K * static_cast<int64_t>(sizeof(T)); off += 64) {
      if (stream)
        __builtin_prefetch(p + off, 0, 0);
      else
        __builtin_prefetch(p + off, 0, 3);
    }
    dot_rows<4>(W, scale, K, x, ldx, y, ldy, B, r);
  }
  for (; r < r1; ++r) dot_rows<1>(W, scale, K, x, ldx, y, ldy, B, r);
}

// This thread's share of the rows of an (N, K) product: contiguous, multiples of 4 rows.
template <typename T>
inline void gemv_share(const T* W, const float* scale, int64_t N, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy,
                       int64_t B, int tid, int nth, bool stream = false) {
  int64_t blocks = (N + 3) / 4;
  int64_t b0 = blocks * tid / nth, b1 = blocks * (tid + 1) / nth;
  int64_t r0 = b0 * 4, r1 = b1 * 4 < N ? b1 * 4 : N;
  if (r0 < r1) gemv_rows(W, scale, K, x, ldx, y, ldy, B, r0, r1, stream);
}

// ---- int4: group-wise, symmetric, fp32 scales (wiola/fast/quantize.py) ----------------------------
// A row of K weights is K/2 bytes, weight 2j in the low nibble of byte j and 2j+1 in the high one,
// each nibble u the weight q = u - 8 in [-7, 7] (ONNX Runtime's MatMulNBits layout with its default
// zero point 8); the row's K/kQ4Group groups of kQ4Group consecutive weights have one fp32 scale
// each, (N, K/kQ4Group) row-major. A vector of weights is widened to fp32 and multiplied by its
// group's scale (the dequantized weight, rounded as torch rounds q·scale), then fused into the sum
// as the other types are: one multiply more per weight vector, shared by the batch rows.
#ifndef WIOLA_Q4_GROUP
#define WIOLA_Q4_GROUP 32
#endif
constexpr int kQ4Group = WIOLA_Q4_GROUP;
static_assert(kQ4Group % 16 == 0, "the int4 group must be a multiple of the widest vector (16 lanes)");
struct q4 {
  uint8_t pair;  // two weights; a pointer to q4 is a matrix's first byte
};

inline float q4_at(const uint8_t* row, int64_t k) {
  uint8_t b = row[k >> 1];
  return static_cast<float>(((k & 1) ? (b >> 4) : (b & 15)) - 8);
}

// kLanes weights (kLanes/2 bytes at p) as fp32 q values.
inline vec q4_load(const uint8_t* p) {
#if defined(WIOLA_ISA_AVX512) || defined(WIOLA_ISA_AVX2)
  const __m128i low = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
#if defined(WIOLA_ISA_AVX512)
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));  // 8 bytes: 16 weights
#else
  int32_t four;
  std::memcpy(&four, p, 4);
  __m128i b = _mm_cvtsi32_si128(four);  // 4 bytes: 8 weights
#endif
  __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
  __m128i q = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), eight);  // in order, as int8
#if defined(WIOLA_ISA_AVX512)
  return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
#else
  return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
#endif
#else
  vec v;
  for (int i = 0; i < kLanes; i += 2) {
    v[i] = static_cast<float>((p[i / 2] & 15) - 8);
    v[i + 1] = static_cast<float>((p[i / 2] >> 4) - 8);
  }
  return v;
#endif
}

template <int NR, int NB>
inline void q4_block(const uint8_t* W, const float* scale, int64_t K, const float* x, int64_t ldx, float* y,
                     int64_t ldy, int64_t r) {
  const int64_t groups = K / kQ4Group, row_bytes = K / 2;
  vec acc[NR][NB] = {};
  for (int64_t g = 0; g < groups; ++g) {
    vec s[NR];
    for (int i = 0; i < NR; ++i) s[i] = vec{} + scale[(r + i) * groups + g];
    for (int64_t k = g * kQ4Group; k < (g + 1) * kQ4Group; k += kLanes) {
      vec xv[NB];
      for (int b = 0; b < NB; ++b) {
        xv[b] = load(x + b * ldx + k);
        WIOLA_PIN(xv[b]);
      }
      for (int i = 0; i < NR; ++i) {
        vec w = q4_load(W + (r + i) * row_bytes + k / 2) * s[i];
        WIOLA_PIN(w);
        for (int b = 0; b < NB; ++b) acc[i][b] += w * xv[b];
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int b = 0; b < NB; ++b) y[b * ldy + r + i] = hsum(acc[i][b]);
}

template <int NR>
inline void q4_rows(const uint8_t* W, const float* scale, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy,
                    int64_t B, int64_t r) {
  for (int64_t b = 0; b < B; b += kBatchBlock) {
    const float* xb = x + b * ldx;
    float* yb = y + b * ldy;
    switch (B - b < kBatchBlock ? B - b : kBatchBlock) {
      case 1: q4_block<NR, 1>(W, scale, K, xb, ldx, yb, ldy, r); break;
#if defined(WIOLA_ISA_AVX512)
      case 2: q4_block<NR, 2>(W, scale, K, xb, ldx, yb, ldy, r); break;
      case 3: q4_block<NR, 3>(W, scale, K, xb, ldx, yb, ldy, r); break;
#endif
      default: q4_block<NR, kBatchBlock>(W, scale, K, xb, ldx, yb, ldy, r); break;
    }
  }
}

// This thread's share of an int4 (N, K) product (the int4 counterpart of gemv_share, with the same
// split, prefetch distance and non-temporal head).
inline void gemv_share(const q4* Wq, const float* scale, int64_t N, int64_t K, const float* x, int64_t ldx, float* y,
                       int64_t ldy, int64_t B, int tid, int nth, bool stream = false) {
  const uint8_t* W = reinterpret_cast<const uint8_t*>(Wq);
  int64_t blocks = (N + 3) / 4;
  int64_t r = blocks * tid / nth * 4, r1 = blocks * (tid + 1) / nth * 4 < N ? blocks * (tid + 1) / nth * 4 : N;
  const int64_t row_bytes = K / 2;
  for (; r + 4 <= r1; r += 4) {
    int64_t p0 = r + 8 < r1 ? r + 8 : r1, p1 = r + 12 < r1 ? r + 12 : r1;
    for (int64_t off = 0; off < (p1 - p0) * row_bytes; off += 64) {
      if (stream)
        __builtin_prefetch(W + p0 * row_bytes + off, 0, 0);
      else
        __builtin_prefetch(W + p0 * row_bytes + off, 0, 3);
    }
    q4_rows<4>(W, scale, K, x, ldx, y, ldy, B, r);
  }
  for (; r < r1; ++r) q4_rows<1>(W, scale, K, x, ldx, y, ldy, B, r);
}

inline void embed_row(const q4* E, const float* scale, int64_t token, int64_t d, float* out) {
  const uint8_t* row = reinterpret_cast<const uint8_t*>(E) + token * (d / 2);
  for (int64_t i = 0; i < d; ++i) out[i] = q4_at(row, i) * scale[token * (d / kQ4Group) + i / kQ4Group];
}

// out = h / sqrt(mean(h²) + eps) ⊙ γ   (statistics in fp32, as the reference)
inline void rms_norm(const float* h, const float* gamma, float* out, int64_t d, float eps) {
  float ms = dot(h, h, d) / static_cast<float>(d);
  float inv = 1.0f / std::sqrt(ms + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = h[i] * inv * gamma[i];
}

// Rotate-half pair layout: pair i is (x_i, x_{i+D/2}).
inline void rope(const float* x, const float* cs, const float* sn, float* out, int64_t D) {
  int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    float x1 = x[i], x2 = x[i + half];
    out[i] = x1 * cs[i] - x2 * sn[i];
    out[i + half] = x1 * sn[i] + x2 * cs[i];
  }
}

enum Dim { kB, kV, kD, kL, kH, kHd, kF, kS, kGate, kGatePreRope, kWeightType, kGroup, kNumDims };
enum WeightType { kFp32, kBf16, kInt8, kInt4 };
enum Global { kEmbed, kFinalNorm, kFreqs, kNumGlobal };
enum PerLayer { kAttnNorm, kWq, kWk, kWv, kWo, kGateW1, kGateW2, kGateB2, kFfnNorm, kWUp, kWBp, kWDown, kPerLayer };
enum State { kK, kVc, kKeyMask, kGateSum, kGateCount, kNReal, kNumState };

struct Workspace {
  float *h, *x, *qkv, *o, *up, *bp, *cs, *sn, *g, *scores, *qrot;
  Workspace(const int64_t* n, float* w) {
    int64_t B = n[kB], d = n[kD], H = n[kH], D = n[kHd], F = n[kF], S = n[kS];
    h = w; w += B * d;
    x = w; w += B * d;
    qkv = w; w += B * 3 * d;
    o = w; w += B * d;
    up = w; w += B * 2 * F;
    bp = w; w += B * F;
    cs = w; w += B * (D / 2);
    sn = w; w += B * (D / 2);
    g = w; w += B * H;
    scores = w; w += B * H * S;
    qrot = w; w += B * d;
  }
};

// Row `token` of the embedding, as fp32 (the dequantized row: weight times the row's scale).
template <typename T>
inline void embed_row(const T* E, const float* scale, int64_t token, int64_t d, float* out) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, E + token * d, d * sizeof(float));
  } else {
    const T* row = E + token * d;
    for (int64_t i = 0; i < d; ++i) out[i] = Weight<T>::at(row + i);
    if constexpr (Weight<T>::kScaled)
      for (int64_t i = 0; i < d; ++i) out[i] *= scale[token];
  }
}

// The step for weight type T of the matrices (see wiola_decode_step); everything else is fp32.
template <typename T>
int decode_step(const int64_t* n, const void* const* weights, const float* const* scales, void* const* state,
                const int64_t* tokens, int64_t slot, float eps, float* logits, float* work) {
  const int64_t B = n[kB], V = n[kV], d = n[kD], L = n[kL], H = n[kH], D = n[kHd], F = n[kF], S = n[kS];
  const bool gate = n[kGate] != 0, gate_pre_rope = n[kGatePreRope] != 0;
  const int64_t half = D / 2;
  auto f32 = [weights](int64_t i) { return static_cast<const float*>(weights[i]); };
  const T* embed = static_cast<const T*>(weights[kEmbed]);
  const float* embed_scale = scales[kEmbed];
  const float* freqs = f32(kFreqs);
  float* k_cache = static_cast<float*>(state[kK]);
  float* v_cache = static_cast<float*>(state[kVc]);
  bool* key_mask = static_cast<bool*>(state[kKeyMask]);
  float* gate_sum = static_cast<float*>(state[kGateSum]);
  int64_t* gate_count = static_cast<int64_t*>(state[kGateCount]);
  int64_t* n_real = static_cast<int64_t*>(state[kNReal]);
  Workspace ws(n, work);
  const float sqrt_d = std::sqrt(static_cast<float>(D));

  // Per row: the residual stream from the embedding, the rotation tables at the row's position
  // (fp32 angle = position · θ̃_i, as wiola.ops.rope_tables), the new slot marked real.
  for (int64_t b = 0; b < B; ++b) {
    embed_row(embed, embed_scale, tokens[b], d, ws.h + b * d);
    float pos = static_cast<float>(n_real[b]);
    for (int64_t i = 0; i < half; ++i) {
      float angle = pos * freqs[i];
      ws.cs[b * half + i] = std::cos(angle);
      ws.sn[b * half + i] = std::sin(angle);
    }
    key_mask[b * S + slot] = true;
    rms_norm(ws.h + b * d, f32(kNumGlobal + kAttnNorm), ws.x + b * d, d, eps);
  }

#pragma omp parallel
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
    for (int64_t l = 0; l < L; ++l) {
      const int64_t at = kNumGlobal + l * kPerLayer;
      auto w = [&](int64_t i) { return static_cast<const float*>(weights[at + i]); };  // fp32 vectors
      auto m = [&](int64_t i) { return static_cast<const T*>(weights[at + i]); };  // the matrices
      auto sc = [&](int64_t i) { return scales[at + i]; };
      // q, k, v = x W_qᵀ, x W_kᵀ, x W_vᵀ   -> qkv (B, 3d)
      for (int j = 0; j < 3; ++j)
        gemv_share(m(kWq + j), sc(kWq + j), d, d, ws.x, d, ws.qkv + j * d, 3 * d, B, tid, nth);
#pragma omp barrier
      // The gate from the running mean of the head-mean query, then q and k rotated and k, v
      // written to the cache: per row, rows split between threads.
      for (int64_t b = tid; b < B; b += nth) {
        const float* q = ws.qkv + b * 3 * d;
        const float* k = q + d;
        const float* v = q + 2 * d;
        const float* cs = ws.cs + b * half;
        const float* sn = ws.sn + b * half;
        float* g = ws.g + b * H;
        if (gate) {
          float m[1024], mr[1024];  // D <= 1024 (checked by the caller)
          for (int64_t i = 0; i < D; ++i) {
            float s = 0.0f;
            for (int64_t hh = 0; hh < H; ++hh) s += q[hh * D + i];
            m[i] = s / static_cast<float>(H);
          }
          const float* mm = m;
          if (!gate_pre_rope) {
            rope(m, cs, sn, mr, D);
            mm = mr;
          }
          float* run = gate_sum + (l * B + b) * D;
          int64_t count = gate_count[l * B + b] + 1;
          gate_count[l * B + b] = count;
          float denom = static_cast<float>(count);
          float c[1024], hidden[1024];
          for (int64_t i = 0; i < D; ++i) {
            run[i] = mm[i] + run[i];
            c[i] = run[i] / denom;
          }
          for (int64_t hh = 0; hh < H; ++hh) hidden[hh] = silu(dot(w(kGateW1) + hh * D, c, D));
          for (int64_t hh = 0; hh < H; ++hh) g[hh] = sigmoid(dot(w(kGateW2) + hh * H, hidden, H) + w(kGateB2)[hh]);
        } else {
          for (int64_t hh = 0; hh < H; ++hh) g[hh] = 1.0f;
        }
        for (int64_t hh = 0; hh < H; ++hh) {
          int64_t cache_at = (((l * B + b) * H + hh) * S + slot) * D;
          rope(q + hh * D, cs, sn, ws.qrot + b * d + hh * D, D);
          rope(k + hh * D, cs, sn, k_cache + cache_at, D);
          std::memcpy(v_cache + cache_at, v + hh * D, D * sizeof(float));
        }
      }
#pragma omp barrier
      // Attention of each (row, head) over the cached slots [0, slot], padding left out:
      // softmax(g · <q̃, k̃_s> / sqrt(D)) v_s, in fp32. (row, head) pairs split between threads.
      for (int64_t p = tid; p < B * H; p += nth) {
        int64_t b = p / H, hh = p % H;
        const float* q = ws.qrot + b * d + hh * D;
        const float* keys = k_cache + ((l * B + b) * H + hh) * S * D;
        const float* values = v_cache + ((l * B + b) * H + hh) * S * D;
        const bool* real = key_mask + b * S;
        float* sc = ws.scores + p * S;
        float gh = ws.g[b * H + hh];
        float mx = -INFINITY;
        for (int64_t s = 0; s <= slot; ++s) {
          if (!real[s]) continue;
          sc[s] = dot(q, keys + s * D, D) / sqrt_d * gh;
          mx = sc[s] > mx ? sc[s] : mx;
        }
        float total = 0.0f;
        for (int64_t s = 0; s <= slot; ++s) {
          if (!real[s]) continue;
          sc[s] = std::exp(sc[s] - mx);
          total += sc[s];
        }
        float* o = ws.o + b * d + hh * D;
        for (int64_t i = 0; i < D; ++i) o[i] = 0.0f;
        for (int64_t s = 0; s <= slot; ++s) {
          if (!real[s]) continue;
          float ps = sc[s] / total;
          const float* vs = values + s * D;
          int64_t i = 0;
          for (; i + kLanes <= D; i += kLanes) store(o + i, load(o + i) + ps * load(vs + i));
          for (; i < D; ++i) o[i] += ps * vs[i];
        }
      }
#pragma omp barrier
      // h' = h + o W_oᵀ; x = RMSNorm(h') γ_ffn
      gemv_share(m(kWo), sc(kWo), d, d, ws.o, d, ws.qkv, 3 * d, B, tid, nth);
#pragma omp barrier
      for (int64_t b = tid; b < B; b += nth) {
        float* hb = ws.h + b * d;
        const float* a = ws.qkv + b * 3 * d;
        for (int64_t i = 0; i < d; ++i) hb[i] = a[i] + hb[i];
        rms_norm(hb, w(kFfnNorm), ws.x + b * d, d, eps);
      }
#pragma omp barrier
      // Butterfly: [a ‖ b] = x W_upᵀ, r = SiLU(a) ⊙ b + x W_bpᵀ, y = r W_downᵀ.
      gemv_share(m(kWUp), sc(kWUp), 2 * F, d, ws.x, d, ws.up, 2 * F, B, tid, nth);
      gemv_share(m(kWBp), sc(kWBp), F, d, ws.x, d, ws.bp, F, B, tid, nth);
#pragma omp barrier
      for (int64_t b = tid; b < B; b += nth) {
        float* a = ws.up + b * 2 * F;
        const float* bb = a + F;
        const float* bp = ws.bp + b * F;
        for (int64_t i = 0; i < F; ++i) a[i] = silu(a[i]) * bb[i] + bp[i];  // r, over a
      }
#pragma omp barrier
      gemv_share(m(kWDown), sc(kWDown), d, F, ws.up, 2 * F, ws.qkv, 3 * d, B, tid, nth);
#pragma omp barrier
      // h'' = h' + y; x = RMSNorm(h'') with the next layer's γ (the final norm after the last).
      const float* next_gamma = l + 1 < L ? f32(at + kPerLayer + kAttnNorm) : f32(kFinalNorm);
      for (int64_t b = tid; b < B; b += nth) {
        float* hb = ws.h + b * d;
        const float* y = ws.qkv + b * 3 * d;
        for (int64_t i = 0; i < d; ++i) hb[i] = y[i] + hb[i];
        rms_norm(hb, next_gamma, ws.x + b * d, d, eps);
      }
#pragma omp barrier
    }
    // The tied head: logits = x Eᵀ.
    gemv_share(embed, embed_scale, V, d, ws.x, d, logits, V, B, tid, nth, true);
  }
  for (int64_t b = 0; b < B; ++b) n_real[b] += 1;
  return 0;
}

}  // namespace

extern "C" {

int64_t wiola_q4_group() { return kQ4Group; }

int64_t wiola_workspace_floats(const int64_t* n) {
  int64_t B = n[kB], d = n[kD], H = n[kH], D = n[kHd], F = n[kF], S = n[kS];
  return B * (d * 7 + 3 * F + D + H + H * S);
}

// dims: kNumDims int64 (see Dim; kWeightType a WeightType). weights: kNumGlobal + L·kPerLayer
// pointers: the embedding and the seven projection matrices of each layer of that weight type, every
// other one fp32 (gate ones may be null without a gate). scales: as many pointers, the fp32 per-row
// scales of each int8 matrix, or the (N, K/kGroup) group scales of each int4 one (null elsewhere). state: the cache's buffers (k, v (L,B,H,S,D) fp32;
// key_mask (B,S) bool; gate_sum (L,B,D) fp32; gate_count (L,B) int64; n_real (B,) int64).
// tokens: (B,) int64 in range. slot: the cache slot of the new tokens (< S). logits: (B, V) out.
// work: wiola_workspace_floats. The caller has checked every shape, dtype, range and that slot < S.
// kGroup: the int4 group (kQ4Group; scales (N, K/kGroup) fp32 per int4 matrix), ignored otherwise.
// Returns 0, 1 for an unknown weight type, 2 for an int4 group this build was not compiled for.
int wiola_decode_step(const int64_t* n, const void* const* weights, const float* const* scales, void* const* state,
                      const int64_t* tokens, int64_t slot, float eps, float* logits, float* work) {
  switch (n[kWeightType]) {
    case kFp32: return decode_step<float>(n, weights, scales, state, tokens, slot, eps, logits, work);
    case kBf16: return decode_step<bf16>(n, weights, scales, state, tokens, slot, eps, logits, work);
    case kInt8: return decode_step<int8_t>(n, weights, scales, state, tokens, slot, eps, logits, work);
    case kInt4:  // the group is compiled in; K % group == 0 checked by the caller
      return n[kGroup] == kQ4Group ? decode_step<q4>(n, weights, scales, state, tokens, slot, eps, logits, work) : 2;
    default: return 1;
  }
}

}  // extern "C"
