"""Where decode's KV cache overtakes the weights, from a bench's decode records.

A decode step reads a fixed part (the decoder's weights and the output head, whatever the context) and
the KV cache, which grows by the same number of bytes with every cached position. Both are in each
record's roofline breakdown; this module splits them, finds the context at which the cache reads as
many bytes as the weights, and compares variants that store the same weights with caches of different
widths (W4 with a bf16 cache against W4 with an FP8 one): what the narrower cache buys at the longest
context measured, against what its bytes allow.
"""

from __future__ import annotations

from dataclasses import dataclass

from .results import ranges_overlap, records, variant_names

FIXED_KEYS = ("weights", "lm_head")  # what "the weights" means here: the model's bytes read every step
SAME_WEIGHTS = 0.005  # two variants store the same weights when their fixed bytes differ by less than this


@dataclass(frozen=True)
class CacheGrowth:
    """One variant's decode bytes at one batch size: ``weight_bytes`` read every step (decoder linears
    and output head), ``cache_bytes_per_token``: KV-cache bytes read per cached position (all layers,
    the whole batch), and its decode records by context length."""

    variant: str
    batch: int
    weight_bytes: float
    cache_bytes_per_token: float
    by_context: dict[int, dict]

    @property
    def crossover_context(self) -> float:
        """The context at which the cache reads as many bytes as the weights."""
        return self.weight_bytes / self.cache_bytes_per_token

    def step_bytes(self, context_len: int) -> float:
        """The weight and cache bytes of a step at ``context_len`` (it attends to its own position too)."""
        return self.weight_bytes + self.cache_bytes_per_token * (context_len + 1)

    def cache_share(self, context_len: int) -> float:
        """The cache's share of the step's weight and cache bytes at ``context_len``."""
        return 1 - self.weight_bytes / self.step_bytes(context_len)


def cache_growth(bench: dict, batch: int) -> list[CacheGrowth]:
    """Each variant's CacheGrowth at ``batch``, in the bench's variant order (variants without decode
    records at that batch, or whose records carry no KV bytes, are left out)."""
    out = []
    for name in variant_names(bench):
        rs = [r for r in records(bench, "decode", name, batch=batch) if "roofline" in r]
        if not rs:
            continue
        parts = rs[-1]["roofline"]["bytes_breakdown"]
        attended = rs[-1]["context_len"] + 1  # the step attends to the cached positions and its own
        if not parts.get("kv_read"):
            continue
        out.append(CacheGrowth(name, batch, sum(parts.get(k, 0.0) for k in FIXED_KEYS),
                               parts["kv_read"] / attended, {r["context_len"]: r for r in rs}))
    return out


def narrower_cache_pairs(growth: list[CacheGrowth]) -> list[tuple[CacheGrowth, CacheGrowth]]:
    """(wider, narrower) pairs of variants that store the same weights and differ in the cache's width."""
    pairs = []
    for narrow in growth:
        wide = [g for g in growth if g.cache_bytes_per_token > 1.01 * narrow.cache_bytes_per_token
                and abs(g.weight_bytes - narrow.weight_bytes) <= SAME_WEIGHTS * narrow.weight_bytes]
        if wide:
            pairs.append((min(wide, key=lambda g: g.cache_bytes_per_token), narrow))
    return pairs


def _mib(n: float) -> str:
    return f"{n / 2**20:.3g} MiB"


def _tokens(n: float) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else f"{n:.0f}"


def growth_lines(bench: dict, batch: int) -> list[str]:
    """The report's Markdown on the cache against the weights at ``batch``: a table of where each
    variant's cache overtakes its weights and the cache's share at the longest context, then what each
    narrower cache buys there (measured ratio of medians against the ratio of the step's weight and
    cache bytes). Empty without decode records at two or more contexts."""
    growth = [g for g in cache_growth(bench, batch) if len(g.by_context) >= 2]
    if not growth:
        return []
    longest = max(max(g.by_context) for g in growth)
    lines = [f"Where the KV cache overtakes the weights, batch {batch}: a decode step reads the weights (the same at "
             f"every context) and the cache (growing with every token); the cache reads as many bytes as the weights "
             f"at the context in the fourth column.", "",
             f"| variant | weights read a step | cache per token | cache = weights at | cache's share at {longest} |",
             "|---|---:|---:|---:|---:|"]
    for g in growth:
        lines.append(f"| {g.variant} | {_mib(g.weight_bytes)} | {g.cache_bytes_per_token / 1024:.1f} KiB | "
                     f"{_tokens(g.crossover_context)} tokens | {100 * g.cache_share(longest):.0f}% |")
    said = []
    for wide, narrow in narrower_cache_pairs(growth):
        if longest not in wide.by_context or longest not in narrow.by_context:
            continue
        shortest = min(set(wide.by_context) & set(narrow.by_context))
        ratio = {c: wide.by_context[c]["median_s"] / narrow.by_context[c]["median_s"] for c in (shortest, longest)}
        noise = (" (the repeats' ranges overlap: the run does not tell the two apart)"
                 if ranges_overlap(wide.by_context[longest], narrow.by_context[longest]) else "")
        said.append(
            f"{narrow.variant}'s cache is {wide.cache_bytes_per_token / narrow.cache_bytes_per_token:.1f}x narrower "
            f"than {wide.variant}'s: at {longest} tokens its step ran {ratio[longest]:.2f}x as fast{noise}, where the "
            f"weight and cache bytes allow {wide.step_bytes(longest) / narrow.step_bytes(longest):.2f}x; at "
            f"{shortest} tokens, where the cache is small, {ratio[shortest]:.2f}x.")
    return lines + ([""] + [" ".join(said)] if said else [])
