"""quantkit: INT8/INT4 weight and FP8 KV-cache quantization for fast LLM decoding.

    import quantkit
    model = quantkit.quantize(model, "w4a16-rtn")   # in place, any transformers causal LM
    quantkit.save(model, "out/my-model-w4")         # compressed-tensors checkpoint (vLLM, transformers)
    model = quantkit.load("out/my-model-w4")        # ready model on quantkit kernels
    quantkit.CpuDecoder(model).generate(ids, 64)    # CPU decode in quantkit's C++ loop

The names below are imported on first use, so that ``import quantkit`` (and ``quantkit --help``)
does not load torch and transformers.
"""

import importlib

__version__ = "0.1.0"

# Public name -> the module that defines it (imported on first access).
_LAZY = {
    "load": ".api", "quantize": ".api", "save": ".api",
    "CheckpointError": ".core.errors", "ConfigError": ".core.errors", "QuantizationError": ".core.errors",
    "Recipe": ".quantization.recipe", "load_recipe": ".quantization.recipe",
    "QuantScheme": ".core.scheme",
    "CpuDecoder": ".runtime.cpu_decoder",
}

__all__ = ["CheckpointError", "ConfigError", "CpuDecoder", "QuantScheme", "QuantizationError", "Recipe", "load", "load_recipe",
           "quantize", "save"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'quantkit' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
