"""GPU: decode attention time over an FP8 vs a bf16 KV cache at long context, with achieved bandwidth.

For each (batch, context) the same Triton kernel (torch.ops.quantkit.decode_attention_fp8) reads a
float8_e4m3fn cache and a bf16 cache; torch's SDPA on the bf16 cache and "dequantize the fp8
cache, then SDPA" (what a non-fused FP8 cache costs) are timed beside them. Times are CUDA-graph
replays (no Python or launch overhead) and eager calls. Bandwidth = bytes the op must read
(K + V + q) and write (out) / time, also as a fraction of the measured device-to-device copy
bandwidth. Needs a CUDA GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.kernels.decode_attention import decode_attention_fp8
from quantkit.kernels.decode_attention_reference import decode_attention_reference

FP8 = torch.float8_e4m3fn


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth (read + write bytes / time), GB/s."""
    from triton.testing import do_bench

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=200)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _time_ms(fn) -> dict:
    from triton.testing import do_bench, do_bench_cudagraph

    out = {"eager_ms": do_bench(fn, warmup=25, rep=100)}
    try:
        out["graph_ms"] = do_bench_cudagraph(fn, rep=100)
    except Exception as e:  # noqa: BLE001 - report, do not hide, what failed
        out["graph_ms"] = None
        out["graph_error"] = f"{type(e).__name__}: {e}"[:200]
    return out


def bench_decode_attention(contexts=(4096, 16384, 32768), batches=(1, 8), num_q_heads=32, num_kv_heads=8,
                           head_dim=128, *, device: str = "cuda", time_ms=_time_ms, copy_gbs: float | None = None) -> dict:
    """Rows of timings per (batch, context, variant) and the copy bandwidth they are compared to.

    device / time_ms / copy_gbs exist for a dry run of this script's logic on CPU.
    """
    torch.manual_seed(0)
    copy_gbs = copy_gbs or copy_bandwidth_gbs()
    rows = []
    for batch in batches:
        for context in contexts:
            q = torch.randn(batch, num_q_heads, head_dim, device=device, dtype=torch.bfloat16)
            k16 = torch.randn(batch, num_kv_heads, context, head_dim, device=device, dtype=torch.bfloat16)
            v16 = torch.randn_like(k16)
            k_scale = (k16.abs().amax() / 448).float().reshape(1)
            v_scale = (v16.abs().amax() / 448).float().reshape(1)
            k8 = (k16.float() / k_scale).clamp(-448, 448).to(FP8)
            v8 = (v16.float() / v_scale).clamp(-448, 448).to(FP8)
            sm = head_dim**-0.5
            variants = {
                "triton fp8 KV": (lambda: decode_attention_fp8(q, k8, v8, k_scale, v_scale, sm_scale=sm), 1),
                "triton bf16 KV": (lambda: decode_attention_fp8(q, k16, v16, sm_scale=sm), 2),
                "torch SDPA bf16 KV": (lambda: F.scaled_dot_product_attention(
                    q[:, :, None], k16, v16, enable_gqa=True, scale=sm), 2),
                "dequantize fp8 + SDPA": (lambda: F.scaled_dot_product_attention(
                    q[:, :, None], (k8.to(torch.bfloat16) * k_scale.to(torch.bfloat16)),
                    (v8.to(torch.bfloat16) * v_scale.to(torch.bfloat16)), enable_gqa=True, scale=sm), 1),
            }
            ref = decode_attention_reference(q, k8, v8, k_scale, v_scale, sm_scale=sm).float()
            out8 = decode_attention_fp8(q, k8, v8, k_scale, v_scale, sm_scale=sm).float()
            rel_err = ((out8 - ref).abs().mean() / ref.abs().mean()).item()
            for name, (fn, kv_bytes_per_elem) in variants.items():
                moved = 2 * k16.numel() * kv_bytes_per_elem + 2 * q.numel() * q.element_size()
                t = time_ms(fn)
                best = t["graph_ms"] if t.get("graph_ms") else t["eager_ms"]
                gbs = moved / (best * 1e-3) / 1e9
                rows.append({
                    "batch": batch, "context": context, "variant": name, **t,
                    "bytes_moved": moved, "achieved_gbs": gbs, "fraction_of_copy_bw": gbs / copy_gbs,
                    "fp8_kernel_rel_mean_error": rel_err if name == "triton fp8 KV" else None,
                })
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "copy_bandwidth_gbs": copy_gbs,
        "shape": {"num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim},
        "rows": rows,
    }
