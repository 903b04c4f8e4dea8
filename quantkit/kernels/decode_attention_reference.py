"""Pure-torch reference for decode attention over an FP8 (or bf16/fp16/fp32) KV cache, and the
argument checks the reference and the Triton kernel share.

The ground truth the Triton kernel in ``decode_attention_kernels.py`` is tested against, and what
``decode_attention.decode_attention_fp8`` runs where Triton cannot. Argument contract: see
``decode_attention.decode_attention_fp8``. Depends on torch only.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KV_DTYPES = (FP8_DTYPE, torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def dequantize_kv(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """cache [B, Hkv, T, D] (any float dtype) * scale ([1] or [Hkv], or None = 1) -> fp32 [B, Hkv, T, D]."""
    x = cache.to(torch.float32)
    if scale is None:
        return x
    return x * scale.to(torch.float32).reshape(1, -1, 1, 1)  # [1, 1|Hkv, 1, 1]


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_mask: torch.Tensor | None = None,
    sm_scale: float | None = None,
    kv_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q . dequant(K)^T * sm_scale, masked) @ dequant(V), in fp32; returns q's dtype.

    q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, T, D] with Hq % Hkv == 0 (query head h reads KV head
    h // (Hq // Hkv)); k_scale, v_scale: [1] or [Hkv] or None; kv_mask: bool [B, T] (True = attend)
    or None; kv_len: one-element int tensor or None, positions >= kv_len are not attended.
    Returns [B, Hq, D]. A row whose keys are all masked gives zeros.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    k = dequantize_kv(k_cache, k_scale).repeat_interleave(group, dim=1)  # [B, Hq, T, D]
    v = dequantize_kv(v_cache, v_scale).repeat_interleave(group, dim=1)  # [B, Hq, T, D]
    past_end = None
    if kv_len is not None:  # positions never written: whatever they hold (even NaN) must not count
        past_end = torch.arange(k_cache.shape[2], device=k.device) >= kv_len.reshape(())  # [T]
        k = k.masked_fill(past_end[:, None], 0.0)
        v = v.masked_fill(past_end[:, None], 0.0)
    scores = torch.einsum("bhd,bhtd->bht", q.to(torch.float32), k) * sm_scale  # [B, Hq, T]
    if kv_mask is not None:
        scores = scores.masked_fill(~kv_mask.to(torch.bool)[:, None, :], float("-inf"))
    if past_end is not None:
        scores = scores.masked_fill(past_end, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
    out = torch.einsum("bht,bhtd->bhd", probs, v)  # [B, Hq, D]
    return out.to(q.dtype)


def check_decode_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_mask: torch.Tensor | None,
    kv_len: torch.Tensor | None = None,
) -> None:
    """Raise a ValueError naming the problem if the arguments break the contract of decode_attention_fp8."""
    if q.dim() != 3:
        raise ValueError(
            f"q must be [B, Hq, D] (one query token per sequence), got shape {tuple(q.shape)}; "
            "for a [B, Hq, 1, D] query pass q.squeeze(2)"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [B, Hkv, T, D] with the same shape, got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}"
        )
    batch, num_q_heads, head_dim = q.shape
    kb, num_kv_heads, seq_len, kd = k_cache.shape
    if kb != batch or kd != head_dim:
        raise ValueError(
            f"q [B={batch}, Hq={num_q_heads}, D={head_dim}] does not match the cache [B={kb}, Hkv={num_kv_heads}, "
            f"T={seq_len}, D={kd}]: batch and head_dim must agree"
        )
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} must be a multiple of Hkv={num_kv_heads} (grouped-query attention)")
    if seq_len == 0:
        raise ValueError("the KV cache is empty (T = 0): there is nothing to attend to")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} is above the supported maximum {MAX_HEAD_DIM}")
    if q.dtype not in QUERY_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not supported; use one of {QUERY_DTYPES}")
    if k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache/v_cache dtypes {k_cache.dtype}/{v_cache.dtype}: both must be the same one of {KV_DTYPES}"
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache must be contiguous along head_dim (stride 1): call .contiguous()")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"q, k_cache, v_cache are on {q.device}, {k_cache.device}, {v_cache.device}: use one device")
    if kv_mask is not None:
        if kv_mask.dtype != torch.bool or tuple(kv_mask.shape) != (batch, seq_len):
            raise ValueError(
                f"kv_mask must be bool [B={batch}, T={seq_len}] (True = attend), got {kv_mask.dtype} "
                f"{tuple(kv_mask.shape)}"
            )
        if kv_mask.device != q.device:
            raise ValueError(f"kv_mask is on {kv_mask.device}, q on {q.device}: use one device")
    if kv_len is not None:
        if kv_len.numel() != 1 or kv_len.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"kv_len must be one int32/int64 length, got {kv_len.dtype} {tuple(kv_len.shape)}")
        if kv_len.device != q.device:
            raise ValueError(f"kv_len is on {kv_len.device}, q on {q.device}: use one device")
