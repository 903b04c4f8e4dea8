"""Decode attention over an FP8 KV cache: ``decode_attention_fp8``, the entry point.

One query token per sequence attends to the whole cached context, the cache read in its stored dtype
(float8_e4m3fn, or bf16/fp16/fp32 unquantized). Where Triton runs (``triton_ops.triton_can_run_on``:
CUDA, or CPU under Triton's interpreter) the call goes to ``torch.ops.quantkit.decode_attention_fp8``,
the flash-decoding kernels of ``decode_attention_kernels`` (registered on first use); elsewhere to the
pure-torch reference (``decode_attention_reference``), and triton is never imported.

The Triton launcher and the Hopper compile check (``decode_attention_triton``, ``compile_kernels``,
``COMPILE_VARIANTS``, ``global_read_bytes``, ``default_launch``) are names of this module too, imported
from ``decode_attention_kernels`` when first asked for. Depends on torch (and triton for those).
"""

from __future__ import annotations

import math

import torch

from .decode_attention_reference import (  # noqa: F401  (the contract's dtypes, importable from here)
    FP8_DTYPE,
    KV_DTYPES,
    MAX_HEAD_DIM,
    QUERY_DTYPES,
    check_decode_attention_args,
    decode_attention_reference,
)
from .triton_ops import kernels_interpreted, register_ops, triton_can_run_on  # noqa: F401

#: names of decode_attention_kernels this module hands out on first use (they import triton)
KERNEL_NAMES = ("decode_attention_triton", "compile_kernels", "COMPILE_VARIANTS", "global_read_bytes",
                "default_launch")


def decode_attention_fp8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_mask: torch.Tensor | None = None,
    sm_scale: float | None = None,
    num_splits: int = 0,
    kv_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over a (FP8) KV cache.

    Args:
        q: [B, Hq, D], float16 / bfloat16 / float32, stride 1 along D (any strides on B, Hq).
        k_cache: [B, Hkv, T, D] (the ``transformers`` cache layout), float8_e4m3fn, or float16 /
            bfloat16 / float32 for an unquantized cache; stride 1 along D. Hq must be a multiple of
            Hkv; query head h reads KV head h // (Hq // Hkv). Dequantized key = k_cache * k_scale.
        v_cache: [B, Hkv, T, D], same dtype and shape as k_cache.
        k_scale, v_scale: float tensors of shape [1] (per tensor) or [Hkv] (per KV head), any float
            dtype, on the cache's device; None means 1.0 (unquantized caches).
        kv_mask: bool [B, T], True where the key is attended (left padding: False on the pads), or
            None to attend to all T keys. A sequence with every key masked gets zeros.
        sm_scale: softmax scale; None means D ** -0.5.
        num_splits: number of programs the KV length is split across per (sequence, KV head);
            0 picks one by the rule of decode_attention_heuristics. Any value gives the same
            result up to rounding.
        kv_len: None, or an int32/int64 tensor of one element on the cache's device: only the
            first kv_len positions are attended (a static cache's written length; read on the
            device, so a CUDA graph replays it). Positions past it are neither read nor attended.

    Returns:
        [B, Hq, D] in q's dtype (contiguous).

    Runs the Triton kernel (``torch.ops.quantkit.decode_attention_fp8``, registered here on first use)
    on CUDA tensors, and on CPU tensors when TRITON_INTERPRET=1 was set before the kernels were first
    used (Triton's interpreter: ``triton_ops``); else the pure-torch reference, without importing triton.
    """
    if sm_scale is None:
        if q.dim() < 1:
            raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
        sm_scale = q.shape[-1] ** -0.5
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be finite, got {sm_scale}")
    if not triton_can_run_on(q.device):
        check_decode_attention_args(q, k_cache, v_cache, kv_mask, kv_len)
        return decode_attention_reference(q, k_cache, v_cache, k_scale, v_scale, kv_mask, sm_scale, kv_len)
    register_ops()
    return torch.ops.quantkit.decode_attention_fp8(
        q, k_cache, v_cache, k_scale, v_scale, kv_mask, sm_scale, num_splits, kv_len
    )


def __getattr__(name: str):
    """The Triton launcher and compile check (``KERNEL_NAMES``), imported on first use."""
    if name not in KERNEL_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    register_ops()
    from . import decode_attention_kernels  # triton: only when one of its names is asked for

    return getattr(decode_attention_kernels, name)
