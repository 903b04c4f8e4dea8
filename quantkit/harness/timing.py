"""Prefill (TTFT) and decode (TPOT) timing of causal LMs, side by side, against the roofline.

- Prefill: one forward over ``batch`` random prompts of ``prompt_len`` tokens into an empty cache,
  logits of the last position only (what generation does before its first token).
- Decode: ONE step at a given context length, timed on its own: a ``StaticCache`` sized exactly
  ``context_len + 1`` (a ``StaticFP8KVCache`` for FP8-KV variants) is filled with random keys and values
  (timing does not depend on their values, and this skips a costly prefill), then each timed call
  feeds one token per sequence and crops the cache back to ``context_len`` so every repeat sees
  the same context. On CUDA the step is captured in a CUDA graph when possible (eager launches
  would dominate a small model's step).
- Compiled (``BenchSettings.compile_backend``, ``quantkit bench --compile [all|decode]``): every
  variant alike, baseline included, runs its forward through ``torch.compile`` (one compiled forward
  per model, reused by every shape; prefill too unless ``compile_prefill`` is off). Decode on CUDA
  then captures compiled step + cache rewind in a CUDA graph (compiled during the warm-up calls,
  captured by hand after them: the same capture as the eager path, so the two differ only in the
  kernels). A compiled prefill reuses one static cache, reset (untimed) between calls, so the graph
  is not retraced for every fresh cache object. Graph breaks seen while warming up are counted in
  each record (``graph_breaks``).

Timers: CUDA events on GPU, ``time.perf_counter`` on CPU; warm-up runs, then the median of
repeats. On CPU the repeats of all variants at one shape are interleaved (A B C A B C ...) so that
the load of a shared machine drifts over all of them alike; on GPU variants run one after another. Peak memory: on GPU the variant's weights plus the growth of ``torch.cuda.max_memory_allocated``
during the measurement (cache, activations; other variants stay resident and are not counted); on
CPU the bytes of the model's tensors plus the cache's tensors ("tensor_bytes"), with the peak-RSS
growth during the measurement beside it where /proc allows.
"""

from __future__ import annotations

import re
import statistics
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from ..core.errors import UsageError
from ..modules.kv_scales import attach_kv_scales, cache_keyword, read_kv_scales
from ..runtime.cpu_decoder import CACHE_VALUE_BYTES, CpuDecoder
from .hardware import DeviceSpec, capture_cuda_graph, cpu_name, synchronize
from .roofline import ModelShape, decode_cost, kv_cache_bytes, moe_roofline_note, predict, prefill_cost
from .variants import Variant, model_tensor_bytes

SCHEMA = "quantkit.bench/1"


#: how decode steps run: the model's transformers forward, or quantkit.CpuDecoder's C++ loop (CPU, Llama family)
DECODE_LOOPS = ("transformers", "quantkit")

#: the seeds BenchSettings takes: the signed 64-bit integers whose successor is one too
SEED_RANGE = (-2**63, 2**63 - 2)


@dataclass
class BenchSettings:
    """What to measure. Lengths above the model's context are dropped (and listed as skipped)."""

    prompt_lens: Sequence[int] = (128, 512, 1024, 2048, 4096)
    context_lens: Sequence[int] = (128, 512, 1024, 2048, 4096)
    batch_sizes: Sequence[int] = (1, 4, 16, 64)
    prefill_batch_sizes: Sequence[int] = (1,)
    warmup: int = 2
    repeats: int = 5
    cuda_graphs: bool = True
    max_cache_bytes: float | None = None  # skip decode shapes whose KV cache would exceed this
    seed: int = 0
    compile_backend: str | None = None  # torch.compile backend ("inductor"); None: eager forward
    compile_prefill: bool = True  # with compile_backend: compile prefill too (else decode only)
    decode_loop: str = "transformers"  # or "quantkit": decode steps in quantkit.CpuDecoder's C++ loop (CPU)

    def __post_init__(self):
        for name in ("prompt_lens", "context_lens", "batch_sizes", "prefill_batch_sizes"):
            values = list(getattr(self, name))
            if not values or any(int(v) < 1 for v in values):
                raise ValueError(f"{name} must be a non-empty list of positive integers, got {values}")
            setattr(self, name, [int(v) for v in values])
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0; got {self.repeats}, {self.warmup}")
        if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:  # decode seeds its tokens with seed + 1
            raise UsageError(f"seed {self.seed} is outside the range of torch's generators; give an integer from "
                             f"-2**63 to 2**63 - 2")
        if self.decode_loop not in DECODE_LOOPS:
            raise UsageError(f"decode loop {self.decode_loop!r}: choose one of {', '.join(DECODE_LOOPS)}")
        if self.decode_loop == "quantkit" and self.compile_backend is not None:
            raise UsageError("the quantkit decode loop is C++ already: drop --compile, or time decode in transformers")
        if self.compile_backend is not None and (
                self.compile_backend not in torch.compiler.list_backends(exclude_tags=())):
            raise UsageError(f"{self.compile_backend!r} is not a torch.compile backend; choose inductor (the default), "
                             f"aot_eager or eager (they only trace), or another that torch.compiler.list_backends() "
                             f"names")


# -- timers -------------------------------------------------------------------------------------

def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``fn``: CUDA events on GPU, perf_counter on CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class MemoryMeter:
    """Peak memory of a measurement: CUDA max allocated, or tensor bytes (+ peak-RSS growth) on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.method = "cuda_max_allocated" if device.type == "cuda" else "tensor_bytes"

    @staticmethod
    def _status_kib(key: str) -> int | None:
        try:
            m = re.search(rf"{key}:\s+(\d+) kB", open("/proc/self/status").read())
        except OSError:
            return None
        return int(m.group(1)) if m else None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._allocated0 = torch.cuda.memory_allocated(self.device)
            return
        self._rss0 = self._status_kib("VmRSS")
        try:  # "5" resets the peak RSS (VmHWM) of this process
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self._rss0 = None

    def stop(self, model_bytes: int, cache_bytes: int, *, cache_allocated_before: bool = False) -> dict:
        """``cache_allocated_before``: the cache existed when ``start`` ran (so the growth excludes it)."""
        if self.device.type == "cuda":
            # Other variants stay resident on the device: count this variant's weights (and its
            # cache) plus what the measurement itself allocated at its peak (activations, workspaces).
            growth = int(torch.cuda.max_memory_allocated(self.device)) - self._allocated0
            base = model_bytes + (cache_bytes if cache_allocated_before else 0)
            return {"method": self.method, "peak_bytes": base + growth, "measurement_peak_bytes": growth,
                    "weights_bytes": model_bytes, "kv_cache_bytes": cache_bytes}
        out = {"method": self.method, "peak_bytes": model_bytes + cache_bytes,
               "weights_bytes": model_bytes, "kv_cache_bytes": cache_bytes}
        hwm = self._status_kib("VmHWM")
        if self._rss0 is not None and hwm is not None:
            out["rss_peak_delta_bytes"] = max(0, hwm - self._rss0) * 1024
        return out


# -- caches ---------------------------------------------------------------------------------------

def cache_tensor_bytes(cache) -> int:
    """Bytes of the tensors a transformers Cache holds (keys, values and any per-layer scales), or of a
    quantkit.CpuDecoder's cache."""
    if hasattr(cache, "cache_bytes"):
        return cache.cache_bytes()
    total, seen = 0, set()
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor) and value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                total += value.numel() * value.element_size()
    return total


def make_decode_cache(variant: Variant, max_cache_len: int):
    """A cache for ``variant``: a transformers StaticCache of ``max_cache_len`` positions, or the
    static FP8 KV cache of that length when its recipe asks for one."""
    if variant.kv_cache is not None:
        return _quantized_kv_cache(variant, max_cache_len)
    from transformers import StaticCache  # import time: transformers loads only where it is used

    return StaticCache(config=variant.model.config, max_cache_len=max_cache_len)


def make_prefill_cache(variant: Variant, shape: ModelShape, batch: int, prompt_len: int, *,
                       dtype: torch.dtype, device: torch.device):
    """An empty cache for a prompt, allocated up front (as an engine's would be) so the timed
    prefill pays for writing the cache, not for allocating it."""
    cache = make_decode_cache(variant, prompt_len)
    if hasattr(cache, "early_initialization"):
        cache.early_initialization(batch, shape.kv_heads, shape.head_dim, dtype, device)
    return cache


def _quantized_kv_cache(variant: Variant, max_cache_len: int):
    """The static FP8 KV cache of ``variant``: ``max_cache_len`` positions preallocated."""
    # import time: it loads transformers' cache classes, needed only with an fp8 cache
    from quantkit.modules import kv_cache

    with warnings.catch_warnings():  # uncalibrated scales are fine for timing
        warnings.simplefilter("ignore")
        return kv_cache.fp8_cache_for(variant.model, attention=variant.info.get("kv_attention", "dequantize"),
                                      max_cache_len=max_cache_len)


def fill_cache(cache, shape: ModelShape, batch: int, context_len: int, *, dtype: torch.dtype,
               device: torch.device, seed: int = 0) -> None:
    """Write ``context_len`` positions of random K and V (drawn on ``device``) into every layer of ``cache``."""
    g = torch.Generator(device=device).manual_seed(seed)
    for layer_idx in range(shape.layers):
        size = (batch, shape.kv_heads, context_len, shape.head_dim)
        k = torch.randn(size, generator=g, device=device, dtype=dtype)  # [B, Hkv, C, D]
        v = torch.randn(size, generator=g, device=device, dtype=dtype)  # [B, Hkv, C, D]
        cache.update(k, v, layer_idx)


def rewind(cache, tokens: int) -> None:
    """Forget the last ``tokens`` positions of ``cache``. Static layers only move their write
    position back (an in-place op on a device tensor, so a CUDA graph can replay it; transformers
    before 5.24 has no crop for them); growing layers are cropped."""
    for layer in cache.layers:
        position = getattr(layer, "cumulative_length", None)
        if isinstance(position, torch.Tensor) and not hasattr(layer, "cumulative_length_int"):
            position.sub_(tokens)
        else:
            layer.crop(-tokens)


def _is_static(cache) -> bool:
    """Whether the cache writes in place (CUDA graphs can replay it; transformers calls such caches
    compileable): StaticCache, StaticFP8KVCache; a growing cache cannot."""
    return bool(getattr(cache, "is_compileable", False))


def _seq_length(cache) -> int:
    return int(cache.get_seq_length())


# -- compiled forwards ------------------------------------------------------------------------------

_COMPILED: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def model_forward(model: nn.Module, settings: BenchSettings, phase: str) -> Callable[..., object]:
    """``model`` itself, or (``settings.compile_backend`` set, and ``phase`` "decode" or prefill compiled
    too) its forward through ``torch.compile``, compiled once per model and backend for every shape."""
    if not settings.compile_backend or (phase == "prefill" and not settings.compile_prefill):
        return model
    per_model = _COMPILED.setdefault(model, {})
    if settings.compile_backend not in per_model:
        per_model[settings.compile_backend] = torch.compile(model, backend=settings.compile_backend)
    return per_model[settings.compile_backend]


def graph_break_count() -> int:
    """Graph breaks dynamo has recorded in this process so far."""
    from torch._dynamo.utils import counters  # import time: dynamo loads only where compiled code is timed

    return sum(counters["graph_break"].values())


def _mode(settings: BenchSettings, graph: bool) -> str:
    """"eager", "cuda_graph", "compiled (inductor)" or "compiled (inductor) + cuda_graph"."""
    if not settings.compile_backend:
        return "cuda_graph" if graph else "eager"
    return f"compiled ({settings.compile_backend})" + (" + cuda_graph" if graph else "")


# -- one measurement --------------------------------------------------------------------------------

def _random_ids(vocab: int, batch: int, length: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).to(device)  # [B, T]


class TimedRun:
    """One variant at one shape, ready to time: ``run`` is the timed call, ``before`` (untimed)
    resets state ahead of each call. Calls can be interleaved with other variants' runs."""

    def __init__(self, variant: Variant, device: torch.device, run: Callable[[], object], *,
                 before: Callable[[], object] | None = None, cache: Callable[[], object],
                 cache_allocated_before: bool, info: dict | None = None, context_len: int | None = None):
        self.variant, self.device, self.run, self.before = variant, device, run, before
        self.cache, self.cache_allocated_before = cache, cache_allocated_before
        self.info = info or {}
        self.context_len = context_len  # decode: the cache length every call must leave behind
        self.times: list[float] = []

    @torch.inference_mode()
    def warm(self, n: int) -> None:
        breaks = graph_break_count()
        for _ in range(n):
            if self.before:
                self.before()
            self.run()
        synchronize(self.device)
        if "graph_breaks" in self.info:  # compiled runs: breaks seen while (re)compiling for this shape
            self.info["graph_breaks"] += graph_break_count() - breaks

    @torch.inference_mode()
    def time(self) -> None:
        if self.before:
            self.before()
        self.times.append(time_once(self.run, self.device))

    @torch.inference_mode()
    def finish(self) -> dict:
        """The times so far, and the peak memory of one more (untimed) call."""
        meter = MemoryMeter(self.device)
        meter.start()
        if self.before:
            self.before()
        self.run()
        synchronize(self.device)
        memory = meter.stop(model_tensor_bytes(self.variant.model), cache_tensor_bytes(self.cache()),
                            cache_allocated_before=self.cache_allocated_before)
        if self.context_len is not None and _seq_length(self.cache()) != self.context_len:
            raise RuntimeError(f"decode steps changed the cache length to {_seq_length(self.cache())} "
                               f"(expected {self.context_len})")
        return {"times_s": list(self.times), "memory": memory, **self.info}


def prefill_run(variant: Variant, shape: ModelShape, batch: int, prompt_len: int, settings: BenchSettings,
                device: torch.device) -> TimedRun:
    """Prefill of ``batch`` random prompts of ``prompt_len`` tokens into a fresh (preallocated) cache;
    compiled: into one static cache reset between calls (see the module docstring)."""
    model = variant.model
    forward = model_forward(model, settings, "prefill")
    compiled = forward is not model
    dtype = next(model.parameters()).dtype
    ids = _random_ids(shape.vocab, batch, prompt_len, device, settings.seed)  # [B, P]
    kw = cache_keyword(model)
    holder = {}

    def new_cache():
        holder.clear()  # free the previous cache before allocating the next
        holder["cache"] = make_prefill_cache(variant, shape, batch, prompt_len, dtype=dtype, device=device)

    reset = new_cache
    new_cache()
    if compiled and _is_static(holder["cache"]):
        reset = holder["cache"].reset  # zeroes in place: the same tensors every call

    def run():
        forward(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: holder["cache"]})

    info = {"mode": _mode(settings, graph=False) if compiled else "eager"}
    if compiled:
        info["graph_breaks"] = 0
    return TimedRun(variant, device, run, before=reset, cache=lambda: holder["cache"], cache_allocated_before=False,
                    info=info)


@torch.inference_mode()
def decode_run(variant: Variant, shape: ModelShape, batch: int, context_len: int, settings: BenchSettings,
               device: torch.device) -> TimedRun:
    """One decode step of ``batch`` sequences at ``context_len`` cached positions (random K/V)."""
    if settings.decode_loop == "quantkit":
        return _cpu_decoder_run(variant, shape, batch, context_len, settings, device)
    model = variant.model
    dtype = next(model.parameters()).dtype
    cache = make_decode_cache(variant, context_len + 1)
    fill_cache(cache, shape, batch, context_len, dtype=dtype, device=device, seed=settings.seed)
    if _seq_length(cache) != context_len:
        raise RuntimeError(f"cache holds {_seq_length(cache)} positions after filling {context_len}")
    ids = _random_ids(shape.vocab, batch, 1, device, settings.seed + 1)  # [B, 1]
    kw = cache_keyword(model)
    forward = model_forward(model, settings, "decode")

    def step():
        forward(input_ids=ids, use_cache=True, **{kw: cache})
        rewind(cache, 1)  # back to context_len: every repeat decodes at the same context

    breaks = graph_break_count()
    mode, run = _mode(settings, graph=False), step
    if device.type == "cuda" and settings.cuda_graphs and _is_static(cache):
        try:  # the warm-up calls inside compile the step (when compiled) before the capture
            run, mode = capture_cuda_graph(step), _mode(settings, graph=True)
        except Exception as e:  # capture fails on ops that synchronise; fall back to eager launches
            torch.cuda.synchronize(device)
            mode = f"{mode} (CUDA graph capture failed: {type(e).__name__})"
            if _seq_length(cache) != context_len:
                raise RuntimeError("a failed CUDA graph capture left the cache at another length") from e
    info = {"mode": mode, "cache": type(cache).__name__}
    if settings.compile_backend:
        info["graph_breaks"] = graph_break_count() - breaks
    return TimedRun(variant, device, run, cache=lambda: cache, cache_allocated_before=True,
                    info=info, context_len=context_len)


def _cpu_decoder_run(variant: Variant, shape: ModelShape, batch: int, context_len: int, settings: BenchSettings,
                     device: torch.device) -> TimedRun:
    """The decode step in quantkit.CpuDecoder's C++ loop: its own cache (the model's dtype, or fp8 for a
    variant whose model holds k/v scales) holds random K/V of ``context_len`` positions; each call
    decodes at position ``context_len`` (overwriting it)."""
    if device.type != "cpu":
        raise UsageError("the quantkit decode loop runs on the CPU: time decode on CUDA in transformers")
    if variant.kv_cache is not None and not read_kv_scales(variant.model)[0]:
        # a recipe's FP8 cache before calibration: scales of 1.0, as its transformers cache takes (variants.py)
        attach_kv_scales(variant.model, {i: (torch.ones(1), torch.ones(1)) for i in range(shape.layers)})
    decoder = CpuDecoder(variant.model, max_len=context_len + 1, cache_dtype="auto" if variant.kv_cache is None else "fp8")
    g = torch.Generator().manual_seed(settings.seed)
    size = (batch, shape.kv_heads, context_len, shape.head_dim)
    decoder.load_cache([torch.randn(size, generator=g) for _ in range(shape.layers)],
                       [torch.randn(size, generator=g) for _ in range(shape.layers)])
    tokens = _random_ids(shape.vocab, batch, 1, device, settings.seed + 1)[:, 0]  # [B]

    def step():
        decoder.truncate(context_len)
        decoder.step(tokens)

    step()  # the block of position context_len is allocated before the cache's bytes are counted
    dtype = decoder.cache_dtype
    return TimedRun(variant, device, step, cache=lambda: decoder, cache_allocated_before=True,
                    info={"mode": f"quantkit C++ decode loop, {dtype} KV cache", "cache": f"CpuDecoder ({dtype})",
                          "cache_dtype": dtype, "cache_block": decoder.cache_block})


def _loop_cache_value_bytes(cache_dtype: str) -> int:
    return CACHE_VALUE_BYTES[cache_dtype]


def measure(runs: Sequence[TimedRun], settings: BenchSettings) -> list[dict]:
    """Warm up and time ``runs`` (one per variant, same shape). Repeats are interleaved across the
    variants (A B C A B C ...), so load or clock drift during the measurement hits all alike."""
    for r in runs:
        r.warm(settings.warmup)
    for _ in range(settings.repeats):
        for r in runs:
            r.time()
    return [r.finish() for r in runs]


# -- the whole benchmark -------------------------------------------------------------------------

def _record(variant: Variant, shape: ModelShape, spec: DeviceSpec, cost, measured: dict, **keys) -> dict:
    median = statistics.median(measured["times_s"])
    pred = predict(cost, spec)
    rec = {"variant": variant.name, **keys, "median_s": median, **measured,
           "roofline": {**pred.to_dict(), "bytes": cost.total_bytes, "flops": cost.total_flops,
                        "bytes_breakdown": cost.bytes, "flops_breakdown": cost.flops,
                        "measured_over_predicted": median / pred.seconds}}
    tokens = keys.get("batch", 1) * keys.get("prompt_len", 1)
    rec["tokens_per_s"] = tokens / median
    rec["achieved_bandwidth"] = cost.total_bytes / median  # bytes the step must read / its time
    rec["bandwidth_fraction"] = rec["achieved_bandwidth"] / spec.memory_bandwidth  # of the roofline device's
    rec["achieved_flops"] = cost.total_flops / median
    return rec


def _measure_variants(variants: Sequence[Variant], make_run: Callable[[Variant], TimedRun], settings: BenchSettings,
                      device: torch.device) -> list[dict]:
    """One shape, every variant. On CPU the variants' repeats are interleaved (a shared CPU's load
    drifts); on GPU they run one variant after the other, so only one variant's cache is allocated."""
    if device.type == "cpu":
        return measure([make_run(v) for v in variants], settings)
    out = []
    for v in variants:
        out.append(measure([make_run(v)], settings)[0])
        torch.cuda.empty_cache()
    return out


def _announced(shapes: Sequence[tuple[int, int]], phase: str, variants: Sequence[Variant], settings: BenchSettings,
               done: int, total: int, *, enabled: bool):
    """Yield ``shapes``, first printing (stderr) which measurement starts and how many remain.

    A shape of a large model can take minutes, so the line comes before the work, not after it."""
    length = "prompt_len" if phase == "prefill" else "context_len"
    runs = f"{len(variants)} variant(s) x {settings.warmup} warm-up + {settings.repeats} timed runs"
    for i, (length_value, batch) in enumerate(shapes):
        if enabled:
            print(f"bench: [{done + i + 1}/{total}] {phase} batch={batch} {length}={length_value}: {runs}; "
                  f"{total - done - i - 1} shape(s) after this", file=sys.stderr, flush=True)
        yield length_value, batch


def run_bench(variants: Sequence[Variant], spec: DeviceSpec, settings: BenchSettings, *,
              device: str | torch.device = "cpu", model_label: str = "", progress: bool = True,
              phases: Sequence[str] = ("prefill", "decode")) -> dict:
    """Measure every variant on every shape (variants interleaved per shape, so drift hits all alike).

    ``progress``: print a line on stderr as each shape starts (which one, how many remain).
    ``phases``: which of "prefill" and "decode" to time (e.g. one at a time, each in its own dtype:
    ``merge_phases`` joins the results)."""
    device = torch.device(device)
    if not variants:
        raise ValueError("nothing to benchmark: give at least the baseline variant")
    if not phases or set(phases) - {"prefill", "decode"}:
        raise ValueError(f"phases must be some of 'prefill' and 'decode', got {list(phases)}")
    shape = ModelShape.from_config(variants[0].model.config)
    max_ctx = shape.max_context or max(max(settings.prompt_lens), max(settings.context_lens) + 1)
    skipped = []
    prompt_lens = [p for p in settings.prompt_lens if p <= max_ctx]
    context_lens = [c for c in settings.context_lens if c + 1 <= max_ctx]
    skipped += [{"phase": "prefill", "prompt_len": p, "reason": f"exceeds the model's context {max_ctx}"}
                for p in settings.prompt_lens if p > max_ctx]
    skipped += [{"phase": "decode", "context_len": c, "reason": f"exceeds the model's context {max_ctx}"}
                for c in settings.context_lens if c + 1 > max_ctx]
    decode_shapes = []
    for c in context_lens:
        for b in settings.batch_sizes:
            largest = max(kv_cache_bytes(shape, v.scheme, c + 1, b) for v in variants)
            if settings.max_cache_bytes is not None and largest > settings.max_cache_bytes:
                skipped.append({"phase": "decode", "context_len": c, "batch": b,
                                "reason": f"KV cache {largest / 2**30:.1f} GiB > limit {settings.max_cache_bytes / 2**30:.1f} GiB"})
            else:
                decode_shapes.append((c, b))
    prefill_shapes = [(p, b) for p in prompt_lens for b in settings.prefill_batch_sizes]
    if not prefill_shapes and not decode_shapes:
        shown = "; ".join(describe_skipped(s) for s in skipped[:3]) + ("; ..." if len(skipped) > 3 else "")
        raise UsageError(f"every shape asked for is skipped, nothing would be measured ({shown}): give prompt and "
                         f"context lengths within the model's context of {max_ctx} tokens, or a larger cache limit")
    if "prefill" not in phases:
        prefill_shapes = []
    if "decode" not in phases:
        decode_shapes = []
    skipped = [s for s in skipped if s["phase"] in phases]
    for s in skipped:  # always said: the user asked for these shapes (or took the defaults)
        print(f"bench: skipping {describe_skipped(s)}", file=sys.stderr, flush=True)
    dtype = str(next(variants[0].model.parameters()).dtype).removeprefix("torch.")

    prefill, decode = [], []
    total = len(prefill_shapes) + len(decode_shapes)
    for p, b in _announced(prefill_shapes, "prefill", variants, settings, 0, total, enabled=progress):
        measured = _measure_variants(variants, lambda v: prefill_run(v, shape, b, p, settings, device), settings, device)
        for v, m in zip(variants, measured):
            prefill.append(_record(v, shape, spec, prefill_cost(shape, v.scheme, p, b), m, batch=b, prompt_len=p)
                           | {"dtype": dtype})
    for c, b in _announced(decode_shapes, "decode", variants, settings, len(prefill_shapes), total, enabled=progress):
        measured = _measure_variants(variants, lambda v: decode_run(v, shape, b, c, settings, device), settings, device)
        for v, m in zip(variants, measured):
            scheme = v.scheme if settings.decode_loop == "transformers" else replace(  # the loop's own cache
                v.scheme, kv_bytes=_loop_cache_value_bytes(m["cache_dtype"]))
            rec = _record(v, shape, spec, decode_cost(shape, scheme, c, b), m, batch=b, context_len=c)
            rec["tokens_per_s"] = b / rec["median_s"]
            rec["dtype"] = dtype
            decode.append(rec)
    return {
        "schema": SCHEMA,
        "model": {"name": model_label, "shape": asdict(shape), "params": shape.params, "dtype": dtype,
                  **({"moe_note": moe_roofline_note(shape)} if shape.is_moe else {})},
        "dtypes": {phase: dtype for phase in ("prefill", "decode") if phase in phases},
        "device": device_info(device, spec),
        "settings": {**asdict(settings), "timer": "cuda_events" if device.type == "cuda" else "perf_counter",
                     "statistic": "median",
                     "order": "variant by variant" if device.type == "cuda" else "repeats interleaved across variants",
                     "memory_method": MemoryMeter(device).method},
        "variants": [v.describe() for v in variants],
        "baseline": variants[0].name,
        "prefill": prefill,
        "decode": decode,
        "skipped": skipped,
    }


def describe_skipped(s: dict) -> str:
    """'decode, context 2048, batch 4: <reason>' from a skipped-shape record."""
    words = {"prompt_len": "prompt", "context_len": "context", "batch": "batch"}
    where = [f"{words[k]} {s[k]}" for k in ("prompt_len", "context_len", "batch") if k in s]
    return f"{s.get('phase', '?')}, {', '.join(where)}: {s.get('reason', 'skipped')}"


def merge_phases(prefill: dict, decode: dict) -> dict:
    """One bench result from a prefill-only and a decode-only run of the same variants (e.g. each
    timed in the dtype fastest for it): the decode run's variants and settings, both phases' records
    and skipped shapes, and ``dtypes`` naming each phase's dtype."""
    if [v["name"] for v in prefill["variants"]] != [v["name"] for v in decode["variants"]]:
        raise ValueError("the prefill and decode runs must time the same variants")
    dtypes = {**prefill["dtypes"], **decode["dtypes"]}
    model = dict(decode["model"], dtype=" / ".join(dict.fromkeys(dtypes.values())))
    return {**decode, "model": model, "dtypes": dtypes, "prefill": prefill["prefill"],
            "skipped": prefill["skipped"] + decode["skipped"]}


def device_info(device: torch.device, spec: DeviceSpec) -> dict:
    info = {"type": device.type, "torch": torch.__version__, "spec": spec.to_dict()}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    else:
        info["name"] = cpu_name()
        info["threads"] = torch.get_num_threads()
    return info
