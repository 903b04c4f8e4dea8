"""Pure-torch reference for decode attention over an FP8 (or bf16/fp16/fp32) KV cache.

The ground truth the Triton kernel in ``decode_attention.py`` is tested against, and the CPU
implementation of ``torch.ops.quantkit.decode_attention_fp8`` when Triton cannot run.
Argument contract: see ``decode_attention.decode_attention_fp8``.
"""

from __future__ import annotations

import torch


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
