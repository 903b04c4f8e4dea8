"""Modules that replace or extend transformers' layers at inference time."""

from .kquant_linear import KQuantLinear
from .quant_linear import QuantLinear

__all__ = ["KQuantLinear", "QuantLinear"]
