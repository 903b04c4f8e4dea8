"""QuantScheme: how one kind of tensor is quantized (compressed-tensors `QuantizationArgs` subset)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from ..gguf.types import GRID_TYPES, for_width

STRATEGIES = ("channel", "group", "tensor")
TYPES = ("int", "float")
INT_BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
#: What a group scheme does with a linear whose in_features its group size does not divide:
#: "smaller-group" the largest of GROUP_SIZES below it that divides (per channel when none does),
#: "channel" per-channel scales, "ragged" keep the group size with a shorter last group
#: (ceil(K / group_size) scales; compressed-tensors 0.20 and vLLM's WNA16 loader do not read it),
#: "error" refuse.
INDIVISIBLE = ("smaller-group", "channel", "ragged", "error")

FP8_E4M3_MAX = 448.0


#: Where a scheme's scales and minimums may lie: "uniform" (any stored scale, integer zero points: the
#: compressed-tensors grid), or one of llama.cpp's block types (quantkit.gguf.types.GRID_TYPES, one record each:
#: what a scheme on it must say, its block, bits and fallbacks), whose scales are fp16 or 6-bit / 8-bit multiples
#: of a super-block's fp16 scale and whose minimums (Q4_K, Q5_K, Q4_1, Q5_1) are floats, which compressed-tensors
#: cannot hold: such weights are written as GGUF.
GRIDS = ("uniform", *GRID_TYPES)


def grid_scheme(grid: str) -> "QuantScheme":
    """The QuantScheme of weights on the GGUF grid `grid` (a key of GRID_TYPES)."""
    g = GRID_TYPES[grid]
    return QuantScheme(num_bits=g.num_bits, symmetric=g.symmetric, strategy="group", group_size=g.group_size,
                       grid=grid)


def _shown(value: Any) -> str:
    """A value as an error message quotes it: its repr and its type ('128' (a str))."""
    return f"{value!r} (a {type(value).__name__})"


@dataclass(frozen=True)
class QuantScheme:
    """Quantization arguments of one tensor kind.

    num_bits: 4 or 8 for "int", 8 for "float" (fp8 e4m3).
    strategy: "channel" (one scale per output row), "group" (one per `group_size` inputs of a row),
      "tensor" (one scale for the whole tensor; FP8 KV cache).
    symmetric: zero point fixed at 0; asymmetric int schemes store an int zero point per scale.
    actorder: how the weights were calibrated, as compressed-tensors records it: None, or "weight"
      (GPTQ visited the columns by activation order with static groups: the layout and the
      inference are unchanged, no g_idx). Set by the algorithm, not by recipes.
    grid: one of GRIDS; a GGUF grid fixes num_bits, symmetric and group_size (GRID_TYPES: e.g. q4_k int4
      asymmetric g32, q6_k int6 symmetric g16), strategy group, and inputs in whole blocks of it (quantkit.gguf.grids).
    """

    num_bits: int = 4
    type: Literal["int", "float"] = "int"
    symmetric: bool = True
    strategy: Literal["channel", "group", "tensor"] = "group"
    group_size: int | None = None
    actorder: Literal["weight"] | None = None
    grid: str = "uniform"

    def __post_init__(self) -> None:
        if self.group_size is not None and (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)):
            raise ValueError(f"group_size must be an integer or None, got {_shown(self.group_size)}")
        for key in ("type", "strategy"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"{key} must be a string, got {_shown(getattr(self, key))}")
        if isinstance(self.num_bits, bool) or not isinstance(self.num_bits, int):
            raise ValueError(f"num_bits must be an integer (e.g. 4, not 4.0), got {_shown(self.num_bits)}")
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric must be true or false, got {_shown(self.symmetric)}")
        if self.type not in TYPES:
            raise ValueError(f"type must be one of {TYPES}, got {self.type!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if not isinstance(self.grid, str) or self.grid not in GRIDS:
            raise ValueError(f"grid must be one of {GRIDS}, got {_shown(self.grid)}")
        if self.grid != "uniform":
            spec = GRID_TYPES[self.grid]
            if (self.type, self.num_bits, self.symmetric, self.strategy, self.group_size) != (
                    "int", spec.num_bits, spec.symmetric, "group", spec.group_size):
                raise ValueError(f"grid {self.grid!r} is llama.cpp's {spec.name}: it needs num_bits: "
                                 f"{spec.num_bits}, symmetric: {str(spec.symmetric).lower()}, strategy: group, "
                                 f"group_size: {spec.group_size}")
            return
        if self.type == "int" and self.num_bits not in INT_BITS:
            raise ValueError(f"int num_bits must be one of {INT_BITS}, got {self.num_bits}")
        if self.type == "float":
            if self.num_bits != 8:
                raise ValueError(f"float num_bits must be 8 (fp8 e4m3), got {self.num_bits}")
            if not self.symmetric:
                raise ValueError("float (fp8) quantization is symmetric only: set symmetric: true")
        if self.strategy == "group":
            if self.group_size not in GROUP_SIZES:
                raise ValueError(
                    f"group_size must be one of {GROUP_SIZES} with strategy 'group', got {self.group_size!r}"
                )
        elif self.group_size is not None:
            raise ValueError(
                f"group_size is only used with strategy 'group' (got strategy {self.strategy!r}, "
                f"group_size {self.group_size}): remove it or use strategy: group"
            )
        if self.actorder not in (None, "weight"):
            raise ValueError(f"actorder must be None or 'weight' (static groups), got {self.actorder!r}")
        if self.actorder is not None and self.strategy != "group":
            # compressed-tensors < 0.16 refuses any actorder without strategy 'group'
            raise ValueError(f"actorder {self.actorder!r} is only recorded with strategy 'group'")

    # -- integer range ---------------------------------------------------------------------------
    @property
    def qmin(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    def groups_for(self, in_features: int) -> int:
        """Number of scale columns for a weight with `in_features` inputs (G in [N, G] scales):
        ceil(K / group_size), the last group shorter when the group size does not divide K (ragged)."""
        if self.strategy == "group":
            assert self.group_size is not None
            return -(-in_features // self.group_size)
        return 1

    def divides(self, in_features: int) -> bool:
        """Whether every group of a weight with `in_features` inputs is whole (always true per channel); on a
        GGUF grid, every block of it (256 inputs for the K-quants)."""
        if self.grid != "uniform":
            return in_features % GRID_TYPES[self.grid].block == 0
        return self.strategy != "group" or in_features % self.group_size == 0

    def fitted(self, in_features: int, indivisible: str = "error", llama_cpp: bool = False) -> "QuantScheme":
        """The scheme a linear with `in_features` inputs gets under the `indivisible` rule (INDIVISIBLE):
        this scheme when its group size divides in_features (or with "ragged"), else a smaller group, per
        channel, or a ValueError for "error". On a K-quant grid, in_features not in whole super-blocks of 256
        get the grid its fallback names (quantkit's, or with llama_cpp llama-quantize's: gguf.types.for_width),
        as llama.cpp falls back from K-quants; on a grid of blocks of 32, the uniform grid at 4 or 8 bits."""
        if indivisible not in INDIVISIBLE:
            raise ValueError(f"indivisible must be one of {INDIVISIBLE}, got {indivisible!r}")
        if self.grid != "uniform":  # as llama.cpp falls back from K-quants: e.g. Q4_K -> Q4_1 -> the uniform grid
            if self.divides(in_features):
                return self
            spec = GRID_TYPES[self.grid]
            if indivisible == "error":
                fallback = (spec.llama_cpp_fallback if llama_cpp else spec.fallback) or "the uniform grid"
                raise ValueError(f"grid {self.grid} needs in_features in whole blocks of {spec.block}, got "
                                 f"{in_features}; use the recipe's `indivisible:` rule (smaller-group: "
                                 f"{self.grid.upper()} falls back to {fallback.upper()}) or ignore that linear")
            spec, whole = for_width(self.grid, in_features, llama_cpp=llama_cpp)
            if whole:
                return grid_scheme(spec.grid)
            bits = 4 if spec.num_bits <= 4 else 8
            return QuantScheme(num_bits=bits, symmetric=spec.symmetric, strategy="group",
                               group_size=spec.group_size).fitted(in_features, indivisible)
        if self.divides(in_features) or indivisible == "ragged":
            return self
        if indivisible == "smaller-group":
            smaller = [g for g in GROUP_SIZES if g < self.group_size and in_features % g == 0]
            if smaller:
                return replace(self, group_size=max(smaller))
        if indivisible in ("smaller-group", "channel"):
            return replace(self, strategy="channel", group_size=None, actorder=None)
        raise ValueError(
            f"group_size {self.group_size} does not divide in_features {in_features}; use a group size that "
            f"divides it, or strategy: channel, or the recipe's `indivisible:` rule ({', '.join(INDIVISIBLE[:3])})"
        )

    @property
    def bits_per_weight(self) -> float:
        """Nominal storage bits per weight incl. 16-bit scales (and packed zero points)."""
        if self.grid != "uniform":
            return GRID_TYPES[self.grid].bits_per_weight  # the block's bytes * 8 / its weights
        if self.strategy != "group":
            return float(self.num_bits)
        assert self.group_size is not None
        extra = 16 + (0 if self.symmetric else self.num_bits)
        return self.num_bits + extra / self.group_size

    # -- compressed-tensors QuantizationArgs ------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """compressed-tensors `QuantizationArgs` dict (weights or kv_cache_scheme)."""
        if self.grid != "uniform":
            raise ValueError(f"grid {self.grid!r} has no compressed-tensors form (its minimums are floats): such "
                             f"weights are written as GGUF")
        d = asdict(self)
        d.pop("grid")
        d.update(dynamic=False, observer="minmax")
        if self.type == "float":
            d.pop("actorder")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantScheme":
        """Read a compressed-tensors `QuantizationArgs` dict (extra reader-only keys are tolerated)."""
        if d.get("dynamic") not in (None, False):
            raise ValueError("dynamic quantization args are not supported (weights and KV scales are static)")
        actorder = d.get("actorder")
        if actorder not in (None, False, "weight", "static"):
            raise ValueError(
                f"actorder {actorder!r} stores permuted groups (a g_idx) that need reordering at inference, which "
                f"quantkit does not do; re-quantize with static groups (actorder 'weight')"
            )
        strategy = d.get("strategy") or "tensor"
        return cls(
            num_bits=d["num_bits"],
            type=d.get("type", "int"),
            symmetric=d.get("symmetric", True),
            strategy=strategy,
            group_size=d.get("group_size") if strategy == "group" else None,
            actorder="weight" if actorder in ("weight", "static") and strategy == "group" else None,
        )

    def describe(self) -> str:
        if self.type == "float":
            return f"fp8-e4m3 per-{self.strategy}"
        if self.grid != "uniform":
            return (f"int{self.num_bits} g{self.group_size} {'sym' if self.symmetric else 'asym'} on the "
                    f"{GRID_TYPES[self.grid].name} grid")
        where = f"g{self.group_size}" if self.strategy == "group" else f"per-{self.strategy}"
        return f"int{self.num_bits} {where} {'sym' if self.symmetric else 'asym'}"
