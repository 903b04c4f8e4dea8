"""The Triton kernels of decode attention over an FP8 KV cache (flash-decoding), and the op
``torch.ops.quantkit.decode_attention_fp8`` that runs them.

The entry point is ``decode_attention.decode_attention_fp8``; this module is imported by
``triton_ops.register_ops`` only (it imports triton and, through ``triton_op``, torch._inductor).

One query token per sequence attends to the whole cached context. Decode attention is bound by
reading K and V, so the cache is read in its stored dtype (float8_e4m3fn: half the bytes of bf16)
and dequantized in registers: fp8 -> bf16/fp16 is exact, the K scale is folded into the score
scale and the V scale into the final normalisation, so no element-wise multiply is spent on the
cache. The same kernel reads bf16/fp16/fp32 caches (scales omitted), which gives the baseline.

Algorithm (two launches):

1. ``_decode_attention_split_kernel``, grid (B * Hkv, S): program (b, kv head, split s) reads
   the keys [s * split_len, (s+1) * split_len) of one KV head in tiles of BLOCK_N (split_len
   from the length the cache holds, read on the device for a static cache), for all the
   Hq / Hkv query heads that share it (GQA: each K/V tile is loaded once per group), and keeps an
   online softmax (running max m, running sum l, unnormalised accumulator acc) in base 2.
   It writes (acc, m, l) per query head and split to fp32 workspaces. K/V tiles are read as
   16-byte vectors (16 fp8 codes; the PTX test checks it), converted to bf16/fp16 in registers.
2. ``_decode_attention_reduce_kernel``, grid (B * Hq,): merges the S partial softmaxes:
   out = v_scale * sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.

Launch parameters (splits, tile, warps, stages): ``decode_attention_heuristics``, by rule.
Depends on torch and triton only.
"""
from __future__ import annotations

import dataclasses
import re

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op, wrap_triton

from .decode_attention_heuristics import DecodeAttentionLaunch, choose_launch
from .decode_attention_reference import check_decode_attention_args, decode_attention_reference
from .triton_interpret import kernels_interpreted, triton_can_run_on


MIN_BLOCK_G = 16  # tl.dot needs M >= 16 on GPUs: query heads of a group are padded to this
LOG2E = 1.4426950408889634
# Initial running max: finite, so a tile whose keys are all masked gives 2^(-inf - m) = 0, never NaN.
_M_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _decode_attention_split_kernel(
    q_ptr,  # [B, Hq, D], q dtype
    k_ptr,  # [B, Hkv, T, D], fp8 / fp16 / bf16 / fp32
    v_ptr,  # [B, Hkv, T, D], same dtype as k
    k_scale_ptr,  # fp32 [1] or [Hkv]
    v_scale_ptr,  # unused here (applied in the reduce kernel); kept for a uniform signature
    mask_ptr,  # uint8 [B, T] (1 = attend), read only when HAS_MASK
    kv_len_ptr,  # int32/int64, one element: keys at positions >= it are not read (HAS_KV_LEN)
    part_acc_ptr,  # fp32 [B, Hq, S, D] unnormalised partial outputs
    part_m_ptr,  # fp32 [B, Hq, S] running max (base 2)
    part_l_ptr,  # fp32 [B, Hq, S] running sum
    qk_scale,  # fp32: sm_scale * log2(e)
    seq_len,  # T
    num_kv_heads,
    k_scale_stride,  # 0 (per tensor) or 1 (per KV head)
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_mb,
    GROUP: tl.constexpr,  # Hq // Hkv
    BLOCK_G: tl.constexpr,  # power of two >= max(GROUP, 16)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # power of two >= HEAD_DIM
    BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_KV_LEN: tl.constexpr,
    DOT_FP32: tl.constexpr,  # dot products in fp32 (interpreter, fp32 queries) or in q's dtype
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bh // num_kv_heads).to(tl.int64)  # int64: b * stride_kb can pass 2**31 on long caches
    kv_head = pid_bh % num_kv_heads
    num_splits = tl.num_programs(1)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_valid = offs_g < GROUP
    d_valid = offs_d < HEAD_DIM
    q_heads = kv_head * GROUP + offs_g  # [BLOCK_G]

    q_ptrs = q_ptr + b * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)
    # The K scale multiplies every score of this KV head: fold it into the softmax scale.
    score_scale = qk_scale * tl.load(k_scale_ptr + kv_head * k_scale_stride).to(tl.float32)

    m_i = tl.full([BLOCK_G], _M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh
    kv_end = seq_len
    if HAS_KV_LEN:  # a static cache: only the written positions are split and read
        kv_end = tl.minimum(kv_end, tl.load(kv_len_ptr).to(tl.int32))
    # keys per split: a multiple of BLOCK_N, from the length on the device (a CUDA graph replays it)
    split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, kv_end)
    for start_n in range(split_start, split_end, BLOCK_N):
        keys = start_n + offs_n  # [BLOCK_N]
        n_valid = keys < split_end
        kv_load_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_base + keys[:, None] * stride_kt + offs_d[None, :], mask=kv_load_mask, other=0.0)
        # V is issued here, before the scores need K, so that its latency overlaps the QK product
        v = tl.load(v_base + keys[:, None] * stride_vt + offs_d[None, :], mask=kv_load_mask, other=0.0)
        # fp8 -> q dtype is exact; the scale is applied to the scores
        if DOT_FP32:
            k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_G, BLOCK_N]
        else:
            k = k.to(q.dtype)
            scores = tl.dot(q, tl.trans(k))  # [BLOCK_G, BLOCK_N], fp32 accumulation
        scores = scores * score_scale
        if HAS_MASK:
            attend = tl.load(mask_ptr + b * stride_mb + keys, mask=n_valid, other=0)
            n_valid = n_valid & (attend != 0)
        scores = tl.where(n_valid[None, :], scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [BLOCK_G]
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_G, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)

        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")  # [BLOCK_G, BLOCK_D]
        else:
            # (V^T P^T)^T: V as the A operand, read straight from global memory in 16-byte vectors
            # (as the B operand of P V the compiler copies it in 8-byte pieces)
            pv = tl.trans(tl.dot(tl.trans(v.to(q.dtype)), tl.trans(p.to(q.dtype))))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # workspaces are [B, Hq, S, ...]: row (b, q_head, split)
    rows = (b * (num_kv_heads * GROUP) + q_heads) * num_splits + split  # [BLOCK_G]
    tl.store(part_m_ptr + rows, m_i, mask=g_valid)
    tl.store(part_l_ptr + rows, l_i, mask=g_valid)
    acc_ptrs = part_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(acc_ptrs, acc, mask=g_valid[:, None] & d_valid[None, :])


@triton.jit
def _decode_attention_reduce_kernel(
    part_acc_ptr,  # fp32 [B, Hq, S, D]
    part_m_ptr,  # fp32 [B, Hq, S]
    part_l_ptr,  # fp32 [B, Hq, S]
    v_scale_ptr,  # fp32 [1] or [Hkv]
    out_ptr,  # [B, Hq, D] contiguous, q dtype
    num_q_heads,
    num_splits,
    v_scale_stride,  # 0 (per tensor) or 1 (per KV head)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # power of two >= S
):
    row = tl.program_id(0)  # b * Hq + q_head
    q_head = row % num_q_heads
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_valid = offs_s < num_splits
    d_valid = offs_d < HEAD_DIM

    m = tl.load(part_m_ptr + row * num_splits + offs_s, mask=s_valid, other=_M_INIT)  # [BLOCK_S]
    l = tl.load(part_l_ptr + row * num_splits + offs_s, mask=s_valid, other=0.0)
    acc_ptrs = part_acc_ptr + (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
    acc = tl.load(acc_ptrs, mask=s_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]

    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - m_max)  # [BLOCK_S]; splits that saw no key have l = 0 and acc = 0
    l_total = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0)  # [BLOCK_D]
    v_scale = tl.load(v_scale_ptr + (q_head // GROUP) * v_scale_stride).to(tl.float32)
    # A row whose keys are all masked has l_total = 0: it gives zeros, as the reference does.
    out = tl.where(l_total > 0.0, out * (v_scale / tl.maximum(l_total, 1e-30)), 0.0)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_valid)


def _check_scale(name: str, scale: torch.Tensor | None, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """None -> fp32 ones [1]; else a float [1] or [Hkv] tensor, returned as contiguous fp32."""
    if scale is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    if not scale.is_floating_point() or scale.dim() != 1 or scale.numel() not in (1, num_kv_heads):
        raise ValueError(
            f"{name} must be a 1-D float tensor of shape [1] (per tensor) or [{num_kv_heads}] (per KV head), "
            f"got dtype {scale.dtype} shape {tuple(scale.shape)}"
        )
    if scale.device != device:
        raise ValueError(f"{name} is on {scale.device} but the cache is on {device}: move it with .to()")
    return scale.to(torch.float32).contiguous()


def default_launch(batch: int, num_kv_heads: int, seq_len: int, device: torch.device) -> DecodeAttentionLaunch:
    """The launch rule of decode_attention_heuristics for this device."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    return choose_launch(batch, num_kv_heads, seq_len, num_sms)


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_mask: torch.Tensor | None = None,
    sm_scale: float | None = None,
    num_splits: int = 0,
    kv_len: torch.Tensor | None = None,
    launch: DecodeAttentionLaunch | None = None,
) -> torch.Tensor:
    """Run the Triton kernels (no fallback). Arguments as ``decode_attention_fp8``; ``launch``
    overrides the whole launch rule (benchmark sweeps), ``num_splits`` > 0 only the split count."""
    check_decode_attention_args(q, k_cache, v_cache, kv_mask, kv_len)
    if not triton_can_run_on(q.device):
        raise RuntimeError(
            f"the Triton decode-attention kernel cannot run on {q.device}: use CUDA tensors, or set "
            "TRITON_INTERPRET=1 before triton is first imported to run it on CPU, or call "
            "decode_attention_reference"
        )
    interpreted = q.device.type == "cpu"
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, seq_len = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    k_scale = _check_scale("k_scale", k_scale, num_kv_heads, q.device)
    v_scale = _check_scale("v_scale", v_scale, num_kv_heads, q.device)
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0 = automatic), got {num_splits}")
    launch = launch or default_launch(batch, num_kv_heads, seq_len, q.device)
    if num_splits:
        launch = dataclasses.replace(launch, num_splits=num_splits)
    # never more splits than tiles (a split past the written length of a static cache reads nothing)
    num_splits = min(launch.num_splits, triton.cdiv(seq_len, launch.block_n))

    if kv_mask is not None:
        mask_u8 = kv_mask.contiguous().view(torch.uint8)  # [B, T]
        stride_mb = mask_u8.stride(0)
    else:
        mask_u8 = torch.empty(1, dtype=torch.uint8, device=q.device)  # never read
        stride_mb = 0
    kv_len_arg = kv_len if kv_len is not None else mask_u8  # never read without HAS_KV_LEN

    part_acc = q.new_empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32)
    part_m = q.new_empty((batch, num_q_heads, num_splits), dtype=torch.float32)
    part_l = q.new_empty((batch, num_q_heads, num_splits), dtype=torch.float32)
    # The interpreter casts fp32 -> bf16 by truncation (GPUs round to nearest even): there, the
    # reduce kernel writes fp32 and torch rounds.
    out_dtype = torch.float32 if interpreted and q.dtype == torch.bfloat16 else q.dtype
    out = q.new_empty((batch, num_q_heads, head_dim), dtype=out_dtype)

    block_d = max(16, triton.next_power_of_2(head_dim))
    # fp32 dot products: in the interpreter (its bf16 tl.dot is wrong), for fp32 queries or an fp32 cache
    dot_fp32 = interpreted or q.dtype == torch.float32 or k_cache.dtype == torch.float32
    wrap_triton(_decode_attention_split_kernel)[(batch * num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, mask_u8, kv_len_arg,
        part_acc, part_m, part_l,
        sm_scale * LOG2E, seq_len, num_kv_heads, 0 if k_scale.numel() == 1 else 1,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        stride_mb,
        GROUP=group,
        BLOCK_G=max(MIN_BLOCK_G, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=launch.block_n,
        HAS_MASK=kv_mask is not None,
        HAS_KV_LEN=kv_len is not None,
        DOT_FP32=dot_fp32,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )  # fmt: skip
    wrap_triton(_decode_attention_reduce_kernel)[(batch * num_q_heads,)](
        part_acc, part_m, part_l, v_scale, out,
        num_q_heads, num_splits, 0 if v_scale.numel() == 1 else 1,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(num_splits),
    )  # fmt: skip
    return out.to(q.dtype)


@triton_op("quantkit::decode_attention_fp8", mutates_args=())
def _decode_attention_fp8_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    kv_mask: torch.Tensor | None,
    sm_scale: float,
    num_splits: int,
    kv_len: torch.Tensor | None = None,
) -> torch.Tensor:
    # Triton's interpreter needs real CPU memory: when the op is traced on CPU (fake/functional
    # tensors, e.g. torch.compile or export), the reference's torch ops are traced instead.
    if triton_can_run_on(q.device) and (q.is_cuda or not is_fake(q)):
        return decode_attention_triton(q, k_cache, v_cache, k_scale, v_scale, kv_mask, sm_scale, num_splits, kv_len)
    check_decode_attention_args(q, k_cache, v_cache, kv_mask, kv_len)
    return decode_attention_reference(q, k_cache, v_cache, k_scale, v_scale, kv_mask, sm_scale, kv_len)


@_decode_attention_fp8_op.register_fake
def _decode_attention_fp8_fake(q, k_cache, v_cache, k_scale, v_scale, kv_mask, sm_scale, num_splits, kv_len=None):
    check_decode_attention_args(q, k_cache, v_cache, kv_mask, kv_len)
    return q.new_empty(q.shape)


# -- ahead-of-time compile check ------------------------------------------------------------------

#: (kv dtype, q dtype, GQA group, head_dim, has_mask, has_kv_len) variants compiled by compile_kernels.
COMPILE_VARIANTS = (
    ("fp8e4nv", "bf16", 4, 128, True, True),
    ("fp8e4nv", "bf16", 4, 128, False, False),
    ("fp8e4nv", "fp16", 6, 80, False, False),
    ("fp8e4nv", "fp32", 1, 64, True, False),
    ("bf16", "bf16", 8, 128, True, True),
)
_SPLIT_POINTER_TYPES = {
    "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "mask_ptr": "*u8", "kv_len_ptr": "*i64",
    "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "qk_scale": "fp32",
}
_GLOBAL_READ = re.compile(
    r"ld\.global(?:\.\w+)*?(?:\.v(\d))?\.[bfsu](\d+)\s|cp\.async\.c[ag]\.shared\.global[^,]*,[^,]*,\s*(0x[0-9a-f]+|\d+)"
)


def global_read_bytes(ptx: str) -> list[int]:
    """Bytes moved by each global-memory read instruction of a PTX listing (ld.global, cp.async)."""
    sizes = []
    for vec, bits, copy_size in _GLOBAL_READ.findall(ptx):
        sizes.append(int(copy_size, 0) if copy_size else int(vec or 1) * int(bits) // 8)
    return sizes


def _compile(kernel, types: dict[str, str], constexprs: dict, target, aligned=(), **options):
    """Compile ``kernel`` for ``target``. ``aligned``: arguments declared multiples of 16 (bytes for
    pointers), as Triton's launcher specializes them at run time when they are."""
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in kernel.arg_names}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target, options=options or None)


def compile_kernels(target=None, variants=COMPILE_VARIANTS) -> dict[str, dict]:
    """Compile both kernels with the real Triton compiler for `target` (default: Hopper, sm_90).

    Needs no GPU, but Triton's interpreter must be off (TRITON_INTERPRET unset when triton was
    imported). Pointers and K/V strides are declared 16-aligned, as they are at run time for a
    cache with head_dim % 16 == 0 (Triton specializes such arguments). Returns {variant name:
    {"cubin_bytes", "shared_bytes", "fp8_converts", "global_read_bytes"}} (the last: the sorted
    distinct sizes of the kernel's global reads); raises the compiler's error if a variant fails.
    """
    if kernels_interpreted():
        raise RuntimeError(
            "compile_kernels needs triton imported without TRITON_INTERPRET=1 (run it in a fresh process)"
        )
    target = target or GPUTarget("cuda", 90, 32)
    launch = choose_launch(1, 8, 32768, 132)  # the tile and options of the H200 rule
    results = {}
    split_kernel = _decode_attention_split_kernel
    aligned = [n for n in split_kernel.arg_names if n.endswith("_ptr") or n.startswith(("stride_q", "stride_k", "stride_v"))]
    for kv_type, q_type, group, head_dim, has_mask, has_kv_len in variants:
        block_d = max(16, triton.next_power_of_2(head_dim))
        compiled = _compile(
            split_kernel,
            {**_SPLIT_POINTER_TYPES, "q_ptr": f"*{q_type}", "k_ptr": f"*{kv_type}", "v_ptr": f"*{kv_type}"},
            dict(GROUP=group, BLOCK_G=max(MIN_BLOCK_G, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                 BLOCK_D=block_d, BLOCK_N=launch.block_n, HAS_MASK=has_mask, HAS_KV_LEN=has_kv_len,
                 DOT_FP32=q_type == "fp32"),
            target, aligned, num_warps=launch.num_warps, num_stages=launch.num_stages,
        )
        ptx = compiled.asm.get("ptx", "")
        name = f"split/{kv_type}/{q_type}/g{group}/d{head_dim}/mask{int(has_mask)}/len{int(has_kv_len)}"
        results[name] = {
            "cubin_bytes": len(compiled.asm.get("cubin", b"")),
            "shared_bytes": compiled.metadata.shared,
            "fp8_converts": "e4m3" in ptx,
            "global_read_bytes": sorted(set(global_read_bytes(ptx))),
        }
        block_s = 1 if has_mask else 64  # one split, and many
        compiled = _compile(
            _decode_attention_reduce_kernel,
            {"out_ptr": f"*{q_type}", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
             "v_scale_ptr": "*fp32"},
            dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=block_s),
            target,
        )
        results[f"reduce/{q_type}/g{group}/d{head_dim}/s{block_s}"] = {
            "cubin_bytes": len(compiled.asm.get("cubin", b"")),
            "shared_bytes": compiled.metadata.shared,
            "fp8_converts": False,
            "global_read_bytes": sorted(set(global_read_bytes(compiled.asm.get("ptx", "")))),
        }
    return results


if __name__ == "__main__":  # python -m quantkit.kernels.decode_attention_kernels: the Hopper compile check
    import json

    print(json.dumps(compile_kernels(), indent=1))
