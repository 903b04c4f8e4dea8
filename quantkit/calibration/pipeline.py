"""Recipe -> calibration data -> block-by-block runner with the recipe's algorithm."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..algorithms.registry import ALGORITHMS
from ..core.errors import QuantizationError
from ..formats.loading import source_dtype
from ..modules.moe import experts_modules
from ..quantization.recipe import Recipe
from ..core.scheme import QuantScheme
from .adapters import adapter_for
from .data import calibration_batches
from .distributed import share
from .runner import BlockProcessor, run_blockwise
from .spill import BlockSpill


def make_processor(recipe: Recipe, schemes: dict[str, QuantScheme],
                   scale_dtype: torch.dtype | None = None) -> BlockProcessor:
    """The block processor running `recipe`'s calibrated algorithm, each linear on its scheme.

    schemes: module path -> the weight scheme of every targeted linear (Recipe.weights_for, as quantize
    computes them before any work).
    scale_dtype: the dtype the checkpoint will store scales in; the algorithms round scales to it
    before use, so the error they compensate is the one the checkpoint has.
    """
    assert recipe.weights is not None
    algorithm = ALGORITHMS[recipe.algorithm.name]
    if algorithm.processor is None:
        raise QuantizationError(f"algorithm {algorithm.name!r} does not use calibration")
    module_name, class_name = algorithm.processor.split(":")
    processor_cls = getattr(importlib.import_module(module_name), class_name)
    return processor_cls(schemes.__getitem__, recipe.algorithm.options or algorithm.options(), scale_dtype)


def quantize_blockwise(
    model: nn.Module, recipe: Recipe, targets: Sequence[str], calibration_data: Any = None, *,
    tokenizer=None, device: torch.device | str | None = None, progress: bool = True,
    scale_dtype: torch.dtype | None = None, schemes: dict | None = None, spill: BlockSpill | None = None,
) -> list[str]:
    """Quantize the targeted linears inside `model`'s decoder blocks with the recipe's calibrated algorithm.

    scale_dtype: the dtype the output stores scales in (default: the source's, quantkit.formats.loading.source_dtype).
    schemes: module path -> weight scheme of each target (default: Recipe.weights_for of each).
    spill: where each finished block's tensors go instead of the process's memory (None: kept in memory).

    Returns the targeted names outside the decoder blocks (left for the caller to quantize without
    calibration). Raises QuantizationError for an unsupported family before loading any data.
    """
    adapter_for(model)
    batches = share(calibration_batches(calibration_data, model, tokenizer))  # this process's windows
    if schemes is None:
        schemes = recipe.schemes_for(model, targets)
    processor = make_processor(recipe, schemes, scale_dtype or source_dtype(model))
    experts = [m for _, m in experts_modules(model)]
    all_tokens = getattr(recipe.algorithm.options, "moe_calibrate_all_experts", True)
    for m in experts:  # every expert is called (0 rows when no token is routed to it) and routing is counted
        m.count_routing, m.calibrate_all_experts, m.routed_tokens = True, all_tokens, None
    try:
        outside = run_blockwise(
            model, batches, targets, [processor], device=device, progress=progress,
            desc=f"{recipe.algorithm.name} {recipe.name}", spill=spill,
        )
    finally:
        for m in experts:
            m.count_routing = m.calibrate_all_experts = False
    fallback = getattr(processor, "rtn_fallback", [])
    if fallback:
        warnings.warn(f"{len(fallback)} expert linears got no calibration token (routed-only statistics) and were "
                      f"quantized with RTN from their weights: {', '.join(fallback[:6])}"
                      f"{' ...' if len(fallback) > 6 else ''}", stacklevel=3)
    return outside
