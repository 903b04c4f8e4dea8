"""The bandwidth-bound Triton GEMV for y = x @ dequant(W).T at small M (decode: M <= 4).

Layout read (``wna16_layout.to_triton_layout``, PW = 32 / bits values per word, B = 8 word rows per
interleave block): qweight int32 [KW, N], N contiguous, word row b*B + r holding k = b*B*PW + i*B + r
in bit field i; scales [G, N]; zeros uint8 [G, N] (asymmetric only).

What each program does (grid (cdiv(N, BLOCK_N), split_k)): BLOCK_N is a multiple of 4 * 32 *
num_warps, so every thread owns groups of 4 adjacent columns and each word row it reads is one
16-byte ``ld.global.v4.b32`` (four int32 words = 4 x PW weights); all warps lie along N and the B
word rows of a block sit in the same thread, so the sum over K is a chain of FMAs in registers (no
shuffles, no shared memory) and each thread has B x (BLOCK_N / (128 * num_warps)) independent
16-byte loads in flight per block. Bit field i of the block is B consecutive values of K, so the
activations it multiplies are one contiguous 16-byte load (bf16/fp16) per row of x, the same for
every thread of the warp (a broadcast). The program walks ``iters`` blocks of its K slice (split-K:
the slices cover the SMs several times over even when N is small).

Dequantization without an int -> float conversion instruction: OR-ing an unsigned value u < 2**23
into the mantissa of 2**23 (bits 0x4B000000) gives the fp32 number 2**23 + u exactly; subtracting
(2**23 + z) leaves u - z exactly, with z the per-column unsigned zero (or the constant 2**(bits-1)).
Per weight that is a bit-field extract, one OR, one FADD and one FMA with x: no I2F, no per-element
scale. The scale multiplies the block's partial sum once (``SCALE_SINGLE``: the block lies inside one
group) or each bit field's partial sum (smaller groups: a group is a multiple of B values, so one bit
field of a block never straddles two groups).

Reduction: with split_k == 1 the program adds the bias and stores y; else it stores its fp32 partial
sums [split, M, N] and either ``_splitk_reduce_kernel`` (wna16_triton) adds them in a fixed order
(deterministic, CUDA-graph capturable, no atomics; a second launch), or, with ``REDUCE_LAST``, the
last program of each column tile to finish (an int32 arrival counter per tile, zero on entry, reset
on exit) adds them in the same fixed order in the same launch. ``REDUCE_LAST`` is compiled and
tested but not picked by the rules until a GPU measures it (``--sweep`` times it).

Not expressible in portable Triton (and not done): two int4 values per 32-bit op as packed fp16x2
(needs ``inline_asm_elementwise``, which the interpreter cannot run).

The pure-torch reference of this kernel is ``reference.wna16_gemm_torch`` (same layout).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _wna16_gemv_kernel(
    x_ptr,  # [M, K] fp16/bf16/fp32, K contiguous (row stride stride_xm), M <= BLOCK_M
    qweight_ptr,  # int32 [KW, N], N contiguous, K interleaved in blocks of BLOCK_KW rows (wna16_layout)
    scales_ptr,  # [G, N]
    zeros_ptr,  # uint8 [G, N] (read when HAS_ZEROS)
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] x dtype (written unless WRITE_PARTIAL), row stride stride_om
    partial_ptr,  # fp32 [split, M, N] (written when WRITE_PARTIAL)
    counters_ptr,  # int32 [cdiv(N, BLOCK_N)], zero on entry and on exit (used when REDUCE_LAST)
    M,
    N,
    K,
    group_size,  # K / G: a multiple of BLOCK_KW, or K
    words_per_split,  # word rows per program along K, a multiple of BLOCK_KW
    iters,  # words_per_split // BLOCK_KW (a scalar loop bound: triton 3.6's interpreter needs one)
    stride_xm,
    stride_om,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_SINGLE: tl.constexpr,  # every block lies inside one group: scale the block's partial sum once
    WRITE_PARTIAL: tl.constexpr,
    REDUCE_LAST: tl.constexpr,  # split-K: the last program of a column tile adds the partials (one launch)
    BLOCK_M: tl.constexpr,  # next power of two >= M
    BLOCK_N: tl.constexpr,  # 4 * 32 * num_warps: 4 adjacent columns per thread
    BLOCK_KW: tl.constexpr,  # word rows per tile = the layout's interleave block (all in one thread)
):
    PER_WORD: tl.constexpr = 32 // BITS
    VALUE_MASK: tl.constexpr = (1 << BITS) - 1
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    MAGIC_BITS: tl.constexpr = 0x4B000000
    MAGIC: tl.constexpr = 8388608.0

    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)  # [BM]
    groups = tl.cdiv(K, group_size)
    # Everything inside the loop is 3-D [BM, BKW, BN] (size-1 axes where a tensor does not vary), so the
    # layout the 16-byte weight loads get (4 adjacent columns per thread, all BKW rows in the same
    # thread) is the layout of every product and of the sum over BKW: no layout conversion, no shared
    # memory, no shuffles.
    cols = offs_n[None, None, :]  # [1, 1, BN]
    mask_cols = cols < N
    rows = tl.arange(0, BLOCK_KW)[None, :, None]  # [1, BKW, 1]
    x_rows2 = x_ptr + offs_m[:, None] * stride_xm  # [BM, 1]
    mask_x_rows2 = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_M, 1, BLOCK_N), dtype=tl.float32)
    w_begin = pid_k * words_per_split
    for it in range(iters):
        w0 = w_begin + it * BLOCK_KW  # first word row of this block
        k0 = w0 * PER_WORD  # first value of K of this block
        words = tl.load(qweight_ptr + (w0 + rows) * N + cols, mask=mask_cols, other=0,
                        eviction_policy="evict_first")  # [1, BKW, BN] int32 (KW is padded: no row mask)
        if SCALE_SINGLE:
            g = tl.minimum(k0 // group_size, groups - 1)
            s = tl.load(scales_ptr + g * N + cols, mask=mask_cols, other=0.0).to(tl.float32)  # [1, 1, BN]
            if HAS_ZEROS:
                bias_f = tl.load(zeros_ptr + g * N + cols, mask=mask_cols, other=0).to(tl.float32) + MAGIC
            else:
                bias_f = MAGIC + OFFSET
            part = tl.zeros((BLOCK_M, BLOCK_KW, BLOCK_N), dtype=tl.float32)  # per row: one FMA per weight
        for i in tl.static_range(PER_WORD):
            if not SCALE_SINGLE:  # bit field i of the block: values k0 + i*BKW .. + BKW - 1, one group
                g = tl.minimum((k0 + i * BLOCK_KW) // group_size, groups - 1)
                s = tl.load(scales_ptr + g * N + cols, mask=mask_cols, other=0.0).to(tl.float32)  # [1, 1, BN]
                if HAS_ZEROS:
                    bias_f = tl.load(zeros_ptr + g * N + cols, mask=mask_cols, other=0).to(tl.float32) + MAGIC
                else:
                    bias_f = MAGIC + OFFSET
            u = (words >> (i * BITS)) & VALUE_MASK  # [1, BKW, BN] unsigned values of k = k0 + i*BKW + row
            w = (u | MAGIC_BITS).to(tl.float32, bitcast=True) - bias_f  # u - z, exact
            offs_k = tl.max_contiguous(tl.multiple_of(k0 + i * BLOCK_KW + tl.arange(0, BLOCK_KW), BLOCK_KW), BLOCK_KW)
            # [BM, BKW] loaded 2-D (contiguous along K: one 16-byte load per row of M), then broadcast along N
            xi = tl.load(x_rows2 + offs_k[None, :], mask=mask_x_rows2 & (offs_k < K)[None, :], other=0.0)
            xi = xi.to(tl.float32)[:, :, None]  # [BM, BKW, 1]
            if SCALE_SINGLE:
                part += xi * w  # [BM, BKW, BN]
            else:
                acc += tl.sum(xi * w, axis=1, keep_dims=True) * s  # [BM, 1, BN]
        if SCALE_SINGLE:
            acc += tl.sum(part, axis=1, keep_dims=True) * s

    acc = tl.reshape(acc, (BLOCK_M, BLOCK_N))
    mask_mn = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if WRITE_PARTIAL:
        part_ptrs = partial_ptr + (pid_k * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
        tl.store(part_ptrs, acc, mask=mask_mn)
        if REDUCE_LAST:
            # Every thread's partial is stored before one thread counts this program in (release), and
            # the program that counts last (acquire) reads all partials from L2 in a fixed order, so the
            # sum is deterministic; it then resets the counter for the next launch (or graph replay).
            tl.debug_barrier()
            arrived = tl.atomic_add(counters_ptr + pid_n, 1, sem="acq_rel")
            if arrived == tl.num_programs(1) - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(tl.num_programs(1)):
                    total += tl.load(partial_ptr + (s * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :],
                                     mask=mask_mn, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
                out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask_mn)
                tl.atomic_xchg(counters_ptr + pid_n, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_mn)
