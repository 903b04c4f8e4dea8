"""Pure-torch reference of the CPU decode attention (``torch.ops.quantkit.decode_attention_cpu``,
csrc/decode_attention_cpu.cpp): the same inputs, dequantized in fp64, one softmax over each sequence's
cached positions.

    out = decode_attention_cpu_reference(q, k_blocks, v_blocks, k_scales, v_scales, k_head_scale,
                                         v_head_scale, lengths, sm_scale)   # fp32 [B, Hq, D]
"""

from __future__ import annotations

import torch

#: The smallest normal float8_e4m3fn magnitude: the kernel reads codes below it (subnormals) as 0.
FP8_SMALLEST_NORMAL = 2.0 ** -6


def dequantize_blocks(blocks: list[torch.Tensor], token_scales: list[torch.Tensor],
                      head_scale: torch.Tensor | None, *, keys: bool) -> torch.Tensor:
    """Cache blocks (fp32 / bf16 / fp16 / float8_e4m3fn / int8; keys [B, Hkv, block / 16, D, 16],
    values [B, Hkv, block, D]) -> fp64 [B, Hkv, T, D].

    int8: each block's fp32 scales [B, Hkv, block] multiply their tokens; float8_e4m3fn: subnormal codes
    read as 0 (as the kernel reads them), head_scale fp32 [Hkv] (or [1]) multiplies its heads."""
    if keys:  # tiles [D, 16] -> positions [16, D]
        blocks = [b.transpose(3, 4).reshape(b.shape[0], b.shape[1], -1, b.shape[3]) for b in blocks]
    x = torch.cat(blocks, dim=2).double()
    if blocks[0].dtype == torch.int8:
        x = x * torch.cat(token_scales, dim=2).double()[..., None]
    if blocks[0].dtype == torch.float8_e4m3fn:
        x = torch.where(x.abs() < FP8_SMALLEST_NORMAL, 0.0, x)
        x = x * head_scale.double().reshape(1, -1, 1, 1)
    return x


def bf16_rounded_query(q: torch.Tensor, k_head_scale: torch.Tensor | None, kv_heads: int, sm_scale: float) -> torch.Tensor:
    """q fp32 [B, Hq, D] as the kernel's bf16 path multiplies it (fp32 [B, Hq, D]): q * sm_scale (* the fp8 key
    scale of its kv head) rounded in fp32, then to bf16 (nearest even), divided back by the same factor. The
    kernel's other factors (2^64 for fp8) are powers of two, which change no rounding."""
    factor = torch.full((kv_heads,), sm_scale, dtype=torch.float32)
    if k_head_scale is not None:
        factor = factor * k_head_scale.float().reshape(-1).expand(kv_heads)
    factor = factor.repeat_interleave(q.shape[1] // kv_heads)[None, :, None]  # [1, Hq, 1]
    return ((q * factor).to(torch.bfloat16).double() / factor.double()).float()


def decode_attention_cpu_reference(q: torch.Tensor, k_blocks: list[torch.Tensor], v_blocks: list[torch.Tensor],
                                   k_scales: list[torch.Tensor], v_scales: list[torch.Tensor],
                                   k_head_scale: torch.Tensor | None, v_head_scale: torch.Tensor | None,
                                   lengths: torch.Tensor, sm_scale: float, *, bf16_query: bool = False,
                                   absolute_values: bool = False) -> torch.Tensor:
    """q fp32 [B, Hq, D] -> fp32 [B, Hq, D] (block layouts as csrc/decode_attention_cpu.cpp's op): softmax(q k^T * sm_scale) v over positions < lengths[b] of
    sequence b, query head h reading kv head h // (Hq / Hkv).

    bf16_query: the query rounded as the kernel's bf16 dot-product path rounds it (``bf16_rounded_query``);
    absolute_values: |v| in place of v, the weighted mean sum_t p_t |v_t| that bounds the error of that
    path's bf16 softmax weights (each within a relative 2^-8 of its value, bf16's unit roundoff: at most 2^-8 of
    this mean)."""
    k = dequantize_blocks(k_blocks, k_scales, k_head_scale, keys=True)
    v = dequantize_blocks(v_blocks, v_scales, v_head_scale, keys=False)
    if absolute_values:
        v = v.abs()
    if bf16_query:
        q = bf16_rounded_query(q, k_head_scale, k.shape[1], sm_scale)
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for b, n in enumerate(lengths.tolist()):
        kb = k[b, :, :n].repeat_interleave(group, dim=0)  # [Hq, n, D]
        vb = v[b, :, :n].repeat_interleave(group, dim=0)
        p = torch.softmax(torch.einsum("hd,hnd->hn", q[b].double(), kb) * sm_scale, dim=-1)
        out[b] = torch.einsum("hn,hnd->hd", p, vb).float()
    return out
