"""Modules that replace or extend transformers' layers at inference time (the GGUF-block layer,
GgufLinear, is in quantkit.gguf.linear), and the model surgery that finds and swaps them (targets, moe).

`QuantLinear` is imported on first use, so that the modules that need no kernels (targets, kv_rotation,
kv_scales) load without triton.
"""

import importlib

__all__ = ["QuantLinear"]


def __getattr__(name: str):
    if name == "QuantLinear":
        value = importlib.import_module(".quant_linear", __name__).QuantLinear
        globals()[name] = value
        return value
    raise AttributeError(f"module 'quantkit.modules' has no attribute {name!r}")
