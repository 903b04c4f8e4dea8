"""Pure-torch quantize-on-write into a static FP8 KV cache, and the argument checks it shares with the
Triton kernel (``kv_cache_write_kernels``): the ground truth the kernel's codes are tested against, bit
for bit, and what ``kv_cache_write.fp8_kv_cache_write`` runs where Triton cannot. Depends on torch only.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
STATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_fp8_kv_cache_write_args(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start) -> None:
    """Raise a ValueError naming the problem if the arguments break the contract of fp8_kv_cache_write."""
    if key_states.dim() != 4 or value_states.shape != key_states.shape:
        raise ValueError(
            f"key_states and value_states must both be [B, Hkv, T_new, D], got {tuple(key_states.shape)} and "
            f"{tuple(value_states.shape)}"
        )
    if k_cache.dtype != FP8_DTYPE or v_cache.dtype != FP8_DTYPE or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must be float8_e4m3fn [B, Hkv, max_len, D] of one shape, got {k_cache.dtype} "
            f"{tuple(k_cache.shape)} and {v_cache.dtype} {tuple(v_cache.shape)}"
        )
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides (allocate them alike)")
    b, h, _, d = key_states.shape
    if (k_cache.shape[0], k_cache.shape[1], k_cache.shape[3]) != (b, h, d):
        raise ValueError(
            f"the new states [B={b}, Hkv={h}, D={d}] do not fit the cache {tuple(k_cache.shape)}: B, Hkv, D must agree"
        )
    if key_states.dtype not in STATE_DTYPES or value_states.dtype != key_states.dtype:
        raise ValueError(f"key/value states must be one of {STATE_DTYPES}, got {key_states.dtype}/{value_states.dtype}")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale.dtype != torch.float32 or scale.dim() != 1 or scale.numel() not in (1, h):
            raise ValueError(f"{name} must be fp32 [1] or [{h}], got {scale.dtype} {tuple(scale.shape)}")
    if start.numel() != 1 or start.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"start must be one int32/int64 position, got {start.dtype} {tuple(start.shape)}")
    for name, t in (("key_states", key_states), ("value_states", value_states), ("k_cache", k_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim (stride 1)")
    devices = {t.device for t in (key_states, value_states, k_cache, v_cache, k_scale, v_scale, start)}
    if len(devices) != 1:
        raise ValueError(f"all arguments must be on one device, got {sorted(map(str, devices))}")


def fp8_kv_cache_write_reference(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start) -> None:
    """In place: cache[:, :, start + t] = fp8_e4m3(clamp(state[:, :, t] / scale, +-448)) for K and V.

    Shapes as fp8_kv_cache_write. Positions from a device tensor, no host sync (index_copy_ on the
    uint8 view of the fp8 storage: torch has no fp8 index_copy_ on every device).
    """
    positions = torch.arange(key_states.shape[2], device=k_cache.device) + start.reshape(())  # [T_new]
    for states, cache, scale in ((key_states, k_cache, k_scale), (value_states, v_cache, v_scale)):
        codes = (states.float() / scale.reshape(1, -1, 1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        cache.view(torch.uint8).index_copy_(2, positions, codes.view(torch.uint8))
