"""Decode-step time against context length: FP8 caches and bf16 caches measured side by side.

Cache kinds: "bf16" (transformers' DynamicCache in the model dtype), "fp8" (the growing
FP8KVCache), "bf16-static" (StaticCache) and "fp8-static" (StaticFP8KVCache), the static ones
sized for the context plus the timed steps. The caches are filled directly with random
keys/values of the context length (no prefill), then one-token decode steps of the whole model
are timed, alternating the kinds so that all see the same machine state. On CPU, absolute times
mean little: read the ratios.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, StaticCache

from quantkit.harness.hardware import synchronize
from quantkit.modules.kv_cache import FP8KVCache, StaticFP8KVCache
from quantkit.modules.kv_scales import cache_keyword

KINDS = ("bf16", "fp8", "bf16-static", "fp8-static")


def filled_cache(model: nn.Module, kind: str, context: int, scales: dict, batch: int = 1,
                 attention: str = "dequantize", max_cache_len: int | None = None):
    """A cache (one of KINDS) of `context` random tokens per layer; static kinds hold max_cache_len positions."""
    config = model.config
    num_kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    max_cache_len = max_cache_len or context + 1
    cache = {
        "bf16": lambda: DynamicCache(config=config),
        "fp8": lambda: FP8KVCache(config, scales, attention=attention),
        "bf16-static": lambda: StaticCache(config=config, max_cache_len=max_cache_len),
        "fp8-static": lambda: StaticFP8KVCache(config, max_cache_len, scales, attention=attention),
    }[kind]()
    for layer in cache.layers:
        k = torch.randn(batch, num_kv_heads, context, head_dim, device=device, dtype=dtype)
        layer.update(k, torch.randn_like(k))
    return cache


def cache_mib(cache) -> float:
    """MiB of the keys and values a cache holds (allocated, for the static kinds)."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)) / 2**20


@torch.no_grad()
def decode_step_times(model: nn.Module, contexts: list[int], scales: dict, *, steps: int = 15, warmup: int = 3,
                      kinds: tuple[str, ...] = ("bf16", "fp8"), attention: str = "dequantize") -> list[dict]:
    """Median seconds of one decode step per (context, cache kind); kinds measured interleaved."""
    device = next(model.parameters()).device
    cache_kw = cache_keyword(model)
    rows = []
    for context in contexts:
        max_len = context + warmup + steps + 1
        caches = {kind: filled_cache(model, kind, context, scales, attention=attention, max_cache_len=max_len)
                  for kind in kinds}
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
            row[f"{kind}_cache_mib"] = cache_mib(caches[kind])
        for kind in kinds:
            if kind != "bf16" and "bf16" in kinds:
                row[f"{kind}_over_bf16_time"] = row[f"{kind}_step_ms"] / row["bf16_step_ms"]
        rows.append(row)
    return rows
