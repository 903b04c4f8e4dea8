"""Quantize-on-write into a static FP8 cache: the Triton kernel (interpreter on CPU) against the
pure-torch reference, bit for bit, and the op under torch.compile."""

import json
import os
import subprocess
import sys

import pytest
import torch

from quantkit.kernels import kv_cache_write as kw, register_ops

register_ops()  # the tests call torch.ops.quantkit.fp8_kv_cache_write directly

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def make_case(batch, heads, max_len, head_dim, new, dtype, per_head, start):
    k = torch.randn(batch, heads, new, head_dim, device=DEVICE) * 3
    k[..., :8] *= 1e-4  # |k| / scale below 2^-6: e4m3 subnormals
    k = k.to(dtype)
    # V as transformers makes it: [B, T_new, Hkv, D] transposed, contiguous along D only
    v = (torch.randn(batch, new, heads, head_dim, device=DEVICE) * 3).to(dtype).transpose(1, 2)
    n = heads if per_head else 1
    k_scale = torch.rand(n, device=DEVICE) * 0.02 + 0.002  # |k| / scale passes 448: saturation is covered
    v_scale = torch.rand(n, device=DEVICE) * 0.02 + 0.002
    codes = torch.randint(0, 256, (batch, heads, max_len, head_dim), dtype=torch.uint8, device=DEVICE)
    codes[codes == 0x7F] = 0  # no NaN codes, so the caches compare with torch.equal
    codes[codes == 0xFF] = 0
    k_cache, v_cache = codes.view(FP8).clone(), codes.flip(-1).view(FP8).clone()
    return k, v, k_cache, v_cache, k_scale, v_scale, torch.tensor(start, device=DEVICE)


@pytest.mark.parametrize("batch,heads,max_len,head_dim,new,dtype,per_head,start", [
    (1, 2, 40, 64, 1, torch.bfloat16, False, 17),  # a decode step
    (2, 3, 33, 80, 5, torch.float16, True, 28),  # a chunk ending at the last position, D not a power of 2
    (3, 1, 20, 32, 20, torch.float32, False, 0),  # a prefill filling the whole cache
])
def test_kernel_writes_the_reference_codes(batch, heads, max_len, head_dim, new, dtype, per_head, start):
    k, v, k_cache, v_cache, ks, vs, start_t = make_case(batch, heads, max_len, head_dim, new, dtype, per_head, start)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kw.fp8_kv_cache_write_reference(k, v, expected_k, expected_v, ks, vs, start_t)
    # the reference itself: the written rows are the codes of quantize_fp8, the rest untouched
    s = ks.reshape(1, -1, 1, 1)
    assert torch.equal(expected_k[:, :, start:start + new].view(torch.uint8),
                       (k.float() / s).clamp(-448, 448).to(FP8).view(torch.uint8))
    assert torch.equal(expected_k[:, :, :start].view(torch.uint8), k_cache[:, :, :start].view(torch.uint8))
    kw.fp8_kv_cache_write_triton(k, v, k_cache, v_cache, ks, vs, start_t)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))
    assert (k_cache[:, :, start:start + new].float().abs() == 448).any()  # saturation happened


def test_kernel_never_writes_past_the_cache():
    """A cache that is a view of the first 12 rows of a larger buffer: a write at positions 11 and 12
    fills row 11 and leaves row 12 (outside the cache) untouched."""
    k, v, buffer, v_buffer, ks, vs, _ = make_case(1, 2, 16, 32, 2, torch.float32, False, 0)
    before = buffer.clone()
    kw.fp8_kv_cache_write_triton(k, v, buffer[:, :, :12], v_buffer[:, :, :12], ks, vs, torch.tensor(11, device=DEVICE))
    expected_row = (k[:, :, :1].float() / ks.reshape(1, -1, 1, 1)).clamp(-448, 448).to(FP8)
    assert torch.equal(buffer[:, :, 11:12].view(torch.uint8), expected_row.view(torch.uint8))
    assert torch.equal(buffer[:, :, 12:].view(torch.uint8), before[:, :, 12:].view(torch.uint8))


def test_op_compiles_without_graph_breaks():
    k, v, k_cache, v_cache, ks, vs, start = make_case(1, 2, 16, 32, 1, torch.float32, False, 5)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kw.fp8_kv_cache_write_reference(k, v, expected_k, expected_v, ks, vs, start)

    def step(k, v, start):
        kw.fp8_kv_cache_write(k, v, k_cache, v_cache, ks, vs, start)
        start.add_(1)

    torch.compile(step, fullgraph=True, backend="aot_eager")(k, v, start)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))
    assert start.item() == 6


def test_bad_arguments_raise_clear_errors():
    k, v, k_cache, v_cache, ks, vs, start = make_case(1, 2, 16, 32, 1, torch.float32, False, 0)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        kw.fp8_kv_cache_write(k, v, k_cache.float(), v_cache, ks, vs, start)
    with pytest.raises(ValueError, match="B, Hkv, D must agree"):
        kw.fp8_kv_cache_write(k[:, :1], v[:, :1], k_cache, v_cache, ks, vs, start)
    with pytest.raises(ValueError, match="k_scale must be fp32"):
        kw.fp8_kv_cache_write(k, v, k_cache, v_cache, torch.ones(3, device=DEVICE), vs, start)
    with pytest.raises(ValueError, match="start must be one"):
        kw.fp8_kv_cache_write(k, v, k_cache, v_cache, ks, vs, start.float())


def test_opcheck():
    k, v, k_cache, v_cache, ks, vs, start = make_case(1, 2, 16, 32, 2, torch.bfloat16, True, 3)
    # On CPU, torch's schema checker compares fp8 tensors with ops that have no fp8 CPU kernel.
    skip = ("test_schema",) if DEVICE == "cpu" else ()
    utils = tuple(u for u in torch.library._OPCHECK_DEFAULT_UTILS if u not in skip)
    torch.library.opcheck(torch.ops.quantkit.fp8_kv_cache_write.default, (k, v, k_cache, v_cache, ks, vs, start),
                          test_utils=utils)


def test_kernel_compiles_for_hopper():
    """The real compiler (not the interpreter) accepts the kernel for sm_90 and converts to e4m3 there."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json; from quantkit.kernels.kv_cache_write import compile_kernel; print(json.dumps(compile_kernel()))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 3
    for name, info in results.items():
        assert info["cubin_bytes"] > 0 and info["fp8_stores"], name
