"""AutoRound (SignRound): rounding offsets and range multipliers learned against a block's output.

Cheng et al., "Optimize Weight Rounding via Signed Gradient Descent for the Quantization of LLMs" (2023),
as intel/auto-round runs it: for every targeted linear of a decoder block, a rounding offset V in
[-0.5, 0.5] per weight and, per (row, group), multipliers of the group's min and max in
[min_range, 1]; the block's output with the fake-quantized weights is fitted to the float block's output
on the same inputs (those the already-quantized earlier blocks produce) by signed gradient descent
(p -= lr_t * sign(grad), lr_t decaying linearly to 0), rounding through a straight-through estimator; the
parameters of the lowest loss seen are kept.

Pure functions over tensors, no module state (the block loop is in calibration/autoround_processor.py):

- ``RoundingParams.init(weight, scheme)``: V = 0 and multipliers 1 (round-to-nearest on min-max ranges);
- ``fake_quantize(weight, params, scheme, options)``: the differentiable quantize-dequantize, fp32 [N, K];
- ``signed_step(params, lr, options)``: one signed-gradient update, projected back into the bounds;
- ``quantized_weight(weight, params, scheme, options, scale_dtype)``: the QuantizedWeight RTN and GPTQ
  produce for the same integer grid (int8 q [N, K], fp32 scale [N, G], int32 zero point [N, G] or None).

Integer grids only (int4 / int8, symmetric or not, per channel or per group); GGUF grids are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.primitives import SYMMETRIC_SCALE_RULES, _range_qparams, grouped_columns
from ..core.quantized_weight import QuantizedWeight
from ..core.scheme import QuantScheme

_EPS = 1e-12


@dataclass(frozen=True)
class AutoRoundOptions:
    """Options of the `autoround` algorithm (recipe: ``algorithm: {name: autoround, ...}``); the defaults
    are intel/auto-round's.

    iters: signed-gradient steps per decoder block (auto-round: 200).
    lr: step size of the rounding offsets at the first step, decaying linearly to 0 (None: 1 / iters).
    minmax_lr: step size of the range multipliers (None: lr).
    batch_size: calibration windows per step, drawn at random from the block's inputs (auto-round: 8).
    tune_ranges: learn the range multipliers too (auto-round's enable_minmax_tuning); False: offsets only.
    min_range: the lowest range multiplier (the group's min and max may shrink to this fraction).
    symmetric_scale: symmetric schemes' scale rule (primitives.SYMMETRIC_SCALE_RULES).
    seed: seed of the windows drawn at each step (results are deterministic for a seed).
    keep_best: keep the parameters with the lowest step loss (auto-round's best-loss checkpoint), then
      the better of them and round-to-nearest on all the block's calibration windows.
    """

    iters: int = 200
    lr: float | None = None
    minmax_lr: float | None = None
    batch_size: int = 8
    tune_ranges: bool = True
    min_range: float = 0.5
    symmetric_scale: str = "qmax"
    seed: int = 0
    keep_best: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.iters, bool) or not isinstance(self.iters, int) or self.iters < 1:
            raise ValueError(f"iters must be a positive whole number of steps (auto-round: 200), got {self.iters!r}")
        for name in ("lr", "minmax_lr"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a positive finite step size (default 1 / iters), got {value!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive number of windows per step, got {self.batch_size!r}")
        if isinstance(self.min_range, bool) or not isinstance(self.min_range, (int, float)) \
                or not (0.0 < self.min_range <= 1.0):
            raise ValueError(f"min_range must be in (0, 1] (the least fraction of a group's range), got {self.min_range!r}")
        if self.symmetric_scale not in SYMMETRIC_SCALE_RULES:
            raise ValueError(f"symmetric_scale must be one of {SYMMETRIC_SCALE_RULES}, got {self.symmetric_scale!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def rounding_lr(self) -> float:
        return float(self.lr) if self.lr is not None else 1.0 / self.iters

    @property
    def range_lr(self) -> float:
        return float(self.minmax_lr) if self.minmax_lr is not None else self.rounding_lr


def check_scheme(scheme: QuantScheme, name: str = "weight") -> None:
    """ValueError for a scheme AutoRound cannot learn: GGUF grids, fp8, one scale per tensor."""
    if scheme.grid != "uniform":
        raise ValueError(f"{name}: autoround runs on the integer grids (int4 / int8, channel or group), not on "
                         f"GGUF's {scheme.grid}; use gptq (e.g. w4a16-gptq-{scheme.grid.replace('_', '')}) for GGUF grids")
    if scheme.type != "int":
        raise ValueError(f"{name}: autoround quantizes int weights, not {scheme.type}")
    if scheme.strategy == "tensor":
        raise ValueError(f"{name}: autoround needs channel or group scales, not one per tensor")


def _group_size(scheme: QuantScheme, k: int) -> int | None:
    return scheme.group_size if scheme.strategy == "group" else None


@dataclass
class RoundingParams:
    """The learned parameters of one linear.

    offset: fp32 [N, G, group] rounding offsets in [-0.5, 0.5] (a ragged last group padded);
    low, high: fp32 [N, G] multipliers of each group's min and max in [min_range, 1] (symmetric: high
      scales the absolute maximum, low is unused).
    """

    offset: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor

    @classmethod
    def init(cls, weight: torch.Tensor, scheme: QuantScheme) -> "RoundingParams":
        """Round-to-nearest on min-max ranges, for weight [N, K]."""
        wg = grouped_columns(weight.detach().float(), _group_size(scheme, weight.shape[1]))
        ones = torch.ones(wg.shape[:2], dtype=torch.float32, device=weight.device)
        return cls(torch.zeros_like(wg), ones.clone(), ones.clone())

    def tensors(self) -> list[torch.Tensor]:
        return [self.offset, self.low, self.high]

    def clone(self) -> "RoundingParams":
        return RoundingParams(*(t.detach().clone() for t in self.tensors()))

    def copy_(self, other: "RoundingParams") -> None:
        for mine, theirs in zip(self.tensors(), other.tensors()):
            mine.data.copy_(theirs)


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward."""
    return x + (torch.round(x) - x).detach()


def _ranges(wg: torch.Tensor, params: RoundingParams, scheme: QuantScheme, options: AutoRoundOptions):
    """(scale [N, G, 1], zero point [N, G, 1] float or None), differentiable in the multipliers."""
    wmin = wg.amin(dim=-1).clamp(max=0.0)
    wmax = wg.amax(dim=-1).clamp(min=0.0)
    if scheme.symmetric:
        amax = torch.maximum(-wmin, wmax) * params.high
        if options.symmetric_scale == "signed":
            divisor = torch.where(-wmin >= wmax, float(-scheme.qmin), float(scheme.qmax))
        elif options.symmetric_scale == "qmax":
            divisor = float(scheme.qmax)
        else:
            divisor = (scheme.qmax - scheme.qmin) / 2
        return (amax / divisor).clamp(min=_EPS).unsqueeze(-1), None
    low, high = wmin * params.low, wmax * params.high
    scale = ((high - low) / (scheme.qmax - scheme.qmin)).clamp(min=_EPS)
    zero = _round_ste(scheme.qmin - low / scale).clamp(scheme.qmin, scheme.qmax)
    return scale.unsqueeze(-1), zero.unsqueeze(-1)


def fake_quantize(weight: torch.Tensor, params: RoundingParams, scheme: QuantScheme,
                  options: AutoRoundOptions) -> torch.Tensor:
    """weight [N, K] -> fp32 [N, K] quantized and dequantized with the learned offsets and ranges; gradients
    reach params through the straight-through rounding."""
    n, k = weight.shape
    wg = grouped_columns(weight.detach().float(), _group_size(scheme, k))
    scale, zero = _ranges(wg, params, scheme, options)
    q = _round_ste(wg / scale + params.offset)
    if zero is not None:
        q = (q + zero).clamp(scheme.qmin, scheme.qmax) - zero
    else:
        q = q.clamp(scheme.qmin, scheme.qmax)
    return (q * scale).reshape(n, -1)[:, :k]


@torch.no_grad()
def signed_step(params: RoundingParams, rounding_lr: float, range_lr: float, options: AutoRoundOptions) -> None:
    """p -= lr * sign(grad) for each parameter with a gradient, then back into its bounds; clears the gradients."""
    offset, low, high = params.tensors()
    if offset.grad is not None:
        offset.sub_(rounding_lr * offset.grad.sign()).clamp_(-0.5, 0.5)
    if options.tune_ranges:
        for t in (low, high):
            if t.grad is not None:
                t.sub_(range_lr * t.grad.sign()).clamp_(options.min_range, 1.0)
    for t in (offset, low, high):
        t.grad = None


@torch.no_grad()
def quantized_weight(weight: torch.Tensor, params: RoundingParams, scheme: QuantScheme, options: AutoRoundOptions,
                     scale_dtype: torch.dtype | None = None) -> QuantizedWeight:
    """weight [N, K] with the learned params -> QuantizedWeight (scales rounded to scale_dtype first, as
    primitives.compute_qparams rounds them, and the integers taken against the stored scales)."""
    n, k = weight.shape
    wg = grouped_columns(weight.detach().float(), _group_size(scheme, k))
    wmin = wg.amin(dim=-1).clamp(max=0.0)
    wmax = wg.amax(dim=-1).clamp(min=0.0)
    # symmetric: one multiplier on both ends scales the absolute maximum, as in fake_quantize
    low = wmin * (params.high if scheme.symmetric else params.low)
    high = wmax * params.high
    scale, zero_point = _range_qparams(low, high, scheme, options.symmetric_scale, scale_dtype)
    q = torch.round(wg / scale.unsqueeze(-1) + params.offset)
    if zero_point is not None:
        q = q + zero_point.float().unsqueeze(-1)
    q = q.clamp(scheme.qmin, scheme.qmax).to(torch.int8).reshape(n, -1)[:, :k].contiguous()
    return QuantizedWeight(q, scale, zero_point, scheme)
