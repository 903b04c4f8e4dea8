"""Weights on llama.cpp's Q4_K grid (QuantScheme grid "q4_k"), and on GGUF's Q4_1 grid with a float minimum
(grid "q4_1", what a q4_k recipe gives a linear whose inputs are no whole super-block): the fields, their
search and their rounding.

A row of K inputs is K / 256 super-blocks of eight groups of 32. Group j of a super-block dequantizes as

    y = (d * sc_j) * u - (dmin * mn_j),   u in 0..15, sc_j and mn_j in 0..63, d and dmin fp16,

each product in fp32 first (ggml's dequantize_row_q4_K). The group's scale s_j = d * sc_j and minimum
m_j = dmin * mn_j (>= 0: the lowest level -m_j is <= 0) are floats, not an integer zero point, which is
why compressed-tensors cannot hold them and such weights are written as GGUF (kernels/gguf_blocks.py has
the byte layout). Every algorithm quantizes onto this grid directly, so the GGUF file holds exactly the
weights quantkit scored: the fields are chosen first (`grid_fields`), then each weight is rounded to its
group's levels (`quantize_onto`; GPTQ does this column by column, pushing the error onward).

Q4_1 (blocks of 32): y = d * u + m with fp16 d and m per group, u in 0..15: a float minimum too (the group's
step s = d, minimum -m), without the super-block's 6-bit rounding.

Each grid is a class (KQuantWeight, Q41Weight) with the same verbs: `choose_fields(w, ...)` -> fields,
`steps(*fields)` -> (scale, minimum) fp32 [N, K/32], `round(w, fields, scheme)` -> the weight, and on the
weight `dequantize()` and `blocks()` (the GGUF blocks, kernels/gguf_blocks.py). GRID_WEIGHTS maps a
scheme's grid to its class. All math is fp32 on [N, K] weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import gguf_blocks

SUPER_BLOCK = 256  # inputs per super-block
GROUP = 32  # inputs per group (sub-block)
LEVELS = 15  # u in 0..LEVELS
FIELD_MAX = 63  # 6-bit sub-block scales and minimums


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


def _check_fields(n: int, k: int, block: int, fields) -> None:
    """ValueError unless each (name, tensor, columns per row, dtype) of `fields` has that shape and dtype."""
    if k % block:
        raise ValueError(f"these weights need K in whole blocks of {block}, got K = {k}")
    for name, t, cols, dtype in fields:
        if tuple(t.shape) != (n, cols) or t.dtype != dtype:
            raise ValueError(f"{name}: expected {dtype} [{n}, {cols}], got {t.dtype} {tuple(t.shape)}")


def _ranges(w: torch.Tensor, clip_ratio, include_zero: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's (lo, hi) fp32 [N, K/32], stretched to include 0 if include_zero, shrunk by clip_ratio
    (a scalar or [N, K/32], as AWQ's clip search does)."""
    g = _groups(w.float())
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    if include_zero:
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    if clip_ratio is not None:
        lo, hi = lo * clip_ratio, hi * clip_ratio
    return lo, hi


class _OnGrid:
    """What both grids' weights share: levels `u` uint8 [N, K], the fields FIELDS, and a scheme."""

    FIELDS: tuple[str, ...] = ()

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.u.shape)

    def fields(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.FIELDS)

    @classmethod
    def round(cls, w: torch.Tensor, fields, scheme):
        """Round-to-nearest of w [N, K] onto the grid of `fields`."""
        return cls(quantize_onto(w, *cls.steps(*fields)).to(torch.uint8), *fields, scheme=scheme)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K], as ggml's dequantize_row_* computes it."""
        return dequantize(self.u, *self.steps(*self.fields()))


@dataclass
class KQuantWeight(_OnGrid):
    """A weight on the Q4_K grid: what an algorithm returns for a "q4_k" scheme.

    u: uint8 [N, K] in 0..15; d, dmin: fp16 [N, K/256]; sc, mn: uint8 [N, K/32] in 0..63; scheme: the
    QuantScheme (grid "q4_k") it was quantized with.
    """

    FIELDS = ("d", "dmin", "sc", "mn")

    u: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor
    scheme: object

    def __post_init__(self) -> None:
        n, k = self.u.shape
        _check_fields(n, k, SUPER_BLOCK, (
            ("d", self.d, k // SUPER_BLOCK, torch.float16), ("dmin", self.dmin, k // SUPER_BLOCK, torch.float16),
            ("sc", self.sc, k // GROUP, torch.uint8), ("mn", self.mn, k // GROUP, torch.uint8)))

    @staticmethod
    def steps(d, dmin, sc, mn) -> tuple[torch.Tensor, torch.Tensor]:
        """(d * sc_j, dmin * mn_j) fp32 [N, K/32]: each group's step and minimum (its lowest level is minus it)."""
        return group_scale(d, sc), group_scale(dmin, mn)

    @staticmethod
    def choose_fields(w: torch.Tensor, *, search: bool = False, importance: torch.Tensor | None = None,
                      clip_ratio=None) -> tuple[torch.Tensor, ...]:
        """(d, dmin, sc, mn) of w [N, K] (K % 256 == 0): with search, llama.cpp's own (searched_fields, weighted
        by `importance` [K] where given); else each group's min-max range (shrunk by clip_ratio), rounded
        to the 6-bit grid (super_block_fields)."""
        if w.dim() != 2 or w.shape[1] % SUPER_BLOCK:
            raise ValueError(f"Q4_K weights need [N, K] with K in whole super-blocks of {SUPER_BLOCK}, "
                             f"got {tuple(w.shape)}")
        if search:
            return searched_fields(w, importance)
        lo, hi = _ranges(w, clip_ratio, include_zero=True)
        return super_block_fields((hi - lo) / LEVELS, -lo)

    def blocks(self) -> torch.Tensor:
        """uint8 [N, K/256 * 144]: the Q4_K blocks."""
        return gguf_blocks.pack_q4_k(self.u, self.d, self.dmin, self.sc, self.mn)


@dataclass
class Q41Weight(_OnGrid):
    """A weight on GGUF's Q4_1 grid: u uint8 [N, K] in 0..15; d, m fp16 [N, K/32] (y = d * u + m); scheme:
    the QuantScheme (grid "q4_1")."""

    FIELDS = ("d", "m")

    u: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    scheme: object

    def __post_init__(self) -> None:
        n, k = self.u.shape
        _check_fields(n, k, GROUP, (("d", self.d, k // GROUP, torch.float16), ("m", self.m, k // GROUP, torch.float16)))

    @staticmethod
    def steps(d, m) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, -m) fp32 [N, K/32]: each group's step and minimum."""
        return d.float(), -m.float()

    @staticmethod
    def choose_fields(w: torch.Tensor, *, search: bool = False, importance: torch.Tensor | None = None,
                      clip_ratio=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, m) of w [N, K] (K % 32 == 0) from each group's min-max range (shrunk by clip_ratio), as
        llama.cpp's quantize_row_q4_1_ref: d = fp16((max - min) / 15), m = fp16(min). search and importance:
        accepted for the common interface; Q4_1's fields are its min-max range."""
        if w.dim() != 2 or w.shape[1] % GROUP:
            raise ValueError(f"Q4_1 weights need [N, K] with K in whole blocks of {GROUP}, got {tuple(w.shape)}")
        lo, hi = _ranges(w, clip_ratio, include_zero=False)
        d, m = ((hi - lo) / LEVELS).to(torch.float16), lo.to(torch.float16)
        if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
            raise ValueError("a Q4_1 block scale or minimum does not fit in fp16 (weights above ~6e4 in magnitude)")
        return d, m

    def blocks(self) -> torch.Tensor:
        """uint8 [N, K/32 * 20]: the Q4_1 blocks."""
        return gguf_blocks.pack_q4_1(self.u, self.d, self.m)


#: a scheme's grid -> the class of its weights
GRID_WEIGHTS = {"q4_k": KQuantWeight, "q4_1": Q41Weight}
GridWeight = KQuantWeight | Q41Weight


def group_scale(super_value: torch.Tensor, field: torch.Tensor) -> torch.Tensor:
    """fp16 [N, S] super-block value times 6-bit [N, S*8] fields -> fp32 [N, S*8] (an exact product)."""
    return (super_value.float().repeat_interleave(SUPER_BLOCK // GROUP, dim=1) * field.float())


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


def searched_fields(w: torch.Tensor, importance: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The Q4_K fields llama.cpp's own quantizer chooses (quantkit.gguf_reference_quants: make_qkx2_quants'
    weighted least-squares search of each group's step and minimum, or with `importance` [K] the imatrix
    path's make_qkx3_quants / make_qp_quants): (d, dmin, sc, mn)."""
    from .gguf_reference_quants import q4_k_fields

    return q4_k_fields(w.float(), None if importance is None else importance.float())[1:]


def grid_weight(w: torch.Tensor, scheme, **field_options) -> GridWeight:
    """Round-to-nearest of w float [N, K] onto the scheme's grid, fields chosen by choose_fields(**field_options)."""
    cls = GRID_WEIGHTS[scheme.grid]
    return cls.round(w, cls.choose_fields(w, **field_options), scheme)


def fake_quantize(w: torch.Tensor, scheme, clip_ratio=None) -> torch.Tensor:
    """Round trip onto the scheme's grid from the min-max ranges (shrunk by clip_ratio): same shape and
    dtype as w [N, K]."""
    return grid_weight(w, scheme, clip_ratio=clip_ratio).dequantize().to(w.dtype)
