"""Modules that replace or extend transformers' layers at inference time (the GGUF-block layer,
GgufLinear, is in quantkit.gguf.linear)."""

from .quant_linear import QuantLinear

__all__ = ["QuantLinear"]
