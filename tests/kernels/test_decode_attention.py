"""FP8 decode attention: the Triton kernel (interpreter on CPU) against the pure-torch reference.

Fresh random inputs every run, several context lengths (ragged ones included), head counts, GQA
ratios, head dims, KV dtypes, scale kinds, masks and split counts; opcheck; clear errors; and a
compile of every kernel variant for Hopper (sm_90) by the real Triton compiler, without a GPU.
"""

import json
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    # Must be set before the Triton kernels are first built (quantkit.kernels.register_ops).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from quantkit.kernels import decode_attention as da, register_ops  # noqa: E402
from quantkit.kernels.decode_attention_reference import decode_attention_reference  # noqa: E402

register_ops()  # the tests call torch.ops.quantkit.decode_attention_fp8 directly

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module", autouse=True)
def _kernels_runnable():
    if DEVICE == "cpu" and not da.kernels_interpreted():
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set, so the kernels cannot run on CPU: "
            "run with TRITON_INTERPRET=1 in the environment"
        )


def rel_mean_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).abs().mean() / ref.abs().mean()).item()


def make_inputs(batch, num_q_heads, num_kv_heads, seq_len, head_dim, *, kv_dtype=FP8, q_dtype=torch.bfloat16,
                per_head_scale=False, left_pad=0):
    """Random q and a cache whose fp8 codes span the e4m3 range, with scales not equal to 1."""
    q = torch.randn(batch, num_q_heads, head_dim, device=DEVICE).to(q_dtype)
    shape = (batch, num_kv_heads, seq_len, head_dim)
    if kv_dtype == FP8:
        k = (torch.randn(shape, device=DEVICE) * 100).clamp(-448, 448).to(FP8)
        v = (torch.randn(shape, device=DEVICE) * 100).clamp(-448, 448).to(FP8)
        n = num_kv_heads if per_head_scale else 1
        k_scale = torch.rand(n, device=DEVICE) * 0.02 + 0.005  # scores of order 1
        v_scale = torch.rand(n, device=DEVICE) * 0.02 + 0.005
    else:
        k = torch.randn(shape, device=DEVICE).to(kv_dtype)
        v = torch.randn(shape, device=DEVICE).to(kv_dtype)
        k_scale = v_scale = None
    mask = None
    if left_pad:
        mask = torch.ones(batch, seq_len, dtype=torch.bool, device=DEVICE)
        mask[-1, :left_pad] = False  # the last sequence is left-padded
    return q, k, v, k_scale, v_scale, mask


CASES = [
    # batch, Hq, Hkv, T, D, kv dtype, q dtype, per-head scale, left pad, num_splits
    (1, 4, 4, 1, 64, FP8, torch.bfloat16, False, 0, 0),  # one cached token, MHA
    (2, 8, 2, 100, 64, FP8, torch.bfloat16, True, 13, 0),  # ragged T, GQA 4, left padding
    (3, 6, 1, 257, 80, FP8, torch.float16, False, 0, 3),  # MQA, group of 6, D not a power of two
    (2, 4, 2, 64, 128, FP8, torch.float32, True, 5, 1),  # exactly one tile, fp32 queries
    (1, 16, 2, 700, 64, FP8, torch.bfloat16, False, 0, 0),  # GQA 8, many tiles, automatic splits
    (2, 4, 2, 1024, 64, torch.bfloat16, torch.bfloat16, False, 0, 4),  # bf16 baseline cache
    (2, 2, 1, 150, 32, torch.float16, torch.float16, False, 30, 2),  # fp16 cache, left padding
    (1, 2, 1, 33, 16, torch.float32, torch.bfloat16, False, 0, 0),  # fp32 cache, smallest head_dim
]


@pytest.mark.parametrize("batch,hq,hkv,seq_len,head_dim,kv_dtype,q_dtype,per_head,left_pad,splits", CASES)
def test_kernel_matches_reference(batch, hq, hkv, seq_len, head_dim, kv_dtype, q_dtype, per_head, left_pad, splits):
    q, k, v, ks, vs, mask = make_inputs(batch, hq, hkv, seq_len, head_dim, kv_dtype=kv_dtype, q_dtype=q_dtype,
                                        per_head_scale=per_head, left_pad=left_pad)
    out = da.decode_attention_triton(q, k, v, ks, vs, mask, num_splits=splits)
    ref = decode_attention_reference(q, k, v, ks, vs, mask)
    assert out.shape == (batch, hq, head_dim) and out.dtype == q_dtype
    assert torch.isfinite(out).all()
    assert rel_mean_error(out, ref) <= 1e-3


def test_split_count_does_not_change_the_result():
    q, k, v, ks, vs, mask = make_inputs(2, 4, 2, 300, 64, q_dtype=torch.float32, left_pad=70)
    ref = decode_attention_reference(q, k, v, ks, vs, mask)
    for splits in (1, 2, 3, 5):  # 5 splits of 64 keys: the last one holds 44
        out = da.decode_attention_triton(q, k, v, ks, vs, mask, num_splits=splits)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_len,splits", [(170, 0), (1, 3), (300, 2), (64, 5)])
def test_static_cache_length_limits_what_is_read(kv_len, splits):
    """A static cache of 300 positions holding kv_len: the tail holds NaN codes, which must be neither
    read nor attended; the result equals attention over the first kv_len positions."""
    q, k, v, ks, vs, mask = make_inputs(2, 8, 2, 300, 64, per_head_scale=True, left_pad=20)
    k[:, :, kv_len:] = float("nan")  # fp8 code 0x7f: NaN poisons any tile that reads it
    v[:, :, kv_len:] = float("nan")
    length = torch.tensor(kv_len, device=DEVICE)
    out = da.decode_attention_triton(q, k, v, ks, vs, mask, num_splits=splits, kv_len=length)
    ref = decode_attention_reference(q, k[:, :, :kv_len].contiguous(), v[:, :, :kv_len].contiguous(), ks, vs,
                                     mask[:, :kv_len].contiguous())
    assert torch.isfinite(out).all()
    assert rel_mean_error(out, ref) <= 1e-3
    masked_ref = decode_attention_reference(q, k, v, ks, vs, mask, kv_len=length)  # the reference's own kv_len
    torch.testing.assert_close(masked_ref, ref, rtol=0, atol=0)
    op = torch.ops.quantkit.decode_attention_fp8(q, k, v, ks, vs, mask, 64**-0.5, splits, length)
    assert rel_mean_error(op, ref) <= 1e-3


def test_fully_masked_split_and_sequence():
    q, k, v, ks, vs, _ = make_inputs(2, 4, 2, 200, 64, q_dtype=torch.float32)
    mask = torch.ones(2, 200, dtype=torch.bool, device=DEVICE)
    mask[0, :150] = False  # the first splits of sequence 0 see no key
    mask[1] = False  # sequence 1 attends to nothing: zeros, like the reference, never NaN
    out = da.decode_attention_triton(q, k, v, ks, vs, mask, num_splits=4)
    ref = decode_attention_reference(q, k, v, ks, vs, mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert (out[1] == 0).all()


def test_reference_matches_sdpa_on_dequantized_cache():
    """The reference itself: same as torch's SDPA with GQA on the dequantized cache and a padding mask."""
    q, k, v, ks, vs, mask = make_inputs(2, 8, 2, 77, 64, q_dtype=torch.float32, per_head_scale=True, left_pad=9)
    kd = k.float() * ks.view(1, -1, 1, 1)
    vd = v.float() * vs.view(1, -1, 1, 1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), kd, vd, attn_mask=mask[:, None, None, :], enable_gqa=True
    ).squeeze(2)
    torch.testing.assert_close(decode_attention_reference(q, k, v, ks, vs, mask), expected, rtol=1e-5, atol=1e-5)


def test_op_dispatch_and_custom_sm_scale():
    q, k, v, ks, vs, mask = make_inputs(2, 4, 2, 90, 64, left_pad=11)
    out = torch.ops.quantkit.decode_attention_fp8(q, k, v, ks, vs, mask, 0.3, 0)
    ref = decode_attention_reference(q, k, v, ks, vs, mask, sm_scale=0.3)
    assert rel_mean_error(out, ref) <= 1e-3
    assert rel_mean_error(da.decode_attention_fp8(q, k, v, ks, vs, mask, sm_scale=0.3), ref) <= 1e-3


@pytest.mark.parametrize("kv_dtype,with_length", [(torch.bfloat16, False), (FP8, False), (FP8, True)])
def test_opcheck(kv_dtype, with_length):
    q, k, v, ks, vs, mask = make_inputs(2, 4, 2, 70, 32, kv_dtype=kv_dtype, left_pad=3)
    args = (q, k, v, ks, vs, mask, 32**-0.5, 2) + ((torch.tensor(50, device=DEVICE),) if with_length else ())
    # On CPU, torch's schema checker compares fp8 tensors with ops that have no fp8 CPU kernel.
    skip = ("test_schema",) if kv_dtype == FP8 and DEVICE == "cpu" else ()
    utils = tuple(u for u in torch.library._OPCHECK_DEFAULT_UTILS if u not in skip)
    torch.library.opcheck(torch.ops.quantkit.decode_attention_fp8.default, args, test_utils=utils)


def test_fake_implementation_gives_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 8, 64, dtype=torch.float16)
        k = torch.empty(3, 2, 500, 64, dtype=FP8)
        out = torch.ops.quantkit.decode_attention_fp8(q, k, k, None, None, None, 0.125, 0)
    assert out.shape == (3, 8, 64) and out.dtype == torch.float16


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: {**a, "q": a["q"].unsqueeze(2)}, "q must be"),
        (lambda a: {**a, "k": a["k"][:, :, :, :32]}, "same shape"),
        (lambda a: {**a, "q": a["q"][:, :3]}, "multiple of Hkv"),
        (lambda a: {**a, "q": a["q"][:1]}, "batch and head_dim"),
        (lambda a: {**a, "k": a["k"][:, :, :0], "v": a["v"][:, :, :0]}, "empty"),
        (lambda a: {**a, "v": a["v"].to(torch.float16)}, "same one of"),
        (lambda a: {**a, "q": a["q"].to(torch.int32)}, "q dtype"),
        (lambda a: {**a, "mask": a["mask"][:, :5]}, "kv_mask must be bool"),
        (lambda a: {**a, "mask": a["mask"].int()}, "kv_mask must be bool"),
        (lambda a: {**a, "ks": torch.ones(3, device=DEVICE)}, "k_scale must be"),
        (lambda a: {**a, "k": a["k"].transpose(2, 3).contiguous().transpose(2, 3)}, "contiguous along head_dim"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, message):
    q, k, v, ks, vs, mask = make_inputs(2, 4, 2, 20, 64, left_pad=2)
    a = change(dict(q=q, k=k, v=v, ks=ks, vs=vs, mask=mask))
    with pytest.raises(ValueError, match=message):
        da.decode_attention_triton(a["q"], a["k"], a["v"], a["ks"], a["vs"], a["mask"])
    with pytest.raises(ValueError, match=message):
        da.decode_attention_fp8(a["q"], a["k"], a["v"], a["ks"], a["vs"], a["mask"])


# -- Hopper compile check (no GPU needed) ---------------------------------------------------------


def test_kernels_compile_for_hopper():
    """The real compiler (not the interpreter) accepts every variant for sm_90; fp8 converts in registers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import json; from quantkit.kernels.decode_attention import compile_kernels; "
        "print(json.dumps(compile_kernels()))"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 2 * len(da.COMPILE_VARIANTS)
    for name, info in results.items():
        assert info["cubin_bytes"] > 0, name
        if name.startswith("split/fp8e4nv"):
            assert info["fp8_converts"], name
        if name.startswith("split/fp8e4nv") and name.endswith("mask0/len0"):
            # Without the 1-byte mask and the 8-byte length, every global read is a 16-byte vector
            # (K, V: 16 fp8 codes; q: 8 bf16/fp16) or the 4-byte scale: no fp8 is read byte by byte.
            assert set(info["global_read_bytes"]) == {4, 16}, (name, info["global_read_bytes"])


def test_global_read_bytes_parses_ptx():
    ptx = """
    @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    ld.global.b32 { %r5 }, [ %rd2 + 0 ];
    @%p2 ld.global.b8 { %rs1 }, [ %rd3 + 0 ];
    cp.async.cg.shared.global [ %r6 + 0 ], [ %rd4 + 0 ], 0x10, %r7;
    cp.async.ca.shared.global [ %r8 + 0 ], [ %rd5 + 0 ], 0x8, %r9;
    """
    assert da.global_read_bytes(ptx) == [16, 4, 1, 16, 8]
