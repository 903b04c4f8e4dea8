// One decode step of a Llama-family decoder in C++, for CPU batch decode without per-op Python cost.
//
// A transformers decode step of a small model is thousands of small op calls from Python (norms, rotary
// embeddings, cache updates, attention, residual adds): on a 2-core CPU they cost more than streaming
// the weights. torch.classes.quantkit.CpuDecoder holds a model's weights (read, never copied, except the
// float q/k/v and gate/up weights, concatenated as the quantized ones are at load) and its own KV cache,
// and runs one step for B sequences at one position in one call:
//
//   h = embed[token]                                              fp32 residual stream [B, H]
//   per layer: x = rmsnorm(h) * w_in; [q|k|v] = x W_qkv^T (+ b); (q, k per-head rmsnorm: Qwen3);
//              rotary (rotate-half convention, cos / sin of position * the model's inv_freq, times its
//              attention scaling, as transformers' rotary modules); k, v -> cache[pos];
//              o = softmax(q k^T * scaling) v over positions 0..pos (GQA; decode_attention_cpu.cpp);
//              h += o W_o^T; x = rmsnorm(h) * w_post; h += (silu(x W_g^T) * x W_u^T) W_d^T
//   logits = rmsnorm(h) * w_final W_lm^T                          fp32 [B, V]
//
// Each linear is either a quantized one in the cpu_q8 layout (quantkit::wna16_cpu_q8dot, its int8
// activation rounding included) or a float one (at::linear in the weight's dtype, x cast to it): the
// same loop runs a float model and its quantized variants, so they differ only in their linears.
// Each sequence b has its own position pos[b] (its cached positions), so rows of different lengths
// (left-padded prompts) decode together.
//
// The KV cache (decode_attention_cpu.h: KvBlocks) is stored as fp32, bf16, fp16, fp8 e4m3 (x / scale,
// the checkpoint's per-tensor or per-head scales, saturated, as quantkit's FP8KVCache) or int8 (a scale
// per token and head), in blocks of `block` positions per layer allocated as the longest sequence grows:
// max_len bounds the positions, it allocates nothing. Attention reads each (sequence, kv head)'s keys and
// values block by block, and a jump from one block to the next costs: on a Zen 4 EPYC, one thread, 2048 and
// 8000 positions, bf16 and fp8, blocks of 1024 ran attention 1.23-1.35x faster than blocks of 256, and blocks
// of 256 laid end to end in memory 1.27-1.40x faster than the same blocks apart (so it is the jump, not the
// arithmetic; evals/kv_cache/cpu_loop/cache-blocks-epyc).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include "decode_attention_cpu.h"
#include "q8dot.h"

namespace {

struct Linear {
  bool quantized = false;  // true: cpu_q8 layout (weight, scale, zero); false: float weight [N, K]
  at::Tensor weight, scale;
  c10::optional<at::Tensor> zero, bias;
};

// x fp32 [B, K] -> fp32 [B, N].
at::Tensor run_linear(const Linear& l, const at::Tensor& x) {
  if (l.quantized) return quantkit::wna16_cpu_q8dot(x, l.weight, l.scale, l.zero, l.bias);
  const at::Tensor xin = x.scalar_type() == l.weight.scalar_type() ? x : x.to(l.weight.scalar_type());
  at::Tensor y = l.bias.has_value() ? at::linear(xin, l.weight, *l.bias) : at::linear(xin, l.weight);
  return y.scalar_type() == at::kFloat ? y : y.to(at::kFloat);
}

// Parts that read the same x, outputs side by side: fp32 [B, sum N].
at::Tensor run_group(const std::vector<Linear>& parts, const at::Tensor& x) {
  if (parts.size() == 1) return run_linear(parts[0], x);
  std::vector<at::Tensor> ys;
  ys.reserve(parts.size());
  for (const auto& p : parts) ys.push_back(run_linear(p, x));
  return at::cat(ys, 1).contiguous();
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w   (rows of n values; w fp32 [n])
void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t n, int64_t stride, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * stride;
    float* o = out + r * stride;
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
    for (int64_t i = 0; i < n; ++i) o[i] = xr[i] * inv * w[i];
  }
}

// Rotate-half rotary embedding of one head in place: v (head_dim values) with cos/sin rows (head_dim).
void rotate(float* v, const float* c, const float* s, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * c[i] - b * s[i];
    v[i + half] = b * c[i + half] + a * s[i + half];
  }
}

// In place: v (n values, n a power of two) <- v H, H the normalized Sylvester Hadamard matrix (H = H^T,
// H H = I), as quantkit.modules.kv_rotation.hadamard_matrix: a fast Walsh-Hadamard transform.
void hadamard(float* v, int64_t n) {
  for (int64_t len = 1; len < n; len <<= 1)
    for (int64_t i = 0; i < n; i += len << 1)
      for (int64_t j = i; j < i + len; ++j) {
        const float a = v[j], b = v[j + len];
        v[j] = a + b, v[j + len] = a - b;
      }
  const float norm = 1.f / std::sqrt(static_cast<float>(n));
  for (int64_t i = 0; i < n; ++i) v[i] *= norm;
}


struct Layer {
  std::vector<Linear> qkv, gate_up;
  Linear o, down;
  at::Tensor in_norm, post_norm, q_norm, k_norm;  // fp32; q_norm / k_norm [head_dim] or undefined
  // cache blocks (layouts: KvBlocks); int8: fp32 token scales [B, kv_heads, block] per block
  std::vector<at::Tensor> k_blocks, v_blocks, k_scales, v_scales;
  at::Tensor k_head_scale, v_head_scale;  // fp8: fp32 [kv_heads]
};

at::ScalarType storage_type(quantkit::KvDtype t) {
  switch (t) {
    case quantkit::KV_FP32: return at::kFloat;
    case quantkit::KV_BF16: return at::kBFloat16;
    case quantkit::KV_FP16: return at::kHalf;
    case quantkit::KV_FP8: return at::kFloat8_e4m3fn;
    default: return at::kChar;
  }
}

constexpr int64_t HUGE_PAGE = int64_t{2} << 20;

// A zeroed tensor of `sizes` in its own allocation; from HUGE_PAGE bytes up aligned to HUGE_PAGE and, on
// Linux, marked for transparent huge pages (madvise MADV_HUGEPAGE: honoured where THP is "always" or
// "madvise"): the attention then reads a long cache with a TLB miss every 2 MiB instead of every 4 KiB.
// On a 2-core Zen 4 VM, SmolLM2's attention over 2048-8000 positions ran 1.13-1.25x faster on two threads and
// 1.17-1.38x on one than with a tensor per layer and block (evals/kv_cache/cpu_loop/huge-pages-epyc).
at::Tensor zeros_on_huge_pages(at::IntArrayRef sizes, at::ScalarType st) {
  int64_t bytes = at::elementSize(st);
  for (const int64_t n : sizes) bytes *= n;
  if (bytes < HUGE_PAGE) return at::zeros(sizes, st);
  const int64_t rounded = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
  void* data = std::aligned_alloc(HUGE_PAGE, rounded);
  TORCH_CHECK(data != nullptr, "CpuDecoder: could not allocate ", rounded, " bytes for the KV cache");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(data, rounded, MADV_HUGEPAGE);  // advice only: without THP the pages stay 4 KiB
#endif
  std::memset(data, 0, bytes);
  return at::from_blob(data, sizes, [](void* d) { std::free(d); }, at::TensorOptions().dtype(st));
}

// x (n fp32 values) stored as type t at dst[index(i)]; int8 returns the scale it used (amax / 127).
template <class Index>
float store_values(quantkit::KvDtype t, const float* x, int64_t n, void* dst, Index index, float fp8_scale) {
  switch (t) {
    case quantkit::KV_FP32:
      for (int64_t i = 0; i < n; ++i) static_cast<float*>(dst)[index(i)] = x[i];
      return 1.f;
    case quantkit::KV_BF16:
      for (int64_t i = 0; i < n; ++i) static_cast<c10::BFloat16*>(dst)[index(i)] = c10::BFloat16(x[i]);
      return 1.f;
    case quantkit::KV_FP16:
      for (int64_t i = 0; i < n; ++i) static_cast<c10::Half*>(dst)[index(i)] = c10::Half(x[i]);
      return 1.f;
    case quantkit::KV_FP8:  // as quantkit.core.primitives.quantize_fp8: x / scale saturated to +-448
      for (int64_t i = 0; i < n; ++i)
        static_cast<c10::Float8_e4m3fn*>(dst)[index(i)] = c10::Float8_e4m3fn(std::min(448.f, std::max(-448.f, x[i] / fp8_scale)));
      return 1.f;
    default: {
      float amax = 0.f;
      for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float scale = amax / 127.f, inv = amax > 0.f ? 1.f / scale : 0.f;
      for (int64_t i = 0; i < n; ++i)
        static_cast<int8_t*>(dst)[index(i)] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[i] * inv))));
      return scale;
    }
  }
}

struct CpuDecoder : torch::CustomClassHolder {
  int64_t n_layers, hidden, heads, kv_heads, head_dim, intermediate, max_len, isa, block;
  quantkit::KvDtype cache_dtype;
  double eps, scaling, rope_scaling;
  at::Tensor embed, final_norm, inv_freq;  // embed [V, H] (any float dtype); inv_freq fp32 [head_dim / 2]
  Linear lm_head;
  std::vector<Layer> layers;
  int64_t batch = 0, blocks = 0;  // blocks allocated per layer
  bool rotated = false;  // the cache stores k H and v H (Hadamard of head_dim); q H in, out H back

  // dims: layers, hidden, heads, kv_heads, head_dim, intermediate, max_len, cache dtype (KvDtype), code
  // path of the attention (0 scalar, 1 AVX2, 2 AVX-512, -1 the CPU's best), cache positions per block (a
  // multiple of 2 * KV_KEY_TILE); params: rms eps, attention scaling, rotary attention scaling.
  CpuDecoder(std::vector<int64_t> dims, std::vector<double> params, at::Tensor embed_, at::Tensor final_norm_,
             at::Tensor inv_freq_) {
    TORCH_CHECK(dims.size() == 10 && params.size() == 3, "CpuDecoder: dims needs 10 values and params 3");
    n_layers = dims[0], hidden = dims[1], heads = dims[2], kv_heads = dims[3], head_dim = dims[4];
    intermediate = dims[5], max_len = dims[6], isa = dims[8], block = dims[9];
    TORCH_CHECK(block > 0 && block % (2 * quantkit::KV_KEY_TILE) == 0, "CpuDecoder: cache blocks of ", block,
                " positions (a positive multiple of ", 2 * quantkit::KV_KEY_TILE, ")");
    TORCH_CHECK(dims[7] >= quantkit::KV_FP32 && dims[7] <= quantkit::KV_INT8, "CpuDecoder: unknown cache dtype ", dims[7]);
    cache_dtype = static_cast<quantkit::KvDtype>(dims[7]);
    eps = params[0], scaling = params[1], rope_scaling = params[2];
    TORCH_CHECK(n_layers > 0 && hidden > 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0 &&
                    head_dim > 0 && head_dim % 2 == 0 && intermediate > 0 && max_len > 0,
                "CpuDecoder: invalid dimensions");
    TORCH_CHECK(embed_.dim() == 2 && embed_.size(1) == hidden, "CpuDecoder: embed must be [V, hidden]");
    TORCH_CHECK(inv_freq_.numel() == head_dim / 2, "CpuDecoder: inv_freq must be [head_dim / 2]");
    embed = embed_.contiguous();
    final_norm = final_norm_.to(at::kFloat).contiguous();
    inv_freq = inv_freq_.to(at::kFloat).contiguous();
    layers.resize(n_layers);
  }

  // fp8: the layer's k / v scales, fp32 [kv_heads] (the cache stores fp8(x / scale)).
  void set_kv_scales(int64_t layer, at::Tensor k_scale, at::Tensor v_scale) {
    TORCH_CHECK(layer >= 0 && layer < n_layers, "CpuDecoder.set_kv_scales: layer out of range");
    TORCH_CHECK(k_scale.numel() == kv_heads && v_scale.numel() == kv_heads,
                "CpuDecoder.set_kv_scales: one scale per kv head");
    layers[layer].k_head_scale = k_scale.to(at::kFloat).contiguous();
    layers[layer].v_head_scale = v_scale.to(at::kFloat).contiguous();
  }

  // The Hadamard rotation of head_dim (a power of two) for the cache: k, v rotated at the write, q before
  // attention, the attention output rotated back. fp8 scales are then those of the rotated basis.
  void set_rotation(bool on) {
    TORCH_CHECK(!on || (head_dim & (head_dim - 1)) == 0, "CpuDecoder.set_rotation: head_dim ", head_dim,
                " is not a power of two");
    rotated = on;
  }

  // slot: "qkv" / "gate_up" (appended in output order), "o", "down"; "lm_head" with layer -1.
  void add_linear(int64_t layer, std::string slot, bool quantized, at::Tensor weight, c10::optional<at::Tensor> scale,
                  c10::optional<at::Tensor> zero, c10::optional<at::Tensor> bias) {
    Linear l;
    l.quantized = quantized;
    l.weight = weight.contiguous();
    if (quantized) {
      TORCH_CHECK(scale.has_value(), "CpuDecoder.add_linear: a quantized linear needs its scale");
      l.scale = scale->contiguous();
      if (zero.has_value()) l.zero = zero->contiguous();
    }
    if (bias.has_value()) l.bias = bias->to(quantized ? at::kFloat : weight.scalar_type()).contiguous();
    if (slot == "lm_head") {
      lm_head = l;
      return;
    }
    TORCH_CHECK(layer >= 0 && layer < n_layers, "CpuDecoder.add_linear: layer ", layer, " out of range");
    Layer& L = layers[layer];
    if (slot == "qkv") L.qkv.push_back(l);
    else if (slot == "gate_up") L.gate_up.push_back(l);
    else if (slot == "o") L.o = l;
    else if (slot == "down") L.down = l;
    else TORCH_CHECK(false, "CpuDecoder.add_linear: unknown slot ", slot);
  }

  void set_norms(int64_t layer, at::Tensor in_norm, at::Tensor post_norm, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm) {
    TORCH_CHECK(layer >= 0 && layer < n_layers, "CpuDecoder.set_norms: layer out of range");
    Layer& L = layers[layer];
    L.in_norm = in_norm.to(at::kFloat).contiguous();
    L.post_norm = post_norm.to(at::kFloat).contiguous();
    if (q_norm.has_value()) L.q_norm = q_norm->to(at::kFloat).contiguous();
    if (k_norm.has_value()) L.k_norm = k_norm->to(at::kFloat).contiguous();
  }

  // An empty cache for `b` sequences (its blocks freed).
  void reset(int64_t b) {
    TORCH_CHECK(b > 0, "CpuDecoder.reset: batch must be positive");
    TORCH_CHECK(cache_dtype != quantkit::KV_FP8 || layers[0].k_head_scale.defined(),
                "CpuDecoder.reset: an fp8 cache needs set_kv_scales for every layer");
    batch = b, blocks = 0;
    for (auto& L : layers) L.k_blocks.clear(), L.v_blocks.clear(), L.k_scales.clear(), L.v_scales.clear();
  }

  // Blocks for `positions` positions per sequence in every layer (zeroed, so that a vector read past a
  // sequence's end reads finite values). A block of every layer is one allocation of keys and one of values
  // (zeros_on_huge_pages), each layer's block a view of it.
  void reserve(int64_t positions) {
    TORCH_CHECK(positions <= max_len, "CpuDecoder: ", positions, " positions exceed max_len ", max_len);
    const at::ScalarType st = storage_type(cache_dtype);
    const int64_t tile = quantkit::KV_KEY_TILE;
    for (; blocks * block < positions; ++blocks) {
      const at::Tensor k = zeros_on_huge_pages({n_layers, batch, kv_heads, block / tile, head_dim, tile}, st);
      const at::Tensor v = zeros_on_huge_pages({n_layers, batch, kv_heads, block, head_dim}, st);
      for (int64_t l = 0; l < n_layers; ++l) {
        Layer& L = layers[l];
        L.k_blocks.push_back(k[l]);
        L.v_blocks.push_back(v[l]);
        if (cache_dtype == quantkit::KV_INT8) {
          L.k_scales.push_back(at::zeros({batch, kv_heads, block}, at::kFloat));
          L.v_scales.push_back(at::zeros({batch, kv_heads, block}, at::kFloat));
        }
      }
    }
  }

  // One key and value (head_dim fp32 values each) of sequence b, kv head h, at position pos (reserved).
  void write(Layer& L, int64_t b, int64_t h, int64_t pos, const float* k, const float* v) {
    std::vector<float> kr, vr;
    if (rotated) {  // the stored basis: k H, v H
      kr.assign(k, k + head_dim), vr.assign(v, v + head_dim);
      hadamard(kr.data(), head_dim), hadamard(vr.data(), head_dim);
      k = kr.data(), v = vr.data();
    }
    const int64_t blk = pos / block, w = pos % block, slab = (b * kv_heads + h) * block, tile = quantkit::KV_KEY_TILE;
    const float ks = L.k_head_scale.defined() ? L.k_head_scale.data_ptr<float>()[h] : 1.f;
    const float vs = L.v_head_scale.defined() ? L.v_head_scale.data_ptr<float>()[h] : 1.f;
    const int64_t key0 = (slab + w / tile * tile) * head_dim + w % tile, val0 = (slab + w) * head_dim;
    const float k_scale = store_values(cache_dtype, k, head_dim, L.k_blocks[blk].data_ptr(),
                                       [&](int64_t e) { return key0 + e * tile; }, ks);
    const float v_scale = store_values(cache_dtype, v, head_dim, L.v_blocks[blk].data_ptr(),
                                       [&](int64_t e) { return val0 + e; }, vs);
    if (cache_dtype == quantkit::KV_INT8) {
      L.k_scales[blk].data_ptr<float>()[slab + w] = k_scale;
      L.v_scales[blk].data_ptr<float>()[slab + w] = v_scale;
    }
  }

  // One layer's cache from k, v [B, kv_heads, len, head_dim] (after rotary, as transformers caches them):
  // sequence b's last lengths[b] positions (a left-padded prompt's tokens) become its positions
  // 0..lengths[b]-1.
  void set_cache(int64_t layer, at::Tensor k, at::Tensor v, at::Tensor lengths) {
    TORCH_CHECK(batch > 0, "CpuDecoder.set_cache: call reset(batch) first");
    TORCH_CHECK(layer >= 0 && layer < n_layers, "CpuDecoder.set_cache: layer out of range");
    TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == batch && k.size(1) == kv_heads &&
                    k.size(3) == head_dim, "CpuDecoder.set_cache: k / v must be [batch, kv_heads, len, head_dim]");
    const at::Tensor kf = k.to(at::kFloat).contiguous(), vf = v.to(at::kFloat).contiguous();
    const at::Tensor n = lengths.to(at::kLong).contiguous();
    TORCH_CHECK(n.numel() == batch, "CpuDecoder.set_cache: one length per sequence");
    const int64_t len = k.size(2), *np = n.data_ptr<int64_t>();
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(np[b] >= 0 && np[b] <= len, "CpuDecoder.set_cache: length ", np[b], " outside 0..", len);
      longest = std::max(longest, np[b]);
    }
    reserve(longest);
    Layer& L = layers[layer];
    const float* kp = kf.data_ptr<float>();
    const float* vp = vf.data_ptr<float>();
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / kv_heads, h = r % kv_heads, skip = len - np[b];
        for (int64_t j = 0; j < np[b]; ++j) {
          const int64_t at = (r * len + skip + j) * head_dim;
          write(L, b, h, j, kp + at, vp + at);
        }
      }
    });
  }

  int64_t cache_bytes() const {
    int64_t total = 0;
    for (const auto& L : layers)
      for (const auto* list : {&L.k_blocks, &L.v_blocks, &L.k_scales, &L.v_scales})
        for (const auto& t : *list) total += t.numel() * static_cast<int64_t>(t.element_size());
    return total;
  }

  // tokens int64 [B] (ids in the vocabulary), positions int64 [B] (sequence b has positions[b] cached
  // positions, below max_len) -> logits fp32 [B, V]; writes the step's keys and values at positions[b].
  at::Tensor step(at::Tensor tokens, at::Tensor positions) {
    TORCH_CHECK(batch > 0, "CpuDecoder.step: call reset(batch) first");
    TORCH_CHECK(tokens.numel() == batch && positions.numel() == batch, "CpuDecoder.step: ", tokens.numel(),
                " tokens for a cache of ", batch, " sequences");
    const at::Tensor pos = positions.to(at::kLong).contiguous();
    const int64_t* pp = pos.data_ptr<int64_t>();
    std::vector<int64_t> lengths(batch);
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(pp[b] >= 0 && pp[b] < max_len, "CpuDecoder.step: position ", pp[b], " outside the cache (max_len ",
                  max_len, ")");
      lengths[b] = pp[b] + 1;
    }
    reserve(*std::max_element(lengths.begin(), lengths.end()));
    const int64_t B = batch, H = hidden, hd = head_dim, qd = heads * hd, kvd = kv_heads * hd, half = hd / 2;
    at::Tensor h = at::index_select(embed, 0, tokens.reshape({-1}).to(at::kLong)).to(at::kFloat).contiguous();
    at::Tensor xn = at::empty({B, H}, at::kFloat);
    at::Tensor attn = at::empty({B, qd}, at::kFloat);
    at::Tensor act = at::empty({B, intermediate}, at::kFloat);
    float* hp = h.data_ptr<float>();
    float* xp = xn.data_ptr<float>();
    std::vector<float> cos_sin(B * 2 * hd);  // per sequence: cos [hd], sin [hd]
    const float* inv = inv_freq.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < half; ++i) {
        const float f = static_cast<float>(pp[b]) * inv[i];
        const float c = std::cos(f) * static_cast<float>(rope_scaling), sn = std::sin(f) * static_cast<float>(rope_scaling);
        cos_sin[b * 2 * hd + i] = cos_sin[b * 2 * hd + i + half] = c;
        cos_sin[b * 2 * hd + hd + i] = cos_sin[b * 2 * hd + hd + i + half] = sn;
      }
    for (auto& L : layers) {
      rms_norm(hp, L.in_norm.data_ptr<float>(), xp, B, H, H, eps);
      at::Tensor qkv = run_group(L.qkv, xn);  // [B, qd + 2 kvd]
      float* p = qkv.data_ptr<float>();
      const int64_t w = qd + 2 * kvd;
      for (int64_t b = 0; b < B; ++b) {
        float* q = p + b * w;
        float* k = q + qd;
        const float* v = k + kvd;
        const float* cr = cos_sin.data() + b * 2 * hd;
        const float* sr = cr + hd;
        if (L.q_norm.defined()) rms_norm(q, L.q_norm.data_ptr<float>(), q, heads, hd, hd, eps);
        if (L.k_norm.defined()) rms_norm(k, L.k_norm.data_ptr<float>(), k, kv_heads, hd, hd, eps);
        for (int64_t i = 0; i < heads; ++i) {
          rotate(q + i * hd, cr, sr, hd);
          if (rotated) hadamard(q + i * hd, hd);  // (q H)(k H)^T = q k^T
        }
        for (int64_t i = 0; i < kv_heads; ++i) {
          rotate(k + i * hd, cr, sr, hd);
          write(L, b, i, pp[b], k + i * hd, v + i * hd);
        }
      }
      quantkit::KvBlocks view;
      view.dtype = cache_dtype, view.batch = B, view.kv_heads = kv_heads, view.head_dim = hd, view.block = block;
      for (int64_t i = 0; i < blocks; ++i) {
        view.k.push_back(L.k_blocks[i].data_ptr());
        view.v.push_back(L.v_blocks[i].data_ptr());
        if (cache_dtype == quantkit::KV_INT8) {
          view.k_scale.push_back(L.k_scales[i].data_ptr<float>());
          view.v_scale.push_back(L.v_scales[i].data_ptr<float>());
        }
      }
      if (cache_dtype == quantkit::KV_FP8)
        view.k_head_scale = L.k_head_scale.data_ptr<float>(), view.v_head_scale = L.v_head_scale.data_ptr<float>();
      quantkit::decode_attention_cpu(p, w, attn.data_ptr<float>(), heads, view, lengths.data(),
                                     static_cast<float>(scaling), 0, isa);
      if (rotated) {  // softmax(.) (v H) = o H: back by H (H H = I)
        float* o = attn.data_ptr<float>();
        for (int64_t r = 0; r < B * heads; ++r) hadamard(o + r * hd, hd);
      }
      h.add_(run_linear(L.o, attn));
      rms_norm(hp, L.post_norm.data_ptr<float>(), xp, B, H, H, eps);
      at::Tensor gu = run_group(L.gate_up, xn);  // [B, 2I]: gate, up
      const float* g = gu.data_ptr<float>();
      float* a = act.data_ptr<float>();
      const int64_t I = intermediate;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < I; ++j) {
          const float gv = g[b * 2 * I + j];
          a[b * I + j] = gv / (1.f + std::exp(-gv)) * g[b * 2 * I + I + j];
        }
      h.add_(run_linear(L.down, act));
    }
    rms_norm(hp, final_norm.data_ptr<float>(), xp, B, H, H, eps);
    return run_linear(lm_head, xn);
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(quantkit, m) {
  m.class_<CpuDecoder>("CpuDecoder")
      .def(torch::init<std::vector<int64_t>, std::vector<double>, at::Tensor, at::Tensor, at::Tensor>())
      .def("add_linear", &CpuDecoder::add_linear)
      .def("set_kv_scales", &CpuDecoder::set_kv_scales)
      .def("set_rotation", &CpuDecoder::set_rotation)
      .def("set_norms", &CpuDecoder::set_norms)
      .def("reset", &CpuDecoder::reset)
      .def("set_cache", &CpuDecoder::set_cache)
      .def("cache_bytes", &CpuDecoder::cache_bytes)
      .def("step", &CpuDecoder::step);
}
