"""Decode-step time against context length: an FP8 cache and a bf16 cache measured side by side.

The caches are filled directly with random keys/values of the context length (no prefill), then
one-token decode steps of the whole model are timed, alternating the variants so that both see
the same machine state. On CPU, absolute times mean little: read the ratios.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from quantkit.eval.hardware import synchronize
from quantkit.modules.kv_cache import FP8KVCache
from quantkit.modules.kv_scales import cache_keyword


def filled_cache(model: nn.Module, kind: str, context: int, scales: dict, batch: int = 1,
                 attention: str = "dequantize"):
    """A cache of `context` random tokens per layer: kind "bf16" (DynamicCache in the model dtype) or "fp8"."""
    config = model.config
    num_kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    cache = DynamicCache(config=config) if kind == "bf16" else FP8KVCache(config, scales, attention=attention)
    for layer in cache.layers:
        k = torch.randn(batch, num_kv_heads, context, head_dim, device=device, dtype=dtype)
        layer.update(k, torch.randn_like(k))
    return cache


@torch.no_grad()
def decode_step_times(model: nn.Module, contexts: list[int], scales: dict, *, steps: int = 15, warmup: int = 3,
                      kinds: tuple[str, ...] = ("bf16", "fp8"), attention: str = "dequantize") -> list[dict]:
    """Median seconds of one decode step per (context, cache kind); kinds measured interleaved."""
    device = next(model.parameters()).device
    cache_kw = cache_keyword(model)
    rows = []
    for context in contexts:
        caches = {kind: filled_cache(model, kind, context, scales, attention=attention) for kind in kinds}
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        token = torch.randint(0, model.config.vocab_size, (1, 1), device=device)
        for step in range(warmup + steps):
            for kind in kinds:
                synchronize(device)
                start = time.perf_counter()
                model(input_ids=token, use_cache=True, **{cache_kw: caches[kind]})
                synchronize(device)
                if step >= warmup:
                    times[kind].append(time.perf_counter() - start)
        row = {"context": context}
        for kind in kinds:
            row[f"{kind}_step_ms"] = 1e3 * statistics.median(times[kind])
            row[f"{kind}_cache_mib"] = caches[kind].nbytes / 2**20 if kind == "fp8" else sum(
                t.numel() * t.element_size() for layer in caches[kind].layers for t in (layer.keys, layer.values)
            ) / 2**20
        if "bf16" in kinds and "fp8" in kinds:
            row["fp8_over_bf16_time"] = row["fp8_step_ms"] / row["bf16_step_ms"]
        rows.append(row)
    return rows
