"""Packing of quantized weights and zero points into the compressed-tensors int32 layout.

Bit order and golden vectors: quantkit.kernels.packing. Weights pack along the input dim
(the last), zero points along the output dim (the first).
"""

from __future__ import annotations

import torch

from quantkit.kernels.packing import pack_int32, unpack_int32

__all__ = ["pack_int32", "unpack_int32", "pack_weight", "unpack_weight", "pack_zero_point", "unpack_zero_point"]


def pack_weight(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q: int [N, K] signed -> int32 [N, ceil(K*bits/32)] (`weight_packed`)."""
    return pack_int32(q, bits)


def unpack_weight(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """int32 [N, W] -> int8 [N, in_features]."""
    return unpack_int32(packed, bits, in_features)


def pack_zero_point(zero_point: torch.Tensor, bits: int) -> torch.Tensor:
    """zero_point: int [N, G] -> int32 [ceil(N*bits/32), G] (`weight_zero_point`, packed along N)."""
    return pack_int32(zero_point.t().contiguous(), bits).t().contiguous()


def unpack_zero_point(packed: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """int32 [ceil(N*bits/32), G] -> int8 [N, G]."""
    return unpack_int32(packed.t().contiguous(), bits, out_features).t().contiguous()
