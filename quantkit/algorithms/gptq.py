"""GPTQ: quantize a weight column by column, pushing each column's error onto the columns not yet quantized.

Two verbs, both pure functions over tensors (the calibration runner schedules them):

- ``HessianSum``: accumulate H = 2 XᵀX / n over calibration inputs, window by window into an fp64 sum
  (the same matrix whatever the batching and the number of processes);
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
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..gguf import grids
from ..kernels import cpu_extension
from ..core.finite import count_nonfinite
from ..core.primitives import check_range_options, compute_qparams, mse_clip_ratio
from ..core.quantized_weight import QuantizedWeight
from ..core.scheme import QuantScheme
from .refine import refine_fields, refine_levels

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
    shrinkage: rho in [0, 1): H is replaced by (1 - rho) H + rho diag(H), its off-diagonal terms (how inputs
      co-vary in the calibration text) shrunk toward 0, before GPTQ and the refinement use it; 0: H as measured.
      A shrunk covariance is the better estimate when calibration tokens are few against K or come from
      another text than the model later reads (evals/quality/frontier/README.md measures both).
    refine_sweeps: sweeps of coordinate descent over the levels GPTQ chose, on GPTQ's own objective
      (algorithms/refine.py: each weight's level moved to the best one with every other weight fixed); 0:
      GPTQ alone. Each sweep costs about one more column walk and keeps the [K, K] Hessian alive beside the
      factor.
    refine_fields: on a GGUF grid, each refinement sweep also moves its fields by coordinate descent on the
      same objective, after the levels: the integer ones per group (the K-quants' sub-block scales and
      minimums, IQ4_XS's scales), then the fp16 ones per block (refine.refine_fields); needs
      refine_sweeps >= 1. No effect on the integer grids.
    refine_shrinkage: rho in [shrinkage, 1) for the refinement's Hessian, (1 - rho) H + rho diag(H); None: the
      same as GPTQ's (shrinkage). Coordinate descent fits its objective more closely than GPTQ's one walk, so
      more of its gain on the calibration text comes from the off-diagonal terms that text estimates worst:
      on SmolLM2 (calibrated on the Python documentation, scored on licence texts) a late down_proj refined
      on 0.75 H + 0.25 diag(H) had 1.5x GPTQ's error on the licence texts' Hessian, refined on
      0.25 H + 0.75 diag(H) 0.65x. Where calibration and use are one text the measured off-diagonal terms are
      what the refinement gains by: on ref:small 0.75 raised the KL 1.2-1.7x at Q2_K-Q4_K_M, 3-4% at Q5_K
      (evals/quality/frontier/README.md). Needs refine_sweeps >= 1.
    """

    damp_percent: float = 0.01
    block_size: int = 128
    act_order: bool = True
    symmetric_scale: str = "qmax"
    observer: str = "minmax"
    mse_grid: int = 100
    mse_max_shrink: float = 0.8
    moe_calibrate_all_experts: bool = True
    shrinkage: float = 0.0
    refine_sweeps: int = 0
    refine_fields: bool = False
    refine_shrinkage: float | None = None

    def __post_init__(self) -> None:
        if not (0.0 < self.damp_percent <= 1.0):
            raise ValueError(f"damp_percent must be in (0, 1], got {self.damp_percent}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be a positive number of columns, got {self.block_size}")
        check_range_options(self.symmetric_scale, self.observer, self.mse_grid, self.mse_max_shrink)
        rho = self.shrinkage
        if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not (0.0 <= rho < 1.0):
            raise ValueError(f"shrinkage must be in [0, 1) (the weight of diag(H) in the shrunk Hessian), got {rho!r}")
        if isinstance(self.refine_sweeps, bool) or not isinstance(self.refine_sweeps, int) or self.refine_sweeps < 0:
            raise ValueError(f"refine_sweeps must be a whole number of sweeps, 0 or more, got {self.refine_sweeps!r}")
        if not isinstance(self.refine_fields, bool):
            raise ValueError(f"refine_fields must be true or false, got {self.refine_fields!r}")
        if self.refine_fields and not self.refine_sweeps:
            raise ValueError("refine_fields moves the fields in each refinement sweep: set refine_sweeps >= 1 too")
        r = self.refine_shrinkage
        if r is not None:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not (rho <= r < 1.0):
                raise ValueError(f"refine_shrinkage must be in [shrinkage, 1) = [{rho}, 1) (the weight of diag(H) in "
                                 f"the refinement's Hessian), got {r!r}")
            if not self.refine_sweeps:
                raise ValueError("refine_shrinkage shrinks the refinement's Hessian: set refine_sweeps >= 1 too")

    @property
    def refinement_shrinkage(self) -> float:
        """The weight of diag(H) in the Hessian the refinement sweeps use: refine_shrinkage, else shrinkage."""
        return self.shrinkage if self.refine_shrinkage is None else self.refine_shrinkage


# -- verb 1: statistics -------------------------------------------------------------------------


class HessianSum:
    """S = sum of XᵀX over a linear's calibration inputs, and H = 2 S / n, the same matrix whatever the
    batching of the windows and however many processes share them (calibration.distributed).

    Each window's XᵀX is computed on its own in fp32, by panels of PANEL rows and the lower triangle only (H
    is symmetric: half the products), and added into an fp64 sum: sums of fp32 terms in fp64 are exact or
    within 2^-53, so the order in which windows arrive or processes add their shares does not change the
    fp32 H. (A running fp32 mean rounds differently for every batching, and GPTQ's rounding decisions
    follow those roundings: two batchings of the same windows gave checkpoints differing in a third of
    their words.)

    Memory: the sum is held as its lower triangle in panels (panel i: fp64 rows r0..r1-1, columns 0..r1-1),
    the bytes of one fp32 [K, K] matrix; ``hessian()`` frees each panel once it is in H, so at most two
    fp32 [K, K] matrices' bytes are alive, as in the factorisation that follows.

    add(x): x [W, T, K] (W windows of T tokens; more leading dimensions are windows too) or [M, K] (taken
    as one unit). panels: the fp64 panels, or None before any input; count: rows seen.
    """

    PANEL = 512

    def __init__(self) -> None:
        self.panels: list[torch.Tensor] | None = None
        self.count = 0

    def start(self, k: int, device: torch.device | str | None = None) -> "HessianSum":
        """An all-zero sum of width k, if none yet (a process whose windows never reached this linear)."""
        if self.panels is None:
            ends = [min(r0 + self.PANEL, k) for r0 in range(0, k, self.PANEL)]
            self.panels = [torch.zeros(r1 - r0, r1, dtype=torch.float64, device=device)
                           for r0, r1 in zip([0] + ends[:-1], ends)]
        return self

    def add(self, x: torch.Tensor) -> "HessianSum":
        k = x.shape[-1]
        windows = x.reshape(-1, x.shape[-2], k) if x.dim() >= 3 else x.unsqueeze(0)  # [W, T, K]
        self.start(k, x.device)
        if windows.numel() == 0:
            return self
        for window in windows:
            window = window.float()  # [T, K]
            for panel in self.panels:
                rows, r1 = panel.shape  # rows r1 - rows .. r1 - 1
                r0 = r1 - rows
                # rows r0..r1-1 up to the diagonal block, in fp32, added in fp64 (the fp32 terms widen exactly)
                panel += window[:, r0:r1].t() @ window[:, :r1]
        self.count += windows.shape[0] * windows.shape[1]
        return self

    def hessian(self) -> torch.Tensor | None:
        """H = 2 S / n, fp32 [K, K] symmetric (None before any input); the sum is freed as H fills."""
        if self.panels is None:
            return None
        panels, self.panels = self.panels, None
        k = panels[-1].shape[1]
        h = torch.empty(k, k, dtype=torch.float32, device=panels[0].device)
        factor = 2.0 / max(self.count, 1)
        for i in range(len(panels)):
            rows, r1 = panels[i].shape
            r0 = r1 - rows
            h[r0:r1, :r1] = panels[i] * factor
            panels[i] = None  # freed
            h[:r0, r0:r1] = h[r0:r1, :r0].t()
            diagonal = h[r0:r1, r0:r1]
            diagonal.copy_(diagonal.tril() + diagonal.tril(-1).t())
        return h


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    """H = 2 XᵀX / n of inputs x [W, T, K] or [M, K] (HessianSum): fp32 [K, K]."""
    return HessianSum().add(x).hessian()


# -- verb 2: quantize ---------------------------------------------------------------------------


def lower_triangular_inverse(lower: torch.Tensor, block: int = 256) -> torch.Tensor:
    """L^-1 [K, K] (lower triangular, a new matrix) of a lower triangular L [K, K] (only its lower triangle is read).

    By row blocks of `block`: X_ii = L_ii^-1 (a small triangular solve), then the block row left of it
    X_i,<i = -X_ii (L_i,<i X_<i,<i), the product taken column block by column block over the lower triangle
    of X only, so the work is ~K³/3 multiply-adds in matrix products, where one triangular solve against the
    whole identity does K³ (at K = 5632 on one AMD EPYC Zen 4 core: 0.84 s against 1.88 s, relative errors
    against fp64 5.5e-8 and 5.2e-8). Memory: X and two [block, K] buffers; L's blocks are read in place
    (a triangular solve on a sub-matrix view of a column-major L would copy it whole).
    """
    k = lower.shape[0]
    inverse = torch.zeros(k, k, dtype=lower.dtype, device=lower.device)
    for r0 in range(0, k, block):
        r1 = min(k, r0 + block)
        eye = torch.eye(r1 - r0, dtype=lower.dtype, device=lower.device)
        diagonal_inverse = torch.linalg.solve_triangular(lower[r0:r1, r0:r1].contiguous(), eye, upper=False)
        inverse[r0:r1, r0:r1] = diagonal_inverse
        if r0:
            product = torch.empty(r1 - r0, r0, dtype=lower.dtype, device=lower.device)  # L_i,<i X_<i,<i
            for c0 in range(0, r0, block):
                c1 = min(r0, c0 + block)
                torch.mm(lower[r0:r1, c0:r0], inverse[c0:r0, c0:c1], out=product[:, c0:c1])
            inverse[r0:r1, :r0] = torch.mm(diagonal_inverse, product).neg_()
    return inverse


def _damped_inverse_factor(reversed_h: Callable[[], torch.Tensor], release: Callable[[], None], damp_percent: float,
                           where: str) -> tuple[torch.Tensor, float]:
    """Upper triangular U with Uᵀ U = (H + damp*I)^-1, raising damping while the factorisation fails.

    reversed_h(): a fresh copy of J H J ([K, K], H with its rows and columns in reverse order), factored in
    place; release(): called once the factorisation succeeded (the caller may free H then). If
    J H J = L Lᵀ (lower Cholesky), then H = V Vᵀ with V = J L J upper, and H^-1 = (V^-1)ᵀ V^-1, so
    U = V^-1 = J L^-1 J: one Cholesky factorisation and L's inverse (lower_triangular_inverse), where inverting
    H and factoring the inverse takes two factorisations and an inverse (measured 1.2-1.3x the time at
    K = 5632), and two [K, K] matrices alive at once, not three. returns (U [K, K], damp_percent actually used).

    Memory: two [K, K] matrices at most (H and its factor, then L and L^-1, then L^-1 and U; measured at
    K = 5632 in a 3-layer quantize, where three, for a moment nearly four, were alive before). The
    factorisation is given the column-major view of the symmetric copy (``f.mT``), the layout LAPACK writes:
    given the row-major ``f`` itself, ``cholesky_ex(out=f)`` factors a column-major copy and copies it back,
    a third matrix beside H and f. No view of L outlives it (the diagonal's kept L alive through the flip),
    and the overflow check reads U in slices (``torch.isfinite(u)`` holds |U| and three boolean masks: 1.75
    more [K, K]). U is bit for bit what the row-major factorisation gave.
    """
    damp = damp_percent
    for attempt in range(MAX_DAMP_RETRIES + 1):
        f = reversed_h()
        diag = f.diagonal()
        diag.add_(damp * torch.mean(diag).item())
        del diag  # a view: it would keep f (then L) alive through the flip below
        info = torch.empty((), dtype=torch.int32, device=f.device)
        lower = f.mT  # f is symmetric: the same matrix, column-major
        torch.linalg.cholesky_ex(lower, out=(lower, info))  # lower: L, in f's memory
        if int(info) == 0:
            release()
            inverse = lower_triangular_inverse(lower)  # L^-1
            del f, lower
            u = torch.flip(inverse, (0, 1))
            del inverse
            if count_nonfinite(u):  # in slices: no [K, K] mask
                raise RuntimeError(f"{where}: the inverse Hessian overflows at damp_percent={damp:g}: raise damp_percent "
                                   f"in the recipe's gptq options, or quantize this layer with RTN (ignore it)")
            return u, damp
        del f, lower
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




#: the C++ walk's rounding modes (kernels/csrc/gptq_walk.cpp's Mode)
_INT_SYMMETRIC, _INT_ZERO_POINT, _GRID_OFFSET, _GRID_MINIMUM, _GRID_VALUES = range(5)


def _column_walk(scheme: QuantScheme, grid, scales_t: torch.Tensor, zeros_t: torch.Tensor | None,
                 minimums_t: torch.Tensor | None, column_group: torch.Tensor):
    """The column walk inside one lazy block: walk(w1, u1, q1, err1, i1, a, b) quantizes the block's columns
    a..b-1 (block rows of w1 [B, N], the weights transposed, starting at column i1), writes their levels to
    q1 [B, N] and their scaled errors to err1 [B, N], and pushes each error onto the block's later columns.

    scales_t / zeros_t / minimums_t: [G, N], read when a column is reached; column_group: [K] the group of
    each column in visit order. On CPU in fp32 the C++ kernel (gptq_walk) runs it, bit for bit the pure-PyTorch
    loop (_walk_columns_reference), which runs elsewhere."""
    on_cpu = scales_t.dtype == torch.float32 and scales_t.device.type == "cpu"
    if on_cpu and cpu_extension.load_cpu_kernels().available:  # built on first use, cached
        values = None
        if grid is not None and grid.VALUES is not None:
            mode, values = _GRID_VALUES, grid.VALUES.contiguous()
            qmin, qmax, offset = 0.0, float(grid.LEVELS), 0.0
        elif grid is not None:
            mode = _GRID_OFFSET if grid.OFFSET is not None else _GRID_MINIMUM
            qmin, qmax, offset = 0.0, float(grid.LEVELS), float(grid.OFFSET or 0)
        else:
            mode = _INT_ZERO_POINT if zeros_t is not None else _INT_SYMMETRIC
            qmin, qmax, offset = float(scheme.qmin), float(scheme.qmax), 0.0
        groups = column_group.to(torch.int64)

        def kernel(w1, u1, q1, err1, i1, a, b):
            torch.ops.quantkit.gptq_walk(w1, u1, q1, err1, scales_t, zeros_t, minimums_t,
                                         groups[i1:i1 + w1.shape[0]], a, b, mode, qmin, qmax, offset, values)

        return kernel

    def reference(w1, u1, q1, err1, i1, a, b):
        _walk_columns_reference(w1, u1, q1, err1, scheme, grid, scales_t, zeros_t, minimums_t,
                                column_group[i1:i1 + w1.shape[0]].tolist(), a, b)

    return reference


def _walk_columns_reference(w1, u1, q1, err1, scheme, grid, scales_t, zeros_t, minimums_t, groups, a, b) -> None:
    """Pure PyTorch: columns a..b-1 of one block (see _column_walk; groups: the block's columns' groups)."""
    for i in range(a, b):
        g = groups[i]
        if grid is not None:
            q = grid.quantize_onto(w1[i], scales_t[g].float(), minimums_t[g].float()).to(w1.dtype)
            deq = grid.level_values(q).to(w1.dtype) * scales_t[g] - minimums_t[g]
        else:
            q, deq = _quantize_column(w1[i], scales_t[g], zeros_t[g] if zeros_t is not None else None, scheme)
        q1[i] = q
        err = (w1[i] - deq) / u1[i, i]  # [N]
        w1[i + 1:] -= u1[i, i + 1:].unsqueeze(1) * err.unsqueeze(0)
        err1[i] = err


@dataclass
class HessianFactor:
    """What GPTQ needs of a layer's Hessian, computed once for all the linears that read the same input
    (q/k/v, gate/up): each then walks its columns with it, and the [K, K] Hessian itself can go.

    u: upper Cholesky factor of the damped H^-1, rows and columns in visit order [K, K];
    dead: inputs never active in calibration (diag H == 0) [K] bool, their weights zeroed;
    energy: diag(H), dead inputs set to 1, original order [K]; perm: the visit order (act_order) or None;
    hessian: the Hessian the refinement uses [K, K], original order: H shrunk by options.refinement_shrinkage,
    kept only where the options refine GPTQ's levels (refine_sweeps).
    """

    u: torch.Tensor
    dead: torch.Tensor
    energy: torch.Tensor
    perm: torch.Tensor | None
    hessian: torch.Tensor | None = None


def factor_hessian(hessian: torch.Tensor, options: GPTQOptions = GPTQOptions(), *, name: str = "weight",
                   dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                   overwrite: bool = False) -> HessianFactor:
    """The HessianFactor of `hessian` [K, K] (HessianSum.hessian), in `dtype` on `device` (default: the Hessian's).

    overwrite: the caller hands the matrix over (it keeps no reference), so that it is freed as soon as the
    factorisation succeeded: at a 14336-wide down_proj one [K, K] matrix (0.8 GB) less while U is computed
    (unless options.refine_sweeps, which keeps H in the factor).
    `hessian` is never modified. At most two [K, K] matrices are alive at once besides a Hessian not handed over.
    """
    k = hessian.shape[0]
    if hessian.dim() != 2 or hessian.shape[1] != k:
        raise ValueError(f"{name}: the Hessian must be square [K, K], got shape {tuple(hessian.shape)}")
    if count_nonfinite(hessian):  # in slices: no [K, K] mask
        raise ValueError(f"{name}: the Hessian has NaN/Inf entries: the calibration activations overflowed")
    h = [hessian.detach().to(dtype=dtype, device=device or hessian.device)]
    if options.shrinkage or options.refinement_shrinkage:
        if not overwrite and h[0].data_ptr() == hessian.data_ptr():  # .to() made no copy: the caller's matrix
            h[0] = h[0].clone()
        diagonal = h[0].diagonal().clone()
        h[0].mul_(1.0 - options.shrinkage).diagonal().copy_(diagonal)  # (1 - rho) H + rho diag(H), in place
        del diagonal
    del hessian
    diagonal = h[0].diagonal()
    dead = diagonal == 0
    energy = torch.where(dead, torch.ones_like(diagonal), diagonal)  # [K], original order; dead inputs get 1
    del diagonal  # a view: it would keep the Hessian alive
    perm = torch.argsort(energy, descending=True) if options.act_order else None
    backwards = perm.flip(0) if perm is not None else torch.arange(k - 1, -1, -1, device=energy.device)

    def reversed_h() -> torch.Tensor:
        f = h[0][backwards[:, None], backwards]  # [K, K]: visit order, reversed
        f.diagonal()[dead[backwards]] = 1.0
        return f

    kept = h[0] if options.refine_sweeps else None
    u = _damped_inverse_factor(reversed_h, h.clear if overwrite else lambda: None, options.damp_percent, name)[0]
    # u: [K, K] upper, rows and columns in visit order
    if kept is not None and options.refinement_shrinkage != options.shrinkage:
        # (1 - r) H + r diag(H) from (1 - rho) H + rho diag(H), in place: the off-diagonal by (1 - r) / (1 - rho)
        diagonal = kept.diagonal().clone()
        kept.mul_((1.0 - options.refinement_shrinkage) / (1.0 - options.shrinkage)).diagonal().copy_(diagonal)
        del diagonal
    return HessianFactor(u, dead, energy, perm, kept)


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

    weight: float [N, K] (out, in); hessian: [K, K] = 2 XᵀX / n of the layer's inputs (HessianSum.hessian), or
    its HessianFactor (factor_hessian with the same options), shared by the linears of one input.
    scale_dtype: dtype the scales are stored in (the model dtype); scales are rounded to it before use.
    Math runs in fp32 (fp64 if weight and hessian are fp64). Inputs are not modified.
    returns: QuantizedWeight (q int8 [N, K], scale fp32 [N, G], zero_point int32 [N, G] | None), columns in
    the original order whatever act_order. On a GGUF grid (gguf.types.GRID_TYPES) a grids.GridWeight: its fields
    are chosen up front from the whole weight (a K-quant super-block spans 8 or 16 groups), each column is
    rounded onto them; with the "mse" observer, the K-quants' and Q5_0's come from llama.cpp's
    importance-weighted search with diag(H) as the importance (llama.cpp's importance matrix is the same
    mean of x^2 per input).
    With options.refine_sweeps, the levels are then refined by coordinate descent (refine.refine_levels; a
    HessianFactor must then come from factor_hessian with the same options, which keeps H).
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

    column_group = (perm if perm is not None else torch.arange(k, device=w.device)) // group_size  # [K]

    block = options.block_size
    if not static and block % group_size:
        block = max(group_size, (block // group_size) * group_size)
    # The walk runs on transposed copies ([K, N] weights, [G, N] scales): each column is a contiguous row.
    wt = w.t().contiguous()  # [K, N]
    del w
    if perm is not None:
        wt = wt[perm]  # visit order: whole rows move
    q_t = torch.zeros(k, n, dtype=dtype, device=wt.device)  # [K, N] (visit order)
    scales_t = scales.t().contiguous()  # [G, N]
    zeros_t = zeros.t().contiguous() if zeros is not None else None
    minimums_t = minimums.t().contiguous() if grid is not None else None
    walk = _column_walk(scheme, grid, scales_t, zeros_t, minimums_t, column_group)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = wt[i1:i2].clone()  # [B, N]
        err1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]  # [B, B]
        # the walk stops where a group starts whose parameters come from its updated columns
        starts = [i for i in range(i2 - i1) if not static and (i1 + i) % group_size == 0]
        for a, b in zip([0] + starts, starts + [i2 - i1]):
            if a == b:
                continue
            if a in starts:
                g = int(column_group[i1 + a])
                s, z = _qparams(w1[a:a + group_size].t(), energy[i1 + a:i1 + a + group_size], one_group, scale_dtype,
                                options)
                scales_t[g] = s[:, 0]
                if zeros_t is not None:
                    zeros_t[g] = z[:, 0]
            walk(w1, u1, q_t[i1:i2], err1, i1, a, b)
        wt[i2:].addmm_(u[i1:i2, i2:].t(), err1, alpha=-1)  # [K - i2, N], in place: no [K - i2, N] temporary
    if perm is not None:
        q_t = q_t[torch.argsort(perm)]  # back to the original order
    q_int = q_t.to(torch.uint8 if grid is not None else torch.int8).t().contiguous()  # [N, K]
    scales = scales_t.t()
    zeros = zeros_t.t() if zeros_t is not None else None
    if grid is not None:
        result = grid(q_int, *fields, scheme=scheme)
    else:
        if perm is not None and scheme.strategy == "group":
            # recorded as compressed-tensors does; per-channel stays null (compressed-tensors < 0.16 refuses it there)
            scheme = dataclasses.replace(scheme, actorder="weight")
        result = QuantizedWeight(q=q_int, scale=scales.float(),
                                 zero_point=zeros.to(torch.int32) if zeros is not None else None, scheme=scheme)
    if options.refine_sweeps:
        if factor.hessian is None:
            raise ValueError(f"{name}: refine_sweeps needs the Hessian: build the factor with factor_hessian and the "
                             f"same options")
        if not options.refine_fields:
            return refine_levels(result, weight, factor.hessian, options.refine_sweeps).weight
        for _ in range(options.refine_sweeps):
            result = refine_levels(result, weight, factor.hessian).weight
            result = refine_fields(result, weight, factor.hessian).weight
    return result
