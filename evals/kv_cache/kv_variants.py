"""The KV-cache variants compared by the evaluation, as cache factories, and a model wrapper that
runs every forward with a fresh cache of one variant.

Every variant returns to attention exactly what it stores (also during the prefill of a window),
so a single forward pass over a window measures the effect of the cache's precision on every
position.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from quantkit.modules.kv_cache import FP8KVCache


class RoundedKVLayer(DynamicLayer):
    """Stores K/V [B, Hkv, T, D] in `storage_dtype` (e.g. bf16 under an fp32 model); returns them in the model dtype."""

    def __init__(self, storage_dtype: torch.dtype):
        super().__init__()
        self.storage_dtype = storage_dtype

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states.to(self.storage_dtype), value_states.to(self.storage_dtype))
        return keys.to(key_states.dtype), values.to(value_states.dtype)


def rounded_cache(model: nn.Module, storage_dtype: torch.dtype) -> Cache:
    return Cache(layers=[RoundedKVLayer(storage_dtype) for _ in range(model.config.num_hidden_layers)])


def unit_scales(model: nn.Module) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {i: (torch.ones(1), torch.ones(1)) for i in range(model.config.num_hidden_layers)}


def cache_factories(model: nn.Module, scales: dict, per_head_scales: dict) -> dict[str, Callable[[], Cache]]:
    """Variant name -> factory of a fresh cache for `model` (an fp32 model: "fp32 KV" is the baseline)."""
    return {
        "fp32 KV (baseline)": lambda: DynamicCache(config=model.config),
        "bf16 KV": lambda: rounded_cache(model, torch.bfloat16),
        "fp16 KV": lambda: rounded_cache(model, torch.float16),
        "FP8 KV, calibrated per-tensor scales": lambda: FP8KVCache(model.config, scales),
        "FP8 KV, calibrated per-head scales": lambda: FP8KVCache(model.config, per_head_scales),
        "FP8 KV, scale 1.0": lambda: FP8KVCache(model.config, unit_scales(model)),
    }


@torch.no_grad()
def magnify_kv(model: nn.Module, factor: float) -> nn.Module:
    """Multiply every layer's keys and values by `factor` without changing the model's function.

    k_proj *= factor with q_proj /= factor keeps q.k (RoPE is linear); v_proj *= factor with
    o_proj /= factor keeps the attention output. Only the cached K/V magnitudes change: this
    shows what calibration buys when activations leave e4m3's comfortable range. In place.
    """
    from quantkit.modules.kv_scales import attention_modules

    for name, attn in attention_modules(model).values():
        if hasattr(attn, "k_norm") or hasattr(attn, "q_norm"):
            raise ValueError(f"{name} normalises q/k: scaling k_proj would be undone, pick a Llama-style model")
        for proj, f in ((attn.k_proj, factor), (attn.q_proj, 1 / factor), (attn.v_proj, factor),
                        (attn.o_proj, 1 / factor)):
            proj.weight.mul_(f)
            if proj.bias is not None and proj is not attn.o_proj:
                proj.bias.mul_(f)
    return model


class WithCache(nn.Module):
    """model(ids) with a fresh cache from `make_cache` on every call (for quantkit.harness.quality)."""

    def __init__(self, model: nn.Module, make_cache: Callable[[], Cache]):
        super().__init__()
        self.model = model
        self.make_cache = make_cache

    def forward(self, input_ids: torch.Tensor):
        return self.model(input_ids=input_ids, cache=self.make_cache(), use_cache=True)


def cache_bytes(cache: Cache) -> int:
    """Bytes of the stored keys and values of a filled cache (any of the variants above)."""
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                total += t.numel() * t.element_size()
    return total
