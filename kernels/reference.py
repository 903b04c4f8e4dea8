"""Pure-torch reference for the weight-only (WNA16) linear: unpack, dequantize, matmul.

The reference reads the on-disk compressed-tensors layout directly and is the ground truth
every faster backend is tested against.
"""

from __future__ import annotations

import torch

from .packing import unpack_int32, unpack_zero_point


def dequantize_wna16(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    bits: int,
    in_features: int,
) -> torch.Tensor:
    """Dequantize a packed weight.

    weight_packed: int32 [N, ceil(K*bits/32)], packed along K (the input dim).
    weight_scale: float [N, G]; G = K / group_size (G = 1 per channel).
    weight_zero_point: int32 [ceil(N*bits/32), G] packed along N, or None (symmetric).
    returns: [N, K] in weight_scale's dtype, w = (q - zp) * s.
    """
    n = weight_packed.shape[0]
    q = unpack_int32(weight_packed, bits, in_features).to(torch.float32)  # [N, K]
    groups = weight_scale.shape[1]
    if in_features % groups:
        raise ValueError(f"in_features={in_features} is not a multiple of the {groups} scale groups")
    q = q.reshape(n, groups, in_features // groups)  # [N, G, g]
    if weight_zero_point is not None:
        zp = unpack_zero_point(weight_zero_point, bits, n).to(torch.float32)  # [N, G]
        q = q - zp.unsqueeze(-1)
    w = q * weight_scale.to(torch.float32).unsqueeze(-1)  # [N, G, g]
    return w.reshape(n, in_features).to(weight_scale.dtype)


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
