"""The GGUF K-quant block layouts (quantkit/gguf/blocks.py: Q4_K, Q5_K, Q6_K) against the `gguf` package's own
numpy dequantizers, bit for bit, and their pack/unpack round trips and refusals. (Q4_0 / Q4_1 / Q8_0 are
covered in test_gguf_export.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from quantkit.gguf import blocks as gguf_blocks  # noqa: E402
from quantkit.gguf.grids import dequantize_blocks  # noqa: E402
from quantkit.gguf.types import GGML_TYPES  # noqa: E402

T = gguf.GGMLQuantizationType
SHAPES = [(1, 256), (3, 512), (5, 1024), (2, 2560), (0, 512)]


def random_fields(kind: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random fields of `kind` over their whole ranges (fp16 scales of either sign, zeros included)."""
    g = torch.Generator().manual_seed(seed)
    gs = k // 256
    d = (torch.randn(n, gs, generator=g) * 0.02).half()
    d[:1, :1] = 0.0
    if kind == "Q6_K":
        return (torch.randint(-32, 32, (n, k), generator=g), d, torch.randint(-128, 128, (n, k // 16), generator=g))
    top = 16 if kind == "Q4_K" else 32
    dmin = (torch.randn(n, gs, generator=g) * 0.02).half()
    return (torch.randint(0, top, (n, k), generator=g), d, dmin, torch.randint(0, 64, (n, k // 32), generator=g),
            torch.randint(0, 64, (n, k // 32), generator=g))


PACK = {"Q4_K": gguf_blocks.pack_q4_k, "Q5_K": gguf_blocks.pack_q5_k, "Q6_K": gguf_blocks.pack_q6_k}
UNPACK = {"Q4_K": gguf_blocks.unpack_q4_k, "Q5_K": gguf_blocks.unpack_q5_k, "Q6_K": gguf_blocks.unpack_q6_k}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_blocks_match_the_gguf_package(kind, shape):
    n, k = shape
    fields = random_fields(kind, n, k, seed=n * 7919 + k)
    data = PACK[kind](*fields)
    assert data.dtype == torch.uint8 and data.shape == (n, k // 256 * GGML_TYPES[kind].block_bytes)
    back = UNPACK[kind](data)
    dtypes = (torch.int8, torch.float16, torch.int8) if kind == "Q6_K" else \
        (torch.uint8, torch.float16, torch.float16, torch.uint8, torch.uint8)
    for mine, theirs, dtype in zip(back, fields, dtypes):
        assert mine.dtype == dtype and torch.equal(mine, theirs.to(dtype))
    ours = dequantize_blocks(data, kind)
    assert ours.dtype == torch.float32 and ours.shape == (n, k)
    if n:  # (the gguf package cannot reshape zero rows)
        theirs = gguf.quants.dequantize(data.numpy(), getattr(T, kind))
        assert np.array_equal(theirs.view(np.uint32), ours.numpy().view(np.uint32))
    # and the formula the docstring states, in fp32 with d*sc and dmin*m rounded first
    if kind == "Q6_K":
        q, d, sc = (t.float() for t in fields)
        expect = (d.repeat_interleave(16, 1) * sc).repeat_interleave(16, 1) * q
    else:
        u, d, dmin, sc, mn = (t.float() for t in fields)
        expect = ((d.repeat_interleave(8, 1) * sc).repeat_interleave(32, 1) * u
                  - (dmin.repeat_interleave(8, 1) * mn).repeat_interleave(32, 1))
    assert torch.equal(ours, expect)


def test_k_byte_positions_are_ggmls():
    """Single weights land where ggml-common.h's structs put them (independent of the gguf package)."""
    zeros = torch.zeros(1, 1, dtype=torch.float16)
    sc = torch.zeros(1, 8, dtype=torch.int64)
    u = torch.zeros(1, 256, dtype=torch.int64)
    u[0, 64 + 32 + 3] = 5  # second 64-chunk, high half, l = 3 -> qs[32 + 3] high nibble
    data = gguf_blocks.pack_q4_k(u, zeros, zeros, sc, sc)
    assert data[0, 16 + 35] == 0x50 and int(data[0, 16:].sum()) == 0x50
    u[0, 64 + 32 + 3] = 21  # Q5_K: low 4 bits as Q4_K, bit 4 in bit 3 (sub-block 3) of qh[3]
    data = gguf_blocks.pack_q5_k(u, zeros, zeros, sc, sc)
    assert data[0, 16 + 3] == 1 << 3 and data[0, 48 + 35] == 0x50
    sc[0, 5], sc[0, 1] = 0b110101, 7  # sc_5: low nibble in byte 9, bits 4-5 in bits 6-7 of byte 1
    mn = torch.zeros(1, 8, dtype=torch.int64)
    mn[0, 6] = 0b101100  # m_6: low nibble in the high nibble of byte 10, bits 4-5 in bits 6-7 of byte 6
    head = gguf_blocks.pack_q4_k(torch.zeros(1, 256, dtype=torch.int64), zeros, zeros, sc, mn)[0, 4:16]
    assert head.tolist() == [0, 7 | 0b11 << 6, 0, 0, 0, 0, 0b10 << 6, 0, 0, 0b0101, 0b1100 << 4, 0]
    q = torch.full((1, 256), -32, dtype=torch.int64)
    q[0, 128 + 64 + 7] = 31  # stored 63; 2nd 128-half, weight l + 64 (l = 7): ql[64 + 7] high, qh[32 + 7] bits 4-5
    data = gguf_blocks.pack_q6_k(q, torch.ones(1, 1, dtype=torch.float16), torch.zeros(1, 16, dtype=torch.int64))
    assert data[0, 64 + 7] == 0xF0 and data[0, 128 + 32 + 7] == 0b11 << 4
    assert int(data[0, :192].sum()) == 0xF0 + (0b11 << 4)
    assert data[0, 208:].tolist() == [0x00, 0x3C]  # fp16 1.0 little-endian, last


def test_k_scale_bytes_round_trip_any_bytes():
    """Every 12 scale bytes decode (get_scale_min_k4) to 16 six-bit values that re-encode to the same bytes."""
    b = torch.randint(0, 256, (500, 12), generator=torch.Generator().manual_seed(3)).to(torch.uint8)
    sc, mn = gguf_blocks.k4_scales_from_bytes(b)
    assert int(sc.max()) <= 63 and int(mn.max()) <= 63
    assert torch.equal(gguf_blocks.k4_scale_bytes(sc, mn), b)


def test_k_refusals():
    h = torch.zeros(2, 1, dtype=torch.float16)
    s8 = torch.zeros(2, 8, dtype=torch.int64)
    u = torch.zeros(2, 256, dtype=torch.int64)
    with pytest.raises(ValueError, match="super-block size 256"):
        gguf_blocks.pack_q4_k(torch.zeros(2, 128, dtype=torch.int64), h, h, s8[:, :4], s8[:, :4])
    with pytest.raises(ValueError, match=r"outside \[0, 15\]"):
        gguf_blocks.pack_q4_k(u + 16, h, h, s8, s8)
    with pytest.raises(ValueError, match=r"outside \[0, 31\]"):
        gguf_blocks.pack_q5_k(u + 32, h, h, s8, s8)
    with pytest.raises(ValueError, match=r"sc: values outside \[0, 63\]"):
        gguf_blocks.pack_q4_k(u, h, h, s8 + 64, s8)
    with pytest.raises(ValueError, match=r"mn: values outside \[0, 63\]"):
        gguf_blocks.pack_q5_k(u, h, h, s8, s8 - 1)
    with pytest.raises(ValueError, match=r"sc: expected \[2, 8\]"):
        gguf_blocks.pack_q4_k(u, h, h, s8[:, :7], s8)
    with pytest.raises(ValueError, match="dmin: expected float16"):
        gguf_blocks.pack_q4_k(u, h, h.float(), s8, s8)
    with pytest.raises(TypeError, match="integer"):
        gguf_blocks.pack_q4_k(u.float(), h, h, s8, s8)
    s16 = torch.zeros(2, 16, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"outside \[-32, 31\]"):
        gguf_blocks.pack_q6_k(u + 32, h, s16)
    with pytest.raises(ValueError, match=r"sc: values outside \[-128, 127\]"):
        gguf_blocks.pack_q6_k(u, h, s16 + 128)
    with pytest.raises(ValueError, match="d: expected float16"):
        gguf_blocks.pack_q6_k(u, h[:1], s16)
    for kind in ("Q4_K", "Q5_K", "Q6_K"):
        with pytest.raises(ValueError, match=f"{kind}: expected uint8"):
            dequantize_blocks(torch.zeros(2, GGML_TYPES[kind].block_bytes + 1, dtype=torch.uint8), kind)
    assert gguf_blocks.SUPER_BLOCK == 256
