"""Which scheme to serve a model with: roofline-predicted latency and memory, measured quality.

For each candidate scheme (fp16, W8, W4 g128; each with a bf16 or an FP8 KV cache) and a workload
(batch B, prompt P, output O) on a device:
- TTFT = one prefill of B x P tokens;
- TPOT = the mean decode step over the O - 1 steps after the first token (contexts P .. P+O-2);
- total = TTFT + (O - 1) x TPOT;
- memory = weights + a KV cache of B x (P + O) positions (activation workspace not counted);
- quality = perplexity increase and KL divergence from `quantkit eval` results, where given.

The prompt plus the output must fit the model's context (max_position_embeddings). When quality
results or a quality budget are given, a lossy scheme without a measurement of its own is not
recommended (its quality is unknown, not good); without either, the advice is speed and memory only
and says so. The recommendation: among schemes that fit the memory budget and the quality budget, the fastest
in total latency, unless a higher-quality scheme is within ``min_gain`` of it (paying quality for
a speedup the workload does not notice is a bad trade: short outputs are prefill-dominated and
prefill barely speeds up).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import UsageError
from ..quantization.recipe import load_recipe
from .hardware import DeviceSpec
from .results import QualityResult
from .roofline import (
    ModelShape, RooflineScheme, decode_cost, kv_cache_bytes, predict, prefill_cost, scheme_from_quantization_config, scheme_from_recipe,
    fitted_to, standard_schemes, weight_memory_bytes,
)

MAX_DECODE_SAMPLES = 1024  # decode steps evaluated exactly up to this many; sampled evenly beyond


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    output_len: int
    batch: int = 1

    def __post_init__(self):
        if self.prompt_len < 1 or self.output_len < 1 or self.batch < 1:
            raise ValueError(f"prompt_len, output_len and batch must be >= 1; got {self}")

    def check_fits(self, shape: ModelShape) -> None:
        """Refuse a prompt plus output longer than the model's context (when the config gives one)."""
        total = self.prompt_len + self.output_len
        if shape.max_context is not None and total > shape.max_context:
            raise UsageError(f"a prompt of {self.prompt_len} tokens plus {self.output_len} generated is {total} tokens, "
                             f"longer than the model's context of {shape.max_context} (max_position_embeddings): "
                             f"give a prompt and output of {shape.max_context} tokens or fewer in all")


@dataclass
class Candidate:
    scheme: RooflineScheme
    ttft_s: float
    tpot_s: float
    total_s: float
    weights_bytes: float
    kv_bytes: float
    prefill_bound: str
    decode_bound: str
    fits: bool = True
    quality: QualityResult | None = None
    within_quality: bool = True
    excluded_because: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.scheme.name

    @property
    def memory_bytes(self) -> float:
        return self.weights_bytes + self.kv_bytes

    @property
    def eligible(self) -> bool:
        return self.fits and self.within_quality

    @property
    def lossless(self) -> bool:
        """The float reference itself (weights and KV cache in the model dtype): no quality to measure."""
        return not self.scheme.quantized and self.scheme.kv_bytes == self.scheme.dtype_bytes

    def to_dict(self) -> dict:
        q = self.quality
        return {"scheme": self.scheme.to_dict(), "name": self.name, "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
                "total_s": self.total_s, "weights_bytes": self.weights_bytes, "kv_bytes": self.kv_bytes,
                "memory_bytes": self.memory_bytes, "fits": self.fits, "prefill_bound": self.prefill_bound,
                "decode_bound": self.decode_bound, "within_quality": self.within_quality,
                "excluded_because": self.excluded_because,
                "perplexity_increase": None if q is None else q.perplexity_increase,
                "kl_divergence": None if q is None else q.kl_divergence}


@dataclass
class Advice:
    workload: Workload
    device: DeviceSpec
    memory_budget: float
    candidates: list[Candidate]
    recommended: Candidate | None
    reason: str

    def to_dict(self) -> dict:
        return {"workload": vars(self.workload), "device": self.device.to_dict(), "memory_budget": self.memory_budget,
                "candidates": [c.to_dict() for c in self.candidates],
                "recommended": None if self.recommended is None else self.recommended.name, "reason": self.reason}


def mean_decode_seconds(shape: ModelShape, scheme: RooflineScheme, device: DeviceSpec, workload: Workload) -> tuple[float, str]:
    """Mean roofline time of the decode steps after the first token, and the bound of the middle step."""
    steps = workload.output_len - 1
    if steps == 0:
        mid = predict(decode_cost(shape, scheme, workload.prompt_len, workload.batch), device)
        return 0.0, mid.bound
    if steps <= MAX_DECODE_SAMPLES:
        contexts = [workload.prompt_len + i for i in range(steps)]
    else:
        contexts = [workload.prompt_len + round(i * (steps - 1) / (MAX_DECODE_SAMPLES - 1)) for i in range(MAX_DECODE_SAMPLES)]
    times = [predict(decode_cost(shape, scheme, c, workload.batch), device).seconds for c in contexts]
    mid = predict(decode_cost(shape, scheme, contexts[len(contexts) // 2], workload.batch), device)
    return sum(times) / len(times), mid.bound


def evaluate(shape: ModelShape, scheme: RooflineScheme, device: DeviceSpec, workload: Workload) -> Candidate:
    pf = predict(prefill_cost(shape, scheme, workload.prompt_len, workload.batch), device)
    tpot, decode_bound = mean_decode_seconds(shape, scheme, device, workload)
    return Candidate(
        scheme=scheme, ttft_s=pf.seconds, tpot_s=tpot, total_s=pf.seconds + (workload.output_len - 1) * tpot,
        weights_bytes=weight_memory_bytes(shape, scheme),
        kv_bytes=kv_cache_bytes(shape, scheme, workload.prompt_len + workload.output_len, workload.batch),
        prefill_bound=pf.bound, decode_bound=decode_bound,
    )


def scheme_key(scheme: RooflineScheme) -> tuple[int, int, bool]:
    """What quality results are matched on: (weight bits, KV bits, symmetric), 16 standing for any float."""
    quantized = scheme.quantized
    return (scheme.weight_bits if quantized else 16), (8 if scheme.kv_bytes == 1 else 16), (scheme.symmetric or not quantized)


def quality_key(result: QualityResult, dtype_bytes: int = 2) -> tuple[int, int, bool] | None:
    """(weight bits, KV bits, symmetric) of the scheme a quality result measured: from the evaluated
    checkpoint's config when it is at hand, from its recipe when the name is one, else from the
    name itself ("w4...", "w8...", "...kv8"/"...fp8")."""
    if result.model and (Path(result.model) / "config.json").is_file():
        try:
            return scheme_key(scheme_from_quantization_config(Path(result.model)))
        except ValueError:
            pass
    try:
        return scheme_key(scheme_from_recipe(load_recipe(result.name), dtype_bytes=dtype_bytes))
    except Exception:
        pass
    name = result.name.lower()
    m = re.search(r"(?:^|[^a-z])w(\d+)", name)
    kv8 = re.search(r"kv[-_]?(?:fp)?8|fp8[-_]?kv", name)
    if not m and not kv8:
        return None
    return (int(m.group(1)) if m else 16), (8 if kv8 else 16), not (m and "asym" in name)


def _quality_rank(c: Candidate) -> tuple:
    """Lower is better quality: measured KL / perplexity increase where known, else nominal precision."""
    q = c.quality
    measured = 0.0 if c.lossless else None
    if q is not None:
        measured = q.kl_divergence if q.kl_divergence is not None else (q.perplexity_increase or 0.0)
    nominal = (-c.scheme.weight_bits, -c.scheme.kv_bytes)
    return (measured if measured is not None else float("inf"), nominal)


def advise(
    shape: ModelShape, device: DeviceSpec, workload: Workload, *,
    memory_budget: float | None = None,
    schemes: Sequence[RooflineScheme] | None = None,
    quality: Sequence[QualityResult] | Mapping[str, QualityResult] = (),
    max_ppl_increase: float | None = None,
    max_kl: float | None = None,
    min_gain: float = 0.10,
) -> Advice:
    """Rank ``schemes`` (default: fp16, W8, W4 g128, each +/- FP8 KV) for ``workload`` on ``device``.

    memory_budget: bytes (default: the device's memory). max_ppl_increase: relative (0.05 = +5%).
    min_gain: a faster scheme must beat a higher-quality one by this fraction of total latency.
    """
    workload.check_fits(shape)
    schemes = [fitted_to(s, shape) for s in (schemes or standard_schemes())]  # widths the group does not divide
    budget = device.memory_bytes if memory_budget is None else memory_budget
    if budget <= 0:
        raise ValueError(f"memory budget must be positive, got {budget}")
    if min_gain < 0:
        raise ValueError(f"min_gain must be >= 0, got {min_gain}")
    by_key: dict[tuple[int, int, bool], QualityResult] = {}
    items = quality.items() if isinstance(quality, Mapping) else [(None, q) for q in quality]
    for name, q in items:
        key = None
        if name is not None:
            key = next((scheme_key(s) for s in schemes if s.name == name), None)
        key = key or quality_key(q)
        if key is None:
            continue
        if key in by_key:
            bits, kv_bits, symmetric = key
            raise UsageError(
                f"quality results {by_key[key].name!r} and {q.name!r} both measured {bits}-bit "
                f"{'symmetric' if symmetric else 'asymmetric'} weights with {'an FP8' if kv_bits == 8 else 'a float'} "
                f"KV cache, and the advice weighs one result per scheme: give only the result of the checkpoint "
                f"you would serve")
        by_key[key] = q

    candidates = []
    for s in schemes:
        c = evaluate(shape, s, device, workload)
        c.quality = by_key.get(scheme_key(s))
        c.fits = c.memory_bytes <= budget
        if not c.fits:
            c.excluded_because.append(f"needs {c.memory_bytes / 1e9:.1f} GB > {budget / 1e9:.1f} GB")
        q = c.quality
        if q is not None and max_ppl_increase is not None and (q.perplexity_increase or 0.0) > max_ppl_increase:
            c.within_quality = False
            c.excluded_because.append(f"perplexity +{100 * q.perplexity_increase:.2f}% > {100 * max_ppl_increase:.2f}%")
        if q is not None and max_kl is not None and q.kl_divergence is not None and q.kl_divergence > max_kl:
            c.within_quality = False
            c.excluded_because.append(f"KL {q.kl_divergence:.4g} > {max_kl:.4g}")
        candidates.append(c)
    # A scheme stored with no more precision than one that already fails the quality budget fails too
    # (W4 + FP8 KV is at least as lossy as W4), whether or not it was measured itself.
    failed = [c for c in candidates if not c.within_quality]
    for c in candidates:
        worse_than = [f for f in failed if f is not c and f.scheme.weight_bits >= c.scheme.weight_bits
                      and f.scheme.kv_bytes >= c.scheme.kv_bytes]
        if c.within_quality and worse_than:
            c.within_quality = False
            c.excluded_because.append(f"at least as lossy as {worse_than[0].name}, which exceeds the quality budget")
    # Quality asked about (results or a budget given): an unmeasured lossy scheme is unknown, not good.
    if quality or max_ppl_increase is not None or max_kl is not None:
        for c in candidates:
            if c.quality is None and not c.lossless and c.within_quality:
                c.within_quality = False
                c.excluded_because.append("quality not measured: pass a `quantkit eval` result with --quality")
    eligible = [c for c in candidates if c.eligible]
    if not eligible:
        smallest = min(candidates, key=lambda c: c.memory_bytes)
        reason = (f"nothing fits: the smallest, {smallest.name}, needs {smallest.memory_bytes / 1e9:.1f} GB "
                  f"(weights {smallest.weights_bytes / 1e9:.1f} + KV {smallest.kv_bytes / 1e9:.1f}) of "
                  f"{budget / 1e9:.1f} GB" if not any(c.fits for c in candidates) else
                  "every scheme that fits exceeds the quality budget or has no quality measurement; measure more "
                  "schemes, relax --max-ppl-increase / --max-kl, or give more memory")
        return Advice(workload, device, budget, candidates, None, reason)

    fastest = min(eligible, key=lambda c: c.total_s)
    close = [c for c in eligible if c.total_s <= fastest.total_s * (1 + min_gain)]
    choice = min(close, key=_quality_rank)
    return Advice(workload, device, budget, candidates, choice, _reason(choice, fastest, candidates, budget, min_gain))


def _reason(choice: Candidate, fastest: Candidate, candidates: list[Candidate], budget: float, min_gain: float) -> str:
    ref = next((c for c in candidates if c.lossless), None)
    decode_share = (choice.total_s - choice.ttft_s) / choice.total_s if choice.total_s else 0.0
    parts = []
    if choice is fastest:
        parts.append(f"fastest scheme that fits ({_s(choice.total_s)} total")
        if ref is not None and ref is not choice:
            parts[-1] += f", {ref.total_s / choice.total_s:.2f}x faster than {ref.name}"
            if not ref.fits:
                parts[-1] += ", which does not fit"
        parts[-1] += ")"
    else:
        better = "better measured quality" if choice.quality is not None or choice.lossless else "higher precision"
        parts.append(f"within {100 * min_gain:.0f}% of the fastest ({fastest.name}: {_s(fastest.total_s)} vs "
                     f"{_s(choice.total_s)}) at {better}")
    parts.append(f"decode is {100 * decode_share:.0f}% of the latency")
    parts.append(f"uses {choice.memory_bytes / 1e9:.1f} of {budget / 1e9:.1f} GB")
    q = choice.quality
    if q is not None:
        inc = q.perplexity_increase
        parts.append("quality: " + ", ".join(x for x in (
            None if inc is None else f"perplexity {100 * inc:+.2f}%",
            None if q.kl_divergence is None else f"KL {q.kl_divergence:.3g}") if x))
    elif not choice.lossless:
        parts.append("its quality was NOT measured: chosen on speed and memory alone; run `quantkit eval` on it "
                     "and pass the result with --quality before serving it")
    by_why: dict[str, list[str]] = {}
    for c in candidates:
        if c.excluded_because:
            by_why.setdefault("; ".join(c.excluded_because), []).append(c.name)
    if by_why:
        parts.append("excluded: " + ", ".join(f"{', '.join(names)} ({why})" for why, names in by_why.items()))
    return f"{choice.name}: " + "; ".join(parts)


def _s(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def format_advice(advice: Advice) -> list[str]:
    """A plain-text table of the candidates and the recommendation."""
    w = advice.workload
    d = advice.device
    lines = [f"{d.name}: {d.figures()}",
             f"workload: batch {w.batch}, prompt {w.prompt_len}, output {w.output_len}",
             f"{'scheme':<14}{'TTFT':>11}{'TPOT':>11}{'total':>11}{'memory GB':>11}  fits  {'Δppl':>8}{'KL':>9}  bound (prefill/decode)"]
    for c in advice.candidates:
        q = c.quality
        unknown = "ref" if c.lossless else "?" if q is None else "–"
        inc = unknown if q is None or q.perplexity_increase is None else f"{100 * q.perplexity_increase:+.2f}%"
        kl = unknown if q is None or q.kl_divergence is None else f"{q.kl_divergence:.3g}"
        mark = "*" if c is advice.recommended else " "
        lines.append(f"{mark}{c.name:<13}{_s(c.ttft_s):>11}{_s(c.tpot_s):>11}{_s(c.total_s):>11}"
                     f"{c.memory_bytes / 1e9:>11.2f}  {'yes ' if c.fits else 'no  '}  {inc:>8}{kl:>9}  "
                     f"{c.prefill_bound}/{c.decode_bound}")
    lines.append("Δppl, KL: from the --quality results; ref: the float model itself; ?: not measured; "
                 "–: not in the result")
    lines += [f"{c.name}: {c.scheme.describe()} (widths its group size does not divide)" for c in advice.candidates
              if c.scheme.layers and not c.name.endswith("+kv8")]
    lines.append(f"recommendation: {advice.reason}")
    return lines
