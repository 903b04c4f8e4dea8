// CPU weight-only linear for decode: int8-quantized activations x int4/int8 weights, integer dot products.
//
// y[m, n] = sum_k x[m, k] * (u[n, k] - z[n, g]) * s[n, g]   (g = k / group_size)
//
// The activations are rounded to int8 per block of 32 values (one fp32 scale d = amax / 127 per block,
// q = round-to-nearest-even(x / d), as llama.cpp's Q8_0), so every block's product with a weight row is an
// exact int32 dot product; each block's sum is scaled once in fp32 (d * s) and accumulated in fp32.
// The zero point is applied per group from the activation block sums: y -= s * z * sum_b d_b * sum(q_b).
//
// Weight layout (built once by quantkit.kernels.wna16_layout.to_cpu_q8_layout), K padded to Kp, a
// multiple of 64 (padding weights are 0, padding activations are 0):
//   int4: uint8 [N, Kp/2]; superblock t (64 values) is 32 bytes; byte j holds the unsigned value
//         u = q + 8 of k = 64t + j in its low nibble and of k = 64t + 32 + j in its high nibble, so one
//         32-byte load gives two blocks of 32 consecutive values (low nibbles, then high nibbles);
//   int8: int8 [N, Kp], the signed q itself, K contiguous.
//   scale: fp32 [N, G]; zero: fp32 [N, G] (asymmetric only) holding the integer zero in the kernel's
//         domain (int4: zp + 8, int8: zp); absent: 8 (int4) / 0 (int8).
//
// Three code paths in one build, chosen at run time from the CPU (or forced, for tests):
//   AVX-512 VNNI (_mm512_dpbusd_epi32, 64 values per instruction), AVX2 (_mm256_maddubs_epi16 +
//   _mm256_madd_epi16, as llama.cpp; int8 through the sign trick) and portable scalar code.
// They compute the same integer block sums; only the order of the fp32 additions differs.
//
// Two loop structures: one row of x (decode) up to a few rows runs the per-row code (each weight row's
// dot products with up to 4 rows of x); from LANES_MIN_ROWS rows (batches, prompts) the lanes code puts
// 8 or 16 rows of x in the lanes of one vector, unpacks each weight row once per call and multiplies 4
// weights broadcast to every lane by the rows' 4 activations per instruction (an int8 GEMM, register-
// blocked over 8 (AVX-512) or 4 (AVX2) weight rows and 8 / 16 rows of x).
#include <cstring>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_isa.h"
#include "q8dot.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using quantkit::detected_isa;
using quantkit::ISA_AVX2;
using quantkit::ISA_AVX512;
using quantkit::ISA_SCALAR;

int64_t g_forced_isa = -1;  // -1: the CPU's best

int64_t active_isa() {
  return g_forced_isa >= 0 ? std::min(g_forced_isa, detected_isa()) : detected_isa();
}

constexpr int BLOCK = 32;   // activation block (values per fp32 scale)
constexpr int SUPER = 64;   // values per superblock of the weight layout
constexpr int MB_MAX = 4;   // rows of x per pass over a weight row (the per-row code)
// Rows of x from which the AVX-512 / AVX2 paths take the lanes code (int4, int8): below them the per-row
// code streams the weight faster (measured on a 2-core Xeon, AVX-512 VNNI: evals/kernels/cpu_q8dot_batch).
constexpr int64_t LANES_MIN_ROWS[2] = {4, 8};

// The activations, quantized per block of 32: q int8 [M, Kp], d fp32 [M, nb] (nb = Kp / 32), per group g
// the fp32 sum over its blocks of d_b * sum(q_b) (xg [M, G]) for the zero-point term; for the per-row
// AVX-512 code the same d repeated per 32-bit lane (de [M, Kp/64, 16]); for the lanes code (2 rows or
// more) the rows interleaved in chunks of L (xi [chunks, K/32, 8, L] dwords, di [chunks, K/32, L]).
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> d, de, xg;
  std::vector<int32_t> xi;
  std::vector<float> di, xgi;
};

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

// One block of 32 values -> q (int8) and d; returns sum(q). Portable code.
template <typename T>
int32_t quantize_block(const T* v, int8_t* q, float* d_out) {
  float f[BLOCK];
  float amax = 0.f;
  for (int j = 0; j < BLOCK; ++j) {
    f[j] = to_f(v[j]);
    amax = std::max(amax, std::fabs(f[j]));
  }
  const float d = amax / 127.0f;
  const float id = d != 0.f ? 1.0f / d : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < BLOCK; ++j) {
    float t = std::nearbyint(f[j] * id);
    t = std::min(127.f, std::max(-127.f, t));
    q[j] = static_cast<int8_t>(t);
    sum += q[j];
  }
  *d_out = d;
  return sum;
}

#if defined(__x86_64__) || defined(__i386__)
#define QK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QK_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))

template <typename T>
QK_AVX2 inline __m256 load8_f(const T* p);
template <>
QK_AVX2 inline __m256 load8_f<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
QK_AVX2 inline __m256 load8_f<c10::BFloat16>(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <>
QK_AVX2 inline __m256 load8_f<c10::Half>(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The same rounding with AVX2, bit for bit (max is exact in any order; _mm256_round_ps to nearest is
// nearbyint in the default rounding mode).
template <typename T>
QK_AVX2 int32_t quantize_block_avx2(const T* v, int8_t* q, float* d_out) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 f[4];
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    f[i] = load8_f(v + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_and_ps(f[i], absmask));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.0f;
  const __m256 id = _mm256_set1_ps(d != 0.f ? 1.0f / d : 0.f);
  const __m256 hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  __m256i qi[4];
  __m256i s = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256 t = _mm256_round_ps(_mm256_mul_ps(f[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    qi[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, t)));
    s = _mm256_add_epi32(s, qi[i]);
  }
  // packs interleave the 128-bit lanes: dwords come out as q0[0:4] q1[0:4] q2[0:4] q3[0:4] q0[4:8] ...
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  *d_out = d;
  return _mm_cvtsi128_si32(s4);
}
#endif

template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int64_t kp, int64_t groups, bool expand, bool avx2, QuantizedX& out) {
  const int64_t nb = kp / BLOCK, kb = k / BLOCK, bpg = kb / groups;
  out.q.assign(m * kp, 0);
  out.d.assign(m * nb, 0.f);
  out.de.assign(expand ? m * nb * 8 : 0, 0.f);
  out.xg.assign(m * groups, 0.f);
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < kb; ++b) {
        const T* v = x + r * k + b * BLOCK;
        int8_t* q = out.q.data() + r * kp + b * BLOCK;
        float d;
#if defined(__x86_64__) || defined(__i386__)
        const int32_t sum = avx2 ? quantize_block_avx2(v, q, &d) : quantize_block(v, q, &d);
#else
        const int32_t sum = quantize_block(v, q, &d);
#endif
        out.d[r * nb + b] = d;
        if (expand)
          for (int j = 0; j < 8; ++j) out.de[r * nb * 8 + b * 8 + j] = d;
        out.xg[r * groups + b / bpg] += d * static_cast<float>(sum);
      }
    }
  });
}

// The rows of x in chunks of L lanes (rows past M are 0): xi[c][b][j][l] = dword j of block b of row
// c * L + l, di[c][b][l] its block scale.
void interleave_rows(int64_t m, int64_t kp, int64_t kb, int64_t groups, int lanes, QuantizedX& qx) {
  const int64_t chunks = (m + lanes - 1) / lanes, nb = kp / BLOCK;
  qx.xi.assign(chunks * kb * 8 * lanes, 0);
  qx.di.assign(chunks * kb * lanes, 0.f);
  qx.xgi.assign(chunks * groups * lanes, 0.f);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      for (int64_t l = 0; l < lanes && c * lanes + l < m; ++l) {
        const int64_t row = c * lanes + l;
        const int8_t* q = qx.q.data() + row * kp;
        for (int64_t b = 0; b < kb; ++b) {
          int32_t* dst = qx.xi.data() + (c * kb + b) * 8 * lanes + l;
          for (int j = 0; j < 8; ++j) std::memcpy(dst + j * lanes, q + b * BLOCK + 4 * j, 4);
          qx.di[(c * kb + b) * lanes + l] = qx.d[row * nb + b];
        }
        for (int64_t g = 0; g < groups; ++g) qx.xgi[(c * groups + g) * lanes + l] = qx.xg[row * groups + g];
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------------
// Per weight row: raw[mi] = sum_b d[mi, b] * s[g(b)] * dot(u_b, q[mi]_b) for MB rows of x.
// ---------------------------------------------------------------------------------------------------
struct RowArgs {
  const uint8_t* w;     // the row's weight bytes
  const float* s;       // the row's scales [G]
  int64_t nsb;          // superblocks (Kp / 64)
  int64_t kb;           // real blocks (K / 32)
  int64_t bpg;          // blocks per group
  const int8_t* q;      // x rows (first of MB), stride kp
  const float* d;       // block scales (first of MB), stride nb
  const float* de;      // lane-expanded block scales, stride nb * 8
  int64_t kp, nb;
  const int32_t* group;  // [nb]: the group of each block (padding blocks: the last group), no division per block
};

inline float scale_of(const RowArgs& a, int64_t b) { return a.s[a.group[b]]; }

// Software prefetch, one block of rows ahead: the weight rows after the ones being read are the next
// bytes of the weight, so while superblock t of these rows is read, the same share of the next rows is
// fetched into the cache. Measured on a Zen 5 EPYC, batch 1 from DRAM: a median 1.7x (AVX-512) / 2.0x (AVX2) the GB/s
// of the hardware prefetchers alone (evals/kernels/cpu_decoder/README.md).
inline void prefetch_bytes(const char* p, int64_t bytes) {
#if defined(__x86_64__) || defined(__i386__)
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
#else
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
#endif
}

// One row, superblock t: the same share of the row after it.
template <int BITS>
inline void prefetch_next_row(const RowArgs& a, int64_t t) {
  constexpr int64_t step = BITS == 4 ? 32 : SUPER;
  prefetch_bytes(reinterpret_cast<const char*>(a.w) + a.nsb * step + t * step, step);
}

template <int BITS, int MB>
void row_scalar(const RowArgs& a, float* raw) {
  float acc[MB] = {};
  for (int64_t t = 0; t < a.nsb; ++t) {
    int32_t wv[SUPER];
    if (BITS == 4) {
      const uint8_t* p = a.w + t * 32;
      for (int j = 0; j < 32; ++j) {
        wv[j] = p[j] & 0x0F;
        wv[j + 32] = p[j] >> 4;
      }
    } else {
      const int8_t* p = reinterpret_cast<const int8_t*>(a.w) + t * SUPER;
      for (int j = 0; j < SUPER; ++j) wv[j] = p[j];
    }
    for (int h = 0; h < 2; ++h) {
      const int64_t b = 2 * t + h;
      const float s = scale_of(a, b);
      for (int mi = 0; mi < MB; ++mi) {
        const int8_t* q = a.q + mi * a.kp + b * BLOCK;
        int32_t dot = 0;
        for (int j = 0; j < BLOCK; ++j) dot += wv[h * BLOCK + j] * q[j];
        acc[mi] += static_cast<float>(dot) * (s * a.d[mi * a.nb + b]);
      }
    }
  }
  for (int mi = 0; mi < MB; ++mi) raw[mi] = acc[mi];
}

#if defined(__x86_64__) || defined(__i386__)

QK_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One block of 32 weights (w: 32 bytes, unsigned for int4 / signed for int8) against MB x rows.
template <int BITS, int MB>
QK_AVX2 inline void block_avx2(__m256i w, const RowArgs& a, int64_t b, __m256* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  const float s = scale_of(a, b);
  __m256i wa = w;
  if (BITS == 8) wa = _mm256_sign_epi8(w, w);  // |q| (-128 -> 0x80 = 128 unsigned)
  for (int mi = 0; mi < MB; ++mi) {
    __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + mi * a.kp + b * BLOCK));
    if (BITS == 8) x = _mm256_sign_epi8(x, w);  // sign(q) * x: |q| * sign(q) * x = q * x
    const __m256i p16 = _mm256_maddubs_epi16(wa, x);  // int4: <= 2*15*127; int8: <= 2*128*127: no saturation
    const __m256i p32 = _mm256_madd_epi16(p16, ones);
    const __m256 sc = _mm256_set1_ps(s * a.d[mi * a.nb + b]);
    acc[mi] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), sc, acc[mi]);
  }
}

template <int BITS, int MB>
QK_AVX2 void row_avx2(const RowArgs& a, float* raw) {
  __m256 acc0[MB], acc1[MB];
  for (int mi = 0; mi < MB; ++mi) acc0[mi] = acc1[mi] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int64_t t = 0; t < a.nsb; ++t) {
    prefetch_next_row<BITS>(a, t);
    __m256i lo, hi;
    if (BITS == 4) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.w + t * 32));
      lo = _mm256_and_si256(v, mask);
      hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    } else {
      lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.w + t * SUPER));
      hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.w + t * SUPER + 32));
    }
    block_avx2<BITS, MB>(lo, a, 2 * t, acc0);
    block_avx2<BITS, MB>(hi, a, 2 * t + 1, acc1);
  }
  for (int mi = 0; mi < MB; ++mi) raw[mi] = hsum256(_mm256_add_ps(acc0[mi], acc1[mi]));
}

template <int BITS, int MB>
QK_AVX512 inline void super_avx512(const RowArgs& a, int64_t t, __m512* acc) {
  __m512i w;
  if (BITS == 4) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.w + t * 32));
    const __m256i lo = _mm256_and_si256(v, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  } else {  // signed q -> unsigned q + 128 (dpbusd multiplies unsigned by signed bytes)
    w = _mm512_xor_si512(_mm512_loadu_si512(a.w + t * SUPER), _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  const float s0 = scale_of(a, 2 * t), s1 = scale_of(a, 2 * t + 1);
  const __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(s0), _mm256_set1_ps(s1), 1);
  for (int mi = 0; mi < MB; ++mi) {
    const __m512i x = _mm512_loadu_si512(a.q + mi * a.kp + t * SUPER);
    const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);  // lanes 0-7: block 2t, 8-15: 2t+1
    const __m512 sc = _mm512_mul_ps(sv, _mm512_loadu_ps(a.de + mi * a.nb * 8 + t * 16));
    acc[mi] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[mi]);
  }
}

template <int BITS, int MB>
QK_AVX512 void row_avx512(const RowArgs& a, float* raw) {
  __m512 acc0[MB], acc1[MB];
  for (int mi = 0; mi < MB; ++mi) acc0[mi] = acc1[mi] = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 1 < a.nsb; t += 2) {
    prefetch_next_row<BITS>(a, t);
    prefetch_next_row<BITS>(a, t + 1);
    super_avx512<BITS, MB>(a, t, acc0);
    super_avx512<BITS, MB>(a, t + 1, acc1);
  }
  if (t < a.nsb) super_avx512<BITS, MB>(a, t, acc0);
  for (int mi = 0; mi < MB; ++mi) raw[mi] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[mi], acc1[mi]));
}

// ---------------------------------------------------------------------------------------------------
// Groups that are whole superblocks (group size a multiple of 64, or one group per row): NR weight rows
// at a time against MB x rows. Per superblock and (row, x row) one integer dot product, one conversion
// and one FMA by the activation scale into a per-group accumulator; the weight scale multiplies that
// accumulator once per group. The x vectors and their scales are loaded once for the NR rows.
// ---------------------------------------------------------------------------------------------------
struct Rows {
  const uint8_t* w;     // first row's weight bytes; row r at w + r * row_bytes
  int64_t row_bytes;
  const float* s;       // first row's scales; row r at s + r * groups
  int64_t groups;
  int64_t nsb;          // superblocks per row (Kp / 64)
  int64_t spg;          // superblocks per group
  const int8_t* q;      // x rows (first of MB), stride kp
  const float* d;       // block scales, stride nb
  const float* de;      // lane-expanded block scales, stride nb * 8
  int64_t kp, nb;
};

template <int BITS, int NR>
inline void prefetch_next_rows(const Rows& a, int64_t t) {
  constexpr int64_t step = NR * (BITS == 4 ? 32 : SUPER);
  prefetch_bytes(reinterpret_cast<const char*>(a.w) + NR * a.row_bytes + t * step, step);
}

template <int BITS, int MB, int NR>
QK_AVX512 void rows_avx512(const Rows& a, float* raw) {
  __m512 acc[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int mi = 0; mi < MB; ++mi) acc[r][mi] = _mm512_setzero_ps();
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0, t0 = 0; t0 < a.nsb; ++g, t0 += a.spg) {
    const int64_t t1 = std::min(a.nsb, t0 + a.spg);
    __m512 accg[NR][MB];
    for (int r = 0; r < NR; ++r)
      for (int mi = 0; mi < MB; ++mi) accg[r][mi] = _mm512_setzero_ps();
    for (int64_t t = t0; t < t1; ++t) {
      prefetch_next_rows<BITS, NR>(a, t);
      __m512i x[MB];
      __m512 de[MB];
      for (int mi = 0; mi < MB; ++mi) {
        x[mi] = _mm512_loadu_si512(a.q + mi * a.kp + t * SUPER);
        de[mi] = _mm512_loadu_ps(a.de + mi * a.nb * 8 + t * 16);
      }
      for (int r = 0; r < NR; ++r) {
        __m512i w;
        if (BITS == 4) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.w + r * a.row_bytes + t * 32));
          const __m256i lo = _mm256_and_si256(v, mask);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
          w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        } else {
          w = _mm512_xor_si512(_mm512_loadu_si512(a.w + r * a.row_bytes + t * SUPER), flip);
        }
        for (int mi = 0; mi < MB; ++mi) {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x[mi]);
          accg[r][mi] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), de[mi], accg[r][mi]);
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 sv = _mm512_set1_ps(a.s[r * a.groups + g]);
      for (int mi = 0; mi < MB; ++mi) acc[r][mi] = _mm512_fmadd_ps(accg[r][mi], sv, acc[r][mi]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int mi = 0; mi < MB; ++mi) raw[r * MB + mi] = _mm512_reduce_add_ps(acc[r][mi]);
}

template <int BITS, int MB, int NR>
QK_AVX2 void rows_avx2(const Rows& a, float* raw) {
  __m256 acc[NR][MB];
  for (int r = 0; r < NR; ++r)
    for (int mi = 0; mi < MB; ++mi) acc[r][mi] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0, t0 = 0; t0 < a.nsb; ++g, t0 += a.spg) {
    const int64_t t1 = std::min(a.nsb, t0 + a.spg);
    __m256 accg[NR][MB];
    for (int r = 0; r < NR; ++r)
      for (int mi = 0; mi < MB; ++mi) accg[r][mi] = _mm256_setzero_ps();
    for (int64_t t = t0; t < t1; ++t) {
      prefetch_next_rows<BITS, NR>(a, t);
      for (int r = 0; r < NR; ++r) {
        __m256i half[2];
        if (BITS == 4) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.w + r * a.row_bytes + t * 32));
          half[0] = _mm256_and_si256(v, mask);
          half[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        } else {
          half[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.w + r * a.row_bytes + t * SUPER));
          half[1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.w + r * a.row_bytes + t * SUPER + 32));
        }
        for (int h = 0; h < 2; ++h) {
          const int64_t b = 2 * t + h;
          const __m256i wa = BITS == 8 ? _mm256_sign_epi8(half[h], half[h]) : half[h];
          for (int mi = 0; mi < MB; ++mi) {
            __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + mi * a.kp + b * BLOCK));
            if (BITS == 8) x = _mm256_sign_epi8(x, half[h]);
            const __m256i p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, x), ones);
            accg[r][mi] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_broadcast_ss(a.d + mi * a.nb + b), accg[r][mi]);
          }
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m256 sv = _mm256_set1_ps(a.s[r * a.groups + g]);
      for (int mi = 0; mi < MB; ++mi) acc[r][mi] = _mm256_fmadd_ps(accg[r][mi], sv, acc[r][mi]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int mi = 0; mi < MB; ++mi) raw[r * MB + mi] = hsum256(acc[r][mi]);
}

// ---------------------------------------------------------------------------------------------------
// Batches and prompts (2 rows of x or more): the rows of x in the lanes of one vector. The activations
// are interleaved once per call (Lanes::xi: per block of 32 and dword j of it, the 4 bytes of that dword
// of each of L rows side by side), and each weight row is unpacked once into u8 (Lanes::wb, in L1);
// then 4 consecutive weights, broadcast to every lane (a load), times the L rows' 4 activations is one
// vpdpbusd (AVX-512) or vpmaddubsw (AVX2) for L rows at once. Per block of 32 the int32 lane sums are
// converted once and multiplied by the rows' block scales (Lanes::di); per group by the weight scale.
// NR weight rows share each load of x. Same integer block sums as the per-row code.
// ---------------------------------------------------------------------------------------------------
struct Lanes {
  const uint8_t* wb;    // NR unpacked weight rows, row r at wb + r * kp: int4 u, int8 q + 128 (AVX-512) or |q| (AVX2)
  const int8_t* ws;     // AVX2 int8: the signed weight rows themselves, row r at ws + r * ws_stride
  int64_t ws_stride;
  const float* s;       // first row's scales; row r at s + r * groups
  int64_t groups, bpg;  // groups, blocks of 32 per group
  const int32_t* xi;    // this chunk of L rows: [kb][8][L] dwords of x
  const float* di;      // [kb][L] block scales (0 for rows past M)
  const float* xg;      // [G][L] per group: sum over its blocks of d * sum(q) (the zero-point term)
  const float* z;       // first row's zeros (row r at z + r * groups; + zshift), or null: zdef
  float zshift, zdef;
  int64_t kp;
  const char* pf;       // the next NR weight rows (row r at pf + r * pf_stride), fetched block by block; or null
  int64_t pf_stride, pf_block;  // bytes per row, bytes per block of 32 (int4: 16, int8: 32)
};

// While a block of the unpacked rows is multiplied, the same block of the next rows is fetched: one line
// per row every 64 bytes, spread over the pass so the fetches do not queue up.
template <int NR>
inline void prefetch_block(const Lanes& a, int64_t b) {
  if (a.pf == nullptr || (b * a.pf_block) % 64 != 0) return;
  for (int r = 0; r < NR; ++r) _mm_prefetch(a.pf + r * a.pf_stride + b * a.pf_block, _MM_HINT_T0);
}

// The integer zero of row r, group g in the kernel's domain.
inline float zero_of(const Lanes& a, int r, int64_t g) { return a.z ? a.z[r * a.groups + g] + a.zshift : a.zdef; }

inline int32_t load_dword(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The AVX-512 lanes code for L = 8 rows of x (ymm, AVX512-VL) or 16 (zmm): the vector operations it uses.
template <int L>
struct LaneVec;
template <>
struct LaneVec<8> {
  using F = __m256;
  using I = __m256i;
  QK_AVX512 static F fzero() { return _mm256_setzero_ps(); }
  QK_AVX512 static I izero() { return _mm256_setzero_si256(); }
  QK_AVX512 static I load_i(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  QK_AVX512 static F load_f(const float* p) { return _mm256_loadu_ps(p); }
  QK_AVX512 static I dot(I acc, int32_t w, I x) { return _mm256_dpbusd_epi32(acc, _mm256_set1_epi32(w), x); }
  QK_AVX512 static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  QK_AVX512 static F set1(float v) { return _mm256_set1_ps(v); }
  QK_AVX512 static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  QK_AVX512 static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  QK_AVX512 static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
template <>
struct LaneVec<16> {
  using F = __m512;
  using I = __m512i;
  QK_AVX512 static F fzero() { return _mm512_setzero_ps(); }
  QK_AVX512 static I izero() { return _mm512_setzero_si512(); }
  QK_AVX512 static I load_i(const int32_t* p) { return _mm512_loadu_si512(p); }
  QK_AVX512 static F load_f(const float* p) { return _mm512_loadu_ps(p); }
  QK_AVX512 static I dot(I acc, int32_t w, I x) { return _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(w), x); }
  QK_AVX512 static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  QK_AVX512 static F set1(float v) { return _mm512_set1_ps(v); }
  QK_AVX512 static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  QK_AVX512 static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  QK_AVX512 static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};

template <int L, int NR>
QK_AVX512 void lanes_avx512(const Lanes& a, float* raw) {
  using V = LaneVec<L>;
  typename V::F acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = V::fzero();
  for (int64_t g = 0; g < a.groups; ++g) {
    typename V::F accg[NR];
    for (int r = 0; r < NR; ++r) accg[r] = V::fzero();
    for (int64_t b = g * a.bpg; b < (g + 1) * a.bpg; ++b) {
      prefetch_block<NR>(a, b);
      typename V::I acci[NR];
      for (int r = 0; r < NR; ++r) acci[r] = V::izero();
      const int32_t* xb = a.xi + b * 8 * L;
      const uint8_t* wb = a.wb + b * BLOCK;
      for (int j = 0; j < 8; ++j) {
        const typename V::I xv = V::load_i(xb + j * L);
        for (int r = 0; r < NR; ++r) acci[r] = V::dot(acci[r], load_dword(wb + r * a.kp + 4 * j), xv);
      }
      const typename V::F dv = V::load_f(a.di + b * L);
      for (int r = 0; r < NR; ++r) accg[r] = V::fma(V::cvt(acci[r]), dv, accg[r]);
    }
    const typename V::F xg = V::load_f(a.xg + g * L);
    for (int r = 0; r < NR; ++r)  // acc += s * (sum - z * xg)
      acc[r] = V::fma(V::fnma(V::set1(zero_of(a, r, g)), xg, accg[r]), V::set1(a.s[r * a.groups + g]), acc[r]);
  }
  for (int r = 0; r < NR; ++r) V::store(raw + r * L, acc[r]);
}

// AVX2, L = 8. int4: u <= 15, so 8 vpmaddubsw pair sums (<= 2 * 15 * 127 each) add up in int16 without
// overflow and one vpmaddwd per block widens them. int8: the sign trick (|q| times sign(q) * x).
template <int BITS, int NR>
QK_AVX2 void lanes8_avx2(const Lanes& a, float* raw) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256 accg[NR];
    for (int r = 0; r < NR; ++r) accg[r] = _mm256_setzero_ps();
    for (int64_t b = g * a.bpg; b < (g + 1) * a.bpg; ++b) {
      prefetch_block<NR>(a, b);
      __m256i acci[NR];
      for (int r = 0; r < NR; ++r) acci[r] = _mm256_setzero_si256();
      const int32_t* xb = a.xi + b * 64;
      const uint8_t* wb = a.wb + b * BLOCK;
      for (int j = 0; j < 8; ++j) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + j * 8));
        for (int r = 0; r < NR; ++r) {
          const __m256i wv = _mm256_set1_epi32(load_dword(wb + r * a.kp + 4 * j));
          if (BITS == 4) {
            acci[r] = _mm256_add_epi16(acci[r], _mm256_maddubs_epi16(wv, xv));
          } else {
            const __m256i sv = _mm256_set1_epi32(
                load_dword(reinterpret_cast<const uint8_t*>(a.ws + r * a.ws_stride) + b * BLOCK + 4 * j));
            acci[r] = _mm256_add_epi32(acci[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wv, _mm256_sign_epi8(xv, sv)), ones));
          }
        }
      }
      const __m256 dv = _mm256_loadu_ps(a.di + b * 8);
      for (int r = 0; r < NR; ++r) {
        const __m256i s32 = BITS == 4 ? _mm256_madd_epi16(acci[r], ones) : acci[r];
        accg[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), dv, accg[r]);
      }
    }
    const __m256 xg = _mm256_loadu_ps(a.xg + g * 8);
    for (int r = 0; r < NR; ++r)  // acc += s * (sum - z * xg)
      acc[r] = _mm256_fmadd_ps(_mm256_fnmadd_ps(_mm256_set1_ps(zero_of(a, r, g)), xg, accg[r]),
                               _mm256_set1_ps(a.s[r * a.groups + g]), acc[r]);
  }
  for (int r = 0; r < NR; ++r) _mm256_storeu_ps(raw + r * 8, acc[r]);
}

// One weight row (row_bytes of the layout) unpacked to u8 in k order, kp bytes: int4 u; int8 q + 128
// (flip, AVX-512: vpdpbusd multiplies unsigned by signed bytes) or |q| (AVX2's sign trick).
template <int BITS>
QK_AVX2 void unpack_u8_avx2(const uint8_t* w, int64_t kp, bool flip, uint8_t* dst) {
  const __m256i mask = _mm256_set1_epi8(0x0F), f = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t t = 0; t < kp / SUPER; ++t) {
    if (BITS == 4) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + t * 32));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t * SUPER), _mm256_and_si256(v, mask));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t * SUPER + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
    } else {
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + t * SUPER + h * 32));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t * SUPER + h * 32),
                            flip ? _mm256_xor_si256(v, f) : _mm256_sign_epi8(v, v));
      }
    }
  }
}

using LanesFn = void (*)(const Lanes&, float*);

// Weight rows per pass over a chunk of x: 8 on AVX-512, so 8 independent vpdpbusd chains hide its
// latency (4 chains measured 0.6x the speed), 4 on AVX2 (16 registers; its int32 sums are plain adds).
constexpr int LANES_NR_MAX = 8;

struct LanesPick {
  LanesFn wide, one;  // wide: `rows` weight rows at a time; one: a single row (the tail)
  int rows, lanes;    // lanes: L rows of x per vector
};

template <int BITS>
LanesPick pick_lanes(int64_t isa, int64_t m) {
  if (isa >= ISA_AVX512) {
    if (m <= 8) return {lanes_avx512<8, 8>, lanes_avx512<8, 1>, 8, 8};
    return {lanes_avx512<16, 8>, lanes_avx512<16, 1>, 8, 16};
  }
  return {lanes8_avx2<BITS, 4>, lanes8_avx2<BITS, 1>, 4, 8};
}

using RowsFn = void (*)(const Rows&, float*);

// (function, rows of W it takes) for MB x rows on this path, or {nullptr, 0} (scalar: the per-row code).
template <int BITS>
std::pair<RowsFn, int> pick_rows(int64_t isa, int mb, bool tail) {
  if (isa >= ISA_AVX512) {
    if (tail) {
      switch (mb) { case 1: return {rows_avx512<BITS, 1, 1>, 1}; case 2: return {rows_avx512<BITS, 2, 1>, 1};
                    case 3: return {rows_avx512<BITS, 3, 1>, 1}; default: return {rows_avx512<BITS, 4, 1>, 1}; }
    }
    switch (mb) { case 1: return {rows_avx512<BITS, 1, 4>, 4}; case 2: return {rows_avx512<BITS, 2, 4>, 4};
                  case 3: return {rows_avx512<BITS, 3, 2>, 2}; default: return {rows_avx512<BITS, 4, 2>, 2}; }
  }
  if (isa == ISA_AVX2) {
    if (tail) {
      switch (mb) { case 1: return {rows_avx2<BITS, 1, 1>, 1}; case 2: return {rows_avx2<BITS, 2, 1>, 1};
                    case 3: return {rows_avx2<BITS, 3, 1>, 1}; default: return {rows_avx2<BITS, 4, 1>, 1}; }
    }
    switch (mb) { case 1: return {rows_avx2<BITS, 1, 4>, 4}; case 2: return {rows_avx2<BITS, 2, 2>, 2};
                  case 3: return {rows_avx2<BITS, 3, 1>, 1}; default: return {rows_avx2<BITS, 4, 1>, 1}; }
  }
  return {nullptr, 0};
}
#endif

using RowFn = void (*)(const RowArgs&, float*);

template <int BITS>
RowFn pick_row(int64_t isa, int mb) {
#define QK_PICK(fn)                      \
  switch (mb) {                          \
    case 1: return fn<BITS, 1>;          \
    case 2: return fn<BITS, 2>;          \
    case 3: return fn<BITS, 3>;          \
    default: return fn<BITS, 4>;         \
  }
#if defined(__x86_64__) || defined(__i386__)
  if (isa >= ISA_AVX512) { QK_PICK(row_avx512) }
  if (isa == ISA_AVX2) { QK_PICK(row_avx2) }
#endif
  QK_PICK(row_scalar)
#undef QK_PICK
}

template <typename T>
void store(const float* y, int64_t count, T* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<T>(y[i]);
}

float read_f(const at::Tensor& t, int64_t i) {
  switch (t.scalar_type()) {
    case at::kFloat: return t.data_ptr<float>()[i];
    case at::kBFloat16: return static_cast<float>(t.data_ptr<c10::BFloat16>()[i]);
    case at::kHalf: return static_cast<float>(t.data_ptr<c10::Half>()[i]);
    default: TORCH_CHECK(false, "quantkit::wna16_cpu_q8dot: bias must be fp32, bf16 or fp16");
  }
}

void check_layout(const at::Tensor& weight, const at::Tensor& scale, const c10::optional<at::Tensor>& zero,
                  int64_t k, const char* op) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu(),
              op, ": weight must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(weight.scalar_type() == at::kByte || weight.scalar_type() == at::kChar,
              op, ": weight must be uint8 (int4 nibbles) or int8");
  const int64_t kp = (k + SUPER - 1) / SUPER * SUPER;
  const bool int4 = weight.scalar_type() == at::kByte;
  TORCH_CHECK(weight.size(1) == (int4 ? kp / 2 : kp), op, ": weight has ", weight.size(1),
              " bytes per row; K=", k, " padded to ", kp, " needs ", (int4 ? kp / 2 : kp));
  TORCH_CHECK(k % BLOCK == 0, op, ": K must be a multiple of 32, got ", k);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 2 && scale.is_contiguous() &&
                  scale.size(0) == weight.size(0) && scale.size(1) >= 1 && k % scale.size(1) == 0 &&
                  (k / scale.size(1)) % BLOCK == 0,
              op, ": scale must be contiguous fp32 [N, G] with K / G a multiple of 32");
  if (zero.has_value()) {
    TORCH_CHECK(zero->scalar_type() == at::kFloat && zero->is_contiguous() && zero->sizes() == scale.sizes(),
                op, ": zero must be contiguous fp32 like scale");
  }
}

template <typename T>
const T* typed(const at::Tensor& t) {
  return t.data_ptr<T>();
}

}  // namespace

namespace quantkit {

at::Tensor wna16_cpu_q8dot(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& zero, const c10::optional<at::Tensor>& bias) {
  const char* op = "quantkit::wna16_cpu_q8dot";
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), op, ": x must be a 2-D CPU tensor [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              op, ": x must be fp32, bf16 or fp16");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = weight.size(0);
  check_layout(weight, scale, zero, k, op);
  if (bias.has_value()) TORCH_CHECK(bias->numel() == n && bias->is_contiguous(), op, ": bias must be [N]");
  const int64_t kp = (k + SUPER - 1) / SUPER * SUPER, groups = scale.size(1), nb = kp / BLOCK;
  const int bits = weight.scalar_type() == at::kByte ? 4 : 8;
  at::Tensor out = at::empty({m, n}, xc.options());
  if (m == 0 || n == 0) return out;

  const int64_t isa = active_isa();
  // 2 rows or more on the AVX-512 / AVX2 paths: the lanes code (rows of x in the lanes of a vector).
  const bool lanes = isa != ISA_SCALAR && m >= LANES_MIN_ROWS[bits == 4 ? 0 : 1];
  QuantizedX qx;
  const bool expand = isa >= ISA_AVX512 && !lanes;
  switch (xc.scalar_type()) {
    case at::kFloat: quantize_rows(typed<float>(xc), m, k, kp, groups, expand, isa != ISA_SCALAR, qx); break;
    case at::kBFloat16: quantize_rows(typed<c10::BFloat16>(xc), m, k, kp, groups, expand, isa != ISA_SCALAR, qx); break;
    default: quantize_rows(typed<c10::Half>(xc), m, k, kp, groups, expand, isa != ISA_SCALAR, qx); break;
  }
  // The kernel's integer zero: int8 on AVX-512 multiplies q + 128 (see super_avx512).
  const float zero_shift = (bits == 8 && isa >= ISA_AVX512) ? 128.f : 0.f;
  const float zero_default = (bits == 4 ? 8.f : 0.f) + zero_shift;
  const float* zp = zero.has_value() ? zero->data_ptr<float>() : nullptr;
  const float* sp = scale.data_ptr<float>();
  const uint8_t* wp = static_cast<const uint8_t*>(weight.data_ptr());
  const int64_t row_bytes = weight.size(1), kb = k / BLOCK;
  std::vector<float> bias_f;
  if (bias.has_value()) {
    bias_f.resize(n);
    for (int64_t i = 0; i < n; ++i) bias_f[i] = read_f(*bias, i);
  }
  const at::ScalarType out_type = xc.scalar_type();
  void* out_ptr = out.data_ptr();

  // Rows of W per task: at least 32 (a few KiB of weights), so a small layer is not split into
  // tasks that cost more to start than to run.
  std::vector<int32_t> group_of(nb);
  for (int64_t b = 0; b < nb; ++b) group_of[b] = static_cast<int32_t>(std::min(b, kb - 1) / (kb / groups));
  const int64_t grain = std::max<int64_t>(32, n / (8 * std::max(1, at::get_num_threads())));
  // Groups made of whole superblocks take the multi-row kernels; others (groups of 32, 96, ...) the per-row ones.
  const bool aligned = groups == 1 || (k / groups) % SUPER == 0;
  const int64_t spg = groups == 1 ? kp / SUPER : (k / groups) / SUPER;
#if defined(__x86_64__) || defined(__i386__)
  LanesPick pick{nullptr, nullptr, 0, 0};
  if (lanes) {
    pick = bits == 4 ? pick_lanes<4>(isa, m) : pick_lanes<8>(isa, m);
    interleave_rows(m, kp, kb, groups, pick.lanes, qx);
  }
#endif
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> y(static_cast<size_t>(m) * (n1 - n0));
    auto store_y = [&](int64_t r, int64_t row, float v) {  // + bias
      y[row * (n1 - n0) + (r - n0)] = bias_f.empty() ? v : v + bias_f[r];
    };
    auto finish = [&](int64_t r, int64_t row, float raw) {  // zero-point term (4 independent sums), bias
      const float* xg = qx.xg.data() + row * groups;
      const float* s = sp + r * groups;
      float corr[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t g = 0; g < groups; ++g)
        corr[g & 3] += s[g] * (zp ? zp[r * groups + g] + zero_shift : zero_default) * xg[g];
      store_y(r, row, raw - ((corr[0] + corr[1]) + (corr[2] + corr[3])));
    };
#if defined(__x86_64__) || defined(__i386__)
    if (lanes) {
      // Each weight row is unpacked once per call and used against every chunk of L rows of x.
      std::vector<uint8_t> wbuf(static_cast<size_t>(LANES_NR_MAX) * kp);
      float raw[LANES_NR_MAX * 16];
      const bool flip = isa >= ISA_AVX512;
      const int lanes_l = pick.lanes;
      const int64_t chunks = (m + lanes_l - 1) / lanes_l;
      for (int64_t r = n0; r < n1;) {
        const int take = r + pick.rows <= n1 ? pick.rows : 1;
        for (int rr = 0; rr < take; ++rr) {
          if (bits == 4) unpack_u8_avx2<4>(wp + (r + rr) * row_bytes, kp, flip, wbuf.data() + rr * kp);
          else unpack_u8_avx2<8>(wp + (r + rr) * row_bytes, kp, flip, wbuf.data() + rr * kp);
        }
        for (int64_t c = 0; c < chunks; ++c) {
          Lanes a{wbuf.data(), reinterpret_cast<const int8_t*>(wp + r * row_bytes), row_bytes, sp + r * groups,
                  groups, kb / groups, qx.xi.data() + c * kb * 8 * lanes_l, qx.di.data() + c * kb * lanes_l,
                  qx.xgi.data() + c * groups * lanes_l, zp ? zp + r * groups : nullptr, zero_shift, zero_default, kp,
                  c == 0 && r + 2 * take <= n1 ? reinterpret_cast<const char*>(wp + (r + take) * row_bytes) : nullptr,
                  row_bytes, bits == 4 ? 16 : 32};
          (take == pick.rows ? pick.wide : pick.one)(a, raw);
          const int64_t rows = std::min<int64_t>(lanes_l, m - c * lanes_l);
          for (int rr = 0; rr < take; ++rr)
            for (int64_t l = 0; l < rows; ++l) store_y(r + rr, c * lanes_l + l, raw[rr * lanes_l + l]);
        }
        r += take;
      }
    }
#endif
    for (int64_t m0 = 0; m0 < m && !lanes; m0 += MB_MAX) {
      const int mb = static_cast<int>(std::min<int64_t>(MB_MAX, m - m0));
      const int8_t* q = qx.q.data() + m0 * kp;
      const float* d = qx.d.data() + m0 * nb;
      const float* de = expand ? qx.de.data() + m0 * nb * 8 : nullptr;
      float raw[4 * MB_MAX];
#if defined(__x86_64__) || defined(__i386__)
      if (aligned && isa != ISA_SCALAR) {
        const auto wide = bits == 4 ? pick_rows<4>(isa, mb, false) : pick_rows<8>(isa, mb, false);
        const auto one = bits == 4 ? pick_rows<4>(isa, mb, true) : pick_rows<8>(isa, mb, true);
        for (int64_t r = n0; r < n1;) {
          const bool full = r + wide.second <= n1;
          const int take = full ? wide.second : 1;
          Rows a{wp + r * row_bytes, row_bytes, sp + r * groups, groups, kp / SUPER, spg, q, d, de, kp, nb};
          (full ? wide.first : one.first)(a, raw);
          for (int rr = 0; rr < take; ++rr)
            for (int mi = 0; mi < mb; ++mi) finish(r + rr, m0 + mi, raw[rr * mb + mi]);
          r += take;
        }
        continue;
      }
#endif
      const RowFn fn = bits == 4 ? pick_row<4>(isa, mb) : pick_row<8>(isa, mb);
      for (int64_t r = n0; r < n1; ++r) {
        RowArgs a{wp + r * row_bytes, sp + r * groups, kp / SUPER, kb, kb / groups,
                  q, d, de, kp, nb, group_of.data()};
        fn(a, raw);
        for (int mi = 0; mi < mb; ++mi) finish(r, m0 + mi, raw[mi]);
      }
    }
    for (int64_t mi = 0; mi < m; ++mi) {
      const float* src = y.data() + mi * (n1 - n0);
      const int64_t off = mi * n + n0;
      switch (out_type) {
        case at::kFloat: store(src, n1 - n0, static_cast<float*>(out_ptr) + off); break;
        case at::kBFloat16: store(src, n1 - n0, static_cast<c10::BFloat16*>(out_ptr) + off); break;
        default: store(src, n1 - n0, static_cast<c10::Half*>(out_ptr) + off); break;
      }
    }
  });
  return out;
}

}  // namespace quantkit

namespace {

// One weight row of the q8dot layout dequantized into fp32 (dst: K values, padded to a superblock).
// Compiled for AVX-512, AVX2 and baseline x86-64 (chosen by the loader from the CPU), so the loops
// vectorize on the CPU that runs them.
#define QK_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
QK_CLONES void unpack_row(const uint8_t* w, const float* s, const float* zrow, bool int4, int64_t k, int64_t gs,
                          float* dst_row) {
  const int64_t nsb = (k + SUPER - 1) / SUPER;
  for (int64_t t = 0; t < nsb; ++t) {  // per superblock: two blocks of 32, each in one group
    for (int h = 0; h < 2; ++h) {
      const int64_t k0 = t * SUPER + h * BLOCK;
      if (k0 >= k) break;
      const int64_t g = k0 / gs;
      const float z = zrow ? zrow[g] : (int4 ? 8.f : 0.f), sc = s[g];
      float* dst = dst_row + k0;
      if (int4) {
        const uint8_t* src = w + t * 32;
        if (h == 0) for (int j = 0; j < BLOCK; ++j) dst[j] = (static_cast<float>(src[j] & 0x0F) - z) * sc;
        else for (int j = 0; j < BLOCK; ++j) dst[j] = (static_cast<float>(src[j] >> 4) - z) * sc;
      } else {
        const int8_t* src = reinterpret_cast<const int8_t*>(w) + k0;
        for (int j = 0; j < BLOCK; ++j) dst[j] = (static_cast<float>(src[j]) - z) * sc;
      }
    }
  }
}

// fp32 -> bf16 bits, round to nearest even (c10::BFloat16's rounding; the weights are finite).
QK_CLONES void store_bf16(const float* y, int64_t count, uint16_t* out) {
  for (int64_t i = 0; i < count; ++i) {
    uint32_t u;
    std::memcpy(&u, y + i, sizeof(u));
    out[i] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}
#undef QK_CLONES

// The weight of the q8dot layout dequantized: [N, K] fp32 (or bf16 when bf16 is true), w = (u - z) * s.
// The large-M (prefill) path multiplies x by it with the dense matmul.
at::Tensor wna16_cpu_q8dot_unpack(const at::Tensor& weight, const at::Tensor& scale,
                                  const c10::optional<at::Tensor>& zero, int64_t k, bool bf16) {
  const char* op = "quantkit::wna16_cpu_q8dot_unpack";
  check_layout(weight, scale, zero, k, op);
  const int64_t n = weight.size(0), groups = scale.size(1), gs = k / groups, row_bytes = weight.size(1);
  const bool int4 = weight.scalar_type() == at::kByte;
  at::Tensor out = at::empty({n, k}, weight.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* wp = static_cast<const uint8_t*>(weight.data_ptr());
  const float* sp = scale.data_ptr<float>();
  const float* zp = zero.has_value() ? zero->data_ptr<float>() : nullptr;
  void* op_ = out.data_ptr();
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> row(((k + SUPER - 1) / SUPER) * SUPER);
    for (int64_t r = n0; r < n1; ++r) {
      unpack_row(wp + r * row_bytes, sp + r * groups, zp ? zp + r * groups : nullptr, int4, k, gs, row.data());
      if (bf16) store_bf16(row.data(), k, reinterpret_cast<uint16_t*>(static_cast<c10::BFloat16*>(op_) + r * k));
      else std::copy(row.data(), row.data() + k, static_cast<float*>(op_) + r * k);
    }
  });
  return out;
}

// set < -1: query; -1: the CPU's best path; 0/1/2/3/4: scalar / AVX2 / AVX-512 / AVX-512 with BF16 / with BF16
// and VBMI (capped at what the CPU runs; this kernel runs its AVX-512 code at 3 and 4).
// Returns the path calls now take.
int64_t wna16_cpu_q8dot_isa(int64_t set) {
  if (set >= -1) g_forced_isa = set;
  return active_isa();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantkit, m) {
  m.def("wna16_cpu_q8dot(Tensor x, Tensor weight, Tensor scale, Tensor? zero=None, Tensor? bias=None) -> Tensor");
  m.def("wna16_cpu_q8dot_unpack(Tensor weight, Tensor scale, Tensor? zero, int in_features, bool bf16) -> Tensor");
  m.def("wna16_cpu_q8dot_isa(int set=-2) -> int", &wna16_cpu_q8dot_isa);
}

TORCH_LIBRARY_IMPL(quantkit, CPU, m) {
  m.impl("wna16_cpu_q8dot", &quantkit::wna16_cpu_q8dot);
  m.impl("wna16_cpu_q8dot_unpack", &wna16_cpu_q8dot_unpack);
}
