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
//              rotary (rotate-half convention, cos/sin tables from the model's own rotary module);
//              k, v -> cache[pos]; o = softmax(q k^T * scaling) v over positions 0..pos (GQA);
//              h += o W_o^T; x = rmsnorm(h) * w_post; h += (silu(x W_g^T) * x W_u^T) W_d^T
//   logits = rmsnorm(h) * w_final W_lm^T                          fp32 [B, V]
//
// Each linear is either a quantized one in the cpu_q8 layout (quantkit::wna16_cpu_q8dot, its int8
// activation rounding included) or a float one (at::linear in the weight's dtype, x cast to it): the
// same loop runs a float model and its quantized variants, so they differ only in their linears.
// The KV cache is fp32 [B, kv_heads, max_len, head_dim] per layer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

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

struct Layer {
  std::vector<Linear> qkv, gate_up;
  Linear o, down;
  at::Tensor in_norm, post_norm, q_norm, k_norm;  // fp32; q_norm / k_norm [head_dim] or undefined
  at::Tensor k_cache, v_cache;                    // fp32 [B, kv_heads, max_len, head_dim]
};

struct CpuDecoder : torch::CustomClassHolder {
  int64_t n_layers, hidden, heads, kv_heads, head_dim, intermediate, max_len;
  double eps, scaling;
  at::Tensor embed, final_norm, cos, sin;  // embed [V, H] (any float dtype); cos / sin fp32 [max_len, head_dim]
  Linear lm_head;
  std::vector<Layer> layers;
  int64_t batch = 0;

  // dims: layers, hidden, heads, kv_heads, head_dim, intermediate, max_len; params: rms eps, attention scaling.
  CpuDecoder(std::vector<int64_t> dims, std::vector<double> params, at::Tensor embed_, at::Tensor final_norm_,
             at::Tensor cos_, at::Tensor sin_) {
    TORCH_CHECK(dims.size() == 7 && params.size() == 2, "CpuDecoder: dims needs 7 values and params 2");
    n_layers = dims[0], hidden = dims[1], heads = dims[2], kv_heads = dims[3], head_dim = dims[4];
    intermediate = dims[5], max_len = dims[6];
    eps = params[0], scaling = params[1];
    TORCH_CHECK(n_layers > 0 && hidden > 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0 &&
                    head_dim > 0 && head_dim % 2 == 0 && intermediate > 0 && max_len > 0,
                "CpuDecoder: invalid dimensions");
    TORCH_CHECK(embed_.dim() == 2 && embed_.size(1) == hidden, "CpuDecoder: embed must be [V, hidden]");
    TORCH_CHECK(cos_.sizes() == sin_.sizes() && cos_.dim() == 2 && cos_.size(0) == max_len &&
                    cos_.size(1) == head_dim, "CpuDecoder: cos / sin must be [max_len, head_dim]");
    embed = embed_.contiguous();
    final_norm = final_norm_.to(at::kFloat).contiguous();
    cos = cos_.to(at::kFloat).contiguous();
    sin = sin_.to(at::kFloat).contiguous();
    layers.resize(n_layers);
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

  // A zeroed cache for `b` sequences (positions 0..max_len-1).
  void reset(int64_t b) {
    TORCH_CHECK(b > 0, "CpuDecoder.reset: batch must be positive");
    batch = b;
    for (auto& L : layers) {
      L.k_cache = at::zeros({b, kv_heads, max_len, head_dim}, at::kFloat);
      L.v_cache = at::zeros({b, kv_heads, max_len, head_dim}, at::kFloat);
    }
  }

  // Positions 0..len-1 of one layer's cache from k, v [B, kv_heads, len, head_dim] (after rotary, as
  // transformers caches them).
  void set_cache(int64_t layer, at::Tensor k, at::Tensor v) {
    TORCH_CHECK(batch > 0, "CpuDecoder.set_cache: call reset(batch) first");
    TORCH_CHECK(layer >= 0 && layer < n_layers, "CpuDecoder.set_cache: layer out of range");
    TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == batch && k.size(1) == kv_heads &&
                    k.size(2) <= max_len && k.size(3) == head_dim,
                "CpuDecoder.set_cache: k / v must be [batch, kv_heads, len <= max_len, head_dim]");
    const int64_t len = k.size(2);
    layers[layer].k_cache.narrow(2, 0, len).copy_(k);
    layers[layer].v_cache.narrow(2, 0, len).copy_(v);
  }

  int64_t cache_bytes() const {
    int64_t total = 0;
    for (const auto& L : layers)
      if (L.k_cache.defined()) total += (L.k_cache.numel() + L.v_cache.numel()) * 4;
    return total;
  }

  // tokens int64 [B] at position pos (each sequence has pos cached positions) -> logits fp32 [B, V];
  // writes the step's keys and values at pos.
  at::Tensor step(at::Tensor tokens, int64_t pos) {
    TORCH_CHECK(batch > 0, "CpuDecoder.step: call reset(batch) first");
    TORCH_CHECK(tokens.numel() == batch, "CpuDecoder.step: ", tokens.numel(), " tokens for a cache of ", batch,
                " sequences");
    TORCH_CHECK(pos >= 0 && pos < max_len, "CpuDecoder.step: position ", pos, " outside the cache (max_len ",
                max_len, ")");
    const int64_t B = batch, H = hidden, hd = head_dim, qd = heads * hd, kvd = kv_heads * hd;
    const int64_t group = heads / kv_heads, len = pos + 1;
    at::Tensor h = at::index_select(embed, 0, tokens.reshape({-1}).to(at::kLong)).to(at::kFloat).contiguous();
    at::Tensor xn = at::empty({B, H}, at::kFloat);
    at::Tensor attn = at::empty({B, qd}, at::kFloat);
    at::Tensor act = at::empty({B, intermediate}, at::kFloat);
    float* hp = h.data_ptr<float>();
    float* xp = xn.data_ptr<float>();
    const float* cr = cos.data_ptr<float>() + pos * hd;
    const float* sr = sin.data_ptr<float>() + pos * hd;
    for (auto& L : layers) {
      rms_norm(hp, L.in_norm.data_ptr<float>(), xp, B, H, H, eps);
      at::Tensor qkv = run_group(L.qkv, xn);  // [B, qd + 2 kvd]
      float* p = qkv.data_ptr<float>();
      const int64_t w = qd + 2 * kvd;
      float* kc = L.k_cache.data_ptr<float>();
      float* vc = L.v_cache.data_ptr<float>();
      for (int64_t b = 0; b < B; ++b) {
        float* q = p + b * w;
        float* k = q + qd;
        const float* v = k + kvd;
        if (L.q_norm.defined()) rms_norm(q, L.q_norm.data_ptr<float>(), q, heads, hd, hd, eps);
        if (L.k_norm.defined()) rms_norm(k, L.k_norm.data_ptr<float>(), k, kv_heads, hd, hd, eps);
        for (int64_t i = 0; i < heads; ++i) rotate(q + i * hd, cr, sr, hd);
        for (int64_t i = 0; i < kv_heads; ++i) {
          rotate(k + i * hd, cr, sr, hd);
          const int64_t at_pos = ((b * kv_heads + i) * max_len + pos) * hd;
          std::copy(k + i * hd, k + (i + 1) * hd, kc + at_pos);
          std::copy(v + i * hd, v + (i + 1) * hd, vc + at_pos);
        }
      }
      float* ap = attn.data_ptr<float>();
      const float sc = static_cast<float>(scaling);
      at::parallel_for(0, B * heads, 1, [&](int64_t t0, int64_t t1) {
        std::vector<float> score(len);
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t b = t / heads, i = t % heads, kvh = i / group;
          const float* q = p + b * w + i * hd;
          const float* K = kc + (b * kv_heads + kvh) * max_len * hd;
          const float* V = vc + (b * kv_heads + kvh) * max_len * hd;
          float mx = -INFINITY;
          for (int64_t j = 0; j < len; ++j) {
            float dot = 0.f;
            for (int64_t e = 0; e < hd; ++e) dot += q[e] * K[j * hd + e];
            score[j] = dot * sc;
            mx = std::max(mx, score[j]);
          }
          float sum = 0.f;
          for (int64_t j = 0; j < len; ++j) sum += (score[j] = std::exp(score[j] - mx));
          float* o = ap + b * qd + i * hd;
          std::fill(o, o + hd, 0.f);
          for (int64_t j = 0; j < len; ++j) {
            const float pj = score[j] / sum;
            for (int64_t e = 0; e < hd; ++e) o[e] += pj * V[j * hd + e];
          }
        }
      });
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
      .def(torch::init<std::vector<int64_t>, std::vector<double>, at::Tensor, at::Tensor, at::Tensor, at::Tensor>())
      .def("add_linear", &CpuDecoder::add_linear)
      .def("set_norms", &CpuDecoder::set_norms)
      .def("reset", &CpuDecoder::reset)
      .def("set_cache", &CpuDecoder::set_cache)
      .def("cache_bytes", &CpuDecoder::cache_bytes)
      .def("step", &CpuDecoder::step);
}
