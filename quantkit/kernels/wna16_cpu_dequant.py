"""Large-M path of the CPU weight-only linears: dequantize the packed weight once, then a dense matmul.

PyTorch's weight-only CPU kernels (``aten._weight_int4pack_mm_for_cpu``, ``aten._weight_int8pack_mm``)
decode the packed weight again for every few rows of x: their time grows linearly with M, and from
M ~ 16 they lose to the dense matmul (0.4-0.9x at M = 16..64). For many rows (prefill) it is cheaper to
decode each weight once into a scratch in the compute dtype and hand it to the dense GEMM, whose time
per row is far lower.

The switch (``cpu_kernel_choice``, ``DEQUANT_MIN_ROWS``): dequantize once from 32 rows for int8 per
channel, 128 for int4 (and int8 groups, which run as two int4 halves). Reasoning, in units that do not
depend on the CPU's speed:

- the fused kernel's time is about M x (one pass of multiply-adds over the weight): it re-decodes the
  packed weight for each row (or small block of rows), so its time per row stays near a GEMV's;
- the dequantize-once path pays P passes over a K x N scratch in the compute dtype (int8: one
  conversion; int4: unpack, convert, scale: about four), then a dense GEMM, blocked and
  cache-resident, whose time per row is a small fraction of a GEMV's;
- so the break-even M is about P passes counted in fused rows, times a small factor: a number of rows
  proportional to the number of passes the dequantization makes, whatever the absolute speed. int4
  needs about four times int8's. Measured (``evals/kernels/cpu/cpu_dequant_crossover.md``, one
  4096x4096 layer, paths interleaved): int8 crosses at M = 16-32 with bf16 activations and 32-64 with
  fp32; int4 at 64 (bf16) and 128 (fp32). Each threshold sits in its band, so either path is within
  ~1.3x of the other there, and decode and short prompts (M = 1..8, where the fused kernels stream the
  packed bytes at 2-5x a dense GEMV) never take the dequantization.

Compute dtype (``cpu_flags.compute_dtype``): fp32 activations compute in fp32; bf16 in bf16 where the
CPU has native bf16 arithmetic (x86 avx512_bf16 / AMX), else in fp32 (bf16 GEMM is emulated there, far
slower than fp32); fp16 computes in fp32. The result is cast back to x's dtype.

Numerics: the scales are the bf16 ones of the CPU layout (the fused kernels read the same), so the
error is of bf16 order whatever x's dtype (quantkit.kernels.wna16_cpu). Values are exact up to that:
the 4-bit value and the scale meet in one fused multiply-add per weight.

Scratch: one buffer per (slot, dtype), grown to the largest layer and reused by every call in the
process (layers run one after another); ``release_scratch()`` frees it.

Layout of ``aten._convert_weight_to_int4pack_for_cpu`` (uint8 [N, K/2], read by ``unpack_int4_to``):
rows of W in blocks of ``BLOCK_N`` (64 with AVX-512, 32 otherwise) stored one after the other; a full
block is [K, BLOCK_N/2] bytes whose byte j holds row j (low nibble) and row j + BLOCK_N/2 (high
nibble); the last, shorter block of t rows is [K, t/2] bytes whose byte j holds rows 2j and 2j + 1.
The block size is found once per process by packing a probe (``int4_block_n``); if no known layout
matches, the dequantize-once path is off and the fused kernel runs at every M.
"""

from __future__ import annotations

import functools

import torch

from .cpu_flags import compute_dtype

_BLOCK_N_CANDIDATES = (64, 32, 16)
_SCRATCH: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def scratch(slot: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A reused 1-D buffer of at least ``numel`` elements (a view of exactly ``numel`` is returned)."""
    buf = _SCRATCH.get((slot, dtype))
    if buf is None or buf.numel() < numel:
        _SCRATCH.pop((slot, dtype), None)  # free the smaller one before allocating
        buf = torch.empty(numel, dtype=dtype)
        _SCRATCH[(slot, dtype)] = buf
    return buf[:numel]


def release_scratch() -> None:
    """Free the dequantization buffers (they are allocated again on the next large-M call)."""
    _SCRATCH.clear()


# ----------------------------------------------------------------------------------------------
# int4 (PyTorch's CPU int4 layout)
# ----------------------------------------------------------------------------------------------
def _int4_blocks(n: int, block_n: int) -> list[tuple[int, int, bool]]:
    """(first row, rows, paired) of each run of blocks: full blocks in one run, then the tail."""
    full = n // block_n * block_n
    runs = [(0, full, False)] if full else []
    if n > full:
        runs.append((full, n - full, True))
    return runs


def unpack_int4_to(out: torch.Tensor, packed: torch.Tensor, block_n: int) -> None:
    """Write the unsigned 4-bit values of ``packed`` into ``out`` as W^T, converting to out's dtype.

    packed: uint8 [N, K/2] from ``aten._convert_weight_to_int4pack_for_cpu``; out: [K, N] (any dtype
    that holds 0..15 exactly, contiguous); out[k, n] = u[n, k].
    """
    n, k = packed.shape[0], packed.shape[1] * 2
    flat = packed.reshape(-1)
    for start, rows, paired in _int4_blocks(n, block_n):
        width = block_n if not paired else rows
        nblocks = rows // width
        words = flat[start * k // 2 : (start + rows) * k // 2].view(nblocks, k, width // 2)  # [nb, K, w/2]
        dst = out[:, start : start + rows]  # [K, rows]
        if paired:  # byte j: rows 2j (low nibble), 2j + 1 (high)
            dst = dst.unflatten(1, (width // 2, 2))  # [K, w/2, 2]
            dst[..., 0].copy_(words[0] & 15)
            dst[..., 1].copy_(words[0] >> 4)
        else:  # byte j of a block: rows j (low nibble), j + w/2 (high)
            dst = dst.unflatten(1, (nblocks, 2, width // 2))  # [K, nb, 2, w/2]
            dst[:, :, 0].copy_((words & 15).transpose(0, 1))
            dst[:, :, 1].copy_((words >> 4).transpose(0, 1))


@functools.cache
def int4_block_n() -> int | None:
    """The row block of the CPU int4 layout in this process (64 with AVX-512, 32 otherwise), or None."""
    gen = torch.Generator().manual_seed(0)
    for n in (144, 176):  # full blocks plus a tail of 16 or 48 rows for every candidate
        u = torch.randint(0, 16, (n, 64), dtype=torch.int32, generator=gen)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
        matches = []
        for block_n in _BLOCK_N_CANDIDATES:
            out = torch.empty(64, n, dtype=torch.uint8)
            unpack_int4_to(out, packed, block_n)
            if torch.equal(out.t().to(torch.int32), u):
                matches.append(block_n)
        if not matches:
            return None
    return matches[0]


def dequantize_int4_t(
    weight: torch.Tensor, scales_zeros: torch.Tensor, dtype: torch.dtype, slot: str = "int4"
) -> torch.Tensor:
    """W^T [K, N] in ``dtype`` (a scratch view) from the CPU int4 layout.

    weight: uint8 [N, K/2]; scales_zeros: bf16 [K/gc, N, 2]; w[n, k] = (u - 8) * s + z with s, z of
    group k // gc. Computed as u * s + (z - 8 s), one multiply-add per weight (z - 8 s in fp32, rounded
    once to ``dtype``).
    """
    block_n = int4_block_n()
    if block_n is None:
        raise RuntimeError("the CPU int4 layout of this PyTorch build is not one quantkit can read")
    n, k = weight.shape[0], weight.shape[1] * 2
    groups = scales_zeros.shape[0]
    u = scratch("int4_u", k * n, torch.uint8).view(k, n)
    unpack_int4_to(u, weight, block_n)  # uint8 first: the strided shuffle moves 1-byte values
    out = scratch(slot, k * n, dtype).view(groups, k // groups, n)  # [G, gc, N]
    out.copy_(u.view(groups, k // groups, n))  # exact; contiguous conversion
    s = scales_zeros[..., 0].to(torch.float32)  # [G, N]
    z = scales_zeros[..., 1].to(torch.float32) - 8 * s  # [G, N]
    torch.addcmul(z.to(dtype).unsqueeze(1), out, s.to(dtype).unsqueeze(1), out=out)  # in place, one dtype
    return out.view(k, n)


def int4_linear_dequantized(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales_zeros: torch.Tensor,
    weight_lo: torch.Tensor | None,
    scales_zeros_lo: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Same contract as ``wna16_cpu.wna16_int4_cpu`` (x [M, K] -> [M, N] in x's dtype), by dequantize + GEMM."""
    dtype = compute_dtype(x.dtype)
    w_t = dequantize_int4_t(weight, scales_zeros, dtype)  # [K, N]
    if weight_lo is not None:  # int8 groups: W = high half + low half
        w_t = w_t.add_(dequantize_int4_t(weight_lo, scales_zeros_lo, dtype, slot="int4_lo"))
    xc = x.to(dtype)
    y = torch.addmm(bias.to(dtype), xc, w_t) if bias is not None else xc @ w_t  # [M, N]
    return y.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# int8 per channel
# ----------------------------------------------------------------------------------------------
def int8_linear_dequantized(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Same contract as ``wna16_cpu.wna16_int8_cpu``, by one int8 -> float conversion and a dense GEMM.

    The per-channel scale multiplies the [M, N] product instead of the [N, K] weight:
    y = (x @ q.T) * s - rowsum(x) * zp * s + bias.
    """
    dtype = compute_dtype(x.dtype)
    n, k = weight.shape
    q = scratch("int8", n * k, dtype).view(n, k)
    q.copy_(weight)  # exact: |q| <= 128
    xc = x.to(dtype)
    y = (xc @ q.t()).to(torch.float32) * scale.to(torch.float32)  # [M, N]
    if zero_scale is not None:
        y = y - xc.to(torch.float32).sum(dim=1, keepdim=True) * zero_scale
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)
