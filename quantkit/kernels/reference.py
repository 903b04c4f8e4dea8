"""Pure-torch reference for the weight-only (WNA16) linear: unpack, dequantize, matmul.

The reference reads the on-disk compressed-tensors layout directly and is the ground truth
every faster backend is tested against. ``wna16_gemm_torch`` is the same computation on the Triton
layout (what ``torch.ops.quantkit.wna16_gemm`` traces on CPU tensors).
"""

from __future__ import annotations

import torch

from .packing import unpack_int32, unpack_zero_point
from .wna16_layout import TRITON_WORD_BLOCK, check_triton_operands


def dequantize_wna16(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    bits: int,
    in_features: int,
    group_size: int | None = None,
) -> torch.Tensor:
    """Dequantize a packed weight.

    weight_packed: int32 [N, ceil(K*bits/32)], packed along K (the input dim).
    weight_scale: float [N, G]; G = ceil(K / group_size) (G = 1 per channel).
    weight_zero_point: int32 [ceil(N*bits/32), G] packed along N, or None (symmetric).
    group_size: inputs per group, the last group holding what is left (ragged); None: K / G, which must divide K.
    returns: [N, K] in weight_scale's dtype, w = (q - zp) * s, input k in group k // group_size.
    """
    n = weight_packed.shape[0]
    q = unpack_int32(weight_packed, bits, in_features).to(torch.float32)  # [N, K]
    groups = weight_scale.shape[1]
    if group_size is None:
        if in_features % groups:
            raise ValueError(f"in_features={in_features} is not a multiple of the {groups} scale groups; "
                             f"pass group_size for a ragged last group")
        group_size = in_features // groups
    elif groups != -(-in_features // group_size):
        raise ValueError(f"{groups} scale groups do not fit in_features={in_features} in groups of {group_size}")
    def per_input(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [N, K]
        return t.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :in_features]

    if weight_zero_point is not None:
        q = q - per_input(unpack_zero_point(weight_zero_point, bits, n))
    return (q * per_input(weight_scale)).to(weight_scale.dtype)


def wna16_linear_reference(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    bits: int,
    in_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ dequant(W).T (+ bias). x: [..., K] -> [..., N] in x's dtype (fp32 accumulation)."""
    w = dequantize_wna16(weight_packed, weight_scale, weight_zero_point, bits, in_features)
    y = torch.nn.functional.linear(x.to(torch.float32), w.to(torch.float32))
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def wna16_gemm_torch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
) -> torch.Tensor:
    """Pure-torch twin of the kernels on the same (Triton) layout: dequantize in fp32, matmul in fp32.

    Traced instead of the kernels when the op is compiled on CPU tensors (the interpreter cannot run
    on fake tensors) and used by the tests as a layout check.
    """
    m, n, k, group_size = check_triton_operands(x, qweight, scales, zeros, bias, bits)
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=x.device, dtype=torch.int32) * bits
    u = (qweight.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)  # [KW, PW, N]: word w, field i
    u = u.view(-1, TRITON_WORD_BLOCK, per_word, n).transpose(1, 2)  # [blocks, PW, B, N]: k = (b*PW + i)*B + r
    u = u.reshape(-1, n)[:k]  # [K, N]
    z = zeros.to(torch.int32) if zeros is not None else torch.full_like(scales, 1 << (bits - 1), dtype=torch.int32)
    z = z.repeat_interleave(group_size, dim=0)  # [K, N]
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)  # [K, N]
    w_t = (u - z).to(torch.float32) * s  # [K, N]
    y = x.to(torch.float32) @ w_t
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)
