"""Weights on llama.cpp's block types as grids (QuantScheme grid "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_1",
"q5_1", "q4_0", "q5_0", "q8_0", "iq4_nl", "iq4_xs"; their records in quantkit/gguf/types.py): the fields, their
search and their rounding.

The K-quants: a row of K inputs is K / 256 super-blocks. Q4_K and Q5_K have eight groups of 32; group j
dequantizes as

    y = (d * sc_j) * u - (dmin * mn_j),   u in 0..15 (Q5_K: 0..31), sc_j and mn_j in 0..63, d and dmin fp16,

each product in fp32 first (ggml's dequantize_row_q4_K). The group's scale s_j = d * sc_j and minimum
m_j = dmin * mn_j (>= 0: the lowest level -m_j is <= 0) are floats, not an integer zero point, which is
why compressed-tensors cannot hold them and such weights are written as GGUF (quantkit/gguf/blocks.py has
the byte layouts). Q2_K is the same with sixteen groups of 16, u in 0..3 and 4-bit sc_j, mn_j (0..15).
Q6_K has sixteen groups of 16, symmetric: y = (d * sc_j) * (u - 32), u in 0..63, sc_j int8; Q3_K likewise
with y = (d * sc_j) * (u - 4), u in 0..7, sc_j a 6-bit signed -32..31.

The blocks of 32: Q4_1 / Q5_1 y = d * u + m (fp16 d and m per group, u in 0..15 / 0..31: a float minimum
without the super-block's 6-bit rounding); Q4_0 y = d * (u - 8), Q5_0 y = d * (u - 16) and Q8_0 y = d * (u - 128)
(fp16 d; llama.cpp's signed scales: the extreme of either sign may take the lowest level).

The non-uniform grids: IQ4_NL y = d * VALUES[u] (fp16 d per 32, u in 0..15 an index into ggml's 16 values
kvalues_iq4nl, -127..113, denser near 0) and IQ4_XS y = (d * sc_j) * VALUES[u] (fp16 d per 256, sc_j a 6-bit
signed -32..31 per 32). Their "nearest level" is the nearest value (ggml's best_index_int8), not a rounding
of a quotient; their LevelGrid carries the values. Their fields are
llama.cpp's (quantize_row_*_ref's, or its imatrix search); each weight then goes to the nearest level of the
stored fp16 fields, where llama.cpp rounds against its fp32 ones before storing them: 0.04-0.6% of the
weights sat one level apart on random weights, each no farther from its value than llama.cpp's.

Every algorithm quantizes onto these grids directly, so the GGUF file holds exactly the weights quantkit
scored: the fields are chosen first (`choose_fields`), then each weight is rounded to its group's levels
(`quantize_onto`; GPTQ does this column by column, pushing the error onward).

Each grid is a class with the same verbs: `choose_fields(w, search=, importance=, clip_ratio=)` -> fields,
`steps(*fields)` -> (scale, minimum) fp32 [N, K/group] (y = scale * u - minimum), `quantize_onto(w, scale,
minimum)` -> levels, `round(w, fields, scheme)` -> the weight, `from_blocks(data)` -> the weight GGUF blocks
hold, and on the weight `dequantize()` (as ggml computes it: quantkit's one ggml dequantization, which
`dequantize_blocks` runs on bytes) and `blocks()` (the GGUF blocks). GRID_WEIGHTS maps a scheme's grid to its
class. All math is fp32 on [N, K] weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.level_grid import LevelGrid
from . import blocks, reference_quants
from .types import BLOCK, GGML_TYPES, SUPER_BLOCK, GgmlType

GROUP = BLOCK  # inputs per group (sub-block) of every grid but Q2_K's, Q3_K's and Q6_K's 16
FIELD_MAX = 63  # 6-bit sub-block scales and minimums (Q4_K, Q5_K)


def _groups(x: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """[N, K] -> [N, K/group, group] (zero rows too)."""
    return x.reshape(x.shape[0], x.shape[1] // group, group)


def _check_fields(n: int, k: int, block: int, fields) -> None:
    """ValueError unless each (name, tensor, columns per row, dtype) of `fields` has that shape and dtype."""
    if k % block:
        raise ValueError(f"these weights need K in whole blocks of {block}, got K = {k}")
    for name, t, cols, dtype in fields:
        if tuple(t.shape) != (n, cols) or t.dtype != dtype:
            raise ValueError(f"{name}: expected {dtype} [{n}, {cols}], got {t.dtype} {tuple(t.shape)}")


def _ranges(w: torch.Tensor, clip_ratio, include_zero: bool, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's (lo, hi) fp32 [N, K/group], stretched to include 0 if include_zero, shrunk by clip_ratio
    (a scalar or [N, K/group], as AWQ's clip search does)."""
    g = _groups(w.float(), group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    if include_zero:
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    if clip_ratio is not None:
        lo, hi = lo * clip_ratio, hi * clip_ratio
    return lo, hi


def _signed_extremes(w: torch.Tensor, clip_ratio, group: int) -> torch.Tensor:
    """Each group's weight of largest magnitude, its sign kept (the first such one, as ggml's loops take it),
    shrunk by clip_ratio: fp32 [N, K/group]."""
    g = _groups(w.float(), group)
    idx = g.abs().argmax(dim=-1, keepdim=True)
    top = g.gather(-1, idx).squeeze(-1)
    return top if clip_ratio is None else top * clip_ratio


def _fp16(x: torch.Tensor, what: str) -> torch.Tensor:
    out = x.to(torch.float16)
    if not torch.isfinite(out).all():
        raise ValueError(f"{what} does not fit in fp16 (weights too large in magnitude)")
    return out


class _OnGrid:
    """What every grid's weights share: levels `u` uint8 [N, K] in 0..LEVELS, the fields FIELDS (each one value
    per group of GROUP or per block of BLOCK inputs of a row), and a scheme. OFFSET: for a symmetric grid, the
    level of 0 (y = scale * (u - OFFSET)); None for a grid with a float minimum (y = scale * u - minimum) and for
    a non-uniform one (VALUES: y = scale * VALUES[u], IQ4_NL and IQ4_XS).
    Each grid's class names its ggml type's record (TYPE, quantkit/gguf/types.py), which gives it GGUF_TYPE,
    BLOCK, GROUP, LEVELS and OFFSET. A quantized weight (quantkit.core.quantized_weight.Quantized) that a
    GgufLinear holds as its GGUF blocks, whose fp16 and 6-bit fields are the same whatever the model dtype."""

    LAYER = "quantkit.gguf.linear:GgufLinear"
    FIELDS: tuple[str, ...] = ()
    TYPE: GgmlType
    UNPACK: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]  # blocks.py's reading: bytes -> (values, *FIELDS)
    GGUF_TYPE: str
    BLOCK: int  # inputs per GGUF block
    GROUP: int
    LEVELS: int
    OFFSET: int | None
    VALUES: torch.Tensor | None  # a non-uniform grid's level values (fp32 [LEVELS + 1], ascending), else None

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        t = cls.TYPE
        cls.GGUF_TYPE, cls.BLOCK, cls.GROUP = t.name, t.block, t.group_size
        cls.LEVELS = (1 << t.num_bits) - 1
        cls.VALUES = None if t.values is None else torch.tensor(t.values, dtype=torch.float32)
        cls.OFFSET = 1 << (t.num_bits - 1) if t.symmetric and t.values is None else None

    @classmethod
    def integer_fields(cls) -> tuple[tuple[str, str, str, int, int], ...]:
        """The grid's integer fields per group, each a multiple of a super-block's float (what
        algorithms/refine.refine_fields moves): (field, the super-block field it multiplies, "scale" or
        "minimum", its lowest value, its highest); () for a grid without such fields."""
        return ()

    @classmethod
    def float_fields(cls) -> tuple[tuple[str, str, str | None], ...]:
        """The grid's float fields, one per block of BLOCK inputs (what refine.refine_fields moves after the
        integers): (field, how one unit of it changes a weight: "scale" by the weight's level value less
        OFFSET, "minimum" by -1, "offset" by +1; the integer field per group that multiplies it, or None)."""
        return (("d", "scale", None),)

    @classmethod
    def level_values(cls, u: torch.Tensor) -> torch.Tensor:
        """fp32 levels (whole numbers 0..LEVELS, any shape) -> the values they stand for: the levels themselves on
        a uniform grid (y = scale * u - minimum), VALUES[u] on a non-uniform one (y = scale * VALUES[u])."""
        return u.float() if cls.VALUES is None else cls.VALUES.to(u.device)[u.long()]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.u.shape)

    def fields(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.FIELDS)

    def fields_rounded_to(self, dtype: torch.dtype) -> "_OnGrid":
        """The weight itself: its blocks keep their fp16 and 6-bit fields in every model dtype."""
        return self

    def level_grid(self) -> LevelGrid:
        """The weight as a core.level_grid.LevelGrid: y = scale * u - minimum per group of GROUP (scale * VALUES[u]
        on a non-uniform grid)."""
        scale, minimum = self.steps(*self.fields())
        column_group = torch.arange(self.u.shape[1], device=self.u.device) // self.GROUP
        values = None if self.VALUES is None else self.VALUES.to(self.u.device)
        return LevelGrid(self.u.float(), scale, minimum, column_group, 0.0, float(self.LEVELS), values)

    def with_levels(self, levels: torch.Tensor) -> "_OnGrid":
        """The same fields with other levels (fp32 [N, K], whole numbers in 0..LEVELS)."""
        return dataclasses.replace(self, u=levels.to(torch.uint8))

    def _check(self, fields) -> None:
        n, k = self.u.shape
        _check_fields(n, k, self.BLOCK, [(name, getattr(self, name), k // per, dtype) for name, per, dtype in fields])

    @classmethod
    def quantize_onto(cls, w: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
        """The nearest level of each weight: w [N, K] with scale / minimum fp32 [N, K/GROUP] (or one column: w,
        scale, minimum [N]) -> fp32 levels in 0..LEVELS: round((w + m) / s), or round(w / s) + OFFSET on a
        symmetric grid (ggml's nearest_int of the same quotient), clamped; 0 where a group's scale is 0. On a
        non-uniform grid the index of the value nearest (w + m) / s (ggml's best_index_int8: a tie to the upper
        value), the index of the value nearest 0 where the scale is 0."""
        column = w.dim() == 1
        x = w.float().unsqueeze(-1) if column else _groups(w.float(), cls.GROUP)
        s, m = scale.unsqueeze(-1), minimum.unsqueeze(-1)
        safe = torch.where(s != 0, s, torch.ones_like(s))
        if cls.VALUES is not None:  # the nearest value to (w + m) / s by ggml's rule; the value nearest 0 where s is 0
            ratio = torch.where(s != 0, (x + m) / safe, torch.zeros_like(x))
            u = reference_quants.best_index_iq4(ratio).float()
        else:
            u = torch.round(x / safe) + cls.OFFSET if cls.OFFSET is not None else torch.round((x + m) / safe)
            u = torch.where(s != 0, u.clamp_(0, cls.LEVELS), torch.zeros_like(u))
        return u.squeeze(-1) if column else u.reshape(w.shape)

    @classmethod
    def round(cls, w: torch.Tensor, fields, scheme):
        """Round-to-nearest of w [N, K] onto the grid of `fields`."""
        return cls(cls.quantize_onto(w, *cls.steps(*fields)).to(torch.uint8), *fields, scheme=scheme)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K], as ggml's dequantize_row_* computes it (for the symmetric grids scale * (u - OFFSET),
        an exact integer times the scale; for the non-uniform ones scale * VALUES[u], one rounding)."""
        scale, minimum = self.steps(*self.fields())
        u = _groups(self.level_values(self.u), self.GROUP)  # a new tensor, computed on in place
        if self.OFFSET is not None:
            y = u.sub_(self.OFFSET).mul_(scale.unsqueeze(-1))
        else:
            y = u.mul_(scale.unsqueeze(-1)).sub_(minimum.unsqueeze(-1))
        return y.reshape(self.u.shape)

    def blocks(self) -> torch.Tensor:
        """uint8 [N, K / BLOCK * block bytes]: the GGUF blocks of GGUF_TYPE."""
        raise NotImplementedError

    @classmethod
    def from_blocks(cls, data: torch.Tensor, scheme=None) -> "_OnGrid":
        """The weight that GGUF blocks of GGUF_TYPE (uint8 [N, K / BLOCK * block bytes]) hold: blocks.py's reading
        of the bytes (UNPACK), whose signed values (int8: Q4_0, Q8_0, Q3_K, Q6_K) are levels less OFFSET.
        scheme: the QuantScheme to record (None for blocks read back without one)."""
        values, *fields = cls.UNPACK(data)
        u = values if values.dtype == torch.uint8 else values.view(torch.uint8) + cls.OFFSET  # mod 256: q + OFFSET
        return cls(u, *fields, scheme=scheme)


@dataclass
class KQuantWeight(_OnGrid):
    """A weight on the Q4_K grid: what an algorithm returns for a "q4_k" scheme.

    u: uint8 [N, K] in 0..15; d, dmin: fp16 [N, K/256]; sc, mn: uint8 [N, K/32] in 0..63; scheme: the
    QuantScheme (grid "q4_k") it was quantized with.
    """

    FIELDS = ("d", "dmin", "sc", "mn")
    TYPE = GGML_TYPES["Q4_K"]
    UNPACK = staticmethod(blocks.unpack_q4_k)
    FIELD_MAX = FIELD_MAX  # the largest sc / mn

    u: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor
    scheme: object

    def __post_init__(self) -> None:
        self._check((("d", self.BLOCK, torch.float16), ("dmin", self.BLOCK, torch.float16),
                     ("sc", self.GROUP, torch.uint8), ("mn", self.GROUP, torch.uint8)))

    @classmethod
    def steps(cls, d, dmin, sc, mn) -> tuple[torch.Tensor, torch.Tensor]:
        """(d * sc_j, dmin * mn_j) fp32 [N, K/GROUP]: each group's step and minimum (its lowest level is minus it)."""
        return group_scale(d, sc, cls.GROUP), group_scale(dmin, mn, cls.GROUP)

    @classmethod
    def integer_fields(cls) -> tuple[tuple[str, str, str, int, int], ...]:
        return ("sc", "d", "scale", 0, cls.FIELD_MAX), ("mn", "dmin", "minimum", 0, cls.FIELD_MAX)

    @classmethod
    def float_fields(cls) -> tuple[tuple[str, str, str | None], ...]:
        return ("d", "scale", "sc"), ("dmin", "minimum", "mn")

    @classmethod
    def choose_fields(cls, w: torch.Tensor, *, search: bool = False, importance: torch.Tensor | None = None,
                      clip_ratio=None) -> tuple[torch.Tensor, ...]:
        """(d, dmin, sc, mn) of w [N, K] (K % 256 == 0): with search, llama.cpp's own (searched_fields, weighted
        by `importance` [K] where given); else each group's min-max range (shrunk by clip_ratio), rounded
        to the 6-bit (Q2_K: 4-bit) grid (super_block_fields)."""
        _need_blocks(w, cls)
        if search:
            return searched_fields(w, importance, cls.GGUF_TYPE)
        lo, hi = _ranges(w, clip_ratio, include_zero=True, group=cls.GROUP)
        return super_block_fields((hi - lo) / cls.LEVELS, -lo, cls.GROUP, cls.FIELD_MAX)

    def blocks(self) -> torch.Tensor:
        """uint8 [N, K/256 * 144]: the Q4_K blocks."""
        return blocks.pack_q4_k(self.u, self.d, self.dmin, self.sc, self.mn)


@dataclass
class Q5KWeight(KQuantWeight):
    """A weight on the Q5_K grid: as KQuantWeight with u in 0..31 (grid "q5_k")."""

    TYPE = GGML_TYPES["Q5_K"]
    UNPACK = staticmethod(blocks.unpack_q5_k)

    def blocks(self) -> torch.Tensor:
        """uint8 [N, K/256 * 176]: the Q5_K blocks."""
        return blocks.pack_q5_k(self.u, self.d, self.dmin, self.sc, self.mn)


@dataclass
class Q2KWeight(KQuantWeight):
    """A weight on the Q2_K grid (grid "q2_k"): as KQuantWeight with sixteen groups of 16 a super-block, u in
    0..3 and sc, mn uint8 [N, K/16] in 0..15."""

    TYPE = GGML_TYPES["Q2_K"]
    UNPACK = staticmethod(blocks.unpack_q2_k)
    FIELD_MAX = 15

    def blocks(self) -> torch.Tensor:
        """uint8 [N, K/256 * 84]: the Q2_K blocks."""
        return blocks.pack_q2_k(self.u, self.d, self.dmin, self.sc, self.mn)


@dataclass
class Q6KWeight(_OnGrid):
    """A weight on the Q6_K grid (grid "q6_k"): u uint8 [N, K] in 0..63 (q = u - 32); d fp16 [N, K/256];
    sc int8 [N, K/16]: y = (d * sc_j) * (u - 32)."""

    FIELDS = ("d", "sc")
    TYPE = GGML_TYPES["Q6_K"]
    UNPACK = staticmethod(blocks.unpack_q6_k)
    SCALE_LEVELS = 128  # sc in -SCALE_LEVELS..SCALE_LEVELS-1

    u: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor
    scheme: object

    def __post_init__(self) -> None:
        self._check((("d", self.BLOCK, torch.float16), ("sc", self.GROUP, torch.int8)))

    @classmethod
    def steps(cls, d, sc) -> tuple[torch.Tensor, torch.Tensor]:
        """(d * sc_j, OFFSET * d * sc_j) fp32 [N, K/16]."""
        s = group_scale(d, sc, 16)
        return s, cls.OFFSET * s

    @classmethod
    def integer_fields(cls) -> tuple[tuple[str, str, str, int, int], ...]:
        return (("sc", "d", "scale", -cls.SCALE_LEVELS, cls.SCALE_LEVELS - 1),)

    @classmethod
    def float_fields(cls) -> tuple[tuple[str, str, str | None], ...]:
        return (("d", "scale", "sc"),)

    @classmethod
    def choose_fields(cls, w: torch.Tensor, *, search: bool = False, importance: torch.Tensor | None = None,
                      clip_ratio=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, sc) of w [N, K] (K % 256 == 0): with search, llama.cpp's own (quantize_row_q6_K_ref's
        make_qx_quants, Q3_K's make_q3_quants, or their imatrix paths with `importance` [K]); else each group's
        signed extreme on -OFFSET (shrunk by clip_ratio), the scales rounded to int8 (Q3_K: 6 bits) against the
        super-block's largest, as quantize_row_q6_K_ref / q3_K_ref round them."""
        _need_blocks(w, cls)
        if search:
            return searched_fields(w, importance, cls.GGUF_TYPE)
        scale = _signed_extremes(w, clip_ratio, 16) / -cls.OFFSET  # [N, K/16]
        n = scale.shape[0]
        v = scale.reshape(n, -1, 16)
        top = v.gather(-1, v.abs().argmax(dim=-1, keepdim=True))  # [N, S, 1] the scale of largest magnitude
        zero = top.abs() < 1e-15
        levels = cls.SCALE_LEVELS
        iscale = torch.where(zero, torch.zeros_like(top), -levels / torch.where(zero, torch.ones_like(top), top))
        sc = torch.round(iscale * v).clamp_(-levels, levels - 1).to(torch.int8).reshape(n, -1)
        d = _fp16(torch.where(zero, torch.zeros_like(top), 1 / torch.where(zero, torch.ones_like(top), iscale)),
                  f"a {cls.GGUF_TYPE} super-block scale").squeeze(-1)
        return d, sc

    def blocks(self) -> torch.Tensor:
        """uint8 [N, K/256 * 210]: the Q6_K blocks."""
        return blocks.pack_q6_k(self.u.to(torch.int16) - 32, self.d, self.sc)


@dataclass
class Q3KWeight(Q6KWeight):
    """A weight on the Q3_K grid (grid "q3_k"): as Q6KWeight with u in 0..7 (q = u - 4) and sc int8 [N, K/16] in
    -32..31 (6 bits): y = (d * sc_j) * (u - 4)."""

    TYPE = GGML_TYPES["Q3_K"]
    UNPACK = staticmethod(blocks.unpack_q3_k)
    SCALE_LEVELS = 32

    def blocks(self) -> torch.Tensor:
        """uint8 [N, K/256 * 110]: the Q3_K blocks."""
        return blocks.pack_q3_k(self.u.to(torch.int16) - 4, self.d, self.sc)


@dataclass
class Q41Weight(_OnGrid):
    """A weight on GGUF's Q4_1 grid: u uint8 [N, K] in 0..15; d, m fp16 [N, K/32] (y = d * u + m); scheme:
    the QuantScheme (grid "q4_1")."""

    FIELDS = ("d", "m")
    TYPE = GGML_TYPES["Q4_1"]
    UNPACK = staticmethod(blocks.unpack_q4_1)

    u: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    scheme: object

    def __post_init__(self) -> None:
        self._check((("d", GROUP, torch.float16), ("m", GROUP, torch.float16)))

    @staticmethod
    def steps(d, m) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, -m) fp32 [N, K/32]: each group's step and minimum."""
        return d.float(), -m.float()

    @classmethod
    def float_fields(cls) -> tuple[tuple[str, str, str | None], ...]:
        return ("d", "scale", None), ("m", "offset", None)

    @classmethod
    def choose_fields(cls, w: torch.Tensor, *, search: bool = False, importance: torch.Tensor | None = None,
                      clip_ratio=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, m) of w [N, K] (K % 32 == 0) from each group's min-max range (shrunk by clip_ratio), as
        llama.cpp's quantize_row_q4_1_ref: d = fp16((max - min) / LEVELS), m = fp16(min); with search and an
        importance [K], llama.cpp's imatrix path (make_qkx3_quants' weighted least-squares search of the step
        and minimum, weights importance * sqrt(sigma^2 + x^2)); without importance llama.cpp has no search
        for these types, nor has this."""
        _need_blocks(w, cls)
        if search and importance is not None:
            d, m = reference_quants.q1_fields(w.float(), importance.float(), cls.LEVELS)
            return _fp16(d, f"a {cls.GGUF_TYPE} block scale"), _fp16(m, f"a {cls.GGUF_TYPE} block minimum")
        lo, hi = _ranges(w, clip_ratio, include_zero=False)
        return (_fp16((hi - lo) / cls.LEVELS, f"a {cls.GGUF_TYPE} block scale"),
                _fp16(lo, f"a {cls.GGUF_TYPE} block minimum"))

    def blocks(self) -> torch.Tensor:
        """uint8 [N, K/32 * 20]: the Q4_1 blocks."""
        return blocks.pack_q4_1(self.u, self.d, self.m)


@dataclass
class Q51Weight(Q41Weight):
    """A weight on GGUF's Q5_1 grid: as Q41Weight with u in 0..31 (grid "q5_1")."""

    TYPE = GGML_TYPES["Q5_1"]
    UNPACK = staticmethod(blocks.unpack_q5_1)

    def blocks(self) -> torch.Tensor:
        """uint8 [N, K/32 * 24]: the Q5_1 blocks."""
        return blocks.pack_q5_1(self.u, self.d, self.m)


@dataclass
class Q50Weight(_OnGrid):
    """A weight on GGUF's Q5_0 grid (grid "q5_0"): u uint8 [N, K] in 0..31; d fp16 [N, K/32] (negative where
    a group's extreme is positive): y = d * (u - 16)."""

    FIELDS = ("d",)
    TYPE = GGML_TYPES["Q5_0"]
    UNPACK = staticmethod(blocks.unpack_q5_0)

    u: torch.Tensor
    d: torch.Tensor
    scheme: object

    def __post_init__(self) -> None:
        self._check((("d", GROUP, torch.float16),))

    @classmethod
    def steps(cls, d) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, OFFSET * d) fp32 [N, K/32]."""
        return d.float(), cls.OFFSET * d.float()

    @classmethod
    def choose_fields(cls, w: torch.Tensor, *, search: bool = False, importance: torch.Tensor | None = None,
                      clip_ratio=None) -> tuple[torch.Tensor]:
        """(d,) of w [N, K] (K % 32 == 0): each group's signed extreme on the lowest level, d = extreme / -OFFSET
        (llama.cpp's quantize_row_q{4,5}_0_ref; shrunk by clip_ratio); with search and an importance [K],
        llama.cpp's imatrix path (make_qx_quants weighted by importance * sqrt(sigma^2 + x^2)); without
        importance llama.cpp has no search for these types, nor has this."""
        _need_blocks(w, cls)
        if search and importance is not None:
            return (_fp16(reference_quants.qx_scales(w.float(), importance.float(), cls.OFFSET), f"a {cls.GGUF_TYPE} scale"),)
        return (_fp16(_signed_extremes(w, clip_ratio, GROUP) / -cls.OFFSET, f"a {cls.GGUF_TYPE} block scale"),)

    def blocks(self) -> torch.Tensor:
        """uint8 [N, K/32 * 22]: the Q5_0 blocks."""
        return blocks.pack_q5_0(self.u, self.d)


@dataclass
class Q40Weight(Q50Weight):
    """A weight on GGUF's Q4_0 grid with llama.cpp's signed scales (grid "q4_0"): u uint8 [N, K] in 0..15;
    d fp16 [N, K/32]: y = d * (u - 8); the extreme of either sign may take -8 (a positive one through a
    negative d), which a positive scale cannot do (the uniform grid's `symmetric_scale: signed`)."""

    TYPE = GGML_TYPES["Q4_0"]
    UNPACK = staticmethod(blocks.unpack_q4_0)

    def blocks(self) -> torch.Tensor:
        """uint8 [N, K/32 * 18]: the Q4_0 blocks."""
        return blocks.pack_q4_0(self.u.to(torch.int16) - 8, self.d)


@dataclass
class Q80Weight(Q50Weight):
    """A weight on GGUF's Q8_0 grid (grid "q8_0"): u uint8 [N, K] (q = u - 128); d fp16 [N, K/32]: y = d * q,
    d = absmax / 127 as llama.cpp's quantize_row_q8_0_ref (Q8_0 has no importance-matrix search)."""

    TYPE = GGML_TYPES["Q8_0"]
    UNPACK = staticmethod(blocks.unpack_q8_0)

    @classmethod
    def choose_fields(cls, w: torch.Tensor, *, search: bool = False, importance: torch.Tensor | None = None,
                      clip_ratio=None) -> tuple[torch.Tensor]:
        """(d,) = fp16(absmax / 127) per group of 32 (shrunk by clip_ratio)."""
        _need_blocks(w, cls)
        lo, hi = _ranges(w, clip_ratio, include_zero=True)
        return (_fp16(torch.maximum(-lo, hi) / 127, "a Q8_0 block scale"),)

    def blocks(self) -> torch.Tensor:
        """uint8 [N, K/32 * 34]: the Q8_0 blocks."""
        return blocks.pack_q8_0(self.u.to(torch.int16) - 128, self.d)


@dataclass
class IQ4NLWeight(_OnGrid):
    """A weight on GGUF's non-uniform IQ4_NL grid (grid "iq4_nl"): u uint8 [N, K] in 0..15, an index into VALUES
    (ggml's kvalues_iq4nl, -127..113); d fp16 [N, K/32] of either sign: y = d * VALUES[u]."""

    FIELDS = ("d",)
    TYPE = GGML_TYPES["IQ4_NL"]
    UNPACK = staticmethod(blocks.unpack_iq4_nl)

    u: torch.Tensor
    d: torch.Tensor
    scheme: object

    def __post_init__(self) -> None:
        self._check((("d", GROUP, torch.float16),))

    @staticmethod
    def steps(d) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, 0) fp32 [N, K/32]."""
        return d.float(), torch.zeros_like(d, dtype=torch.float32)

    @classmethod
    def choose_fields(cls, w: torch.Tensor, *, search: bool = False, importance: torch.Tensor | None = None,
                      clip_ratio=None) -> tuple[torch.Tensor]:
        """(d,) of w [N, K] (K % 32 == 0): with search, llama.cpp's own (quantize_iq4_nl: the weighted least-squares
        scale over 16 trials, weights x^2, or with `importance` [K] importance * sqrt(sigma^2 + x^2)); else each
        block's signed extreme on the lowest value, d = extreme / -127 (shrunk by clip_ratio)."""
        _need_blocks(w, cls)
        if search:
            return (reference_quants.iq4_nl_fields(w.float(), None if importance is None else importance.float())[1],)
        return (_fp16(_signed_extremes(w, clip_ratio, GROUP) / cls.TYPE.values[0], "an IQ4_NL block scale"),)

    def blocks(self) -> torch.Tensor:
        """uint8 [N, K/32 * 18]: the IQ4_NL blocks."""
        return blocks.pack_iq4_nl(self.u, self.d)


@dataclass
class IQ4XSWeight(_OnGrid):
    """A weight on GGUF's non-uniform IQ4_XS grid (grid "iq4_xs"): u uint8 [N, K] in 0..15, an index into VALUES;
    d fp16 [N, K/256]; sc int8 [N, K/32] in -32..31 (6 bits): y = (d * sc_j) * VALUES[u]."""

    FIELDS = ("d", "sc")
    TYPE = GGML_TYPES["IQ4_XS"]
    UNPACK = staticmethod(blocks.unpack_iq4_xs)

    u: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor
    scheme: object

    def __post_init__(self) -> None:
        self._check((("d", self.BLOCK, torch.float16), ("sc", self.GROUP, torch.int8)))

    @classmethod
    def steps(cls, d, sc) -> tuple[torch.Tensor, torch.Tensor]:
        """(d * sc_j, 0) fp32 [N, K/32] (an exact product)."""
        s = group_scale(d, sc, cls.GROUP)
        return s, torch.zeros_like(s)

    @classmethod
    def integer_fields(cls) -> tuple[tuple[str, str, str, int, int], ...]:
        return (("sc", "d", "scale", -32, 31),)

    @classmethod
    def float_fields(cls) -> tuple[tuple[str, str, str | None], ...]:
        return (("d", "scale", "sc"),)

    @classmethod
    def choose_fields(cls, w: torch.Tensor, *, search: bool = False, importance: torch.Tensor | None = None,
                      clip_ratio=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, sc) of w [N, K] (K % 256 == 0): with search, llama.cpp's own (quantize_iq4_xs: IQ4_NL's search per
        sub-block of 32, with `importance` [K] where given); else each sub-block's signed extreme on the lowest
        value (extreme / -127, shrunk by clip_ratio). Either way the sub-block scales are then rounded to 6 bits
        against the super-block's largest, as quantize_row_iq4_nl_impl rounds them (d = -largest / 32)."""
        _need_blocks(w, cls)
        if search:
            return reference_quants.iq4_xs_fields(w.float(), None if importance is None else importance.float())[1:]
        scale = _signed_extremes(w, clip_ratio, GROUP) / cls.TYPE.values[0]  # [N, K/32]
        n = scale.shape[0]
        d, sc = reference_quants.iq4_super_block(scale.reshape(n, -1, 8))
        return _fp16(d, "an IQ4_XS super-block scale"), sc.to(torch.int8).reshape(n, -1)

    def blocks(self) -> torch.Tensor:
        """uint8 [N, K/256 * 136]: the IQ4_XS blocks."""
        return blocks.pack_iq4_xs(self.u, self.d, self.sc)


#: a scheme's grid -> the class of its weights
GRID_WEIGHTS = {cls.TYPE.grid: cls for cls in (Q2KWeight, Q3KWeight, KQuantWeight, Q5KWeight, Q6KWeight, Q41Weight,
                                               Q51Weight, Q40Weight, Q50Weight, Q80Weight, IQ4NLWeight, IQ4XSWeight)}
GridWeight = _OnGrid


def _need_blocks(w: torch.Tensor, cls) -> None:
    if w.dim() != 2 or w.shape[1] % cls.BLOCK:
        raise ValueError(f"{cls.GGUF_TYPE} weights need [N, K] with K in whole blocks of {cls.BLOCK}, "
                         f"got {tuple(w.shape)}")


def group_scale(super_value: torch.Tensor, field: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """fp16 [N, S] super-block value times integer [N, S*256/group] fields -> fp32 [N, S*256/group] (an exact
    product)."""
    n, per = field.shape[0], SUPER_BLOCK // group
    return (super_value.float().unsqueeze(-1) * field.float().reshape(n, field.shape[1] // per, per)).reshape(field.shape)


def super_block_fields(scale: torch.Tensor, minimum: torch.Tensor, group: int = GROUP,
                       field_max: int = FIELD_MAX) -> tuple[torch.Tensor, ...]:
    """Float group steps and minimums (>= 0) fp32 [N, K/group] -> the grid of integer fields 0..field_max
    nearest them, as llama.cpp's quantize_row_q4_K_ref (6 bits, groups of 32) and q2_K_ref (4 bits, groups of
    16) round them: sc_j = round(field_max / max_j s_j * s_j), d = fp16(max_j s_j / field_max), and likewise
    mn_j and dmin. returns (d, dmin fp16 [N, K/256], sc, mn uint8 [N, K/group])."""
    n = scale.shape[0]
    per = SUPER_BLOCK // group
    out = []
    for values in (scale, minimum):
        v = values.reshape(n, -1, per)  # [N, S, per]
        top = v.amax(dim=-1, keepdim=True)  # [N, S, 1]
        inv = torch.where(top > 0, field_max / top.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(top))
        field = torch.round(inv * v).clamp_(0, field_max).to(torch.uint8).reshape(n, -1)
        out.append((_fp16((top / field_max).squeeze(-1), "a K-quant super-block scale"), field))
    (d, sc), (dmin, mn) = out
    return d, dmin, sc, mn


def searched_fields(w: torch.Tensor, importance: torch.Tensor | None = None,
                    kind: str = "Q4_K") -> tuple[torch.Tensor, ...]:
    """The fields of K-quant `kind` (Q2_K ... Q6_K) llama.cpp's own quantizer chooses for w [N, K]
    (quantkit.gguf.reference_quants: e.g. Q4_K's make_qkx2_quants weighted least-squares search of each group's
    step and minimum, or with `importance` [K] the imatrix path's make_qkx3_quants / make_qp_quants): the
    grid's FIELDS, (d, dmin, sc, mn) or (d, sc)."""
    fields = getattr(reference_quants, f"{kind.lower()}_fields")
    return fields(w.float(), None if importance is None else importance.float())[1:]


def dequantize_blocks(data: torch.Tensor, kind: str) -> torch.Tensor:
    """uint8 blocks of ggml type `kind` [N, G*bytes] -> fp32 [N, G*weights per block], as ggml's dequantize_row_*
    computes them (for the K-quants d*sc and dmin*m rounded to fp32 first): the grid's dequantize of the fields
    blocks.py reads from the bytes."""
    if kind not in GGML_TYPES:
        raise ValueError(f"unknown block type {kind!r}; one of {sorted(GGML_TYPES)}")
    return GRID_WEIGHTS[GGML_TYPES[kind].grid].from_blocks(data).dequantize()


def grid_weight(w: torch.Tensor, scheme, **field_options) -> GridWeight:
    """Round-to-nearest of w float [N, K] onto the scheme's grid, fields chosen by choose_fields(**field_options)."""
    cls = GRID_WEIGHTS[scheme.grid]
    return cls.round(w, cls.choose_fields(w, **field_options), scheme)


def fake_quantize(w: torch.Tensor, scheme, clip_ratio=None) -> torch.Tensor:
    """Round trip onto the scheme's grid from the min-max ranges (shrunk by clip_ratio): same shape and
    dtype as w [N, K]."""
    return grid_weight(w, scheme, clip_ratio=clip_ratio).dequantize().to(w.dtype)
