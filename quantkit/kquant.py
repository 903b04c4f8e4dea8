"""Weights on llama.cpp's Q4_K grid (QuantScheme grid "q4_k"): the fields, their search and their rounding.

A row of K inputs is K / 256 super-blocks of eight groups of 32. Group j of a super-block dequantizes as

    y = (d * sc_j) * u - (dmin * mn_j),   u in 0..15, sc_j and mn_j in 0..63, d and dmin fp16,

each product in fp32 first (ggml's dequantize_row_q4_K). The group's scale s_j = d * sc_j and minimum
m_j = dmin * mn_j (>= 0: the lowest level -m_j is <= 0) are floats, not an integer zero point, which is
why compressed-tensors cannot hold them and such weights are written as GGUF (kernels/gguf_blocks.py has
the byte layout). Every algorithm quantizes onto this grid directly, so the GGUF file holds exactly the
weights quantkit scored: the fields are chosen first (`grid_fields`), then each weight is rounded to its
group's levels (`quantize_onto`; GPTQ does this column by column, pushing the error onward).

All math is fp32 on [N, K] weights; the fields are shaped as gguf_blocks.pack_q4_k takes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPER_BLOCK = 256  # inputs per super-block
GROUP = 32  # inputs per group (sub-block)
LEVELS = 15  # u in 0..LEVELS
FIELD_MAX = 63  # 6-bit sub-block scales and minimums


@dataclass
class KQuantWeight:
    """A weight on the Q4_K grid: what an algorithm returns for a "q4_k" scheme.

    u: uint8 [N, K] in 0..15; d, dmin: fp16 [N, K/256]; sc, mn: uint8 [N, K/32] in 0..63; scheme: the
    QuantScheme (grid "q4_k") it was quantized with.
    """

    u: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor
    scheme: object

    def __post_init__(self) -> None:
        n, k = self.u.shape
        if k % SUPER_BLOCK:
            raise ValueError(f"Q4_K weights need K in whole super-blocks of {SUPER_BLOCK}, got K = {k}")
        for name, t, cols, dtype in (("d", self.d, k // SUPER_BLOCK, torch.float16),
                                     ("dmin", self.dmin, k // SUPER_BLOCK, torch.float16),
                                     ("sc", self.sc, k // GROUP, torch.uint8), ("mn", self.mn, k // GROUP, torch.uint8)):
            if tuple(t.shape) != (n, cols) or t.dtype != dtype:
                raise ValueError(f"{name}: expected {dtype} [{n}, {cols}], got {t.dtype} {tuple(t.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.u.shape)

    def scale(self) -> torch.Tensor:
        """fp32 [N, K/32]: d * sc_j, each group's step."""
        return group_scale(self.d, self.sc)

    def minimum(self) -> torch.Tensor:
        """fp32 [N, K/32]: dmin * mn_j, each group's minimum (its lowest level is minus it)."""
        return group_scale(self.dmin, self.mn)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K], as ggml's dequantize_row_q4_K computes it."""
        return dequantize(self.u, self.scale(), self.minimum())


def group_scale(super_value: torch.Tensor, field: torch.Tensor) -> torch.Tensor:
    """fp16 [N, S] super-block value times 6-bit [N, S*8] fields -> fp32 [N, S*8] (an exact product)."""
    return (super_value.float().repeat_interleave(SUPER_BLOCK // GROUP, dim=1) * field.float())


def _groups(x: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, K/32, 32]."""
    return x.reshape(x.shape[0], -1, GROUP)


def dequantize(u: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """u [N, K] levels, scale / minimum fp32 [N, K/32] -> fp32 [N, K] = scale * u - minimum."""
    y = _groups(u.float()) * scale.unsqueeze(-1) - minimum.unsqueeze(-1)
    return y.reshape(u.shape)


def quantize_onto(w: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The nearest level of each weight: w [N, K] with scale / minimum fp32 [N, K/32] (or one column: w,
    scale, minimum [N]) -> fp32 levels in 0..15, round((w + m) / s) clamped; 0 where a group's scale is 0."""
    column = w.dim() == 1
    x = w.float().unsqueeze(-1) if column else _groups(w.float())
    s, m = scale.unsqueeze(-1), minimum.unsqueeze(-1)
    u = torch.round((x + m) / torch.where(s > 0, s, torch.ones_like(s))).clamp_(0, LEVELS)
    u = torch.where(s > 0, u, torch.zeros_like(u))
    return u.squeeze(-1) if column else u.reshape(w.shape)


def super_block_fields(scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Float group steps and minimums (>= 0) fp32 [N, K/32] -> the 6-bit grid nearest them, as
    llama.cpp's quantize_row_q4_K_ref rounds them: sc_j = round(63 / max_j s_j * s_j) (<= 63), d = fp16(max_j
    s_j / 63), and likewise mn_j and dmin. returns (d, dmin fp16 [N, K/256], sc, mn uint8 [N, K/32])."""
    n = scale.shape[0]
    per = SUPER_BLOCK // GROUP
    out = []
    for values in (scale, minimum):
        v = values.reshape(n, -1, per)  # [N, S, 8]
        top = v.amax(dim=-1, keepdim=True)  # [N, S, 1]
        inv = torch.where(top > 0, FIELD_MAX / top.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(top))
        field = torch.round(inv * v).clamp_(0, FIELD_MAX).to(torch.uint8).reshape(n, -1)
        out.append(((top / FIELD_MAX).squeeze(-1).to(torch.float16), field))
    (d, sc), (dmin, mn) = out
    if not (torch.isfinite(d).all() and torch.isfinite(dmin).all()):
        raise ValueError("a Q4_K super-block scale does not fit in fp16 (weights above ~4e6 in magnitude)")
    return d, dmin, sc, mn


def minmax_ranges(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's min-max range as a float step and minimum: w [N, K] -> (s, m) fp32 [N, K/32],
    s = (max - min) / 15 and m = -min with the range stretched to include 0."""
    g = _groups(w.float())
    lo = g.amin(dim=-1).clamp(max=0.0)
    hi = g.amax(dim=-1).clamp(min=0.0)
    return (hi - lo) / LEVELS, -lo


def grid_fields(w: torch.Tensor, clip_ratio: torch.Tensor | float | None = None) -> tuple[torch.Tensor, ...]:
    """The Q4_K fields of a weight: (d, dmin, sc, mn) from each group's min-max range (shrunk by
    clip_ratio, a scalar or fp32 [N, K/32], as AWQ's clip search does), rounded to the 6-bit grid
    (super_block_fields). w: float [N, K], K % 256 == 0."""
    if w.dim() != 2 or w.shape[1] % SUPER_BLOCK:
        raise ValueError(f"Q4_K weights need [N, K] with K in whole super-blocks of {SUPER_BLOCK}, got {tuple(w.shape)}")
    s, m = minmax_ranges(w)
    if clip_ratio is not None:
        s, m = s * clip_ratio, m * clip_ratio
    return super_block_fields(s, m)


def searched_fields(w: torch.Tensor, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The Q4_K fields llama.cpp's own quantizer chooses (quantkit.gguf_reference_quants: make_qkx2_quants'
    weighted least-squares search of each group's step and minimum, or with `importance` [K] the imatrix
    path's make_qkx3_quants / make_qp_quants): (d, dmin, sc, mn) as grid_fields returns them."""
    from .gguf_reference_quants import q4_k_fields

    return q4_k_fields(w.float(), None if importance is None else importance.float())[1:]


def kquant_weight(w: torch.Tensor, scheme, fields: tuple[torch.Tensor, ...] | None = None,
                  **grid_options) -> KQuantWeight:
    """Round-to-nearest onto the Q4_K grid: w float [N, K] -> KQuantWeight (fields from
    grid_fields(w, **grid_options) unless given as (d, dmin, sc, mn))."""
    d, dmin, sc, mn = fields if fields is not None else grid_fields(w, **grid_options)
    u = quantize_onto(w, group_scale(d, sc), group_scale(dmin, mn))
    return KQuantWeight(u.to(torch.uint8), d, dmin, sc, mn, scheme)


def fake_quantize(w: torch.Tensor, **grid_options) -> torch.Tensor:
    """Round trip onto the Q4_K grid: same shape and dtype as w [N, K] (grid_options: grid_fields')."""
    return kquant_weight(w, None, **grid_options).dequantize().to(w.dtype)
