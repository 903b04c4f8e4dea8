"""Weight-quantization algorithms: pure functions from (weight, statistics) to QuantizedWeight."""

from ..recipe import register_algorithm_options
from .rtn import RTNOptions, rtn_quantize

register_algorithm_options("rtn", RTNOptions)

__all__ = ["RTNOptions", "rtn_quantize"]
