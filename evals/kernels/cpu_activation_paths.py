"""Which CPU path should a weight-only linear take for fp32 (or fp16) activations, per M?

    python evals/kernels/cpu_activation_paths.py --out evals/kernels/cpu --realtime
    python evals/kernels/cpu_activation_paths.py --out evals/kernels/cpu --realtime --dtype float16

For each layer shape (K x N), weight format (int4 g128, int8 per channel) and number of rows M, times
the candidate ways to compute y = x @ W.T with x [M, K] in ``--dtype`` side by side, interleaved call
by call (so load drifts over all alike), as speedups over the dense matmul of a float model in that
dtype (> 1: faster than the float model's own linear):

- ``reference``: ``wna16_linear_reference``, dequantize in fp32 on every call then the fp32 matmul
  (exact; what ``backend="auto"`` ran for fp32 models on CPU before);
- ``fused_bf16``: x cast to bf16, PyTorch's fused weight-only kernel in bf16
  (``aten._weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm``), the result cast back;
- ``fused_native``: the same aten kernels fed x and the scales in x's dtype (they accept fp32 and
  fp16); timed up to ``--fused-native-max-m`` rows only, as its time grows linearly with M;
- ``dequant_fp32``: the dequantize-once path of ``quantkit.kernels.wna16_cpu_dequant`` (the weight
  decoded into an fp32 scratch, then the fp32 dense matmul).

The last column names the path ``torch.ops.quantkit.wna16_int4_cpu`` / ``wna16_int8_cpu`` take at that
M (``cpu_kernel_choice.choose``). Outputs OUT/cpu_activation_paths_DTYPE.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import quantkit.kernels as qk
from quantkit.harness.hardware import cpu_name
from quantkit.kernels import cpu_flags, cpu_kernel_choice
from quantkit.kernels import wna16_cpu_dequant as dq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_dequant_crossover import measure  # noqa: E402
from cpu_timing import realtime_priority  # noqa: E402

DEQUANTIZED = (cpu_kernel_choice.AtenInt4Dequantized, cpu_kernel_choice.AtenInt8Dequantized)

# K x N: a 1B Llama's projections (q/o, gate/up, down) and ref:small's (q/o, gate/up, down)
DEFAULT_SHAPES = "2048x2048,2048x5632,5632x2048,256x256,256x768,768x256"
PATHS = ("reference", "fused_bf16", "fused_native", "dequant_fp32")


def layer(fmt: str, k: int, n: int, gen: torch.Generator) -> dict:
    """A random W4 g128 (fmt "int4") or W8 per-channel (fmt "int8") layer: on-disk tensors and the torch layout."""
    bits, groups = (4, k // 128) if fmt == "int4" else (8, 1)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k * bits // 32), dtype=torch.int32, generator=gen)
    scale = torch.rand(n, groups, generator=gen) * 0.01 + 0.001  # fp32 [N, G]
    shape = qk.wna16_layout.check_wna16_weight(packed, scale, None, bits, k)
    # PyTorch's CPU kernels' layouts (what this script times), whichever kernel the "torch" backend would pick
    build = qk.wna16_layout.to_cpu_int4_layout if fmt == "int4" else qk.wna16_layout.to_cpu_int8_layout
    prep = build(packed, scale, None, shape)
    return {"bits": bits, "packed": packed, "scale": scale, "prep": prep}


def paths(fmt: str, lay: dict, dense: torch.Tensor, x: torch.Tensor, fused_native: bool) -> dict:
    """name -> zero-argument call computing x @ W.T that way; "dense" is the float model's linear (dense in x's dtype)."""
    k, prep = x.shape[1], lay["prep"]
    bf16, dtype = torch.bfloat16, x.dtype
    calls = {
        "dense": lambda: torch.nn.functional.linear(x, dense),
        "reference": lambda: qk.wna16_linear_reference(x, lay["packed"], lay["scale"], None, lay["bits"], k),
    }
    if fmt == "int4":
        w, sz = prep["cpu_int4_weight"], prep["cpu_int4_scales_zeros"]
        group, sz_native = k // sz.shape[0], sz.to(dtype)
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        calls["fused_bf16"] = lambda: mm(x.to(bf16), w, group, sz).to(dtype)
        calls["fused_native"] = lambda: mm(x, w, group, sz_native)
        calls["dequant_fp32"] = lambda: dq.int4_linear_dequantized(x, w, sz, None, None, None)
    else:
        w, s = prep["cpu_int8_weight"], prep["cpu_int8_scale"]
        s_native = s.to(dtype)
        mm = torch.ops.aten._weight_int8pack_mm
        calls["fused_bf16"] = lambda: mm(x.to(bf16), w, s).to(dtype)
        calls["fused_native"] = lambda: mm(x, w, s_native)
        calls["dequant_fp32"] = lambda: dq.int8_linear_dequantized(x, w, s, None, None)
    if not fused_native:
        del calls["fused_native"]
    return calls


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated K x N layer shapes")
    p.add_argument("--ms", default="1,2,4,8,16,32,64,128,512", help="comma-separated M values")
    p.add_argument("--formats", default="int4,int8")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="activation dtype")
    p.add_argument("--fused-native-max-m", type=int, default=8, help="time fused_native up to this M")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--realtime", action="store_true", help="time under SCHED_FIFO (Linux, root)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    result = {"command": "python evals/kernels/cpu_activation_paths.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "dtype": args.dtype, "capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": cpu_flags.native_bf16(),
              "thresholds": dict(cpu_kernel_choice.DEQUANT_MIN_ROWS), "rows": []}
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.lower().split("x"))
        dense = torch.randn(n, k, generator=gen).to(dtype)
        for fmt in args.formats.split(","):
            lay = layer(fmt, k, n, gen)
            for m in (int(v) for v in args.ms.split(",")):
                x = torch.randn(m, k, generator=gen).to(dtype)
                with realtime_priority(args.realtime):
                    t = measure(paths(fmt, lay, dense, x, m <= args.fused_native_max_m), args.reps)
                row = {"K": k, "N": n, "format": fmt, "M": m, "dense_us": t["dense"] * 1e6,
                       **{f"{name}_vs_dense": t["dense"] / t[name] for name in PATHS if name in t},
                       "op_takes": "dequant_fp32" if isinstance(cpu_kernel_choice.choose(m, k, n, dtype, f"cpu_{fmt}"), DEQUANTIZED)
                       else "fused_bf16"}
                result["rows"].append(row)
                print(f"{k}x{n} {fmt} M={m:<4} dense {row['dense_us']:8.0f} us  " + "  ".join(
                    f"{name} {row[f'{name}_vs_dense']:.2f}x" for name in PATHS if f"{name}_vs_dense" in row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"cpu_activation_paths_{args.dtype}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(to_markdown(result))
    return result


def to_markdown(result: dict) -> str:
    d = result["dtype"]
    lines = [f"# CPU weight-only linear with {d} activations: each path as a speedup over the {d} dense matmul", "",
             f"{result['machine']} ({result['capability']}, native bf16: {result['native_bf16']}), "
             f"{result['threads']} threads, torch {result['torch']}. Paths timed interleaved call by call, median; "
             f"> 1 is faster than the float model's own linear. Dequantize-once thresholds in force: "
             f"{result['thresholds']} (rows of x).", "",
             f"Command: `{result['command']}`", "",
             f"| K x N | format | M | dense {d} (us) | reference | fused bf16 | fused {d} | dequantize-once fp32 "
             "| fastest | the op takes |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in result["rows"]:
        speeds = {name: r[f"{name}_vs_dense"] for name in PATHS if f"{name}_vs_dense" in r}
        cells = " | ".join(f"{speeds[name]:.2f}x" if name in speeds else "-" for name in PATHS)
        lines.append(f"| {r['K']}x{r['N']} | {r['format']} | {r['M']} | {r['dense_us']:.0f} | {cells} | "
                     f"{max(speeds, key=speeds.get)} | {r['op_takes']} |")
    lines += ["", "Ratios only: absolute times depend on the machine and its load."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
