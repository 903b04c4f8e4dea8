"""Triton kernels for y = x @ dequant(W).T with W int2/int4/int8 (weight-only, "WNA16").

Registered as ``torch.ops.quantkit.wna16_gemm`` (``torch.library.triton_op``: torch.compile sees
through it to the kernels; the fake implementation allocates with ``new_empty``).

Weight layout (built once by ``wna16_layout.to_triton_layout``), with PW = 32 / bits:

- qweight int32 [ceil(K / PW), N]: word j of column n holds k = j*PW + i in bits [i*bits, (i+1)*bits),
  stored unsigned (value + 2**(bits-1)). N is contiguous, so a tile of words is one coalesced load.
- scales [G, N] fp16/bf16/fp32, G = K / group_size (1 per channel).
- zeros uint8 [G, N] (asymmetric only): unsigned zero zp + 2**(bits-1).
- dequant: w = (u - z) * s, z = zeros or the constant 2**(bits-1); an integer subtract and one
  multiply, exact in fp32 (the reference computes the same in fp32).

Kernels:

1. ``_wna16_matmul_kernel``, grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), split_k). Program (i, j, s)
   walks its share of K in tiles of BLOCK_KW words: it loads the [BLOCK_KW, BLOCK_N] words
   (``evict_first``: streamed once), the scales (one row when a tile lies inside one group, else one
   row per word), and for each of the PW bit fields i unpacks a [BLOCK_KW, BLOCK_N] slice of W
   (rows k = word*PW + i), multiplies it with the matching strided columns of x, and accumulates in
   fp32: with ``tl.dot`` (algo "dot") or as a broadcast multiply and sum (algo "gemv", M <= 4, no
   tensor-core padding). No reshape or interleave is needed, so the unpacked tile never leaves
   registers. With split_k == 1 it adds the bias and stores y in x's dtype; else it writes fp32
   partial sums [split_k, M, N] and
2. ``_splitk_reduce_kernel`` sums them, adds the bias and casts (deterministic; no atomics).
3. ``_wna16_dequant_kernel`` writes dequant(W).T [K, N] in x's dtype, for large M (algo "dequant"),
   followed by a dense ``torch.matmul``.

Interpreter (TRITON_INTERPRET=1, CPU tensors): ``tl.dot`` on bf16 inputs is silently wrong there, so
both operands are cast to fp32 (``DOT_FP32``); fp32 activations also use fp32 dot operands with
``input_precision="ieee"`` on GPUs (exact fp32, not TF32). Launch configurations:
``wna16_heuristics``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op, wrap_triton

from .packing import check_bits, packed_words
from .wna16_heuristics import DEFAULT_NUM_SMS, WNA16Config, choose_config

KERNELS_INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
TRITON_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REDUCE_BLOCK_N = 256
DEQUANT_BLOCK = (16, 64)  # (word rows, columns) per program of the dequant kernel


@triton.jit
def _wna16_matmul_kernel(
    x_ptr,  # [M, K] fp16/bf16/fp32, K contiguous (row stride stride_xm)
    qweight_ptr,  # int32 [KW, N], KW = cdiv(K, PW)
    scales_ptr,  # [G, N]
    zeros_ptr,  # uint8 [G, N] (read when HAS_ZEROS)
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] x dtype (written unless WRITE_PARTIAL), row stride stride_om
    partial_ptr,  # fp32 [split, M, N] (written when WRITE_PARTIAL)
    M,
    N,
    K,
    group_size,  # K / G
    k_split_len,  # values of K per split, a multiple of BLOCK_KW * PW
    stride_xm,
    stride_om,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_SINGLE: tl.constexpr,  # every K tile lies inside one group: load one scale row per tile
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,  # split-K > 1: write fp32 partial sums instead of y
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr,
):
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = BLOCK_KW * PER_WORD
    VALUE_MASK: tl.constexpr = (1 << BITS) - 1
    OFFSET: tl.constexpr = 1 << (BITS - 1)

    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_m = offs_m < M
    mask_n = offs_n < N
    num_words = tl.cdiv(K, PER_WORD)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BM, 1]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_split_len
    k_end = tl.minimum(k_begin + k_split_len, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_w = k0 // PER_WORD + tl.arange(0, BLOCK_KW)  # [BKW] word rows
        mask_w = offs_w < num_words
        mask_wn = mask_w[:, None] & mask_n[None, :]  # [BKW, BN]
        words = tl.load(
            qweight_ptr + offs_w[:, None] * N + offs_n[None, :], mask=mask_wn, other=0, eviction_policy="evict_first"
        )  # [BKW, BN] int32
        if SCALE_SINGLE:
            g = k0 // group_size
            s = tl.load(scales_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]  # [1, BN]
            if HAS_ZEROS:
                z = tl.load(zeros_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.int32)[None, :]  # [1, BN]
            else:
                z = OFFSET
        else:
            g_w = (offs_w * PER_WORD) // group_size  # [BKW]: a word never straddles two groups
            s = tl.load(scales_ptr + g_w[:, None] * N + offs_n[None, :], mask=mask_wn, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(zeros_ptr + g_w[:, None] * N + offs_n[None, :], mask=mask_wn, other=0).to(tl.int32)
            else:
                z = OFFSET
        for i in tl.static_range(PER_WORD):
            u = (words >> (i * BITS)) & VALUE_MASK  # [BKW, BN] unsigned values of rows k = word*PW + i
            w = (u - z).to(tl.float32) * s  # [BKW, BN]
            offs_k = offs_w * PER_WORD + i  # [BKW]
            xi = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)  # [BM, BKW]
            if USE_DOT:
                if DOT_FP32:
                    acc = tl.dot(xi.to(tl.float32), w, acc, input_precision="ieee")
                else:
                    acc = tl.dot(xi, w.to(xi.dtype), acc)
            else:
                acc += tl.sum(xi.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)  # [BM, BN]

    mask_mn = mask_m[:, None] & mask_n[None, :]
    if not WRITE_PARTIAL:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_mn)
    else:
        part_ptrs = partial_ptr + (pid_k * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
        tl.store(part_ptrs, acc, mask=mask_mn)


@triton.jit
def _splitk_reduce_kernel(
    partial_ptr,  # fp32 [split_k, M, N]
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] x dtype, row stride stride_om
    M,
    N,
    stride_om,
    split_k,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(split_k):
        acc += tl.load(partial_ptr + (s * M + m).to(tl.int64) * N + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _wna16_dequant_kernel(
    qweight_ptr,  # int32 [KW, N]
    scales_ptr,  # [G, N]
    zeros_ptr,  # uint8 [G, N] (read when HAS_ZEROS)
    out_ptr,  # [K, N] output dtype: dequant(W).T
    N,
    K,
    group_size,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_KW: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    PER_WORD: tl.constexpr = 32 // BITS
    VALUE_MASK: tl.constexpr = (1 << BITS) - 1
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    offs_w = tl.program_id(0) * BLOCK_KW + tl.arange(0, BLOCK_KW)  # [BKW]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_wn = (offs_w < tl.cdiv(K, PER_WORD))[:, None] & (offs_n < N)[None, :]
    words = tl.load(qweight_ptr + offs_w[:, None] * N + offs_n[None, :], mask=mask_wn, other=0)
    g_w = (offs_w * PER_WORD) // group_size
    s = tl.load(scales_ptr + g_w[:, None] * N + offs_n[None, :], mask=mask_wn, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(zeros_ptr + g_w[:, None] * N + offs_n[None, :], mask=mask_wn, other=0).to(tl.int32)
    else:
        z = OFFSET
    for i in tl.static_range(PER_WORD):
        u = (words >> (i * BITS)) & VALUE_MASK
        w = (u - z).to(tl.float32) * s  # [BKW, BN]
        offs_k = (offs_w * PER_WORD + i).to(tl.int64)
        mask = mask_wn & (offs_k < K)[:, None]
        tl.store(out_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------
def kernels_interpreted() -> bool:
    """True when triton was imported with TRITON_INTERPRET=1 (kernels then run on CPU tensors).

    Triton reads the variable when the kernels are decorated, i.e. when quantkit.kernels is first
    imported: set it before that."""
    return KERNELS_INTERPRETED


def triton_can_run_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and KERNELS_INTERPRETED)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def check_triton_operands(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
) -> tuple[int, int, int, int]:
    """Validate the operands of quantkit::wna16_gemm; returns (M, N, K, group_size)."""
    op = "quantkit::wna16_gemm"
    per_word = check_bits(bits, op)
    if x.dim() != 2 or x.dtype not in TRITON_X_DTYPES:
        raise ValueError(f"{op}: x must be 2-D [M, K] in one of {TRITON_X_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    if qweight.dtype != torch.int32 or qweight.dim() != 2 or qweight.shape[0] != packed_words(k, bits):
        raise ValueError(
            f"{op}: qweight must be int32 [ceil(K/{per_word})={packed_words(k, bits)}, N] for K={k} at {bits} bits, "
            f"got {qweight.dtype} {tuple(qweight.shape)}"
        )
    n = qweight.shape[1]
    if scales.dim() != 2 or scales.shape[1] != n or scales.dtype not in TRITON_X_DTYPES:
        raise ValueError(f"{op}: scales must be [G, N={n}] float, got {scales.dtype} {tuple(scales.shape)}")
    groups = scales.shape[0]
    if groups < 1 or k % groups:
        raise ValueError(f"{op}: scales has G={groups} groups, which does not divide K={k}")
    group_size = k // groups
    if groups > 1 and group_size % per_word:
        raise ValueError(
            f"{op}: group_size={group_size} must be a multiple of {per_word} (values per int32 word at {bits} bits) "
            "or cover the whole row (per channel); use backend='reference' for other group sizes"
        )
    if zeros is not None and (zeros.dtype != torch.uint8 or tuple(zeros.shape) != (groups, n)):
        raise ValueError(f"{op}: zeros must be uint8 [G={groups}, N={n}], got {zeros.dtype} {tuple(zeros.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"{op}: bias must be [N={n}], got {tuple(bias.shape)}")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device}, x on {x.device}")
    return m, n, k, group_size


def wna16_gemm_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    *,
    config: WNA16Config | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the kernels: y [M, N] = x [M, K] @ dequant(W).T (+ bias), in x's dtype.

    config: a WNA16Config to force (tests, sweeps); default ``choose_config``.
    out: optional [M, N] x-dtype output buffer; workspace: optional fp32 buffer of at least
    split_k * M * N elements for split-K partial sums (algo "dequant": at least K * N elements in
    x's dtype for the dequantized weight). Both are overwritten entirely before being read.
    """
    m, n, k, group_size = check_triton_operands(x, qweight, scales, zeros, bias, bits)
    if not triton_can_run_on(x.device):
        raise RuntimeError(
            "the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 set before quantkit.kernels is "
            f"imported, to run on CPU); got tensors on {x.device}"
        )
    cfg = config or choose_config(m, n, k, bits, num_sms(x.device))
    x = x.contiguous()
    if out is None:
        out = x.new_empty((m, n))
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1 or out.device != x.device:
        raise ValueError(f"out must be a row-major [{m}, {n}] {x.dtype} tensor on {x.device}")
    if m == 0:
        return out
    per_word = 32 // bits
    has_zeros, has_bias = zeros is not None, bias is not None
    zeros_arg = zeros if has_zeros else scales  # never read
    bias_arg = bias if has_bias else scales  # never read

    block_k = cfg.block_kw * per_word
    k_tiles = -(-k // block_k)
    split = min(cfg.split_k, k_tiles)
    if workspace is not None:
        need, need_dtype = (k * n, x.dtype) if cfg.algo == "dequant" else (split * m * n, torch.float32)
        if workspace.numel() < need or workspace.dtype != need_dtype or not workspace.is_contiguous():
            raise ValueError(f"workspace must be a contiguous {need_dtype} tensor of at least {need} elements")
    if cfg.algo == "dequant":
        w_t = x.new_empty((k, n)) if workspace is None else workspace[: k * n].view(k, n)  # [K, N]
        grid = (triton.cdiv(packed_words(k, bits), DEQUANT_BLOCK[0]), triton.cdiv(n, DEQUANT_BLOCK[1]))
        wrap_triton(_wna16_dequant_kernel)[grid](
            qweight, scales, zeros_arg, w_t, n, k, group_size,
            BITS=bits, HAS_ZEROS=has_zeros, BLOCK_KW=DEQUANT_BLOCK[0], BLOCK_N=DEQUANT_BLOCK[1],
        )
        if has_bias:
            torch.addmm(bias.to(x.dtype), x, w_t, out=out)
        else:
            torch.mm(x, w_t, out=out)
        return out

    k_split_len = -(-k_tiles // split) * block_k
    scale_single = groups_single(group_size, k, block_k)
    if split > 1:
        partial = (
            x.new_empty((split, m, n), dtype=torch.float32)
            if workspace is None
            else workspace[: split * m * n].view(split, m, n)
        )
    else:
        partial = out  # never written
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    wrap_triton(_wna16_matmul_kernel)[grid](
        x, qweight, scales, zeros_arg, bias_arg, out, partial,
        m, n, k, group_size, k_split_len, x.stride(0), out.stride(0),
        BITS=bits, HAS_ZEROS=has_zeros, HAS_BIAS=has_bias, SCALE_SINGLE=scale_single,
        USE_DOT=cfg.algo == "dot", DOT_FP32=KERNELS_INTERPRETED or x.dtype == torch.float32,
        WRITE_PARTIAL=split > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_KW=cfg.block_kw,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        wrap_triton(_splitk_reduce_kernel)[(m, triton.cdiv(n, REDUCE_BLOCK_N))](
            partial, bias_arg, out, m, n, out.stride(0), split,
            HAS_BIAS=has_bias, BLOCK_N=REDUCE_BLOCK_N,
        )
    return out


def groups_single(group_size: int, k: int, block_k: int) -> bool:
    """True when every K tile of block_k values lies inside one scale group."""
    return group_size == k or group_size % block_k == 0


def wna16_gemm_torch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
) -> torch.Tensor:
    """Pure-torch twin of the kernels on the same (Triton) layout: dequantize in fp32, matmul in fp32.

    Traced instead of the kernels when the op is compiled on CPU tensors (the interpreter cannot run
    on fake tensors) and used by the tests as a layout check.
    """
    m, n, k, group_size = check_triton_operands(x, qweight, scales, zeros, bias, bits)
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=x.device, dtype=torch.int32) * bits
    u = (qweight.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)  # [KW, PW, N]
    u = u.reshape(-1, n)[:k]  # [K, N]
    z = zeros.to(torch.int32) if zeros is not None else torch.full_like(scales, 1 << (bits - 1), dtype=torch.int32)
    z = z.repeat_interleave(group_size, dim=0)  # [K, N]
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)  # [K, N]
    w_t = (u - z).to(torch.float32) * s  # [K, N]
    y = x.to(torch.float32) @ w_t
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


@triton_op("quantkit::wna16_gemm", mutates_args=())
def wna16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
) -> torch.Tensor:
    """y = x @ dequant(W).T (+ bias) on the Triton layout; fp32 accumulation, output in x's dtype.

    Args:
        x: fp16/bf16/fp32 [M, K], any M (made contiguous).
        qweight: int32 [ceil(K*bits/32), N]; word j of column n holds k = j*(32/bits) + i at bits
            [i*bits, (i+1)*bits), unsigned (value + 2**(bits-1)).
        scales: [G, N] fp16/bf16/fp32, G = K / group_size; group_size a multiple of 32/bits, or G = 1.
        zeros: uint8 [G, N] unsigned zero points (zp + 2**(bits-1)) for asymmetric weights, or None.
        bias: optional [N].
        bits: 2, 4 or 8.
    Returns:
        [M, N] in x's dtype; w[n, k] = (u[k, n] - z[k // group_size, n]) * scales[k // group_size, n].
    Runs on CUDA tensors, or on CPU tensors when triton was imported with TRITON_INTERPRET=1.
    """
    if x.device.type == "cpu" and is_fake(x):
        return wna16_gemm_torch(x, qweight, scales, zeros, bias, bits)
    return wna16_gemm_triton(x, qweight, scales, zeros, bias, bits)


@wna16_gemm.register_fake
def _wna16_gemm_fake(x, qweight, scales, zeros, bias, bits):
    m, n, _, _ = check_triton_operands(x, qweight, scales, zeros, bias, bits)
    return x.new_empty((m, n))
