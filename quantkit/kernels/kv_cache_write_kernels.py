"""Quantize-on-write into a static FP8 KV cache, as ``torch.ops.quantkit.fp8_kv_cache_write``.

A decode step appends one token's keys and values per layer. Writing them into a preallocated
float8_e4m3fn cache with torch ops costs a division, a clamp, a cast and an index copy for K and
for V (eight small launches per layer); this kernel does all of it in one launch: program
(b * Hkv + h, t) reads the new K and V rows [D] in the model dtype, divides by the scale (IEEE
division, as torch does), saturates to +-448 and stores the fp8 codes at cache position
``start + t``. ``start`` is read from a device tensor, so a CUDA graph that captured the launch
writes at the position the cache has reached when it replays.

The pure-torch path (``fp8_kv_cache_write_reference``) gives bit-identical codes; it is what runs
on CPU. Depends on torch and triton only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op, wrap_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_FP8_MAX = tl.constexpr(FP8_MAX)
STATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INTERPRETED: bool = bool(triton.knobs.runtime.interpret)


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


def check_fp8_kv_cache_write_args(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start) -> None:
    """Raise a ValueError naming the problem if the arguments break the contract of fp8_kv_cache_write."""
    if key_states.dim() != 4 or value_states.shape != key_states.shape:
        raise ValueError(
            f"key_states and value_states must both be [B, Hkv, T_new, D], got {tuple(key_states.shape)} and "
            f"{tuple(value_states.shape)}"
        )
    if k_cache.dtype != FP8_DTYPE or v_cache.dtype != FP8_DTYPE or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must be float8_e4m3fn [B, Hkv, max_len, D] of one shape, got {k_cache.dtype} "
            f"{tuple(k_cache.shape)} and {v_cache.dtype} {tuple(v_cache.shape)}"
        )
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides (allocate them alike)")
    b, h, _, d = key_states.shape
    if (k_cache.shape[0], k_cache.shape[1], k_cache.shape[3]) != (b, h, d):
        raise ValueError(
            f"the new states [B={b}, Hkv={h}, D={d}] do not fit the cache {tuple(k_cache.shape)}: B, Hkv, D must agree"
        )
    if key_states.dtype not in STATE_DTYPES or value_states.dtype != key_states.dtype:
        raise ValueError(f"key/value states must be one of {STATE_DTYPES}, got {key_states.dtype}/{value_states.dtype}")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale.dtype != torch.float32 or scale.dim() != 1 or scale.numel() not in (1, h):
            raise ValueError(f"{name} must be fp32 [1] or [{h}], got {scale.dtype} {tuple(scale.shape)}")
    if start.numel() != 1 or start.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"start must be one int32/int64 position, got {start.dtype} {tuple(start.shape)}")
    for name, t in (("key_states", key_states), ("value_states", value_states), ("k_cache", k_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim (stride 1)")
    devices = {t.device for t in (key_states, value_states, k_cache, v_cache, k_scale, v_scale, start)}
    if len(devices) != 1:
        raise ValueError(f"all arguments must be on one device, got {sorted(map(str, devices))}")


def fp8_kv_cache_write_reference(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start) -> None:
    """In place: cache[:, :, start + t] = fp8_e4m3(clamp(state[:, :, t] / scale, +-448)) for K and V.

    Shapes as fp8_kv_cache_write. Positions from a device tensor, no host sync (index_copy_ on the
    uint8 view of the fp8 storage: torch has no fp8 index_copy_ on every device).
    """
    positions = torch.arange(key_states.shape[2], device=k_cache.device) + start.reshape(())  # [T_new]
    for states, cache, scale in ((key_states, k_cache, k_scale), (value_states, v_cache, v_scale)):
        codes = (states.float() / scale.reshape(1, -1, 1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        cache.view(torch.uint8).index_copy_(2, positions, codes.view(torch.uint8))


def _triton_can_run_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and _INTERPRETED)


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
    if _triton_can_run_on(key_states.device) and (key_states.is_cuda or not is_fake(key_states)):
        fp8_kv_cache_write_triton(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start)
    else:
        fp8_kv_cache_write_reference(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start)


def fp8_kv_cache_write(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start) -> None:
    """Quantize new keys/values and write them into a static FP8 cache, in place.

    Args:
        key_states, value_states: [B, Hkv, T_new, D], float16 / bfloat16 / float32, stride 1 along D.
        k_cache, v_cache: float8_e4m3fn [B, Hkv, max_len, D], same shape and strides; positions
            start .. start + T_new - 1 are overwritten with fp8_e4m3(clamp(state / scale, -448, 448)).
            They must be < max_len, which is not checked on the host (it would need a sync): past
            it the kernel writes nothing (never out of bounds), the reference raises IndexError.
        k_scale, v_scale: fp32 [1] (per tensor) or [Hkv] (per KV head).
        start: int32/int64 tensor of one element on the same device: the first position to write.

    On CUDA one Triton launch (or the interpreter on CPU with TRITON_INTERPRET=1); elsewhere the
    pure-torch reference. Both give the same codes.
    """
    check_fp8_kv_cache_write_args(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start)
    torch.ops.quantkit.fp8_kv_cache_write(key_states, value_states, k_cache, v_cache, k_scale, v_scale, start)


def compile_kernel(target=None) -> dict[str, dict]:
    """Compile the write kernel for `target` (default: Hopper, sm_90) with the real Triton compiler,
    for bf16 / fp16 / fp32 states and head_dim 128 / 80. Needs no GPU but triton imported without
    TRITON_INTERPRET=1. Returns {variant: {"cubin_bytes", "fp8_stores"}}."""
    from triton.backends.compiler import GPUTarget

    if _INTERPRETED:
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
