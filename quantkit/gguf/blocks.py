"""GGUF (ggml) block layouts Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and the
non-uniform IQ4_NL, IQ4_XS: the only home of their byte and nibble orders in quantkit.

ggml stores a row of K weights as K / 32 blocks of 32 (ggml-common.h), little-endian:

- Q4_0, 18 bytes: fp16 d, then 16 bytes qs; weight j (0..15) in the low nibble of qs[j], weight j + 16 in
  the high nibble; y = d * (nibble - 8). (Not the compressed-tensors order of quantkit/kernels/packing.py, which
  puts consecutive weights in consecutive nibbles.)
- Q4_1, 20 bytes: fp16 d, fp16 m, 16 bytes qs in the Q4_0 nibble order; y = d * nibble + m.
- Q5_0, 22 bytes: fp16 d, 4 bytes qh (a little-endian uint32), 16 bytes qs; u in 0..31, its low 4 bits in
  qs in the Q4_0 nibble order, bit 4 of weight j in bit j of qh; y = d * (u - 16).
- Q5_1, 24 bytes: fp16 d, fp16 m, then qh and qs as Q5_0; y = d * u + m.
- Q8_0, 34 bytes: fp16 d, then 32 int8 qs; y = d * q.

The K-quants store a row as K / 256 super-blocks (ggml-common.h block_q2_K ... block_q6_K, ggml-quants.c
dequantize_row_q2_K ... q6_K and get_scale_min_k4):

- Q2_K, 84 bytes: 16 bytes scales, 64 bytes qs, fp16 d, fp16 dmin. Sixteen sub-blocks of 16, sub-block j
  with a 4-bit scale sc_j (low nibble of scales[j]) and a 4-bit min m_j (high nibble): y = (d * sc_j) * u -
  (dmin * m_j), u in 0..3. qs: each 128 weights take 32 bytes, weight l + 32 s (l in 0..31, s in 0..3) in
  bits 2s..2s+1 of byte l.
- Q3_K, 110 bytes: 32 bytes hmask, 64 bytes qs, 12 bytes scales, fp16 d. Sixteen sub-blocks of 16 with a
  6-bit scale v_j = sc_j + 32 (sc_j in -32..31): y = (d * sc_j) * q, q in -4..3 stored as u = q + 4: its low
  2 bits in qs as Q2_K's, bit 2 of weight 32 b + l (l in 0..31) in bit b of hmask[l]. The 12 scale bytes:
  the low 4 bits of v_j in the low nibble of byte j (j < 8) or the high nibble of byte j - 8 (j >= 8), the
  high 2 bits of v_j in bits 2 (j / 4) of byte 8 + j % 4.
- Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of scales, 128 bytes qs. Eight sub-blocks of 32, each with a
  6-bit scale sc_j and a 6-bit min m_j (0..63): y = (d * sc_j) * u - (dmin * m_j), u in 0..15. The 12 scale
  bytes: bytes 0-3 hold sc_0..3 in bits 0-5 and bits 4-5 of sc_4..7 in bits 6-7; bytes 4-7 the same for the
  mins; bytes 8-11 hold the low 4 bits of sc_4..7 (low nibble) and of m_4..7 (high nibble). qs: each
  64 weights take 32 bytes, weight l (0..31) in the low nibble of byte l, weight l + 32 in the high one.
- Q5_K, 176 bytes: fp16 d, fp16 dmin, the 12 Q4_K scale bytes, 32 bytes qh, 128 bytes qs; u in 0..31, its
  low 4 bits in qs as Q4_K, bit 4 of weight 32*j + l (sub-block j) in bit j of qh[l].
- Q6_K, 210 bytes: 128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16 weights), fp16 d (last):
  y = (d * sc_j) * q, q in -32..31 stored as q + 32 (6 bits). Each 128 weights take 64 bytes of ql and 32 of
  qh: weights l and l + 64 in the low / high nibble of ql[l], weights l + 32 and l + 96 in ql[l + 32]
  (l in 0..31), and their upper 2 bits in qh[l] at bits 0-1, 2-3, 4-5, 6-7 for l, l + 32, l + 64, l + 96.

The non-uniform 4-bit types (ggml-common.h block_iq4_nl / block_iq4_xs, ggml-quants.c dequantize_row_iq4_nl /
iq4_xs): a 4-bit index u picks one of the 16 values of ggml's kvalues_iq4nl (quantkit/gguf/types.py IQ4_VALUES):

- IQ4_NL, 18 bytes per 32: fp16 d, then 16 bytes qs in the Q4_0 nibble order (weight j low, j + 16 high);
  y = d * values[u].
- IQ4_XS, 136 bytes per 256: fp16 d, a little-endian uint16 scales_h, 4 bytes scales_l, 128 bytes qs. Eight
  sub-blocks of 32, sub-block j with a 6-bit ls_j = sc_j + 32 (sc_j in -32..31): its low 4 bits in the low
  (j even) or high (j odd) nibble of scales_l[j / 2], its high 2 bits in bits 2j..2j+1 of scales_h;
  y = (d * sc_j) * values[u]. qs: sub-block j takes 16 bytes, in the Q4_0 nibble order within it.

Rows are independent; a tensor [N, K] is stored as uint8 [N, K / block weights * block bytes] (what the
`gguf` package's GGUFWriter.add_tensor takes with raw_dtype=...); each type's weights and bytes per block are
its record in quantkit/gguf/types.py. Their dequantization is each grid's (quantkit/gguf/grids.py:
`dequantize_blocks` reads the fields here, then dequantizes them). Pure torch; of quantkit only those records.
"""

from __future__ import annotations

import torch

from .types import BLOCK, GGML_TYPES, SUPER_BLOCK

K_SCALE_BYTES = 12  # the packed 6-bit scales and mins of a Q4_K / Q5_K super-block


def _check(q: torch.Tensor, name: str, lo: int, hi: int, block: int = BLOCK) -> tuple[int, int]:
    if q.dim() != 2:
        raise ValueError(f"{name}: expected [N, K] integers, got shape {tuple(q.shape)}")
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got {q.dtype}")
    n, k = q.shape
    if k % block:
        kind = "super-block" if block == SUPER_BLOCK else "block"
        raise ValueError(f"{name}: K = {k} is not a multiple of the {kind} size {block}")
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"{name}: values outside [{lo}, {hi}]")
    return n, k // block


def _check_fields(x: torch.Tensor, name: str, n: int, g: int, lo: int, hi: int) -> torch.Tensor:
    """An integer [N, G] field (K-quant sub-block scales or mins) in [lo, hi] -> int16 [N, G]."""
    if tuple(x.shape) != (n, g):
        raise ValueError(f"{name}: expected [{n}, {g}], got shape {tuple(x.shape)}")
    _check(x, name, lo, hi, block=1)
    return x.to(torch.int16)


def _half_bytes(x: torch.Tensor, n: int, g: int, name: str) -> torch.Tensor:
    """fp16 [N, G] -> uint8 [N, G, 2] (little-endian, as the machine stores it: x86 and ARM are)."""
    if x.dtype != torch.float16 or tuple(x.shape) != (n, g):
        raise ValueError(f"{name}: expected float16 [{n}, {g}], got {x.dtype} {tuple(x.shape)}")
    dense = torch.empty(n, g, dtype=torch.float16, device=x.device).copy_(x)  # (a read-back field may be strided)
    return dense.view(torch.uint8).reshape(n, g, 2)


def _nibbles(u: torch.Tensor) -> torch.Tensor:
    """uint [N, G, 32] in 0..15 -> uint8 [N, G, 16]: weight j low nibble, weight j + 16 high nibble."""
    return (u[..., :16] | (u[..., 16:] << 4)).to(torch.uint8)


def _unnibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [N, G, 16] -> int16 [N, G, 32] in 0..15 (inverse of _nibbles)."""
    qs = qs.to(torch.int16)
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def pack_q4_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q: int [N, K] in [-8, 7]; d: fp16 [N, K/32]. returns uint8 [N, K/32*18] Q4_0 blocks (y = d*q)."""
    n, g = _check(q, "Q4_0", -8, 7)
    u = (q.to(torch.int16) + 8).reshape(n, g, BLOCK)
    return torch.cat([_half_bytes(d, n, g, "Q4_0 d"), _nibbles(u)], dim=-1).reshape(n, -1)


def pack_q4_1(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """u: int [N, K] in [0, 15]; d, m: fp16 [N, K/32]. returns uint8 [N, K/32*20] Q4_1 blocks (y = d*u + m)."""
    n, g = _check(u, "Q4_1", 0, 15)
    u = u.to(torch.int16).reshape(n, g, BLOCK)
    return torch.cat([_half_bytes(d, n, g, "Q4_1 d"), _half_bytes(m, n, g, "Q4_1 m"), _nibbles(u)],
                     dim=-1).reshape(n, -1)


def _high_bits(u: torch.Tensor) -> torch.Tensor:
    """uint [N, G, 32] in 0..31 -> uint8 [N, G, 4]: bit 4 of weight j in bit j of a little-endian uint32."""
    bits = (u.to(torch.int64) >> 4) << torch.arange(BLOCK, dtype=torch.int64, device=u.device)
    qh = bits.sum(dim=-1, keepdim=True)  # [N, G, 1]
    return ((qh >> torch.arange(0, 32, 8, dtype=torch.int64, device=u.device)) & 0xFF).to(torch.uint8)


def _unhigh_bits(qh: torch.Tensor) -> torch.Tensor:
    """Inverse of _high_bits: uint8 [N, G, 4] -> int16 [N, G, 32] in {0, 16}."""
    word = (qh.to(torch.int64) << torch.arange(0, 32, 8, dtype=torch.int64, device=qh.device)).sum(dim=-1, keepdim=True)
    return (((word >> torch.arange(BLOCK, dtype=torch.int64, device=qh.device)) & 1) << 4).to(torch.int16)


def pack_q5_0(u: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """u: int [N, K] in [0, 31]; d: fp16 [N, K/32]. returns uint8 [N, K/32*22] Q5_0 blocks (y = d*(u - 16))."""
    n, g = _check(u, "Q5_0", 0, 31)
    u = u.to(torch.int16).reshape(n, g, BLOCK)
    return torch.cat([_half_bytes(d, n, g, "Q5_0 d"), _high_bits(u), _nibbles(u & 0xF)], dim=-1).reshape(n, -1)


def pack_q5_1(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """u: int [N, K] in [0, 31]; d, m: fp16 [N, K/32]. returns uint8 [N, K/32*24] Q5_1 blocks (y = d*u + m)."""
    n, g = _check(u, "Q5_1", 0, 31)
    u = u.to(torch.int16).reshape(n, g, BLOCK)
    return torch.cat([_half_bytes(d, n, g, "Q5_1 d"), _half_bytes(m, n, g, "Q5_1 m"), _high_bits(u),
                      _nibbles(u & 0xF)], dim=-1).reshape(n, -1)


def pack_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q: int [N, K] in [-128, 127]; d: fp16 [N, K/32]. returns uint8 [N, K/32*34] Q8_0 blocks (y = d*q)."""
    n, g = _check(q, "Q8_0", -128, 127)
    qs = q.to(torch.int8).reshape(n, g, BLOCK).contiguous().view(torch.uint8)
    return torch.cat([_half_bytes(d, n, g, "Q8_0 d"), qs], dim=-1).reshape(n, -1)


def pack_iq4_nl(u: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """u: int [N, K] in [0, 15] (indices into IQ4_VALUES); d: fp16 [N, K/32]. returns uint8 [N, K/32*18] IQ4_NL
    blocks (y = d*values[u])."""
    n, g = _check(u, "IQ4_NL", 0, 15)
    u = u.to(torch.int16).reshape(n, g, BLOCK)
    return torch.cat([_half_bytes(d, n, g, "IQ4_NL d"), _nibbles(u)], dim=-1).reshape(n, g * 18)


def pack_iq4_xs(u: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """u: int [N, K] in [0, 15] (K % 256 == 0); d: fp16 [N, K/256]; sc: int [N, K/32] in [-32, 31]. returns
    uint8 [N, K/256*136] IQ4_XS blocks: weight i of sub-block j is (d*sc_j)*values[u_i]."""
    n, g = _check(u, "IQ4_XS", 0, 15, SUPER_BLOCK)
    ls = (_check_fields(sc, "IQ4_XS sc", n, g * 8, -32, 31) + 32).reshape(n, g, 8)  # 0..63
    low = ls & 0xF
    scales_l = low[..., 0::2] | (low[..., 1::2] << 4)  # [N, G, 4]
    high = (ls >> 4).to(torch.int32) << torch.arange(0, 16, 2, dtype=torch.int32, device=u.device)
    scales_h = high.sum(dim=-1, keepdim=True)  # [N, G, 1]: a uint16, little-endian
    scales_h = torch.cat([scales_h & 0xFF, scales_h >> 8], dim=-1)
    qs = _nibbles(u.to(torch.int16).reshape(n, g * 8, BLOCK)).reshape(n, g, 128)
    return torch.cat([_half_bytes(d, n, g, "IQ4_XS d"), scales_h.to(torch.uint8), scales_l.to(torch.uint8), qs],
                     dim=-1).reshape(n, g * 136)


def k4_scale_bytes(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """The 12 scale bytes of Q4_K / Q5_K: sc, mn int [..., 8] -> uint8 [..., 12], computed as
    quantize_row_q4_K_ref writes them (values above 63 wrap as the C's uint8 stores do; pack_q4_k refuses them)."""
    sc, mn = sc.to(torch.int16) & 0xFF, mn.to(torch.int16) & 0xFF
    low = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                     (sc[..., 4:] & 0xF) | ((mn[..., 4:] & 0xF) << 4)], dim=-1)
    return (low & 0xFF).to(torch.uint8)


def k4_scales_from_bytes(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of k4_scale_bytes (ggml's get_scale_min_k4): uint8 [..., 12] -> (sc, mn uint8 [..., 8] in 0..63).
    Every 12 bytes decode to 16 six-bit values and re-encode to the same bytes."""
    b = b.to(torch.int16)
    q, m, lo = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat([q & 63, (lo & 0xF) | ((q >> 6) << 4)], dim=-1)
    mn = torch.cat([m & 63, (lo >> 4) | ((m >> 6) << 4)], dim=-1)
    return sc.to(torch.uint8), mn.to(torch.uint8)


def _k_header(d, dmin, sc, mn, n: int, g: int, name: str) -> torch.Tensor:
    """fp16 d, dmin [N, G], 6-bit sc, mn [N, G*8] -> uint8 [N, G, 16]: d, dmin, the 12 scale bytes."""
    sc = _check_fields(sc, f"{name} sc", n, g * 8, 0, 63).reshape(n, g, 8)
    mn = _check_fields(mn, f"{name} mn", n, g * 8, 0, 63).reshape(n, g, 8)
    return torch.cat([_half_bytes(d, n, g, f"{name} d"), _half_bytes(dmin, n, g, f"{name} dmin"),
                      k4_scale_bytes(sc, mn)], dim=-1)


def _k_nibbles(u: torch.Tensor) -> torch.Tensor:
    """uint [N, G, 256] (low 4 bits used) -> uint8 [N, G, 128]: per 64 weights, l low and l + 32 high nibble."""
    u = (u & 0xF).reshape(*u.shape[:2], 4, 2, 32)
    return (u[..., 0, :] | (u[..., 1, :] << 4)).to(torch.uint8).reshape(*u.shape[:2], 128)


def _k_unnibbles(qs: torch.Tensor) -> torch.Tensor:
    """Inverse of _k_nibbles: uint8 [N, G, 128] -> int16 [N, G, 256] in 0..15."""
    qs = qs.to(torch.int16).reshape(*qs.shape[:2], 4, 1, 32)
    return torch.cat([qs & 0xF, qs >> 4], dim=-2).reshape(*qs.shape[:2], SUPER_BLOCK)


def pack_q4_k(u: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
              mn: torch.Tensor) -> torch.Tensor:
    """u: int [N, K] in [0, 15] (K % 256 == 0); d, dmin: fp16 [N, K/256]; sc, mn: int [N, K/32] in [0, 63].
    returns uint8 [N, K/256*144] Q4_K blocks: weight i of sub-block j is (d*sc_j)*u_i - (dmin*mn_j)."""
    n, g = _check(u, "Q4_K", 0, 15, SUPER_BLOCK)
    u = u.to(torch.int16).reshape(n, g, SUPER_BLOCK)
    return torch.cat([_k_header(d, dmin, sc, mn, n, g, "Q4_K"), _k_nibbles(u)], dim=-1).reshape(n, g * 144)


def pack_q5_k(u: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
              mn: torch.Tensor) -> torch.Tensor:
    """u: int [N, K] in [0, 31] (K % 256 == 0); d, dmin: fp16 [N, K/256]; sc, mn: int [N, K/32] in [0, 63].
    returns uint8 [N, K/256*176] Q5_K blocks: weight i of sub-block j is (d*sc_j)*u_i - (dmin*mn_j)."""
    n, g = _check(u, "Q5_K", 0, 31, SUPER_BLOCK)
    u = u.to(torch.int16).reshape(n, g, SUPER_BLOCK)
    high = (u >> 4).reshape(n, g, 8, 32) << torch.arange(8, dtype=torch.int16, device=u.device).view(8, 1)
    qh = high.sum(dim=2).to(torch.uint8)  # bit j of qh[l]: bit 4 of weight 32*j + l
    return torch.cat([_k_header(d, dmin, sc, mn, n, g, "Q5_K"), qh, _k_nibbles(u)], dim=-1).reshape(n, g * 176)


def _two_bits(u: torch.Tensor) -> torch.Tensor:
    """uint [N, G, 256] (low 2 bits used) -> uint8 [N, G, 64]: per 128 weights, weight l + 32 s in bits 2s of byte l."""
    u = (u & 3).reshape(*u.shape[:2], 2, 4, 32)
    shifts = torch.arange(0, 8, 2, dtype=torch.int16, device=u.device).view(4, 1)
    return (u << shifts).sum(dim=3).to(torch.uint8).reshape(*u.shape[:2], 64)


def _untwo_bits(qs: torch.Tensor) -> torch.Tensor:
    """Inverse of _two_bits: uint8 [N, G, 64] -> int16 [N, G, 256] in 0..3."""
    qs = qs.to(torch.int16).reshape(*qs.shape[:2], 2, 1, 32)
    shifts = torch.arange(0, 8, 2, dtype=torch.int16, device=qs.device).view(4, 1)
    return ((qs >> shifts) & 3).reshape(*qs.shape[:2], SUPER_BLOCK)


def k3_scale_bytes(v: torch.Tensor) -> torch.Tensor:
    """The 12 scale bytes of Q3_K: v int [..., 16] in 0..63 (sc + 32) -> uint8 [..., 12], as quantize_row_q3_K_ref
    writes them."""
    v = v.to(torch.int16)
    low = v & 0xF
    high = (v >> 4).reshape(*v.shape[:-1], 4, 4)  # [..., j / 4, j % 4]
    shifts = torch.arange(0, 8, 2, dtype=torch.int16, device=v.device).view(4, 1)
    return torch.cat([low[..., :8] | (low[..., 8:] << 4), (high << shifts).sum(dim=-2)], dim=-1).to(torch.uint8)


def k3_scales_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """Inverse of k3_scale_bytes (ggml's dequantize_row_q3_K): uint8 [..., 12] -> int16 [..., 16] in 0..63."""
    b = b.to(torch.int16)
    low = torch.cat([b[..., :8] & 0xF, b[..., :8] >> 4], dim=-1)
    shifts = torch.arange(0, 8, 2, dtype=torch.int16, device=b.device).view(4, 1)
    high = ((b[..., 8:12].unsqueeze(-2) >> shifts) & 3).flatten(-2)  # [..., 16]: j / 4 major, j % 4 minor
    return low | (high << 4)


def pack_q2_k(u: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
              mn: torch.Tensor) -> torch.Tensor:
    """u: int [N, K] in [0, 3] (K % 256 == 0); d, dmin: fp16 [N, K/256]; sc, mn: int [N, K/16] in [0, 15].
    returns uint8 [N, K/256*84] Q2_K blocks: weight i of sub-block j (16 weights) is (d*sc_j)*u_i - (dmin*mn_j)."""
    n, g = _check(u, "Q2_K", 0, 3, SUPER_BLOCK)
    sc = _check_fields(sc, "Q2_K sc", n, g * 16, 0, 15).reshape(n, g, 16)
    mn = _check_fields(mn, "Q2_K mn", n, g * 16, 0, 15).reshape(n, g, 16)
    u = u.to(torch.int16).reshape(n, g, SUPER_BLOCK)
    return torch.cat([(sc | (mn << 4)).to(torch.uint8), _two_bits(u), _half_bytes(d, n, g, "Q2_K d"),
                      _half_bytes(dmin, n, g, "Q2_K dmin")], dim=-1).reshape(n, g * 84)


def pack_q3_k(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """q: int [N, K] in [-4, 3] (K % 256 == 0); d: fp16 [N, K/256]; sc: int [N, K/16] in [-32, 31].
    returns uint8 [N, K/256*110] Q3_K blocks: weight i of sub-block j (16 weights) is (d*sc_j)*q_i."""
    n, g = _check(q, "Q3_K", -4, 3, SUPER_BLOCK)
    sc = _check_fields(sc, "Q3_K sc", n, g * 16, -32, 31).reshape(n, g, 16)
    u = (q.to(torch.int16) + 4).reshape(n, g, SUPER_BLOCK)
    high = (u >> 2).reshape(n, g, 8, 32) << torch.arange(8, dtype=torch.int16, device=q.device).view(8, 1)
    hmask = high.sum(dim=2).to(torch.uint8)  # bit b of hmask[l]: bit 2 of weight 32*b + l
    return torch.cat([hmask, _two_bits(u), k3_scale_bytes(sc + 32), _half_bytes(d, n, g, "Q3_K d")],
                     dim=-1).reshape(n, g * 110)


def pack_q6_k(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """q: int [N, K] in [-32, 31] (K % 256 == 0); d: fp16 [N, K/256]; sc: int [N, K/16] in [-128, 127].
    returns uint8 [N, K/256*210] Q6_K blocks: weight i of sub-block j (16 weights) is (d*sc_j)*q_i."""
    n, g = _check(q, "Q6_K", -32, 31, SUPER_BLOCK)
    sc = _check_fields(sc, "Q6_K sc", n, g * 16, -128, 127).to(torch.int8).reshape(n, g, 16)
    L = (q.to(torch.int16) + 32).reshape(n, g, 2, 4, 32)  # [N, G, half, quarter, l]
    lo = L & 0xF
    ql = torch.cat([lo[..., 0, :] | (lo[..., 2, :] << 4), lo[..., 1, :] | (lo[..., 3, :] << 4)], dim=-1)
    shifts = torch.arange(0, 8, 2, dtype=torch.int16, device=q.device).view(4, 1)
    qh = ((L >> 4) << shifts).sum(dim=3)  # [N, G, 2, 32]
    return torch.cat([ql.to(torch.uint8).reshape(n, g, 128), qh.to(torch.uint8).reshape(n, g, 64),
                      sc.contiguous().view(torch.uint8), _half_bytes(d, n, g, "Q6_K d")], dim=-1).reshape(n, g * 210)


def _blocks(data: torch.Tensor, kind: str) -> torch.Tensor:
    size = GGML_TYPES[kind].block_bytes
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % size:
        raise ValueError(f"{kind}: expected uint8 [N, G*{size}], got {data.dtype} {tuple(data.shape)}")
    return data.reshape(data.shape[0], data.shape[1] // size, size)


def _half(b: torch.Tensor) -> torch.Tensor:
    """uint8 [N, G, 2] -> fp16 [N, G]."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def unpack_q4_0(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_q4_0: uint8 [N, G*18] -> (q int8 [N, G*32] in [-8, 7], d fp16 [N, G])."""
    b = _blocks(data, "Q4_0")
    return (_unnibbles(b[..., 2:]) - 8).to(torch.int8).reshape(b.shape[0], -1), _half(b[..., :2])


def unpack_q4_1(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of pack_q4_1: uint8 [N, G*20] -> (u uint8 [N, G*32] in [0, 15], d fp16 [N, G], m fp16 [N, G])."""
    b = _blocks(data, "Q4_1")
    return _unnibbles(b[..., 4:]).to(torch.uint8).reshape(b.shape[0], -1), _half(b[..., :2]), _half(b[..., 2:4])


def unpack_q5_0(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_q5_0: uint8 [N, G*22] -> (u uint8 [N, G*32] in [0, 31], d fp16 [N, G])."""
    b = _blocks(data, "Q5_0")
    u = _unnibbles(b[..., 6:]) | _unhigh_bits(b[..., 2:6])
    return u.to(torch.uint8).reshape(b.shape[0], -1), _half(b[..., :2])


def unpack_q5_1(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of pack_q5_1: uint8 [N, G*24] -> (u uint8 [N, G*32] in [0, 31], d fp16 [N, G], m fp16 [N, G])."""
    b = _blocks(data, "Q5_1")
    u = _unnibbles(b[..., 8:]) | _unhigh_bits(b[..., 4:8])
    return u.to(torch.uint8).reshape(b.shape[0], -1), _half(b[..., :2]), _half(b[..., 2:4])


def unpack_q8_0(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_q8_0: uint8 [N, G*34] -> (q int8 [N, G*32], d fp16 [N, G])."""
    b = _blocks(data, "Q8_0")
    return b[..., 2:].contiguous().view(torch.int8).reshape(b.shape[0], -1), _half(b[..., :2])


def unpack_iq4_nl(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_iq4_nl: uint8 [N, G*18] -> (u uint8 [N, G*32] in [0, 15], d fp16 [N, G])."""
    b = _blocks(data, "IQ4_NL")
    n, g = b.shape[:2]
    return _unnibbles(b[..., 2:]).to(torch.uint8).reshape(n, g * BLOCK), _half(b[..., :2])


def unpack_iq4_xs(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of pack_iq4_xs: uint8 [N, G*136] -> (u uint8 [N, G*256] in [0, 15], d fp16 [N, G],
    sc int8 [N, G*8] in [-32, 31]), as ggml's dequantize_row_iq4_xs reads ls."""
    b = _blocks(data, "IQ4_XS")
    n, g = b.shape[:2]
    scales_h = b[..., 2].to(torch.int32) | (b[..., 3].to(torch.int32) << 8)  # [N, G]
    high = (scales_h.unsqueeze(-1) >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)) & 3  # [N, G, 8]
    scales_l = b[..., 4:8].to(torch.int32)
    low = torch.stack([scales_l & 0xF, scales_l >> 4], dim=-1).reshape(n, g, 8)  # sub-block j: nibble j % 2 of byte j / 2
    sc = ((low | (high << 4)) - 32).to(torch.int8).reshape(n, g * 8)
    u = _unnibbles(b[..., 8:].reshape(n, g * 8, 16)).to(torch.uint8).reshape(n, g * SUPER_BLOCK)
    return u, _half(b[..., :2]), sc


def _unpack_k_header(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """uint8 [N, G, bytes] Q4_K / Q5_K blocks -> (d, dmin fp16 [N, G], sc, mn uint8 [N, G*8])."""
    sc, mn = k4_scales_from_bytes(b[..., 4:4 + K_SCALE_BYTES])
    n, g = b.shape[:2]
    return _half(b[..., 0:2]), _half(b[..., 2:4]), sc.reshape(n, g * 8), mn.reshape(n, g * 8)


def unpack_q4_k(data: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inverse of pack_q4_k: uint8 [N, G*144] -> (u uint8 [N, G*256] in [0, 15], d fp16 [N, G],
    dmin fp16 [N, G], sc uint8 [N, G*8] in [0, 63], mn uint8 [N, G*8] in [0, 63])."""
    b = _blocks(data, "Q4_K")
    u = _k_unnibbles(b[..., 16:]).to(torch.uint8).reshape(b.shape[0], b.shape[1] * SUPER_BLOCK)
    return (u, *_unpack_k_header(b))


def unpack_q5_k(data: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inverse of pack_q5_k: uint8 [N, G*176] -> (u uint8 [N, G*256] in [0, 31], d fp16 [N, G],
    dmin fp16 [N, G], sc uint8 [N, G*8] in [0, 63], mn uint8 [N, G*8] in [0, 63])."""
    b = _blocks(data, "Q5_K")
    n, g = b.shape[:2]
    qh = b[..., 16:48].to(torch.int16).reshape(n, g, 1, 32)
    high = (qh >> torch.arange(8, dtype=torch.int16, device=b.device).view(8, 1)) & 1  # [N, G, 8, 32]
    u = _k_unnibbles(b[..., 48:]) | (high.reshape(n, g, SUPER_BLOCK) << 4)
    return (u.to(torch.uint8).reshape(n, g * SUPER_BLOCK), *_unpack_k_header(b))


def unpack_q2_k(data: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inverse of pack_q2_k: uint8 [N, G*84] -> (u uint8 [N, G*256] in [0, 3], d fp16 [N, G], dmin fp16 [N, G],
    sc uint8 [N, G*16] in [0, 15], mn uint8 [N, G*16] in [0, 15])."""
    b = _blocks(data, "Q2_K")
    n, g = b.shape[:2]
    u = _untwo_bits(b[..., 16:80]).to(torch.uint8).reshape(n, g * SUPER_BLOCK)
    scales = b[..., :16].reshape(n, g * 16)
    return u, _half(b[..., 80:82]), _half(b[..., 82:84]), scales & 0xF, scales >> 4


def unpack_q3_k(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of pack_q3_k: uint8 [N, G*110] -> (q int8 [N, G*256] in [-4, 3], d fp16 [N, G],
    sc int8 [N, G*16] in [-32, 31])."""
    b = _blocks(data, "Q3_K")
    n, g = b.shape[:2]
    hm = b[..., :32].to(torch.int16).reshape(n, g, 1, 32)
    high = (hm >> torch.arange(8, dtype=torch.int16, device=b.device).view(8, 1)) & 1  # [N, G, 8, 32]
    u = _untwo_bits(b[..., 32:96]) | (high.reshape(n, g, SUPER_BLOCK) << 2)
    sc = k3_scales_from_bytes(b[..., 96:108]) - 32
    q = (u - 4).to(torch.int8).reshape(n, g * SUPER_BLOCK)
    return q, _half(b[..., 108:110]), sc.to(torch.int8).reshape(n, g * 16)


def unpack_q6_k(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of pack_q6_k: uint8 [N, G*210] -> (q int8 [N, G*256] in [-32, 31], d fp16 [N, G],
    sc int8 [N, G*16])."""
    b = _blocks(data, "Q6_K")
    n, g = b.shape[:2]
    ql = b[..., :128].to(torch.int16).reshape(n, g, 2, 1, 64)
    lo = torch.cat([ql & 0xF, ql >> 4], dim=3).reshape(n, g, 2, 4, 32)  # quarters 0, 1 low; 2, 3 high
    qh = b[..., 128:192].to(torch.int16).reshape(n, g, 2, 1, 32)
    hi = (qh >> torch.arange(0, 8, 2, dtype=torch.int16, device=b.device).view(4, 1)) & 3  # [N, G, 2, 4, 32]
    q = ((lo | (hi << 4)) - 32).to(torch.int8).reshape(n, g * SUPER_BLOCK)
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(n, g * 16)
    return q, _half(b[..., 208:210]), sc
