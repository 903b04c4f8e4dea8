"""quantkit: INT8/INT4 weight and FP8 KV-cache quantization for fast LLM decoding.

    import quantkit
    model = quantkit.quantize(model, "w4a16-rtn")   # in place, any transformers causal LM
    quantkit.save(model, "out/my-model-w4")         # compressed-tensors checkpoint (vLLM, transformers)
    model = quantkit.load("out/my-model-w4")        # ready model on quantkit kernels
"""

from .api import load, quantize, save
from .errors import CheckpointError, ConfigError, QuantizationError
from .recipe import Recipe, load_recipe
from .scheme import QuantScheme

__version__ = "0.1.0"

__all__ = ["CheckpointError", "ConfigError", "QuantScheme", "QuantizationError", "Recipe", "load", "load_recipe",
           "quantize", "save"]
