"""GPTQ's levels refined by coordinate descent on GPTQ's own objective: the `refine_sweeps` option of gptq.

GPTQ minimises each linear's output error on its calibration inputs, tr((Ŵ - W) H (Ŵ - W)ᵀ) with H = 2 XᵀX / n,
in one pass: each column is rounded once, with the columns after it still free to absorb its error, and
never revisited. Its result is therefore not the best level of any column given all the others. A sweep of
coordinate descent (CDQuant, Nair and Suggala 2024, starts greedy coordinate descent from GPTQ's result; this
is its cyclic form) visits every column in turn and
moves each row's level in it to the one that minimises the same objective with every other weight fixed:
with E = Ŵ - W and G = E H (the objective's half-gradient), changing weight (r, j) by d changes the error
of row r by 2 d G[r, j] + d² H[j, j], least at the level nearest d* = -G[r, j] / H[j, j], clamped to the grid
(on a non-uniform grid, IQ4_NL / IQ4_XS, the level whose value is nearest: LevelGrid.moved).
Each move lowers the objective or leaves it, so a sweep never undoes GPTQ's gains; rows are independent, so
a column's rows move together, and G follows the moves of a block of columns in one matrix product, as
GPTQ's lazy updates do.

The grids stay GPTQ's (scales, zero points, a GGUF grid's fields): only levels move, so every weight type
with a LevelGrid view (core.quantized_weight.Quantized) is refined the same way. Cost per sweep: one
[N, K] x [K, K] product for G plus, per column, one [N] update and a rank-1 update of the block's G:
about what GPTQ's own walk costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.quantized_weight import Quantized


@dataclass
class Refinement:
    """What refine_levels did: the refined weight, how many levels moved off GPTQ's, and the objective
    sum over rows of (Ŵ - W) H (Ŵ - W)ᵀ before and after (fp64 sums of the fp32 terms)."""

    weight: Quantized
    moved: int
    error_before: float
    error_after: float


def _error(e: torch.Tensor, g: torch.Tensor) -> float:
    return float((e.double() * g.double()).sum())


@torch.no_grad()
def refine_levels(qweight: Quantized, weight: torch.Tensor, hessian: torch.Tensor, sweeps: int = 1,
                  block_size: int = 128) -> Refinement:
    """`sweeps` sweeps of coordinate descent over the levels of `qweight` (its grid fixed).

    weight: the float weight [N, K] it quantizes; hessian: fp32 [K, K], 2 XᵀX / n of the linear's inputs
    (columns with H[j, j] == 0, inputs calibration never reached, are left as they are).
    block_size: columns whose moves are applied to G together (the result does not depend on it beyond
    float rounding).
    """
    grid = qweight.level_grid()
    n, k = grid.levels.shape
    if tuple(hessian.shape) != (k, k) or tuple(weight.shape) != (n, k):
        raise ValueError(f"refine_levels: weight {tuple(weight.shape)} and Hessian {tuple(hessian.shape)} do not "
                         f"match levels [{n}, {k}]")
    h = hessian.float()
    w = weight.detach().float()
    levels = grid.levels.clone()
    step = grid.scale[:, grid.column_group]  # [N, K]: the weight change of one level (of one unit of value)
    diag = h.diagonal()
    live = (diag > 0).tolist()
    e = grid.dequantize(levels) - w  # [N, K]
    g = e @ h
    before = _error(e, g)
    for sweep in range(sweeps):
        if sweep:  # afresh, so that float drift in the running updates does not accumulate over sweeps
            g = (grid.dequantize(levels) - w) @ h
        for b0 in range(0, k, block_size):
            b1 = min(b0 + block_size, k)
            gb = g[:, b0:b1].clone()  # [N, B], kept current within the block
            moves = torch.zeros(n, b1 - b0, dtype=torch.float32, device=w.device)  # [N, B] weight changes
            hb = h[b0:b1, b0:b1]
            for j in range(b1 - b0):
                c = b0 + j
                if not live[c]:
                    continue
                s = step[:, c]
                target = -gb[:, j] / (diag[c] * torch.where(s != 0, s, torch.ones_like(s)))  # in units of the step
                moved = grid.moved(levels[:, c], target)
                d = torch.where(s != 0, (grid.value(moved) - grid.value(levels[:, c])) * s, torch.zeros_like(s))  # [N]
                levels[:, c] = torch.where(s != 0, moved, levels[:, c])
                moves[:, j] = d
                gb.addr_(d, hb[j])
            g.addmm_(moves, h[b0:b1])  # every column's G follows the block's moves
    after = _error(grid.dequantize(levels) - w, g)  # g has followed every move: no further [N, K] x [K, K] product
    return Refinement(qweight.with_levels(levels), int((levels != grid.levels).sum()), before, after)
