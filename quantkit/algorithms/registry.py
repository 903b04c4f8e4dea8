"""The weight-quantization algorithms a recipe can name: one table that the recipe, the API, the CLI
and the calibration pipeline ask, instead of comparing names.

    algorithm = ALGORITHMS["gptq"]
    algorithm.options               # GPTQOptions: the typed options of the recipe's `algorithm:` entry
    algorithm.needs_calibration     # True: runs in quantkit.calibration's block-by-block runner
    algorithm.processor             # "quantkit.calibration.gptq_processor:GPTQProcessor"
    algorithm.leftovers             # "rtn": the targeted linears outside the decoder blocks
    ALGORITHMS["rtn"].quantize_linear  # rtn_quantize: one linear on its own, without calibration

The processor is named, not imported: it belongs to quantkit.calibration (it drives the runner),
which imports the algorithms, so the algorithms never import calibration. quantkit.api quantizes each
targeted linear that no calibration reaches on its own, with `linear_quantizer(options)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.quantized_weight import Quantized
from ..core.scheme import QuantScheme
from .autoround import AutoRoundOptions
from .awq import AWQOptions
from .gptq import GPTQOptions
from .rtn import RTNOptions, rtn_quantize

#: (weight float [N, K], scheme, options, *, scale_dtype) -> the quantized weight, its scales rounded to scale_dtype
LinearQuantizer = Callable[..., Quantized]


@dataclass(frozen=True)
class Algorithm:
    """One weight-quantization algorithm: its recipe options and how it runs.

    Without calibration: `quantize_linear` quantizes each targeted linear on its own. With calibration: its
    block `processor`, and `leftovers`, the algorithm without calibration (with its default options) that
    quantizes the targeted linears outside the decoder blocks (an output head no processor quantizes).
    """

    name: str
    options: type  # frozen dataclass of the recipe's options (validated by quantkit.core.config_utils.from_dict)
    needs_calibration: bool
    #: "module:Class" of its calibration block processor, built as Class(scheme, options, scale_dtype)
    processor: str | None = None
    quantize_linear: LinearQuantizer | None = None
    leftovers: str | None = None

    def __post_init__(self) -> None:
        calibrated = self.needs_calibration
        if (self.processor is None) == calibrated or (self.leftovers is None) == calibrated or (
                self.quantize_linear is None) != calibrated:
            raise ValueError(f"algorithm {self.name}: a processor and leftovers exactly when it needs calibration, "
                             f"else quantize_linear")

    def linear_quantizer(self, options: Any) -> Callable[[torch.Tensor, QuantScheme, torch.dtype], Quantized]:
        """(weight, scheme, scale_dtype) -> quantized weight: how a targeted linear that no calibration reaches
        is quantized, with `options` (the recipe's) where this algorithm needs no calibration, else with the
        default options of its leftovers' algorithm."""
        if self.needs_calibration:
            leftovers = ALGORITHMS[self.leftovers]
            return leftovers.linear_quantizer(leftovers.options())
        return lambda weight, scheme, scale_dtype: self.quantize_linear(weight, scheme, options, scale_dtype=scale_dtype)


ALGORITHMS: dict[str, Algorithm] = {
    algorithm.name: algorithm
    for algorithm in (
        Algorithm("rtn", RTNOptions, needs_calibration=False, quantize_linear=rtn_quantize),
        Algorithm("gptq", GPTQOptions, needs_calibration=True,
                  processor="quantkit.calibration.gptq_processor:GPTQProcessor", leftovers="rtn"),
        Algorithm("awq", AWQOptions, needs_calibration=True, processor="quantkit.calibration.awq_processor:AWQProcessor",
                  leftovers="rtn"),
        Algorithm("autoround", AutoRoundOptions, needs_calibration=True,
                  processor="quantkit.calibration.autoround_processor:AutoRoundProcessor", leftovers="rtn"),
    )
}
