"""LevelGrid: a quantized weight as whole-number levels on per-group affine grids, the view that a rounding
moving levels (algorithms/refine.py) works on. Every quantized weight type gives it (`level_grid()` of the
core.quantized_weight.Quantized protocol); this module imports nothing of quantkit, so that the GGUF grids,
which the core's primitives import, can import it too."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LevelGrid:
    """A quantized weight seen as levels on affine grids, one per group of inputs: column c of row r
    dequantizes as scale[r, g] * levels[r, c] - minimum[r, g] with g = column_group[c] (an integer weight's
    minimum is scale * zero point; a GGUF grid's is its float minimum, or OFFSET * scale on a symmetric one).

    levels: fp32 [N, K] whole numbers in lowest..highest; scale, minimum: fp32 [N, G]; column_group: int64 [K].
    """

    levels: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    column_group: torch.Tensor
    lowest: float
    highest: float

    def dequantize(self, levels: torch.Tensor) -> torch.Tensor:
        """levels fp32 [N, K] -> fp32 [N, K] on these grids."""
        return levels * self.scale[:, self.column_group] - self.minimum[:, self.column_group]
