"""The CPU decode attention over a cache allocated three ways, side by side in one run: a tensor per layer and
block (CpuDecoder's cache before), one allocation per block holding every layer's block on 4 KiB pages, and
the same on transparent huge pages (CpuDecoder's cache now: csrc/decode_step.cpp, zeros_on_huge_pages).

    python evals/kv_cache/cpu_loop/huge_pages.py --out evals/kv_cache/cpu_loop/huge-pages-epyc \
        --contexts 2048,8000 --threads 2 --repeats 21

SmolLM2-135M's attention shape (30 layers, 3 kv heads of 64, 9 query heads), blocks of 1024 positions, random
bf16 and fp8 caches (time does not depend on the values). The allocations are made with torch.empty and
advised with madvise(MADV_HUGEPAGE) or madvise(MADV_NOHUGEPAGE) before they are first written (Linux with THP
"always" or "madvise"); the report gives the process's AnonHugePages to show which it got. Medians and minima
of the wall time over the repeats, every layout's run interleaved with the others'.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from pathlib import Path

import torch

from quantkit.files.outputs import write_output_file
from quantkit.harness.hardware import cpu_name
from quantkit.kernels.cpu_extension import load_cpu_kernels

LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK = 30, 3, 9, 64, 1024
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15
LAYOUTS = ("a tensor per layer and block", "a block of every layer, 4 KiB pages", "a block of every layer, huge pages")


def advised_bytes(nbytes: int, advice: int) -> torch.Tensor:
    """uint8 [nbytes] starting on a HUGE_PAGE boundary, madvise'd with `advice` before its first write."""
    length = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    raw = torch.empty(length + HUGE_PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(raw.data_ptr() + skip), ctypes.c_size_t(length), advice) != 0:
        raise OSError(ctypes.get_errno(), "madvise")
    return raw[skip:skip + nbytes]


def one_allocation_per_block(blocks: list[list[torch.Tensor]], advice: int) -> list[list[torch.Tensor]]:
    """blocks[layer][i] (one shape and dtype) copied so that block i of every layer shares one allocation, as
    CpuDecoder allocates its cache: [layer][i] views of one [layers, ...] tensor per i, madvise'd with `advice`."""
    first = blocks[0][0]
    out = [[] for _ in blocks]
    for i in range(len(blocks[0])):
        shared = advised_bytes(len(blocks) * first.numel() * first.element_size(), advice)
        shared = shared.view(first.dtype).view(len(blocks), *first.shape)
        for layer, row in enumerate(blocks):
            out[layer].append(shared[layer].copy_(row[i]))
    return out


def cache(dtype: torch.dtype, blocks: int, layout: int, g: torch.Generator):
    """[(key blocks, value blocks)] per layer: keys [1, Hkv, BLOCK / 16, D, 16], values [1, Hkv, BLOCK, D]."""
    kshape, vshape = (1, KV_HEADS, BLOCK // 16, HEAD_DIM, 16), (1, KV_HEADS, BLOCK, HEAD_DIM)
    keys, values = ([[torch.randn(shape, generator=g).clamp(-8, 8).to(dtype) for _ in range(blocks)]
                     for _ in range(LAYERS)] for shape in (kshape, vshape))
    if layout:
        advice = MADV_NOHUGEPAGE if layout == 1 else MADV_HUGEPAGE
        keys, values = one_allocation_per_block(keys, advice), one_allocation_per_block(values, advice)
    return list(zip(keys, values))


def anon_huge_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default="2048,8000")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    if not load_cpu_kernels().available:
        parser.error(f"the CPU kernels are unavailable: {load_cpu_kernels().reason}")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    rows, huge_kb = [], {}
    for context in [int(c) for c in args.contexts.split(",")]:
        blocks = -(-(context + 1) // BLOCK)
        q, lengths = torch.randn(1, HEADS, HEAD_DIM, generator=g), torch.tensor([context + 1])
        runs, before = {}, anon_huge_kb()
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            scale = torch.full((1,), 0.02) if dtype == torch.float8_e4m3fn else None
            for layout in range(len(LAYOUTS)):
                layers = cache(dtype, blocks, layout, g)

                def run(layers=layers, scale=scale):
                    for k, v in layers:
                        torch.ops.quantkit.decode_attention_cpu(q, k, v, [], [], scale, scale, lengths,
                                                                HEAD_DIM ** -0.5)
                runs[(str(dtype).removeprefix("torch."), layout)] = run
        huge_kb[context] = anon_huge_kb() - before
        times = {key: [] for key in runs}
        for fn in runs.values():
            fn()
        for _ in range(args.repeats):
            for key, fn in runs.items():
                t = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t)
        for (dtype, layout), ts in times.items():
            rows.append({"context": context, "cache": dtype, "layout": LAYOUTS[layout],
                         "median_ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3})
        runs.clear()
    base = {(r["context"], r["cache"]): r["median_ms"] for r in rows if r["layout"] == LAYOUTS[0]}
    lines = [f"# The CPU decode attention against the cache's allocation: {cpu_name()}, {args.threads} thread(s)", "",
             f"SmolLM2-135M's shape, 30 layers, blocks of {BLOCK}; wall time over {args.repeats} interleaved repeats. "
             "AnonHugePages the huge-page caches got: "
             + ", ".join(f"context {c}: {kb / 1024:.0f} MiB" for c, kb in huge_kb.items()) + ".", "",
             "| context | cache | allocation | median ms | min ms | vs a tensor per layer and block (medians) |",
             "|---:|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['cache']} | {r['layout']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | "
                     f"{base[(r['context'], r['cache'])] / r['median_ms']:.2f}x |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": cpu_name(), "threads": args.threads, "repeats": args.repeats, "anon_huge_kb": huge_kb,
            "thp": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
            if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") else "", "rows": rows}
    write_output_file(out / "results.json", json.dumps(meta, indent=1) + "\n")
    write_output_file(out / "results.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
