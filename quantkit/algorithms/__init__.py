"""Weight-quantization algorithms: pure functions from (weight, statistics) to QuantizedWeight.

Which algorithms a recipe can name, with their options and whether they need calibration: registry.py.
"""

from .awq import AWQOptions, awq_quantize
from .gptq import GPTQOptions, HessianSum, gptq_quantize, hessian_of
from .registry import ALGORITHMS, Algorithm
from .rtn import RTNOptions, rtn_quantize

__all__ = ["ALGORITHMS", "AWQOptions", "Algorithm", "GPTQOptions", "RTNOptions", "awq_quantize", "gptq_quantize",
           "HessianSum", "hessian_of", "rtn_quantize"]
