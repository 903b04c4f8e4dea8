"""GPTQ: quantize a weight column by column, pushing each column's error onto the columns not yet quantized.

Two verbs, both pure functions over tensors (the calibration runner schedules them):

- ``hessian_update(h, count, x)``: accumulate H = 2 XᵀX / n over calibration inputs, as a running
  mean in fp32 (the same matrix whatever the batching);
- ``factor_hessian(h, options)``: what the column walk needs of H (the Cholesky factor of its damped
  inverse, in visit order), once for all the linears that share an input;
- ``gptq_quantize(weight, hessian or factor, scheme, options)``: the quantized weight.

Algorithm (Frantar et al., "GPTQ", 2022), with the fixes later implementations converged on:

- dead inputs (diag(H) == 0: never active in calibration) get H_jj = 1 and their weights zeroed;
- relative damping: H += damp_percent * mean(diag H) * I, raised x10 (with a warning) while the
  Cholesky factorisation fails;
- act-order with *static groups*: columns are visited by decreasing diag(H), but each group's scale and
  zero point are computed up front from the columns of that group in the original order, so the
  checkpoint needs no reordering and no `g_idx` at inference (compressed-tensors records this as
  ``actorder: "weight"``, its alias "static"; its "group" ordering is the other kind, with a g_idx);
- lazy batch updates: the error of a block of ``block_size`` columns is applied to the rest of the
  matrix in one matmul;
- optionally (``observer: mse``) each group's range is shrunk by the factor that minimises its
  quantization error weighted by diag(H), the energy of each input (the `mse` option of the
  IST-DASLab quantizer and llm-compressor's MSE observer, weighted by the Hessian's diagonal), instead
  of the min-max range.

Without act-order, a group's scale is computed when the walk reaches the group's first column, from
that group's *updated* weights (the IST-DASLab code reads stale weights there when the group starts
inside a lazy block; we read the updated ones, so results do not depend on ``block_size``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

import torch

from ..gguf import grids
from ..core.primitives import check_range_options, compute_qparams, mse_clip_ratio
from ..core.quantized_weight import QuantizedWeight
from ..core.scheme import QuantScheme

MAX_DAMP_RETRIES = 6  # 0.01 -> 1e4 in x10 steps


class CholeskyWarning(UserWarning):
    """The Hessian was not positive definite at the requested damping; damping was raised."""


@dataclass(frozen=True)
class GPTQOptions:
    """Options of the `gptq` algorithm (recipe: ``algorithm: {name: gptq, ...}``).

    damp_percent: damping added to diag(H), relative to mean(diag(H)); raised x10 automatically
      (with a warning) while the Cholesky factorisation fails.
    block_size: columns per lazy batch update (a multiple of the group size when groups are used).
    act_order: visit columns by decreasing activation energy diag(H) (static groups: no g_idx).
    symmetric_scale: symmetric schemes' scale rule, absmax / qmax ("qmax", int4: /7) or absmax / half the
      signed range ("half_range", int4: /7.5, the top value clipped to 7: llm-compressor's convention).
    observer: how a group's range is chosen: "minmax" (its min and max) or "mse" (shrunk by the factor
      1 - i/mse_grid, i <= mse_max_shrink * mse_grid, with the least diag(H)-weighted squared error; on the
      q4_k grid, llama.cpp's importance-weighted search with diag(H) as the importance).
    moe_calibrate_all_experts: mixture-of-experts models: each expert's statistics come from every
      calibration token (as llm-compressor's default); False: only from the tokens routed to it. The
      block's output always follows the router's choice.
    """

    damp_percent: float = 0.01
    block_size: int = 128
    act_order: bool = True
    symmetric_scale: str = "qmax"
    observer: str = "minmax"
    mse_grid: int = 100
    mse_max_shrink: float = 0.8
    moe_calibrate_all_experts: bool = True

    def __post_init__(self) -> None:
        if not (0.0 < self.damp_percent <= 1.0):
            raise ValueError(f"damp_percent must be in (0, 1], got {self.damp_percent}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be a positive number of columns, got {self.block_size}")
        check_range_options(self.symmetric_scale, self.observer, self.mse_grid, self.mse_max_shrink)


# -- verb 1: statistics -------------------------------------------------------------------------


def hessian_update(h: torch.Tensor | None, count: int, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Fold inputs x into the running mean H = 2 XᵀX / n.

    h: fp32 [K, K] or None (start); count: rows seen so far; x: [..., K] inputs of the linear.
    returns: (fp32 [K, K], new count). Accumulates in fp32 whatever x's dtype.
    """
    x = x.reshape(-1, x.shape[-1]).float()  # [M, K]
    m, k = x.shape
    if h is None:
        h = torch.zeros(k, k, dtype=torch.float32, device=x.device)
    if m == 0:
        return h, count
    total = count + m
    h.mul_(count / total)
    x = x * math.sqrt(2.0 / total)
    h.addmm_(x.t(), x)
    return h, total


# -- verb 2: quantize ---------------------------------------------------------------------------


def _damped_cholesky_inverse(h: torch.Tensor, damp_percent: float, where: str) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor U of (H + damp*I)^-1 (so that Uᵀ U = H^-1), raising damping on failure.

    h: [K, K] symmetric PSD, damped *in place* (the caller's working copy). At most three [K, K]
    matrices are alive at once. returns (U [K, K], damp_percent actually used).
    """
    diag = h.diagonal()
    undamped = diag.clone()  # [K]
    mean_diag = torch.mean(undamped).item()
    damp = damp_percent
    for attempt in range(MAX_DAMP_RETRIES + 1):
        diag.copy_(undamped + damp * mean_diag)
        l, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(l)
            del l
            u, info = torch.linalg.cholesky_ex(hinv, upper=True)
            del hinv
            if int(info) == 0 and torch.isfinite(u).all():
                return u, damp
        if attempt < MAX_DAMP_RETRIES:
            warnings.warn(
                f"{where}: Hessian not positive definite with damp_percent={damp:g}; retrying with {damp * 10:g}",
                CholeskyWarning, stacklevel=3,
            )
            damp *= 10
    raise RuntimeError(
        f"{where}: the Hessian stays singular even with damp_percent={damp:g}; the calibration inputs of this "
        f"layer are degenerate: use more or more varied calibration data, or quantize it with RTN (ignore it)"
    )


def _quantize_column(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme):
    """w, scale, zero: [N]. returns (int q [N] as float, dequantized [N]) in w's dtype."""
    q = torch.round(w / scale)
    if zero is not None:
        q = q + zero
    q = q.clamp(scheme.qmin, scheme.qmax)
    deq = (q - zero) * scale if zero is not None else q * scale
    return q, deq


def _qparams(w: torch.Tensor, energy: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype | None,
             options: GPTQOptions):
    """qparams of w [N, Kw] in `scheme`'s groups: (scale [N, G], zero [N, G] or None), fp32.

    energy: [Kw] diag(H) of those columns (weights the error of the "mse" observer).
    scale_dtype: round scales to the storage dtype first, so the error GPTQ compensates is the real one.
    """
    rule = dict(symmetric_scale=options.symmetric_scale, scale_dtype=scale_dtype)
    clip = None
    if options.observer == "mse":
        clip = mse_clip_ratio(w, scheme, importance=energy, grid=options.mse_grid,
                              max_shrink=options.mse_max_shrink, **rule)  # [N, G]
    scale, zero = compute_qparams(w, scheme, clip_ratio=clip, **rule)
    return scale, (zero.float() if zero is not None else None)




@dataclass
class HessianFactor:
    """What GPTQ needs of a layer's Hessian, computed once for all the linears that read the same input
    (q/k/v, gate/up): each then walks its columns with it, and the [K, K] Hessian itself can go.

    u: upper Cholesky factor of the damped H^-1, rows and columns in visit order [K, K];
    dead: inputs never active in calibration (diag H == 0) [K] bool, their weights zeroed;
    energy: diag(H), dead inputs set to 1, original order [K]; perm: the visit order (act_order) or None.
    """

    u: torch.Tensor
    dead: torch.Tensor
    energy: torch.Tensor
    perm: torch.Tensor | None


def factor_hessian(hessian: torch.Tensor, options: GPTQOptions = GPTQOptions(), *, name: str = "weight",
                   dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                   overwrite: bool = False) -> HessianFactor:
    """The HessianFactor of `hessian` [K, K] (hessian_update), in `dtype` on `device` (default: the Hessian's).

    overwrite: the caller hands the matrix over (it is damped and permuted in place, and must not be used
    afterwards): one [K, K] copy less, which at a 14336-wide down_proj is 0.8 GB. At most three [K, K]
    matrices are alive at once.
    """
    k = hessian.shape[0]
    if hessian.dim() != 2 or hessian.shape[1] != k:
        raise ValueError(f"{name}: the Hessian must be square [K, K], got shape {tuple(hessian.shape)}")
    if not torch.isfinite(hessian).all():
        raise ValueError(f"{name}: the Hessian has NaN/Inf entries: the calibration activations overflowed")
    h = hessian.detach().to(dtype=dtype, device=device or hessian.device)
    if not overwrite and h.data_ptr() == hessian.data_ptr():
        h = h.clone()
    del hessian
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    energy = torch.diag(h).clone()  # [K], original order
    perm = torch.argsort(energy, descending=True) if options.act_order else None
    if perm is not None:
        h = h[perm]
        h = h[:, perm]
    u = _damped_cholesky_inverse(h, options.damp_percent, name)[0]  # [K, K] upper
    return HessianFactor(u, dead, energy, perm)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor | HessianFactor,
    scheme: QuantScheme,
    options: GPTQOptions = GPTQOptions(),
    *,
    scale_dtype: torch.dtype | None = None,
    name: str = "weight",
) -> QuantizedWeight | grids.GridWeight:
    """GPTQ-quantize one linear weight.

    weight: float [N, K] (out, in); hessian: [K, K] = 2 XᵀX / n of the layer's inputs (hessian_update), or
    its HessianFactor (factor_hessian with the same options), shared by the linears of one input.
    scale_dtype: dtype the scales are stored in (the model dtype); scales are rounded to it before use.
    Math runs in fp32 (fp64 if weight and hessian are fp64). Inputs are not modified.
    returns: QuantizedWeight (q int8 [N, K], scale fp32 [N, G], zero_point int32 [N, G] | None), columns in
    the original order whatever act_order. On a GGUF grid (gguf.types.GRID_TYPES) a grids.GridWeight: its fields
    are chosen up front from the whole weight (a K-quant super-block spans 8 or 16 groups), each column is
    rounded onto them; with the "mse" observer, the K-quants' and Q5_0's come from llama.cpp's
    importance-weighted search with diag(H) as the importance (llama.cpp's importance matrix is the same
    mean of x^2 per input).
    """
    if weight.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if isinstance(hessian, HessianFactor):
        factor = hessian
        if tuple(factor.u.shape) != (k, k):
            raise ValueError(f"{name}: Hessian factor of shape {tuple(factor.u.shape)} does not match in_features {k}")
        dtype = factor.u.dtype
    else:
        if tuple(hessian.shape) != (k, k):
            raise ValueError(f"{name}: Hessian shape {tuple(hessian.shape)} does not match in_features {k}")
        dtype = torch.float64 if (weight.dtype == torch.float64 and hessian.dtype == torch.float64) else torch.float32
        factor = factor_hessian(hessian, options, name=name, dtype=dtype, device=weight.device)
    u, dead, energy, perm = factor.u, factor.dead, factor.energy, factor.perm
    w = weight.detach().to(dtype).clone()  # [N, K]
    groups = scheme.groups_for(k)
    group_size = scheme.group_size if scheme.strategy == "group" else k  # the last group may be shorter (ragged)
    w[:, dead] = 0.0

    # Channel-wise and static-group parameters come from the (dead-zeroed) weight in its original order.
    scales = torch.zeros(n, groups, dtype=dtype, device=w.device)  # [N, G]
    zeros = None if scheme.symmetric else torch.zeros(n, groups, dtype=dtype, device=w.device)
    grid = grids.GRID_WEIGHTS.get(scheme.grid)  # static too: a super-block's fields span eight groups
    static = scheme.strategy == "channel" or perm is not None or grid is not None
    if grid is not None:
        fields = grid.choose_fields(w.float(), search=options.observer == "mse", importance=energy)
        step, minimum = grid.steps(*fields)
        scales.copy_(step)
        minimums = minimum.to(dtype)  # [N, G]
    elif static:
        s, z = _qparams(w, energy, scheme, scale_dtype, options)  # [N, G]
        scales.copy_(s)
        if zeros is not None:
            zeros.copy_(z)
    else:  # each group's parameters from its updated columns, when the walk reaches the group
        one_group = dataclasses.replace(scheme, strategy="channel", group_size=None, actorder=None)

    if perm is not None:
        w = w[:, perm]
    column_group = (perm if perm is not None else torch.arange(k, device=w.device)) // group_size  # [K]

    block = options.block_size
    if not static and block % group_size:
        block = max(group_size, (block // group_size) * group_size)
    # The walk runs on transposed copies ([K, N] weights, [G, N] scales): each column is a contiguous row.
    wt = w.t().contiguous()  # [K, N] (visit order)
    del w
    q_t = torch.zeros(k, n, dtype=dtype, device=wt.device)  # [K, N] (visit order)
    scales_t = scales.t().contiguous()  # [G, N]
    zeros_t = zeros.t().contiguous() if zeros is not None else None
    minimums_t = minimums.t().contiguous() if grid is not None else None
    groups_of = column_group.tolist()
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = wt[i1:i2].clone()  # [B, N]
        err1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]  # [B, B]
        for i in range(i2 - i1):
            col = i1 + i
            g = groups_of[col]
            if not static and col % group_size == 0:
                s, z = _qparams(w1[i:i + group_size].t(), energy[col:col + group_size], one_group, scale_dtype, options)
                scales_t[g] = s[:, 0]
                if zeros_t is not None:
                    zeros_t[g] = z[:, 0]
            if grid is not None:
                q = grid.quantize_onto(w1[i], scales_t[g].float(), minimums_t[g].float()).to(dtype)
                deq = q * scales_t[g] - minimums_t[g]
            else:
                q, deq = _quantize_column(w1[i], scales_t[g], zeros_t[g] if zeros_t is not None else None, scheme)
            q_t[col] = q
            err = (w1[i] - deq) / u1[i, i]  # [N]
            w1[i:] -= u1[i, i:].unsqueeze(1) * err.unsqueeze(0)
            err1[i] = err
        wt[i2:] -= (err1.t() @ u[i1:i2, i2:]).t()
    q_int = q_t.t()  # [N, K] (visit order)
    scales = scales_t.t()
    zeros = zeros_t.t() if zeros_t is not None else None

    if perm is not None:
        q_int = q_int[:, torch.argsort(perm)]
    if grid is not None:
        return grid(q_int.to(torch.uint8), *fields, scheme=scheme)
    if perm is not None and scheme.strategy == "group":
        # recorded as compressed-tensors does; per-channel stays null (compressed-tensors < 0.16 refuses it there)
        scheme = dataclasses.replace(scheme, actorder="weight")
    return QuantizedWeight(
        q=q_int.to(torch.int8),
        scale=scales.float(),
        zero_point=zeros.to(torch.int32) if zeros is not None else None,
        scheme=scheme,
    )
