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
    On a non-uniform grid (`values`, GGUF's IQ4_NL / IQ4_XS) a level is an index into the values:
    scale[r, g] * values[levels[r, c]] - minimum[r, g].

    levels: fp32 [N, K] whole numbers in lowest..highest; scale, minimum: fp32 [N, G]; column_group: int64 [K];
    values: fp32 [highest + 1] ascending, or None (a uniform grid: a level is its own value).
    """

    levels: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    column_group: torch.Tensor
    lowest: float
    highest: float
    values: torch.Tensor | None = None

    def value(self, levels: torch.Tensor) -> torch.Tensor:
        """The values fp32 levels (any shape) stand for: themselves, or values[levels] on a non-uniform grid."""
        return levels if self.values is None else self.values[levels.long()]

    def moved(self, levels: torch.Tensor, change: torch.Tensor) -> torch.Tensor:
        """The level whose value is nearest value(levels) + change (fp32, same shapes; change in units of the
        scale), within lowest..highest: on a uniform grid levels + round(change), clamped."""
        if self.values is None:
            return (levels + torch.round(change)).clamp_(self.lowest, self.highest)
        target = self.value(levels) + change
        return (target.unsqueeze(-1) - self.values).abs().argmin(dim=-1).float()

    def dequantize(self, levels: torch.Tensor) -> torch.Tensor:
        """levels fp32 [N, K] -> fp32 [N, K] on these grids."""
        return self.value(levels) * self.scale[:, self.column_group] - self.minimum[:, self.column_group]
