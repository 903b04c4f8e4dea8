"""Modules that replace or extend transformers' layers at inference time."""

from .quant_linear import QuantLinear

__all__ = ["QuantLinear"]
