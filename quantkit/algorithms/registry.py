"""The weight-quantization algorithms a recipe can name: one table that the recipe, the API, the CLI
and the calibration pipeline ask, instead of comparing names.

    algorithm = ALGORITHMS["gptq"]
    algorithm.options               # GPTQOptions: the typed options of the recipe's `algorithm:` entry
    algorithm.needs_calibration     # True: runs in quantkit.calibration's block-by-block runner
    algorithm.processor             # "quantkit.calibration.gptq_processor:GPTQProcessor"

The processor is named, not imported: it belongs to quantkit.calibration (it drives the runner),
which imports the algorithms, so the algorithms never import calibration. An algorithm without
calibration quantizes each targeted linear on its own with round-to-nearest (quantkit.api).
"""

from __future__ import annotations

from dataclasses import dataclass

from .autoround import AutoRoundOptions
from .awq import AWQOptions
from .gptq import GPTQOptions
from .rtn import RTNOptions


@dataclass(frozen=True)
class Algorithm:
    """One weight-quantization algorithm: its recipe options and how it runs."""

    name: str
    options: type  # frozen dataclass of the recipe's options (validated by quantkit.core.config_utils.from_dict)
    needs_calibration: bool
    #: "module:Class" of its calibration block processor, built as Class(scheme, options, scale_dtype)
    processor: str | None = None


ALGORITHMS: dict[str, Algorithm] = {
    algorithm.name: algorithm
    for algorithm in (
        Algorithm("rtn", RTNOptions, needs_calibration=False),
        Algorithm("gptq", GPTQOptions, needs_calibration=True,
                  processor="quantkit.calibration.gptq_processor:GPTQProcessor"),
        Algorithm("awq", AWQOptions, needs_calibration=True, processor="quantkit.calibration.awq_processor:AWQProcessor"),
        Algorithm("autoround", AutoRoundOptions, needs_calibration=True,
                  processor="quantkit.calibration.autoround_processor:AutoRoundProcessor"),
    )
}
