"""GGUF (ggml) block layouts Q4_0, Q4_1 and Q8_0: the only home of their byte and nibble orders in quantkit.

ggml stores a row of K weights as K / 32 blocks of 32 (ggml-common.h), little-endian:

- Q4_0, 18 bytes: fp16 d, then 16 bytes qs; weight j (0..15) in the low nibble of qs[j], weight j + 16 in
  the high nibble; y = d * (nibble - 8). (Not the compressed-tensors order of kernels/packing.py, which
  puts consecutive weights in consecutive nibbles.)
- Q4_1, 20 bytes: fp16 d, fp16 m, 16 bytes qs in the Q4_0 nibble order; y = d * nibble + m.
- Q8_0, 34 bytes: fp16 d, then 32 int8 qs; y = d * q.

Rows are independent; a tensor [N, K] is stored as uint8 [N, K / 32 * block bytes] (what the `gguf`
package's GGUFWriter.add_tensor takes with raw_dtype=...). Pure torch, no other quantkit import.
"""

from __future__ import annotations

import torch

BLOCK = 32  # weights per block, all three types
#: bytes per block of each type
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _check(q: torch.Tensor, name: str, lo: int, hi: int) -> tuple[int, int]:
    if q.dim() != 2:
        raise ValueError(f"{name}: expected [N, K] integers, got shape {tuple(q.shape)}")
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got {q.dtype}")
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"{name}: K = {k} is not a multiple of the block size {BLOCK}")
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"{name}: values outside [{lo}, {hi}]")
    return n, k // BLOCK


def _half_bytes(x: torch.Tensor, n: int, g: int, name: str) -> torch.Tensor:
    """fp16 [N, G] -> uint8 [N, G, 2] (little-endian, as the machine stores it: x86 and ARM are)."""
    if x.dtype != torch.float16 or tuple(x.shape) != (n, g):
        raise ValueError(f"{name}: expected float16 [{n}, {g}], got {x.dtype} {tuple(x.shape)}")
    return x.contiguous().view(torch.uint8).reshape(n, g, 2)


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


def pack_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q: int [N, K] in [-128, 127]; d: fp16 [N, K/32]. returns uint8 [N, K/32*34] Q8_0 blocks (y = d*q)."""
    n, g = _check(q, "Q8_0", -128, 127)
    qs = q.to(torch.int8).reshape(n, g, BLOCK).contiguous().view(torch.uint8)
    return torch.cat([_half_bytes(d, n, g, "Q8_0 d"), qs], dim=-1).reshape(n, -1)


def _blocks(data: torch.Tensor, kind: str) -> torch.Tensor:
    size = BLOCK_BYTES[kind]
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % size:
        raise ValueError(f"{kind}: expected uint8 [N, G*{size}], got {data.dtype} {tuple(data.shape)}")
    return data.reshape(data.shape[0], -1, size)


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


def unpack_q8_0(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_q8_0: uint8 [N, G*34] -> (q int8 [N, G*32], d fp16 [N, G])."""
    b = _blocks(data, "Q8_0")
    return b[..., 2:].contiguous().view(torch.int8).reshape(b.shape[0], -1), _half(b[..., :2])


def dequantize_blocks(data: torch.Tensor, kind: str) -> torch.Tensor:
    """uint8 blocks of `kind` [N, G*bytes] -> fp32 [N, G*32] (ggml's dequantize_row_* in fp32)."""
    if kind == "Q4_1":
        u, d, m = unpack_q4_1(data)
        n = u.shape[0]
        return (u.float().reshape(n, -1, BLOCK) * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)).reshape(n, -1)
    q, d = unpack_q4_0(data) if kind == "Q4_0" else unpack_q8_0(data) if kind == "Q8_0" else (None, None)
    if q is None:
        raise ValueError(f"unknown block type {kind!r}; one of {sorted(BLOCK_BYTES)}")
    n = q.shape[0]
    return (q.float().reshape(n, -1, BLOCK) * d.float().unsqueeze(-1)).reshape(n, -1)
