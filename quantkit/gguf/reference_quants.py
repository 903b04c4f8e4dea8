"""llama.cpp's own quantizers for the GGUF K-quants Q2_K ... Q6_K, Q8_0 and the non-uniform IQ4_NL / IQ4_XS, ported
to pure torch bit for bit.

Ports of ggml/src/ggml-quants.c (the llama.cpp tree quantkit is checked against):

- without importance: quantize_row_q4_K_ref, quantize_row_q5_K_ref (make_qkx2_quants, then the 6-bit
  quantization of the sub-block scales and mins against the super-block's max) and quantize_row_q6_K_ref
  (make_qx_quants with rmse_type 1, then int8 scales against the largest |scale|);
- with importance (llama.cpp's imatrix path, quantize_q4_K / quantize_q5_K / quantize_q6_K given
  quant_weights): quantize_row_q4_K_impl and quantize_row_q5_K_impl (make_qkx3_quants per sub-block,
  make_qp_quants for the scales and mins) and quantize_row_q6_K_impl (make_qx_quants weighted by the
  importance);
- quantize_iq4_nl / quantize_iq4_xs (quantize_row_iq4_nl_impl with ntry 7, what ggml_quantize_chunk runs
  with or without importance: weights x^2 or importance * sqrt(sigma^2 + x^2), each block of 32's scale the
  best weighted least-squares fit over 16 trial scales, IQ4_XS's then rounded to 6 bits against the
  super-block's largest) and best_index_int8 (the nearest of the 16 values, a tie to the upper one);
- quantize_row_q8_0_ref (quantize_q8_0: d = amax / 127, the codes roundf against the unrounded d; the one
  maker of Q8_0 blocks from float weights outside the grids, which round against the stored fp16 d);
- nearest_int (round half to even through the 1.5 * 2^23 trick, its wrap-around kept), GGML_FP32_TO_FP16
  (round to nearest even) and the C's uint8 / int8 stores.

`importance` is the imatrix of the tensor: one non-negative float per column (per input feature) [K],
what llama-quantize passes as quant_weights. ggml_quantize_chunk uses the *_ref functions when it is None.

Exactness: every step is the C's fp32 arithmetic in the C's order: the sums are accumulated element by
element (a Python loop over the 16, 32 or 256 positions, vectorised over all rows and blocks), a / b is a
true fp32 division (never a reciprocal times, which is what torch's `scalar / tensor` does) and sqrtf is
taken in float64 and rounded (torch's fp32 CPU sqrt is not correctly rounded). This matches ggml as built
for x86-64 without -ffast-math and without FMA contraction (llama.cpp's ggml-base is compiled without
-march, so no FMA); a ggml built where the compiler contracts a*b+c into FMA (e.g. aarch64) can differ in
rare blocks. tests/test_gguf_reference_quants.py compares against ggml's own bytes: 100% identical blocks
measured against ggml 0.26.0 and 0.25.3 (docs/gguf-k-quants.md). Checked with CPU torch only: on a GPU
the same ops should round alike (true division, no fast math) but that is not tested.

Shapes: w float [N, K], K % 256 == 0; the *_fields functions return the fields in the shapes that
quantkit/gguf/blocks.py's pack_q4_k / pack_q5_k / pack_q6_k take, and quantize_* are those packs of them.
Non-finite weights are refused (ValueError), as are K % 256 != 0 and an importance that is not a finite,
non-negative [K].
"""

from __future__ import annotations

import numpy as np
import torch

from . import blocks
from .types import GGML_TYPES

QK_K = blocks.SUPER_BLOCK
GROUP_MAX_EPS = np.float32(1e-15)
#: super-blocks quantized per step (bounds the working memory: some 40 fp32 temporaries of this many x 256,
#: ~160 MB at 4096)
CHUNK_BLOCKS = 1 << 12

F32 = torch.float32


def _f(v) -> np.float32:
    """A C float literal / fp32 scalar expression value."""
    return np.float32(v)


def _t(v, like: torch.Tensor) -> torch.Tensor:
    """An fp32 scalar as a 0-dim tensor on `like`'s device (so torch computes the op in fp32, elementwise)."""
    return torch.tensor(float(v), dtype=F32, device=like.device)


def _div(a, b: torch.Tensor) -> torch.Tensor:
    """C's a / b in fp32, a a scalar or a tensor (torch's `scalar / tensor` is a reciprocal times: not exact)."""
    return torch.div(a if isinstance(a, torch.Tensor) else _t(a, b), b)


def _sqrtf(x: torch.Tensor) -> torch.Tensor:
    """sqrtf, correctly rounded (through float64: exact for fp32)."""
    return torch.sqrt(x.double()).float()


def _nearest_int(f: torch.Tensor) -> torch.Tensor:
    """ggml's nearest_int: fp32 -> int32, round half to even for |f| < 2^22 (and the C's bits beyond)."""
    return ((f + 12582912.0).view(torch.int32) & 0x007FFFFF) - 0x00400000


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero) in fp32, exactly: floor(|x|) + floor(2 (|x| - floor(|x|))), signed."""
    a = x.abs()
    f = a.floor()
    return torch.sign(x) * (f + (2 * (a - f)).floor())


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """llama.cpp's quantize_row_q8_0_ref of w float [N, K] (K % 32 == 0), bit for bit: per block of 32,
    d = amax / 127 in fp32, the codes roundf(x * (1 / d)) against that unrounded d (0 where d is 0), d stored
    as fp16. returns uint8 [N, K/32 * 34] Q8_0 blocks."""
    n, k = w.shape
    if k % blocks.BLOCK:
        raise ValueError(f"Q8_0: K = {k} is not a multiple of the block size {blocks.BLOCK}")
    if n == 0:  # (no block scales to view as bytes)
        return torch.empty(0, k // blocks.BLOCK * GGML_TYPES["Q8_0"].block_bytes, dtype=torch.uint8)
    x = w.float().reshape(n, k // blocks.BLOCK, blocks.BLOCK)
    d = x.abs().amax(dim=-1) / 127  # [N, K/32]
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _roundf(x * inv.unsqueeze(-1)).to(torch.int8).reshape(n, k)
    return blocks.pack_q8_0(q, d.to(torch.float16))


def _u8(i: torch.Tensor) -> torch.Tensor:
    """A C store of an int into uint8_t: modulo 256 (as int32)."""
    return i & 0xFF


def _i8(i: torch.Tensor) -> torch.Tensor:
    """A C store of an int into int8_t: modulo 256, two's complement (as int32)."""
    return ((i + 128) & 0xFF) - 128


def _to_fp16(x: torch.Tensor) -> torch.Tensor:
    """GGML_FP32_TO_FP16: round to nearest even (torch's fp16 cast)."""
    return x.to(torch.float16)


def _where(c: torch.Tensor, a, b):
    return torch.where(c, a, b)


def _seq_sum(*terms: torch.Tensor) -> tuple[torch.Tensor, ...] | torch.Tensor:
    """C's `float s = 0; for (i = 0; i < n; ++i) s += t[i];` over the last dimension, fp32, in order (torch's
    sum reduces pairwise: other roundings). terms: fp32 [..., n] of one shape, summed in one loop; returns
    [...] each (one tensor for one term)."""
    t = torch.stack(terms).movedim(-1, 0).contiguous()  # [n, len(terms), ...]
    acc = torch.zeros_like(t[0])
    for i in range(t.shape[0]):
        acc = acc + t[i]
    return acc[0] if len(terms) == 1 else tuple(acc)


# ---------------------------------------------------------------------------------------------- helpers
# Each works on x [..., n] (the C's x[0..n-1] as the last dimension), vectorised over the leading ones.

def _make_qkx_quants(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                     qkx3: bool, use_mad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants (qkx3 False) or make_qkx3_quants with weights; use_mad: weighted absolute errors
    instead of squared ones (quantize_row_q2_K_ref's). x, w: fp32 [..., n]. returns (L int32 [..., n] in
    0..nmax, scale fp32 [...], the_min fp32 [...])."""
    err = torch.abs if use_mad else _sq
    n = x.shape[-1]
    mn, mx = x[..., 0], x[..., 0]
    sum_w = w[..., 0]
    sum_x = sum_w * x[..., 0]
    for i in range(1, n):
        xi, wi = x[..., i], w[..., i]
        mn = _where(xi < mn, xi, mn)
        mx = _where(xi > mx, xi, mx)
        sum_w = sum_w + wi
        sum_x = sum_x + wi * xi
    zero = torch.zeros_like(mn)
    mn = _where(mn > 0, zero, mn)
    flat = (mx <= mn) if qkx3 else (mx == mn)
    rng = mx - mn
    iscale = _div(_f(nmax), rng)
    scale = _div(_f(1), iscale)
    L = _nearest_int(iscale.unsqueeze(-1) * (x - mn.unsqueeze(-1))).clamp(0, nmax)
    Lf = L.float()
    best = _seq_sum(w * err(scale.unsqueeze(-1) * Lf + mn.unsqueeze(-1) - x))
    flat_min = mn
    for step in range(nstep + 1):
        num = _f(_f(rmin) + _f(rdelta) * _f(step)) + _f(nmax)
        iscale = _div(num, mx - mn)  # the C's min is the best fit so far: it moves
        v = iscale.unsqueeze(-1) * (x - mn.unsqueeze(-1))
        if qkx3:
            nmax_t = _t(nmax, v)
            Laux = _where(v > 0, _nearest_int(_where(v < nmax_t, v, nmax_t)), torch.zeros_like(L))
        else:
            Laux = _nearest_int(v).clamp(0, nmax)
        la = Laux.float()
        wl = w * la
        sum_l, sum_l2, sum_xl = _seq_sum(wl, wl * la, wl * x)  # w*l, w*l*l, w*l*x as the C groups them
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = torch.div(sum_w * sum_xl - sum_x * sum_l, D)
        this_min = torch.div(sum_l2 * sum_x - sum_l * sum_xl, D)
        pos = this_min > 0
        this_min = _where(pos, zero, this_min)
        this_scale = _where(pos, torch.div(sum_xl, sum_l2), this_scale)
        cur = _seq_sum(w * err(this_scale.unsqueeze(-1) * la + this_min.unsqueeze(-1) - x))
        better = (D > 0) & (cur < best)
        L = _where(better.unsqueeze(-1), Laux, L)
        best = _where(better, cur, best)
        scale = _where(better, this_scale, scale)
        mn = _where(better, this_min, mn)
    L = _where(flat.unsqueeze(-1), torch.zeros_like(L), L)
    scale = _where(flat, zero, scale)
    mn = _where(flat, flat_min, mn)
    return L, scale, -mn


def _sq(d: torch.Tensor) -> torch.Tensor:
    return d * d


def _make_qp_quants(x: torch.Tensor, qw: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qp_quants. x, qw: fp32 [..., n]. returns (L int32 [..., n] in 0..255 (a uint8 in C), scale [...])."""
    n = x.shape[-1]
    mx = torch.zeros_like(x[..., 0])
    for i in range(n):
        mx = _where(mx > x[..., i], mx, x[..., i])
    zero_group = mx < _t(GROUP_MAX_EPS, mx)
    iscale = _div(_f(nmax), mx)
    L = _u8(_nearest_int(iscale.unsqueeze(-1) * x))
    scale = _div(_f(1), iscale)
    Lf = L.float()
    diff = x - scale.unsqueeze(-1) * Lf
    best = _seq_sum(qw * diff * diff)
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        iscale_is = _div(_f(_f(0.1) * _f(step)) + _f(nmax), mx)
        scale_is = _div(_f(1), iscale_is)
        lf = _nearest_int(iscale_is.unsqueeze(-1) * x).clamp(max=nmax).float()
        diff = x - scale_is.unsqueeze(-1) * lf
        mse = _seq_sum(qw * diff * diff)
        better = mse < best
        best = _where(better, mse, best)
        iscale = _where(better, iscale_is, iscale)
    l = _nearest_int(iscale.unsqueeze(-1) * x).clamp(max=nmax)
    L = _u8(l)
    lf = l.float()
    sumlx, suml2 = _seq_sum(qw * x * lf, qw * lf * lf)
    # five passes; a pass that changes nothing leaves the state as it was, so the C's early exit changes nothing
    for _ in range(5):
        for i in range(n):
            w, xi, Li = qw[..., i], x[..., i], L[..., i]
            Lif = Li.float()
            slx = sumlx - w * xi * Lif
            sl2 = suml2 - w * Lif * Lif
            ok = (slx > 0) & (sl2 > 0)
            new_l = _nearest_int(torch.div(xi * sl2, slx)).clamp(max=nmax)
            nf = new_l.float()
            slx = slx + w * xi * nf
            sl2 = sl2 + w * nf * nf
            take = ok & (new_l != Li) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            L = L.clone()
            L[..., i] = _where(take, _u8(new_l), Li)
            sumlx = _where(take, slx, sumlx)
            suml2 = _where(take, sl2, suml2)
    zero = torch.zeros_like(mx)
    scale = _where(suml2 > 0, torch.div(sumlx, suml2), zero)
    return _where(zero_group.unsqueeze(-1), torch.zeros_like(L), L), _where(zero_group, zero, scale)


def _signed_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The C's `if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }` over the last dimension of x
    fp32 [..., n]: (amax, max) [...], the first of equal magnitudes."""
    amax = torch.zeros_like(x[..., 0])
    mx = torch.zeros_like(amax)
    for i in range(x.shape[-1]):
        ax = x[..., i].abs()
        up = ax > amax
        amax = _where(up, ax, amax)
        mx = _where(up, x[..., i], mx)
    return amax, mx


def _make_qx_quants(x: torch.Tensor, nmax: int, qw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants with rmse_type 1 (weights x*x, or qw). x: fp32 [..., n]; qw broadcastable to x.
    returns (L int32 [..., n] in 0..2*nmax-1 (q + nmax), scale fp32 [...])."""
    amax, mx = _signed_max(x)
    zero_group = amax < _t(GROUP_MAX_EPS, amax)
    w = x * x if qw is None else qw.expand_as(x)

    def fit(iscale):
        l = _nearest_int(iscale.unsqueeze(-1) * x).clamp(-nmax, nmax - 1)
        lf = l.float()
        sumlx, suml2 = _seq_sum(w * x * lf, w * lf * lf)
        return l + nmax, sumlx, suml2

    zero = torch.zeros_like(amax)
    L, sumlx, suml2 = fit(_div(_f(-nmax), mx))
    scale = _where(suml2 != 0, torch.div(sumlx, suml2), zero)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        Lis, sumlx, suml2 = fit(_div(-_f(_f(nmax) + _f(_f(0.1) * _f(step))), mx))
        take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = _where(take.unsqueeze(-1), Lis, L)
        scale = _where(take, torch.div(sumlx, suml2), scale)
        best = _where(take, scale * sumlx, best)
    return _where(zero_group.unsqueeze(-1), torch.zeros_like(L), L), _where(zero_group, zero, scale)


def _make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_q3_quants with do_rmse (weights x*x; five passes of moving one level at a time). x: fp32 [..., n].
    returns (L int32 [..., n] in 0..2*nmax-1 (q + nmax; 0 for an all-zero group), scale fp32 [...])."""
    n = x.shape[-1]
    amax, mx = _signed_max(x)
    zero_group = amax < _t(GROUP_MAX_EPS, amax)
    L = _nearest_int(_div(_f(-nmax), mx).unsqueeze(-1) * x).clamp(-nmax, nmax - 1)
    w = x * x
    lf = L.float()
    sumlx, suml2 = _seq_sum(w * x * lf, w * lf * lf)
    # five passes; a pass that changes nothing leaves the state as it was, so the C's early exit changes nothing
    for _ in range(5):
        for i in range(n):
            wi, xi, Li = w[..., i], x[..., i], L[..., i]
            Lif = Li.float()
            slx = sumlx - wi * xi * Lif
            sl2 = suml2 - wi * Lif * Lif
            new_l = _nearest_int(torch.div(xi * sl2, slx)).clamp(-nmax, nmax - 1)
            nf = new_l.float()
            slx_new = slx + wi * xi * nf
            sl2_new = sl2 + wi * nf * nf
            take = (slx > 0) & (new_l != Li) & (sl2_new > 0) & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
            L = L.clone()
            L[..., i] = _where(take, new_l, Li)
            sumlx = _where(take, slx_new, sumlx)
            suml2 = _where(take, sl2_new, suml2)
    zero = torch.zeros_like(amax)
    scale = _where(suml2 > 0, torch.div(sumlx, suml2), zero)
    return _where(zero_group.unsqueeze(-1), torch.zeros_like(L), L + nmax), _where(zero_group, zero, scale)


# ------------------------------------------------------------------------------------------- the rows

def _check(w: torch.Tensor, importance: torch.Tensor | None, name: str,
           block: int = QK_K) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a float tensor [N, K], got "
                         f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    if w.shape[1] % block:
        kind = "super-block" if block == QK_K else "block"
        raise ValueError(f"{name}: K = {w.shape[1]} is not a multiple of the {kind} size {block}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{name}: the weight holds NaN or inf")
    if importance is not None:
        if not isinstance(importance, torch.Tensor) or tuple(importance.shape) != (w.shape[1],):
            raise ValueError(f"{name}: importance must be a tensor [K] = [{w.shape[1]}], got "
                             f"{tuple(getattr(importance, 'shape', ()))}")
        importance = importance.to(device=w.device, dtype=F32)
        if not bool(torch.isfinite(importance).all()) or bool((importance < 0).any()):
            raise ValueError(f"{name}: importance must be finite and non-negative")
    return w.to(F32), importance


def _chunks(n: int, k: int):
    rows = max(1, CHUNK_BLOCKS * QK_K // max(k, 1))
    for r in range(0, n, rows):
        yield slice(r, min(n, r + rows))


def _q45_fields(x: torch.Tensor, qw: torch.Tensor | None, nmax: int, ref: tuple[float, float, int],
                clamp_impl_scales: bool) -> tuple[torch.Tensor, ...]:
    """quantize_row_q{4,5}_K_ref (qw None) or _impl. x: fp32 [N, G, 8, 32]; qw: fp32 [G, 8, 32] or None.
    returns (L [N, G, 8, 32], d fp16 [N, G], dmin fp16 [N, G], sc [N, G, 8], mn [N, G, 8]) as int32 / fp16."""
    if qw is None:
        sum_x2 = _seq_sum(x * x)
        av_x = _sqrtf(torch.div(sum_x2, _t(32, sum_x2)))
        weights = av_x.unsqueeze(-1) + x.abs()
        L, scales, mins = _make_qkx_quants(x, weights, nmax, *ref, qkx3=False)
        max_scale = torch.zeros_like(scales[..., 0])
        max_min = torch.zeros_like(max_scale)
        for j in range(8):
            max_scale = _where(scales[..., j] > max_scale, scales[..., j], max_scale)
            max_min = _where(mins[..., j] > max_min, mins[..., j], max_min)
        zero = torch.zeros_like(max_scale)
        inv_scale = _where(max_scale > 0, _div(_f(63), max_scale), zero)
        inv_min = _where(max_min > 0, _div(_f(63), max_min), zero)
        ls = _u8(_nearest_int(inv_scale.unsqueeze(-1) * scales)).clamp(max=63)
        lm = _u8(_nearest_int(inv_min.unsqueeze(-1) * mins)).clamp(max=63)
        d = _to_fp16(torch.div(max_scale, _t(63, max_scale)))
        dmin = _to_fp16(torch.div(max_min, _t(63, max_min)))
    else:
        flat = x.flatten(-2)
        sum_x2 = _seq_sum(flat * flat)
        sigma2 = torch.div(2 * sum_x2, _t(QK_K, sum_x2))
        weights = qw * _sqrtf(sigma2[..., None, None] + x * x)
        sw = _seq_sum(weights)
        L, scales, mins = _make_qkx_quants(x, weights, nmax, -0.9, 0.05, 36, qkx3=True)
        ls, d_block = _make_qp_quants(scales, sw, 63)
        lm, m_block = _make_qp_quants(mins, sw, 63)
        if clamp_impl_scales:  # quantize_row_q5_K_impl clamps to 63; quantize_row_q4_K_impl does not
            ls, lm = ls.clamp(max=63), lm.clamp(max=63)
        d, dmin = _to_fp16(d_block), _to_fp16(m_block)
    # the C packs ls / lm into 12 bytes (wrapping as uint8 does) and reads them back with get_scale_min_k4
    sc, mn = blocks.k4_scales_from_bytes(blocks.k4_scale_bytes(ls, lm))
    sc, mn = sc.to(torch.int32), mn.to(torch.int32)
    dd = d.float().unsqueeze(-1) * sc.float()
    dm = dmin.float().unsqueeze(-1) * mn.float()
    l = _nearest_int(torch.div(x + dm.unsqueeze(-1), dd.unsqueeze(-1).expand_as(x))).clamp(0, nmax)
    L = _where((dd == 0).unsqueeze(-1), L, l)
    return L, d, dmin, sc, mn


def _k_fields(w, importance, name, nmax, ref, clamp_impl_scales):
    w, importance = _check(w, importance, name)
    n, k = w.shape
    g = k // QK_K
    qw = None if importance is None else importance.reshape(g, 8, 32)
    parts = [_q45_fields(w[rows].reshape(-1, g, 8, 32), qw, nmax, ref, clamp_impl_scales) for rows in _chunks(n, k)]
    u, d, dmin, sc, mn = (torch.cat(p, dim=0) for p in zip(*parts)) if parts else \
        (torch.zeros(0, g, 8, 32, dtype=torch.int32), *(torch.zeros(0, g, dtype=torch.float16),) * 2,
         *(torch.zeros(0, g, 8, dtype=torch.int32),) * 2)
    return (u.to(torch.uint8).reshape(n, k), d, dmin, sc.to(torch.uint8).reshape(n, g * 8),
            mn.to(torch.uint8).reshape(n, g * 8))


def q4_k_fields(w: torch.Tensor, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """llama.cpp's Q4_K quantization of w float [N, K] (K % 256 == 0), optionally with the imatrix
    `importance` [K] (quantize_q4_K: quantize_row_q4_K_ref without, quantize_row_q4_K_impl with).
    returns (u uint8 [N, K] in 0..15, d fp16 [N, K/256], dmin fp16 [N, K/256], sc uint8 [N, K/32] in 0..63,
    mn uint8 [N, K/32] in 0..63): the arguments of blocks.pack_q4_k."""
    return _k_fields(w, importance, "Q4_K", 15, (-1.0, 0.1, 20), clamp_impl_scales=False)


def q5_k_fields(w: torch.Tensor, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """llama.cpp's Q5_K quantization (quantize_row_q5_K_ref / _impl) of w float [N, K]: as q4_k_fields with
    u in 0..31; the arguments of blocks.pack_q5_k."""
    return _k_fields(w, importance, "Q5_K", 31, (-0.5, 0.1, 15), clamp_impl_scales=True)


def _q6_fields(x: torch.Tensor, qw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_row_q6_K_ref (qw None) or _impl. x: fp32 [N, G, 16, 16]; qw: fp32 [G, 16, 16] or None.
    returns (L int32 [N, G, 16, 16] in 0..63 (q + 32), d fp16 [N, G], sc int32 [N, G, 16] in -128..127)."""
    L, scales = _make_qx_quants(x, 32, qw)
    max_abs, max_scale = _signed_max(scales)
    zero_block = max_abs < _t(GROUP_MAX_EPS, max_abs)
    iscale = _div(_f(-128), max_scale)
    d = _to_fp16(_div(_f(1), iscale))
    sc = _i8(_nearest_int(iscale.unsqueeze(-1) * scales).clamp(max=127))
    dd = d.float().unsqueeze(-1) * sc.float()
    l = _nearest_int(torch.div(x, dd.unsqueeze(-1).expand_as(x))).clamp(-32, 31) + 32
    L = _where((dd == 0).unsqueeze(-1), L, l)
    # a block whose scales are all ~0 is written as zero bytes: q = -32, sc = 0, d = +0
    L = _where(zero_block[..., None, None], torch.zeros_like(L), L)
    sc = _where(zero_block.unsqueeze(-1), torch.zeros_like(sc), sc)
    d = _where(zero_block, torch.zeros_like(d), d)
    return L, d, sc


def q6_k_fields(w: torch.Tensor, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """llama.cpp's Q6_K quantization (quantize_row_q6_K_ref without importance, quantize_row_q6_K_impl with)
    of w float [N, K] (K % 256 == 0). returns (q int8 [N, K] in -32..31, d fp16 [N, K/256],
    sc int8 [N, K/16]): the arguments of blocks.pack_q6_k."""
    w, importance = _check(w, importance, "Q6_K")
    n, k = w.shape
    g = k // QK_K
    qw = None if importance is None else importance.reshape(g, 16, 16)
    parts = [_q6_fields(w[rows].reshape(-1, g, 16, 16), qw) for rows in _chunks(n, k)]
    if not parts:
        return (torch.zeros(0, k, dtype=torch.int8), torch.zeros(0, g, dtype=torch.float16),
                torch.zeros(0, g * 16, dtype=torch.int8))
    L, d, sc = (torch.cat(p, dim=0) for p in zip(*parts))
    return (L - 32).to(torch.int8).reshape(n, k), d, sc.to(torch.int8).reshape(n, g * 16)


def _sub16_weights(x: torch.Tensor, qw: torch.Tensor, twice: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The imatrix paths' weights of Q2_K / Q3_K: qw * sqrt(sigma^2 + x^2), sigma^2 the super-block's mean x^2
    (twice that for Q3_K), and their sums per sub-block. x: fp32 [N, G, 16, 16]; qw: [G, 16, 16].
    returns (weights [N, G, 16, 16], sums [N, G, 16])."""
    flat = x.flatten(-2)
    sum_x2 = _seq_sum(flat * flat)
    sigma2 = torch.div(2 * sum_x2 if twice else sum_x2, _t(QK_K, sum_x2))
    weights = qw * _sqrtf(sigma2[..., None, None] + x * x)
    return weights, _seq_sum(weights)


def _q3_fields(x: torch.Tensor, qw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_row_q3_K_ref (qw None) or _impl. x: fp32 [N, G, 16, 16]; qw: fp32 [G, 16, 16] or None.
    returns (L int32 [N, G, 16, 16] in 0..7 (q + 4), d fp16 [N, G], v int32 [N, G, 16] in 0..63 (sc + 32))."""
    if qw is None:
        L, scales = _make_q3_quants(x, 4)
        _, max_scale = _signed_max(scales)
        some = max_scale != 0
        iscale = _div(_f(-32), max_scale)
        v = _i8(_nearest_int(iscale.unsqueeze(-1) * scales)).clamp(-32, 31) + 32
        v = _where(some.unsqueeze(-1), v, torch.zeros_like(v))  # the C leaves the 12 bytes zero: sc = -32
        d = _where(some, _to_fp16(_div(_f(1), iscale)), torch.zeros_like(max_scale, dtype=torch.float16))
    else:
        weights, sw = _sub16_weights(x, qw, twice=True)
        L, scales = _make_qx_quants(x, 4, weights)
        v, d_block = _make_qx_quants(scales, 32, sw)
        d = _to_fp16(d_block)
    dd = d.float().unsqueeze(-1) * (v - 32).float()
    l = _nearest_int(torch.div(x, dd.unsqueeze(-1).expand_as(x))).clamp(-4, 3) + 4
    return _where((dd == 0).unsqueeze(-1), L, l), d, v


def _q2_fields(x: torch.Tensor, qw: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """quantize_row_q2_K_ref (qw None) or _impl. x: fp32 [N, G, 16, 16]; qw: fp32 [G, 16, 16] or None.
    returns (L int32 [N, G, 16, 16] in 0..3, d fp16 [N, G], dmin fp16 [N, G], sc [N, G, 16], mn [N, G, 16]
    int32 in 0..15)."""
    if qw is None:
        L, scales, mins = _make_qkx_quants(x, x.abs(), 3, -0.5, 0.1, 15, qkx3=False, use_mad=True)
        max_scale = torch.zeros_like(scales[..., 0])
        max_min = torch.zeros_like(max_scale)
        for j in range(16):
            max_scale = _where(scales[..., j] > max_scale, scales[..., j], max_scale)
            max_min = _where(mins[..., j] > max_min, mins[..., j], max_min)
        zero, zero16 = torch.zeros_like(max_scale), torch.zeros_like(max_scale, dtype=torch.float16)
        has_scale, has_min = max_scale > 0, max_min > 0
        ls = _nearest_int(_div(_f(15), max_scale).unsqueeze(-1) * scales)
        lm = _nearest_int(_div(_f(15), max_min).unsqueeze(-1) * mins)
        byte = _where(has_scale.unsqueeze(-1), _u8(ls), torch.zeros_like(ls))
        byte = _where(has_min.unsqueeze(-1), _u8(byte | (lm << 4)), byte)
        d = _where(has_scale, _to_fp16(torch.div(max_scale, _t(15, zero))), zero16)
        dmin = _where(has_min, _to_fp16(torch.div(max_min, _t(15, zero))), zero16)
    else:
        weights, sw = _sub16_weights(x, qw, twice=False)
        L, scales, mins = _make_qkx_quants(x, weights, 3, -0.9, 0.05, 36, qkx3=True)
        ls, d_block = _make_qp_quants(scales, sw, 15)
        lm, m_block = _make_qp_quants(mins, sw, 15)
        byte = _u8(ls | (lm << 4))
        d, dmin = _to_fp16(d_block), _to_fp16(m_block)
    sc, mn = byte & 0xF, byte >> 4
    dd = d.float().unsqueeze(-1) * sc.float()
    dm = dmin.float().unsqueeze(-1) * mn.float()
    l = _nearest_int(torch.div(x + dm.unsqueeze(-1), dd.unsqueeze(-1).expand_as(x))).clamp(0, 3)
    return _where((dd == 0).unsqueeze(-1), L, l), d, dmin, sc, mn


def _sub16_rows(fields, w, importance, name):
    """Run `fields` (_q2_fields / _q3_fields) over w float [N, K] in chunks of rows: returns its outputs
    concatenated, each [N, G, ...] (int32 / fp16)."""
    w, importance = _check(w, importance, name)
    n, k = w.shape
    g = k // QK_K
    qw = None if importance is None else importance.reshape(g, 16, 16)
    parts = [fields(w[rows].reshape(-1, g, 16, 16), qw) for rows in _chunks(n, k)]
    if not parts:
        parts = [fields(torch.zeros(0, g, 16, 16), qw)]
    return [torch.cat(p, dim=0) for p in zip(*parts)]


def q3_k_fields(w: torch.Tensor, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """llama.cpp's Q3_K quantization (quantize_row_q3_K_ref without importance: make_q3_quants; with it
    quantize_row_q3_K_impl: make_qx_quants weighted, then make_qx_quants of the scales) of w float [N, K]
    (K % 256 == 0). returns (q int8 [N, K] in -4..3, d fp16 [N, K/256], sc int8 [N, K/16] in -32..31): the
    arguments of blocks.pack_q3_k."""
    L, d, v = _sub16_rows(_q3_fields, w, importance, "Q3_K")
    n, g = d.shape
    return (L - 4).to(torch.int8).reshape(n, g * QK_K), d, (v - 32).to(torch.int8).reshape(n, g * 16)


def q2_k_fields(w: torch.Tensor, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """llama.cpp's Q2_K quantization (quantize_row_q2_K_ref without importance: make_qkx2_quants with absolute
    errors; with it quantize_row_q2_K_impl: make_qkx3_quants, make_qp_quants for the 4-bit scales and mins) of
    w float [N, K] (K % 256 == 0). returns (u uint8 [N, K] in 0..3, d fp16 [N, K/256], dmin fp16 [N, K/256],
    sc uint8 [N, K/16] in 0..15, mn uint8 [N, K/16] in 0..15): the arguments of blocks.pack_q2_k."""
    L, d, dmin, sc, mn = _sub16_rows(_q2_fields, w, importance, "Q2_K")
    n, g = d.shape
    return (L.to(torch.uint8).reshape(n, g * QK_K), d, dmin, sc.to(torch.uint8).reshape(n, g * 16),
            mn.to(torch.uint8).reshape(n, g * 16))


def quantize_q2_k(w: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """ggml_quantize_chunk(GGML_TYPE_Q2_K, w, ..., importance): w float [N, K] -> uint8 [N, K/256*84]."""
    return blocks.pack_q2_k(*q2_k_fields(w, importance))


def quantize_q3_k(w: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """ggml_quantize_chunk(GGML_TYPE_Q3_K, w, ..., importance): w float [N, K] -> uint8 [N, K/256*110]."""
    return blocks.pack_q3_k(*q3_k_fields(w, importance))


def quantize_q4_k(w: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """ggml_quantize_chunk(GGML_TYPE_Q4_K, w, ..., importance): w float [N, K] -> uint8 [N, K/256*144]."""
    return blocks.pack_q4_k(*q4_k_fields(w, importance))


def quantize_q5_k(w: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """ggml_quantize_chunk(GGML_TYPE_Q5_K, w, ..., importance): w float [N, K] -> uint8 [N, K/256*176]."""
    return blocks.pack_q5_k(*q5_k_fields(w, importance))


def quantize_q6_k(w: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """ggml_quantize_chunk(GGML_TYPE_Q6_K, w, ..., importance): w float [N, K] -> uint8 [N, K/256*210]."""
    return blocks.pack_q6_k(*q6_k_fields(w, importance))


def qx_scales(w: torch.Tensor, importance: torch.Tensor, nmax: int) -> torch.Tensor:
    """The scale per block of 32 that llama.cpp's imatrix path for Q4_0 (nmax 8) or Q5_0 (nmax 16) searches
    (quantize_row_q4_0_impl / quantize_row_q5_0_impl: make_qx_quants(32, nmax, x, L, 1, weight) with
    weight = importance * sqrt(sigma^2 + x^2), sigma^2 the row's mean x^2). w float [N, K], K % 32 == 0,
    importance [K] -> fp32 [N, K/32], before the fp16 rounding (the search itself; the row sum is not
    accumulated in the C's order, so this is llama.cpp's search, not always its bytes)."""
    _check_blocks_of_32(w, f"Q{4 if nmax == 8 else 5}_0")
    x, qw = _imatrix_weights(w, importance)
    return _make_qx_quants(x, nmax, qw)[1]


def _check_blocks_of_32(w: torch.Tensor, name: str) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] % 32 or not bool(torch.isfinite(w).all()):
        raise ValueError(f"{name}: expected a finite float tensor [N, K] with K % 32 == 0, got "
                         f"{tuple(getattr(w, 'shape', ()))}")


def _imatrix_weights(w: torch.Tensor, importance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights llama.cpp's imatrix paths for the blocks of 32 give each position: importance * sqrt(sigma^2
    + x^2), sigma^2 the row's mean x^2. w float [N, K], importance [K] -> (x, weights) fp32 [N, K/32, 32]."""
    n, k = w.shape
    x = w.to(F32).reshape(n, k // 32, 32)
    sigma2 = (x * x).sum(dim=(1, 2)) / k  # [N]
    return x, importance.to(F32).reshape(1, k // 32, 32) * _sqrtf(sigma2[:, None, None] + x * x)


def q1_fields(w: torch.Tensor, importance: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step and minimum per block of 32 that llama.cpp's imatrix path for Q4_1 (nmax 15) or Q5_1 (nmax 31)
    searches (quantize_row_q4_1_impl / quantize_row_q5_1_impl: make_qkx3_quants(32, nmax, x, weight, ..., -0.9,
    0.05, 36) with weight = importance * sqrt(sigma^2 + x^2), sigma^2 the row's mean x^2). w float [N, K],
    K % 32 == 0, importance [K] -> (d, m) fp32 [N, K/32] with y = d * u + m (m <= 0), before the fp16 rounding
    (the search itself; the row sum is not accumulated in the C's order, so this is llama.cpp's search, not
    always its bytes). Without an importance llama.cpp takes the min-max range (quantize_row_q4_1_ref)."""
    _check_blocks_of_32(w, f"Q{4 if nmax == 15 else 5}_1")
    n, k = w.shape
    d, m = [torch.zeros(0, k // 32)], [torch.zeros(0, k // 32)]
    for rows in _chunks(n, k):  # bounds the search's temporaries
        _, scale, the_min = _make_qkx_quants(*_imatrix_weights(w[rows], importance), nmax, -0.9, 0.05, 36, qkx3=True)
        d.append(scale)
        m.append(-the_min)
    return torch.cat(d), torch.cat(m)


# ------------------------------------------------------------------------------ the non-uniform IQ4 types

#: ggml's kvalues_iq4nl as fp32 (the C compares fp32 against the int8 values promoted to float)
IQ4_VALUES = torch.tensor(GGML_TYPES["IQ4_NL"].values, dtype=F32)


def best_index_iq4(x: torch.Tensor) -> torch.Tensor:
    """ggml's best_index_int8(16, kvalues_iq4nl, x) elementwise: the index (int64, 0..15) of the value nearest
    x fp32, a tie going to the upper one (`x - val[mu-1] < val[mu] - x ? mu-1 : mu`, the differences rounded in
    fp32 as the C's are); below the lowest value 0, above the highest 15, NaN 15 (the C's binary search with
    every comparison false)."""
    values = IQ4_VALUES.to(x.device)
    mu = (x.unsqueeze(-1) >= values).sum(-1).clamp(1, 15)  # val[mu - 1] <= x < val[mu] inside the range
    lower = x - values[mu - 1] < values[mu] - x
    idx = torch.where(lower, mu - 1, mu)
    idx = torch.where(x <= values[0], torch.zeros_like(idx), idx)
    return torch.where((x >= values[-1]) | torch.isnan(x), torch.full_like(idx, 15), idx)


def _iq4_block_scales(x: torch.Tensor, weight: torch.Tensor, ntry: int = 7) -> torch.Tensor:
    """The first half of quantize_row_iq4_nl_impl with ntry > 0: each block of 32's scale d (y = d * values[l]),
    the weighted least-squares fit of the levels at 2 ntry + 2 trial scales. x, weight: fp32 [..., 32].
    returns fp32 [...] (0 for a block whose largest |x| is below GROUP_MAX_EPS)."""
    amax, mx = _signed_max(x)
    zero_block = amax < _t(GROUP_MAX_EPS, amax)
    mx = _where(zero_block, torch.ones_like(mx), mx)  # (the C skips these blocks)
    v0 = _f(GGML_TYPES["IQ4_NL"].values[0])
    values = IQ4_VALUES.to(x.device)

    def fit(iscale):
        q = values[best_index_iq4(iscale.unsqueeze(-1) * x)]
        wq = weight * q
        return _seq_sum(wq * x, wq * q)  # sumqx += w*q*x[j]; sumq2 += w*q*q

    sumqx, sumq2 = fit(_div(_f(1), torch.div(-mx, _t(v0, mx))))  # d = -max / values[0]; id = 1/d
    zero = torch.zeros_like(mx)
    d = _where(sumq2 > 0, torch.div(sumqx, sumq2), zero)
    best = d * sumqx
    for itry in range(-ntry, ntry + 1):
        sumqx, sumq2 = fit(_div(_f(itry + int(v0)), mx))  # id = (itry + values[0]) / max
        take = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = _where(take, torch.div(sumqx, sumq2), d)
        best = _where(take, d * sumqx, best)
    return _where(zero_block, zero, d)


def iq4_super_block(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The second half of quantize_row_iq4_nl_impl for IQ4_XS: the eight sub-block scales of a super-block
    fp32 [..., 8] -> (d fp32 [...], l int32 [..., 8] in -32..31), d = -(the scale of largest magnitude) / 32
    and l = nearest_int(scale / d) through 1/d (0 where d is 0), so sub-block j's scale is d * l_j (d stored as
    fp16; the C rounds the levels against the fp32 d)."""
    _, max_scale = _signed_max(scales)
    d = torch.div(-max_scale, _t(32, max_scale))
    inv = _where(d != 0, _div(_f(1), d), torch.zeros_like(d))
    return d, _nearest_int(inv.unsqueeze(-1) * scales).clamp(-32, 31)


def _iq4_weights(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """quantize_row_iq4_nl_impl's weight of each position: x^2, or with an importance qw * sqrt(sigma^2 + x^2),
    sigma^2 twice the mean x^2 of the super-block (of the block of 32 for IQ4_NL). x: fp32 [N, G, S, 32] (S
    sub-blocks a super-block); qw: fp32 [G, S, 32] or None."""
    if qw is None:
        return x * x
    flat = x.flatten(-2)
    sigma2 = _seq_sum(flat * flat) * _t(_f(2) / _f(flat.shape[-1]), flat)
    return qw * _sqrtf(sigma2[..., None, None] + x * x)


def iq4_nl_fields(w: torch.Tensor, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's IQ4_NL quantization of w float [N, K] (K % 32 == 0), optionally with the imatrix `importance`
    [K]: ggml_quantize_chunk's quantize_iq4_nl (quantize_row_iq4_nl_impl with ntry 7, with or without
    importance; quantize_row_iq4_nl_ref's ntry -1 is not what llama-quantize runs). returns (u uint8 [N, K] in
    0..15, d fp16 [N, K/32]): the arguments of blocks.pack_iq4_nl; the levels are the nearest values to
    x / d against the fp32 d, as the C rounds them."""
    w, importance = _check(w, importance, "IQ4_NL", block=32)
    n, k = w.shape
    g = k // 32
    qw = None if importance is None else importance.reshape(g, 1, 32)
    us, ds = [torch.zeros(0, k, dtype=torch.uint8)], [torch.zeros(0, g, dtype=torch.float16)]
    for rows in _chunks(n, k):
        x = w[rows].reshape(-1, g, 1, 32)
        scale = _iq4_block_scales(x, _iq4_weights(x, qw))  # [n, G, 1]
        inv = _where(scale != 0, _div(_f(1), scale), torch.zeros_like(scale))
        us.append(best_index_iq4(inv.unsqueeze(-1) * x).to(torch.uint8).reshape(-1, k))
        ds.append(_to_fp16(scale).reshape(-1, g))
    return torch.cat(us), torch.cat(ds)


def iq4_xs_fields(w: torch.Tensor, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """llama.cpp's IQ4_XS quantization of w float [N, K] (K % 256 == 0), optionally with the imatrix `importance`
    [K]: quantize_iq4_xs (quantize_row_iq4_nl_impl over super-blocks of 256, ntry 7). returns (u uint8 [N, K]
    in 0..15, d fp16 [N, K/256], sc int8 [N, K/32] in -32..31): the arguments of blocks.pack_iq4_xs; the levels
    are the nearest values to x / (d * sc) against the fp32 d, as the C rounds them."""
    w, importance = _check(w, importance, "IQ4_XS")
    n, k = w.shape
    g = k // QK_K
    qw = None if importance is None else importance.reshape(g, 8, 32)
    us, ds, scs = [torch.zeros(0, k, dtype=torch.uint8)], [torch.zeros(0, g, dtype=torch.float16)], \
        [torch.zeros(0, g * 8, dtype=torch.int8)]
    for rows in _chunks(n, k):
        x = w[rows].reshape(-1, g, 8, 32)
        d, l = iq4_super_block(_iq4_block_scales(x, _iq4_weights(x, qw)))  # [n, G], [n, G, 8]
        dl = d.unsqueeze(-1) * l.float()
        inv = _where(dl != 0, _div(_f(1), dl), torch.zeros_like(dl))
        us.append(best_index_iq4(inv.unsqueeze(-1) * x).to(torch.uint8).reshape(-1, k))
        ds.append(_to_fp16(d))
        scs.append(l.to(torch.int8).reshape(-1, g * 8))
    return torch.cat(us), torch.cat(ds), torch.cat(scs)


def quantize_iq4_nl(w: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """ggml_quantize_chunk(GGML_TYPE_IQ4_NL, w, ..., importance): w float [N, K] -> uint8 [N, K/32*18]."""
    return blocks.pack_iq4_nl(*iq4_nl_fields(w, importance))


def quantize_iq4_xs(w: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """ggml_quantize_chunk(GGML_TYPE_IQ4_XS, w, ..., importance): w float [N, K] -> uint8 [N, K/256*136]."""
    return blocks.pack_iq4_xs(*iq4_xs_fields(w, importance))
