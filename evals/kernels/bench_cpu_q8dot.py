"""Per-layer CPU quantized linear speed, decode to prompts: GB/s against the copy bandwidth, ratios to float.

    python evals/kernels/bench_cpu_q8dot.py --out evals/kernels/cpu --realtime
    python evals/kernels/bench_cpu_q8dot.py --out evals/kernels/cpu_q8dot_batch --realtime \
        --shapes 576x1536,2048x5632,4096x4096 --rows 1,2,4,8,16,64,256,512 --paths float,fp32,q8dot-w8,q8dot-w4

For each layer shape (default: the demo's speed model, hidden 1024 / intermediate 2816, and a fused
QKV / gate-up of it) and each path, y = x @ W.T at M rows (default 1 and 4) is timed over enough
copies of the layer that the weights stream from DRAM (``--bytes`` per path, far above the L3), with
the copies called round-robin and the paths interleaved, median over ``--repeats``:

- ``float`` / ``fp32``: the bf16 / fp32 dense linear (``torch.nn.functional.linear``, x in that dtype);
- ``aten-w4`` / ``aten-w8``: PyTorch's weight-only kernels (``_weight_int4pack_mm_for_cpu`` g128 /
  ``_weight_int8pack_mm`` per channel, bf16 activations: quantkit's previous CPU path);
- ``q8dot-w4`` / ``q8dot-w8``: ``torch.ops.quantkit.wna16_cpu_q8dot`` (int8 activations, integer dot
  products; W4 in groups of 128, W8 per channel), on the CPU's best code path and, with ``--isa``,
  others (``avx2``, ``scalar``).

``--shapes`` takes names of the table below (substrings) or literal NxK shapes. The table gives each
path's time as a ratio to the bf16 and fp32 linears of the same shape and rows, measured in the same
interleaved rounds. GB/s = bytes of weights (and scales) read per call / time per call. The copy bandwidth is
``dst.copy_(src)`` of a 512 MiB buffer, counted as bytes read + bytes written; a GEMV only reads, so
its ceiling lies between the copy figure and ~2x it. Outputs OUT/bench_cpu_q8dot.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import quantkit.kernels as qk
from quantkit.harness.hardware import cpu_name
from quantkit.kernels.cpu_extension import cpu_kernel_isa, load_cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_timing import realtime_priority  # noqa: E402

SHAPES = {  # name -> (N, K): the speed model's linears (hidden 1024, intermediate 2816, 4 KV heads of 64)
    "q/o 1024x1024": (1024, 1024),
    "k/v 256x1024": (256, 1024),
    "qkv fused 1536x1024": (1536, 1024),
    "gate/up 2816x1024": (2816, 1024),
    "gate-up fused 5632x1024": (5632, 1024),
    "down 1024x2816": (1024, 2816),
}


def select_shapes(spec: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K): the SHAPES whose names contain one of the comma-separated parts of ``spec``, and
    each part written NxK as it is (all of SHAPES when ``spec`` is empty)."""
    parts = [s for s in spec.split(",") if s]
    shapes = {k: v for k, v in SHAPES.items() if not parts or any(s in k for s in parts)}
    for s in parts:
        n, _, k = s.partition("x")
        if n.isdigit() and k.isdigit():
            shapes[s] = (int(n), int(k))
    return shapes


def copy_bandwidth(repeats: int) -> float:
    """GB/s of dst.copy_(src) on 512 MiB (read + write bytes)."""
    src = torch.ones(512 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() / statistics.median(times) / 1e9


def layer_copies(path: str, n: int, k: int, budget: int, gen: torch.Generator):
    """(callable list, bytes per call): enough copies of one random layer to fill ``budget`` bytes."""
    if path in ("float", "fp32"):
        dtype = torch.bfloat16 if path == "float" else torch.float32
        w = torch.randn(n, k, generator=gen).to(dtype)
        per = w.numel() * w.element_size()
        ws = [w] + [w.clone() for _ in range(max(1, budget // per) - 1)]
        return [lambda x, w=w: torch.nn.functional.linear(x.to(w.dtype), w) for w in ws], per
    bits = 4 if path.endswith("w4") else 8
    groups = k // 128 if bits == 4 else 1
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k * bits // 32), dtype=torch.int32, generator=gen)
    scale = (torch.rand(n, groups, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
    shape = qk.wna16_layout.check_wna16_weight(packed, scale, None, bits, k)
    if path.startswith("aten"):
        build = qk.wna16_layout.to_cpu_int8_layout if bits == 8 else qk.wna16_layout.to_cpu_int4_layout
    else:
        build = qk.wna16_layout.to_cpu_q8_layout
    prepared = build(packed, scale, None, shape)
    per = sum(t.numel() * t.element_size() for t in prepared.values())
    copies = [prepared] + [{kk: v.clone() for kk, v in prepared.items()} for _ in range(max(1, budget // per) - 1)]

    def call(x, p):
        if "cpu_q8_weight" in p:
            return torch.ops.quantkit.wna16_cpu_q8dot(x, p["cpu_q8_weight"], p["cpu_q8_scale"], None, None)
        if "cpu_int8_weight" in p:
            return torch.ops.quantkit.wna16_int8_cpu(x, p["cpu_int8_weight"], p["cpu_int8_scale"], None, None)
        return torch.ops.quantkit.wna16_int4_cpu(x, p["cpu_int4_weight"], p["cpu_int4_scales_zeros"], None, None, None)

    return [lambda x, p=p: call(x, p) for p in copies], per


def time_path(fns, x, rounds: int) -> float:
    """Seconds per call: the copies called round-robin ``rounds`` times (after one warm-up pass)."""
    for f in fns:
        f(x)
    t = time.perf_counter()
    for _ in range(rounds):
        for f in fns:
            f(x)
    return (time.perf_counter() - t) / (rounds * len(fns))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rows", default="1,4", help="M values, comma separated")
    ap.add_argument("--bytes", type=int, default=256 << 20, help="weight bytes per path (>> the L3)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the copies per repeat")
    ap.add_argument("--isa", default="", help="extra q8dot code paths to time, e.g. avx2,scalar")
    ap.add_argument("--shapes", default="", help="shape names (comma separated substrings) or NxK shapes")
    ap.add_argument("--paths", default="float,aten-w8,aten-w4,q8dot-w8,q8dot-w4",
                    help="paths to time: float (bf16), fp32, aten-w8, aten-w4, q8dot-w8, q8dot-w4")
    ap.add_argument("--realtime", action="store_true", help="SCHED_FIFO for the timed part (Linux, root)")
    args = ap.parse_args(argv)
    kernels = load_cpu_kernels()
    if not kernels.available:
        print(f"the C++ CPU kernels are unavailable: {kernels.reason}", file=sys.stderr)
        return 1
    best = cpu_kernel_isa()
    isas = [best] + [i for i in args.isa.split(",") if i and i != best]
    gen = torch.Generator().manual_seed(0)
    shapes = select_shapes(args.shapes)
    rows = [int(r) for r in args.rows.split(",")]
    with realtime_priority(args.realtime):
        bw = copy_bandwidth(args.repeats)
        print(f"copy bandwidth: {bw:.1f} GB/s (read + write), {torch.get_num_threads()} threads, {cpu_name()}")
        results = []
        for name, (n, k) in shapes.items():
            paths = {p: layer_copies(p, n, k, args.bytes, gen) for p in args.paths.split(",")}
            for m in rows:
                x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
                timed = [(p, isa) for p in paths for isa in (isas if p.startswith("q8dot") else [""])]
                times: dict[tuple, list[float]] = {key: [] for key in timed}
                for _ in range(args.repeats):
                    for p, isa in timed:  # interleaved: load drifts over every path alike
                        if isa:
                            cpu_kernel_isa(isa)
                        times[(p, isa)].append(time_path(paths[p][0], x, args.rounds))
                cpu_kernel_isa("auto")
                med = {key: statistics.median(ts) for key, ts in times.items()}
                for (p, isa), t in med.items():
                    gbs = paths[p][1] / t / 1e9
                    label = f"{p} ({isa})" if isa else p
                    vs = {f"x_{f}": med[(f, "")] / t for f in ("float", "fp32") if (f, "") in med}
                    results.append({"shape": name, "n": n, "k": k, "m": m, "path": label, "us": t * 1e6,
                                    "bytes": paths[p][1], "gb_s": gbs, "of_copy": gbs / bw, **vs})
                    ratios = "".join(f" {v:5.2f}x {f[2:]}" for f, v in vs.items())
                    print(f"{name:26s} M={m:3d} {label:22s} {t * 1e6:9.1f} us {gbs:6.1f} GB/s ({gbs / bw:4.0%} of copy){ratios}")
            del paths
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                "copy_gb_s": bw, "command": "python evals/kernels/bench_cpu_q8dot.py " + " ".join(argv or sys.argv[1:])}
        (args.out / "bench_cpu_q8dot.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
        lines = [
            "# CPU quantized linear per layer: GB/s of weights read vs the copy bandwidth, time vs the float linears", "",
            f"{meta['cpu']}, {meta['threads']} threads, torch {meta['torch']}; copy bandwidth {bw:.1f} GB/s "
            "(dst.copy_(src), 512 MiB, read + write bytes). Measured on a shared, loaded machine: upper bounds "
            "on time, lower bounds on GB/s.", "", f"Command: `{meta['command']}`", "",
            "| layer (N x K) | M | path | us / call | GB/s | of copy | vs bf16 | vs fp32 |",
            "|---|---:|---|---:|---:|---:|---:|---:|",
        ]
        ratio = lambda r, key: f"{r[key]:.2f}x" if key in r else ""  # noqa: E731
        lines += [f"| {r['shape']} | {r['m']} | {r['path']} | {r['us']:.1f} | {r['gb_s']:.1f} | {r['of_copy']:.0%} | "
                  f"{ratio(r, 'x_float')} | {ratio(r, 'x_fp32')} |" for r in results]
        (args.out / "bench_cpu_q8dot.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
