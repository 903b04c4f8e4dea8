"""Round-to-nearest: min-max scales, no calibration. The baseline every report shows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..primitives import compute_qparams, quantize
from ..quantized_weight import QuantizedWeight
from ..scheme import QuantScheme


@dataclass(frozen=True)
class RTNOptions:
    """RTN has no options."""


def rtn_quantize(weight: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """weight: float [N, K] -> QuantizedWeight with min-max scales (fp32 math)."""
    scale, zero_point = compute_qparams(weight, scheme)
    return QuantizedWeight(quantize(weight, scale, zero_point, scheme), scale, zero_point, scheme)
