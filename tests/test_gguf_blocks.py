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


# ------------------------------------------------------------------------------ the non-uniform IQ4 types

#: ggml-common.h's kvalues_iq4nl, written out here (not read from quantkit) for the scalar references below
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _fp16_at(raw: bytes, at: int) -> np.float32:
    return np.float32(np.frombuffer(raw[at:at + 2], np.float16)[0])


def dequantize_row_iq4_nl(raw: bytes) -> list[np.float32]:
    """ggml-quants.c's dequantize_row_iq4_nl, line by line over one row's bytes (block_iq4_nl: ggml_half d,
    uint8_t qs[16]): y[j] = d * kvalues[qs[j] & 0xf], y[j + 16] = d * kvalues[qs[j] >> 4], in fp32."""
    y = []
    for b in range(0, len(raw), 18):
        d = _fp16_at(raw, b)
        qs = raw[b + 2:b + 18]
        block = [np.float32(0)] * 32
        for j in range(16):
            block[j] = np.float32(d * np.float32(KVALUES_IQ4NL[qs[j] & 0xF]))
            block[j + 16] = np.float32(d * np.float32(KVALUES_IQ4NL[qs[j] >> 4]))
        y += block
    return y


def dequantize_row_iq4_xs(raw: bytes) -> list[np.float32]:
    """ggml-quants.c's dequantize_row_iq4_xs, line by line (block_iq4_xs: ggml_half d, uint16_t scales_h,
    uint8_t scales_l[4], uint8_t qs[128]): ls = ((scales_l[ib/2] >> 4*(ib%2)) & 0xf) | (((scales_h >> 2*ib) & 3)
    << 4), dl = d * (ls - 32), then as IQ4_NL per sub-block of 32."""
    y = []
    for b in range(0, len(raw), 136):
        d = _fp16_at(raw, b)
        scales_h = raw[b + 2] | (raw[b + 3] << 8)
        scales_l = raw[b + 4:b + 8]
        qs = raw[b + 8:b + 136]
        for ib in range(8):
            ls = ((scales_l[ib // 2] >> 4 * (ib % 2)) & 0xF) | (((scales_h >> 2 * ib) & 3) << 4)
            dl = np.float32(d * np.float32(ls - 32))
            block = [np.float32(0)] * 32
            for j in range(16):
                block[j] = np.float32(dl * np.float32(KVALUES_IQ4NL[qs[16 * ib + j] & 0xF]))
                block[j + 16] = np.float32(dl * np.float32(KVALUES_IQ4NL[qs[16 * ib + j] >> 4]))
            y += block
    return y


IQ4_SHAPES = [(1, 256), (3, 512), (2, 1280), (0, 256)]


def random_iq4_fields(kind: str, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random IQ4_NL (u, d) or IQ4_XS (u, d, sc) fields over their whole ranges (scales of either sign, zeros)."""
    u = torch.randint(0, 16, (n, k), generator=g)
    if kind == "IQ4_NL":
        d = (torch.randn(n, k // 32, generator=g) * 0.01).half()
        d[:1, :1] = 0.0
        return u, d
    d = (torch.randn(n, k // 256, generator=g) * 0.001).half()
    d[:1, :1] = -0.0
    return u, d, torch.randint(-32, 32, (n, k // 32), generator=g)


@pytest.mark.parametrize("shape", IQ4_SHAPES)
@pytest.mark.parametrize("kind", ["IQ4_NL", "IQ4_XS"])
def test_iq4_blocks_round_trip_and_dequantize_as_ggmls_c(kind, shape):
    """Fresh random fields each run: pack -> unpack gives them back (bytes -> fields -> bytes too), and the
    grid's dequantization equals a scalar transcription of ggml's dequantize_row_iq4_* bit for bit (and the
    gguf package's numpy reading)."""
    n, k = shape
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    pack = getattr(gguf_blocks, f"pack_{kind.lower()}")
    unpack = getattr(gguf_blocks, f"unpack_{kind.lower()}")
    fields = random_iq4_fields(kind, n, k, g)
    data = pack(*fields)
    assert data.dtype == torch.uint8 and data.shape == (n, k // GGML_TYPES[kind].block * GGML_TYPES[kind].block_bytes)
    back = unpack(data)
    for mine, theirs, dtype in zip(back, fields, (torch.uint8, torch.float16, torch.int8)):
        assert mine.dtype == dtype and torch.equal(mine.view(torch.int16) if dtype == torch.float16 else mine,
                                                   theirs.view(torch.int16) if dtype == torch.float16 else
                                                   theirs.to(dtype))  # fp16 compared bit for bit (-0.0)
    assert torch.equal(pack(*back), data)
    ours = dequantize_blocks(data, kind)
    assert ours.dtype == torch.float32 and ours.shape == (n, k)
    scalar = dequantize_row_iq4_nl if kind == "IQ4_NL" else dequantize_row_iq4_xs
    for r in range(n):
        expect = np.array(scalar(data[r].numpy().tobytes()), np.float32)
        assert np.array_equal(expect.view(np.uint32), ours[r].numpy().view(np.uint32)), r
    if n:
        theirs = gguf.quants.dequantize(data.numpy(), getattr(T, kind))
        assert np.array_equal(theirs, ours.numpy())


def test_iq4_byte_positions_are_ggmls():
    """Single values land where ggml-common.h's block_iq4_xs puts them (independent of the gguf package)."""
    u = torch.zeros(1, 256, dtype=torch.int64)
    u[0, 32 * 5 + 16 + 2] = 9  # sub-block 5, weight 16 + 2: the high nibble of qs[16 * 5 + 2]
    sc = torch.full((1, 8), -32, dtype=torch.int64)  # ls = 0
    sc[0, 3] = 0b110101 - 32  # ls_3: low nibble in the high nibble of scales_l[1], high 2 bits in bits 6-7 of scales_h
    data = gguf_blocks.pack_iq4_xs(u, torch.ones(1, 1, dtype=torch.float16), sc)[0]
    assert data[:2].tolist() == [0x00, 0x3C] and data[2:4].tolist() == [0b11 << 6, 0]
    assert data[4:8].tolist() == [0, 0b0101 << 4, 0, 0]
    assert data[8 + 16 * 5 + 2] == 9 << 4 and int(data[8:].sum()) == 9 << 4
    data = gguf_blocks.pack_iq4_nl(u[:, :32], torch.ones(1, 1, dtype=torch.float16))[0]
    assert data.shape == (18,) and int(data[2:].sum()) == 0
    with pytest.raises(ValueError, match=r"sc: values outside \[-32, 31\]"):
        gguf_blocks.pack_iq4_xs(u, torch.ones(1, 1, dtype=torch.float16), sc + 64)
    with pytest.raises(ValueError, match=r"outside \[0, 15\]"):
        gguf_blocks.pack_iq4_nl(u[:, :32] + 16, torch.ones(1, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="super-block size 256"):
        gguf_blocks.pack_iq4_xs(u[:, :64], torch.ones(1, 1, dtype=torch.float16), sc)
