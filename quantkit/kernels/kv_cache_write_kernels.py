"""The Triton kernel of quantize-on-write into a static FP8 KV cache, and the op
``torch.ops.quantkit.fp8_kv_cache_write`` that runs it.

The entry point is ``kv_cache_write.fp8_kv_cache_write``; this module is imported by
``triton_ops.register_ops`` only (it imports triton and, through ``triton_op``, torch._inductor).

A decode step appends one token's keys and values per layer. Writing them into a preallocated
float8_e4m3fn cache with torch ops costs a division, a clamp, a cast and an index copy for K and
for V (eight small launches per layer); this kernel does all of it in one launch: program
(b * Hkv + h, t) reads the new K and V rows [D] in the model dtype, divides by the scale (IEEE
division, as torch does), saturates to +-448 and stores the fp8 codes at cache position
``start + t``. ``start`` is read from a device tensor, so a CUDA graph that captured the launch
writes at the position the cache has reached when it replays.

The pure-torch path (``kv_cache_write_reference.fp8_kv_cache_write_reference``) gives bit-identical
codes; it is what runs on CPU. Depends on torch and triton only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op, wrap_triton

from .kv_cache_write_reference import FP8_MAX, check_fp8_kv_cache_write_args, fp8_kv_cache_write_reference
from .triton_interpret import kernels_interpreted, triton_can_run_on

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _saturate_to_e4m3_grid(x):
    """fp32 -> the nearest float8_e4m3fn value (ties to even), saturated to +-448, still in fp32.

    The cast to fp8 that follows is then exact. Rounding here rather than in the cast keeps
    Triton's interpreter right too (its fp32 -> fp8 cast neither carries a round-up into the
    exponent nor rounds ties to even). e4m3 keeps 3 mantissa bits: a normal value of exponent e
    is a multiple of u = 2^(e - 3); subnormals (exponent < -6) are multiples of 2^-9. Adding
    m = u * 2^23 (whose fp32 ulp is u) rounds |x| to a multiple of u, ties to even; subtracting m
    is exact.
    """
    x = tl.clamp(x, -_FP8_MAX, _FP8_MAX)
    magnitude = tl.abs(x)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)
    m = ((exponent - 3 + 23 + 127) << 23).to(tl.float32, bitcast=True)  # u * 2^23
    rounded = (magnitude + m) - m
    return tl.where(x < 0, -rounded, rounded)


@triton.jit
def _fp8_kv_cache_write_kernel(
    k_ptr,  # [B, Hkv, T_new, D] model dtype
    v_ptr,  # [B, Hkv, T_new, D] model dtype
    k_cache_ptr,  # fp8 [B, Hkv, max_len, D], written at positions start .. start + T_new - 1
    v_cache_ptr,  # fp8 [B, Hkv, max_len, D]
    k_scale_ptr,  # fp32 [1] or [Hkv]
    v_scale_ptr,  # fp32 [1] or [Hkv]
    start_ptr,  # int32/int64 [1] or 0-d: first position to write
    max_len,  # positions in the cache: rows at or past it are never written
    num_kv_heads,
    scale_stride,  # 0 (per tensor) or 1 (per KV head)
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_cb, stride_ch, stride_ct,  # the two caches share one layout
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # power of two >= HEAD_DIM
):
    pid = tl.program_id(0)
    t = tl.program_id(1)
    b = (pid // num_kv_heads).to(tl.int64)
    h = pid % num_kv_heads
    position = tl.load(start_ptr).to(tl.int64) + t
    offs = tl.arange(0, BLOCK_D)
    d_valid = offs < HEAD_DIM
    k_scale = tl.load(k_scale_ptr + h * scale_stride)
    v_scale = tl.load(v_scale_ptr + h * scale_stride)
    k = tl.load(k_ptr + b * stride_kb + h * stride_kh + t * stride_kt + offs, mask=d_valid, other=0.0)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + t * stride_vt + offs, mask=d_valid, other=0.0)
    k_code = _saturate_to_e4m3_grid(tl.math.div_rn(k.to(tl.float32), k_scale)).to(tl.float8e4nv)
    v_code = _saturate_to_e4m3_grid(tl.math.div_rn(v.to(tl.float32), v_scale)).to(tl.float8e4nv)
    row = b * stride_cb + h * stride_ch + position * stride_ct
    # a full cache drops the write instead of corrupting memory ([BLOCK_D] mask: the row is in the cache)
    in_cache = d_valid & ((position + offs * 0) < max_len)
    tl.store(k_cache_ptr + row + offs, k_code, mask=in_cache)
    tl.store(v_cache_ptr + row + offs, v_code, mask=in_cache)


def fp8_kv_cache_write_triton(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start) -> None:
    """Run the Triton kernel (no fallback). Arguments as fp8_kv_cache_write."""
    check_fp8_kv_cache_write_args(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start)
    b, h, t_new, d = key_states.shape
    wrap_triton(_fp8_kv_cache_write_kernel)[(b * h, t_new)](
        key_states, value_states, k_cache, v_cache, k_scale, v_scale, start,
        k_cache.shape[2], h, 0 if k_scale.numel() == 1 else 1,
        key_states.stride(0), key_states.stride(1), key_states.stride(2),
        value_states.stride(0), value_states.stride(1), value_states.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
    )  # fmt: skip


@triton_op("quantkit::fp8_kv_cache_write", mutates_args=("k_cache", "v_cache"))
def _fp8_kv_cache_write_op(
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    start: torch.Tensor,
) -> None:
    if triton_can_run_on(key_states.device) and (key_states.is_cuda or not is_fake(key_states)):
        fp8_kv_cache_write_triton(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start)
    else:
        fp8_kv_cache_write_reference(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start)


def compile_kernel(target=None) -> dict[str, dict]:
    """Compile the write kernel for `target` (default: Hopper, sm_90) with the real Triton compiler,
    for bf16 / fp16 / fp32 states and head_dim 128 / 80. Needs no GPU but triton imported without
    TRITON_INTERPRET=1. Returns {variant: {"cubin_bytes", "fp8_stores"}}."""
    if kernels_interpreted():
        raise RuntimeError("compile_kernel needs triton imported without TRITON_INTERPRET=1 (a fresh process)")
    target = target or GPUTarget("cuda", 90, 32)
    kernel = _fp8_kv_cache_write_kernel
    results = {}
    for state_type, head_dim in (("bf16", 128), ("fp16", 80), ("fp32", 64)):
        constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": max(16, triton.next_power_of_2(head_dim))}
        types = {"k_ptr": f"*{state_type}", "v_ptr": f"*{state_type}", "k_cache_ptr": "*fp8e4nv",
                 "v_cache_ptr": "*fp8e4nv", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "start_ptr": "*i64"}
        signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in kernel.arg_names}
        compiled = triton.compile(triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=target)
        results[f"write/{state_type}/d{head_dim}"] = {
            "cubin_bytes": len(compiled.asm.get("cubin", b"")),
            "fp8_stores": "e4m3" in compiled.asm.get("ptx", ""),
        }
    return results
