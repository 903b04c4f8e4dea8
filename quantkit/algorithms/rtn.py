"""Round-to-nearest: no calibration. The baseline every report shows.

Each group's range is its min and max (observer "minmax"), or, with observer "mse", that range shrunk by
the factor with the least squared rounding error (primitives.mse_clip_ratio, unweighted: RTN sees no
activations). symmetric_scale picks how a symmetric range becomes a scale (primitives.SYMMETRIC_SCALE_RULES;
"signed" is llama.cpp's Q4_0 rule within positive scales: a negative extreme on -8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..gguf.grids import GridWeight, grid_weight
from ..core.primitives import check_range_options, compute_qparams, mse_clip_ratio, quantize
from ..core.quantized_weight import QuantizedWeight
from ..core.scheme import QuantScheme


@dataclass(frozen=True)
class RTNOptions:
    """Options of the `rtn` algorithm (recipe: ``algorithm: {name: rtn, ...}``); the defaults are plain
    min-max round-to-nearest.

    symmetric_scale: one of primitives.SYMMETRIC_SCALE_RULES (symmetric schemes only).
    observer: "minmax" or "mse" (each group's range shrunk by 1 - i/mse_grid, i <= mse_max_shrink * mse_grid,
      with the least squared error of the rounded weights; on the q4_k grid, llama.cpp's own least-squares
      search of each group's step and minimum, quantkit.gguf.grids.searched_fields; q4_1: min-max).
    """

    symmetric_scale: str = "qmax"
    observer: str = "minmax"
    mse_grid: int = 100
    mse_max_shrink: float = 0.8

    def __post_init__(self) -> None:
        check_range_options(self.symmetric_scale, self.observer, self.mse_grid, self.mse_max_shrink)


def rtn_quantize(weight: torch.Tensor, scheme: QuantScheme, options: RTNOptions = RTNOptions(), *,
                 scale_dtype: torch.dtype | None = None) -> QuantizedWeight | GridWeight:
    """weight: float [N, K] -> QuantizedWeight (fp32 math; a grids.GridWeight on a GGUF grid). scale_dtype: the
    dtype the checkpoint stores scales in; they are rounded to it before the weights are (so the mse observer
    scores the stored scales)."""
    if scheme.grid != "uniform":  # each group's min-max range, or ("mse") Q4_K's least-squares search
        return grid_weight(weight.float(), scheme, search=options.observer == "mse")
    rule = dict(symmetric_scale=options.symmetric_scale, scale_dtype=scale_dtype)
    clip = None
    if options.observer == "mse" and scheme.strategy != "tensor":
        clip = mse_clip_ratio(weight, scheme, grid=options.mse_grid, max_shrink=options.mse_max_shrink, **rule)
    scale, zero_point = compute_qparams(weight, scheme, clip_ratio=clip, **rule)
    return QuantizedWeight(quantize(weight, scale, zero_point, scheme), scale, zero_point, scheme)
