"""A model to time decode on this CPU: a random-weight Llama whose weights exceed the last-level cache.

Decode is bound by memory bandwidth only when its weights stream from DRAM; a model that fits in the
CPU's last-level cache (a 10 MB reference model in a 32 MiB L3) is timed at cache speed, where the
roofline (DRAM bandwidth) does not apply and quantization saves little. So the model is sized from
the cache: the smallest variant quantkit makes (4-bit weights with a 16-bit scale per group of 128)
must still be ``CACHE_MULTIPLE`` times the cache; the float model is then 4x (bf16) or 8x (float32)
that. Random weights time the same as trained ones; quality is measured on a trained model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

CACHE_MULTIPLE = 2.0  # the smallest variant's decoder weights, in last-level caches
SMALLEST_BITS_PER_WEIGHT = 4 + 16 / 128  # int4 with a 16-bit scale per group of 128
HIDDEN_SIZES = (2048, 1024, 512, 256, 128)  # the widest that still gives MIN_LAYERS layers is taken
MIN_LAYERS = 8
MAX_FLOAT32_BYTES = 2 << 30  # cap on the float model's decoder weights (a huge cache would ask for more)
VOCAB = 4096  # random token ids: the vocabulary only sizes the embedding and lm_head
MAX_CONTEXT = 16384  # the model's context: decode is timed up to 8192 cached tokens
ASSUMED_CACHE_BYTES = 32 << 20  # when the cache cannot be read


@dataclass(frozen=True)
class CacheInfo:
    """The last-level cache: its size in bytes over all its instances, and where that was read."""

    bytes: int
    source: str


def last_level_cache(sysfs: str | Path = "/sys/devices/system/cpu") -> CacheInfo:
    """The highest-level data or unified cache, summed over its instances (one per group of cores that
    shares it), from /sys; an assumed 32 MiB when /sys does not say."""
    root = Path(sysfs)
    best: dict[int, dict[str, int]] = {}  # level -> {shared_cpu_list: bytes}
    for index in sorted(root.glob("cpu[0-9]*/cache/index[0-9]*")):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            size = _parse_size((index / "size").read_text().strip())
            shared = (index / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified"):
            best.setdefault(level, {})[shared] = size
    if not best:
        return CacheInfo(ASSUMED_CACHE_BYTES, f"assumed {ASSUMED_CACHE_BYTES >> 20} MiB ({root}/cpu*/cache unreadable)")
    level = max(best)
    instances = best[level]
    each = sorted(set(instances.values()))
    return CacheInfo(sum(instances.values()),
                     f"L{level}, {len(instances)} x {' / '.join(_mib(b) for b in each)} in {root}/cpu*/cache")


def _parse_size(text: str) -> int:
    """'32768K' / '32M' / '1024' (bytes) -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text)


def _mib(n: float) -> str:
    return f"{n / 2**20:.3g} MiB"


def _layer_params(hidden: int) -> tuple[int, int, int, int]:
    """(linear parameters per decoder layer, intermediate size, heads, KV heads) of a Llama layer of
    width ``hidden``: heads of 64, a quarter as many KV heads, an MLP 2.75x wide (a multiple of 128)."""
    heads = hidden // 64
    kv_heads = max(1, heads // 4)
    intermediate = 128 * math.ceil(2.75 * hidden / 128)
    attention = 2 * hidden * hidden + 2 * hidden * kv_heads * 64  # q, o; k, v
    return attention + 3 * hidden * intermediate, intermediate, heads, kv_heads


def bandwidth_bound_config(cache_bytes: int) -> dict:
    """A Llama config.json (dict) whose decoder weights, stored at SMALLEST_BITS_PER_WEIGHT, are at least
    CACHE_MULTIPLE x ``cache_bytes`` (float32 weights capped at MAX_FLOAT32_BYTES)."""
    target = CACHE_MULTIPLE * cache_bytes / (SMALLEST_BITS_PER_WEIGHT / 8)  # decoder linear parameters
    target = min(target, MAX_FLOAT32_BYTES / 4)
    hidden = next((h for h in HIDDEN_SIZES if target / _layer_params(h)[0] >= MIN_LAYERS), HIDDEN_SIZES[-1])
    per_layer, intermediate, heads, kv_heads = _layer_params(hidden)
    layers = max(2, min(math.ceil(target / per_layer), MAX_FLOAT32_BYTES // (4 * per_layer)))
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "vocab_size": VOCAB, "max_position_embeddings": MAX_CONTEXT, "tie_word_embeddings": False}

