"""AWQ: activation-aware weight scaling, then a clipping search, then round-to-nearest.

Pure functions over tensors (Lin et al., "AWQ", 2023); the calibration runner decides which linears
share a scale, runs the sub-block forwards the search compares, and folds the scales into the model:

- per input channel k, s_k = mean|x_k|^a (divided by mean|w_k|^(1-a) with ``duo_scaling``, where |w| is
  relative to its group's maximum, as in AutoAWQ and llm-compressor), normalised so that
  max(s) * min(s) = 1, for a on a grid in [0, 1); the candidate whose scaled-and-quantized weights give
  the least output error wins. s = 1 (plain RTN) is always a candidate, so the search never does worse
  than RTN on the data it sees. The weight columns are multiplied by s and 1/s is folded into whatever
  produces the input (a norm's weight or the previous linear's rows);
- per output row and group, the range is shrunk by the factor r in {1, 1 - 1/grid, ...} (down to
  1 - max_shrink) that minimises the error of that group's partial dot products over the inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..gguf.grids import GridWeight, grid_weight
from ..core.primitives import compute_qparams, fake_quantize, grouped_columns, quantize
from ..core.quantized_weight import QuantizedWeight
from ..core.scheme import QuantScheme

_MIN_SCALE = 1e-4
_CLIP_CHUNK_ELEMENTS = 1 << 24  # fp32 elements of [G, M, n] partial outputs per chunk of output rows (64 MiB)


@dataclass(frozen=True)
class AWQOptions:
    """Options of the `awq` algorithm (recipe: ``algorithm: {name: awq, ...}``).

    grid: number of exponents a in {0, 1/grid, ..., (grid-1)/grid} tried for the scales.
    duo_scaling: scales from activations *and* weights, mean|x|^a / mean|w|^(1-a) (else mean|x|^a).
    clip: run the clipping search after scaling.
    clip_grid, max_shrink: shrink factors 1 - i/clip_grid for i < max_shrink * clip_grid.
    max_search_tokens: calibration tokens (evenly subsampled) the scale search evaluates on.
    clip_tokens: tokens (a subsample of those) the clipping search evaluates on.
    block_outputs: score q/k/v candidates by the attention's output (as AutoAWQ and llm-compressor do), from
      forwards through the block on the first max_search_tokens tokens, instead of by the q/k/v outputs. Off
      by default: on SmolLM2-135M it gave a slightly higher KL (0.363 vs 0.347) and took 7% longer.
    moe_calibrate_all_experts: mixture-of-experts models: each expert's clipping search sees every
      calibration token; False: only the tokens routed to it (the block's output follows the router).
    """

    grid: int = 20
    duo_scaling: bool = True
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    max_search_tokens: int = 4096
    clip_tokens: int = 1024
    block_outputs: bool = False
    moe_calibrate_all_experts: bool = True

    def __post_init__(self) -> None:
        if self.grid < 1 or self.clip_grid < 1:
            raise ValueError(f"grid and clip_grid must be >= 1, got {self.grid} and {self.clip_grid}")
        if not (0.0 <= self.max_shrink < 1.0):
            raise ValueError(f"max_shrink must be in [0, 1), got {self.max_shrink}")
        if self.max_search_tokens < 1 or self.clip_tokens < 1:
            raise ValueError("max_search_tokens and clip_tokens must be positive token counts")


def mean_abs_update(mean: torch.Tensor | None, count: int, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Running mean of |x| per input channel. x: [..., K]; returns (fp32 [K], tokens seen)."""
    x = x.reshape(-1, x.shape[-1]).float()  # [M, K]
    m = x.shape[0]
    if mean is None:
        mean = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
    if m == 0:
        return mean, count
    total = count + m
    mean.mul_(count / total).add_(x.abs().sum(dim=0), alpha=1.0 / total)
    return mean, total


def weight_channel_mean(weights: list[torch.Tensor], group_size: int | None) -> torch.Tensor:
    """Mean over output rows of |w| relative to its group's max, per input channel.

    weights: [N_i, K] each (the linears sharing one input); group_size: None for one group of K; the last
    group may be shorter (ragged). returns fp32 [K].
    """
    w = torch.cat([x.float() for x in weights], dim=0)  # [N, K]
    n, k = w.shape
    wg = grouped_columns(w.abs(), group_size)  # [N, G, group] (a ragged last group padded with zeros)
    wg = wg / (wg.amax(dim=-1, keepdim=True) + 1e-6)
    return wg.reshape(n, -1)[:, :k].mean(dim=0)


def channel_scales(x_mean: torch.Tensor, ratio: float, w_mean: torch.Tensor | None = None) -> torch.Tensor:
    """s = mean|x|^ratio (/ mean|w|^(1-ratio) when w_mean is given), normalised so that max(s) * min(s) = 1.

    x_mean, w_mean: [K] -> fp32 [K].
    """
    s = x_mean.float().clamp(min=_MIN_SCALE).pow(ratio)
    if w_mean is not None:
        s = (s / (w_mean.float().pow(1 - ratio) + _MIN_SCALE)).clamp(min=_MIN_SCALE)
    return s / (s.max() * s.min()).sqrt()


def search_scales(
    x_mean: torch.Tensor, loss: Callable[[torch.Tensor], float], grid: int = 20, w_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float | None, list[float]]:
    """Grid search of the scale exponent.

    x_mean: [K] mean |x| per input channel; loss(s [K]) -> output error with scales s; w_mean: [K] for duo
    scaling (weight_channel_mean), or None.
    returns: (best s fp32 [K], its exponent (None when s = 1 won), the losses: s = 1 first, then each
    exponent of the grid).
    """
    ones = torch.ones_like(x_mean, dtype=torch.float32)
    best_s, best_ratio = ones, None
    best = float(loss(ones))
    losses = [best]
    for i in range(grid):
        ratio = i / grid
        s = channel_scales(x_mean, ratio, w_mean)
        value = float(loss(s))
        losses.append(value)
        if value < best:
            best, best_ratio, best_s = value, ratio, s
    if best != best:  # NaN: every candidate failed
        raise ValueError("AWQ scale search: the output error is NaN; the calibration activations are not finite")
    return best_s, best_ratio, losses


def scaled_effective_weight(
    w: torch.Tensor, s: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The weight a layer effectively applies to its *unscaled* input after AWQ scaling: Q(w * s) / s.

    w: [N, K]; s: [K]. returns fp32 [N, K].
    """
    s = s.float()
    return fake_quantize(w.float() * s, scheme, scale_dtype=scale_dtype) / s


def search_clip(
    w: torch.Tensor, x: torch.Tensor, scheme: QuantScheme, *, grid: int = 20, max_shrink: float = 0.5,
    scale_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per (output row, group) range shrink factor minimising the error of the group's partial outputs.

    w: [N, K] (already scaled); x: [M, K] inputs seen by w. returns fp32 [N, G] factors in (0, 1].
    """
    n, k = w.shape
    g = scheme.groups_for(k)
    group_size = scheme.group_size if scheme.strategy == "group" else None
    w = grouped_columns(w.float(), group_size)  # [N, G, gs]: a ragged last group padded with zeros (adding nothing)
    gs = w.shape[-1]
    w = w.reshape(n, g * gs)
    xg = grouped_columns(x.float().reshape(-1, k), group_size).transpose(0, 1)  # [G, M, gs]
    m = xg.shape[1]
    ratios = [1.0 - i / grid for i in range(max(1, int(max_shrink * grid)))]
    best_ratio = torch.ones(n, g, dtype=torch.float32, device=w.device)
    chunk = max(1, _CLIP_CHUNK_ELEMENTS // max(1, g * m))
    for n0 in range(0, n, chunk):
        wc = w[n0:n0 + chunk]  # [n, K]
        ref = torch.bmm(xg, wc.reshape(-1, g, gs).permute(1, 2, 0))  # [G, M, n]
        best_err = torch.full((wc.shape[0], g), float("inf"), device=w.device)  # [n, G]
        for r in ratios:
            wq = fake_quantize(wc, scheme, clip_ratio=r, scale_dtype=scale_dtype)  # [n, K]
            out = torch.bmm(xg, wq.reshape(-1, g, gs).permute(1, 2, 0))  # [G, M, n]
            err = (out - ref).pow(2).mean(dim=1).t()  # [n, G]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_ratio[n0:n0 + chunk] = torch.where(better, torch.full_like(err, r), best_ratio[n0:n0 + chunk])
    return best_ratio


def awq_quantize(
    w: torch.Tensor, scheme: QuantScheme, clip_ratio: torch.Tensor | None = None,
    scale_dtype: torch.dtype | None = None,
) -> QuantizedWeight | GridWeight:
    """Round-to-nearest of the (already scaled) weight w [N, K] with per-group clip factors [N, G] (a
    grids.GridWeight on a GGUF grid)."""
    if scheme.grid != "uniform":
        return grid_weight(w.float(), scheme, clip_ratio=clip_ratio)
    scale, zero = compute_qparams(w.float(), scheme, clip_ratio=clip_ratio, scale_dtype=scale_dtype)
    return QuantizedWeight(quantize(w.float(), scale, zero, scheme), scale, zero, scheme)
