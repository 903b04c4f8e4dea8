"""Roofline benchmark of the WNA16 linear: y = x @ dequant(W).T against the dense torch.matmul.

    python evals/kernels/bench_wna16.py --out DIR             # full set on the GPU (CUDA) or the CPU set
    python evals/kernels/bench_wna16.py --out DIR --quick     # a couple of shapes, M in (1, 16, 256)
    python evals/kernels/bench_wna16.py --out DIR --sweep     # GPU: also time alternative launch configs

Shapes are K x N = (in_features, out_features); x is [M, K], W is [N, K]. For each shape, M and
weight scheme it records the time of each backend (quantkit "triton", and on CUDA the peers
"tinygemm" = ``aten._weight_int4pack_mm`` and "gemlite" when installed, all fed the *same* quantized
values: ``wna16_peers.py``) next to torch.matmul(x, W.t()) in the same dtype (cuBLAS; speedup =
matmul time / backend time), the achieved bandwidth (bytes of packed weights + scales + zeros +
activations in and out, divided by the time), its share of the copy bandwidth measured in the same
run (a device-to-device tensor copy: read + write bytes / time), and the relative mean error
against the fp32 dequantization (reference). A backend that cannot run a scheme is listed under
"skipped" with the reason.

Timing. GPU: every timed call reads a different copy of the weights (enough copies to exceed 4x the
L2 cache), all copies run back to back inside one captured CUDA graph, replayed between CUDA
events: pure GPU time with cold caches and no Python launch overhead (what decode under CUDA graphs
sees). ``--timer do_bench`` uses triton.testing.do_bench instead (L2 flushed between calls, eager
launches). CPU: wall time of the same rotation over weight copies larger than the last-level cache,
median of the repetitions; CPU figures are meaningful only as ratios within one run.

Outputs DIR/bench_wna16.json (every figure, the device and the measured copy bandwidth) and
DIR/bench_wna16.md (tables).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import quantkit.kernels as qk
from quantkit.harness.hardware import capture_cuda_graph, cpu_name
from quantkit.kernels.packing import packed_words

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_timing import realtime_priority  # noqa: E402
from wna16_peers import PEERS, PeerUnavailable  # noqa: E402

# K x N: Llama-3-8B (qkv 4096x6144, o 4096x4096, gate+up 4096x28672, gate 4096x14336, down 14336x4096)
# and Llama-3-70B-like (8192x8192, gate+up 8192x57344, down 28672x8192)
FULL_SHAPES = [(8192, 8192), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 57344), (28672, 8192),
               (4096, 6144), (4096, 14336)]
FULL_MS = [1, 2, 4, 8, 16, 32, 64, 128, 512, 2048]
QUICK_SHAPES = [(4096, 4096), (8192, 8192), (4096, 28672)]
QUICK_MS = [1, 4, 16, 512]
CPU_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
CPU_MS = [1, 4, 16, 64]
CPU_QUICK_SHAPES = [(4096, 4096)]
CPU_QUICK_MS = [1, 16]
CACHE_BYTES = {"cuda": 50 << 20, "cpu": 32 << 20}  # H200 L2 / this CPU's L3; copies exceed 4x this


@dataclass(frozen=True)
class Scheme:
    name: str
    bits: int
    group_size: int | None  # None: per channel
    symmetric: bool


SCHEMES = {
    s.name: s
    for s in (
        Scheme("w4g128", 4, 128, True),
        Scheme("w4g128-asym", 4, 128, False),
        Scheme("w4g32", 4, 32, True),
        Scheme("w4ch", 4, None, True),
        Scheme("w8ch", 8, None, True),
        Scheme("w8g128", 8, 128, True),
    )
}
DEFAULT_SCHEMES = ["w4g128", "w4g128-asym", "w8ch"]
QUICK_SCHEMES = ["w4g128", "w8ch"]


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------
def random_checkpoint(scheme: Scheme, k: int, n: int, dtype: torch.dtype, device: str, gen: torch.Generator):
    """On-disk tensors with uniformly random packed words (every bit pattern is a valid weight)."""
    words = packed_words(k, scheme.bits)
    groups = 1 if scheme.group_size is None else k // scheme.group_size
    kw = dict(generator=gen, device=device)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, words), dtype=torch.int32, **kw)
    scale = (torch.rand(n, groups, **kw) * 0.01 + 0.001).to(dtype)
    zero = None
    if not scheme.symmetric:
        zero = torch.randint(-(2**31), 2**31 - 1, (packed_words(n, scheme.bits), groups), dtype=torch.int32, **kw)
    return packed, scale, zero


def moved_bytes(scheme: Scheme, m: int, k: int, n: int, act_bytes: int = 2, scale_bytes: int = 2) -> int:
    """Bytes a perfect kernel moves: packed weights + scales + zeros + x in + y out."""
    groups = 1 if scheme.group_size is None else k // scheme.group_size
    weight = k * n * scheme.bits // 8
    scales = groups * n * scale_bytes
    zeros = 0 if scheme.symmetric else groups * n  # uint8 in the Triton layout
    return weight + scales + zeros + m * k * act_bytes + m * n * act_bytes


def copies_for(bytes_per_copy: int, device: str, max_copies: int = 64) -> int:
    """Enough copies of a weight that rotating through them keeps it out of cache (at least 2)."""
    return max(min(2, max_copies), min(max_copies, math.ceil(4 * CACHE_BYTES[device] / max(bytes_per_copy, 1))))


# ----------------------------------------------------------------------------------------------
# Timers
# ----------------------------------------------------------------------------------------------
def time_rotating(fns, device: str, reps: int, timer: str = "graph", realtime: bool = False) -> float:
    """Seconds per call of fns (each reading its own weight copy), run in rotation."""
    for fn in fns:  # warm-up: JIT compilation, allocator, first-touch
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        if timer == "do_bench":
            import triton.testing

            per_fn = [triton.testing.do_bench(fn, warmup=5, rep=max(20, reps), return_mode="median") for fn in fns[:4]]
            return statistics.median(per_fn) / 1e3
        def rotation():
            for fn in fns:
                fn()

        replay = capture_cuda_graph(rotation, warmup=1)  # warms up on the capture stream too
        replay()
        torch.cuda.synchronize()
        samples = []
        for _ in range(max(3, reps // 4)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(4):
                replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / (4 * len(fns)))
        return statistics.median(samples)
    samples = []
    with realtime_priority(realtime):
        for r in range(reps):
            fn = fns[r % len(fns)]
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def copy_bandwidth(device: str, reps: int, realtime: bool = False) -> float:
    """Measured copy bandwidth in GB/s: (read + write bytes) / time of dst.copy_(src)."""
    nbytes = (1 << 30) if device == "cuda" else (256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = time_rotating([lambda: dst.copy_(src)], device, max(reps, 5), realtime=realtime)
    return 2 * nbytes / seconds / 1e9


# ----------------------------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------------------------
def sweep_configs(m: int, n: int, k: int, bits: int, num_sms: int) -> list[qk.WNA16Config]:
    """Alternatives to the heuristic's pick, for --sweep (the table in wna16_heuristics is refitted from these)."""
    base = qk.choose_config(m, n, k, bits, num_sms)
    out = []
    splits = sorted({1, max(1, base.split_k // 4), max(1, base.split_k // 2), base.split_k, base.split_k * 2})
    if m <= 4:
        bm = 1 << (m - 1).bit_length()
        for warps, bn in ((1, 128), (1, 256), (2, 256), (2, 512), (4, 512), (4, 1024)):
            for split in splits:
                out.append(qk.WNA16Config("gemv", bm, bn, split, num_warps=warps, num_stages=1))
                if split > 1:  # the same with the single-launch reduction
                    out.append(qk.WNA16Config("gemv", bm, bn, split, num_warps=warps, num_stages=1, reduce="last"))
    if m <= 64:
        bm = max(16, 1 << (m - 1).bit_length())
        for bn in (64, 128, 256):
            for split in splits:
                out.append(qk.WNA16Config("dot", bm, bn, split))
    else:
        for bm, bn, warps, stages in ((64, 128, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3), (128, 128, 4, 4),
                                      (64, 256, 4, 3)):
            for split in (1, 2, 4) if m <= 512 else (1,):  # fewer (M, N) tiles than SMs at M = 65..512
                out.append(qk.WNA16Config("dot", bm, bn, split, num_warps=warps, num_stages=stages))
    out.append(qk.WNA16Config("dequant", 1, 64))
    return [c for c in out if c != base]


QUANTKIT_BACKENDS = ("triton", "torch", "reference")


def make_calls(backend, ckpts, scheme, k, n, dtype):
    """One ``call(x)`` per weight copy, or raises PeerUnavailable. Also returns the quantkit layout name."""
    if backend in PEERS:
        return [PEERS[backend](*c, scheme.bits, k, dtype) for c in ckpts], backend
    prepared = [qk.prepare_wna16(*c, bits=scheme.bits, in_features=k, backend=backend) for c in ckpts]

    def call(x, p):
        return qk.wna16_linear(x, p, bits=scheme.bits, in_features=k, out_features=n, backend=backend)

    return [lambda x, p=p: call(x, p) for p in prepared], qk.prepared_layout(prepared[0])


def run(args, save=None) -> dict:
    """Time every shape x scheme x backend x M; ``save(result)`` is called after every row (so a run cut
    short by a time limit keeps what it measured)."""
    device = args.device
    gen = torch.Generator(device=device).manual_seed(args.seed)
    dtypes = [getattr(torch, d) for d in args.dtypes]
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"CPU: {cpu_name()}",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "timer": args.timer if device == "cuda" else "wall-clock median" + (" under SCHED_FIFO" * args.realtime),
        "shape_convention": "K x N = (in_features, out_features); x [M, K], W [N, K]",
        "bytes_convention": "packed weights + scales (2 B) + uint8 zeros (asymmetric) + x in + y out (2 B each)",
        "argv": sys.argv[1:],
    }
    result["copy_bandwidth_GBps"] = copy_bw = copy_bandwidth(device, args.reps, args.realtime)
    print(f"copy bandwidth: {copy_bw:.1f} GB/s", flush=True)
    rows, skipped = [], []
    result["rows"], result["skipped"], result["complete"] = rows, skipped, False
    matmul_cache: dict[tuple, float] = {}
    for k, n in args.shapes:
        dense_bytes = n * k * 2
        dense_copies = copies_for(dense_bytes, device, args.max_copies)
        dense = {dt: [torch.randn(n, k, generator=gen, device=device, dtype=dt) for _ in range(dense_copies)]
                 for dt in dtypes}
        for scheme_name in args.schemes:
            scheme = SCHEMES[scheme_name]
            if scheme.group_size and k % scheme.group_size:
                continue
            for backend in args.backends:
                qbytes = moved_bytes(scheme, 0, k, n)
                copies = copies_for(qbytes, device, args.max_copies)
                reps = args.reps
                if backend == "reference":  # dequantizes the whole weight per call: slow, cache-insensitive
                    copies, reps = 1, min(reps, 3)
                ckpts = {dt: [random_checkpoint(scheme, k, n, dt, device, gen) for _ in range(copies)] for dt in dtypes}
                calls, layout = {}, None
                for dt in dtypes:
                    try:
                        calls[dt], layout = make_calls(backend, ckpts[dt], scheme, k, n, dt)
                    except PeerUnavailable as exc:
                        skipped.append({"K": k, "N": n, "scheme": scheme.name, "backend": backend,
                                        "dtype": str(dt).removeprefix("torch."), "reason": str(exc)})
                        print(f"skip {backend} {scheme.name} {dt}: {exc}", flush=True)
                if not calls:
                    continue
                for m in args.ms:
                    row = {"K": k, "N": n, "M": m, "scheme": scheme.name, "backend": backend, "layout": layout,
                           "bytes": moved_bytes(scheme, m, k, n)}
                    if backend == "triton":
                        sms = qk.wna16_triton.num_sms(torch.device(device))
                        row["config"] = qk.choose_config(m, n, k, scheme.bits, sms).as_dict()
                    for dt, fns in calls.items():
                        tag = str(dt).removeprefix("torch.")
                        x = torch.randn(m, k, generator=gen, device=device, dtype=dt)
                        key = (k, n, m, dt)
                        if key not in matmul_cache:
                            matmul_cache[key] = time_rotating(
                                [lambda w=w: torch.matmul(x, w.t()) for w in dense[dt]], device, args.reps, args.timer,
                                args.realtime)
                        t_mm = matmul_cache[key]
                        t = time_rotating([lambda f=f: f(x) for f in fns], device, reps, args.timer, args.realtime)
                        packed, scale, zero = ckpts[dt][0]
                        ref = qk.wna16_linear_reference(x.float(), packed, scale.float(), zero, scheme.bits, k)
                        y = fns[0](x).float()
                        err = ((y - ref).abs().mean() / ref.abs().mean()).item()
                        row.update({
                            f"us_{tag}": t * 1e6, f"matmul_us_{tag}": t_mm * 1e6, f"speedup_{tag}": t_mm / t,
                            f"GBps_{tag}": row["bytes"] / t / 1e9,
                            f"pct_copy_bw_{tag}": 100 * row["bytes"] / t / 1e9 / copy_bw,
                            f"matmul_GBps_{tag}": (dense_bytes + 2 * m * (k + n)) / t_mm / 1e9,
                            f"rel_err_{tag}": err,
                        })
                        if backend == "triton" and args.sweep and dt == dtypes[0]:
                            prepared = [qk.prepare_wna16(*c, bits=scheme.bits, in_features=k, backend="triton")
                                        for c in ckpts[dt]]
                            row["sweep"] = sweep(prepared, x, scheme, m, n, k, device, args)
                    rows.append(row)
                    if save:
                        save(result)
                    print(format_row(row, [dt for dt in dtypes if dt in calls]), flush=True)
                del ckpts, calls
        del dense
    result["complete"] = True
    return result


def sweep(prepared_list, x, scheme, m, n, k, device, args) -> list[dict]:
    out = []
    for cfg in sweep_configs(m, n, k, scheme.bits, qk.wna16_triton.num_sms(torch.device(device))):
        def call(p, cfg=cfg):
            return qk.wna16_gemm_triton(x, p["triton_qweight"], p["triton_scales"], p.get("triton_zeros"), None,
                                        scheme.bits, config=cfg)
        try:
            t = time_rotating([lambda p=p: call(p) for p in prepared_list], device, args.reps, args.timer,
                              args.realtime)
            out.append({"config": cfg.as_dict(), "us": t * 1e6})
        except Exception as exc:  # noqa: BLE001  (a config that does not launch is a finding, not a crash)
            out.append({"config": cfg.as_dict(), "error": f"{type(exc).__name__}: {exc}"[:300]})
    return out


# ----------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------
def format_row(row: dict, dtypes) -> str:
    parts = [f"{row['K']}x{row['N']} M={row['M']:<4} {row['scheme']:<12} {row['backend']:<9}"]
    for dt in dtypes:
        tag = str(dt).removeprefix("torch.")
        parts.append(f"{tag}: {row[f'us_{tag}']:9.1f} us vs matmul {row[f'matmul_us_{tag}']:9.1f} us "
                     f"= {row[f'speedup_{tag}']:5.2f}x, {row[f'pct_copy_bw_{tag}']:5.1f}% BW, "
                     f"err {row[f'rel_err_{tag}']:.1e}")
    return " | ".join(parts)


def to_markdown(result: dict, dtypes: list[str]) -> str:
    lines = [
        "# WNA16 linear vs torch.matmul",
        "",
        f"Device: {result['device']} ({result['threads']} threads), torch {result['torch']}, timer: {result['timer']}.",
        f"Measured copy bandwidth: **{result['copy_bandwidth_GBps']:.1f} GB/s**.",
        f"Shapes: {result['shape_convention']}. Bytes: {result['bytes_convention']}.",
        f"Command: `python evals/kernels/bench_wna16.py {' '.join(result['argv'])}`",
        "",
    ]
    if not result.get("complete", True):
        lines += ["**Incomplete run** (stopped before the end, e.g. by a time limit): only the rows below were "
                  "measured.", ""]
    head = "| K x N | M | scheme | backend |"
    rule = "|---|---:|---|---|"
    for tag in dtypes:
        head += f" {tag} us | matmul {tag} us | speedup {tag} | GB/s {tag} | % copy BW {tag} |"
        rule += "---:|---:|---:|---:|---:|"
    head += " rel err |"
    rule += "---:|"
    lines += [head, rule]
    for r in result["rows"]:
        line = f"| {r['K']}x{r['N']} | {r['M']} | {r['scheme']} | {r['backend']} ({r['layout']}) |"
        for tag in dtypes:
            if f"us_{tag}" in r:
                line += (f" {r[f'us_{tag}']:.1f} | {r[f'matmul_us_{tag}']:.1f} | {r[f'speedup_{tag}']:.2f}x |"
                         f" {r[f'GBps_{tag}']:.1f} | {r[f'pct_copy_bw_{tag}']:.1f} |")
            else:
                line += " – | – | – | – | – |"
        line += " " + ", ".join(f"{r[f'rel_err_{tag}']:.1e}" for tag in dtypes if f"rel_err_{tag}" in r) + " |"
        lines.append(line)
    lines += side_by_side(result, dtypes[0])
    if result.get("skipped"):
        lines += ["", "## Skipped", ""]
        lines += [f"- {s['backend']} {s['scheme']} {s['dtype']} at {s['K']}x{s['N']}: {s['reason']}"
                  for s in result["skipped"]]
    swept = [r for r in result["rows"] if r.get("sweep")]
    if swept:
        lines += ["", "## Sweep (first dtype): best alternative vs the heuristic's pick", "",
                  "| K x N | M | scheme | heuristic us | best us | best config |", "|---|---:|---|---:|---:|---|"]
        for r in swept:
            ok = [s for s in r["sweep"] if "us" in s]
            best = min(ok, key=lambda s: s["us"]) if ok else None
            tag = dtypes[0]
            if best:
                lines.append(f"| {r['K']}x{r['N']} | {r['M']} | {r['scheme']} | {r[f'us_{tag}']:.1f} | "
                             f"{best['us']:.1f} | `{json.dumps(best['config'])}` |")
    return "\n".join(lines) + "\n"


def side_by_side(result: dict, tag: str) -> list[str]:
    """One line per (shape, scheme, M): the cuBLAS time and every backend's speedup over it and % copy BW."""
    backends = list(dict.fromkeys(r["backend"] for r in result["rows"]))
    if len(backends) < 2:
        return []
    lines = ["", f"## Side by side ({tag}): speedup over cuBLAS / torch.matmul, and % of copy bandwidth", "",
             "| K x N | scheme | M | matmul us | " + " | ".join(backends) + " |",
             "|---|---|---:|---:|" + "---:|" * len(backends)]
    groups: dict[tuple, dict] = {}
    for r in result["rows"]:
        if f"us_{tag}" in r:
            groups.setdefault((r["K"], r["N"], r["scheme"], r["M"]), {})[r["backend"]] = r
    for (k, n, scheme, m), by in groups.items():
        mm = next(iter(by.values()))[f"matmul_us_{tag}"]
        cells = [f"{by[b][f'speedup_{tag}']:.2f}x / {by[b][f'pct_copy_bw_{tag}']:.0f}%" if b in by else "–"
                 for b in backends]
        lines.append(f"| {k}x{n} | {scheme} | {m} | {mm:.1f} | " + " | ".join(cells) + " |")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="WNA16 linear roofline benchmark (see the module docstring).")
    p.add_argument("--out", required=True, type=Path, help="folder for bench_wna16.json and bench_wna16.md")
    p.add_argument("--quick", action="store_true", help="fewer shapes, M values and schemes")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backends", default=None,
                   help="comma-separated, from triton,torch,reference (quantkit) and tinygemm,gemlite (peers); "
                        "default triton,tinygemm,gemlite on CUDA, torch,reference on CPU")
    p.add_argument("--shapes", default=None, help="comma-separated KxN list, e.g. 4096x4096,8192x28672")
    p.add_argument("--ms", default=None, help="comma-separated M values")
    p.add_argument("--schemes", default=None, help=f"comma-separated, from {sorted(SCHEMES)}")
    p.add_argument("--dtypes", default=None,
                   help="activation dtypes; default bfloat16 (the measured decode dtype; tinygemm takes only bf16)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 40 on CUDA, 9 on CPU)")
    p.add_argument("--timer", choices=("graph", "do_bench"), default="graph", help="GPU timing method")
    p.add_argument("--sweep", action="store_true", help="GPU: also time alternative launch configurations")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--max-copies", type=int, default=64, help="cap on the weight copies rotated through")
    p.add_argument("--realtime", action="store_true",
                   help="CPU: time under SCHED_FIFO (Linux, root) to shield the ratios from other load")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is available")
    args.backends = (args.backends or ("triton,tinygemm,gemlite" if cuda else "torch,reference")).split(",")
    unknown = [b for b in args.backends if b not in QUANTKIT_BACKENDS and b not in PEERS]
    if unknown:
        p.error(f"unknown backends {unknown}; choose from {list(QUANTKIT_BACKENDS) + list(PEERS)}")
    if args.shapes:
        args.shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    else:
        args.shapes = (QUICK_SHAPES if args.quick else FULL_SHAPES) if cuda else (
            CPU_QUICK_SHAPES if args.quick else CPU_SHAPES)
    args.ms = [int(v) for v in args.ms.split(",")] if args.ms else (
        (QUICK_MS if args.quick else FULL_MS) if cuda else (CPU_QUICK_MS if args.quick else CPU_MS))
    args.schemes = args.schemes.split(",") if args.schemes else (QUICK_SCHEMES if args.quick else DEFAULT_SCHEMES)
    unknown = [s for s in args.schemes if s not in SCHEMES]
    if unknown:
        p.error(f"unknown schemes {unknown}; choose from {sorted(SCHEMES)}")
    args.dtypes = (args.dtypes or "bfloat16").split(",")
    args.reps = args.reps or (40 if cuda else 9)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    tags = [str(getattr(torch, d)).removeprefix("torch.") for d in args.dtypes]

    def save(result):
        (args.out / "bench_wna16.json").write_text(json.dumps(result, indent=1))
        (args.out / "bench_wna16.md").write_text(to_markdown(result, tags))

    result = run(args, save)
    save(result)
    print(f"wrote {args.out / 'bench_wna16.json'} and {args.out / 'bench_wna16.md'}")
    return result


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1" and "--device" not in sys.argv:
        print("note: TRITON_INTERPRET=1 runs the Triton kernels interpreted on CPU (tests only)", file=sys.stderr)
    main()
