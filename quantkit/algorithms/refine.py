"""GPTQ's levels, and a GGUF grid's fields, refined by coordinate descent on GPTQ's own objective: the
`refine_sweeps` and `refine_fields` options of gptq (refine_fields, at the end of this file, has its own notes).

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

import dataclasses
from dataclasses import dataclass

import torch

from ..core.quantized_weight import Quantized


@dataclass
class Refinement:
    """What refine_levels (refine_fields) did: the refined weight, how many levels (fields) moved, and the
    objective sum over rows of (Ŵ - W) H (Ŵ - W)ᵀ before and after (fp64 sums of the fp32 terms)."""

    weight: Quantized
    moved: int
    error_before: float
    error_after: float


def _checked(qweight: Quantized, weight: torch.Tensor, hessian: torch.Tensor, who: str):
    """(qweight's LevelGrid, weight fp32 [N, K], hessian fp32 [K, K]); ValueError where the shapes disagree."""
    grid = qweight.level_grid()
    n, k = grid.levels.shape
    if tuple(hessian.shape) != (k, k) or tuple(weight.shape) != (n, k):
        raise ValueError(f"{who}: weight {tuple(weight.shape)} and Hessian {tuple(hessian.shape)} do not "
                         f"match levels [{n}, {k}]")
    return grid, weight.detach().float(), hessian.float()


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
    grid, w, h = _checked(qweight, weight, hessian, "refine_levels")
    n, k = grid.levels.shape
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


def _best_step(a: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The objective along one direction per row: a [N, C] the weight change of one unit on C columns, g [N, C]
    the half-gradient there, h [C, C] their Hessian -> (slope a . g, curvature a H a, best real step
    t* = -slope / curvature; 0 where the curvature is 0), each fp32 [N]. A step of t changes the row's
    objective by 2 t slope + t^2 curvature."""
    curvature = ((a @ h) * a).sum(-1)
    slope = (a * g).sum(-1)
    positive = curvature > 0
    t = torch.where(positive, -slope / torch.where(positive, curvature, torch.ones_like(curvature)),
                    torch.zeros_like(curvature))
    return slope, curvature, t


@torch.no_grad()
def refine_fields(qweight: Quantized, weight: torch.Tensor, hessian: torch.Tensor) -> Refinement:
    """One sweep of coordinate descent over the fields of a GGUF grid's groups and super-blocks, its levels fixed.

    A GGUF grid's fields were chosen before GPTQ's walk, from the float weight: they are no longer the best for
    the levels GPTQ then picked. On the K-quant and IQ4_XS grids a group's step is a super-block float times a
    small integer (Q2_K's 4-bit sc_j, Q3_K's 6-bit signed one, ...), and on Q2_K-Q5_K its minimum likewise
    (dmin * mn_j). The sweep visits every group in turn and moves each row's integer field to the value that
    minimises the same objective as refine_levels with everything else fixed: the weight change of one unit of
    the field is a = factor * v on the group's columns (v: the level's value less the grid's OFFSET for a step,
    -1 for a minimum), so the error of row r changes by 2 t (a . G) + t^2 a H a for a change of t units, least
    at the integer nearest t* = -(a . G) / (a H a), clamped to the field's range (grids' integer_fields). Then
    every block's fp16 floats (grids' float_fields: the K-quants' d and dmin, whose unit moves column c by its
    group's integer times v_c; Q4_0's, Q8_0's and IQ4_NL's d; Q4_1's d and m): the best real change, rounded
    to fp16, kept where it lowers the objective. No move raises the objective.

    qweight: a GGUF grid weight (quantkit.gguf.grids; a weight on an integer grid, which has neither, is
    returned as it is);
    weight: the float weight [N, K]; hessian: fp32 [K, K] (as refine_levels).
    Refinement.moved counts the fields moved, integers and floats.
    """
    grid, w, h = _checked(qweight, weight, hessian, "refine_fields")
    n, k = grid.levels.shape
    e = qweight.dequantize() - w
    g = e @ h  # [N, K]
    before = _error(e, g)
    specs = getattr(qweight, "integer_fields", tuple)()
    float_specs = getattr(qweight, "float_fields", tuple)()
    if not specs and not float_specs:
        return Refinement(qweight, 0, before, before)
    group, block = qweight.GROUP, qweight.BLOCK
    values = qweight.level_values(qweight.u) - (qweight.OFFSET or 0)  # [N, K]

    def per_unit(role: str, cols: slice) -> torch.Tensor:
        """[N, C]: the weight change on `cols` of one unit of a field before its multiplier: v for a scale, -1
        for a minimum, +1 for an offset (grids.float_fields)."""
        if role == "scale":
            return values[:, cols]
        return torch.full_like(values[:, cols], -1.0 if role == "minimum" else 1.0)

    ints = {name: getattr(qweight, name).clone() for name, *_ in specs}
    floats = {name: getattr(qweight, name).clone() for name, *_ in float_specs}
    moved = 0
    for j in range(k // group):
        cols = slice(j * group, (j + 1) * group)
        for name, factor, role, lo, hi in specs:
            a = floats[factor][:, j * group // block].float().unsqueeze(1) * per_unit(role, cols)  # [N, group]
            _, _, t = _best_step(a, g[:, cols], h[cols, cols])
            current = ints[name][:, j].float()
            change = (current + torch.round(t)).clamp_(lo, hi) - current  # [N] whole numbers
            if bool(change.any()):
                moved += int((change != 0).sum())
                ints[name][:, j] = (current + change).to(ints[name].dtype)
                g.addmm_(change.unsqueeze(1) * a, h[cols])  # G follows the group's change
    for sb in range(k // block):
        cols = slice(sb * block, (sb + 1) * block)
        for name, role, integer in float_specs:
            a = per_unit(role, cols)  # [N, block]
            if integer is not None:
                per_group = ints[integer][:, sb * block // group:(sb + 1) * block // group].float()
                a = per_group.repeat_interleave(group, 1) * a
            slope, curvature, t = _best_step(a, g[:, cols], h[cols, cols])
            current = floats[name][:, sb]
            target = (current.float() + t).to(current.dtype)
            change = target.float() - current.float()
            falls = torch.isfinite(change) & (2 * change * slope + change * change * curvature < 0)
            change = torch.where(falls, change, torch.zeros_like(change))
            if bool(change.any()):
                moved += int((change != 0).sum())
                floats[name][:, sb] = (current.float() + change).to(current.dtype)
                g.addmm_(change.unsqueeze(1) * a, h[cols])
    refined = dataclasses.replace(qweight, **ints, **floats)
    after = _error(refined.dequantize() - w, g)
    return Refinement(refined, moved, before, after)
