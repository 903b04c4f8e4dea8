"""Quantize-on-write into a static FP8 KV cache: ``fp8_kv_cache_write``, the entry point.

A decode step appends one token's keys and values per layer; on CUDA one Triton launch quantizes and
writes them (``torch.ops.quantkit.fp8_kv_cache_write``, the kernel of ``kv_cache_write_kernels``,
registered on first use), elsewhere the pure-torch reference does (``kv_cache_write_reference``), with
the same codes, and triton is never imported.

The Triton launcher and its compile check (``fp8_kv_cache_write_triton``, ``compile_kernel``) are names
of this module too, imported from ``kv_cache_write_kernels`` when first asked for. Depends on torch (and
triton for those).
"""

from __future__ import annotations

import torch

from .kv_cache_write_reference import (  # noqa: F401  (the contract's constants, importable from here)
    FP8_DTYPE,
    FP8_MAX,
    STATE_DTYPES,
    check_fp8_kv_cache_write_args,
    fp8_kv_cache_write_reference,
)
from .triton_ops import register_ops, triton_can_run_on

#: names of kv_cache_write_kernels this module hands out on first use (they import triton)
KERNEL_NAMES = ("fp8_kv_cache_write_triton", "compile_kernel")


def fp8_kv_cache_write(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start) -> None:
    """Quantize new keys/values and write them into a static FP8 cache, in place.

    Args:
        key_states, value_states: [B, Hkv, T_new, D], float16 / bfloat16 / float32, stride 1 along D.
        k_cache, v_cache: float8_e4m3fn [B, Hkv, max_len, D], same shape and strides; positions
            start .. start + T_new - 1 are overwritten with fp8_e4m3(clamp(state / scale, -448, 448)).
            They must be < max_len, which is not checked on the host (it would need a sync): past
            it the kernel writes nothing (never out of bounds), the reference raises IndexError.
        k_scale, v_scale: fp32 [1] (per tensor) or [Hkv] (per KV head).
        start: int32/int64 tensor of one element on the same device: the first position to write.

    On CUDA one Triton launch (``torch.ops.quantkit.fp8_kv_cache_write``, registered here on first use;
    or the interpreter on CPU with TRITON_INTERPRET=1: ``triton_ops``); elsewhere the pure-torch
    reference, without importing triton. Both give the same codes.
    """
    check_fp8_kv_cache_write_args(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start)
    if not triton_can_run_on(key_states.device):
        fp8_kv_cache_write_reference(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start)
        return
    register_ops()
    torch.ops.quantkit.fp8_kv_cache_write(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start)


def __getattr__(name: str):
    """The Triton launcher and compile check (``KERNEL_NAMES``), imported on first use."""
    if name not in KERNEL_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    register_ops()
    from . import kv_cache_write_kernels  # triton: only when one of its names is asked for

    return getattr(kv_cache_write_kernels, name)
