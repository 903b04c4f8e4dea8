"""Triton kernels for y = x @ dequant(W).T with W int2/int4/int8 (weight-only, "WNA16").

Registered as ``torch.ops.quantkit.wna16_gemm`` (``torch.library.triton_op``: torch.compile sees
through it to the kernels; the fake implementation allocates with ``new_empty``). Imported by
``triton_ops.register_ops`` only (triton and, through ``triton_op``, torch._inductor); ``wna16.wna16_linear``
and ``prepare_wna16`` call that before they reach the op. The operand checks are
``wna16_layout.check_triton_operands``, the pure-torch twin ``reference.wna16_gemm_torch``.

Weight layout (built once by ``wna16_layout.to_triton_layout``), with PW = 32 / bits and B =
``TRITON_WORD_BLOCK`` (8) word rows per interleave block:

- qweight int32 [KW, N], KW = ceil(K / PW) rounded up to a multiple of B; N contiguous. Word row
  b*B + r holds k = b*B*PW + i*B + r in bits [i*bits, (i+1)*bits), stored unsigned (value + 2**(bits-1)):
  bit field i of a block's B rows is B consecutive values of K.
- scales [G, N] fp16/bf16/fp32, G = K / group_size (1 per channel); group_size a multiple of B, or K.
- zeros uint8 [G, N] (asymmetric only): unsigned zero zp + 2**(bits-1).
- w = (u - z) * s, z = zeros or the constant 2**(bits-1).

Kernels (the algorithm is chosen per call by ``wna16_heuristics.choose_config``):

1. "gemv" (decode: M <= 2 by rule, up to 4): ``wna16_gemv._wna16_gemv_kernel``, built for bandwidth (16-byte weight
   loads, int -> float by the 2**23 magic-number trick, scale once per block; see its docstring).
2. "dot" (M > 4): ``_wna16_matmul_kernel``, grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), split_k).
   Each K step is one interleave block: the [B, BLOCK_N] words are unpacked into the [PW, B, BLOCK_N]
   bit fields, which reshape to the block's [B*PW, BLOCK_N] values *in K order*, so one ``tl.dot``
   with K = B*PW (64 at int4) takes a contiguous [BLOCK_M, B*PW] tile of x.
3. Split-K (both): programs write fp32 partial sums [split_k, M, N]; ``_splitk_reduce_kernel`` adds
   them in a fixed order, adds the bias and casts (deterministic, no atomics: bf16 atomics do not exist).
   The GEMV can instead let the last program of each column tile add them (config ``reduce="last"``:
   one launch, plus a memset of the arrival counters); not picked by the rules until measured.
4. "dequant" (prefill, large M): ``_wna16_dequant_kernel`` writes dequant(W).T [K, N] in x's dtype,
   then a dense ``torch.matmul`` (the matmul is compute-bound there; see wna16_heuristics).

Interpreter (TRITON_INTERPRET=1, CPU tensors): ``tl.dot`` on bf16 inputs is silently wrong there, so
both operands are cast to fp32 (``DOT_FP32``); fp32 activations also use fp32 dot operands with
``input_precision="ieee"`` on GPUs (exact fp32, not TF32). Loop bounds are scalar arguments, not
``tl.minimum`` results (triton 3.6's interpreter rejects a tensor bound in ``range``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op, wrap_triton

from .reference import wna16_gemm_torch
from .wna16_gemv import _wna16_gemv_kernel
from .wna16_heuristics import DEFAULT_NUM_SMS, WNA16Config, choose_config
from .triton_interpret import triton_can_run_on
from .wna16_layout import TRITON_WORD_BLOCK, check_triton_operands

KERNELS_INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
REDUCE_BLOCK_N = 256
DEQUANT_BLOCK_N = 64  # columns per program of the dequant kernel (rows: one interleave block)


@triton.jit
def _wna16_matmul_kernel(
    x_ptr,  # [M, K] fp16/bf16/fp32, K contiguous (row stride stride_xm)
    qweight_ptr,  # int32 [KW, N], K interleaved in blocks of BLOCK_KW rows
    scales_ptr,  # [G, N]
    zeros_ptr,  # uint8 [G, N] (read when HAS_ZEROS)
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] x dtype (written unless WRITE_PARTIAL), row stride stride_om
    partial_ptr,  # fp32 [split, M, N] (written when WRITE_PARTIAL)
    M,
    N,
    K,
    group_size,  # K / G: a multiple of BLOCK_KW, or K
    words_per_split,  # word rows per program along K, a multiple of BLOCK_KW
    iters,  # words_per_split // BLOCK_KW
    stride_xm,
    stride_om,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_SINGLE: tl.constexpr,  # every block lies inside one group: one scale row per block
    DOT_FP32: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,  # split-K > 1: write fp32 partial sums instead of y
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr,  # = the layout's interleave block
):
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = BLOCK_KW * PER_WORD
    VALUE_MASK: tl.constexpr = (1 << BITS) - 1
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    MAGIC_BITS: tl.constexpr = 0x4B000000  # 2**23 as fp32: (u | MAGIC_BITS) read as fp32 = 2**23 + u
    MAGIC: tl.constexpr = 8388608.0

    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    groups = tl.cdiv(K, group_size)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    fields = tl.arange(0, PER_WORD)[:, None, None]  # [PW, 1, 1] bit field index i
    rows = tl.arange(0, BLOCK_KW)[None, :, None]  # [1, BKW, 1]
    cols3 = offs_n[None, None, :]  # [1, 1, BN]
    mask_cols3 = mask_n[None, None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_begin = pid_k * words_per_split
    for it in range(iters):
        w0 = w_begin + it * BLOCK_KW
        k0 = w0 * PER_WORD
        words = tl.load(qweight_ptr + (w0 + rows) * N + cols3, mask=mask_cols3, other=0,
                        eviction_policy="evict_first")  # [1, BKW, BN]
        if SCALE_SINGLE:
            g = tl.minimum(k0 // group_size, groups - 1)  # scalar
        else:
            g = tl.minimum((k0 + fields * BLOCK_KW) // group_size, groups - 1)  # [PW, 1, 1]: one group per field
        s = tl.load(scales_ptr + g * N + cols3, mask=mask_cols3, other=0.0).to(tl.float32)  # [1|PW, 1, BN]
        if HAS_ZEROS:
            bias_f = tl.load(zeros_ptr + g * N + cols3, mask=mask_cols3, other=0).to(tl.float32) + MAGIC
        else:
            bias_f = MAGIC + OFFSET
        u = (words >> (fields * BITS)) & VALUE_MASK  # [PW, BKW, BN]: value k0 + i*BKW + r at [i, r]
        w = ((u | MAGIC_BITS).to(tl.float32, bitcast=True) - bias_f) * s  # exact (u - z), one rounding
        w = tl.reshape(w, (BLOCK_K, BLOCK_N))  # [BK, BN] in K order
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        xt = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)  # [BM, BK]
        if DOT_FP32:
            acc = tl.dot(xt.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, w.to(xt.dtype), acc)

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
    qweight_ptr,  # int32 [KW, N], K interleaved in blocks of BLOCK_KW rows
    scales_ptr,  # [G, N]
    zeros_ptr,  # uint8 [G, N] (read when HAS_ZEROS)
    out_ptr,  # [K, N] output dtype: dequant(W).T
    N,
    K,
    group_size,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_KW: tl.constexpr,  # = the layout's interleave block: one block per program
    BLOCK_N: tl.constexpr,
):
    PER_WORD: tl.constexpr = 32 // BITS
    VALUE_MASK: tl.constexpr = (1 << BITS) - 1
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    w0 = tl.program_id(0) * BLOCK_KW
    offs_r = tl.arange(0, BLOCK_KW)  # [BKW]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_n = (offs_n < N)[None, :]
    groups = tl.cdiv(K, group_size)
    words = tl.load(qweight_ptr + (w0 + offs_r)[:, None] * N + offs_n[None, :], mask=mask_n, other=0)
    for i in tl.static_range(PER_WORD):
        offs_k = w0 * PER_WORD + i * BLOCK_KW + offs_r  # [BKW]: consecutive values of K
        g = tl.minimum((w0 * PER_WORD + i * BLOCK_KW) // group_size, groups - 1)
        s = tl.load(scales_ptr + g * N + offs_n[None, :], mask=mask_n, other=0.0).to(tl.float32)  # [1, BN]
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + g * N + offs_n[None, :], mask=mask_n, other=0).to(tl.int32)
        else:
            z = OFFSET
        u = (words >> (i * BITS)) & VALUE_MASK  # [BKW, BN]
        w = (u - z).to(tl.float32) * s
        mask = mask_n & (offs_k < K)[:, None]
        tl.store(out_ptr + offs_k.to(tl.int64)[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


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
    if cfg.algo == "gemv" and m > cfg.block_m:
        raise ValueError(f"a gemv configuration with block_m={cfg.block_m} cannot run M={m} rows")
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
    blocks = qweight.shape[0] // TRITON_WORD_BLOCK  # interleave blocks along K
    split = splits_dividing(blocks, cfg.split_k)
    if workspace is not None:
        need, need_dtype = (k * n, x.dtype) if cfg.algo == "dequant" else (split * m * n, torch.float32)
        if workspace.numel() < need or workspace.dtype != need_dtype or not workspace.is_contiguous():
            raise ValueError(f"workspace must be a contiguous {need_dtype} tensor of at least {need} elements")
    if cfg.algo == "dequant":
        w_t = x.new_empty((k, n)) if workspace is None else workspace[: k * n].view(k, n)  # [K, N]
        wrap_triton(_wna16_dequant_kernel)[(blocks, triton.cdiv(n, DEQUANT_BLOCK_N))](
            qweight, scales, zeros_arg, w_t, n, k, group_size,
            BITS=bits, HAS_ZEROS=has_zeros, BLOCK_KW=TRITON_WORD_BLOCK, BLOCK_N=DEQUANT_BLOCK_N,
        )
        if has_bias:
            torch.addmm(bias.to(x.dtype), x, w_t, out=out)
        else:
            torch.mm(x, w_t, out=out)
        return out

    iters = blocks // split  # blocks per program along K
    scale_single = groups_single(group_size, k, TRITON_WORD_BLOCK * per_word)
    if split > 1:
        partial = (
            x.new_empty((split, m, n), dtype=torch.float32)
            if workspace is None
            else workspace[: split * m * n].view(split, m, n)
        )
    else:
        partial = out  # never written
    scalars = (m, n, k, group_size, iters * TRITON_WORD_BLOCK, iters, x.stride(0), out.stride(0))
    flags = dict(BITS=bits, HAS_ZEROS=has_zeros, HAS_BIAS=has_bias, SCALE_SINGLE=scale_single,
                 WRITE_PARTIAL=split > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_KW=TRITON_WORD_BLOCK,
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    reduce_last = split > 1 and cfg.reduce == "last"
    if cfg.algo == "gemv":
        tiles = triton.cdiv(n, cfg.block_n)
        counters = torch.zeros(tiles, dtype=torch.int32, device=x.device) if reduce_last else qweight  # [tiles]
        wrap_triton(_wna16_gemv_kernel)[(tiles, split)](
            x, qweight, scales, zeros_arg, bias_arg, out, partial, counters, *scalars,
            REDUCE_LAST=reduce_last, **flags)
    else:
        grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
        wrap_triton(_wna16_matmul_kernel)[grid](
            x, qweight, scales, zeros_arg, bias_arg, out, partial, *scalars,
            DOT_FP32=KERNELS_INTERPRETED or x.dtype == torch.float32, **flags)
    if split > 1 and not reduce_last:
        wrap_triton(_splitk_reduce_kernel)[(m, triton.cdiv(n, REDUCE_BLOCK_N))](
            partial, bias_arg, out, m, n, out.stride(0), split,
            HAS_BIAS=has_bias, BLOCK_N=REDUCE_BLOCK_N,
        )
    return out


def splits_dividing(blocks: int, wanted: int) -> int:
    """The largest split-K <= wanted that divides the K blocks evenly (every program gets the same work)."""
    split = max(1, min(wanted, blocks))
    while blocks % split:
        split -= 1
    return split


def groups_single(group_size: int, k: int, block_k: int) -> bool:
    """True when every K block of block_k values lies inside one scale group."""
    return group_size == k or group_size % block_k == 0


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
        qweight: int32 [KW, N] in the interleaved layout of ``wna16_layout.to_triton_layout`` (KW =
            ceil(K*bits/32) rounded up to a multiple of 8; word row b*8 + r holds k = b*8*PW + i*8 + r at
            bits [i*bits, (i+1)*bits), unsigned (value + 2**(bits-1)), PW = 32/bits).
        scales: [G, N] fp16/bf16/fp32, G = K / group_size; group_size a multiple of 8, or G = 1.
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
