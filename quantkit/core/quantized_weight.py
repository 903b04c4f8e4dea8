"""QuantizedWeight: the output of every weight-quantization algorithm (unpacked, in memory)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .primitives import dequantize
from .scheme import QuantScheme


@dataclass
class QuantizedWeight:
    """Integer weight with its quantization parameters.

    q: int8 [N, K] in [scheme.qmin, scheme.qmax]; scale: fp32 [N, G]; zero_point: int32 [N, G] or None.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    scheme: QuantScheme

    def __post_init__(self) -> None:
        n, k = self.q.shape
        g = self.scheme.groups_for(k)
        if tuple(self.scale.shape) != (n, g):
            raise ValueError(f"scale shape {tuple(self.scale.shape)} != expected {(n, g)} for q {tuple(self.q.shape)}")
        if (self.zero_point is None) != self.scheme.symmetric:
            raise ValueError("zero_point must be given exactly when the scheme is asymmetric")

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]."""
        return dequantize(self.q, self.scale, self.zero_point, self.scheme)
