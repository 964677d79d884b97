// One decoding step of the whole Wiola model on a CPU, in fp32 arithmetic: every layer and the tied
// head for B rows of one new token each, reading the model's weights and writing the static cache in
// place. The matrices (the embedding/head and every layer's projections) are fp32, bf16, int8 with
// one fp32 scale per output row, or int4 with one fp32 scale per group of kQ4Group weights of a row
// (weight-only quantization, wiola/fast/quantize.py): one body of the products for fp32 and int8,
// the weight type a template parameter (Weight<T>, dot_block), and one for int4 and bf16, which are
// read as 32-bit lanes of several weights each (Packed<P>, packed_block), all widened to fp32 in
// registers.
// Built and loaded by wiola/fast/decode_step_cpu.py (g++ -O3 -fopenmp, ctypes); the math is docs/SPEC.md's,
// the same as wiola.model.WiolaModel.forward with a cache and T = 1. For a prompt (T > 1) the same
// library runs the attention over the cache (PromptAttention), the RMSNorms and the butterfly's
// SiLU gate (rms_norm_rows, silu_gate_rows); its products stay ATen's.
//
// Why C++: decoding one token is bound by reading the weights (52 MB for the 13m preset), yet the
// PyTorch path spends as long again on ~2,000 small ATen calls, and MKL's matrix-vector product is
// single-threaded. Here every product streams its rows once, split between the threads of torch's
// own OpenMP pool (libgomp is loaded once, by torch, so the two share it), and the small ops run
// as plain loops between barriers of one parallel region.
//
// One source, four instruction-set variants, chosen by the builder with macros:
//   WIOLA_ISA_AVX512  16 fp32 lanes (zmm), 32 vector registers: 4 weight rows x 4 batch rows
//   WIOLA_ISA_AVX2     8 fp32 lanes (ymm, with FMA), 16 registers: 4 weight rows x 2 batch rows
//   WIOLA_ISA_AMX      with WIOLA_ISA_AVX512: the bf16 products on the AMX tile unit (tile_rows),
//                      the bf16 matrices tiled
//   neither            portable: 4 lanes of GCC's generic vectors (SSE2, NEON, or scalar code),
//                      no x86 assembly, compiles for any target
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#if defined(WIOLA_ISA_AVX512) || defined(WIOLA_ISA_AVX2)
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
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
constexpr int kRowBlock = 8;    // weight rows a block at one batch row: 8 FMA chains
#define WIOLA_PIN(x) asm("" : "+v"(x))
#elif defined(WIOLA_ISA_AVX2)
#if !defined(__AVX2__) || !defined(__FMA__)
#error "WIOLA_ISA_AVX2 needs -mavx2 -mfma"
#endif
typedef float v8 __attribute__((vector_size(32)));
typedef v8 vec;
constexpr int kLanes = 8;
constexpr int kBatchBlock = 2;  // 8 accumulators + 2 x + 1 w of 16 registers
constexpr int kRowBlock = 4;
#define WIOLA_PIN(x) asm("" : "+x"(x))
#else
typedef v4 vec;
constexpr int kLanes = 4;
constexpr int kBatchBlock = 2;
constexpr int kRowBlock = 4;
#define WIOLA_PIN(x) ((void)0)
#endif

typedef int32_t ivec __attribute__((vector_size(4 * kLanes)));  // a vec's lanes as int32

// 0, 1, ..., kLanes - 1: each lane's number.
inline ivec lane_numbers() {
  ivec n;
  for (int l = 0; l < kLanes; ++l) n[l] = l;
  return n;
}

// Loads and stores through memcpy: unaligned, and no aliasing assumption.
inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }

#if defined(WIOLA_ISA_AVX512) || defined(WIOLA_ISA_AVX2)
inline void store4(float* p, __m128 v) { _mm_storeu_ps(p, v); }
#endif

// acc + a·b, one rounding (a fused multiply-add) where the variant targets one, written out for the
// products rather than left to -ffp-contract: GCC contracted `acc += w * x` in most instantiations of
// the product blocks but not in all (the AVX2 variant's block of one weight row at one batch row;
// the element-wise tail of a row whose length is not a multiple of the vector, on AVX-512 too), so a
// matrix's last N mod 4 rows, or a row's last weights, differed in their last bits between a batch
// of one row and a larger batch. Without an FMA instruction (x86 without -mfma) nothing is
// contracted anywhere, and a·b and the sum are rounded apart everywhere alike. Measured against the
// contracted form: bench/results/2026-12-05_cpu_prompt-rows-amd-zen5/ (bf16 at batch 8 0.92-0.94x).
inline vec madd(vec a, vec b, vec acc) {
#if defined(WIOLA_ISA_AVX512)
  return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(WIOLA_ISA_AVX2)
  return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#elif defined(__aarch64__) && defined(__ARM_NEON)
  return (vec)vfmaq_f32((float32x4_t)acc, (float32x4_t)a, (float32x4_t)b);
#elif defined(__FP_FAST_FMAF)
  vec r;
  for (int l = 0; l < kLanes; ++l) r[l] = __builtin_fmaf(a[l], b[l], acc[l]);
  return r;
#else
  return acc + a * b;
#endif
}

// x / d by Markstein's correction, bitwise the division's quotient (round to nearest) where
// quotient_exact says so: with r = RN(1/d), y = RN(x·r) lies within an ulp of x/d, the remainder
// x - y·d is exact in one fused multiply-add, and RN(y + rem·r) is then the correctly rounded x/d,
// wherever nothing on the way underflows or overflows. A vector division issues once in several
// cycles; this is three operations of the FMA units. Checked against the division on every
// significand of x in a binade for thousands of divisors (the result scales with powers of two of x
// and d): bench/results/2026-12-06_cpu_exact-division/; tests/test_decode_step_cpu.py::test_divide_is_the_division.
inline vec quotient(vec x, float d, float r) {
  const vec y = x * r;
  return madd(madd(vec{} - y, vec{} + d, x), vec{} + r, y);
}

// Whether quotient(x, d, 1/d) is x / d for every x with 2^-100 <= |x| <= 2^100 and for x = +0: d
// within [2^-20, 2^20] (the quotients and remainders then stay far from both ends of the exponent
// range), and a vector FMA in the variant (the portable one divides).
inline bool quotient_exact(float d) {
#if defined(WIOLA_ISA_AVX512) || defined(WIOLA_ISA_AVX2)
  return d >= 0x1p-20f && d <= 0x1p20f;
#else
  (void)d;
  return false;
#endif
}

// Whether every lane of x has 2^-100 <= |x| <= 2^100 (no zero, NaN or infinity).
inline bool dividend_fits(vec x) {
  constexpr int32_t kLow = 0x0d800000, kHigh = 0x71800000;  // the bits of 2^-100 and 2^100
  ivec bits;
  std::memcpy(&bits, &x, sizeof(bits));
#if defined(WIOLA_ISA_AVX512)
  const __m512i mag = _mm512_and_si512((__m512i)bits, _mm512_set1_epi32(0x7fffffff));
  return _mm512_cmple_epu32_mask(_mm512_sub_epi32(mag, _mm512_set1_epi32(kLow)), _mm512_set1_epi32(kHigh - kLow)) ==
         0xffff;
#elif defined(WIOLA_ISA_AVX2)
  const ivec mag = bits & 0x7fffffff;
  return _mm256_movemask_ps((__m256)((mag >= kLow) & (mag <= kHigh))) == 0xff;
#else
  (void)bits;
  return false;
#endif
}

// x / d, bitwise: quotient where it is exact for this d and every lane of x, else the division.
inline vec divide(vec x, float d, float r) { return quotient_exact(d) && dividend_fits(x) ? quotient(x, d, r) : x / d; }

// madd for one float (a row's last K mod kLanes weights).
inline float madd1(float a, float b, float acc) {
#if defined(__FMA__) || defined(__FP_FAST_FMAF) || defined(__aarch64__)
  return __builtin_fmaf(a, b, acc);
#else
  return acc + a * b;
#endif
}

inline v4 load4(const float* p) {
  v4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

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

#if defined(WIOLA_ISA_AVX512)
// [lanes 0-7 of a + lanes 8-15 of a | the same of b]: hsum's first fold of two vectors at once.
__attribute__((always_inline)) inline __m512 fold_halves(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
// hsum's second fold of the four vectors that two fold_halves hold: block j = vector j's partial
// sums t0..t3.
__attribute__((always_inline)) inline __m512 fold_quads(__m512 s01, __m512 s23) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}
// Four vectors folded as hsum4 folds them: block j = vector j's partial sums t0..t3.
__attribute__((always_inline)) inline __m512 quads4(vec a0, vec a1, vec a2, vec a3) {
  return fold_quads(fold_halves((__m512)a0, (__m512)a1), fold_halves((__m512)a2, (__m512)a3));
}
#endif

// out[i] = hsum(a[i]) for four vectors, each sum in hsum's order (lane l + lane l + width/2, halving
// down to four partial sums t, then (t0 + t2) + (t1 + t3)), so bitwise the same; the four folded
// together, two vectors a shuffle, instead of one extract-and-add chain each.
__attribute__((always_inline)) inline void hsum4(vec a0_, vec a1_, vec a2_, vec a3_, float* out) {
  const vec a[4] = {a0_, a1_, a2_, a3_};
#if defined(WIOLA_ISA_AVX512)
  // Lanes l and l + 8 of two vectors in one add, then lanes l and l + 4: four partial sums of
  // each vector, a 128-bit block each.
  __m128 t[4];
  const __m512 q = quads4(a[0], a[1], a[2], a[3]);
  t[0] = _mm512_castps512_ps128(q);
  t[1] = _mm512_extractf32x4_ps(q, 1);
  t[2] = _mm512_extractf32x4_ps(q, 2);
  t[3] = _mm512_extractf32x4_ps(q, 3);
#elif defined(WIOLA_ISA_AVX2)
  __m128 t[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 v = (__m256)a[i];
    t[i] = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  }
#else
  const v4* t = a;
#endif
#if defined(WIOLA_ISA_AVX512) || defined(WIOLA_ISA_AVX2)
  // Transpose the four blocks, then (t0 + t2) + (t1 + t3) lane by lane.
  __m128 r0 = t[0], r1 = t[1], r2 = t[2], r3 = t[3];
  _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
  store4(out, _mm_add_ps(_mm_add_ps(r0, r2), _mm_add_ps(r1, r3)));
#else
  for (int i = 0; i < 4; ++i) out[i] = hsum(t[i]);
#endif
}

#if defined(WIOLA_ISA_AVX512)
// Within each block b, lane m of R_k = t_k of row m; then (t0 + t2) + (t1 + t3).
__attribute__((always_inline)) inline __m512 hsum16_quads(__m512 q0, __m512 q1, __m512 q2, __m512 q3) {
  const __m512 t0 = _mm512_unpacklo_ps(q0, q1), t1 = _mm512_unpackhi_ps(q0, q1);
  const __m512 t2 = _mm512_unpacklo_ps(q2, q3), t3 = _mm512_unpackhi_ps(q2, q3);
  const __m512 r0 = (__m512)_mm512_unpacklo_pd((__m512d)t0, (__m512d)t2);
  const __m512 r1 = (__m512)_mm512_unpackhi_pd((__m512d)t0, (__m512d)t2);
  const __m512 r2 = (__m512)_mm512_unpacklo_pd((__m512d)t1, (__m512d)t3);
  const __m512 r3 = (__m512)_mm512_unpackhi_pd((__m512d)t1, (__m512d)t3);
  return _mm512_add_ps(_mm512_add_ps(r0, r2), _mm512_add_ps(r1, r3));
}
// Block b of the result (lanes 4b..4b+3) = hsum(a[i][b]) for rows i = 0..3 and 4 batch rows b:
// sixteen sums, each in hsum's order as hsum4 adds them (so bitwise the same), folded together in
// 47 operations against four hsum4's 92, most of them on the shuffle ports. Each vector is named
// with constant indices: with a loop over the rows GCC 12 kept the accumulators in memory (all
// sixteen stored to the stack after each block's loop), and the batch-8 step ran 1.33x slower.
__attribute__((always_inline)) inline __m512 hsum16(const vec (&a)[4][4]) {
  return hsum16_quads(quads4(a[0][0], a[0][1], a[0][2], a[0][3]), quads4(a[1][0], a[1][1], a[1][2], a[1][3]),
                      quads4(a[2][0], a[2][1], a[2][2], a[2][3]), quads4(a[3][0], a[3][1], a[3][2], a[3][3]));
}
// Blocks 0 and 2 of the result = hsum(a[i][0]) for rows i = 0..3 and 4..7 (one batch row), in
// hsum's order (blocks 1 and 3 repeat them): 33 operations against two hsum4's 46. Rows are folded
// as quads4 folds batch rows (q0: block i = row i's quad; q1: row 4 + i's), and each q_m of the
// transpose is row m's quad and row 4 + m's, in blocks 0 and 2.
__attribute__((always_inline)) inline __m512 hsum8_rows(const vec (&a)[8][1]) {
  const __m512 q0 = quads4(a[0][0], a[1][0], a[2][0], a[3][0]), q1 = quads4(a[4][0], a[5][0], a[6][0], a[7][0]);
  return hsum16_quads(_mm512_shuffle_f32x4(q0, q1, 0x00), _mm512_shuffle_f32x4(q0, q1, 0x55),
                      _mm512_shuffle_f32x4(q0, q1, 0xAA), _mm512_shuffle_f32x4(q0, q1, 0xFF));
}
// Blocks 0 and 1 of the result = hsum(a[i][b]) for rows i = 0..3 and batch rows b = 0 and 1, in
// hsum's order (blocks 2 and 3 hold the same sums in another order): 31 operations against two
// hsum4's 46. Rows 0 and 1 (2 and 3) are folded into one vector, block 2i + b = row i's quad for
// batch row b; a copy with its halves swapped lines each row's quads up with the others' for the
// transpose.
__attribute__((always_inline)) inline __m512 hsum8(const vec (&a)[4][2]) {
  const __m512 q01 = fold_quads(fold_halves((__m512)a[0][0], (__m512)a[0][1]), fold_halves((__m512)a[1][0], (__m512)a[1][1]));
  const __m512 q23 = fold_quads(fold_halves((__m512)a[2][0], (__m512)a[2][1]), fold_halves((__m512)a[3][0], (__m512)a[3][1]));
  return hsum16_quads(q01, _mm512_shuffle_f32x4(q01, q01, 0x4E), q23, _mm512_shuffle_f32x4(q23, q23, 0x4E));
}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  vec acc = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) acc += load(a + k) * load(b + k);
  float s = hsum(acc);
  for (; k < n; ++k) s += a[k] * b[k];
  return s;
}

// out[u] = the sum of a[k]·b[u·n + k] over the first n / kLanes · kLanes k, for u < 4: dot's vector
// part, bitwise, for four rows of b at once.
__attribute__((always_inline)) inline void dot4(const float* a, const float* b, int64_t n, float* out) {
  vec acc[4] = {};
  for (int64_t k = 0; k + kLanes <= n; k += kLanes) {
    const vec av = load(a + k);
    for (int u = 0; u < 4; ++u) acc[u] += av * load(b + u * n + k);
  }
  hsum4(acc[0], acc[1], acc[2], acc[3], out);
}

// e^x lane by lane for x <= 0 (softmax's x - max), as Cephes' expf: x = n·ln 2 + r with n the
// nearest integer to x·log2 e and |r| <= ln 2 / 2 (ln 2 in two parts, so r is exact), e^r by its
// degree-7 polynomial, times 2^n built in the exponent bits. At most 7.9e-8 relative error on
// [-87.3, 0] (measured against exp in double; std::exp is under 1 ulp, 6e-8); 0 below -87.34 (e^x
// under the smallest normal float), NaN for NaN. One function for every lane and every element (a tail goes through a padded vector), so an
// element's value does not depend on where it sits.
inline vec exp_nonpositive(vec x) {
  const vec magic = vec{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const vec n = (x * 1.44269504088896341f + magic) - magic;
  vec r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vec p = vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  vec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const vec e = p * scale;
  return x < -87.3365402f ? vec{} : e;
}

// x[i] = e^(x[i] - shift) for i < n (x[i] <= shift).
inline void exp_shifted(float* x, int64_t n, float shift) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(x + i, exp_nonpositive(load(x + i) - shift));
  if (i < n) {
    float tail[kLanes] = {};
    std::memcpy(tail, x + i, (n - i) * sizeof(float));
    vec t = exp_nonpositive(load(tail) - shift);
    std::memcpy(x + i, &t, (n - i) * sizeof(float));
  }
}

// o[0, NV·kLanes) = Σ_s ps[s] v_s over the real slots s <= slot, in slot order, the NV vectors
// of o held in registers (v_s: `ld` floats apart).
template <int NV>
inline void attend_values(const float* ps, const bool* real, int64_t slot, const float* v, int64_t ld, float* o) {
  vec acc[NV] = {};
  for (int64_t s = 0; s <= slot; ++s) {
    if (!real[s]) continue;
    const float w = ps[s];
    for (int u = 0; u < NV; ++u) acc[u] += w * load(v + s * ld + u * kLanes);
  }
  for (int u = 0; u < NV; ++u) store(o + u * kLanes, acc[u]);
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
  typedef int32_t wide __attribute__((vector_size(4 * kLanes)));
  // GCC 12 scalarises the sign extension of a generic int8 vector: the x86 variants say it directly.
  static vec load(const int8_t* p) {
#if defined(WIOLA_ISA_AVX512)
    return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(WIOLA_ISA_AVX2)
    return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
    // Each lane shifts its byte of the 4 to the top and back (arithmetic: sign-extended); NEON:
    // one broadcast load, one shift each way, one convert (a conversion of the int8 vector is
    // scalarised there too).
    int32_t four;
    std::memcpy(&four, p, sizeof(four));
    const wide up = {24, 16, 8, 0};
    wide w = (wide{} + four) << up;
    return __builtin_convertvector(w >> 24, vec);
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

// SiLU(x) = x·σ(x) lane by lane, σ from e = e^-|x| (exp_nonpositive, never overflowing):
// σ(x) = 1/(1 + e) for x >= 0, e/(1 + e) below. Within 3 ulp of x·σ(x) in exact arithmetic
// (exp's 7.9e-8, a division and a product); NaN for NaN.
inline vec silu_vec(vec x) {
  const vec zero = vec{}, one = zero + 1.0f;
  const vec e = exp_nonpositive(x < zero ? x : -x);
  return x * ((x < zero ? e : one) / (one + e));
}

// The butterfly's middle over n elements: o = SiLU(a) ⊙ b + c, silu_vec in every lane, the last
// n % kLanes elements through a padded vector, so that an element's value depends on nothing but
// its inputs (not on where a span starts). o may be a: each vector is read before it is written.
// The prompt's rows (silu_gate_rows) and the step's shares (Step::butterfly_share) both run it, so
// a prompt's butterfly is the step's, bitwise, for the same inputs.
inline void silu_gate_span(const float* a, const float* b, const float* c, float* o, int64_t n) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) store(o + j, silu_vec(load(a + j)) * load(b + j) + load(c + j));
  if (j < n) {
    float ta[kLanes] = {}, tb[kLanes] = {}, tc[kLanes] = {};
    const size_t bytes = (n - j) * sizeof(float);
    std::memcpy(ta, a + j, bytes), std::memcpy(tb, b + j, bytes), std::memcpy(tc, c + j, bytes);
    const vec t = silu_vec(load(ta)) * load(tb) + load(tc);
    std::memcpy(o + j, &t, bytes);
  }
}

// The sums of a block of NR rows x NB batch rows of accumulators, each in hsum's order:
// sums[b][i] = hsum(acc[i][b]), four rows at a time where there are four.
template <int NR, int NB>
__attribute__((always_inline)) inline void block_sums(const vec (&acc)[NR][NB], float (&sums)[NB][NR]) {
#pragma GCC unroll 4
  for (int b = 0; b < NB; ++b) {
    if constexpr (NR % 4 == 0) {
#pragma GCC unroll 2
      for (int g = 0; g < NR; g += 4) hsum4(acc[g][b], acc[g + 1][b], acc[g + 2][b], acc[g + 3][b], sums[b] + g);
    } else {
      for (int i = 0; i < NR; ++i) sums[b][i] = hsum(acc[i][b]);
    }
  }
}

// y[b·ldy + i] = hsum(acc[i][b]) (times scale[i] when kScaled) for NR rows i (a multiple of 4), as
// one vector store a batch row and four rows: the same values as block_sums, past the per-output loop.
template <bool kScaled, int NR, int NB>
__attribute__((always_inline)) inline void store_sums4(const vec (&acc)[NR][NB], const float* scale, float* y,
                                                       int64_t ldy) {
  static_assert(NR % 4 == 0, "store_sums4 stores four rows at a time");
#if defined(WIOLA_ISA_AVX512)
  if constexpr (NR == 4 && (NB == 4 || NB == 2)) {
    __m512 sums;
    if constexpr (NB == 4)
      sums = hsum16(acc);
    else
      sums = hsum8(acc);
    if constexpr (kScaled) sums = _mm512_mul_ps(sums, _mm512_broadcast_f32x4(_mm_loadu_ps(scale)));
    _mm_storeu_ps(y, _mm512_castps512_ps128(sums));
    _mm_storeu_ps(y + ldy, _mm512_extractf32x4_ps(sums, 1));
    if constexpr (NB == 4) {
      _mm_storeu_ps(y + 2 * ldy, _mm512_extractf32x4_ps(sums, 2));
      _mm_storeu_ps(y + 3 * ldy, _mm512_extractf32x4_ps(sums, 3));
    }
    return;
  }
  if constexpr (NR == 8 && NB == 1) {
    const __m512 sums = hsum8_rows(acc);
    __m128 lo = _mm512_castps512_ps128(sums), hi = _mm512_extractf32x4_ps(sums, 2);
    if constexpr (kScaled) {
      lo = _mm_mul_ps(lo, _mm_loadu_ps(scale));
      hi = _mm_mul_ps(hi, _mm_loadu_ps(scale + 4));
    }
    _mm_storeu_ps(y, lo);
    _mm_storeu_ps(y + 4, hi);
    return;
  }
#endif
#pragma GCC unroll 2
  for (int g = 0; g < NR; g += 4) {
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      if constexpr (kScaled) {
        v4 four;
        hsum4(acc[g][b], acc[g + 1][b], acc[g + 2][b], acc[g + 3][b], reinterpret_cast<float*>(&four));
        four *= load4(scale + g);
        std::memcpy(y + b * ldy + g, &four, sizeof(four));
      } else {
        hsum4(acc[g][b], acc[g + 1][b], acc[g + 2][b], acc[g + 3][b], y + b * ldy + g);
      }
    }
  }
}

// y[b, r] = <W[r, :], x[b, :]> for rows r in [r0, r1) and every b < B: W (N, K) row-major as
// nn.Linear stores it, so each thread streams one contiguous slice of the matrix exactly once.
// NR rows at a time (independent FMA chains: 4, or 8 at one batch row, dot_blocks), the batch in
// groups of up to kBatchBlock rows of x, which stay in L1 while a group of W rows is reused from L1
// for every group of x.
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
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) {
      vec w = Weight<T>::load(W + (r + i) * K + k);
      WIOLA_PIN(w);
      for (int b = 0; b < NB; ++b) acc[i][b] = madd(w, xv[b], acc[i][b]);
    }
  }
  if constexpr (NR % 4 == 0) {
    if (k == K) {  // no tail: each batch row's sums (times the rows' scales) stored four at once
      store_sums4<Weight<T>::kScaled>(acc, scale + r, y + r, ldy);
      return;
    }
  }
  float sums[NB][NR];
  block_sums(acc, sums);
  for (int i = 0; i < NR; ++i) {
    const T* w = W + (r + i) * K;
    for (int b = 0; b < NB; ++b) {
      float s = sums[b][i];
      for (int64_t kk = k; kk < K; ++kk) s = madd1(Weight<T>::at(w + kk), x[b * ldx + kk], s);
      if constexpr (Weight<T>::kScaled) s *= scale[r + i];
      y[b * ldy + r + i] = s;
    }
  }
}

// Rows [r, r + NR) of NB batch rows: one block where NB is 1, else blocks of 4 rows (NR·NB
// accumulators must fit the registers). Each row's sums are its own, so the numbers are the same.
template <int NR, int NB, typename T>
inline void dot_blocks(const T* W, const float* scale, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy,
                       int64_t r) {
  if constexpr (NR > 4 && NB > 1) {
    for (int g = 0; g < NR; g += 4) dot_block<4, NB>(W, scale, K, x, ldx, y, ldy, r + g);
  } else {
    dot_block<NR, NB>(W, scale, K, x, ldx, y, ldy, r);
  }
}

template <int NR, typename T>
inline void dot_rows(const T* W, const float* scale, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t B,
                     int64_t r) {
  for (int64_t b = 0; b < B; b += kBatchBlock) {
    const float* xb = x + b * ldx;
    float* yb = y + b * ldy;
    switch (B - b < kBatchBlock ? B - b : kBatchBlock) {
      case 1: dot_blocks<NR, 1>(W, scale, K, xb, ldx, yb, ldy, r); break;
#if defined(WIOLA_ISA_AVX512)
      case 2: dot_blocks<NR, 2>(W, scale, K, xb, ldx, yb, ldy, r); break;
      case 3: dot_blocks<NR, 3>(W, scale, K, xb, ldx, yb, ldy, r); break;
#endif
      default: dot_blocks<NR, kBatchBlock>(W, scale, K, xb, ldx, yb, ldy, r); break;
    }
  }
}

// Rows [r0, r1) of y = x Wᵀ, the block of 4 rows `ahead` rows ahead prefetched. The layers' weights
// (19 MB for the 13m preset) mostly come from L3, into L1 here: the hardware prefetcher alone
// does not keep up (measured on an AMD EPYC, one thread: the AVX2 step took about a third longer
// without it, the AVX-512 one about a tenth). With `stream` the prefetch is non-temporal, so that
// the tied head would not evict the layers' weights where the matrices outgrow the last-level
// cache; no CPU chooses it (STREAM_HEAD in decode_step_cpu.py: it was level or slower on every CPU
// measured, 1.5-1.7x slower on an Ice Lake-SP Xeon whose 48 MiB L3 the fp32 matrices outgrow,
// since its non-temporal lines come from DRAM every step); the knob is for bench.ab_tuning's A/Bs.
// 8 rows ahead: level with 16 and 32 on the Xeons (faster than none on the Ice Lake-SP: 1.00-1.25x
// with the head cached), about 5% faster than 16 on the EPYC; on a Zen 5 EPYC about 8 KB ahead (16
// bf16 rows of 256 weights: 1.10x at batch 1); on a Zen 4 EPYC 0 rows ahead, each block's own lines requested at once just before its
// loads (fp32 at batch 8 1.31-1.49x faster than 8 rows ahead, batch 1 1.01-1.09x); the distance
// chosen per CPU and weight type (choose_tuning).
// The 4 rows `ahead` rows past row r (of rows below r1, row_bytes each, from W's first byte).
inline void prefetch_block(const char* W, int64_t row_bytes, int64_t r, int64_t r1, bool stream, int64_t ahead) {
  int64_t p0 = r + ahead < r1 ? r + ahead : r1, p1 = r + ahead + 4 < r1 ? r + ahead + 4 : r1;
  const char* p = W + p0 * row_bytes;
  for (int64_t off = 0; off < (p1 - p0) * row_bytes; off += 64) {
    if (stream)
      __builtin_prefetch(p + off, 0, 0);
    else
      __builtin_prefetch(p + off, 0, 3);
  }
}

// Rows [r0, r1) (r0 a multiple of 4; r1 too unless it is N) of a matrix of row_bytes-byte rows at
// W, in blocks of kBlock (rows(r, 8) where kBlock is 8), then of 4 (rows(r, 4)), then one at a time
// (rows(r, 1)), the row count a compile-time constant; before each block, the rows `ahead` rows on
// are prefetched, up to row r1. A function of its own for each weight type, as the product loop
// always was: inlined into the sharing loop, the fp32 step at batch 1 ran about a tenth slower on
// the Zen 4 VM (interleaved A/B, both slot orders).
// Blocks of 8 (kRowBlock, AVX-512) are for int8 and int4, whose products issue more instructions a
// weight than the others: at one batch row a block of 4 rows is 4 FMA chains, and the FMA's latency
// (4 cycles on the Zen 5 EPYC) held them to one FMA a cycle of the core's two. With 8 rows the 13m
// step at batch 1 ran 1.09-1.13x faster in int8 and 1.11-1.15x in int4 (batch 8 level: its blocks
// stay 4 rows of 4 batch rows); bf16 and fp32, bound by reading their rows, ran 0.97x and
// 0.79-0.88x (fp32: 8 rows' streams at once), so they keep 4 (AMD EPYC Zen 5, tg128 interleaved, tokens equal;
// bench/results/2026-12-04_cpu_row-blocks-amd-zen5/).
template <int kBlock, typename Rows>
__attribute__((noinline)) void stream_rows(const void* W, int64_t row_bytes, int64_t r0, int64_t r1, bool stream,
                                           int64_t ahead, const Rows& rows) {
  const char* bytes = static_cast<const char*>(W);
  int64_t r = r0;
  if constexpr (kBlock == 8) {
    for (; r + 8 <= r1; r += 8) {
      prefetch_block(bytes, row_bytes, r, r1, stream, ahead);
      prefetch_block(bytes, row_bytes, r + 4, r1, stream, ahead);
      rows(r, std::integral_constant<int, 8>{});
    }
  }
  for (; r + 4 <= r1; r += 4) {
    prefetch_block(bytes, row_bytes, r, r1, stream, ahead);
    rows(r, std::integral_constant<int, 4>{});
  }
  for (; r < r1; ++r) rows(r, std::integral_constant<int, 1>{});
}

// ---- sharing a product's rows among the threads ----------------------------------------------
// A product's rows go in blocks of 4, each thread a contiguous share: thread t the blocks from
// blocks·cut[t] to blocks·cut[t + 1]. No thread touches another's rows, or any line another thread
// writes, until the next barrier. A row is computed the same way whichever thread computes it, so
// no result depends on the cuts. They follow each thread's measured rate (Balance): where cores
// are shared (a VM's neighbours, a laptop's other programs) one core can run slower than the other
// for whole runs (on the Zen 4 EPYC VM every product of one run took 1.4-1.6x as long on one thread
// as on the other), and even cuts would wait for it at every barrier. (The threads once claimed
// their shares a part at a time through an atomic range each and took over half of what was left
// of a slower thread's. On the Zen 5 EPYC VM these cuts ran the 13m step at batch 1 1.05-1.14x
// faster than that in bf16, 0.99-1.06x in int8, 1.00-1.07x in int4, 1.04-1.08x in fp32, batch 8
// level, as fast with 4 threads on its 2 cores and 1.01-1.18x with a busy process on one core;
// bench/results/2026-12-04_cpu_product-overhead-amd-zen5/.)
constexpr int kBalanced = 8;  // thread counts whose cuts follow the measured rates; above, even cuts

struct Split {
  double cut[kBalanced + 1] = {0.0, 1.0};
  int nth = 1;

  // Rows [r0, r1) of thread t's share of N rows when the region has `n` threads (even cuts when n
  // is not the count the cuts were made for).
  void rows(int64_t N, int t, int n, int64_t& r0, int64_t& r1) const {
    const int64_t blocks = (N + 3) / 4;
    int64_t b0, b1;
    if (n == nth && n <= kBalanced) {
      b0 = t == 0 ? 0 : static_cast<int64_t>(static_cast<double>(blocks) * cut[t]);
      b1 = t + 1 == n ? blocks : static_cast<int64_t>(static_cast<double>(blocks) * cut[t + 1]);
    } else {
      b0 = blocks * t / n, b1 = blocks * (t + 1) / n;
    }
    r0 = std::min(4 * b0, N), r1 = std::min(4 * std::max(b0, b1), N);
  }
};

// A cheap clock for Balance, in ticks of its own (only ratios between threads are used): the time
// stamp counter on x86 (invariant across cores on the CPUs this runs on), the virtual counter on
// ARM64, else steady_clock's nanoseconds.
inline uint64_t tick() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_ia32_rdtsc();
#elif defined(__aarch64__)
  uint64_t t;
  asm volatile("mrs %0, cntvct_el0" : "=r"(t));
  return t;
#else
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
#endif
}

// Each thread's part of the rows, per kind of product (the layers' products; the head) and thread
// count, for the whole process (a property of the cores and of where the weights are cached, not of
// one binding): 0 until a step has measured them. After each step, thread t's part of a kind moves
// kGain of the way to its share of the threads' rates on that kind (its part over its time), and
// stays at least kLeast of an even part. The head has parts of its own because its rates also
// depend on where its rows are cached: with one set learned from the head, the 13m fp32 step on the
// Zen 5 VM (whose L3 the 32 MB head outgrows) settled at 3:5 and split every layer's products 3:5
// as well, where the layers' own rates settle within 2% of even. A step in which one thread's rate
// was under 1/kOutlier of another's is not counted: a thread that lost its core for a scheduler
// tick says nothing of its speed. Relaxed atomics: the parts are hints that no result depends on,
// and two bindings may step at once.
struct Balance {
  static constexpr int kKinds = 2;  // 0: the layers' products, 1: the head
  static constexpr double kGain = 0.125, kLeast = 0.25, kOutlier = 4.0;
  std::atomic<float> part[kKinds][kBalanced + 1][kBalanced] = {};

  static Balance& process() {
    static Balance balance;
    return balance;
  }

  // The cuts of kind k for n threads from the parts (even for n > kBalanced or before a measure).
  Split split(int k, int n) const {
    Split s;
    s.nth = n;
    if (n > kBalanced) return s;
    double sum = 0.0, p[kBalanced];
    for (int t = 0; t < n; ++t) sum += p[t] = part[k][n][t].load(std::memory_order_relaxed);
    for (int t = 0; t < n; ++t) s.cut[t + 1] = sum > 0.0 ? s.cut[t] + p[t] / sum : static_cast<double>(t + 1) / n;
    s.cut[n] = 1.0;
    return s;
  }

  // Thread t's next part of n threads (into `next`) from the parts `was` (as set: any positive
  // numbers, taken as fractions of their sum; all 0: not yet measured, even) and its time ticks[t]
  // on the rows cuts.cut[t] to cuts.cut[t + 1] of one step; false (next untouched) when the step
  // does not count: a thread without rows or time, or an outlier.
  static bool next_parts(int n, const float* was, const Split& cuts, const uint64_t* ticks, float* next) {
    if (n < 2 || n > kBalanced || n != cuts.nth) return false;
    double rate[kBalanced], sum = 0.0, lo = INFINITY, hi = 0.0;
    for (int t = 0; t < n; ++t) {
      const double rows = cuts.cut[t + 1] - cuts.cut[t];
      if (ticks[t] == 0 || !(rows > 0.0)) return false;
      rate[t] = rows / static_cast<double>(ticks[t]);
      sum += rate[t], lo = std::min(lo, rate[t]), hi = std::max(hi, rate[t]);
    }
    if (hi > kOutlier * lo) return false;
    double had = 0.0;
    for (int t = 0; t < n; ++t) had += was[t] > 0.0f ? was[t] : 0.0f;
    double moved[kBalanced], total = 0.0;
    for (int t = 0; t < n; ++t) {
      const double from = had > 0.0 && was[t] > 0.0f ? was[t] / had : 1.0 / n;
      moved[t] = std::max(kLeast / n, from + kGain * (rate[t] / sum - from));
      total += moved[t];
    }
    for (int t = 0; t < n; ++t) next[t] = static_cast<float>(moved[t] / total);
    return true;
  }

  // The parts of kind k moved by one step of n threads (next_parts).
  void update(int k, const Split& cuts, int n, const uint64_t* ticks) {
    if (n < 2 || n > kBalanced) return;
    float was[kBalanced], next[kBalanced];
    for (int t = 0; t < n; ++t) was[t] = part[k][n][t].load(std::memory_order_relaxed);
    if (!next_parts(n, was, cuts, ticks, next)) return;
    for (int t = 0; t < n; ++t) part[k][n][t].store(next[t], std::memory_order_relaxed);
  }
};

// ---- the step's barrier ------------------------------------------------------------------------
// Thread t of the step's region counts the barriers it has reached in arrivals[t], a cache line
// of its own, and waits until every other thread's count has reached its own: one line each way
// between two threads. In a loop of barriers alone on two cores of the Zen 5 VM it took 37-230 ns
// a barrier, libgomp's `omp barrier` 190-420 ns in the same runs (the range is where the host
// placed the two vCPUs); the step passes 9 a layer. Each thread reads every other's line, so
// above kFlagThreads threads (more than were measured) the step keeps `omp barrier`. A thread
// that has looked kSpins times yields its core at each further look, so that a thread it waits
// on that shares its core (more threads than cores: other processes, or a test's thread counts)
// gets to run. In the 13m step, against `omp barrier` on the Zen 5 VM: 1.02-1.08x at batch 1
// (int8, bf16, int4; fp32 1.01x), batch 8 0.97-1.04x; 4 threads on its 2 cores 0.61-0.82 ms a
// step against 0.99-1.02 ms.
struct alignas(64) Arrival {
  std::atomic<int64_t> reached{0};
};
constexpr int kFlagThreads = 8;
constexpr int kSpins = 256;

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// One thread's view of a region's barrier: arrivals (nth of them, 0 when the region starts).
struct Barrier {
  Arrival* arrivals;
  int tid, nth;
  int64_t reached = 0;

  void wait() {
    if (nth > kFlagThreads) {
#pragma omp barrier
      return;
    }
    ++reached;
    arrivals[tid].reached.store(reached, std::memory_order_release);
    for (int u = 0; u < nth; ++u) {
      if (u == tid) continue;
      for (int looks = 0; arrivals[u].reached.load(std::memory_order_acquire) < reached; ++looks) {
        if (looks < kSpins)
          spin_pause();
        else
          std::this_thread::yield();
      }
    }
  }
};

// ---- int4: group-wise, symmetric, fp32 scales (wiola/fast/quantize.py) ----------------------------
// A row of K weights is K/2 bytes, weight 2j in the low nibble of byte j and 2j+1 in the high one,
// each nibble u the weight q = u - 8 in [-7, 7] (ONNX Runtime's MatMulNBits layout with its default
// zero point 8); the row's K/kQ4Group groups of kQ4Group consecutive weights have one fp32 scale
// each, (N, K/kQ4Group) row-major. How the product reads them: Packed<q4> below.
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

// kLanes weights (kLanes/2 bytes at p) as fp32 q values (a row's tail, beyond its whole chunks).
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

// ---- lane-packed products: int4 and bf16 ------------------------------------------------------
// Both read a row in chunks of kPer·kLanes weights as kLanes 32-bit lanes, weight kPer·i + j of the
// chunk in part j of lane i: int4, 8 nibbles a lane (128 weights a chunk on AVX-512: the stored
// layout, nibble j at bits 4j); bf16, 2 halves a lane (weight 2i in the low half). Part j of every
// lane at once is one or two lane operations away, with no widening shuffle, and it multiplies the
// chunk's x taken at a stride of kPer, which each thread rearranges once per product (transpose
// below, B·K floats), not once per row.
// - int4: nibble j becomes its fp32 value q by a 16-entry table lookup (AVX-512 vpermps reads the
//   low 4 bits of each lane's index) or exactly as (2^23 + u) - (2^23 + 8) (the other variants: the
//   nibble ORed into the mantissa of 2^23). A lane's 8 products q·x are summed in fp32 and the sum
//   multiplied by the lane's group scale (lane i lies in group i/4 of the chunk) before it joins the
//   row's sum, as the int8 rows multiply by their scale after the sum: the dequantized weights'
//   function within the fp32 error bound (docs/SPEC.md, "int4 weights").
// - bf16: the high half masked, the low half shifted up, are the two weights' fp32 values: each
//   product w·x fused into the sum as the other types do (two operations per 2·kLanes weights
//   against a widening shuffle and a shift per kLanes).
// A row's tail of K mod kPer·kLanes takes the element-wise path.
typedef uint32_t uvec __attribute__((vector_size(4 * kLanes)));

inline vec as_vec(uvec u) {
  vec v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

template <typename P>
struct Packed;
template <>
struct Packed<q4> {
  static constexpr int kPer = 8;
  static constexpr bool kScaled = true;
  static int64_t row_bytes(int64_t K) { return K / 2; }  // the bytes of K weights
  // Nibble J of every lane as fp32 q = u - 8.
  template <int J>
  static vec part(uvec lanes) {
    uvec u = J ? lanes >> (4 * J) : lanes;
#if defined(WIOLA_ISA_AVX512)
    const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    return (vec)_mm512_permutexvar_ps((__m512i)u, table);
#else
    return as_vec((u & 15u) | 0x4B000000u) - 8388616.0f;  // (2^23 + u) - (2^23 + 8): exact
#endif
  }
  // The scale of each lane of the chunk at weight c of row r (lane i: group i/4).
  static vec lane_scales(const float* scale, int64_t r, int64_t K, int64_t c) {
    const float* s = scale + r * (K / kQ4Group) + c / kQ4Group;
#if defined(WIOLA_ISA_AVX512)
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return (vec)_mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(s)));
#elif defined(WIOLA_ISA_AVX2)
    return (vec)_mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(s[0])), _mm_set1_ps(s[1]), 1);
#else
    static_assert(kLanes == 4, "portable: one group a chunk");
    return vec{} + s[0];
#endif
  }
  // kLanes dequantized weights at weight k of row r (the tail: whole groups).
  static vec tail(const uint8_t* row, const float* scale, int64_t r, int64_t K, int64_t k) {
    return q4_load(row + k / 2) * (vec{} + scale[r * (K / kQ4Group) + k / kQ4Group]);
  }
  static float at(const uint8_t* row, const float* scale, int64_t r, int64_t K, int64_t k) {
    return q4_at(row, k) * scale[r * (K / kQ4Group) + k / kQ4Group];
  }
};
template <>
struct Packed<bf16> {
  static constexpr int kPer = 2;
  static constexpr bool kScaled = false;
  static int64_t row_bytes(int64_t K) { return 2 * K; }
  template <int J>
  static vec part(uvec lanes) {
    return as_vec(J ? lanes & 0xFFFF0000u : lanes << 16);
  }
  static vec tail(const uint8_t* row, const float*, int64_t, int64_t, int64_t k) {
    return Weight<bf16>::load(reinterpret_cast<const bf16*>(row) + k);
  }
  static float at(const uint8_t* row, const float*, int64_t, int64_t, int64_t k) {
    return Weight<bf16>::at(reinterpret_cast<const bf16*>(row) + k);
  }
};

// sum[b] += part J of lanes · x of batch row b, for J..kPer-1; x read by each FMA from memory.
// Not packed_fma_rows with one row: that pins the x parts in registers, which the narrow variants
// do not have to spare where kShareX is false (int4 at batch 8 on AVX2 ran 2.2x slower that way,
// same numbers; AMD EPYC Zen 4).
template <typename P, int J, int NB>
inline void packed_fma(uvec lanes, const float* xt, int64_t ldx, vec* sum) {
  vec w = Packed<P>::template part<J>(lanes);
  WIOLA_PIN(w);
  for (int b = 0; b < NB; ++b) sum[b] = madd(w, load(xt + b * ldx + J * kLanes), sum[b]);
  if constexpr (J + 1 < Packed<P>::kPer) packed_fma<P, J + 1, NB>(lanes, xt, ldx, sum);
}

// Whether packed_fma_rows pins the parts of x in registers: everywhere but in the AVX-512
// variant's bf16 blocks of more than one batch row. There GCC keeps them in registers by itself,
// and pinned under -mtune=icelake-server it stored and reloaded them through the stack (12 vector
// stack accesses in the block of 4 rows and 4 batch rows against 4 unpinned); unpinned, the 13m
// bf16 step at batch 8 ran 1.03-1.07x faster on the Ice Lake-SP Xeon, batches 4 and 6 within the
// noise, the same tokens. Unpinned, int4 at batch 2 ran 0.96-0.99x there, and the AVX2 variant's
// bf16 0.93-0.96x at batch 2 (bench/results/2026-12-08_cpu_packed-x-pins-intel-icelake/).
template <typename P, int NB>
constexpr bool kPinX = NB == 1 || Packed<P>::kScaled || kLanes < 16;

// sum[i][b] += part J of lanes[i] · x of batch row b, for J..kPer-1 and the NR rows: each part of
// x loaded once for all NR rows (as dot_block does), each (row, lane) summing its parts in order.
template <typename P, int J, int NR, int NB>
inline void packed_fma_rows(const uvec* lanes, const float* xt, int64_t ldx, vec (*sum)[NB]) {
  vec xv[NB];
  for (int b = 0; b < NB; ++b) {
    xv[b] = load(xt + b * ldx + J * kLanes);
    if constexpr (kPinX<P, NB>) WIOLA_PIN(xv[b]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i) {
    vec w = Packed<P>::template part<J>(lanes[i]);
    WIOLA_PIN(w);
    // x first: with the weight first GCC allocated the registers so that the int4 step at batch 1
    // ran 0.96-0.97x (AMD EPYC Zen 5, interleaved; the same numbers either way)
    for (int b = 0; b < NB; ++b) sum[i][b] = madd(xv[b], w, sum[i][b]);
  }
  if constexpr (J + 1 < Packed<P>::kPer) packed_fma_rows<P, J + 1, NR, NB>(lanes, xt, ldx, sum);
}

// Batch rows a pass of packed_rows takes through each block of 4 weight rows: every chunk's lanes
// are loaded and split into parts once a pass, so more batch rows a pass split each weight fewer
// times. bf16 takes 4 on AVX-512 (16 sums, 4 lanes and 4 parts of x fit its 32 registers): the 13m
// bf16 step ran 1.09-1.17x faster at batches 4, 5 and 8 than with 2, batch 1 level (AMD EPYC Zen 5,
// tg128 interleaved, tokens equal; bench/results/2026-12-04_cpu_bf16-batch-pass-amd-zen5/). Each
// sum takes the same operations in the same order either way, so the numbers are bitwise the same.
// int4 keeps 2: with 4 its sums and scaled sums outgrow the registers (kShareX below), and it ran
// 1.43x slower loading x per row, 1.53x slower in blocks of 2 weight rows (same CPU and A/B).
template <typename P>
constexpr int kPackedBatch = kLanes >= 16 && !Packed<P>::kScaled ? 4 : kLanes >= 8 ? 2 : 1;

// Whether a chunk's x parts are shared by the NR rows (packed_fma_rows) or loaded per row
// (packed_fma): sharing holds NR lanes, NR·NB sums (and as many accumulators when scaled) in
// registers, which fits 32 vector registers (AVX-512, NEON) at every NB and 16 (AVX2, SSE) at NB 1.
// Either order gives every number bitwise the same.
template <typename P, int NR, int NB>
constexpr bool kShareX = NR * NB * (Packed<P>::kScaled ? 2 : 1) + NR + NB + 1 <= (kLanes >= 16 ? 32 : 16);

// Rows [r, r + NR) of NB batch rows; xt: transpose's x (stride ldx). Each chunk's lanes are loaded
// once into a register (pinned): left to itself GCC folds the load into each part's operation, so
// the bf16 mask and shift read every chunk twice, and the bf16 step at batch 1 ran 1.04-1.06x
// faster pinned (1.04x at batch 8; AMD EPYC Zen 5, interleaved, logits bitwise the same).
template <typename P, int NR, int NB>
inline void packed_block(const uint8_t* W, const float* scale, int64_t K, const float* xt, int64_t ldx, float* y,
                         int64_t ldy, int64_t r) {
  constexpr int64_t chunk = Packed<P>::kPer * kLanes;
  const int64_t row_bytes = Packed<P>::row_bytes(K), full = K / chunk * chunk;
  vec acc[NR][NB] = {};
  for (int64_t c = 0; c < full; c += chunk) {
    if constexpr (kShareX<P, NR, NB>) {
      uvec lanes[NR];
#pragma GCC unroll 8
      for (int i = 0; i < NR; ++i) {
        std::memcpy(&lanes[i], W + (r + i) * row_bytes + Packed<P>::row_bytes(c), sizeof(lanes[i]));
        WIOLA_PIN(lanes[i]);
      }
      if constexpr (Packed<P>::kScaled) {
        vec sum[NR][NB] = {};
        packed_fma_rows<P, 0, NR, NB>(lanes, xt + c, ldx, sum);
#pragma GCC unroll 8
        for (int i = 0; i < NR; ++i) {
          vec s = Packed<P>::lane_scales(scale, r + i, K, c);
          for (int b = 0; b < NB; ++b) acc[i][b] = madd(sum[i][b], s, acc[i][b]);
        }
      } else {
        packed_fma_rows<P, 0, NR, NB>(lanes, xt + c, ldx, acc);
      }
      continue;
    }
    for (int i = 0; i < NR; ++i) {
      uvec lanes;
      std::memcpy(&lanes, W + (r + i) * row_bytes + Packed<P>::row_bytes(c), sizeof(lanes));
      WIOLA_PIN(lanes);
      if constexpr (Packed<P>::kScaled) {
        vec sum[NB] = {};
        packed_fma<P, 0, NB>(lanes, xt + c, ldx, sum);
        vec s = Packed<P>::lane_scales(scale, r + i, K, c);
        for (int b = 0; b < NB; ++b) acc[i][b] = madd(sum[b], s, acc[i][b]);
      } else {
        packed_fma<P, 0, NB>(lanes, xt + c, ldx, acc[i]);
      }
    }
  }
  int64_t k = full;
  for (; k + kLanes <= K; k += kLanes) {
    for (int i = 0; i < NR; ++i) {
      vec w = Packed<P>::tail(W + (r + i) * row_bytes, scale, r + i, K, k);
      for (int b = 0; b < NB; ++b) acc[i][b] = madd(w, load(xt + b * ldx + k), acc[i][b]);
    }
  }
  if constexpr (NR % 4 == 0) {
    if (k == K) {  // no tail: each batch row's sums stored four at once
      store_sums4<false>(acc, nullptr, y + r, ldy);
      return;
    }
  }
  float sums[NB][NR];
  block_sums(acc, sums);
  for (int i = 0; i < NR; ++i) {
    for (int b = 0; b < NB; ++b) {
      float s = sums[b][i];
      for (int64_t kk = k; kk < K; ++kk) s = madd1(Packed<P>::at(W + (r + i) * row_bytes, scale, r + i, K, kk), xt[b * ldx + kk], s);
      y[b * ldy + r + i] = s;
    }
  }
}

// x (B rows of K, stride ldx) into xt (B rows of K, stride K): each whole chunk's x[kPer·i + j] at
// j·kLanes + i, the tail as it is.
template <int kPer>
inline void transpose(const float* x, int64_t ldx, int64_t B, int64_t K, float* xt) {
  constexpr int64_t chunk = kPer * kLanes;
  const int64_t full = K / chunk * chunk;
  for (int64_t b = 0; b < B; ++b) {
    const float* xb = x + b * ldx;
    float* tb = xt + b * K;
    for (int64_t c = 0; c < full; c += chunk)
      for (int i = 0; i < kLanes; ++i)
        for (int j = 0; j < kPer; ++j) tb[c + j * kLanes + i] = xb[c + kPer * i + j];
    for (int64_t k = full; k < K; ++k) tb[k] = xb[k];
  }
}

template <typename P, int NR>
inline void packed_rows(const uint8_t* W, const float* scale, int64_t K, const float* xt, float* y, int64_t ldy,
                        int64_t B, int64_t r) {
  int64_t b = 0;
  for (; b + kPackedBatch<P> <= B; b += kPackedBatch<P>) {
    if constexpr (NR > 4 && kPackedBatch<P> > 1) {  // as dot_blocks: 4 rows a block past one batch row
      for (int g = 0; g < NR; g += 4) packed_block<P, 4, kPackedBatch<P>>(W, scale, K, xt + b * K, K, y + b * ldy, ldy, r + g);
    } else {
      packed_block<P, NR, kPackedBatch<P>>(W, scale, K, xt + b * K, K, y + b * ldy, ldy, r);
    }
  }
  for (; b < B; ++b) packed_block<P, NR, 1>(W, scale, K, xt + b * K, K, y + b * ldy, ldy, r);
}

// Weight rows a block at one batch row for weight type T (stream_rows): kRowBlock for int8 and int4,
// whose products are bound by issuing instructions, 4 for fp32 and bf16, bound by reading.
template <typename T>
constexpr int kBlockRows = std::is_same_v<T, int8_t> || std::is_same_v<T, q4> ? kRowBlock : 4;

// This thread's buffer of at least n elements of T, on a 64-byte boundary (grown, never shrunk;
// one per element type): the products' rearranged x, read by vector and tile loads.
template <typename T>
inline T* thread_buffer(int64_t n) {
  static thread_local T* buffer = nullptr;
  static thread_local int64_t size = 0;
  if (size < n) {
    std::free(buffer);
    buffer = static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64));
    if (buffer == nullptr) std::abort();
    size = n;
  }
  return buffer;
}

#if defined(WIOLA_ISA_AMX)
// The AMX variant's bf16 products, on the CPU's tile unit (Intel AMX-BF16: TDPBF16PS adds the
// products of a 16x32 bf16 tile and a 32x16 bf16 tile into a 16x16 fp32 tile). The weights are
// bf16 and x goes in as three bf16 pieces whose sum is x exactly (tile_pieces), so every product
// w·x_piece is exact in fp32 and the sums are fp32 sums of exact products: the same function
// within the fp32 error bound, as every variant's order is. Each output's three pieces are summed
// over K by the tile unit, then y = (sum_hi + sum_mid) + sum_lo: the tile unit computes each
// element of a tile by the same operations whichever row or column of the tile it is in, so a
// row's numbers are the same alone or in any batch. int8 and int4 stay on the AVX-512 products
// (Intel Xeon family 6 model 167, 13m step interleaved in one process): int8 widened to bf16 tiles
// first ran 0.77x at batch 1 and 0.97x at batch 8; int4 (nibbles to bf16 by a table lookup, each
// group's sums scaled out of the tile) 0.70x at batch 1 and 1.59x at batch 8, where a row's path
// cannot depend on the batch (bench/results/2026-12-07_cpu_amx-products-intel-xeon/).
//
// The bf16 matrices are stored tiled (wiola.fast.decode_step_cpu.tile_matrix): blocks of 16 rows
// x 32 weights, 512 a block, the blocks of each 16-row band in order of K; inside one, weight (n, k)
// at (k / 2)·32 + 2n + k % 2 (the pairs the instruction multiplies), rows padded with zeros to a
// multiple of 32, K to a multiple of 32. Tiles of the row-major matrix read with its row stride
// streamed at about 14 GB/s a core here, these contiguous ones at about 25 (the core's rate from L3).
constexpr int64_t kTileN = 16, kTileK = 32, kTileSize = kTileN * kTileK;
inline int64_t tiled_k(int64_t K) { return (K + kTileK - 1) / kTileK * kTileK; }
inline int64_t tile_at(int64_t n, int64_t k, int64_t K) {
  return ((n / kTileN) * (tiled_k(K) / kTileK) + k / kTileK) * kTileSize + (k % kTileK) / 2 * 2 * kTileN +
         (n % kTileN) * 2 + k % 2;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Batch rows a pass of tile_rows takes: 3 pieces each, up to 32 tile rows (two tiles of x).
constexpr int64_t kTileBatch = 10;

// x rows [0, B) (stride ldx, B <= kTileBatch) as tiles: chunk c of K at xa + c·M·32, row 3b + p
// holding piece p of batch row b (M = 3B): hi = x's top 8 significant bits, mid the next 8, lo the
// rest, each cut off (not rounded), so that hi + mid + lo == x exactly for every x whose pieces are
// normal (|x| >= 2^-110; below, the tile unit flushes a subnormal piece: an error under 2^-126 an
// element). Past K, to the last chunk's end, zeros (a masked load: x is not read there).
inline void tile_pieces(const float* x, int64_t ldx, int64_t B, int64_t K, uint16_t* xa) {
  const int64_t M = 3 * B, end = tiled_k(K);
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const auto upper = [](__m512i v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)); };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < end; k += 16) {  // 16 | 32: a vector stays within its chunk
      const __mmask16 in = K - k >= 16 ? 0xFFFF : K > k ? static_cast<__mmask16>((1u << (K - k)) - 1) : 0;
      const __m512 v = _mm512_maskz_loadu_ps(in, x + b * ldx + k);
      const __m512i hi = _mm512_and_si512(_mm512_castps_si512(v), top);
      const __m512 r1 = _mm512_sub_ps(v, _mm512_castsi512_ps(hi));  // exact: x's bits below its top 8
      const __m512i mid = _mm512_and_si512(_mm512_castps_si512(r1), top);
      const __m512 lo = _mm512_sub_ps(r1, _mm512_castsi512_ps(mid));  // exact, at most 8 bits: a bf16
      uint16_t* row = xa + (k / kTileK) * M * kTileK + k % kTileK;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + (3 * b) * kTileK), upper(hi));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + (3 * b + 1) * kTileK), upper(mid));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + (3 * b + 2) * kTileK), upper(_mm512_castps_si512(lo)));
    }
}

// Rows [r0, r1) of y (B rows, stride ldy) = x·Wᵀ for a tiled bf16 W (N, K), B <= kTileBatch, x
// already in tiles (xa). Blocks of 32 rows (two tiles of weights), each with every chunk of K:
// tmm4/tmm5 hold the pieces of up to 16 and of the next 16 tile rows, tmm6/tmm7 the two weight
// tiles, tmm0-3 the four sums.
inline void tile_rows(const bf16* W, int64_t K, const uint16_t* xa, int64_t B, float* y, int64_t ldy, int64_t r0,
                      int64_t r1) {
  const int M = static_cast<int>(3 * B), M0 = M < 16 ? M : 16, M1 = M - M0;
  TileConfig cfg;
  for (int t : {0, 1, 4}) cfg.rows[t] = M0, cfg.colsb[t] = 64;
  if (M1)
    for (int t : {2, 3, 5}) cfg.rows[t] = M1, cfg.colsb[t] = 64;
  for (int t : {6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  const int64_t chunks = tiled_k(K) / kTileK;
  alignas(64) float sums[32 * 32];  // tile row (piece), then the 32 outputs of the block
  for (int64_t n0 = r0 / 32 * 32; n0 < r1; n0 += 32) {
    _tile_zero(0);
    _tile_zero(1);
    if (M1) {
      _tile_zero(2);
      _tile_zero(3);
    }
    const bf16* w0 = W + (n0 / kTileN) * chunks * kTileSize;
    const bf16* w1 = w0 + chunks * kTileSize;
    for (int64_t c = 0; c < chunks; ++c) {
      const uint16_t* a = xa + c * M * kTileK;
      _tile_loadd(4, a, 64);
      _tile_loadd(6, w0 + c * kTileSize, 64);
      _tile_loadd(7, w1 + c * kTileSize, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (M1) {
        _tile_loadd(5, a + 16 * kTileK, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, sums, 128);
    _tile_stored(1, sums + 16, 128);
    if (M1) {
      _tile_stored(2, sums + 16 * 32, 128);
      _tile_stored(3, sums + 16 * 32 + 16, 128);
    }
    // y = (hi + mid) + lo for the block's outputs in [r0, r1): two vectors of 16 a batch row
    const int64_t lo = n0 > r0 ? n0 : r0, hi = n0 + 32 < r1 ? n0 + 32 : r1;
    const uint32_t in = static_cast<uint32_t>(((uint64_t{1} << (hi - n0)) - 1) & ~((uint64_t{1} << (lo - n0)) - 1));
    for (int64_t b = 0; b < B; ++b) {
      const float* s = sums + 3 * b * 32;
      for (int h = 0; h < 2; ++h) {
        const __mmask16 m = static_cast<__mmask16>(in >> (16 * h));
        const __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(s + 16 * h), _mm512_load_ps(s + 32 + 16 * h)),
                                       _mm512_load_ps(s + 64 + 16 * h));
        _mm512_mask_storeu_ps(y + b * ldy + n0 + 16 * h, m, v);
      }
    }
  }
  _tile_release();
}

// Thread tid's share of a tiled bf16 product, in passes of kTileBatch batch rows. The split's cuts
// move to the nearest multiple of 32 rows (the same rule on both sides of a cut, so the shares
// still cover the rows once), so that no block of 32 is computed by two threads.
inline void tile_share(const Split& split, const bf16* W, int64_t N, int64_t K, const float* x, int64_t ldx, float* y,
                       int64_t ldy, int64_t B, int tid, int nth) {
  int64_t r0, r1;
  split.rows(N, tid, nth, r0, r1);
  const auto snap = [N](int64_t r) { return r >= N ? N : std::min(N, (r + 16) / 32 * 32); };
  r0 = snap(r0), r1 = snap(r1);
  if (r0 >= r1) return;
  uint16_t* const xa = thread_buffer<uint16_t>(3 * kTileBatch * tiled_k(K));  // the pieces of x
  for (int64_t b = 0; b < B; b += kTileBatch) {
    const int64_t nb = B - b < kTileBatch ? B - b : kTileBatch;
    tile_pieces(x + b * ldx, ldx, nb, K, xa);
    tile_rows(W, K, xa, nb, y + b * ldy, ldy, r0, r1);
  }
}
#endif

// Thread tid's share (split, of a region of nth threads) of an (N, K) product, read by stream_rows
// (prefetch, non-temporal head). fp32 and int8 rows are read as they are; int4 and bf16 rows are
// packed for x rearranged (transpose), which each thread does into its own buffer first (B·K
// floats, far fewer than the N·K weights).
template <typename T>
inline void share_product(const Split& split, const T* W, const float* scale, int64_t N, int64_t K, const float* x,
                          int64_t ldx, float* y, int64_t ldy, int64_t B, int tid, int nth, bool stream, int64_t ahead) {
#if defined(WIOLA_ISA_AMX)
  if constexpr (std::is_same_v<T, bf16>) {
    tile_share(split, W, N, K, x, ldx, y, ldy, B, tid, nth);
    return;
  }
#endif
  int64_t r0, r1;
  split.rows(N, tid, nth, r0, r1);
  if (r0 >= r1) return;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, int8_t>) {
    const int64_t row_bytes = K * static_cast<int64_t>(sizeof(T));
    const auto rows = [&](int64_t r, auto nr) { dot_rows<decltype(nr)::value>(W, scale, K, x, ldx, y, ldy, B, r); };
    stream_rows<kBlockRows<T>>(W, row_bytes, r0, r1, stream, ahead, rows);
  } else {
    // On a 64-byte boundary, so that no vector of x read from it crosses a cache line (new[] gives
    // 16 bytes: with the buffer 16 bytes past the boundary the 13m bf16 step ran 1.05-1.06x slower
    // at batch 8, 1.01-1.06x at batch 1, int4 level to 1.02x; AMD EPYC Zen 4, interleaved,
    // bench/results/2026-12-06_cpu_xt-alignment-amd-zen4/).
    float* const xt = thread_buffer<float>(B * K);  // one lookup of the thread-local, not one a block
    transpose<Packed<T>::kPer>(x, ldx, B, K, xt);
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(W);
    const int64_t row_bytes = Packed<T>::row_bytes(K);
    const auto rows = [&](int64_t r, auto nr) { packed_rows<T, decltype(nr)::value>(bytes, scale, K, xt, y, ldy, B, r); };
    stream_rows<kBlockRows<T>>(W, row_bytes, r0, r1, stream, ahead, rows);
  }
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

// The gate at a position is three parts, of which only the running sum chains one position to the
// next: gate_mean (the head mean of the position's query q, H heads of D, head stride D, rotated by
// cs and sn where cs is not null: the gate after RoPE), the running sum of the real positions' means
// and their mean so far (0 before any), and gate_mlp (g = σ(W_2 SiLU(W_1 c) + b_2), W_1 (H, D),
// W_2 (H, H)). The step's gate_row runs the three at one position (gate_position); the prompt's
// gate_rows runs the first and the last for every position at once, split between the threads, and
// the sums between them: the same operations on the same numbers either way. D, H <= 1024 (checked
// by the bindings).
inline void gate_mean(const float* q, int64_t H, int64_t D, const float* cs, const float* sn, float* out) {
  float m[1024];
  for (int64_t j = 0; j < D; ++j) {
    float s = 0.0f;
    for (int64_t hh = 0; hh < H; ++hh) s += q[hh * D + j];
    m[j] = s / static_cast<float>(H);
  }
  if (cs != nullptr)
    rope(m, cs, sn, out, D);
  else
    std::memcpy(out, m, D * sizeof(float));
}

// sum ← m + sum and seen + 1 where the position is real; c = sum / max(seen, 1).
inline void gate_sum(const float* m, int64_t D, bool real, float* sum, int64_t& seen, float* c) {
  if (real) {
    for (int64_t j = 0; j < D; ++j) sum[j] = m[j] + sum[j];
    ++seen;
  }
  const float denom = static_cast<float>(seen > 0 ? seen : 1);
  for (int64_t j = 0; j < D; ++j) c[j] = sum[j] / denom;
}

inline void gate_mlp(const float* c, int64_t H, int64_t D, const float* w1, const float* w2, const float* b2,
                     float* g) {
  float hidden[1024];
  for (int64_t hh = 0; hh < H; ++hh) hidden[hh] = silu(dot(w1 + hh * D, c, D));
  for (int64_t hh = 0; hh < H; ++hh) g[hh] = sigmoid(dot(w2 + hh * H, hidden, H) + b2[hh]);
}

inline void gate_position(const float* q, int64_t H, int64_t D, const float* cs, const float* sn, bool real,
                          float* sum, int64_t& seen, const float* w1, const float* w2, const float* b2, float* g) {
  float m[1024], c[1024];
  gate_mean(q, H, D, cs, sn, m);
  gate_sum(m, D, real, sum, seen, c);
  gate_mlp(c, H, D, w1, w2, b2, g);
}

// How many threads a parallel region of `bytes` of streaming takes: one per `per_thread`, at
// most OpenMP's maximum (torch.set_num_threads). A small model's step is done sooner by one
// thread than the barriers of several cost, above all when other processes share the cores and
// a waiting thread may lose its core for a scheduler tick. Results do not depend on the count.
constexpr int64_t kSampleBytesPerThread = 1 << 21;
inline int threads_for(int64_t bytes, int64_t per_thread = kSampleBytesPerThread) {
  int64_t n = bytes / per_thread;
  int most = omp_get_max_threads();
  return n < 1 ? 1 : n < most ? static_cast<int>(n) : most;
}

// body(tid, nth) on `nth` threads of one parallel region, or on this thread alone without one
// when nth is 1: a region of fewer threads than torch's pool would dock its idle threads first,
// which costs a scheduler tick or more whenever the cores are shared (measured: 0.2 s a step on a
// loaded 2-core machine, against 0.2 ms without the region). The barriers in body then bind to
// this thread alone and return at once.
template <typename Body>
inline void parallel(int nth, const Body& body) {
  if (nth <= 1) {
    body(0, 1);
    return;
  }
#pragma omp parallel num_threads(nth)
  body(omp_get_thread_num(), omp_get_num_threads());
}

// The step's argument layout. wiola/fast/decode_step_cpu.py holds the same table (LAYOUT) and checks
// it at load against wiola_layout_counts(): a drift between the two is refused, never misread.
// kStreamHead, kPrefetchRows and kBytesPerThread are the tuning the binding chose for this CPU
// (wiola.fast.decode_step_cpu.choose_tuning), kMatrixBytes the bytes of the matrices a step streams
// as stored (scales included; wiola.fast.quantize.matrix_bytes), which sets the thread count with
// kBytesPerThread; none of them changes a result.
// kGroup: the int4 group the binding expects (kQ4Group; checked by the entry points).
enum Dim {
  kB, kV, kD, kL, kH, kHd, kF, kS, kGate, kGatePreRope, kWeightType,
  kStreamHead, kPrefetchRows, kBytesPerThread, kMatrixBytes, kGroup, kNumDims
};
enum WeightType { kFp32, kBf16, kInt8, kInt4 };
enum Global { kEmbed, kFinalNorm, kFreqs, kNumGlobal };
enum PerLayer { kAttnNorm, kWq, kWk, kWv, kWo, kGateW1, kGateW2, kGateB2, kFfnNorm, kWUp, kWBp, kWDown, kPerLayer };
enum State { kK, kVc, kKeyMask, kGateSum, kGateCount, kNReal, kNumState };

// Scratch for up to R rows (R = n[kB], the cache's rows), carved from one fp32 buffer.
struct Workspace {
  float *h, *x, *qkv, *o, *up, *bp, *cs, *sn, *g, *scores, *qrot;
  Workspace(const int64_t* n, float* w) {
    int64_t R = n[kB], d = n[kD], H = n[kH], D = n[kHd], F = n[kF], S = n[kS];
    h = w; w += R * d;
    x = w; w += R * d;
    qkv = w; w += R * 3 * d;
    o = w; w += R * d;
    up = w; w += R * 2 * F;
    bp = w; w += R * F;
    cs = w; w += R * (D / 2);
    sn = w; w += R * (D / 2);
    g = w; w += R * H;
    scores = w; w += R * H * S;
    qrot = w; w += R * d;
  }
  static int64_t floats(const int64_t* n) {
    int64_t R = n[kB], d = n[kD], H = n[kH], D = n[kHd], F = n[kF], S = n[kS];
    return R * (d * 7 + 3 * F + D + H + H * S);
  }
};

// Row `token` of the embedding, as fp32 (the dequantized row: weight times the row's scale).
template <typename T>
inline void embed_row(const T* E, const float* scale, int64_t token, int64_t d, float* out) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, E + token * d, d * sizeof(float));
  } else {
#if defined(WIOLA_ISA_AMX)
    if constexpr (std::is_same_v<T, bf16>) {
      for (int64_t i = 0; i < d; ++i) out[i] = Weight<T>::at(E + tile_at(token, i, d));  // tiled (tile_rows)
      return;
    }
#endif
    for (int64_t i = 0; i < d; ++i) out[i] = Weight<T>::at(E + token * d + i);
    if constexpr (Weight<T>::kScaled)
      for (int64_t i = 0; i < d; ++i) out[i] *= scale[token];
  }
}

// One step of B active rows, the matrices of weight type T (everything else fp32). Active row i
// is the cache's row rows[i], its new token tokens[i] goes to slot slots[i] of that row (rows
// join at different times, so each has its own slot). Each row's arithmetic reads only its own
// activations and cache row, in an order that does not depend on B, on i or on the thread count:
// a row's logits are bitwise the same alone or beside any others.
template <typename T>
struct Step {
  const int64_t R, B, V, d, L, H, D, F, S, half;
  const bool gate, gate_pre_rope, stream_head;
  const int64_t ahead, bytes_per_thread, matrix_bytes;
  const void* const* weights;
  const float* const* scales;
  float* const k_cache;
  float* const v_cache;
  bool* const key_mask;
  float* const gate_sum;
  int64_t* const gate_count;
  int64_t* const n_real;
  const int64_t *rows, *tokens, *slots;
  const float eps, sqrt_d;
  Workspace ws;
  float* logits;
  Split split[Balance::kKinds];  // the cuts of the layers' products and of the head
  Arrival* arrivals = nullptr;
  struct alignas(64) Busy {  // a line a thread: no thread writes another's
    uint64_t ticks[Balance::kKinds] = {};
  } busy[kBalanced];  // each thread's ticks in each kind of product

  Step(const int64_t* n, const void* const* w, const float* const* sc, void* const* state, int64_t b,
       const int64_t* rows_, const int64_t* tokens_, const int64_t* slots_, float eps_, float* logits_, float* work)
      : R(n[kB]), B(b), V(n[kV]), d(n[kD]), L(n[kL]), H(n[kH]), D(n[kHd]), F(n[kF]), S(n[kS]), half(n[kHd] / 2),
        gate(n[kGate] != 0), gate_pre_rope(n[kGatePreRope] != 0), stream_head(n[kStreamHead] != 0),
        ahead(n[kPrefetchRows]), bytes_per_thread(n[kBytesPerThread]), matrix_bytes(n[kMatrixBytes]),
        weights(w), scales(sc),
        k_cache(static_cast<float*>(state[kK])), v_cache(static_cast<float*>(state[kVc])),
        key_mask(static_cast<bool*>(state[kKeyMask])), gate_sum(static_cast<float*>(state[kGateSum])),
        gate_count(static_cast<int64_t*>(state[kGateCount])), n_real(static_cast<int64_t*>(state[kNReal])),
        rows(rows_), tokens(tokens_), slots(slots_), eps(eps_), sqrt_d(std::sqrt(static_cast<float>(n[kHd]))),
        ws(n, work), logits(logits_) {}

  static int64_t at(int64_t l, int64_t i) { return kNumGlobal + l * kPerLayer + i; }
  const float* vec(int64_t slot) const { return static_cast<const float*>(weights[slot]); }
  const T* mat(int64_t slot) const { return static_cast<const T*>(weights[slot]); }
  // Cache offsets of active row i: layer l's row, and head hh's slot s in it.
  int64_t cache_row(int64_t l, int64_t i) const { return l * R + rows[i]; }
  int64_t kv_at(int64_t l, int64_t i, int64_t hh, int64_t s) const { return ((cache_row(l, i) * H + hh) * S + s) * D; }

  // The step's products, kProducts a layer in the order layer() runs them (W_q, W_k, W_v, W_o,
  // W_up, W_bp, W_down), then the head; product p's output rows.
  static constexpr int kProducts = 7;
  int64_t product_rows(int64_t p) const {
    if (p == kProducts * L) return V;
    const int64_t j = p % kProducts;
    return j == 4 ? 2 * F : j == 5 ? F : d;
  }

  // Thread tid's part (of nth) of y = x Wᵀ for every active row: product p (product_rows(p) x K),
  // the matrix of slot `slot`; its ticks counted for Balance.
  void product(int64_t p, int64_t slot, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy, int tid,
               int nth, bool stream = false) {
    const int k = p == kProducts * L ? 1 : 0;
    const uint64_t start = tick();
    share_product(split[k], mat(slot), scales[slot], product_rows(p), K, x, ldx, y, ldy, B, tid, nth, stream, ahead);
    if (tid < kBalanced) busy[tid].ticks[k] += tick() - start;
  }

  // The cuts of nth threads (Balance), and the barrier's arrivals, at 0, in this thread's buffer
  // (grown, never shrunk).
  void init_region(int nth) {
    static thread_local std::unique_ptr<Arrival[]> arrived;
    static thread_local int size_arrived = 0;
    if (size_arrived < nth) {
      arrived.reset(new Arrival[nth]);
      size_arrived = nth;
    }
    for (int k = 0; k < Balance::kKinds; ++k) split[k] = Balance::process().split(k, nth);
    arrivals = arrived.get();
    for (int t = 0; t < nth; ++t) arrivals[t].reached.store(0, std::memory_order_relaxed);
  }

  // The residual stream from the embedding, the rotation tables at the row's position (fp32
  // angle = position · θ̃_i, as wiola.ops.rope_tables), the new slot marked real, the first norm.
  void begin_row(int64_t i) {
    embed_row(mat(kEmbed), scales[kEmbed], tokens[i], d, ws.h + i * d);
    const float* freqs = vec(kFreqs);
    float pos = static_cast<float>(n_real[rows[i]]);
    for (int64_t j = 0; j < half; ++j) {
      float angle = pos * freqs[j];
      ws.cs[i * half + j] = std::cos(angle);
      ws.sn[i * half + j] = std::sin(angle);
    }
    key_mask[rows[i] * S + slots[i]] = true;
    rms_norm(ws.h + i * d, vec(at(0, kAttnNorm)), ws.x + i * d, d, eps);
  }

  // Row i's gate of layer l: the running mean of the head-mean query (rotated unless
  // gate_pre_rope), updated in the cache, through the small MLP: g = σ(W_2 SiLU(W_1 c) + b_2).
  void gate_row(int64_t l, int64_t i) {
    float* g = ws.g + i * H;
    if (!gate) {
      for (int64_t hh = 0; hh < H; ++hh) g[hh] = 1.0f;
      return;
    }
    const int64_t row = cache_row(l, i);  // a step's token is always real
    gate_position(ws.qkv + i * 3 * d, H, D, gate_pre_rope ? nullptr : ws.cs + i * half, ws.sn + i * half, true,
                  gate_sum + row * D, gate_count[row], vec(at(l, kGateW1)), vec(at(l, kGateW2)), vec(at(l, kGateB2)), g);
  }

  // Row i's query and key rotated, the key and value written to the row's new cache slot.
  void cache_write_row(int64_t l, int64_t i) {
    const float* q = ws.qkv + i * 3 * d;
    const float *cs = ws.cs + i * half, *sn = ws.sn + i * half;
    for (int64_t hh = 0; hh < H; ++hh) {
      int64_t to = kv_at(l, i, hh, slots[i]);
      rope(q + hh * D, cs, sn, ws.qrot + i * d + hh * D, D);
      rope(q + d + hh * D, cs, sn, k_cache + to, D);
      std::memcpy(v_cache + to, q + 2 * d + hh * D, D * sizeof(float));
    }
  }

  // Attention of (row, head) pair p over the row's cached slots [0, slot], padding left out:
  // softmax(g · <q̃, k̃_s> / sqrt(D)) v_s, in fp32. Three passes over the slots, each free of a
  // chain from one slot to the next except the running max and sum: the scores, their
  // exponentials (divided by the sum once each), then the weighted values summed in registers
  // (attend_values). Every score, exponential and output lane is computed in the same order
  // whatever the slot count, row or thread.
  // The pair `next` (the next this thread attends, or -1) has its keys and values prefetched
  // alongside the scores: a batch's cache outgrows the caches (8 rows of the 13m preset at 144
  // slots: 14 MB), and a pair's two blocks (D floats a slot each: 2-18 KB there) are too short for
  // the hardware prefetcher to reach full rate.
  void attention_row(int64_t l, int64_t p, int64_t next) {
    int64_t i = p / H, hh = p % H, slot = slots[i];
    const float* q = ws.qrot + i * d + hh * D;
    const float* keys = k_cache + kv_at(l, i, hh, 0);
    const float* values = v_cache + kv_at(l, i, hh, 0);
    const bool* real = key_mask + rows[i] * S;
    float* sc = ws.scores + p * S;
    float gh = ws.g[i * H + hh];
    float mx = -INFINITY;
    int64_t s = 0;
    const int64_t full = D / kLanes * kLanes;
    const char *next_keys = nullptr, *next_values = nullptr;
    int64_t next_bytes = 0, fetched = 0;
    if (next >= 0) {
      const int64_t ni = next / H, nh = next % H;
      next_keys = reinterpret_cast<const char*>(k_cache + kv_at(l, ni, nh, 0));
      next_values = reinterpret_cast<const char*>(v_cache + kv_at(l, ni, nh, 0));
      next_bytes = (slots[ni] + 1) * D * static_cast<int64_t>(sizeof(float));
    }
    auto prefetch_next = [&](int64_t upto) {  // the next pair's lines up to byte `upto` of its blocks
      for (const int64_t end = std::min(next_bytes, upto); fetched < end; fetched += 64) {
        __builtin_prefetch(next_keys + fetched, 0, 3);
        __builtin_prefetch(next_values + fetched, 0, 3);
      }
    };
    const int64_t per_four = 4 * D * static_cast<int64_t>(sizeof(float));
    for (; s + 4 <= slot + 1; s += 4) {  // four slots at a time, each <q̃, k̃_s> in dot's order
      prefetch_next(fetched + per_four);
      float four[4];
      dot4(q, keys + s * D, D, four);
      for (int u = 0; u < 4; ++u) {
        if (!real[s + u]) continue;
        float t = four[u];
        for (int64_t k = full; k < D; ++k) t += q[k] * keys[(s + u) * D + k];
        sc[s + u] = t / sqrt_d * gh;
        mx = sc[s + u] > mx ? sc[s + u] : mx;
      }
    }
    for (; s <= slot; ++s) {
      if (!real[s]) continue;
      sc[s] = dot(q, keys + s * D, D) / sqrt_d * gh;
      mx = sc[s] > mx ? sc[s] : mx;
    }
    prefetch_next(next_bytes);  // the rest, where the next pair is longer than this one
    exp_shifted(sc, slot + 1, mx);  // every slot's; the padding's are not used
    float total = 0.0f;
    for (int64_t s = 0; s <= slot; ++s)
      if (real[s]) total += sc[s];
    for (int64_t s = 0; s <= slot; ++s) sc[s] = real[s] ? sc[s] / total : 0.0f;
    float* o = ws.o + i * d + hh * D;
    int64_t j = 0;
    for (; j + 4 * kLanes <= D; j += 4 * kLanes) attend_values<4>(sc, real, slot, values + j, D, o + j);
    switch ((D - j) / kLanes) {
      case 3: attend_values<3>(sc, real, slot, values + j, D, o + j); break;
      case 2: attend_values<2>(sc, real, slot, values + j, D, o + j); break;
      case 1: attend_values<1>(sc, real, slot, values + j, D, o + j); break;
      default: break;
    }
    for (j += (D - j) / kLanes * kLanes; j < D; ++j) {
      float acc = 0.0f;
      for (int64_t s = 0; s <= slot; ++s)
        if (real[s]) acc += sc[s] * values[s * D + j];
      o[j] = acc;
    }
  }

  // h = h + y (row i of y, stride ldy); x = RMSNorm(h) γ.
  void residual_norm_row(int64_t i, const float* y, int64_t ldy, const float* gamma) {
    float* hb = ws.h + i * d;
    const float* a = y + i * ldy;
    for (int64_t j = 0; j < d; ++j) hb[j] = a[j] + hb[j];
    rms_norm(hb, gamma, ws.x + i * d, d, eps);
  }

  // The butterfly's middle: r = SiLU(a) ⊙ b + x W_bpᵀ, over a (up = [a ‖ b]), element-wise, so
  // this thread takes an equal share of all B·F elements (at batch 1 every thread has some).
  void butterfly_share(int tid, int nth) {
    const int64_t n = B * F, e0 = n * tid / nth, e1 = n * (tid + 1) / nth;
    for (int64_t e = e0; e < e1;) {
      const int64_t i = e / F, j0 = e % F, j1 = std::min(F, j0 + (e1 - e));
      float* a = ws.up + i * 2 * F;
      silu_gate_span(a + j0, a + F + j0, ws.bp + i * F + j0, a + j0, j1 - j0);
      e += j1 - j0;
    }
  }

  // One layer in the threads of the parallel region: products split by output rows, per-row
  // work split by rows, a barrier (Barrier) wherever the next part reads what other threads
  // wrote. Six would do, with every thread computing each row's norms into its own h and x and
  // the gate beside each (row, head) pair's attention: with libgomp's barriers that ran the 13m
  // step 1.00-1.06x faster on the Zen 5 VM, with these it was level (0.99-1.01x at batch 1 and 8).
  void layer(int64_t l, Barrier& bar) {
    const int tid = bar.tid, nth = bar.nth;
    const int64_t first = l * kProducts;  // this layer's first product
    for (int j = 0; j < 3; ++j) product(first + j, at(l, kWq + j), d, ws.x, d, ws.qkv + j * d, 3 * d, tid, nth);
    bar.wait();
    for (int64_t i = tid; i < B; i += nth) {
      gate_row(l, i);
      cache_write_row(l, i);
    }
    bar.wait();
    for (int64_t p = tid; p < B * H; p += nth) attention_row(l, p, p + nth < B * H ? p + nth : -1);
    bar.wait();
    product(first + 3, at(l, kWo), d, ws.o, d, ws.qkv, 3 * d, tid, nth);
    bar.wait();
    for (int64_t i = tid; i < B; i += nth) residual_norm_row(i, ws.qkv, 3 * d, vec(at(l, kFfnNorm)));
    bar.wait();
    product(first + 4, at(l, kWUp), d, ws.x, d, ws.up, 2 * F, tid, nth);
    product(first + 5, at(l, kWBp), d, ws.x, d, ws.bp, F, tid, nth);
    bar.wait();
    butterfly_share(tid, nth);
    bar.wait();
    product(first + 6, at(l, kWDown), F, ws.up, 2 * F, ws.qkv, 3 * d, tid, nth);
    bar.wait();
    // h'' = h' + y; x = RMSNorm(h'') with the next layer's γ (the final norm after the last).
    const float* next_gamma = l + 1 < L ? vec(at(l + 1, kAttnNorm)) : vec(kFinalNorm);
    for (int64_t i = tid; i < B; i += nth) residual_norm_row(i, ws.qkv, 3 * d, next_gamma);
    bar.wait();
  }

  // The tied head, logits = x Eᵀ, streamed past the last-level cache where chosen (see prefetch_block).
  void head(int tid, int nth) { product(kProducts * L, kEmbed, d, ws.x, d, logits, V, tid, nth, stream_head); }

  void layers_and_head(int tid, int nth) {
    Barrier bar{arrivals, tid, nth};
    for (int64_t l = 0; l < L; ++l) layer(l, bar);
    head(tid, nth);
  }

  void run() {
    for (int64_t i = 0; i < B; ++i) begin_row(i);
    const int nth = threads_for(matrix_bytes, bytes_per_thread);
    init_region(nth);
    int ran = 1;  // the region's thread count (OpenMP may give fewer than asked)
    parallel(nth, [this, &ran](int tid, int n) {
      if (tid == 0) ran = n;
      layers_and_head(tid, n);
    });
    for (int k = 0; k < Balance::kKinds; ++k) {
      uint64_t ticks[kBalanced] = {};
      for (int t = 0; t < ran && t < kBalanced; ++t) ticks[t] = busy[t].ticks[k];
      Balance::process().update(k, split[k], ran, ticks);
    }
    for (int64_t i = 0; i < B; ++i) n_real[rows[i]] += 1;
  }
};

template <typename T>
int decode_rows(const int64_t* n, const void* const* weights, const float* const* scales, void* const* state, int64_t B,
                const int64_t* rows, const int64_t* tokens, const int64_t* slots, float eps, float* logits,
                float* work) {
  Step<T>(n, weights, scales, state, B, rows, tokens, slots, eps, logits, work).run();
  return 0;
}

// ------------------------------------------------------------------------- the prompt's attention
// wiola.ops.decode_attention for T new tokens per row (a prompt, or a chunk of one after cached
// tokens): the T keys rotated and written with their values to slots [start, start + T) of each
// row's cache, then every query attends to the row's real slots up to its own. The PyTorch path
// runs this as a dozen ATen calls and SDPA's CPU flash attention, which at the model's small head
// dimension (32) spends most of its time outside the products; here each (row, head) pair's keys
// are transposed once, and a tile of kTileRows queries takes its scores against kKeyChunk keys at
// a time as outer products (an accumulator per query and key vector, the queries' elements
// broadcast), then its softmax and its weighted values in registers.
//
// Every number a query gets is independent of the tile it sits in, the thread and the batch: a
// score is one FMA chain over d in order (then / sqrt(D) · g, as the step), the maximum is exact,
// the exponentials are exp_nonpositive's, the sum runs in lanes fixed by the slot (slot mod
// kLanes, zeros past the query's own slot, then hsum), and its weighted values are one FMA chain
// over the slots in order, zeros (masked or later slots) adding nothing.
constexpr int kTileRows = 8;                      // queries a tile
constexpr int kKeyVecs = kLanes >= 16 ? 2 : 1;    // key vectors a step: 8 x 2 accumulators of 32 registers (AVX-512)
constexpr int64_t kKeyChunk = kKeyVecs * kLanes;  // keys a step
constexpr int kValueVecs = kLanes >= 16 ? 2 : 1;  // value vectors a pass: 8 x 2 accumulators

struct PromptAttention {
  int64_t B, T, H, D, S, start, end, Sp;  // Sp: end rounded up to kKeyChunk, the transposed keys' row length
  int64_t q0;  // the first new token whose query attends (the caller keeps the outputs of q0 .. T - 1)
  const float *q, *k, *v;                 // (B, T, H, D), element (b, t, h, j) at b·ld_b + t·ld_t + h·D + j
  int64_t ld_b, ld_t;
  const float *g, *cs, *sn;  // g (B, T, H); cos, sin (B, T, D/2)
  float *k_cache, *v_cache;  // (B, H, S, D)
  const bool* key_mask;      // (B, S)
  float* out;                // (B, T - q0, H, D)
  float* kt;                 // (B·H, Sp / kKeyChunk, D, kKeyChunk) transposed keys, one panel a key chunk
  float* scratch;            // per thread: tile_floats()
  float sqrt_d, inv_sqrt_d;

  int64_t tile_floats() const { return kTileRows * (D + Sp) + Sp; }

  // Pair p = b·H + h: its T new keys rotated into the cache, their values copied; then every key
  // in [0, end) transposed into kt (zeros past end), a panel of D x kKeyChunk contiguous floats a
  // chunk of keys, the scores' loads in the order they are read. As D rows of Sp floats, the rows
  // of a power-of-two Sp fell into two of L1's sets (an AMD EPYC Zen 5: the 13m preset's prompt
  // attention ran 1.1-1.35x slower at 512-1,000 tokens, the same numbers).
  void keys(int64_t p) {
    const int64_t b = p / H, h = p % H, half = D / 2;
    float* kc = k_cache + p * S * D;
    float* vc = v_cache + p * S * D;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t at = b * ld_b + t * ld_t + h * D, r = (b * T + t) * half;
      rope(k + at, cs + r, sn + r, kc + (start + t) * D, D);
      std::memcpy(vc + (start + t) * D, v + at, D * sizeof(float));
    }
    float* kp = kt + p * D * Sp;
    for (int64_t s0 = 0; s0 < Sp; s0 += kKeyChunk) {  // s0 < end: Sp is end rounded up
      float* panel = kp + s0 * D;
      const int64_t n = std::min<int64_t>(kKeyChunk, end - s0);
      for (int64_t j = 0; j < D; ++j) {
        float* dst = panel + j * kKeyChunk;
        for (int64_t u = 0; u < n; ++u) dst[u] = kc[(s0 + u) * D + j];
        for (int64_t u = n; u < kKeyChunk; ++u) dst[u] = 0.0f;
      }
    }
  }

  // A query's scores row[0, reach) (its slot `slot`, its gate gr) into its probabilities: scaled,
  // padding (bias -1, where bias is given) and the slots past its own at -inf, its softmax; 0 from
  // the vector past its slot to reach.
  void softmax_row(float* row, int64_t slot, int64_t reach, float gr, const float* bias) {
    // Vectors [0, used) hold the slots up to the query's own; past it a row's probabilities are 0.
    const int64_t used = (slot / kLanes + 1) * kLanes;
    const ivec lanes = lane_numbers();
    vec mx = vec{} - INFINITY, mn = vec{} + INFINITY;  // mn: the least score of a real or later slot
    for (int64_t s = 0; s < used; s += kLanes) {
      vec x = divide(load(row + s), sqrt_d, inv_sqrt_d) * gr;
      if (bias != nullptr) x = load(bias + s) < 0.0f ? vec{} - INFINITY : x;
      mn = x < mn ? x : mn;
      if (s + kLanes > slot + 1) x = lanes > static_cast<int32_t>(slot - s) ? vec{} - INFINITY : x;  // past the slot
      store(row + s, x);
      mx = x > mx ? x : mx;
    }
    float m = mx[0], least = mn[0];
    for (int l = 1; l < kLanes; ++l) {
      m = mx[l] > m ? mx[l] : m;
      least = mn[l] < least ? mn[l] : least;
    }
    if (m == -INFINITY) {  // no real key (a padding query): zeros, as the reference
      std::fill(row, row + reach, 0.0f);
      return;
    }
    vec total = {};
    for (int64_t s = 0; s < used; s += kLanes) {
      const vec e = exp_nonpositive(load(row + s) - m);
      store(row + s, e);
      total += e;
    }
    // Every exponential is +0 (masked, or under e^-87.34) or at least e^-69 > 2^-100 when no real
    // score lies more than 69 below the largest: then every vector's quotient is the division's.
    const float sum = hsum(total), inv_sum = 1.0f / sum;
    if (least - m >= -69.0f && quotient_exact(sum))
      for (int64_t s = 0; s < used; s += kLanes) store(row + s, quotient(load(row + s), sum, inv_sum));
    else
      for (int64_t s = 0; s < used; s += kLanes) store(row + s, load(row + s) / sum);
    std::fill(row + used, row + reach, 0.0f);
  }

  // Queries t0 .. t0 + n - 1 of pair p.
  void tile(int64_t p, int64_t t0, float* work) {
    const int64_t b = p / H, h = p % H, half = D / 2, n = std::min<int64_t>(kTileRows, T - t0);
    float* qt = work;                   // kTileRows x D rotated queries (zeros past n)
    float* sc = work + kTileRows * D;   // kTileRows x Sp scores, then probabilities
    float* bias = sc + kTileRows * Sp;  // Sp: 0 for a real slot, -1 for padding
    for (int64_t r = 0; r < kTileRows; ++r) {
      if (r < n) {
        const int64_t t = t0 + r, rr = (b * T + t) * half;
        rope(q + b * ld_b + t * ld_t + h * D, cs + rr, sn + rr, qt + r * D, D);
      } else {
        std::fill(qt + r * D, qt + (r + 1) * D, 0.0f);
      }
    }
    const int64_t last = start + t0 + n - 1;                  // the last query's slot
    const int64_t reach = (last / kKeyChunk + 1) * kKeyChunk;  // keys scored: [0, reach), reach <= Sp
    const float* kp = kt + p * D * Sp;
    for (int64_t s = 0; s < reach; s += kKeyChunk) {
      vec acc[kTileRows][kKeyVecs] = {};
      const float* panel = kp + s * D;
      for (int64_t j = 0; j < D; ++j) {
        vec kv[kKeyVecs];
        for (int u = 0; u < kKeyVecs; ++u) kv[u] = load(panel + j * kKeyChunk + u * kLanes);
        for (int r = 0; r < kTileRows; ++r) {
          const float x = qt[r * D + j];
          for (int u = 0; u < kKeyVecs; ++u) acc[r][u] += x * kv[u];
        }
      }
      for (int r = 0; r < kTileRows; ++r)
        for (int u = 0; u < kKeyVecs; ++u) store(sc + r * Sp + s + u * kLanes, acc[r][u]);
    }
    const bool* km = key_mask + b * S;
    const bool padded = std::memchr(km, 0, last + 1) != nullptr;
    if (padded)  // -1 marks a padding slot (whatever its cache holds, even NaN, it is never used)
      for (int64_t s = 0; s < reach; ++s) bias[s] = s <= last && km[s] ? 0.0f : -1.0f;
    for (int64_t r = 0; r < n; ++r)
      softmax_row(sc + r * Sp, start + t0 + r, reach, g[(b * T + t0 + r) * H + h], padded ? bias : nullptr);
    for (int64_t r = n; r < kTileRows; ++r) std::fill(sc + r * Sp, sc + r * Sp + reach, 0.0f);
    int64_t j = 0;
    for (; j + kValueVecs * kLanes <= D; j += kValueVecs * kLanes) values<kValueVecs>(p, b, t0, n, last, sc, j, padded);
    for (; j + kLanes <= D; j += kLanes) values<1>(p, b, t0, n, last, sc, j, padded);
    if (j < D) value_columns(p, b, t0, n, last, sc, j, padded);  // D not a multiple of kLanes
  }

  // Output columns [j0, D), fewer than kLanes: the same sums as values', a column at a time.
  void value_columns(int64_t p, int64_t b, int64_t t0, int64_t n, int64_t last, const float* sc, int64_t j0,
                     bool padded) {
    const float* vc = v_cache + p * S * D;
    const bool* km = key_mask + b * S;
    const int64_t h = p % H;
    for (int64_t r = 0; r < n; ++r) {
      float* o = out + ((b * (T - q0) + t0 - q0 + r) * H + h) * D;
      for (int64_t j = j0; j < D; ++j) {
        float acc = 0.0f;
        for (int64_t s = 0; s <= last; ++s)
          if (!padded || km[s]) acc += sc[r * Sp + s] * vc[s * D + j];
        o[j] = acc;
      }
    }
  }

  // Output columns [j, j + NV·kLanes) of the tile's queries: Σ_s p_s v_s over the real slots
  // 0 .. last in order (a later slot's p_s is 0 for an earlier query), NV vectors a query in registers.
  template <int NV>
  void values(int64_t p, int64_t b, int64_t t0, int64_t n, int64_t last, const float* sc, int64_t j, bool padded) {
    if (padded)
      values_of<NV, true>(p, b, t0, n, last, sc, j);
    else
      values_of<NV, false>(p, b, t0, n, last, sc, j);
  }

  template <int NV, bool Padded>
  void values_of(int64_t p, int64_t b, int64_t t0, int64_t n, int64_t last, const float* sc, int64_t j) {
    const float* vc = v_cache + p * S * D + j;
    const bool* km = key_mask + b * S;
    const int64_t h = p % H, ld = D;
    const float* pr[kTileRows];  // each query's probabilities: a register each, no address arithmetic a slot
    for (int r = 0; r < kTileRows; ++r) pr[r] = sc + r * Sp;
    vec acc[kTileRows][NV] = {};
    for (int64_t s = 0; s <= last; ++s) {
      if (Padded && !km[s]) continue;  // a padding slot: weight 0, its values never read
      vec vv[NV];
      for (int u = 0; u < NV; ++u) vv[u] = load(vc + s * ld + u * kLanes);
      for (int r = 0; r < kTileRows; ++r) {
        const float w = pr[r][s];
        for (int u = 0; u < NV; ++u) acc[r][u] += w * vv[u];
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      float* o = out + ((b * (T - q0) + t0 - q0 + r) * H + h) * D + j;
      for (int u = 0; u < NV; ++u) store(o + u * kLanes, acc[r][u]);
    }
  }

  void run() {
    const int64_t pairs = B * H, tiles = (T - q0 + kTileRows - 1) / kTileRows, tasks = pairs * tiles;
    const int most = omp_get_max_threads();
    const int nth = tasks >= 2 * most ? most : 1;  // a few tiles are done sooner by one thread than a region costs
    parallel(nth, [&](int tid, int nth_) {
      for (int64_t p = tid; p < pairs; p += nth_) keys(p);
#pragma omp barrier
      float* work = scratch + tid * tile_floats();
      // The longest tiles (the last queries) first, so that the short ones even out the threads.
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < tasks; ++task)
        tile(task % pairs, q0 + (tiles - 1 - task / pairs) * kTileRows, work);
    });
  }
};

// ---------------------------------------------------------------------------------------- sampling
// The sampler of wiola.generation, so that the tokens are the Python sampler's bitwise: greedy is
// the first maximal logit (torch.argmax; a NaN wins, as there); sampling divides by the temperature
// (x / float(t), as torch divides by a Python float), sets to -inf every logit below the k-th largest
// (torch.topk's k-th value, ties kept), then every logit outside the top-p nucleus (nucleus_row:
// wiola.generation.nucleus_drop's mask, each decision proven against a bound), subtracts log E (the
// caller's Exp(1) noise, its log taken by torch: the same draws and the same log as
// wiola.generation.sample_next) and takes the first maximum.
enum SampleMode { kGreedy, kSample };

// torch.argmax's choice: the first NaN if there is one, else the first maximum. One vector pass
// in kArgmaxSets interleaved sets of lanes keeps each lane's maximum with the first index holding
// it and the lane's first NaN; the lanes are merged after (the smallest index among those holding
// the maximum), the last n % (kArgmaxSets·kLanes) elements taken one by one, so the result is the
// scalar loop's, without its chain from one element to the next. (One set chained each vector's
// compare on the last: about 4.6 us a greedy step over the 13m preset's 32,000 logits on the
// Zen 5 VM.) Vocabularies of 2^31 or more go through the scalar loop.
constexpr int kArgmaxSets = 4;

inline int64_t argmax_first(const float* x, int64_t n) {
  constexpr int64_t kStride = kArgmaxSets * kLanes;
  constexpr int32_t none = INT32_MAX;
  int64_t best = 0, j = 0;
  if (n >= kStride && n < (int64_t{1} << 31)) {
    vec mx[kArgmaxSets];
    ivec at[kArgmaxSets], nan_at[kArgmaxSets];
    const ivec lane = lane_numbers();
    for (int s = 0; s < kArgmaxSets; ++s) {
      mx[s] = load(x + s * kLanes);
      at[s] = lane + s * kLanes;
      nan_at[s] = mx[s] != mx[s] ? at[s] : ivec{} + none;
    }
    for (j = kStride; j + kStride <= n; j += kStride) {
      for (int s = 0; s < kArgmaxSets; ++s) {
        const vec v = load(x + j + s * kLanes);
        const ivec here = lane + static_cast<int32_t>(j + s * kLanes);
        nan_at[s] = (v != v) & (nan_at[s] == none) ? here : nan_at[s];
        at[s] = v > mx[s] ? here : at[s];
        mx[s] = v > mx[s] ? v : mx[s];
      }
    }
    int32_t first_nan = none;
    for (int s = 0; s < kArgmaxSets; ++s)
      for (int u = 0; u < kLanes; ++u) first_nan = nan_at[s][u] < first_nan ? nan_at[s][u] : first_nan;
    if (first_nan != none) return first_nan;
    float m = mx[0][0];
    for (int s = 0; s < kArgmaxSets; ++s)
      for (int u = 0; u < kLanes; ++u) m = mx[s][u] > m ? mx[s][u] : m;
    best = n;
    for (int s = 0; s < kArgmaxSets; ++s)
      for (int u = 0; u < kLanes; ++u)
        if (mx[s][u] == m && at[s][u] < best) best = at[s][u];
  }
  for (; j < n; ++j) {
    if (std::isnan(x[j])) return j;
    if (x[j] > x[best]) best = j;
  }
  return best;
}

// A float's key in integer order: larger values, larger keys (-0.0 just below 0.0; NaN not ordered).
inline uint32_t order_key(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

// The largest of x[0, n), NaN left out (-inf where there is none); *nan set where a NaN is among them.
inline float max_and_nan(const float* x, int64_t n, bool* nan) {
  vec m = vec{} - INFINITY;
  ivec nans = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const vec v = load(x + j);
    nans |= v != v;
    m = v > m ? v : m;
  }
  float most = -INFINITY;
  for (int u = 0; u < kLanes; ++u) {
    most = m[u] > most ? m[u] : most;
    *nan |= nans[u] != 0;
  }
  for (; j < n; ++j) {
    *nan |= x[j] != x[j];
    most = x[j] > most ? x[j] : most;
  }
  return most;
}

// The k-th largest of x[0, n) counting repeats (torch.topk(x, k).values[-1]). The k-th largest of the
// maxima of 4k blocks is at most the k-th largest of x (k blocks hold an element at least that large),
// and usually few elements reach it: only those go through nth_element (a copy of all 32,000 logits
// through nth_element took 130 us a row of the 13m preset, Intel(R) Xeon(R) Processor, family 6 model
// 167). Where blocks would be shorter than a vector, or x holds a NaN (torch.topk ranks NaN above
// everything, which a > b cannot order), all of x goes through nth_element ordered as torch ranks.
// scratch: n floats.
inline float kth_largest(const float* x, int64_t n, int64_t k, float* scratch) {
  const int64_t blocks = 4 * k, width = n / blocks;
  bool nan = false;
  if (width >= kLanes) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t lo = b * width, hi = b + 1 == blocks ? n : lo + width;
      scratch[b] = max_and_nan(x + lo, hi - lo, &nan);
    }
    if (!nan) {
      const auto greater = [](float a, float c) { return a > c; };
      std::nth_element(scratch, scratch + (k - 1), scratch + blocks, greater);
      const float lower = scratch[k - 1];
      int64_t m = 0;
      for (int64_t j = 0; j < n; ++j)
        if (x[j] >= lower) scratch[m++] = x[j];
      std::nth_element(scratch, scratch + (k - 1), scratch + m, greater);
      return scratch[k - 1];
    }
  }
  uint32_t* keys = reinterpret_cast<uint32_t*>(scratch);
  for (int64_t j = 0; j < n; ++j) keys[j] = x[j] != x[j] ? 0xffffffffu : order_key(x[j]);  // NaN above +inf
  std::nth_element(keys, keys + (k - 1), keys + n, [](uint32_t a, uint32_t c) { return a > c; });
  const uint32_t bits = (keys[k - 1] & 0x80000000u) ? keys[k - 1] & 0x7fffffffu : ~keys[k - 1];
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

typedef double dvec __attribute__((vector_size(sizeof(vec))));      // half a vec's lanes, in double
typedef float hvec __attribute__((vector_size(sizeof(vec) / 2)));  // half a vec
typedef uint64_t qvec __attribute__((vector_size(sizeof(vec))));   // dvec's lanes as uint64
typedef uint16_t bvec __attribute__((vector_size(2 * kLanes)));     // a vec's lanes as uint16

// e^d lane by lane for d <= 0 in double: d = n·ln 2 + r with n the nearest integer to d·log2 e and
// |r| <= ln 2 / 2 (ln 2 in two parts, fdlibm's, so n·ln 2's first part is exact), e^r by its Taylor
// polynomial of degree 13 (remainder under 5e-18) in Estrin's order (a chain of 5 products, not 13:
// the sum over a row waits on the chain's latency), times 2^n built in the exponent bits. Within
// kExpDoubleError (tests/test_nucleus.py: every variant, a sweep of [-708, 0] against std::exp);
// 0 below -708.3 (e^d under 2^-1021), NaN for NaN.
inline dvec exp_nonpositive_double(dvec d) {
  const dvec magic = dvec{} + 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer
  const dvec t = d * 1.4426950408889634 + magic;
  const dvec n = t - magic;
  const dvec r = (d - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
  constexpr double c[14] = {1.0,           1.0,           1.0 / 2,        1.0 / 6,         1.0 / 24,
                            1.0 / 120,     1.0 / 720,     1.0 / 5040,     1.0 / 40320,     1.0 / 362880,
                            1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600, 1.0 / 6227020800};  // 1/k!
  dvec q[7];
  for (int k = 0; k < 7; ++k) q[k] = c[2 * k] + c[2 * k + 1] * r;
  const dvec r2 = r * r, r4 = r2 * r2;
  const dvec s0 = q[0] + r2 * q[1], s1 = q[2] + r2 * q[3], s2 = q[4] + r2 * q[5];
  const dvec p = (s0 + r4 * s1) + (r4 * r4) * (s2 + r4 * q[6]);
  qvec bits, magic_bits;
  std::memcpy(&bits, &t, sizeof(bits));
  std::memcpy(&magic_bits, &magic, sizeof(magic_bits));
  const qvec exponent = (bits - magic_bits + 1023) << 52;  // n's two's complement sits in t's low bits
  dvec scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  return d < -708.3 ? dvec{} : p * scale;
}

// ------------------------------------------------------------------------ the nucleus (top-p)
// wiola.generation.nucleus_drop's mask: the logits (scaled, top-k filtered) sorted in descending
// order, their float64 softmax summed in that order, and a token dropped where the ones ranked above
// it hold at least top_p of it (the first always kept). torch's float64 exp and its order of summing
// are not reproduced here; each decision is proven instead. The weight above a rank and the total are
// summed here in double, within a bound of their exact values (below); torch's float64 value of
// their ratio lies within a bound of the exact one (nucleus_torch_bound); a rank is kept or dropped
// only where that whole interval, about 1e-11 wide for 32,000 ids, lies on one side of top_p. Where
// it straddles (an exact tie with top_p: crafted logits), or where the nucleus ends inside a run of
// equal logits (which of them stay is then torch.sort's order of their ids), the caller's function
// decides: the binding's runs the reference's own nucleus_drop.
//
// The mask is "keep what is above a cut value", so only the ranks near the cut are sorted: each
// finite logit falls into a bucket of 1/32 of a unit below the maximum (the last one holding
// everything past 40), the weight of every bucket is summed, the buckets wholly inside the nucleus are
// passed at once, and a bucket the walk must enter is gathered and sorted (tens of ids). A row of
// 32,000 ids: about 55 us of the sampler's time (a top-p row 82-88 us, a row at a temperature alone
// 29-31; amx variant, Intel(R) Xeon(R) Processor, family 6 model 167), about half of it the
// exponentials; the reference took 1.8 ms.
typedef int (*NucleusCaller)(const float* x, int64_t V, double top_p, uint8_t* drop);

// How a row's nucleus was decided: none (top_p >= 1, or a NaN, +inf or only -inf among the logits:
// the reference's softmax is then NaN and drops nothing), by the bound, by the caller.
enum NucleusPath { kNucleusNone, kNucleusBound, kNucleusCaller };

constexpr int kNucleusBuckets = 1281;
constexpr float kBucketsPerUnit = 32.0f;
constexpr double kUnitDouble = 0x1p-53;
// Relative error bounds of the exponentials: exp_nonpositive_double's (2 ulps measured; 2^-48 is 32),
// torch's float64 exp (Sleef's u10 functions, 1 ulp; 2^-48 leaves room for another implementation).
constexpr double kExpDoubleError = 0x1p-48, kTorchExpError = 0x1p-48;

// A logit's bucket from d = x - max <= 0 (larger logits, lower buckets); -inf gets kNucleusBuckets,
// which the walk skips (its weight is 0 whether it is kept or not).
inline ivec nucleus_buckets(vec d) {
  const vec t = -d * kBucketsPerUnit;
  const ivec b = __builtin_convertvector(t < kNucleusBuckets - 1 ? t : vec{} + (kNucleusBuckets - 1), ivec);
  return d == -INFINITY ? ivec{} + kNucleusBuckets : b;
}

// How far torch's float64 ratio (cumsum(probs) - probs at a rank) may lie from the exact one, for V
// logits: each exp within kTorchExpError and its argument x - max rounded (2^-53 of |x - max| <= 746
// where the exp is not 0), the total summed in any order ((V - 1)·2^-53 of it), each probability one
// or two roundings from the exponential over that total, the running sum in double ((V - 1)·2^-53 of
// at most 1), the subtraction; subnormal exponentials (under 2^-1022 each) add below 2^-1000.
inline double nucleus_torch_bound(int64_t V) {
  return 4 * kTorchExpError + (6.0 * static_cast<double>(V) + 2048) * kUnitDouble + 0x1p-1000;
}

// Proven decisions at a rank with `above` (the computed weight of the ranks above it) out of `total`,
// both within `error` of their exact values, against torch's value within `torch` of the exact ratio.
struct NucleusBound {
  double total, error, torch, top_p;
  bool kept(double above) const { return (above + error) / (total - error) * (1 + 4 * kUnitDouble) + torch < top_p; }
  bool dropped(double above) const {
    return (above - error) / (total + error) * (1 - 4 * kUnitDouble) - torch >= top_p;
  }
};

// e^(x - mx) of one logit, by the function nucleus_row sums the buckets with (within the same bound).
inline double nucleus_weight(float x, double mx) {
  return exp_nonpositive_double(dvec{} + (static_cast<double>(x) - mx))[0];
}

// The ranks in descending order, from the largest logit, until the first one dropped: kWalkCut with
// *cut its logit (every finite logit <= *cut goes), kWalkKeepAll where none is, kWalkUnsure where a
// rank's interval straddles top_p, kWalkTied where the first dropped equals the last kept.
// bucket: each logit's; keys: V uint64 of scratch.
enum NucleusWalk { kWalkKeepAll, kWalkCut, kWalkUnsure, kWalkTied };

inline int nucleus_walk(const float* x, int64_t V, double mx, const uint16_t* bucket, const double* mass,
                        const NucleusBound& bound, uint64_t* keys, float* cut) {
  double above = 0.0;
  bool first = true;  // rank 0 is kept whatever the bound says (nucleus_drop keeps the first)
  for (int b = 0; b < kNucleusBuckets; ++b) {
    if (mass[b] == 0 && b < kNucleusBuckets - 1) continue;  // empty: a weight is 0 only past -708 (the last)
    if (bound.kept(above + mass[b])) {  // the bucket's last rank has less above it: all kept
      above += mass[b];
      first = false;
      continue;
    }
    int64_t n = 0;
    const auto take = [&](int64_t j) {
      if (bucket[j] == b) keys[n++] = static_cast<uint64_t>(order_key(x[j])) << 32 | static_cast<uint64_t>(j);
    };
    int64_t at = 0;
    for (; at + kLanes <= V; at += kLanes) {  // a vector of buckets at a time: few are b
      bvec here;
      std::memcpy(&here, bucket + at, sizeof(here));
      const bvec hit = here == static_cast<uint16_t>(b);
      uint64_t words[sizeof(bvec) / 8], any = 0;
      std::memcpy(words, &hit, sizeof(hit));
      for (const uint64_t word : words) any |= word;
      if (any != 0)
        for (int u = 0; u < kLanes; ++u) take(at + u);
    }
    for (; at < V; ++at) take(at);
    std::sort(keys, keys + n, [](uint64_t a, uint64_t c) { return a > c; });
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = static_cast<int64_t>(keys[i] & 0xffffffffu);
      if (!first && !bound.kept(above)) {
        if (!bound.dropped(above)) return kWalkUnsure;
        if (i > 0 && x[j] == x[keys[i - 1] & 0xffffffffu]) return kWalkTied;  // no tie across buckets
        *cut = x[j];
        return kWalkCut;
      }
      first = false;
      above += nucleus_weight(x[j], mx);
    }
  }
  return kWalkKeepAll;
}

// Sets to -inf x's tokens outside the nucleus of top_p (< 1); x: V logits, scaled and top-k filtered.
// scratch: V uint16 (each logit's bucket) and V uint64 (the walk's sort), 8-byte aligned. Returns the
// NucleusPath; kNucleusCaller (x unchanged) where the caller must decide. minus_inf (null: not
// asked): whether the reference drops the -inf logits (1), keeps them (0), or the bound cannot tell
// (-1); they rank last with the whole weight above them. Sampling need not ask: -inf stays -inf.
inline int nucleus_row(float* x, int64_t V, double top_p, uint16_t* bucket, uint64_t* keys, int* minus_inf = nullptr) {
  bool nan = false;
  const float mx = max_and_nan(x, V, &nan);
  if (nan || !std::isfinite(mx)) return kNucleusNone;  // the reference's softmax is NaN: it drops nothing
  // Each bucket's weight, e^(x - mx) in double a vector at a time (the last padded with -inf: 0), into
  // kCopies histograms in turn (shorter chains of adds to one bucket).
  constexpr int kCopies = 2;
  double mass[kCopies][kNucleusBuckets + 1] = {};
  dvec spread = {};
  const double md = mx;
  for (int64_t j = 0; j < V; j += kLanes) {
    vec v;
    if (j + kLanes <= V) {
      v = load(x + j);
    } else {
      float tail[kLanes];
      for (int u = 0; u < kLanes; ++u) tail[u] = j + u < V ? x[j + u] : -INFINITY;
      v = load(tail);
    }
    const ivec b = nucleus_buckets(v - mx);
    hvec half[2];
    std::memcpy(half, &v, sizeof(v));
    double e[kLanes];
    for (int h = 0; h < 2; ++h) {
      const dvec d = __builtin_convertvector(half[h], dvec) - md;
      const dvec w = exp_nonpositive_double(d);
      spread += w > 0 ? w * -d : dvec{};
      std::memcpy(e + h * (kLanes / 2), &w, sizeof(w));
    }
    for (int u = 0; u < kLanes; ++u) mass[u % kCopies][b[u]] += e[u];
    if (j + kLanes <= V) {
      const bvec narrow = __builtin_convertvector(b, bvec);
      std::memcpy(bucket + j, &narrow, sizeof(narrow));
    } else {
      for (int u = 0; j + u < V; ++u) bucket[j + u] = static_cast<uint16_t>(b[u]);
    }
  }
  double total = 0.0, spread_sum = 0.0;
  for (int b = 0; b < kNucleusBuckets; ++b) {
    for (int c = 1; c < kCopies; ++c) mass[0][b] += mass[c][b];
    total += mass[0][b];
  }
  for (int u = 0; u < kLanes / 2; ++u) spread_sum += spread[u];
  // Each weight within (kExpDoubleError + 2^-53·|x - mx|) of e^(x - mx) (its argument rounded to
  // double), 0 only below e^-708.3 (< 2^-1021); the double sums within (4V + 4096)·2^-53 of the total.
  const double n = static_cast<double>(V);
  const double error = 1.1 * (kExpDoubleError * total + kUnitDouble * spread_sum) + n * 0x1p-1020 +
                       (4 * n + 4096) * kUnitDouble * total;
  float cut = 0.0f;
  const NucleusBound bound{total, error, nucleus_torch_bound(V), top_p};
  const int walk = nucleus_walk(x, V, md, bucket, mass[0], bound, keys, &cut);
  if (walk == kWalkUnsure || walk == kWalkTied) return kNucleusCaller;
  if (minus_inf != nullptr) *minus_inf = walk == kWalkCut || bound.dropped(total) ? 1 : bound.kept(total) ? 0 : -1;
  if (walk == kWalkCut)
    for (int64_t j = 0; j < V; ++j)
      if (x[j] <= cut) x[j] = -INFINITY;
  return kNucleusBound;
}

// x = logits / temperature with every logit below the k-th largest -inf (filter_logits' top-k).
// False where a logit / temperature passes float32 (a temperature of 1e-40: a positive logit to +inf,
// or, where every logit is negative, every one to -inf): the argmax then, the distribution's limit.
// scratch: V floats.
inline bool scaled_row(const float* logits, int64_t V, float temperature, int64_t top_k, float* x, float* scratch) {
  ivec positive_inf = {}, finite_or_nan = {};  // lanes' flags: a vector at a time, no chain per element
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes) {
    const vec v = load(logits + j) / temperature;  // a division per lane, rounded as torch's
    store(x + j, v);
    positive_inf |= v == INFINITY;
    finite_or_nan |= v != -INFINITY;
  }
  bool overflow = false, all_negative_inf = true;
  for (int u = 0; u < kLanes; ++u) {
    overflow |= positive_inf[u] != 0;
    all_negative_inf &= finite_or_nan[u] == 0;
  }
  for (; j < V; ++j) {
    x[j] = logits[j] / temperature;
    overflow |= x[j] == INFINITY;
    all_negative_inf &= x[j] == -INFINITY;
  }
  if (overflow || all_negative_inf) return false;
  if (top_k > 0 && top_k < V) {
    float kth = kth_largest(x, V, top_k, scratch);
    for (int64_t j = 0; j < V; ++j)
      if (x[j] < kth) x[j] = -INFINITY;
  }
  return true;
}

// The exponential race: the first maximum of x - log E (x overwritten).
inline int64_t race(float* x, int64_t V, const float* log_noise) {
  for (int64_t j = 0; j < V; ++j) x[j] = x[j] - log_noise[j];
  return argmax_first(x, V);
}

// One row's token, or -1 where its nucleus falls to the caller (sample_rows then asks it). top_p >= 1:
// none. *path: the NucleusPath. scratch: 4V floats.
inline int64_t sample_row(const float* logits, int64_t V, int64_t mode, float temperature, int64_t top_k,
                          double top_p, const float* log_noise, float* scratch, int64_t* path) {
  *path = kNucleusNone;
  if (mode == kGreedy) return argmax_first(logits, V);
  float* x = scratch;
  if (!scaled_row(logits, V, temperature, top_k, x, scratch + V)) return argmax_first(logits, V);
  if (top_p < 1.0) {
    *path = nucleus_row(x, V, top_p, reinterpret_cast<uint16_t*>(scratch + V), reinterpret_cast<uint64_t*>(scratch + 2 * V));
    if (*path == kNucleusCaller) return -1;
  }
  return race(x, V, log_noise);
}

// log-softmax of the unfiltered logits at `token` and the k best (id, log-probability), best
// first (ties: the lower id first). The exponentials are the attention softmax's exp_nonpositive
// (at most 7.9e-8 relative error each; 0 below e^-87.3, which cannot move a sum of at least 1), the
// last vector padded with -inf (exponential 0), summed in double half a vector's lanes at a time. A
// greedy row of 32,000 ids with its logprob took 156 us through the scalar std::exp in double (a
// fifth of a 13m bf16 step at batch 1), 19 us so (Intel(R) Xeon(R) Processor, family 6 model 167,
// amx/avx512 variants; avx2 172 -> 31 us, portable 171 -> 62).
inline void logprobs_row(const float* logits, int64_t V, int64_t token, int64_t k, float* logprob, int64_t* top_ids,
                         float* top_values, int64_t* order) {
  float mx = -INFINITY;
  vec m = vec{} - INFINITY;
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes) {
    const vec v = load(logits + j);
    m = v > m ? v : m;  // a NaN is never the max, as below
  }
  for (int u = 0; u < kLanes; ++u) mx = m[u] > mx ? m[u] : mx;
  for (; j < V; ++j) mx = logits[j] > mx ? logits[j] : mx;
  dvec sums = {};
  const auto add = [&](vec v) {
    const vec e = exp_nonpositive(v - mx);
    hvec half[2];
    std::memcpy(half, &e, sizeof(e));
    sums += __builtin_convertvector(half[0], dvec) + __builtin_convertvector(half[1], dvec);
  };
  for (j = 0; j + kLanes <= V; j += kLanes) add(load(logits + j));
  if (j < V) {
    float tail[kLanes];
    for (int u = 0; u < kLanes; ++u) tail[u] = j + u < V ? logits[j + u] : -INFINITY;
    add(load(tail));
  }
  double total = 0.0;
  for (int u = 0; u < kLanes / 2; ++u) total += sums[u];
  const double lse = static_cast<double>(mx) + std::log(total);
  *logprob = static_cast<float>(logits[token] - lse);
  if (k <= 0) return;
  for (int64_t j = 0; j < V; ++j) order[j] = j;
  auto better = [logits](int64_t a, int64_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(order, order + k, order + V, better);
  for (int64_t j = 0; j < k; ++j) {
    top_ids[j] = order[j];
    top_values[j] = static_cast<float>(logits[order[j]] - lse);
  }
}

// Per-row sampler settings and outputs of one call (arrays of B; log_noise B x V, rows of kGreedy
// ignored; top_p null: no nucleus; top_ids/top_values B x max_k; logprob null: none computed; path
// null: not reported). caller: where a nucleus is left to it (nucleus_row), null: such a row's token is -1.
struct Samplers {
  const int64_t* mode;
  const float* temperature;
  const int64_t* top_k;
  const double* top_p;
  const float* log_noise;
  const int64_t* n_logprobs;
  int64_t max_k;
  NucleusCaller caller;
  int64_t* token;
  float* logprob;
  int64_t* top_ids;
  float* top_values;
  int64_t* path;
};

// Every row's token (and log-probabilities), rows split between threads; a row whose nucleus falls to
// the caller is finished after, on this thread (the binding's caller is Python's). scratch: the
// threads' 4V floats each (sample_scratch_floats). Returns how many rows got no token (-1): a caller
// that failed or was absent.
inline int64_t sample_rows(const float* logits, int64_t B, int64_t V, const Samplers& s, float* scratch) {
  int nt = threads_for(B * V * static_cast<int64_t>(sizeof(float)) * 16);  // ~16 passes over the logits
  const auto top_p = [&s](int64_t i) { return s.top_p == nullptr ? 1.0 : s.top_p[i]; };
  const auto logprobs = [&](int64_t i, float* mine) {
    if (s.logprob != nullptr)
      logprobs_row(logits + i * V, V, s.token[i], s.n_logprobs[i], s.logprob + i, s.top_ids + i * s.max_k,
                   s.top_values + i * s.max_k, reinterpret_cast<int64_t*>(mine + 2 * V));
  };
  parallel(nt < B ? nt : static_cast<int>(B), [&](int tid, int nth) {
    float* mine = scratch + tid * 4 * V;
    for (int64_t i = tid; i < B; i += nth) {
      int64_t path;
      s.token[i] = sample_row(logits + i * V, V, s.mode[i], s.temperature[i], s.top_k[i], top_p(i),
                              s.log_noise + i * V, mine, &path);
      if (s.path != nullptr) s.path[i] = path;
      if (s.token[i] >= 0) logprobs(i, mine);
    }
  });
  int64_t missing = 0;
  for (int64_t i = 0; i < B; ++i) {
    if (s.token[i] >= 0) continue;
    float* x = scratch;
    uint8_t* drop = reinterpret_cast<uint8_t*>(scratch + V);
    scaled_row(logits + i * V, V, s.temperature[i], s.top_k[i], x, scratch + V);
    if (s.caller == nullptr || s.caller(x, V, top_p(i), drop) != 0) {
      missing += 1;
      continue;
    }
    for (int64_t j = 0; j < V; ++j)
      if (drop[j]) x[j] = -INFINITY;
    s.token[i] = race(x, V, s.log_noise + i * V);
    logprobs(i, scratch);
  }
  return missing;
}

// ---- Exp(1) noise drawn as torch's CPU exponential_ draws it, from the same generator state ----
// torch's exponential_ (ATen's exponential_kernel: at::exponential_distribution<double>, one value at
// a time in tensor order) makes each value from two outputs a, b of the generator's MT19937
// (at::mt19937): u = ((a·2^32 + b) mod 2^53)·2^-53, the value float(-1.0 · log1p(-u)) through glibc's
// scalar log1p. A sampled row draws V of them each token: 500 us for 32,000 ids (Intel(R) Xeon(R)
// Processor, family 6 model 167), most of a 13m step. Here the same values from the same state: the
// MT19937 refilled and tempered a vector of words at a time; -log(1 - u) (1 - u is exact: a multiple
// of 2^-53 in (0, 1]) by fdlibm's log in double a vector at a time (a few ulp); where that double
// lies within 2^-40 (relative) of a float's rounding boundary, and only there, glibc's value (also
// within 1 ulp of -log1p(-u)) could round to another float, so the value is made again by
// std::log1p exactly as torch makes it (u = 0 too: its sign of zero). wiola/fast/decode_step_cpu.py
// checks the whole against torch's own draws once a process and keeps torch's where they differ.
constexpr int kMtN = 624, kMtM = 397;
// Where torch's CPUGeneratorImplState (get_state()'s bytes) keeps the engine's position and words.
constexpr int64_t kGenBytes = 5056, kGenLeft = 8, kGenNext = 16, kGenWords = 24;

inline uint32_t mt_twist(uint32_t u, uint32_t v) {
  return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}
inline uvec mt_twist(uvec u, uvec v) {
  return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((0u - (v & 1u)) & 0x9908b0dfu);
}
inline uvec load_words(const uint32_t* p) {
  uvec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store_words(uint32_t* p, uvec v) { std::memcpy(p, &v, sizeof(v)); }

// at::mt19937's next_state(): the 624 words anew. Each vector reads the words it replaces and the
// next ones before it writes (originals), and words 227 behind (already new): as the scalar order.
inline void mt_refill(uint32_t* p) {
  int i = 0;
  for (; i + kLanes <= kMtN - kMtM; i += kLanes)
    store_words(p + i, load_words(p + i + kMtM) ^ mt_twist(load_words(p + i), load_words(p + i + 1)));
  for (; i < kMtN - kMtM; ++i) p[i] = p[i + kMtM] ^ mt_twist(p[i], p[i + 1]);
  for (; i + kLanes <= kMtN - 1; i += kLanes)
    store_words(p + i, load_words(p + i + kMtM - kMtN) ^ mt_twist(load_words(p + i), load_words(p + i + 1)));
  for (; i < kMtN - 1; ++i) p[i] = p[i + kMtM - kMtN] ^ mt_twist(p[i], p[i + 1]);
  p[kMtN - 1] = p[kMtM - 1] ^ mt_twist(p[kMtN - 1], p[0]);
}

template <typename W>  // uint32_t or uvec
inline W mt_temper(W y) {
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  return y ^ (y >> 18);
}

// torch's at::mt19937 as get_state() lays it out: `left` counts down to the next refill (left - 1
// outputs remain before it), `next` indexes the words.
struct TorchMT {
  uint32_t words[kMtN];
  int64_t left, next;

  // False for a position out of range (then nothing is read past the words).
  bool read(const uint8_t* state) {
    int32_t left32;
    uint64_t next64;
    std::memcpy(&left32, state + kGenLeft, sizeof(left32));
    std::memcpy(&next64, state + kGenNext, sizeof(next64));
    if (left32 < 1 || next64 > static_cast<uint64_t>(kMtN) || static_cast<int64_t>(next64) + left32 - 1 > kMtN)
      return false;
    left = left32, next = static_cast<int64_t>(next64);
    for (int i = 0; i < kMtN; ++i) {
      uint64_t w;
      std::memcpy(&w, state + kGenWords + 8 * i, sizeof(w));
      words[i] = static_cast<uint32_t>(w);
    }
    return true;
  }

  void write(uint8_t* state) const {
    for (int i = 0; i < kMtN; ++i) {
      const uint64_t w = words[i];
      std::memcpy(state + kGenWords + 8 * i, &w, sizeof(w));
    }
    const int32_t left32 = static_cast<int32_t>(left);
    const uint64_t next64 = static_cast<uint64_t>(next);
    std::memcpy(state + kGenLeft, &left32, sizeof(left32));
    std::memcpy(state + kGenNext, &next64, sizeof(next64));
  }

  // n outputs into out (null: skipped), as n calls of at::mt19937::operator().
  void draw(uint32_t* out, int64_t n) {
    while (n > 0) {
      if (left == 1) {
        mt_refill(words);
        left = kMtN + 1, next = 0;
      }
      const int64_t k = std::min(left - 1, n);
      if (out != nullptr) {
        int64_t j = 0;
        for (; j + kLanes <= k; j += kLanes) store_words(out + j, mt_temper(load_words(words + next + j)));
        for (; j < k; ++j) out[j] = mt_temper(words[next + j]);
        out += k;
      }
      left -= k, next += k, n -= k;
    }
  }
  void skip(int64_t n) { draw(nullptr, n); }
};

// The double of each lane of x < 2^52: 2^52 + x has x for its low bits.
inline dvec exact_double(qvec x) {
  const qvec bits = x | 0x4330000000000000ull;
  dvec d;
  std::memcpy(&d, &bits, sizeof(d));
  return d - 4503599627370496.0;
}

// -log(v) for v in [2^-53, 1], lane by lane: fdlibm's e_log.c (v = 2^k·(1 + f), 1 + f in
// [√2/2, √2), s = f/(2 + f), log(1 + f) = f - s·(f - R(s²)) with its minimax R), a few ulp.
inline dvec minus_log(dvec v) {
  qvec bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const qvec hi = bits >> 32;
  const qvec m = hi & 0x000fffffu;
  const qvec i = (m + 0x95f64u) & 0x100000u;  // 1 << 20 where the mantissa is past √2: halve it
  const qvec k = ((hi >> 20) & 0x7ffu) + (i >> 20) + 1;  // the exponent + 1024: 971..1024
  const qvec fbits = ((m | (i ^ 0x3ff00000u)) << 32) | (bits & 0xffffffffu);
  dvec f;
  std::memcpy(&f, &fbits, sizeof(f));
  f -= 1.0;
  const dvec dk = exact_double(k) - 1024.0;
  const dvec s = f / (2.0 + f), z = s * s, w = z * z;
  const dvec t1 = w * (3.999999999940941908e-01 + w * (2.222219843214978396e-01 + w * 1.531383769920937332e-01));
  const dvec t2 = z * (6.666666666666735130e-01 +
                       w * (2.857142874366239149e-01 + w * (1.818357216161805012e-01 + w * 1.479819860511658591e-01)));
  const dvec R = t1 + t2;
  return -(dk * 6.93147180369123816490e-01 - ((s * (f - R) - dk * 1.90821492927058770002e-10) - f));
}

// All ones where r's float could differ from that of a double within 2^-40 (relative) of r: the 29
// bits a rounding to float drops are within 2^13 of r's ulps (each at least 2^-53·r, so 2^13 of them
// at least 2^-40·r) of half of 2^29, the midpoint between two floats; or r is 0 (its sign is torch's
// -1.0 · log1p(-0.0)).
inline qvec near_midpoint(dvec r) {
  qvec bits;
  std::memcpy(&bits, &r, sizeof(bits));
  return (qvec)(((bits & 0x1fffffffu) - (0x10000000u - 0x2000u)) < 0x4000u) | (qvec)((bits << 1) == 0);
}

inline bool any_lane(qvec m) {
#if defined(WIOLA_ISA_AVX512)
  return _mm512_test_epi64_mask((__m512i)m, (__m512i)m) != 0;
#else
  uint64_t any = 0;
  for (int t = 0; t < static_cast<int>(sizeof(m) / 8); ++t) any |= m[t];
  return any != 0;
#endif
}

// n Exp(1) values into out from mt, as torch's exponential_ makes them (above). Returns how many
// values took std::log1p for the rounding check.
inline int64_t exponential(TorchMT& mt, int64_t n, float* out) {
  constexpr int kD = kLanes / 2, kChunk = 1024;  // doubles a vector; values a pass
  alignas(64) uint32_t drawn[2 * kChunk];
  int64_t redone = 0;
  for (int64_t at = 0; at < n; at += kChunk) {
    const int64_t c = std::min<int64_t>(kChunk, n - at);
    mt.draw(drawn, 2 * c);
    int64_t j = 0;
    for (; j + kD <= c; j += kD) {
      qvec pairs;  // lane t: b << 32 | a, the t-th value's two outputs as they lie in memory
      std::memcpy(&pairs, drawn + 2 * j, sizeof(pairs));
      const dvec u = (exact_double(pairs & 0x1fffffu) * 4294967296.0 + exact_double(pairs >> 32)) * 0x1p-53;
      const dvec r = minus_log(1.0 - u);
      const hvec value = __builtin_convertvector(r, hvec);
      float* o = out + at + j;
      std::memcpy(o, &value, sizeof(value));
      const qvec near = near_midpoint(r);
      if (__builtin_expect(!any_lane(near), 1)) continue;
      for (int t = 0; t < kD; ++t)
        if (near[t] != 0) {
          o[t] = static_cast<float>(-1.0 * std::log1p(-u[t]));
          ++redone;
        }
    }
    for (; j < c; ++j) {
      const uint64_t bits = (static_cast<uint64_t>(drawn[2 * j]) << 32 | drawn[2 * j + 1]) & ((1ull << 53) - 1);
      out[at + j] = static_cast<float>(-1.0 * std::log1p(-(static_cast<double>(bits) * 0x1p-53)));
    }
  }
  return redone;
}

// n Exp(1) values of one stream into out on nth threads, the same values as exponential (a
// value's bits do not depend on where a pass starts), mt left where exponential leaves it. Thread
// t takes the values from cut[t]: it copies mt and skips the 2·cut[t] outputs before them, which
// costs only the refills of the words they span (kSkipCost of making the values), then makes its
// own. Each thread reads nothing another writes, so no words cross between cores (words refilled
// by one thread and tempered by another ran the other thread 1.65x slower a value on the Intel
// Xeon VM, model 167). The cuts leave each thread the same work: thread t takes T - kSkipCost·cut[t].
constexpr double kSkipCost = 0.12;
constexpr int64_t kSharedValues = 1 << 14;  // one stream's values from which the threads share them
inline int64_t exponential_shared(TorchMT& mt, int64_t n, float* out, int nth) {
  std::atomic<int64_t> redone{0};
  TorchMT end;
  parallel(nth, [&](int tid, int threads) {
    double at = 0.0, width = 0.0, unit = 0.0;  // unit: the sum of the shares for T = 1
    for (int t = 0; t < threads; ++t) unit += std::max(0.0, 1.0 - kSkipCost * unit);
    const double T = static_cast<double>(n) / unit;
    for (int t = 0; t <= tid; ++t) {
      at += width;
      width = std::max(0.0, T - kSkipCost * at);
    }
    const int64_t a = std::min(n, static_cast<int64_t>(at));
    const int64_t b = tid + 1 == threads ? n : std::min(n, static_cast<int64_t>(at + width));
    TorchMT own = mt;
    own.skip(2 * a);
    redone += exponential(own, b - a, out + a);
    if (tid + 1 == threads) end = own;
  });
  mt = end;
  return redone;
}

// Row r of out (rows, n) drawn from generator state states[job[r]]; a state's rows in row order
// (one stream, as a draw of its rows one after another), the states on separate threads. Every
// state is read before any is written: -1 (nothing written) where one's position is out of range.
inline int64_t exponential_rows(uint8_t* const* states, int64_t jobs, const int64_t* job, int64_t rows, int64_t n,
                                float* out) {
  std::unique_ptr<TorchMT[]> mts(new TorchMT[jobs]);
  for (int64_t j = 0; j < jobs; ++j)
    if (!mts[j].read(states[j])) return -1;
  const int most = omp_get_max_threads();
  if (jobs == 1 && most > 1 && rows * n >= kSharedValues) {  // one stream: its values shared by the threads
    const int64_t redone = exponential_shared(mts[0], rows * n, out, most);
    mts[0].write(states[0]);
    return redone;
  }
  std::atomic<int64_t> redone{0};
  const int threads = jobs < 2 || rows * n < (1 << 14) ? 1 : jobs < most ? static_cast<int>(jobs) : most;
  parallel(threads, [&](int tid, int nth) {
    for (int64_t j = tid; j < jobs; j += nth) {
      int64_t mine = 0;
      for (int64_t r = 0; r < rows; ++r)
        if (job[r] == j) mine += exponential(mts[j], n, out + r * n);
      mts[j].write(states[j]);
      redone += mine;
    }
  });
  return redone;
}

// ---- the prompt's element-wise parts: RMSNorm after the residual add, the butterfly's middle ----
// Each row of d (or F) floats is one independent piece of work: its numbers do not depend on the
// number of rows, the thread count or the split. Rows go to the threads in contiguous ranges; a
// region of threads opens only where every thread gets at least kRowsWorkPerThread elements.
constexpr int64_t kRowsWorkPerThread = 1 << 15;
inline int threads_for_rows(int64_t rows, int64_t width) {
  const int most = omp_get_max_threads();
  return rows * width >= kRowsWorkPerThread * most && rows >= most ? most : 1;
}

// h = x (+ residual), out = rms_norm(h) row by row: the step's rms_norm, so a prompt's norms equal
// the step's for the same h.
inline void rms_norm_rows(const float* x, const float* residual, const float* gamma, float eps, float* out,
                          float* h, int64_t rows, int64_t d) {
  parallel(threads_for_rows(rows, d), [&](int tid, int nth) {
    for (int64_t r = rows * tid / nth; r < rows * (tid + 1) / nth; ++r) {
      const float* xr = x + r * d;
      if (residual != nullptr) {
        float* hr = h + r * d;
        for (int64_t i = 0; i < d; ++i) hr[i] = xr[i] + residual[r * d + i];
        xr = hr;
      }
      rms_norm(xr, gamma, out + r * d, d, eps);
    }
  });
}

// out = SiLU(a) ⊙ b + c row by row, with [a ‖ b] a row of up (2F floats) and c a row of bp (F).
inline void silu_gate_rows(const float* up, const float* bp, float* out, int64_t rows, int64_t F) {
  parallel(threads_for_rows(rows, F), [&](int tid, int nth) {
    for (int64_t r = rows * tid / nth; r < rows * (tid + 1) / nth; ++r) {
      const float* a = up + r * 2 * F;
      silu_gate_span(a, a + F, bp + r * F, out + r * F, F);
    }
  });
}

// The products' own rate, for the benchmarks' compute floor (wiola.fast.speed.product_floor):
// `reps` times y = x Wᵀ over all N rows of one (N, K) matrix of weight type n[kWeightType] (scale
// as the step's: per row for int8, per group for int4, null otherwise; n[kPrefetchRows] ahead),
// for x (B, K), on each of `nth` threads at once, thread t writing its own y + t·B·N ((B, N)).
// Every thread reads the whole matrix: small enough, it stays in each core's cache, and the time is
// that of the kernels' multiply-adds (and widening), not of reading the weights. Returns 0, 1 for
// an unknown weight type, 2 for an int4 group this build was not compiled for.
template <typename T>
void product_reps(const int64_t* n, const void* W, const float* scale, int64_t N, int64_t K, const float* x, int64_t B,
                  float* y, int64_t reps, int nth) {
  parallel(nth, [&](int tid, int) {
    const Split alone;  // one thread's share: all N rows
    for (int64_t i = 0; i < reps; ++i)
      share_product(alone, static_cast<const T*>(W), scale, N, K, x, K, y + tid * B * N, N, B, 0, 1, false,
                    n[kPrefetchRows]);
  });
}

// The variant's multiply-add peak, for the benchmarks (wiola.fast.speed.fma_peak): `reps` rounds of
// C independent chains acc = madd(acc, a, b) of kLanes lanes each, on each of `nth` threads at once,
// reading no memory. With as many chains as the multiply-add's latency times its pipes (8 on the
// x86 cores measured; wider ARM cores want more) this is the rate at which the variant issues
// fp32 multiply-adds, a ceiling for every product of the step (each multiplies a weight by x
// with one madd). GCC keeps the chains in registers (an empty asm pinning each one made it keep the
// array on the stack: a store and a load per madd, half the rate on the Zen 5 EPYC); past the
// register file they spill, so the caller takes the best of several C. a and b keep the chains
// near b / (1 - a) = 0.1, never denormal. out[t]: thread t's sum of its chains (kept, so that no
// chain is dropped).
template <int C>
void fma_chains(int64_t reps, int nth, float* out) {
  parallel(nth, [&](int tid, int) {
    const vec a = vec{} + 0.999999f, b = vec{} + 1e-7f;
    vec acc[C];
    for (int c = 0; c < C; ++c) acc[c] = vec{} + static_cast<float>(c + tid);
    for (int64_t r = 0; r < reps; ++r) {
#pragma GCC unroll 32
      for (int c = 0; c < C; ++c) acc[c] = madd(acc[c], a, b);
    }
    vec s = {};
    for (int c = 0; c < C; ++c) s += acc[c];
    out[tid] = hsum(s);
  });
}

// wiola.ops.gate over T positions of each of B rows with the parts the step's gate_position runs at
// one: every position's head mean of the query (rotated by the position's cos and sin where given:
// the gate after RoPE), shared between the threads; then each row's running sum over its real
// positions in order (mask null: every position) and the mean so far (0 before any); then every
// position's MLP, shared between the threads. n: B, T, H, D,
// ld_b, ld_t (q's batch and token strides; head stride D, unit element stride). run (B, D) and count
// (B,) hold the carried sum and count on entry and the new ones on return; g (B, T, H). cos and sin
// (B, T, D/2), mask (B, T) bytes: contiguous. Each row's numbers are its own, whatever B or thread.
inline void gate_rows(const int64_t* n, const float* q, const float* w1, const float* w2, const float* b2,
                      const float* cos, const float* sin, const uint8_t* mask, float* run, int64_t* count, float* g) {
  const int64_t B = n[0], T = n[1], H = n[2], D = n[3], ld_b = n[4], ld_t = n[5], half = D / 2, P = B * T;
  std::unique_ptr<float[]> means(new float[P * D]);  // each position's head mean, then its c
  float* m = means.get();
  parallel(threads_for_rows(P, D * H), [&](int tid, int nth) {
    for (int64_t at = P * tid / nth; at < P * (tid + 1) / nth; ++at) {
      const int64_t b = at / T, t = at % T;
      gate_mean(q + b * ld_b + t * ld_t, H, D, cos == nullptr ? nullptr : cos + at * half,
                sin == nullptr ? nullptr : sin + at * half, m + at * D);
    }
#pragma omp barrier
    for (int64_t b = B * tid / nth; b < B * (tid + 1) / nth; ++b)  // the running sums: a row's in order
      for (int64_t t = 0; t < T; ++t) {
        float* c = m + (b * T + t) * D;
        gate_sum(c, D, mask == nullptr || mask[b * T + t] != 0, run + b * D, count[b], c);
      }
#pragma omp barrier
    for (int64_t at = P * tid / nth; at < P * (tid + 1) / nth; ++at) gate_mlp(m + at * D, H, D, w1, w2, b2, g + at * H);
  });
}

// y (B, N) = x (B, K) · Wᵀ for an fp32 (N, K) row-major matrix W, by the step's own product
// (share_product): each output is the same operations in the same order whatever B, the thread count
// or the thread that computes it, so a row's numbers never depend on the rows beside it. W's rows are
// shared evenly among the threads (one where the product is small: no result depends on the count),
// `ahead` rows prefetched. The fast model's CPU products of at most 64 positions a sequence run here
// (wiola.ops.linear), so that a prompt row's logits are the same alone and in a batch.
inline void product_rows(const float* W, int64_t N, int64_t K, const float* x, int64_t B, float* y, int64_t ahead) {
  const int most = omp_get_max_threads();
  const int nth = N * K * B >= kRowsWorkPerThread * 16 * most && N >= 4 * most ? most : 1;
  parallel(nth, [&](int tid, int n) {
    Split even;
    even.nth = 0;  // no learned cuts: even shares
    share_product(even, W, nullptr, N, K, x, K, y, N, B, tid, n, false, ahead);
  });
}

}  // namespace

extern "C" {

int64_t wiola_workspace_floats(const int64_t* n) { return Workspace::floats(n); }

// rows x n Exp(1) values into out (rows, n) fp32, row r drawn as torch's CPU exponential_ draws
// from the generator whose state (get_state()'s bytes, state_bytes each) is states[job[r]], each
// state advanced in place as torch's draws of its rows, in row order, would leave it
// (exponential_rows). Returns how many values took the scalar log1p, -1 for a state's position out
// of range, -2 for a state of another size, a job out of [0, jobs) or a negative count.
int64_t wiola_exponential(uint8_t* const* states, int64_t state_bytes, int64_t jobs, const int64_t* job, int64_t rows,
                          int64_t n, float* out) {
  if (state_bytes != kGenBytes || jobs < 0 || rows < 0 || n < 0) return -2;
  for (int64_t r = 0; r < rows; ++r)
    if (job[r] < 0 || job[r] >= jobs) return -2;
  return exponential_rows(states, jobs, job, rows, n, out);
}

int64_t wiola_q4_group() { return kQ4Group; }

// Balance (the threads' parts of each product's rows): the parts of kind `kind` (0: the layers'
// products, 1: the head) for n threads, read into parts[0..n) or, with `set`, written from them
// (0 everywhere: not yet measured, even cuts). Returns 0, or 1 for a kind or count it does not
// keep (n outside 2..kBalanced).
int wiola_balance_parts(int64_t kind, int64_t n, float* parts, int64_t set) {
  if (kind < 0 || kind >= Balance::kKinds || n < 2 || n > kBalanced) return 1;
  Balance& b = Balance::process();
  for (int64_t t = 0; t < n; ++t) {
    if (set)
      b.part[kind][n][t].store(parts[t], std::memory_order_relaxed);
    else
      parts[t] = b.part[kind][n][t].load(std::memory_order_relaxed);
  }
  return 0;
}

// Balance's rule on its own: n threads' next parts (into next) from their parts `was` (0: not yet
// measured) and the ticks each spent on its rows between cut[t] and cut[t + 1] (n + 1 fractions,
// 0 to 1) in one step. Returns 1 when the step counts, else 0 (next untouched).
int wiola_balance_next(int64_t n, const float* was, const double* cut, const uint64_t* ticks, float* next) {
  if (n < 2 || n > kBalanced) return 0;
  Split cuts;
  cuts.nth = static_cast<int>(n);
  for (int64_t t = 0; t <= n; ++t) cuts.cut[t] = cut[t];
  return Balance::next_parts(static_cast<int>(n), was, cuts, ticks, next) ? 1 : 0;
}

// The lengths of the argument arrays, for the Python table to be checked against: dims, global
// weight slots, weight slots per layer, cache buffers.
void wiola_layout_counts(int64_t* out) {
  out[0] = kNumDims;
  out[1] = kNumGlobal;
  out[2] = kPerLayer;
  out[3] = kNumState;
}

// dims: kNumDims int64 (see Dim; kB the cache's rows R, kWeightType a WeightType). weights:
// kNumGlobal + L·kPerLayer pointers: the embedding and the seven projection matrices of each layer
// of that weight type, every other one fp32 (gate ones may be null without a gate). scales: as
// many pointers, the fp32 per-row scales of each int8 matrix, or the (N, K/kGroup) group scales of
// each int4 one (null elsewhere). state: the cache's
// buffers (k, v (L,R,H,S,D) fp32; key_mask (R,S) bool; gate_sum (L,R,D) fp32; gate_count (L,R)
// int64; n_real (R,) int64). B active rows: rows (B,) distinct cache rows, tokens (B,) ids in range,
// slots (B,) each row's new slot (< S). logits: (B, V) out. work: wiola_workspace_floats. The
// caller has checked every shape, dtype and range. Returns 0, 1 for an unknown weight type, 2 for
// an int4 group this build was not compiled for.
int wiola_decode_rows(const int64_t* n, const void* const* weights, const float* const* scales, void* const* state,
                      int64_t B, const int64_t* rows, const int64_t* tokens, const int64_t* slots, float eps,
                      float* logits, float* work) {
  switch (n[kWeightType]) {
    case kFp32: return decode_rows<float>(n, weights, scales, state, B, rows, tokens, slots, eps, logits, work);
    case kBf16: return decode_rows<bf16>(n, weights, scales, state, B, rows, tokens, slots, eps, logits, work);
    case kInt8: return decode_rows<int8_t>(n, weights, scales, state, B, rows, tokens, slots, eps, logits, work);
    case kInt4:  // the group is compiled in; K % group == 0 checked by the caller
      return n[kGroup] == kQ4Group ? decode_rows<q4>(n, weights, scales, state, B, rows, tokens, slots, eps, logits, work) : 2;
    default: return 1;
  }
}

// product_reps (above) of the weight type n[kWeightType].
int wiola_product_reps(const int64_t* n, const void* W, const float* scale, int64_t N, int64_t K, const float* x,
                       int64_t B, float* y, int64_t reps, int64_t nth) {
  const int threads = static_cast<int>(nth);
  switch (n[kWeightType]) {
    case kFp32: product_reps<float>(n, W, scale, N, K, x, B, y, reps, threads); return 0;
    case kBf16: product_reps<bf16>(n, W, scale, N, K, x, B, y, reps, threads); return 0;
    case kInt8: product_reps<int8_t>(n, W, scale, N, K, x, B, y, reps, threads); return 0;
    case kInt4:
      if (n[kGroup] != kQ4Group) return 2;
      product_reps<q4>(n, W, scale, N, K, x, B, y, reps, threads);
      return 0;
    default: return 1;
  }
}

// fma_chains with `chains` chains (8, 12, 16 or 24) on nth threads, out (nth,) floats. Returns the
// multiply-adds of one chain's madd (kLanes), or 0 for a chain count it was not built for.
int64_t wiola_fma_peak(int64_t chains, int64_t reps, int64_t nth, float* out) {
  const int threads = static_cast<int>(nth);
  switch (chains) {
    case 8: fma_chains<8>(reps, threads, out); break;
    case 12: fma_chains<12>(reps, threads, out); break;
    case 16: fma_chains<16>(reps, threads, out); break;
    case 24: fma_chains<24>(reps, threads, out); break;
    default: return 0;
  }
  return kLanes;
}

// Samples: sample_rows' scratch, in floats (4V per thread: the filtered row, V for top-k's copy or
// the nucleus' buckets, V uint64 for the nucleus' sort or the top ids).
int64_t wiola_sample_scratch_floats(int64_t V) { return 4 * V * omp_get_max_threads(); }

// The tokens of B rows from their (B, V) logits: mode (B,) SampleMode, temperature (B,), top_k (B,)
// (0: none), top_p (B,) float64 (>= 1: none), log_noise (B, V) (log of the Exp(1) draws; read for
// kSample rows), n_logprobs (B,) (each <= max_k); caller: for a nucleus the C++ cannot decide; out
// token (B,), logprob (B,) (null: not computed), top_ids / top_values (B, max_k), path (B,)
// NucleusPath. scratch: wiola_sample_scratch_floats(V). Returns how many rows got no token (-1).
int64_t wiola_sample_rows(const float* logits, int64_t B, int64_t V, const int64_t* mode, const float* temperature,
                          const int64_t* top_k, const double* top_p, const float* log_noise, const int64_t* n_logprobs,
                          int64_t max_k, NucleusCaller caller, int64_t* token, float* logprob, int64_t* top_ids,
                          float* top_values, int64_t* path, float* scratch) {
  Samplers s{mode, temperature, top_k, top_p, log_noise, n_logprobs, max_k, caller, token, logprob, top_ids, top_values,
             path};
  return sample_rows(logits, B, V, s, scratch);
}

// One step of B rows (wiola_decode_rows) and their tokens (wiola_sample_rows) in one call. Returns
// wiola_decode_rows' code, or -3 where a row got no token.
int wiola_step_rows(const int64_t* n, const void* const* weights, const float* const* scales, void* const* state,
                    int64_t B, const int64_t* rows, const int64_t* tokens, const int64_t* slots, float eps,
                    float* logits, float* work, const int64_t* mode, const float* temperature, const int64_t* top_k,
                    const double* top_p, const float* log_noise, const int64_t* n_logprobs, int64_t max_k,
                    NucleusCaller caller, int64_t* token, float* logprob, int64_t* top_ids, float* top_values,
                    int64_t* path, float* scratch) {
  int rc = wiola_decode_rows(n, weights, scales, state, B, rows, tokens, slots, eps, logits, work);
  if (rc != 0) return rc;
  return wiola_sample_rows(logits, B, n[kV], mode, temperature, top_k, top_p, log_noise, n_logprobs, max_k, caller,
                           token, logprob, top_ids, top_values, path, scratch) == 0
             ? 0
             : -3;
}

// The nucleus alone: drop (B, V) uint8 = 1 where x's token is outside the nucleus of top_p (B,)
// float64 < 1, x (B, V) scaled and top-k filtered logits; path
// (B,) NucleusPath. Returns how many rows the caller failed (their drop left as it was).
int64_t wiola_nucleus(const float* x, int64_t B, int64_t V, const double* top_p, NucleusCaller caller, uint8_t* drop,
                      int64_t* path) {
  std::unique_ptr<float[]> scratch(new float[4 * V]);
  int64_t failed = 0;
  for (int64_t i = 0; i < B; ++i) {
    float* row = scratch.get();
    std::memcpy(row, x + i * V, V * sizeof(float));
    int minus_inf = 0;
    path[i] = nucleus_row(row, V, top_p[i], reinterpret_cast<uint16_t*>(row + V),
                          reinterpret_cast<uint64_t*>(row + 2 * V), &minus_inf);
    const bool any_minus_inf = std::find(x + i * V, x + (i + 1) * V, -INFINITY) != x + (i + 1) * V;
    if (path[i] == kNucleusBound && minus_inf < 0 && any_minus_inf) path[i] = kNucleusCaller;
    if (path[i] == kNucleusCaller) {
      failed += caller == nullptr || caller(x + i * V, V, top_p[i], drop + i * V) != 0;
      continue;
    }
    for (int64_t j = 0; j < V; ++j)
      drop[i * V + j] = x[i * V + j] == -INFINITY ? path[i] == kNucleusBound && minus_inf : row[j] == -INFINITY;
  }
  return failed;
}

// The largest relative error of exp_nonpositive_double against std::exp over n points spread evenly
// over [lo, 0] (tests: the bound the nucleus assumes, kExpDoubleError).
double wiola_exp_error(double lo, int64_t n) {
  double worst = 0.0;
  constexpr int kHalf = kLanes / 2;
  for (int64_t k = 0; k < n; k += kHalf) {
    dvec d = {};
    for (int u = 0; u < kHalf; ++u) d[u] = lo * static_cast<double>((k + u) % n) / static_cast<double>(n);
    const dvec e = exp_nonpositive_double(d);
    for (int u = 0; u < kHalf && k + u < n; ++u) {
      const double exact = std::exp(d[u]);
      const double err = std::fabs(e[u] - exact) / exact;
      worst = err > worst ? err : worst;
    }
  }
  return worst;
}

// generate's loop over steps [i0, i1) for all R rows of the cache, as wiola.generation.decode_loop
// runs it: step i samples from the prefill's logits (i == 0, `first`) or from a step of the
// previous tokens at slot `start + i - 1`; with an eos (>= 0) finished rows emit `pad`, and the
// loop stops before step i once every row has finished. out (R, N) int64 gets column i of step i;
// finished (R,) uint8 carries across calls. One sampler for every row: greedy, or temperature, top_k
// and top_p (>= 1: none; caller: for a nucleus the C++ cannot decide) with log_noise ((i1 - i0), R,
// V). logits: (R, V) scratch. Returns the step it stopped before (i1 when none finished early), -1
// for an unknown weight type, -2 where a row got no token (the caller failed).
int64_t wiola_generate(const int64_t* n, const void* const* weights, const float* const* scales, void* const* state,
                       float eps, float* work, int64_t start, int64_t i0, int64_t i1, int64_t N, const float* first,
                       float* logits, int64_t greedy, float temperature, int64_t top_k, double top_p,
                       NucleusCaller caller, const float* log_noise, int64_t eos, int64_t pad, uint8_t* finished,
                       int64_t* out, float* scratch) {
  const int64_t R = n[kB], V = n[kV];
  std::unique_ptr<int64_t[]> idx(new int64_t[5 * R]);
  int64_t *rows = idx.get(), *slots = rows + R, *tokens = rows + 2 * R, *modes = rows + 3 * R, *top_ks = rows + 4 * R;
  std::unique_ptr<float[]> temps(new float[R]);
  std::unique_ptr<double[]> top_ps(new double[R]);
  int64_t stopped = i1;
  for (int64_t i = 0; i < R; ++i) {
    rows[i] = i;
    modes[i] = greedy ? kGreedy : kSample;
    top_ks[i] = top_k;
    temps[i] = temperature;
    top_ps[i] = top_p;
  }
  for (int64_t i = i0; i < i1; ++i) {
    const float* step_logits = first;
    if (i > 0) {
      bool all = eos >= 0;
      for (int64_t b = 0; b < R && all; ++b) all = finished[b] != 0;
      if (all) {
        stopped = i;
        break;
      }
      for (int64_t b = 0; b < R; ++b) {
        slots[b] = start + i - 1;
        tokens[b] = out[b * N + i - 1];
      }
      if (wiola_decode_rows(n, weights, scales, state, R, rows, tokens, slots, eps, logits, work) != 0) {
        stopped = -1;
        break;
      }
      step_logits = logits;
    }
    const float* noise = greedy ? nullptr : log_noise + (i - i0) * R * V;
    Samplers s{modes, temps.get(), top_ks, top_ps.get(), noise, nullptr, 0, caller, tokens, nullptr, nullptr, nullptr,
               nullptr};
    if (sample_rows(step_logits, R, V, s, scratch) != 0) {
      stopped = -2;
      break;
    }
    for (int64_t b = 0; b < R; ++b) {
      int64_t t = tokens[b];
      if (eos >= 0) {
        if (finished[b]) t = pad;
        if (t == eos) finished[b] = 1;
      }
      out[b * N + i] = t;
    }
  }
  return stopped;
}

// Every row of the cache at one shared slot (a batch that started together, left-padded):
// wiola_decode_rows with rows 0..R-1 and slot for each.
int wiola_decode_step(const int64_t* n, const void* const* weights, const float* const* scales, void* const* state,
                      const int64_t* tokens, int64_t slot, float eps, float* logits, float* work) {
  const int64_t R = n[kB];
  int64_t* rows = new int64_t[2 * R];
  for (int64_t i = 0; i < R; ++i) {
    rows[i] = i;
    rows[R + i] = slot;
  }
  int rc = wiola_decode_rows(n, weights, scales, state, R, rows, tokens, rows + R, eps, logits, work);
  delete[] rows;
  return rc;
}

// wiola.ops.decode_attention for T > 1 new tokens (PromptAttention). n: B, T, H, D, S, start, ld_b,
// ld_t (q, k and v are (B, T, H, D) views with those batch and token strides, head stride D, unit
// element stride: the fused projection's output), q0 (the first new token whose query attends,
// 0 <= q0 < T). g (B, T, H), cos and sin (B, T, D/2), key_mask (B, S): contiguous; k_cache, v_cache
// (B, H, S, D) contiguous, written at [start, start + T) (every new token's key and value); out
// (B, T - q0, H, D): the attention of tokens q0 .. T - 1. scratch: wiola_decode_attention_floats(B, H, D, start + T). The caller has
// checked every shape, dtype and range (D even and a multiple of 16, start + T <= S).
int64_t wiola_decode_attention_floats(int64_t B, int64_t H, int64_t D, int64_t end) {
  const int64_t Sp = (end + kKeyChunk - 1) / kKeyChunk * kKeyChunk;
  return B * H * D * Sp + omp_get_max_threads() * (kTileRows * (D + Sp) + Sp);
}

void wiola_decode_attention(const int64_t* n, const float* q, const float* k, const float* v, const float* g,
                            const float* cs, const float* sn, float* k_cache, float* v_cache, const bool* key_mask,
                            float* out, float* scratch) {
  PromptAttention a;
  a.B = n[0], a.T = n[1], a.H = n[2], a.D = n[3], a.S = n[4], a.start = n[5], a.ld_b = n[6], a.ld_t = n[7], a.q0 = n[8];
  a.end = a.start + a.T;
  a.Sp = (a.end + kKeyChunk - 1) / kKeyChunk * kKeyChunk;
  a.q = q, a.k = k, a.v = v, a.g = g, a.cs = cs, a.sn = sn;
  a.k_cache = k_cache, a.v_cache = v_cache, a.key_mask = key_mask, a.out = out;
  a.kt = scratch;
  a.scratch = scratch + a.B * a.H * a.D * a.Sp;
  a.sqrt_d = std::sqrt(static_cast<float>(a.D));
  a.inv_sqrt_d = 1.0f / a.sqrt_d;
  a.run();
}

// wiola.ops.rms_norm over `rows` contiguous rows of d floats (rms_norm_rows): residual and h are
// both null or both (rows, d); out (rows, d).
void wiola_rms_norm_rows(const float* x, const float* residual, const float* gamma, float eps, float* out, float* h,
                         int64_t rows, int64_t d) {
  rms_norm_rows(x, residual, gamma, eps, out, h, rows, d);
}

// The gate over B rows of T positions (gate_rows; its comment has the arguments).
void wiola_gate_rows(const int64_t* n, const float* q, const float* w1, const float* w2, const float* b2,
                     const float* cos, const float* sin, const uint8_t* mask, float* run, int64_t* count, float* g) {
  gate_rows(n, q, w1, w2, b2, cos, sin, mask, run, count, g);
}

// y (B, N) = x (B, K) · Wᵀ, fp32, row by row (product_rows).
void wiola_product_rows(const float* W, int64_t N, int64_t K, const float* x, int64_t B, float* y, int64_t ahead) {
  product_rows(W, N, K, x, B, y, ahead);
}

// The butterfly's middle over `rows` rows (silu_gate_rows): up (rows, 2F), bp and out (rows, F).
void wiola_silu_gate_rows(const float* up, const float* bp, float* out, int64_t rows, int64_t F) {
  silu_gate_rows(up, bp, out, rows, F);
}

// x / d over n floats into out, a vector at a time (the last n mod kLanes through a vector padded
// with +0), as the prompt's attention divides: with `exact` 1 by quotient alone, for testing it on its
// stated domain (returns 1, out untouched, where quotient_exact(d) is false); with 0 by divide.
int wiola_divide(const float* x, int64_t n, float d, int64_t exact, float* out) {
  if (exact && !quotient_exact(d)) return 1;
  const float r = 1.0f / d;
  for (int64_t i = 0; i < n; i += kLanes) {
    float part[kLanes] = {};
    const int64_t m = std::min<int64_t>(kLanes, n - i);
    std::memcpy(part, x + i, m * sizeof(float));
    const vec y = exact ? quotient(load(part), d, r) : divide(load(part), d, r);
    std::memcpy(out + i, &y, m * sizeof(float));
  }
  return 0;
}

}  // extern "C"
