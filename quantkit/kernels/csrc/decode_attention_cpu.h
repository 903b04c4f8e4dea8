// quantkit's fused CPU decode attention over a block-allocated KV cache (decode_attention_cpu.cpp), for the
// other C++ kernels (the decode loop, decode_step.cpp).
#pragma once
#include <cstdint>
#include <vector>

namespace quantkit {

// How the cache stores a value x: fp32 / bf16 / fp16 as x rounded to that type; fp8 as
// float8_e4m3fn(clamp(x / head_scale, -448, 448)); int8 as round(x / s) with s = amax / 127 of the
// token's head_dim values (one fp32 scale per token and kv head).
enum KvDtype : int64_t { KV_FP32 = 0, KV_BF16 = 1, KV_FP16 = 2, KV_FP8 = 3, KV_INT8 = 4 };

// Positions per key tile: keys are stored in tiles of KV_KEY_TILE positions, [head_dim, KV_KEY_TILE]
// values each, so that one key component of 16 positions is one AVX-512 vector.
constexpr int64_t KV_KEY_TILE = 16;

// One layer's cache in blocks of `block` positions (a multiple of 2 * KV_KEY_TILE): block i holds
// positions [i * block, (i + 1) * block) of every sequence and kv head, keys [batch, kv_heads,
// block / KV_KEY_TILE, head_dim, KV_KEY_TILE] and values [batch, kv_heads, block, head_dim] (int8: fp32
// scales [batch, kv_heads, block] in k_scale / v_scale). fp8: k_head_scale / v_head_scale fp32 [kv_heads].
struct KvBlocks {
  KvDtype dtype = KV_FP32;
  int64_t batch = 0, kv_heads = 0, head_dim = 0, block = 0;
  std::vector<const void*> k, v;
  std::vector<const float*> k_scale, v_scale;
  const float* k_head_scale = nullptr;
  const float* v_head_scale = nullptr;
};

// out[b, h] = sum_t softmax_t(q[b, h] . k[b, h / group, t] * sm_scale) v[b, h / group, t] over t < lengths[b]
// (lengths[b] >= 1). q fp32 rows of heads * head_dim values, row b at q + b * q_stride; out fp32
// [batch, heads, head_dim]. chunk: positions per task (0: chosen from the shape and the threads);
// isa: 0 scalar, 1 AVX2, 2 AVX-512, 3 AVX-512 with bf16 dot products for bf16 / fp8 caches (the query and
// the softmax weights rounded to bf16), -1 the CPU's best (capped at what the CPU runs).
void decode_attention_cpu(const float* q, int64_t q_stride, float* out, int64_t heads, const KvBlocks& cache,
                          const int64_t* lengths, float sm_scale, int64_t chunk, int64_t isa);

}  // namespace quantkit
