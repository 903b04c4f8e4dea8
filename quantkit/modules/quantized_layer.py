"""The quantized-layer protocol: what every layer holding a quantized weight implements (QuantLinear;
quantkit.gguf.linear.GgufLinear), so that code around the layers asks them instead of naming their classes.

    is_quantized_layer(module)   whether a module holds a quantized weight
    to_layer(qweight, bias, dtype)  the layer a quantized weight becomes (core.quantized_weight.Quantized.LAYER)
    holds_format(module, format) whether it holds an on-disk format's tensors as they are: COMPRESSED_TENSORS
                                 (QuantLinear's packed weight, scales, shape, zero points), GGUF (GgufLinear's blocks)

A new layer subclasses QuantizedLayer, names its FORMAT and PACKED_WEIGHT, implements `from_weight`,
`dequantized_weight` and `stored_bits`, and is named by its weight type's LAYER.
"""

from __future__ import annotations

import importlib
from typing import ClassVar

import torch
from torch import nn

from ..core.quantized_weight import Quantized
from ..core.scheme import QuantScheme

COMPRESSED_TENSORS = "compressed-tensors"
GGUF = "gguf"


class QuantizedLayer(nn.Module):
    """A linear layer y = x @ W.T + b whose W is quantized (in_features K, out_features N, scheme).

    FORMAT: the on-disk format whose tensors it holds as they are (COMPRESSED_TENSORS, GGUF).
    PACKED_WEIGHT: the name of the tensor that holds the weight itself (what a weight census counts).
    """

    FORMAT: ClassVar[str]
    PACKED_WEIGHT: ClassVar[str]
    in_features: int
    out_features: int
    scheme: QuantScheme

    @classmethod
    def from_weight(cls, qweight: Quantized, bias: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32) -> "QuantizedLayer":
        """A new layer on the weight's device holding `qweight`, its bias and float tensors in `dtype`."""
        raise NotImplementedError

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [N, K]."""
        raise NotImplementedError

    def stored_bits(self, scale_dtype: torch.dtype | None = None) -> int:
        """Bits the weight takes stored (floating fields counted in scale_dtype where the layer stores them so)."""
        raise NotImplementedError


def is_quantized_layer(module: nn.Module) -> bool:
    return isinstance(module, QuantizedLayer)


def holds_format(module: nn.Module, format: str) -> bool:
    """Whether `module` is a quantized layer holding `format`'s tensors as they are."""
    return is_quantized_layer(module) and module.FORMAT == format


def to_layer(qweight: Quantized, bias: torch.Tensor | None, dtype: torch.dtype) -> QuantizedLayer:
    """The layer an algorithm's result becomes (its LAYER: a QuantLinear, or a GgufLinear on a GGUF grid)."""
    module, _, name = qweight.LAYER.partition(":")
    return getattr(importlib.import_module(module), name).from_weight(qweight, bias, dtype=dtype)
