"""quantkit's C++ decode loop on CPU: one call per decode step for Llama-family models.

On a CPU, a transformers decode step of a small model is thousands of small op calls from Python
(norms, rotary embeddings, cache updates, attention, residual adds; ~4,800 for SmolLM2-135M), and
they, not the bytes of the weights, set its time: the thesis that fewer weight bytes decode faster
cannot show through them. ``CpuDecoder`` runs the whole step in C++ (``kernels/csrc/decode_step.cpp``,
``torch.classes.quantkit.CpuDecoder``) on the model's own tensors: quantized linears through
``quantkit::wna16_cpu_q8dot`` (their int8 activation rounding included), float linears through
``at::linear`` in their dtype. A float model and its quantized variants run the same loop, so they
differ only in their linears.

    model = quantkit.load("ckpt")                      # or any supported float transformers model
    decoder = quantkit.CpuDecoder(model, max_len=2048)
    ids = decoder.generate(input_ids, max_new_tokens=64)  # greedy: prefill in transformers, decode in C++

Supported: LlamaForCausalLM, MistralForCausalLM (no sliding window), Qwen2ForCausalLM, Qwen3ForCausalLM
on CPU: RMSNorm, SiLU-gated MLP, grouped-query attention, rotary embeddings whose tables do not depend on
the sequence length (default, linear, llama3, yarn), tied or untied lm_head, biases. Anything else
(mixture-of-experts layers, sliding windows, a quantized KV cache, GGUF K-quant linears, a layer the
C++ kernel does not run) raises ``UsageError`` naming it; the model itself still runs in transformers.

Numerics: the residual stream, norms, rotary embeddings, attention (softmax over all cached positions)
and the KV cache are fp32 (the cache holds ``4 * 2 * layers * kv_heads * head_dim`` bytes per position
and sequence); a bf16 model's float linears compute in bf16 as transformers' do. Against the model's own
fp32 forward the logits agree to fp32 rounding (tests/test_cpu_decoder.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import UsageError
from .modules.fused_linear import FusedPart
from .modules.kv_scales import cache_keyword, read_kv_scales
from .modules.quant_linear import QuantLinear

#: the model types (config.model_type) the loop runs
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
#: rotary types whose cos / sin tables depend on the position only (not on the sequence length)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def decoder_unavailable(model: nn.Module) -> str | None:
    """Why ``CpuDecoder(model)`` cannot run here (the C++ kernels did not build, or the model is not
    supported), or None."""
    from .kernels.cpu_extension import load_cpu_kernels

    kernels = load_cpu_kernels()
    return unsupported_reason(model) if kernels.available else kernels.reason


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``CpuDecoder`` cannot run ``model`` (one line), or None when it can."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        return f"model type {model_type!r} is not one of {', '.join(ARCHITECTURES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the loop's MLP is SiLU-gated)"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):  # Qwen2/3 keep a window they do not use
        return f"sliding-window attention (sliding_window={window})"
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") not in STATIC_ROPE_TYPES:
        return f"rotary type {getattr(rotary, 'rope_type', None)!r} (supported: {', '.join(STATIC_ROPE_TYPES)})"
    if next(model.parameters()).device.type != "cpu":
        return "the model is not on the CPU"
    if read_kv_scales(model)[0]:
        return "an FP8 KV cache (the model holds k_scale / v_scale; the loop's cache is fp32)"
    for i, layer in enumerate(inner.layers):
        mlp, attn = getattr(layer, "mlp", None), getattr(layer, "self_attn", None)
        if mlp is None or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return f"layer {i}'s MLP is not a gated MLP (mixture-of-experts layers are not supported)"
        if attn is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return f"layer {i}'s attention has no q/k/v/o projections"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            reason = _linear_reason(getattr(attn if name[0] in "qkvo" else mlp, name))
            if reason:
                return f"layer {i} {name}: {reason}"
    return _linear_reason(model.get_output_embeddings())


def _linear_reason(module: nn.Module) -> str | None:
    if isinstance(module, FusedPart):
        module = module._group.fused
    if isinstance(module, QuantLinear):
        return None if module.kernel_layout == "cpu_q8" else (
            f"a quantized linear prepared for {module.kernel_layout!r}, not quantkit's C++ kernel (cpu_q8)")
    if type(module) is nn.Linear:
        return None
    return f"{type(module).__name__} is neither nn.Linear nor a QuantLinear"


class CpuDecoder:
    """Greedy batch decode of a supported model in quantkit's C++ loop (see the module docstring).

    Holds the model's tensors (not copies, except the float q/k/v and gate/up weights, concatenated
    once) and its own fp32 KV cache of ``max_len`` positions per sequence."""

    def __init__(self, model: nn.Module, max_len: int | None = None) -> None:
        reason = decoder_unavailable(model)
        if reason:
            raise UsageError(f"quantkit's CPU decoder cannot run this model: {reason}. Run it in transformers "
                             f"(model.generate) instead")
        config, inner = model.config, model.model
        self.model = model
        self.max_len = int(config.max_position_embeddings if max_len is None else max_len)
        if self.max_len < 1:
            raise UsageError(f"max_len must be a positive number of positions, got {max_len}")
        attn0 = inner.layers[0].self_attn
        head_dim = attn0.head_dim
        dims = [config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                config.num_key_value_heads, head_dim, config.intermediate_size, self.max_len]
        eps = float(inner.norm.variance_epsilon)
        with torch.inference_mode():
            positions = torch.arange(self.max_len).unsqueeze(0)
            cos, sin = inner.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
            embed = model.get_input_embeddings().weight
            self._native = torch.classes.quantkit.CpuDecoder(
                dims, [eps, float(attn0.scaling)], embed, inner.norm.weight, cos[0].float(), sin[0].float())
            for i, layer in enumerate(inner.layers):
                attn, mlp = layer.self_attn, layer.mlp
                self._add_group(i, "qkv", [attn.q_proj, attn.k_proj, attn.v_proj])
                self._add(i, "o", attn.o_proj)
                self._add_group(i, "gate_up", [mlp.gate_proj, mlp.up_proj])
                self._add(i, "down", mlp.down_proj)
                q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
                self._native.set_norms(i, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                       None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight)
            self._add(-1, "lm_head", model.get_output_embeddings())
        self.batch = 0
        self.position = 0  # cached positions per sequence

    def _add(self, layer: int, slot: str, module: nn.Module) -> None:
        if isinstance(module, QuantLinear):
            prepared = module.prepared_tensors()
            self._native.add_linear(layer, slot, True, prepared["cpu_q8_weight"], prepared["cpu_q8_scale"],
                                    prepared.get("cpu_q8_zero"), module.bias)
        else:
            self._native.add_linear(layer, slot, False, module.weight, None, None, module.bias)

    def _add_group(self, layer: int, slot: str, parts: list[nn.Module]) -> None:
        """Projections that read one input: the fused QuantLinear where quantkit.load fused them, one
        concatenated float weight for float ones, else each part in order."""
        if all(isinstance(p, FusedPart) for p in parts) and len({id(p._group) for p in parts}) == 1 and [
                p.index for p in parts] == list(range(len(parts))) and len(parts[0]._group.sizes) == len(parts):
            self._add(layer, slot, parts[0]._group.fused)
        elif all(type(p) is nn.Linear for p in parts) and len({p.weight.dtype for p in parts}) == 1:
            bias = None if all(p.bias is None for p in parts) else torch.cat(
                [p.weight.new_zeros(p.out_features) if p.bias is None else p.bias for p in parts])
            self._native.add_linear(layer, slot, False, torch.cat([p.weight for p in parts]), None, None, bias)
        else:
            for p in parts:
                self._add(layer, slot, p._group.fused if isinstance(p, FusedPart) else p)

    def reset(self, batch: int) -> None:
        """An empty cache for ``batch`` sequences."""
        if batch < 1:
            raise UsageError(f"batch must be a positive number of sequences, got {batch}")
        self._native.reset(batch)
        self.batch, self.position = batch, 0

    def cache_bytes(self) -> int:
        """Bytes of the decoder's KV cache tensors."""
        return int(self._native.cache_bytes())

    def load_cache(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Fill the cache from per-layer keys / values [B, kv_heads, L, head_dim] (as transformers caches
        them, after rotary); the next step decodes at position L."""
        length = keys[0].shape[2]
        if length >= self.max_len:
            raise UsageError(f"{length} cached positions leave no room in a decoder of max_len {self.max_len}")
        self.reset(keys[0].shape[0])
        for i, (k, v) in enumerate(zip(keys, values)):
            self._native.set_cache(i, k.float(), v.float())
        self.position = length

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [B, L] -> logits fp32 [B, V] of the last position: the prompt runs through the
        model's own transformers forward, its keys and values are copied into the decoder's cache."""
        from transformers import DynamicCache

        with torch.inference_mode():
            cache = DynamicCache()
            out = self.model(input_ids, use_cache=True, logits_to_keep=1, **{cache_keyword(self.model): cache})
            self.load_cache([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers])
        return out.logits[:, -1].float()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens int64 [B] (one per sequence) -> logits fp32 [B, V]; the step's keys and values are cached."""
        if self.batch == 0:
            raise UsageError("the decoder holds no sequences: call prefill (or reset) first")
        if self.position >= self.max_len:
            raise UsageError(f"the decoder's cache is full ({self.max_len} positions); make it with a larger max_len")
        with torch.inference_mode():
            logits = self._native.step(tokens.reshape(-1), self.position)
        self.position += 1
        return logits

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, sampling=None, *,
                 eos_token_id: int | list[int] | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """input_ids int64 [B, L] -> [B, L + n]: greedy by default, else as ``sampling`` says (a
        ``quantkit.sampling.SamplingConfig``; ``generator``: its random state). With ``eos_token_id``,
        a sequence ends at one of those tokens (later positions get the first) and generation ends when
        all have, so n <= max_new_tokens; without, n = max_new_tokens."""
        from .decode_loop import decode, eos_stop
        from .sampling import SamplingConfig

        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        return decode(self, input_ids, max_new_tokens, sampling or SamplingConfig(), generator=generator,
                      stop=eos_stop(eos) if eos else None, pad_token_id=eos[0] if eos else None)
