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
