"""Reference quantization math in pure torch: scales, zero points, quantize, dequantize (int and fp8).

Conventions (compressed-tensors): q = clamp(round(w / s) + zp, qmin, qmax) in the signed range,
w ~ (q - zp) * s. Weights are [N=out, K=in]; scales and zero points are [N, G] with
G = ceil(K / group_size) (G = 1 per channel; a ragged last group holds the K % group_size inputs
left over). All math runs in fp32.
"""

from __future__ import annotations

import torch

from ..gguf.grids import fake_quantize as grid_fake_quantize
from .scheme import FP8_E4M3_MAX, QuantScheme

_EPS = 1e-12
_MSE_PATIENCE = 10  # grid steps without any group improving after which mse_clip_ratio stops


def _grouped(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """[N, K] -> [N, G, group] in fp32 according to the scheme's strategy; a ragged last group is padded
    with zeros (which change neither a min-max range that always includes 0 nor a product)."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    n, k = w.shape
    if scheme.strategy == "tensor":
        return w.float().reshape(1, 1, n * k)  # [1, 1, N*K]
    return grouped_columns(w.float(), scheme.group_size if scheme.strategy == "group" else None)


def grouped_columns(x: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """[..., K] -> [..., G, group_size] with G = ceil(K / group_size) (group_size None: one group of K);
    a ragged last group is padded with zeros up to G * group_size."""
    k = x.shape[-1]
    size = group_size or k
    g = -(-k // size)
    if g * size != k:
        x = torch.nn.functional.pad(x, (0, g * size - k))
    return x.unflatten(-1, (g, size))


#: How a symmetric scale divides the absolute maximum: by qmax (int4: 7, the default), by half the
#: signed range, (qmax - qmin) / 2 (int4: 7.5, the top value clipped to 7: llm-compressor's observer), or
#: "signed": by the end level on the extreme's side, -qmin (int4: 8) when the largest-magnitude value is
#: negative, qmax (7) when it is positive, so that the extreme lands exactly on a level and a negative one
#: uses the level -8 that absmax / 7 leaves empty (llama.cpp's Q4_0 rule, d = extreme / -8, within
#: positive scales: llama.cpp also puts a positive extreme on -8 with a negative d).
SYMMETRIC_SCALE_RULES = ("qmax", "half_range", "signed")
OBSERVERS = ("minmax", "mse")  # how a group's range is chosen: its min and max, or the MSE-searched shrink of them


def check_range_options(symmetric_scale: str, observer: str, mse_grid: int, mse_max_shrink: float) -> None:
    """ValueError naming the first invalid range option of an algorithm (RTN's, GPTQ's)."""
    if symmetric_scale not in SYMMETRIC_SCALE_RULES:
        raise ValueError(f"symmetric_scale must be one of {SYMMETRIC_SCALE_RULES}, got {symmetric_scale!r}")
    if observer not in OBSERVERS:
        raise ValueError(f"observer must be one of {OBSERVERS}, got {observer!r}")
    if mse_grid < 1:
        raise ValueError(f"mse_grid must be a positive number of steps, got {mse_grid}")
    if not (0.0 <= mse_max_shrink < 1.0):
        raise ValueError(f"mse_max_shrink must be in [0, 1), got {mse_max_shrink}")


def compute_qparams(
    w: torch.Tensor, scheme: QuantScheme, *, clip_ratio: torch.Tensor | float | None = None,
    symmetric_scale: str = "qmax", scale_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min-max scales (and zero points) for an int scheme.

    w: [N, K] float. clip_ratio: optional factor (scalar or [N, G]) shrinking the range (AWQ/MSE clipping).
    symmetric_scale: one of SYMMETRIC_SCALE_RULES (symmetric schemes only).
    scale_dtype: the dtype scales are stored in; scales are rounded to it (and kept >= its smallest normal
      number) after the zero points are chosen, so that an algorithm minimises the error of the stored scales.
    returns: scale fp32 [N, G] (or [1, 1] per tensor), zero_point int32 [N, G] or None if symmetric.
    """
    if scheme.type != "int":
        raise ValueError("compute_qparams is for int schemes; use fp8_scale for float schemes")
    wg = _grouped(w, scheme)
    wmin = wg.amin(dim=-1).clamp(max=0.0)  # [N, G]
    wmax = wg.amax(dim=-1).clamp(min=0.0)
    if clip_ratio is not None:
        wmin, wmax = wmin * clip_ratio, wmax * clip_ratio
    return _range_qparams(wmin, wmax, scheme, symmetric_scale, scale_dtype)


def _range_qparams(wmin: torch.Tensor, wmax: torch.Tensor, scheme: QuantScheme, symmetric_scale: str,
                   scale_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """compute_qparams from the groups' ranges: wmin <= 0 <= wmax, fp32 [N, G]."""
    if scheme.symmetric:
        amax = torch.maximum(-wmin, wmax)
        if symmetric_scale not in SYMMETRIC_SCALE_RULES:
            raise ValueError(f"symmetric_scale must be one of {SYMMETRIC_SCALE_RULES}, got {symmetric_scale!r}")
        if symmetric_scale == "signed":
            divisor = torch.where(-wmin >= wmax, float(-scheme.qmin), float(scheme.qmax))
        else:
            divisor = scheme.qmax if symmetric_scale == "qmax" else (scheme.qmax - scheme.qmin) / 2
        scale = (amax / divisor).clamp(min=_EPS)
        return _stored(scale, scale_dtype), None
    scale = ((wmax - wmin) / (scheme.qmax - scheme.qmin)).clamp(min=_EPS)
    zero_point = torch.round(scheme.qmin - wmin / scale).clamp(scheme.qmin, scheme.qmax).to(torch.int32)
    return _stored(scale, scale_dtype), zero_point


def mse_clip_ratio(
    w: torch.Tensor, scheme: QuantScheme, *, importance: torch.Tensor | None = None, grid: int = 100,
    max_shrink: float = 0.8, symmetric_scale: str = "qmax", scale_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per (row, group) range shrink factor r in {1, 1 - 1/grid, ...} (down to 1 - max_shrink) whose
    quantization error sum_k importance_k * (w_k - Q_r(w_k))^2 is least (an MSE observer).

    w: [N, K] float; importance: [K] non-negative weight per input column (e.g. GPTQ's diag(H), the
    energy of each input), None for plain MSE. returns fp32 [N, G] factors for compute_qparams(clip_ratio=).
    The search stops early once no group has improved for _MSE_PATIENCE steps in a row.
    """
    if scheme.strategy == "tensor":
        raise ValueError("mse_clip_ratio is for channel and group schemes")
    wg = _grouped(w, scheme)  # [N, G, group]
    if importance is None:
        weight = torch.ones_like(wg[:1])
    else:
        weight = _grouped(importance.float().reshape(1, -1).to(w.device), scheme)  # [1, G, group]
    wmin = wg.amin(dim=-1).clamp(max=0.0)  # [N, G]
    wmax = wg.amax(dim=-1).clamp(min=0.0)
    best = torch.ones(wg.shape[:2], dtype=torch.float32, device=w.device)  # [N, G]
    best_err = torch.full_like(best, float("inf"))
    last_better = 0
    deq = torch.empty_like(wg, dtype=torch.float32)  # one buffer for every candidate: no fresh pages per step
    for i in range(max(1, int(round(max_shrink * grid)) + 1)):
        if i - last_better > _MSE_PATIENCE:
            break
        r = 1.0 - i / grid
        scale, zero = _range_qparams(wmin * r, wmax * r, scheme, symmetric_scale, scale_dtype)
        scale = scale.unsqueeze(-1)  # [N, G, 1]
        torch.div(wg, scale, out=deq).round_()
        if zero is not None:
            zero = zero.float().unsqueeze(-1)
            deq.add_(zero).clamp_(scheme.qmin, scheme.qmax).sub_(zero).mul_(scale)
        else:
            deq.clamp_(scheme.qmin, scheme.qmax).mul_(scale)
        err = deq.sub_(wg).pow_(2).mul_(weight).sum(dim=-1)  # [N, G]
        better = err < best_err
        if bool(better.any()):
            last_better = i
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, torch.full_like(best, r), best)
    return best


def _stored(scale: torch.Tensor, scale_dtype: torch.dtype | None) -> torch.Tensor:
    """fp32 scales rounded to their storage dtype (>= its smallest normal number); unchanged for None."""
    if scale_dtype is None:
        return scale
    return scale.to(scale_dtype).float().clamp(min=torch.finfo(scale_dtype).tiny)


def quantize(
    w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, scheme: QuantScheme
) -> torch.Tensor:
    """w: [N, K] float; scale/zero_point: [N, G]. returns int8 [N, K] in [qmin, qmax]."""
    n, k = w.shape
    wg = _grouped(w, scheme)  # [N, G, group]
    q = torch.round(wg / scale.float().unsqueeze(-1))
    if zero_point is not None:
        q = q + zero_point.float().unsqueeze(-1)
    return q.clamp(scheme.qmin, scheme.qmax).to(torch.int8).reshape(n, -1)[:, :k].contiguous()


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, scheme: QuantScheme
) -> torch.Tensor:
    """q: int [N, K]; scale/zero_point: [N, G]. returns fp32 [N, K] = (q - zp) * s."""
    n, k = q.shape
    qg = _grouped(q, scheme)  # [N, G, group]
    if zero_point is not None:
        qg = qg - zero_point.float().unsqueeze(-1)
    return (qg * scale.float().unsqueeze(-1)).reshape(n, -1)[:, :k]


def fake_quantize(w: torch.Tensor, scheme: QuantScheme, **qparam_kwargs) -> torch.Tensor:
    """Quantize-dequantize round trip with min-max qparams; same shape and dtype as w.

    qparam_kwargs: compute_qparams' options (clip_ratio, symmetric_scale, scale_dtype); on a GGUF grid
    (quantkit.gguf.grids) only clip_ratio applies (its fields are fp16 and 6-bit whatever the scale dtype).
    """
    if scheme.grid != "uniform":
        return grid_fake_quantize(w, scheme, clip_ratio=qparam_kwargs.get("clip_ratio"))
    scale, zp = compute_qparams(w, scheme, **qparam_kwargs)
    return dequantize(quantize(w, scale, zp, scheme), scale, zp, scheme).to(w.dtype)


# -- fp8 e4m3 (KV cache) ------------------------------------------------------------------------


def fp8_scale(absmax: torch.Tensor) -> torch.Tensor:
    """Per-tensor (or per-head) fp8 e4m3 scale from an absolute maximum: absmax / 448 (>= tiny eps)."""
    return (absmax.float() / FP8_E4M3_MAX).clamp(min=_EPS)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale saturated to +-448, cast to float8_e4m3fn (never NaN for finite inputs)."""
    return (x.float() / scale.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float8_e4m3fn * scale -> dtype."""
    return (q.float() * scale.float()).to(dtype)
