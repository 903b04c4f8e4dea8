"""GPU: decode attention over an FP8 vs a bf16 KV cache at long context, with achieved bandwidth.

    python evals/kv_cache/gpu_bench.py --out DIR [--contexts 1024 8192 16384 32768 131072] [--batches 1 8] [--sweep]

For each (batch, context) the Triton kernel (torch.ops.quantkit.decode_attention_fp8) reads a
float8_e4m3fn cache and a bf16 cache; torch's SDPA on the bf16 cache (the baseline every ratio is
taken against) and "dequantize the fp8 cache, then SDPA" (what a non-fused FP8 cache costs) are
timed beside them. Shape: Llama-3.1-8B attention (32 query heads, 8 KV heads, head_dim 128), one
layer. Times are CUDA-graph replays (no Python or launch overhead) and eager calls. Bandwidth =
bytes the op must read (K + V + q) and write (out) / time, also as a fraction of the measured
device-to-device copy bandwidth; a cache that fits twice in L2 is flagged (its figure is not DRAM
bandwidth). Shapes whose tensors do not fit in free GPU memory are listed as skipped.

``--sweep`` times the launch parameters around the rule of quantkit.kernels.decode_attention_heuristics
(tile, warps, stages, programs per SM) at a few shapes and marks the rule's own choice, so that a GPU
run can confirm the rule or say which constants to change. Writes DIR/gpu_bench.{json,md}. Needs CUDA.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from quantkit.kernels.decode_attention import decode_attention_fp8, decode_attention_triton
from quantkit.kernels.decode_attention_heuristics import (
    BLOCK_N, NUM_STAGES, NUM_WARPS, PROGRAMS_PER_SM, choose_launch,
)
from quantkit.kernels.decode_attention_reference import decode_attention_reference

FP8 = torch.float8_e4m3fn
SHAPE = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}  # Llama-3.1-8B attention
BASELINE = "torch SDPA bf16 KV"


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth (read + write bytes / time), GB/s."""
    from triton.testing import do_bench

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=200)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def time_ms(fn, rep: int = 100, eager: bool = True) -> dict:
    """{"graph_ms": CUDA-graph replay time (None if capture failed, with "graph_error"), "eager_ms"}."""
    from triton.testing import do_bench, do_bench_cudagraph

    out = {"eager_ms": do_bench(fn, warmup=10, rep=rep) if eager else None}
    try:
        out["graph_ms"] = do_bench_cudagraph(fn, rep=rep)
    except Exception as e:  # noqa: BLE001 - report, do not hide, what failed
        out["graph_ms"], out["graph_error"] = None, f"{type(e).__name__}: {e}"[:200]
    return out


def _best_ms(t: dict) -> float:
    if t.get("graph_ms") is None and t.get("eager_ms") is None:
        raise RuntimeError(t.get("graph_error", "no timing"))
    return t["graph_ms"] if t.get("graph_ms") else t["eager_ms"]


def make_inputs(batch: int, context: int, device: str = "cuda"):
    """q [B, Hq, D] bf16; bf16 K/V [B, Hkv, T, D]; their fp8 codes with per-tensor scales."""
    q = torch.randn(batch, SHAPE["num_q_heads"], SHAPE["head_dim"], device=device, dtype=torch.bfloat16)
    k16 = torch.randn(batch, SHAPE["num_kv_heads"], context, SHAPE["head_dim"], device=device, dtype=torch.bfloat16)
    v16 = torch.randn_like(k16)
    k_scale = (k16.abs().amax() / 448).float().reshape(1)
    v_scale = (v16.abs().amax() / 448).float().reshape(1)
    k8 = (k16.float() / k_scale).clamp(-448, 448).to(FP8)
    v8 = (v16.float() / v_scale).clamp(-448, 448).to(FP8)
    return q, k16, v16, k8, v8, k_scale, v_scale


def _shape_bytes(batch: int, context: int) -> int:
    """GPU bytes one shape needs at its peak: bf16 K/V, fp8 K/V, and SDPA's dequantized copies."""
    kv = batch * SHAPE["num_kv_heads"] * context * SHAPE["head_dim"]
    return 2 * kv * 2 + 2 * kv + 2 * kv * 2 + 2 * kv * 4  # + fp32 temporaries while quantizing


def bench_decode_attention(contexts=(1024, 8192, 16384, 32768, 131072), batches=(1, 8), *,
                           copy_gbs: float | None = None, rep: int = 100) -> dict:
    """Rows of timings per (batch, context, variant), the copy bandwidth, the skipped shapes."""
    torch.manual_seed(0)
    copy_gbs = copy_gbs or copy_bandwidth_gbs()
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0)
    sm = SHAPE["head_dim"] ** -0.5
    rows, skipped = [], []
    for batch, context in itertools.product(batches, contexts):
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        if _shape_bytes(batch, context) > 0.8 * free:
            skipped.append({"batch": batch, "context": context, "reason": f"needs ~{_shape_bytes(batch, context) / 2**30:.0f} GiB"})
            continue
        q, k16, v16, k8, v8, k_scale, v_scale = make_inputs(batch, context)
        variants = {
            "triton fp8 KV": (lambda: decode_attention_fp8(q, k8, v8, k_scale, v_scale, sm_scale=sm), 1),
            "triton bf16 KV": (lambda: decode_attention_fp8(q, k16, v16, sm_scale=sm), 2),
            BASELINE: (lambda: F.scaled_dot_product_attention(q[:, :, None], k16, v16, enable_gqa=True, scale=sm), 2),
            "dequantize fp8 + SDPA": (lambda: F.scaled_dot_product_attention(
                q[:, :, None], k8.to(torch.bfloat16) * k_scale.to(torch.bfloat16),
                v8.to(torch.bfloat16) * v_scale.to(torch.bfloat16), enable_gqa=True, scale=sm), 1),
        }
        ref = decode_attention_reference(q, k8, v8, k_scale, v_scale, sm_scale=sm).float()
        out8 = decode_attention_fp8(q, k8, v8, k_scale, v_scale, sm_scale=sm).float()
        rel_err = ((out8 - ref).abs().mean() / ref.abs().mean()).item()
        shape_rows = []
        for name, (fn, kv_bytes_per_elem) in variants.items():
            moved = 2 * k16.numel() * kv_bytes_per_elem + 2 * q.numel() * q.element_size()
            t = time_ms(fn, rep)
            gbs = moved / (_best_ms(t) * 1e-3) / 1e9
            shape_rows.append({
                "batch": batch, "context": context, "variant": name, **t, "bytes_moved": moved,
                "achieved_gbs": gbs, "fraction_of_copy_bw": gbs / copy_gbs, "l2_resident": moved < 2 * l2_bytes,
                "fp8_kernel_rel_mean_error": rel_err if name == "triton fp8 KV" else None,
            })
        base = next(r for r in shape_rows if r["variant"] == BASELINE)
        for r in shape_rows:
            r["speedup_over_sdpa_bf16"] = _best_ms(base) / _best_ms(r)
        rows += shape_rows
        del q, k16, v16, k8, v8
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_bandwidth_gbs": copy_gbs,
        "l2_bytes": l2_bytes,
        "shape": SHAPE,
        "rows": rows,
        "skipped": skipped,
    }


def sweep_launch(shapes=((1, 8192), (1, 32768), (8, 32768)), *, block_ns=(32, 64, 128), warps=(4, 8),
                 stages=(2, 3), programs_per_sm=(2, 4, 8), copy_gbs: float, rep: int = 50) -> list[dict]:
    """The fp8 kernel timed over launch parameters at a few (batch, context) shapes (CUDA graph)."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    sm = SHAPE["head_dim"] ** -0.5
    rows = []
    for batch, context in shapes:
        q, k16, v16, k8, v8, k_scale, v_scale = make_inputs(batch, context)
        del k16, v16
        moved = 2 * k8.numel() + 2 * q.numel() * q.element_size()
        rule = choose_launch(batch, SHAPE["num_kv_heads"], context, num_sms)
        for block_n, w, st, p in itertools.product(block_ns, warps, stages, programs_per_sm):
            launch = choose_launch(batch, SHAPE["num_kv_heads"], context, num_sms, programs_per_sm=p, block_n=block_n,
                                   num_warps=w, num_stages=st)
            row = {"batch": batch, "context": context, "block_n": block_n, "num_warps": w, "num_stages": st,
                   "programs_per_sm": p, "num_splits": launch.num_splits, "rule": launch == rule}
            try:
                t = time_ms(lambda: decode_attention_triton(q, k8, v8, k_scale, v_scale, sm_scale=sm, launch=launch), rep,
                            eager=False)
                gbs = moved / (_best_ms(t) * 1e-3) / 1e9
                row.update(ms=_best_ms(t), achieved_gbs=gbs, fraction_of_copy_bw=gbs / copy_gbs)
            except Exception as e:  # noqa: BLE001 - a configuration that does not compile or fit is reported
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
        del q, k8, v8
    return rows


def markdown(report: dict) -> str:
    lines = [
        f"# FP8 decode attention on {report['device']}",
        "",
        f"Reproduce: `{report['command']}`  ",
        f"torch {report['torch']}; one layer of Llama-3.1-8B attention (Hq={report['shape']['num_q_heads']}, "
        f"Hkv={report['shape']['num_kv_heads']}, D={report['shape']['head_dim']}); measured copy bandwidth "
        f"{report['copy_bandwidth_gbs']:.0f} GB/s. Times are CUDA-graph replays; GB/s counts the bytes the op must "
        "read and write; the speedup is SDPA-on-bf16's time over the variant's. Rows marked L2 move less than "
        "twice the L2 cache: their bandwidth is not DRAM bandwidth.",
        "",
        "| batch | context | variant | µs | GB/s | % of copy BW | speedup over SDPA bf16 |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        flag = " (L2)" if r["l2_resident"] else ""
        lines.append(f"| {r['batch']} | {r['context']} | {r['variant']} | {1e3 * _best_ms(r):.1f} | "
                     f"{r['achieved_gbs']:.0f}{flag} | {100 * r['fraction_of_copy_bw']:.0f}% | "
                     f"{r['speedup_over_sdpa_bf16']:.2f}x |")
    for s in report["skipped"]:
        lines.append(f"| {s['batch']} | {s['context']} | skipped: {s['reason']} | | | | |")
    if report.get("sweep"):
        lines += [
            "",
            f"## Launch sweep (rule: block_n {BLOCK_N}, {NUM_WARPS} warps, {NUM_STAGES} stages, "
            f"{PROGRAMS_PER_SM} programs per SM; * = the rule's choice)",
            "",
            "| batch | context | block_n | warps | stages | programs/SM | splits | µs | % of copy BW |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in sorted(report["sweep"], key=lambda r: (r["batch"], r["context"], r.get("ms", float("inf")))):
            timing = (f"{1e3 * r['ms']:.1f} | {100 * r['fraction_of_copy_bw']:.0f}%" if "ms" in r
                      else f"error | {r['error'][:60]}")
            lines.append(f"| {r['batch']} | {r['context']} | {r['block_n']} | {r['num_warps']} | {r['num_stages']} | "
                         f"{r['programs_per_sm']} | {r['num_splits']}{' *' if r['rule'] else ''} | {timing} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 16384, 32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--sweep", action="store_true", help="also time launch parameters around the rule")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench.py needs a CUDA GPU")
    report = bench_decode_attention(args.contexts, args.batches)
    report["command"] = "python evals/kv_cache/gpu_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.sweep:
        report["sweep"] = sweep_launch(copy_gbs=report["copy_bandwidth_gbs"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "gpu_bench.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
