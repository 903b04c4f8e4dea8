"""llama.cpp's quantized block types, one record each: the ggml type (name and id), the weights and bytes of
one block, the QuantScheme grid a weight on it takes (bits, symmetric, group size) and where a tensor whose
width is no whole block of it goes (llama-quantize's fallback, and quantkit's own for its grid recipes).

Every other table of quantkit reads these records: core/scheme.py (which grids exist and what a scheme on each
must say), blocks.py (bytes per block), grids.py (one class per type: its fields, rounding, blocks and
dequantization), linear.py, mix.py and writing.py (the type each weight is written in). Standard library
only: core/scheme.py reads it, and `quantkit --help` loads no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK = 32  # weights per block of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (and per sub-block of Q4_K / Q5_K / IQ4_XS)
SUPER_BLOCK = 256  # weights per block of the K-quants and IQ4_XS (ggml's QK_K)


@dataclass(frozen=True)
class GgmlType:
    """One of llama.cpp's block types (ggml-common.h).

    name: ggml's name ("Q4_K"); type_id: its ggml_type value (a GGUF file's tensor type); block: weights per
    block (256 for the K-quants' and IQ4_XS's super-blocks, else 32); block_bytes: bytes per block. num_bits,
    symmetric, group_size: what a QuantScheme on its grid (grid: the lower-case name) says, a group being a
    sub-block with its own scale. llama_cpp_fallback: the grid llama-quantize's tensor_type_fallback writes for
    a tensor whose width is no whole block of this one; fallback: the grid quantkit's own grid recipes take
    there (Q4_K keeps 4 bits with a float minimum: Q4_1). None: a block of 32, whose fallback is no block type.
    values: the level values of a non-uniform grid (IQ4_NL, IQ4_XS: y = scale * values[u], u the 4-bit index),
    ascending; None for the uniform grids (y = scale * u - minimum).
    """

    name: str
    type_id: int
    block: int
    block_bytes: int
    num_bits: int
    symmetric: bool
    group_size: int
    llama_cpp_fallback: str | None = None
    fallback: str | None = None
    values: tuple[int, ...] | None = None

    @property
    def grid(self) -> str:
        """The QuantScheme grid of this type ("q4_k")."""
        return self.name.lower()

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight: a block's bytes * 8 / its weights (Q4_K 4.5)."""
        return self.block_bytes * 8 / self.block


#: ggml's kvalues_iq4nl (ggml-common.h): the 16 levels of IQ4_NL and IQ4_XS, in units of the block's scale
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

_TYPES = (
    # y = d*sc*u - dmin*mn, 4-bit sc / mn per 16
    GgmlType("Q2_K", 10, SUPER_BLOCK, 84, 2, False, 16, llama_cpp_fallback="q4_0", fallback="q4_0"),
    # y = d*sc*(u - 4), 6-bit signed sc per 16
    GgmlType("Q3_K", 11, SUPER_BLOCK, 110, 3, True, 16, llama_cpp_fallback="q4_0", fallback="q4_0"),
    # y = d*sc*u - dmin*mn, 6-bit sc / mn per 32
    GgmlType("Q4_K", 12, SUPER_BLOCK, 144, 4, False, 32, llama_cpp_fallback="q5_0", fallback="q4_1"),
    GgmlType("Q5_K", 13, SUPER_BLOCK, 176, 5, False, 32, llama_cpp_fallback="q5_1", fallback="q5_1"),
    # y = d*sc*(u - 32), int8 sc per 16
    GgmlType("Q6_K", 14, SUPER_BLOCK, 210, 6, True, 16, llama_cpp_fallback="q8_0", fallback="q8_0"),
    GgmlType("Q4_1", 3, BLOCK, 20, 4, False, 32),  # y = d*u + m, fp16 d and m per 32
    GgmlType("Q5_1", 7, BLOCK, 24, 5, False, 32),
    GgmlType("Q4_0", 2, BLOCK, 18, 4, True, 32),  # y = d*(u - 8), fp16 d per 32, either sign
    GgmlType("Q5_0", 6, BLOCK, 22, 5, True, 32),  # y = d*(u - 16)
    GgmlType("Q8_0", 8, BLOCK, 34, 8, True, 32),  # y = d*(u - 128)
    # y = d*values[u], fp16 d per 32 (either sign)
    GgmlType("IQ4_NL", 20, BLOCK, 18, 4, True, 32, values=IQ4_VALUES),
    # y = d*(ls - 32)*values[u], fp16 d per 256, 6-bit ls per 32
    GgmlType("IQ4_XS", 23, SUPER_BLOCK, 136, 4, True, 32, llama_cpp_fallback="iq4_nl", fallback="iq4_nl",
             values=IQ4_VALUES),
)
#: ggml type name -> its record
GGML_TYPES = {t.name: t for t in _TYPES}
#: QuantScheme grid ("q4_k") -> its record
GRID_TYPES = {t.grid: t for t in _TYPES}


def for_width(grid: str, width: int, *, llama_cpp: bool = False) -> tuple[GgmlType, bool]:
    """The type a tensor of `width` inputs asked on `grid` takes: the grid's own where width is whole blocks of
    it, else its fallback's (quantkit's, or with llama_cpp llama-quantize's), followed on (Q2_K -> Q4_0); and
    whether width is whole blocks of it (False: the last type of the chain, whose blocks of 32 do not divide
    width either; what then is the caller's rule)."""
    t = GRID_TYPES[grid]
    while width % t.block:
        nxt = t.llama_cpp_fallback if llama_cpp else t.fallback
        if nxt is None:
            return t, False
        t = GRID_TYPES[nxt]
    return t, True
