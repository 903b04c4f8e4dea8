"""Where the CPU weight-only linear should switch from the fused aten kernel to dequantize-once + dense matmul.

    python evals/kernels/cpu_dequant_crossover.py --out evals/kernels/cpu --realtime

For one layer shape and each M, times three ways to compute y = x @ W.T side by side, interleaved call
by call (so load drifts over all alike): the fused kernel (``aten._weight_int4pack_mm_for_cpu`` /
``_weight_int8pack_mm``), the dequantize-once path (``quantkit.kernels.wna16_cpu_dequant``) and the
dense matmul on a float weight of the same shape. It prints and writes each path's time as a ratio to
the dense matmul (speedup > 1: faster than dense), and the M from which dequantize-once beats the
fused kernel. The switch in ``cpu_kernel_choice.DEQUANT_MIN_ROWS`` is reasoned from such runs.
Outputs OUT/cpu_dequant_crossover.{json,md}.
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
from quantkit.kernels import cpu_flags, cpu_kernel_choice
from quantkit.kernels import wna16_cpu_dequant as dq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_timing import realtime_priority  # noqa: E402


def layer(fmt: str, k: int, n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A random W4 g128 (fmt "int4") or W8 per-channel (fmt "int8") layer in the torch backend's layout."""
    bits, groups = (4, k // 128) if fmt == "int4" else (8, 1)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k * bits // 32), dtype=torch.int32, generator=gen)
    scale = (torch.rand(n, groups, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
    shape = qk.wna16_layout.check_wna16_weight(packed, scale, None, bits, k)
    # PyTorch's CPU kernels' layouts (what this script times), whichever kernel the "torch" backend would pick
    build = qk.wna16_layout.to_cpu_int4_layout if fmt == "int4" else qk.wna16_layout.to_cpu_int8_layout
    return build(packed, scale, None, shape)


def paths(fmt: str, prep: dict, dense: torch.Tensor, x: torch.Tensor) -> dict:
    """name -> zero-argument call computing x @ W.T that way."""
    if fmt == "int4":
        w, sz = prep["cpu_int4_weight"], prep["cpu_int4_scales_zeros"]
        group = x.shape[1] // sz.shape[0]
        fused = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), w, group, sz)  # noqa: E731
        dequant = lambda: dq.int4_linear_dequantized(x, w, sz, None, None, None)  # noqa: E731
    else:
        w, s = prep["cpu_int8_weight"], prep["cpu_int8_scale"]
        fused = lambda: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), w, s)  # noqa: E731
        dequant = lambda: dq.int8_linear_dequantized(x, w, s, None, None)  # noqa: E731
    return {"dense": lambda: x @ dense.t(), "fused": fused, "dequantize_once": dequant}


def measure(calls: dict, reps: int) -> dict[str, float]:
    """Median seconds per call of each path, the paths interleaved call by call."""
    for fn in calls.values():
        fn()
    samples = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", default="4096x4096", help="K x N of the layer (default 4096x4096)")
    p.add_argument("--ms", default="8,16,32,64,128,256,512", help="comma-separated M values")
    p.add_argument("--dtypes", default="bfloat16,float32", help="activation dtypes")
    p.add_argument("--formats", default="int4,int8")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--realtime", action="store_true", help="time under SCHED_FIFO (Linux, root)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    k, n = (int(v) for v in args.shape.lower().split("x"))
    gen = torch.Generator().manual_seed(0)
    result = {"command": "python evals/kernels/cpu_dequant_crossover.py " + " ".join(sys.argv[1:] if argv is None
                                                                                    else argv),
              "machine": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "native_bf16": cpu_flags.native_bf16(), "thresholds": dict(cpu_kernel_choice.DEQUANT_MIN_ROWS), "K": k, "N": n, "rows": []}
    for fmt in args.formats.split(","):
        prep = layer(fmt, k, n, gen)
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            dense = torch.randn(n, k, generator=gen).to(dtype)
            for m in (int(v) for v in args.ms.split(",")):
                x = torch.randn(m, k, generator=gen).to(dtype)
                with realtime_priority(args.realtime):
                    t = measure(paths(fmt, prep, dense, x), args.reps)
                row = {"format": fmt, "dtype": str(dtype).removeprefix("torch."), "M": m,
                       **{f"{name}_us": s * 1e6 for name, s in t.items()},
                       "fused_vs_dense": t["dense"] / t["fused"], "dequant_vs_dense": t["dense"] / t["dequantize_once"]}
                result["rows"].append(row)
                print(f"{fmt} {row['dtype']:<8} M={m:<4} fused {row['fused_vs_dense']:.2f}x  "
                      f"dequantize-once {row['dequant_vs_dense']:.2f}x  of dense", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_dequant_crossover.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "cpu_dequant_crossover.md").write_text(to_markdown(result))
    return result


def to_markdown(result: dict) -> str:
    lines = ["# CPU weight-only linear: fused kernel vs dequantize-once, as speedups over the dense matmul", "",
             f"Layer K x N = {result['K']} x {result['N']}; {result['machine']}, {result['threads']} threads, "
             f"torch {result['torch']}, native bf16: {result['native_bf16']}. Paths timed interleaved call by call, "
             f"median. Thresholds in force: {result['thresholds']} (rows of x).", "",
             f"Command: `{result['command']}`", "",
             "| format | x dtype | M | fused vs dense | dequantize-once vs dense | faster path |",
             "|---|---|---:|---:|---:|---|"]
    for r in result["rows"]:
        best = "dequantize-once" if r["dequant_vs_dense"] > r["fused_vs_dense"] else "fused"
        lines.append(f"| {r['format']} | {r['dtype']} | {r['M']} | {r['fused_vs_dense']:.2f}x | "
                     f"{r['dequant_vs_dense']:.2f}x | {best} |")
    lines += ["", "Ratios only: absolute times depend on the machine and its load."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
