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
#include <cstring>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "q8dot.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

enum Isa : int64_t { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

int64_t detected_isa() {
  static const int64_t isa = [] {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"))
      return (int64_t)ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return (int64_t)ISA_AVX2;
#endif
    return (int64_t)ISA_SCALAR;
  }();
  return isa;
}

int64_t g_forced_isa = -1;  // -1: the CPU's best

int64_t active_isa() {
  return g_forced_isa >= 0 ? std::min(g_forced_isa, detected_isa()) : detected_isa();
}

constexpr int BLOCK = 32;   // activation block (values per fp32 scale)
constexpr int SUPER = 64;   // values per superblock of the weight layout
constexpr int MB_MAX = 4;   // rows of x per pass over a weight row

// The activations, quantized per block of 32: q int8 [M, Kp], d fp32 [M, nb] (nb = Kp / 32),
// the same d repeated per 32-bit lane for the AVX-512 path (de [M, Kp/64, 16]), and per group g the
// fp32 sum over its blocks of d_b * sum(q_b) (xg [M, G]) for the zero-point term.
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> d, de, xg;
};

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int64_t kp, int64_t groups, QuantizedX& out) {
  const int64_t nb = kp / BLOCK, kb = k / BLOCK, bpg = kb / groups;
  out.q.assign(m * kp, 0);
  out.d.assign(m * nb, 0.f);
  out.de.assign(m * nb * 8, 0.f);
  out.xg.assign(m * groups, 0.f);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < kb; ++b) {
      const T* v = x + r * k + b * BLOCK;
      float f[BLOCK];
      float amax = 0.f;
      for (int j = 0; j < BLOCK; ++j) {
        f[j] = to_f(v[j]);
        amax = std::max(amax, std::fabs(f[j]));
      }
      const float d = amax / 127.0f;
      const float id = d != 0.f ? 1.0f / d : 0.f;
      int32_t sum = 0;
      int8_t* q = out.q.data() + r * kp + b * BLOCK;
      for (int j = 0; j < BLOCK; ++j) {
        float t = std::nearbyint(f[j] * id);
        t = std::min(127.f, std::max(-127.f, t));
        q[j] = static_cast<int8_t>(t);
        sum += q[j];
      }
      out.d[r * nb + b] = d;
      for (int j = 0; j < 8; ++j) out.de[r * nb * 8 + b * 8 + j] = d;
      out.xg[r * groups + b / bpg] += d * static_cast<float>(sum);
    }
  }
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
#define QK_AVX2 __attribute__((target("avx2,fma")))
#define QK_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni,avx2,fma")))

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

using RowsFn = void (*)(const Rows&, float*);

// (function, rows of W it takes) for MB x rows on this path, or {nullptr, 0} (scalar: the per-row code).
template <int BITS>
std::pair<RowsFn, int> pick_rows(int64_t isa, int mb, bool tail) {
  if (isa == ISA_AVX512) {
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
  if (isa == ISA_AVX512) { QK_PICK(row_avx512) }
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

  QuantizedX qx;
  switch (xc.scalar_type()) {
    case at::kFloat: quantize_rows(typed<float>(xc), m, k, kp, groups, qx); break;
    case at::kBFloat16: quantize_rows(typed<c10::BFloat16>(xc), m, k, kp, groups, qx); break;
    default: quantize_rows(typed<c10::Half>(xc), m, k, kp, groups, qx); break;
  }
  const int64_t isa = active_isa();
  // The kernel's integer zero: int8 on AVX-512 multiplies q + 128 (see super_avx512).
  const float zero_shift = (bits == 8 && isa == ISA_AVX512) ? 128.f : 0.f;
  const float zero_default = (bits == 4 ? 8.f : 0.f) + zero_shift;
  const float* zp = zero.has_value() ? zero->data_ptr<float>() : nullptr;
  const float* sp = scale.data_ptr<float>();
  const uint8_t* wp = static_cast<const uint8_t*>(weight.data_ptr());
  const int64_t row_bytes = weight.size(1);
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
  for (int64_t b = 0; b < nb; ++b) group_of[b] = static_cast<int32_t>(std::min(b, k / BLOCK - 1) / ((k / BLOCK) / groups));
  const int64_t grain = std::max<int64_t>(32, n / (8 * std::max(1, at::get_num_threads())));
  // Groups made of whole superblocks take the multi-row kernels; others (groups of 32, 96, ...) the per-row ones.
  const bool aligned = groups == 1 || (k / groups) % SUPER == 0;
  const int64_t spg = groups == 1 ? kp / SUPER : (k / groups) / SUPER;
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> y(static_cast<size_t>(m) * (n1 - n0));
    auto finish = [&](int64_t r, int64_t row, float raw) {  // zero-point term, bias
      const float* xg = qx.xg.data() + row * groups;
      float corr = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const float z = zp ? zp[r * groups + g] + zero_shift : zero_default;
        corr += sp[r * groups + g] * z * xg[g];
      }
      float v = raw - corr;
      if (!bias_f.empty()) v += bias_f[r];
      y[row * (n1 - n0) + (r - n0)] = v;
    };
    for (int64_t m0 = 0; m0 < m; m0 += MB_MAX) {
      const int mb = static_cast<int>(std::min<int64_t>(MB_MAX, m - m0));
      const int8_t* q = qx.q.data() + m0 * kp;
      const float* d = qx.d.data() + m0 * nb;
      const float* de = qx.de.data() + m0 * nb * 8;
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
        RowArgs a{wp + r * row_bytes, sp + r * groups, kp / SUPER, k / BLOCK, (k / BLOCK) / groups,
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

// set < -1: query; -1: the CPU's best path; 0/1/2: scalar / AVX2 / AVX-512 (capped at what the CPU runs).
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
