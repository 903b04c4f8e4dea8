"""The quantized-weight protocol (`Quantized`) and QuantizedWeight, the integer weight most algorithms return
(unpacked, in memory)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Protocol

import torch

from .level_grid import LevelGrid
from .primitives import dequantize
from .scheme import QuantScheme


class Quantized(Protocol):
    """What every quantized weight type implements (QuantizedWeight here; each GGUF grid's weight,
    quantkit.gguf.grids.GridWeight), so that the code around the algorithms asks the weight instead of
    switching on its type:

        scheme                   the QuantScheme it was quantized on
        shape                    (N, K)
        dequantize()             fp32 [N, K]
        fields_rounded_to(dtype) the weight as a layer computing in `dtype` holds it (its float fields
                                 rounded to `dtype`, or the weight itself where its layer keeps fields of its
                                 own type, as GGUF blocks keep fp16 and 6-bit ones)
        level_grid()             the weight as levels on per-group affine grids (LevelGrid), what a rounding
                                 that moves levels (GPTQ's refinement, algorithms/refine.py) works on
        with_levels(levels)      the same weight with other levels (fp32 [N, K], whole numbers in the grid's range)
        LAYER                    "module:Class" of the layer that holds it (a quantkit.modules.quantized_layer
                                 .QuantizedLayer, built by `to_layer` there); named, not imported: the layers
                                 stand on a floor above this one

    A new weight type implements these and names its layer; an algorithm returns it, and the calibration
    runner and quantkit.quantize put it in the model with `to_layer`.
    """

    LAYER: ClassVar[str]
    scheme: QuantScheme

    @property
    def shape(self) -> tuple[int, int]: ...

    def dequantize(self) -> torch.Tensor: ...

    def fields_rounded_to(self, dtype: torch.dtype) -> "Quantized": ...

    def level_grid(self) -> LevelGrid: ...

    def with_levels(self, levels: torch.Tensor) -> "Quantized": ...


@dataclass
class QuantizedWeight:
    """Integer weight with its quantization parameters (a core.quantized_weight.Quantized: held by a QuantLinear).

    q: int8 [N, K] in [scheme.qmin, scheme.qmax]; scale: fp32 [N, G]; zero_point: int32 [N, G] or None.
    """

    LAYER: ClassVar[str] = "quantkit.modules.quant_linear:QuantLinear"

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

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]."""
        return dequantize(self.q, self.scale, self.zero_point, self.scheme)

    def fields_rounded_to(self, dtype: torch.dtype) -> "QuantizedWeight":
        """The scales rounded to `dtype` (a QuantLinear holds them in its model dtype), back in fp32."""
        return replace(self, scale=self.scale.to(dtype).float())

    def level_grid(self) -> LevelGrid:
        n, k = self.q.shape
        size = self.scheme.group_size if self.scheme.strategy == "group" else k
        scale = self.scale.float()
        minimum = scale * self.zero_point.float() if self.zero_point is not None else torch.zeros_like(scale)
        column_group = torch.arange(k, device=self.q.device) // size
        return LevelGrid(self.q.float(), scale, minimum, column_group, float(self.scheme.qmin),
                         float(self.scheme.qmax))

    def with_levels(self, levels: torch.Tensor) -> "QuantizedWeight":
        return replace(self, q=levels.to(torch.int8))
