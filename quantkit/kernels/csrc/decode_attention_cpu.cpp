// Fused decode attention on CPU over quantkit's block-allocated KV cache (flash-decoding).
//
// One query token per sequence: out[b, h] = softmax_t(q[b, h] . k[b, kv(h), t] * sm_scale) v[b, kv(h), t].
// The cache is read in its stored type (fp32, bf16, fp16, fp8 e4m3, int8 with a scale per token and
// head) and dequantized in registers; nothing is converted in memory first.
//
// Work: at::parallel_for over tasks (sequence, kv head, chunk of positions). A task reads each key and
// value row of its chunk once for all `group` query heads of its kv head (GQA), computes the chunk's
// scores, its max m and sum l of exp(s - m) and its unnormalized output o = sum exp(s - m) v; a final
// pass merges the chunks of each head: out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c.
//
// Dequantization in registers:
//   bf16: the 16-bit pattern shifted into the high half of an fp32; fp16: vcvtph2ps;
//   fp8 e4m3: no x86 conversion before AVX10.2: the code c, sign-extended to 32 bits, shifted left by
//     20 and masked with 0x87f00000, is an fp32 bit pattern whose value is exactly fp8(c) * 2^-120 for
//     every normal code (exponent and mantissa land in the fp32's, the sign in its sign bit): three
//     integer ops, no conversion. Subnormal codes (|fp8(c)| < 2^-6, 1/28672 of the scale's range)
//     become fp32 subnormals, read as 0: the fp8 tasks run with the CPU's denormals-are-zero and
//     flush-to-zero set (a subnormal operand costs a microcode assist on every FMA). The 2^-120 is
//     undone in three steps that keep every product normal: the query is scaled by 2^64 (and the head
//     scale), the scores by 2^56, the softmax weights by 2^64 (in the exponent of exp), and the output
//     by 2^120 (and the head scale) over the weights' sum, which carries the same 2^64;
//   int8: sign-extended and converted; its per-token scale multiplies the score (keys) and the
//     softmax weight (values).
// Five code paths in one build, chosen at run time from the CPU (cpuid) or by the caller: AVX-512 with
// BF16 and VBMI (the next, with the fp8 cache read by byte permutes: the same results), AVX-512 with BF16
// (bf16 and fp8 caches by bf16 dot products, the query and the softmax weights rounded to bf16: see its
// section), AVX-512 (16 values a vector), AVX2 + F16C (8) and portable scalar code (fp8 by a 256-entry
// table of the same values). The last three differ only in the order of the fp32 additions.
//
// Memory: keys are read a tile (16 positions) at a time and values a row at a time, each prefetched
// KEY_AHEAD tiles / VALUE_AHEAD rows ahead (the hardware prefetcher alone left a bf16 cache at ~9 GB/s
// on one core).
#include "decode_attention_cpu.h"

#include "cpu_isa.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using quantkit::KvBlocks;
using quantkit::KvDtype;

using quantkit::detected_isa;
using quantkit::ISA_AVX2;
using quantkit::ISA_AVX512;
using quantkit::ISA_AVX512_BF16;
using quantkit::ISA_AVX512_BF16_VBMI;
using quantkit::ISA_SCALAR;

// Every path reads an fp8 code c as fp8(c) * 2^-FP8_EXP (0 for subnormal codes); the query is scaled
// by 2^FP8_Q, the scores by 2^(FP8_EXP - FP8_Q), the softmax weights by 2^FP8_P (see the header).
constexpr int FP8_EXP = 120, FP8_Q = 64, FP8_P = 64;
constexpr int32_t FP8_MASK = static_cast<int32_t>(0x87f00000u);  // sign, exponent bits 23-26, mantissa 20-22

// Denormals-are-zero and flush-to-zero for the calling thread while it lives (fp8 tasks).
struct SubnormalsAreZero {
#if defined(__x86_64__) || defined(__i386__)
  explicit SubnormalsAreZero(bool on) : saved(_mm_getcsr()), on(on) {
    if (on) _mm_setcsr(saved | 0x8040);  // FTZ (bit 15) | DAZ (bit 6)
  }
  ~SubnormalsAreZero() {
    if (on) _mm_setcsr(saved);
  }
  unsigned saved;
  bool on;
#else
  explicit SubnormalsAreZero(bool) {}
#endif
};

constexpr int64_t value_bytes(KvDtype t) {
  switch (t) {
    case quantkit::KV_FP32: return 4;
    case quantkit::KV_BF16:
    case quantkit::KV_FP16: return 2;
    default: return 1;
  }
}

constexpr int64_t TILE = quantkit::KV_KEY_TILE;  // positions of one key tile: [head_dim, TILE] values

// A run of n consecutive positions inside one block, from its first one (a multiple of 2 * TILE): keys
// in tiles of TILE positions, [D, TILE] values each; values n rows of D values; int8: the tokens' scales.
struct Rows {
  const uint8_t* data;
  const float* scale;
  int64_t n;
};

// Where key component e of position r (counted from a tile's start) is, in values.
inline int64_t key_index(int64_t r, int64_t e, int64_t D) { return ((r / TILE) * D + e) * TILE + r % TILE; }

// The kernels of one code path and cache type, G query heads, head_dim D:
//   scores: s[g * ld + r] = (q[g] . k_r) (* scale_r)   for r < n (vector paths also fill s up to n
//           rounded up to 2 * TILE: the caller's buffer has room, the values are not read)
//   values: o[g] += sum_r p[g * ld + r] (* scale_r) v_r
//   exp_sum: m = max(x[0..n)), x[i] = exp(x[i] - m) * 2^shift, returns their sum (and m)
struct Kernels {
  void (*scores)(const Rows&, const float* q, int64_t G, int64_t D, float* s, int64_t ld);
  void (*values)(const Rows&, const float* p, int64_t G, int64_t ld, float* o, int64_t D);
  float (*exp_sum)(float* x, int64_t n, float* m, int shift);
};

// The factor of the scores (keys), after int8's per-token scale.
template <int DT>
constexpr float score_factor() { return DT == quantkit::KV_FP8 ? static_cast<float>(1ull << (FP8_EXP - FP8_Q)) : 1.f; }

// ----------------------------------------------------------------------------------------------- scalar

const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int c = 0; c < 256; ++c)  // subnormal codes (exponent bits 0) read as 0, as the vector paths
      t[c] = (c & 0x78) == 0 ? 0.f
                             : std::ldexp(static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(c),
                                                                                c10::Float8_e4m3fn::from_bits())),
                                          -FP8_EXP);
    return t;
  }();
  return table.data();
}

template <int DT>
inline float load_scalar(const uint8_t* data, int64_t i) {
  if constexpr (DT == quantkit::KV_FP32) return reinterpret_cast<const float*>(data)[i];
  if constexpr (DT == quantkit::KV_BF16) {
    uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(data)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  if constexpr (DT == quantkit::KV_FP16)
    return static_cast<float>(c10::Half(reinterpret_cast<const uint16_t*>(data)[i], c10::Half::from_bits()));
  if constexpr (DT == quantkit::KV_FP8) return fp8_table()[data[i]];
  return static_cast<float>(reinterpret_cast<const int8_t*>(data)[i]);
}

template <int DT>
void scores_scalar(const Rows& rows, const float* q, int64_t G, int64_t D, float* s, int64_t ld) {
  for (int64_t r = 0; r < rows.n; ++r)
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.f;
      for (int64_t e = 0; e < D; ++e) dot += q[g * D + e] * load_scalar<DT>(rows.data, key_index(r, e, D));
      s[g * ld + r] = (DT == quantkit::KV_INT8 ? dot * rows.scale[r] : dot) * score_factor<DT>();
    }
}

template <int DT>
void values_scalar(const Rows& rows, const float* p, int64_t G, int64_t ld, float* o, int64_t D) {
  for (int64_t r = 0; r < rows.n; ++r) {
    const float sc = DT == quantkit::KV_INT8 ? rows.scale[r] : 1.f;
    for (int64_t e = 0; e < D; ++e) {
      const float v = load_scalar<DT>(rows.data, r * D + e);
      for (int64_t g = 0; g < G; ++g) o[g * D + e] += p[g * ld + r] * sc * v;
    }
  }
}

float exp_sum_scalar(float* x, int64_t n, float* m, int shift) {
  *m = *std::max_element(x, x + n);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::ldexp(std::exp(x[i] - *m), shift));
  return sum;
}

#if defined(__x86_64__) || defined(__i386__)
#define QK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QK_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
#define QK_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")))
#define QK_AVX512VBMI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi,avx2,fma,f16c")))

// Query heads per pass over the keys (accumulators in registers), and per pass over the values
// (GT x NV accumulators in registers, at most 24 of the 32 vector registers).
constexpr int KEY_TILE = 4;
constexpr int value_tile(int nv) { return nv <= 6 ? 4 : nv <= 8 ? 3 : 1; }

// How far ahead of its reads a task prefetches: key tiles, value rows.
constexpr int64_t KEY_AHEAD = 4, VALUE_AHEAD = 32;

// Prefetches the cache lines of [p, p + bytes) into L1.
inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// Calls f.template operator()<T>() with T = min(rest, TILE) as a compile-time constant (1..4).
#define QK_TILE_SWITCH(rest, TILE, CALL) \
  switch (std::min<int64_t>(rest, TILE)) {  \
    case 1: CALL(1); break;                 \
    case 2: if constexpr (TILE >= 2) { CALL(2); } break; \
    case 3: if constexpr (TILE >= 3) { CALL(3); } break; \
    default: if constexpr (TILE >= 4) { CALL(4); } break; \
  }

// -------------------------------------------------------------------------------------------- AVX-512

// 16 values from data + i (i counts values).
template <int DT>
QK_AVX512 inline __m512 load16(const uint8_t* data, int64_t i) {
  if constexpr (DT == quantkit::KV_FP32) return _mm512_loadu_ps(reinterpret_cast<const float*>(data) + i);
  if constexpr (DT == quantkit::KV_BF16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + 2 * i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  if constexpr (DT == quantkit::KV_FP16)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + 2 * i)));
  if constexpr (DT == quantkit::KV_FP8) {  // fp8(c) * 2^-120 as an fp32 bit pattern (see the header)
    const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(data + i)));
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(w, 20), _mm512_set1_epi32(FP8_MASK)));
  }
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(data + i))));
}

// Two key tiles (32 positions) at a time: 2 * GT independent accumulators.
template <int DT, int GT>
QK_AVX512 void scores_tile_avx512(const Rows& rows, const float* q, int64_t D, float* s, int64_t ld) {
  for (int64_t r = 0; r < rows.n; r += 2 * TILE) {
    constexpr int64_t vb = value_bytes(static_cast<KvDtype>(DT));
    const uint8_t* t0 = rows.data + key_index(r, 0, D) * vb;
    const int64_t next = D * TILE;  // values from one tile to the next
    prefetch(t0 + KEY_AHEAD * next * vb, 2 * next * vb);
    __m512 a0[GT], a1[GT];
    for (int g = 0; g < GT; ++g) a0[g] = a1[g] = _mm512_setzero_ps();
    for (int64_t e = 0; e < D; ++e) {
      const __m512 k0 = load16<DT>(t0, e * TILE), k1 = load16<DT>(t0, next + e * TILE);
      for (int g = 0; g < GT; ++g) {
        const __m512 qv = _mm512_set1_ps(q[g * D + e]);
        a0[g] = _mm512_fmadd_ps(qv, k0, a0[g]);
        a1[g] = _mm512_fmadd_ps(qv, k1, a1[g]);
      }
    }
    const bool int8 = DT == quantkit::KV_INT8;
    const __m512 f = _mm512_set1_ps(score_factor<DT>());
    const __m512 s0 = int8 ? _mm512_loadu_ps(rows.scale + r) : f;  // int8's factor is 1
    const __m512 s1 = int8 ? _mm512_loadu_ps(rows.scale + r + TILE) : f;
    for (int g = 0; g < GT; ++g) {
      _mm512_storeu_ps(s + g * ld + r, _mm512_mul_ps(a0[g], s0));
      _mm512_storeu_ps(s + g * ld + r + TILE, _mm512_mul_ps(a1[g], s1));
    }
  }
}

template <int DT>
QK_AVX512 void scores_avx512(const Rows& rows, const float* q, int64_t G, int64_t D, float* s, int64_t ld) {
  for (int64_t g0 = 0; g0 < G; g0 += KEY_TILE) {
#define QK_CALL(T) scores_tile_avx512<DT, T>(rows, q + g0 * D, D, s + g0 * ld, ld)
    QK_TILE_SWITCH(G - g0, KEY_TILE, QK_CALL)
#undef QK_CALL
  }
}

template <int DT, int NV, int GT>
QK_AVX512 void values_tile_avx512(const Rows& rows, const float* p, int64_t ld, float* o) {
  constexpr int64_t D = 16 * NV;
  __m512 acc[GT][NV];
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_loadu_ps(o + g * D + 16 * j);
  constexpr int64_t row_bytes = D * value_bytes(static_cast<KvDtype>(DT));
  for (int64_t r = 0; r < rows.n; ++r) {
    const uint8_t* row = rows.data + r * row_bytes;
    prefetch(row + VALUE_AHEAD * row_bytes, row_bytes);
    __m512 v[NV];
    for (int j = 0; j < NV; ++j) v[j] = load16<DT>(row, 16 * j);
    const float sc = DT == quantkit::KV_INT8 ? rows.scale[r] : 1.f;
    for (int g = 0; g < GT; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * ld + r] * sc);
      for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(w, v[j], acc[g][j]);
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(o + g * D + 16 * j, acc[g][j]);
}

template <int DT, int NV>
QK_AVX512 void values_avx512(const Rows& rows, const float* p, int64_t G, int64_t ld, float* o, int64_t) {
  constexpr int TILE = value_tile(NV);
  for (int64_t g0 = 0; g0 < G; g0 += TILE) {
#define QK_CALL(T) values_tile_avx512<DT, NV, T>(rows, p + g0 * ld, ld, o + g0 * 16 * NV)
    QK_TILE_SWITCH(G - g0, TILE, QK_CALL)
#undef QK_CALL
  }
}

// exp(x) * 2^shift for x <= 0 and 0 <= shift <= 64 (Cephes: 2^(n + shift) * p(r), |r| <= ln2 / 2;
// ~2 ulp), exp(-87) * 2^shift below -87.
QK_AVX512 inline __m512 exp16(__m512 x, int shift) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127 + shift)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

QK_AVX512 float exp_sum_avx512(float* x, int64_t n, float* m, int shift) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (n % 16)) - 1);
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mx = lowest;
  for (int64_t i = 0; i + 16 <= n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(x + i));
  if (n % 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(lowest, tail, x + n / 16 * 16));
  *m = _mm512_reduce_max_ps(mx);
  const __m512 mv = _mm512_set1_ps(*m);
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv), shift);
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mv), shift);
    _mm512_mask_storeu_ps(x + i, k, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(acc);
}

// ---------------------------------------------------------------------------------------- AVX-512 BF16
//
// bf16 and fp8 caches with bf16 dot products (vdpbf16ps: two bf16 products added to an fp32 lane, the
// sum in fp32). The cache's values are exact in bf16 (fp8 as fp8(c) * 2^-120, the fp32 read's bit trick
// in 16-bit lanes: sign-extended, shifted left by 4, masked with 0x87f0); the query (after its factors)
// and the softmax weights are rounded to bf16 (round to nearest even) as GPU attention rounds them
// before its matmuls. One vdpbf16ps does a query head's multiply-adds for 32 cached values, where the
// fp32 path converts 16 (three integer ops for fp8) and runs one FMA per query head on them (SmolLM2's 3
// query heads per kv head: 12 instructions per 32 fp8 keys before, 7 now; measured on Zen 4: 1.1-1.2x,
// evals/kv_cache/cpu_loop). Keys: the tile's rows e and e + 1 (32 contiguous values) interleaved to pairs
// (one vpermw) against the query's pair (q[e], q[e + 1]); values: rows r and r + 1 interleaved (one
// vpermt2w per 16 pairs) against the weights' pair (p[r], p[r + 1]); an odd last row in fp32.

constexpr int16_t FP8_MASK16 = static_cast<int16_t>(0x87f0);

// 32 cached values from data + i (i counts values) as bf16 bit patterns.
template <int DT>
QK_AVX512BF16 inline __m512i load32_bf16(const uint8_t* data, int64_t i) {
  if constexpr (DT == quantkit::KV_BF16) return _mm512_loadu_si512(data + 2 * i);
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + i)));
  return _mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(FP8_MASK16));
}

// 16-bit lane indices: PAIR_HALVES interleaves the two halves of one vector, (x0, x16, x1, x17, ...);
// PAIR_LO / PAIR_HI interleave the first / last 16 lanes of two vectors a, b: (a0, b0, a1, b1, ...).
struct PairIndices {
  alignas(64) int16_t halves[32], lo[32], hi[32];
  constexpr PairIndices() : halves(), lo(), hi() {
    for (int i = 0; i < 32; ++i) {
      halves[i] = static_cast<int16_t>((i % 2) * 16 + i / 2);
      lo[i] = static_cast<int16_t>((i % 2) * 32 + i / 2);
      hi[i] = static_cast<int16_t>((i % 2) * 32 + 16 + i / 2);
    }
  }
};
constexpr PairIndices PAIRS{};

// x[0..n) -> bf16 bit patterns (round to nearest even).
QK_AVX512BF16 void to_bf16(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
  for (; i < n; ++i) out[i] = c10::BFloat16(x[i]).x;
}

inline int32_t load_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// n values of each of G rows x [g * ld ..) -> bf16 [G, n] in the calling thread's buffer (the query after its
// factors, or a run's softmax weights).
QK_AVX512BF16 const uint16_t* bf16_rows(const float* x, int64_t G, int64_t ld, int64_t n) {
  thread_local std::vector<uint16_t> buffer;
  buffer.resize(G * n);
  for (int64_t g = 0; g < G; ++g) to_bf16(x + g * ld, n, buffer.data() + g * n);
  return buffer.data();
}

// An odd last value row r (NV * 16 values at `row`): fp32 products with the same bf16 weights pb[g * ldb + r].
template <int DT, int NV, int GT>
QK_AVX512BF16 inline void add_odd_value_row(const uint8_t* row, const uint16_t* pb, int64_t ldb, int64_t r,
                                            __m512 (&acc)[GT][NV]) {
  for (int g = 0; g < GT; ++g) {
    const uint32_t bits = static_cast<uint32_t>(pb[g * ldb + r]) << 16;
    float wf;
    std::memcpy(&wf, &bits, 4);
    const __m512 w = _mm512_set1_ps(wf);
    for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(w, load16<DT>(row, 16 * j), acc[g][j]);
  }
}

// Two key tiles (32 positions) at a time against GT query heads, qb: the heads' bf16 [GT, D].
template <int DT, int GT>
QK_AVX512BF16 void scores_tile_bf16dot(const Rows& rows, const uint16_t* qb, int64_t D, float* s, int64_t ld) {
  const __m512i halves = _mm512_load_si512(PAIRS.halves);
  constexpr int64_t vb = value_bytes(static_cast<KvDtype>(DT));
  const int64_t next = D * TILE;
  for (int64_t r = 0; r < rows.n; r += 2 * TILE) {
    const uint8_t* t0 = rows.data + key_index(r, 0, D) * vb;
    prefetch(t0 + KEY_AHEAD * next * vb, 2 * next * vb);
    __m512 a0[GT], a1[GT];
    for (int g = 0; g < GT; ++g) a0[g] = a1[g] = _mm512_setzero_ps();
    for (int64_t e = 0; e < D; e += 2) {  // rows e and e + 1 of each tile: 32 contiguous values
      const __m512bh k0 = (__m512bh)_mm512_permutexvar_epi16(halves, load32_bf16<DT>(t0, e * TILE));
      const __m512bh k1 = (__m512bh)_mm512_permutexvar_epi16(halves, load32_bf16<DT>(t0, next + e * TILE));
      for (int g = 0; g < GT; ++g) {
        const __m512bh qv = (__m512bh)_mm512_set1_epi32(load_pair(qb + g * D + e));
        a0[g] = _mm512_dpbf16_ps(a0[g], k0, qv);
        a1[g] = _mm512_dpbf16_ps(a1[g], k1, qv);
      }
    }
    const __m512 f = _mm512_set1_ps(score_factor<DT>());
    for (int g = 0; g < GT; ++g) {
      _mm512_storeu_ps(s + g * ld + r, _mm512_mul_ps(a0[g], f));
      _mm512_storeu_ps(s + g * ld + r + TILE, _mm512_mul_ps(a1[g], f));
    }
  }
}

template <int DT>
QK_AVX512BF16 void scores_bf16dot(const Rows& rows, const float* q, int64_t G, int64_t D, float* s, int64_t ld) {
  const uint16_t* qb = bf16_rows(q, 1, 0, G * D);
  for (int64_t g0 = 0; g0 < G; g0 += KEY_TILE) {
#define QK_CALL(T) scores_tile_bf16dot<DT, T>(rows, qb + g0 * D, D, s + g0 * ld, ld)
    QK_TILE_SWITCH(G - g0, KEY_TILE, QK_CALL)
#undef QK_CALL
  }
}

// Rows in pairs against GT heads' bf16 weights pb [GT, ldb]; D = 32 * NP.
template <int DT, int NP, int GT>
QK_AVX512BF16 void values_tile_bf16dot(const Rows& rows, const uint16_t* pb, int64_t ldb, float* o) {
  constexpr int64_t D = 32 * NP;
  constexpr int64_t row_bytes = D * value_bytes(static_cast<KvDtype>(DT));
  const __m512i lo = _mm512_load_si512(PAIRS.lo), hi = _mm512_load_si512(PAIRS.hi);
  __m512 acc[GT][2 * NP];
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < 2 * NP; ++j) acc[g][j] = _mm512_loadu_ps(o + g * D + 16 * j);
  int64_t r = 0;
  for (; r + 1 < rows.n; r += 2) {
    const uint8_t* row = rows.data + r * row_bytes;
    prefetch(row + VALUE_AHEAD * row_bytes, 2 * row_bytes);
    __m512bh w[GT];
    for (int g = 0; g < GT; ++g) w[g] = (__m512bh)_mm512_set1_epi32(load_pair(pb + g * ldb + r));
    for (int c = 0; c < NP; ++c) {  // dims [32c, 32c + 32) of rows r and r + 1, in pairs
      const __m512i a = load32_bf16<DT>(row, 32 * c), b = load32_bf16<DT>(row + row_bytes, 32 * c);
      const __m512bh v0 = (__m512bh)_mm512_permutex2var_epi16(a, lo, b);
      const __m512bh v1 = (__m512bh)_mm512_permutex2var_epi16(a, hi, b);
      for (int g = 0; g < GT; ++g) {
        acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], v0, w[g]);
        acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], v1, w[g]);
      }
    }
  }
  if (r < rows.n) add_odd_value_row<DT>(rows.data + r * row_bytes, pb, ldb, r, acc);
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < 2 * NP; ++j) _mm512_storeu_ps(o + g * D + 16 * j, acc[g][j]);
}

constexpr int value_tile_bf16dot(int np) { return np <= 2 ? 4 : np <= 3 ? 3 : np <= 4 ? 2 : 1; }

template <int DT, int NP>
QK_AVX512BF16 void values_bf16dot(const Rows& rows, const float* p, int64_t G, int64_t ld, float* o, int64_t) {
  const uint16_t* pb = bf16_rows(p, G, ld, rows.n);  // the weights in bf16, [G, n]
  constexpr int TILE = value_tile_bf16dot(NP);
  for (int64_t g0 = 0; g0 < G; g0 += TILE) {
#define QK_CALL(T) values_tile_bf16dot<DT, NP, T>(rows, pb + g0 * rows.n, rows.n, o + g0 * 32 * NP)
    QK_TILE_SWITCH(G - g0, TILE, QK_CALL)
#undef QK_CALL
  }
}

// ------------------------------------------------------------------------------- AVX-512 BF16 with VBMI
//
// The fp8 cache read with one byte permute per 64 bytes in place of the widening loads and 16-bit
// interleaves above (on Zen 4, one core, one layer's cache in the last-level cache: the fp8 attention
// 1.15-1.23x faster; from memory 3%: evals/kv_cache/cpu_loop). Each code lands in the high byte of a 16-bit lane; an
// arithmetic shift right by 4 and the mask 0x87f0 then make it the bf16 pattern of fp8(c) * 2^-120, as
// load32_bf16 does, whatever the lane's low byte holds. The products and their order are those of the
// bf16dot path: the results are the same bits.
//   Keys: 64 bytes = rows e..e+3 of a tile (16 positions each). FP8_PERMUTES.key puts rows e and e + 2 of
//     position r in the low and high byte of lane 2r, rows e + 1 and e + 3 in lane 2r + 1: a left shift by 8
//     then gives position r the pair (row e, row e + 1) in its 32-bit lane, and the high bytes alone the pair
//     (row e + 2, row e + 3), each against the query's pair.
//   Values: rows r and r + 1, 64 dims each. FP8_PERMUTES.value[c] puts dim 16c + j of row r and of row r + 1 in
//     the high bytes of 32-bit lane j: the pair (row r, row r + 1) of that dim, against the weights' pair.
struct Fp8Permutes {
  alignas(64) int8_t key[64];
  alignas(64) int8_t value[4][64];
  constexpr Fp8Permutes() : key(), value() {
    for (int r = 0; r < 16; ++r) {
      key[4 * r] = static_cast<int8_t>(r);                // lane 2r, low byte: row e
      key[4 * r + 1] = static_cast<int8_t>(2 * 16 + r);   // lane 2r, high byte: row e + 2
      key[4 * r + 2] = static_cast<int8_t>(16 + r);       // lane 2r + 1, low byte: row e + 1
      key[4 * r + 3] = static_cast<int8_t>(3 * 16 + r);   // lane 2r + 1, high byte: row e + 3
    }
    for (int c = 0; c < 4; ++c)
      for (int j = 0; j < 16; ++j) {
        value[c][4 * j + 1] = static_cast<int8_t>(16 * c + j);       // row r (first operand)
        value[c][4 * j + 3] = static_cast<int8_t>(64 + 16 * c + j);  // row r + 1 (second operand)
      }
  }
};
constexpr Fp8Permutes FP8_PERMUTES{};

// 16-bit lanes whose high byte is an fp8 code -> bf16 patterns of fp8(c) * 2^-120 (the low byte ignored).
QK_AVX512VBMI inline __m512bh fp8_high_bytes_to_bf16(__m512i x) {
  return (__m512bh)_mm512_and_si512(_mm512_srai_epi16(x, 4), _mm512_set1_epi16(FP8_MASK16));
}

// scores_tile_bf16dot for an fp8 cache, D a multiple of 4.
template <int GT>
QK_AVX512VBMI void scores_tile_fp8_vbmi(const Rows& rows, const uint16_t* qb, int64_t D, float* s, int64_t ld) {
  const __m512i perm = _mm512_load_si512(FP8_PERMUTES.key);
  const int64_t next = D * TILE;
  for (int64_t r = 0; r < rows.n; r += 2 * TILE) {
    const uint8_t* t0 = rows.data + key_index(r, 0, D);
    prefetch(t0 + KEY_AHEAD * next, 2 * next);
    __m512 a0[GT], a1[GT];
    for (int g = 0; g < GT; ++g) a0[g] = a1[g] = _mm512_setzero_ps();
    for (int64_t e = 0; e < D; e += 4) {  // rows e..e + 3 of each tile: 64 contiguous codes
      const __m512i x0 = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(t0 + e * TILE));
      const __m512i x1 = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(t0 + next + e * TILE));
      const __m512bh lo0 = fp8_high_bytes_to_bf16(_mm512_slli_epi16(x0, 8)), hi0 = fp8_high_bytes_to_bf16(x0);
      const __m512bh lo1 = fp8_high_bytes_to_bf16(_mm512_slli_epi16(x1, 8)), hi1 = fp8_high_bytes_to_bf16(x1);
      for (int g = 0; g < GT; ++g) {
        const __m512bh q01 = (__m512bh)_mm512_set1_epi32(load_pair(qb + g * D + e));
        const __m512bh q23 = (__m512bh)_mm512_set1_epi32(load_pair(qb + g * D + e + 2));
        a0[g] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a0[g], lo0, q01), hi0, q23);
        a1[g] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a1[g], lo1, q01), hi1, q23);
      }
    }
    const __m512 f = _mm512_set1_ps(score_factor<quantkit::KV_FP8>());
    for (int g = 0; g < GT; ++g) {
      _mm512_storeu_ps(s + g * ld + r, _mm512_mul_ps(a0[g], f));
      _mm512_storeu_ps(s + g * ld + r + TILE, _mm512_mul_ps(a1[g], f));
    }
  }
}

QK_AVX512VBMI void scores_fp8_vbmi(const Rows& rows, const float* q, int64_t G, int64_t D, float* s, int64_t ld) {
  const uint16_t* qb = bf16_rows(q, 1, 0, G * D);
  for (int64_t g0 = 0; g0 < G; g0 += KEY_TILE) {
#define QK_CALL(T) scores_tile_fp8_vbmi<T>(rows, qb + g0 * D, D, s + g0 * ld, ld)
    QK_TILE_SWITCH(G - g0, KEY_TILE, QK_CALL)
#undef QK_CALL
  }
}

// values_tile_bf16dot for an fp8 cache; D = 64 * NQ.
template <int NQ, int GT>
QK_AVX512VBMI void values_tile_fp8_vbmi(const Rows& rows, const uint16_t* pb, int64_t ldb, float* o) {
  constexpr int64_t D = 64 * NQ;
  __m512i perm[4];
  for (int c = 0; c < 4; ++c) perm[c] = _mm512_load_si512(FP8_PERMUTES.value[c]);
  __m512 acc[GT][4 * NQ];
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < 4 * NQ; ++j) acc[g][j] = _mm512_loadu_ps(o + g * D + 16 * j);
  int64_t r = 0;
  for (; r + 1 < rows.n; r += 2) {
    const uint8_t* row = rows.data + r * D;
    prefetch(row + VALUE_AHEAD * D, 2 * D);
    __m512bh w[GT];
    for (int g = 0; g < GT; ++g) w[g] = (__m512bh)_mm512_set1_epi32(load_pair(pb + g * ldb + r));
    for (int c4 = 0; c4 < NQ; ++c4) {  // dims [64 c4, 64 c4 + 64) of rows r and r + 1
      const __m512i a = _mm512_loadu_si512(row + 64 * c4), b = _mm512_loadu_si512(row + D + 64 * c4);
      for (int c = 0; c < 4; ++c) {  // dims 16 c .. 16 c + 15 of them, in pairs
        const __m512bh v = fp8_high_bytes_to_bf16(_mm512_permutex2var_epi8(a, perm[c], b));
        for (int g = 0; g < GT; ++g) acc[g][4 * c4 + c] = _mm512_dpbf16_ps(acc[g][4 * c4 + c], v, w[g]);
      }
    }
  }
  if (r < rows.n) add_odd_value_row<quantkit::KV_FP8>(rows.data + r * D, pb, ldb, r, acc);
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < 4 * NQ; ++j) _mm512_storeu_ps(o + g * D + 16 * j, acc[g][j]);
}

template <int NQ>
QK_AVX512VBMI void values_fp8_vbmi(const Rows& rows, const float* p, int64_t G, int64_t ld, float* o, int64_t) {
  const uint16_t* pb = bf16_rows(p, G, ld, rows.n);  // the weights in bf16, [G, n]
  constexpr int TILE = value_tile_bf16dot(2 * NQ);
  for (int64_t g0 = 0; g0 < G; g0 += TILE) {
#define QK_CALL(T) values_tile_fp8_vbmi<NQ, T>(rows, pb + g0 * rows.n, rows.n, o + g0 * 64 * NQ)
    QK_TILE_SWITCH(G - g0, TILE, QK_CALL)
#undef QK_CALL
  }
}

// ----------------------------------------------------------------------------------------------- AVX2

QK_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int DT>
QK_AVX2 inline __m256 load8(const uint8_t* data, int64_t i) {
  if constexpr (DT == quantkit::KV_FP32) return _mm256_loadu_ps(reinterpret_cast<const float*>(data) + i);
  if constexpr (DT == quantkit::KV_BF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 2 * i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  if constexpr (DT == quantkit::KV_FP16)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 2 * i)));
  if constexpr (DT == quantkit::KV_FP8) {  // as load16
    const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(data + i)));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(w, 20), _mm256_set1_epi32(FP8_MASK)));
  }
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(data + i))));
}

// One key tile (16 positions, two vectors) at a time: 2 * GT independent accumulators.
template <int DT, int GT>
QK_AVX2 void scores_tile_avx2(const Rows& rows, const float* q, int64_t D, float* s, int64_t ld) {
  for (int64_t r = 0; r < rows.n; r += TILE) {
    constexpr int64_t vb = value_bytes(static_cast<KvDtype>(DT));
    const uint8_t* t0 = rows.data + key_index(r, 0, D) * vb;
    prefetch(t0 + KEY_AHEAD * D * TILE * vb, D * TILE * vb);
    __m256 a0[GT], a1[GT];
    for (int g = 0; g < GT; ++g) a0[g] = a1[g] = _mm256_setzero_ps();
    for (int64_t e = 0; e < D; ++e) {
      const __m256 k0 = load8<DT>(t0, e * TILE), k1 = load8<DT>(t0, e * TILE + 8);
      for (int g = 0; g < GT; ++g) {
        const __m256 qv = _mm256_set1_ps(q[g * D + e]);
        a0[g] = _mm256_fmadd_ps(qv, k0, a0[g]);
        a1[g] = _mm256_fmadd_ps(qv, k1, a1[g]);
      }
    }
    const bool int8 = DT == quantkit::KV_INT8;
    const __m256 f = _mm256_set1_ps(score_factor<DT>());
    const __m256 s0 = int8 ? _mm256_loadu_ps(rows.scale + r) : f;  // int8's factor is 1
    const __m256 s1 = int8 ? _mm256_loadu_ps(rows.scale + r + 8) : f;
    for (int g = 0; g < GT; ++g) {
      _mm256_storeu_ps(s + g * ld + r, _mm256_mul_ps(a0[g], s0));
      _mm256_storeu_ps(s + g * ld + r + 8, _mm256_mul_ps(a1[g], s1));
    }
  }
}

template <int DT>
QK_AVX2 void scores_avx2(const Rows& rows, const float* q, int64_t G, int64_t D, float* s, int64_t ld) {
  for (int64_t g0 = 0; g0 < G; g0 += KEY_TILE) {
#define QK_CALL(T) scores_tile_avx2<DT, T>(rows, q + g0 * D, D, s + g0 * ld, ld)
    QK_TILE_SWITCH(G - g0, KEY_TILE, QK_CALL)
#undef QK_CALL
  }
}

// AVX2 has 16 vector registers: the outputs stay in memory (L1), each value row is converted once.
template <int DT, int NV>
QK_AVX2 void values_avx2(const Rows& rows, const float* p, int64_t G, int64_t ld, float* o, int64_t) {
  constexpr int64_t D = 8 * NV;
  constexpr int64_t row_bytes = D * value_bytes(static_cast<KvDtype>(DT));
  for (int64_t r = 0; r < rows.n; ++r) {
    const uint8_t* row = rows.data + r * row_bytes;
    prefetch(row + VALUE_AHEAD * row_bytes, row_bytes);
    const float sc = DT == quantkit::KV_INT8 ? rows.scale[r] : 1.f;
    for (int j = 0; j < NV; ++j) {
      const __m256 v = load8<DT>(row, 8 * j);
      for (int64_t g = 0; g < G; ++g) {
        float* og = o + g * D + 8 * j;
        _mm256_storeu_ps(og, _mm256_fmadd_ps(_mm256_set1_ps(p[g * ld + r] * sc), v, _mm256_loadu_ps(og)));
      }
    }
  }
}

QK_AVX2 inline __m256 exp8(__m256 x, int shift) {  // as exp16
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127 + shift)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

QK_AVX2 float exp_sum_avx2(float* x, int64_t n, float* m, int shift) {
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(x + j));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  float best = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  for (; j < n; ++j) best = std::max(best, x[j]);
  *m = best;
  const __m256 mv = _mm256_set1_ps(best);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv), shift);
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum8(acc);
  for (; i < n; ++i) sum += (x[i] = std::ldexp(std::exp(x[i] - best), shift));
  return sum;
}
#endif

// ------------------------------------------------------------------------------------------ dispatch

#if defined(__x86_64__) || defined(__i386__)
// The avx512-bf16 path's values kernel for head_dim D (bf16 / fp8 caches), nullptr where it has none.
template <int DT>
decltype(Kernels::values) bf16dot_values(int64_t D) {
  switch (D) {
    case 64: return &values_bf16dot<DT, 2>;
    case 96: return &values_bf16dot<DT, 3>;
    case 128: return &values_bf16dot<DT, 4>;
    case 256: return &values_bf16dot<DT, 8>;
    case 80: return &values_avx512<DT, 5>;
    default: return nullptr;
  }
}
#endif

template <int DT>
Kernels pick_dtype(int64_t isa, int64_t D) {
#if defined(__x86_64__) || defined(__i386__)
#define QK_CASE(W, NAME, NV) \
  case W * NV: return {&scores_##NAME<DT>, &values_##NAME<DT, NV>, &exp_sum_##NAME};
  if constexpr (DT == quantkit::KV_FP8)
    if (isa >= ISA_AVX512_BF16_VBMI && D % 4 == 0) {  // values: D a multiple of 64, else the bf16dot code
      Kernels k{&scores_fp8_vbmi, nullptr, &exp_sum_avx512};
      switch (D) {
        case 64: k.values = &values_fp8_vbmi<1>; break;
        case 128: k.values = &values_fp8_vbmi<2>; break;
        case 256: k.values = &values_fp8_vbmi<4>; break;
        default: k.values = bf16dot_values<DT>(D); break;
      }
      if (k.values) return k;
    }
  if constexpr (DT == quantkit::KV_BF16 || DT == quantkit::KV_FP8)
    if (isa >= ISA_AVX512_BF16) {  // keys: any D; values: D a multiple of 32 (else the fp32 AVX-512 code)
      const Kernels k{&scores_bf16dot<DT>, bf16dot_values<DT>(D), &exp_sum_avx512};
      if (k.values) return k;
    }
  if (isa >= ISA_AVX512) switch (D) { QK_CASE(16, avx512, 4) QK_CASE(16, avx512, 5) QK_CASE(16, avx512, 6)
                                      QK_CASE(16, avx512, 8) QK_CASE(16, avx512, 16) default: break; }
  if (isa >= ISA_AVX2) switch (D) { QK_CASE(8, avx2, 8) QK_CASE(8, avx2, 10) QK_CASE(8, avx2, 12)
                                    QK_CASE(8, avx2, 16) QK_CASE(8, avx2, 32) default: break; }
#undef QK_CASE
#endif
  return {&scores_scalar<DT>, &values_scalar<DT>, &exp_sum_scalar};
}

Kernels pick(KvDtype t, int64_t isa, int64_t D) {
  switch (t) {
    case quantkit::KV_FP32: return pick_dtype<quantkit::KV_FP32>(isa, D);
    case quantkit::KV_BF16: return pick_dtype<quantkit::KV_BF16>(isa, D);
    case quantkit::KV_FP16: return pick_dtype<quantkit::KV_FP16>(isa, D);
    case quantkit::KV_FP8: return pick_dtype<quantkit::KV_FP8>(isa, D);
    default: return pick_dtype<quantkit::KV_INT8>(isa, D);
  }
}

constexpr int64_t ALIGN = 2 * TILE;  // chunks, blocks and so every run start at a multiple of two key tiles

// Positions per task (a multiple of ALIGN): enough tasks for every thread several times over, 64 to 1024 each.
int64_t pick_chunk(int64_t runs, int64_t max_len) {
  const int64_t want = 4 * std::max<int64_t>(1, at::get_num_threads());
  const int64_t per_run = std::max<int64_t>(1, (want + runs - 1) / runs);
  const int64_t c = (max_len + per_run - 1) / per_run;
  return std::min<int64_t>(1024, std::max<int64_t>(64, (c + ALIGN - 1) / ALIGN * ALIGN));
}

}  // namespace

namespace quantkit {

void decode_attention_cpu(const float* q, int64_t q_stride, float* out, int64_t heads, const KvBlocks& c,
                          const int64_t* lengths, float sm_scale, int64_t chunk, int64_t isa) {
  const int64_t B = c.batch, Hkv = c.kv_heads, D = c.head_dim, G = heads / Hkv, bs = c.block;
  TORCH_CHECK(B > 0 && Hkv > 0 && heads % Hkv == 0 && D > 0 && bs > 0, "decode_attention_cpu: invalid shape");
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lengths[b] >= 1 && lengths[b] <= bs * static_cast<int64_t>(c.k.size()),
                "decode_attention_cpu: sequence ", b, " has length ", lengths[b], " outside the cache's ",
                bs * static_cast<int64_t>(c.k.size()), " positions");
    max_len = std::max(max_len, lengths[b]);
  }
  isa = isa < 0 ? detected_isa() : std::min(isa, detected_isa());
  const Kernels kern = pick(c.dtype, isa, D);
  TORCH_CHECK(bs % ALIGN == 0, "decode_attention_cpu: blocks of ", bs, " positions (a multiple of ", ALIGN, ")");
  chunk = chunk <= 0 ? pick_chunk(B * Hkv, max_len) : (chunk + ALIGN - 1) / ALIGN * ALIGN;
  const int64_t nch = (max_len + chunk - 1) / chunk, tasks = B * Hkv * nch;
  const int64_t vbytes = value_bytes(c.dtype);
  std::vector<float> part_o(tasks * G * D), part_m(tasks * G), part_l(tasks * G);
  const bool fp8 = c.dtype == KV_FP8;
  const int p_shift = fp8 ? FP8_P : 0;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    const SubnormalsAreZero daz(fp8);
    std::vector<float> qs(G * D), s(G * chunk);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / (Hkv * nch), h = task / nch % Hkv, ci = task % nch;
      const int64_t p0 = ci * chunk, p1 = std::min(p0 + chunk, lengths[b]), n = p1 - p0;
      float* o = part_o.data() + task * G * D;
      std::fill(o, o + G * D, 0.f);
      if (n <= 0) {
        std::fill(part_m.data() + task * G, part_m.data() + (task + 1) * G, -std::numeric_limits<float>::infinity());
        std::fill(part_l.data() + task * G, part_l.data() + (task + 1) * G, 0.f);
        continue;
      }
      const float kf = sm_scale * (fp8 ? std::ldexp(c.k_head_scale[h], FP8_Q) : 1.f);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + b * q_stride + (h * G + g) * D;
        for (int64_t e = 0; e < D; ++e) qs[g * D + e] = qg[e] * kf;
      }
      for (int pass = 0; pass < 2; ++pass) {  // 0: scores of the chunk's keys, 1: its values weighted
        for (int64_t p = p0; p < p1;) {  // runs inside one block, each starting at a multiple of ALIGN
          const int64_t blk = p / bs, w = p % bs, len = std::min(p1 - p, bs - w), slab = (b * Hkv + h) * bs;
          const float* scale = c.dtype == KV_INT8 ? (pass == 0 ? c.k_scale[blk] : c.v_scale[blk]) + slab + w : nullptr;
          float* sp = s.data() + (p - p0);
          if (pass == 0)  // keys: the tile of position w
            kern.scores(Rows{static_cast<const uint8_t*>(c.k[blk]) + (slab + w) * D * vbytes, scale, len},
                        qs.data(), G, D, sp, chunk);
          else  // values: row w
            kern.values(Rows{static_cast<const uint8_t*>(c.v[blk]) + (slab + w) * D * vbytes, scale, len},
                        sp, G, chunk, o, D);
          p += len;
        }
        if (pass == 0)
          for (int64_t g = 0; g < G; ++g) {
            part_l[task * G + g] = kern.exp_sum(s.data() + g * chunk, n, &part_m[task * G + g], p_shift);
          }
      }
    }
  });
  at::parallel_for(0, B * heads, 16, [&](int64_t r0, int64_t r1) {
    const SubnormalsAreZero daz(fp8);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / heads, hq = r % heads, h = hq / G, g = hq % G;
      const int64_t first = (b * Hkv + h) * nch;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t ci = 0; ci < nch; ++ci) mx = std::max(mx, part_m[(first + ci) * G + g]);
      float* dst = out + r * D;
      std::fill(dst, dst + D, 0.f);
      float total = 0.f;
      for (int64_t ci = 0; ci < nch; ++ci) {
        const int64_t t = first + ci;
        if (part_l[t * G + g] == 0.f) continue;
        const float w = std::exp(part_m[t * G + g] - mx);
        total += w * part_l[t * G + g];
        const float* o = part_o.data() + (t * G + g) * D;
        for (int64_t e = 0; e < D; ++e) dst[e] += w * o[e];
      }
      const float f = fp8 ? std::ldexp(c.v_head_scale[h] / total, FP8_EXP) : 1.f / total;
      for (int64_t e = 0; e < D; ++e) dst[e] *= f;
    }
  });
}

}  // namespace quantkit

namespace {

KvDtype kv_dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return quantkit::KV_FP32;
    case at::kBFloat16: return quantkit::KV_BF16;
    case at::kHalf: return quantkit::KV_FP16;
    case at::kFloat8_e4m3fn: return quantkit::KV_FP8;
    case at::kChar: return quantkit::KV_INT8;
    default: TORCH_CHECK(false, "decode_attention_cpu: a cache of ", t, " (fp32, bf16, fp16, float8_e4m3fn or int8)");
  }
}

// The op, for tests and callers outside the decode loop: q fp32 [B, Hq, D]; per block of `block`
// positions (a multiple of 32), keys [B, Hkv, block / 16, D, 16] and values [B, Hkv, block, D] of one dtype;
// k_scales / v_scales: int8 only, fp32 [B, Hkv, block] per block; k_head_scale / v_head_scale: fp8
// only, fp32 [Hkv] (or [1]); lengths int64 [B], each in 1 .. the blocks' positions.
at::Tensor decode_attention_cpu_op(const at::Tensor& q, at::TensorList k_blocks, at::TensorList v_blocks,
                                   at::TensorList k_scales, at::TensorList v_scales,
                                   const c10::optional<at::Tensor>& k_head_scale,
                                   const c10::optional<at::Tensor>& v_head_scale, const at::Tensor& lengths,
                                   double sm_scale, int64_t chunk, int64_t isa) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "decode_attention_cpu: q must be fp32 [B, Hq, D]");
  TORCH_CHECK(!k_blocks.empty() && k_blocks.size() == v_blocks.size(), "decode_attention_cpu: one or more blocks, "
              "as many values as keys");
  KvBlocks c;
  c.dtype = kv_dtype_of(k_blocks[0].scalar_type());
  TORCH_CHECK(v_blocks[0].dim() == 4, "decode_attention_cpu: values must be [B, Hkv, block, D]");
  c.batch = q.size(0), c.kv_heads = v_blocks[0].size(1), c.head_dim = q.size(2), c.block = v_blocks[0].size(2);
  std::vector<at::Tensor> keep;  // contiguous copies live until the call returns
  const bool int8 = c.dtype == quantkit::KV_INT8;
  TORCH_CHECK(!int8 || (k_scales.size() == k_blocks.size() && v_scales.size() == k_blocks.size()),
              "decode_attention_cpu: an int8 cache needs a scale tensor per block for keys and values");
  const std::vector<int64_t> kshape{c.batch, c.kv_heads, c.block / TILE, c.head_dim, TILE},
      vshape{c.batch, c.kv_heads, c.block, c.head_dim};
  for (size_t i = 0; i < k_blocks.size(); ++i) {
    TORCH_CHECK(k_blocks[i].sizes() == kshape && v_blocks[i].sizes() == vshape &&
                    k_blocks[i].scalar_type() == k_blocks[0].scalar_type() &&
                    v_blocks[i].scalar_type() == k_blocks[i].scalar_type(),
                "decode_attention_cpu: every block must be keys [B, Hkv, block / 16, D, 16] and values [B, Hkv, block, D] "
                "of one dtype");
    keep.push_back(k_blocks[i].contiguous());
    c.k.push_back(keep.back().data_ptr());
    keep.push_back(v_blocks[i].contiguous());
    c.v.push_back(keep.back().data_ptr());
    if (int8) {
      for (const at::Tensor& t : {k_scales[i], v_scales[i]})
        TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == c.batch * c.kv_heads * c.block,
                    "decode_attention_cpu: int8 scales must be fp32 [B, Hkv, block]");
      keep.push_back(k_scales[i].contiguous());
      c.k_scale.push_back(keep.back().data_ptr<float>());
      keep.push_back(v_scales[i].contiguous());
      c.v_scale.push_back(keep.back().data_ptr<float>());
    }
  }
  at::Tensor ks, vs;
  if (c.dtype == quantkit::KV_FP8) {
    TORCH_CHECK(k_head_scale.has_value() && v_head_scale.has_value(), "decode_attention_cpu: fp8 needs k / v scales");
    ks = k_head_scale->to(at::kFloat).reshape({-1}).expand({c.kv_heads}).contiguous();
    vs = v_head_scale->to(at::kFloat).reshape({-1}).expand({c.kv_heads}).contiguous();
    c.k_head_scale = ks.data_ptr<float>(), c.v_head_scale = vs.data_ptr<float>();
  }
  const at::Tensor len = lengths.to(at::kLong).contiguous();
  TORCH_CHECK(len.numel() == c.batch, "decode_attention_cpu: one length per sequence");
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  quantkit::decode_attention_cpu(qc.data_ptr<float>(), qc.size(1) * c.head_dim, out.data_ptr<float>(), qc.size(1), c,
                                 len.data_ptr<int64_t>(), static_cast<float>(sm_scale), chunk, isa);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantkit, m) {
  m.def("decode_attention_cpu(Tensor q, Tensor[] k_blocks, Tensor[] v_blocks, Tensor[] k_scales, Tensor[] v_scales, "
        "Tensor? k_head_scale, Tensor? v_head_scale, Tensor lengths, float sm_scale, int chunk=0, int isa=-1) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantkit, CPU, m) { m.impl("decode_attention_cpu", &decode_attention_cpu_op); }
