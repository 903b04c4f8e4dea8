"""Weight-quantization algorithms: pure functions from (weight, statistics) to QuantizedWeight."""

from ..recipe import register_algorithm_options
from .awq import AWQOptions, awq_quantize
from .gptq import GPTQOptions, gptq_quantize, hessian_update
from .rtn import RTNOptions, rtn_quantize

register_algorithm_options("rtn", RTNOptions)
register_algorithm_options("gptq", GPTQOptions)
register_algorithm_options("awq", AWQOptions)

# Algorithms that need calibration data (run through quantkit.calibration's block-by-block runner).
CALIBRATED_ALGORITHMS = ("gptq", "awq")

__all__ = ["AWQOptions", "CALIBRATED_ALGORITHMS", "GPTQOptions", "RTNOptions", "awq_quantize", "gptq_quantize",
           "hessian_update", "rtn_quantize"]
