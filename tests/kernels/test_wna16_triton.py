"""Triton WNA16 kernels (interpreted on CPU without a GPU) against the reference from the dequantized weight.

Every scheme (int4 g32/g64/g128/per-channel, int8 per-channel/g64, int2 g64; symmetric and asymmetric)
in fp16, bf16 and fp32, M from 1 to 8 and a few larger (each M through the algorithm the rules pick
for it), N ragged (80: not a multiple of any BLOCK_N), fresh random inputs each run; every algorithm
(GEMV at each BLOCK_M, split-K, dot, dequant) forced with NaN-poisoned output and workspace buffers
on every scheme; ragged K; invalid operands; opcheck and torch.compile of the op.
"""

from __future__ import annotations

import pytest
import torch

import quantkit.kernels as qk
from quantkit.kernels import WNA16Config

from .wna16_cases import TRITON_SCHEMES, Scheme, random_weight, reference_output, rel_mean_error, tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, K = 80, 256
M_ALL = (1, 2, 3, 4, 5, 6, 7, 8, 16, 33)
M_SOME = (1, 2, 5, 8, 33)


@pytest.fixture(scope="module", autouse=True)
def _kernels_runnable():
    if DEVICE == "cpu" and not qk.kernels_interpreted():
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set, so the kernels cannot run on CPU: run with "
            "TRITON_INTERPRET=1 in the environment (tests/conftest.py sets it before any test module is collected)"
        )


@pytest.fixture
def gen():
    g = torch.Generator()
    g.seed()  # fresh inputs every run; printed on failure
    return g


def _prepared(weight, device=DEVICE):
    prep = qk.prepare_wna16(weight.weight_packed, weight.weight_scale, weight.weight_zero_point,
                            bits=weight.bits, in_features=weight.in_features, backend="triton")
    return {k: v.to(device) for k, v in prep.items()}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("scheme", TRITON_SCHEMES, ids=lambda s: s.id)
def test_matches_reference(scheme: Scheme, dtype, gen):
    weight = random_weight(scheme, N, K, dtype, gen)
    prep = _prepared(weight)
    bias = torch.randn(N, generator=gen).to(dtype)
    for m in M_ALL if dtype == torch.float16 else M_SOME:
        x = torch.randn(m, K, generator=gen).to(dtype)
        with_bias = bias if m % 2 else None
        y = qk.wna16_linear(x.to(DEVICE), prep, bits=scheme.bits, in_features=K, out_features=N, backend="triton",
                            bias=None if with_bias is None else with_bias.to(DEVICE))
        assert y.shape == (m, N) and y.dtype == dtype
        err = rel_mean_error(y.cpu(), reference_output(x, weight, with_bias))
        cfg = qk.choose_config(m, N, K, scheme.bits)
        assert err <= tolerance(dtype), f"seed={gen.initial_seed()} M={m} {cfg}: relative mean error {err:.2e}"


FORCED = [
    WNA16Config("gemv", 1, 128, split_k=1, num_warps=1),
    WNA16Config("gemv", 2, 256, split_k=2, num_warps=1),
    WNA16Config("gemv", 4, 128, split_k=3, num_warps=1),
    WNA16Config("gemv", 2, 128, split_k=4, num_warps=1, reduce="last"),
    WNA16Config("dot", 16, 32, split_k=1),
    WNA16Config("dot", 16, 64, split_k=2),
    WNA16Config("dot", 32, 16, split_k=1),
    WNA16Config("dequant", 1, 64),
]


# one scheme per bit width x scale mode (block-wide scale, per-field scale, per channel), both zero modes
FORCED_SCHEMES = [Scheme(4, 32, False), Scheme(4, 128, True), Scheme(4, None, False), Scheme(8, None, True),
                  Scheme(8, 64, False), Scheme(2, 64, False)]


@pytest.mark.parametrize("config", FORCED, ids=lambda c: f"{c.algo}-m{c.block_m}-n{c.block_n}-s{c.split_k}")
@pytest.mark.parametrize("scheme", FORCED_SCHEMES, ids=lambda s: s.id)
def test_every_algorithm_writes_every_output(scheme, config, gen):
    """Output and workspace poisoned with NaN: any element a kernel fails to write shows up."""
    dtype = torch.float16
    m = min(config.block_m, 4) if config.algo == "gemv" else 5
    weight = random_weight(scheme, N, K, dtype, gen)
    prep = _prepared(weight)
    x = torch.randn(m, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    out = torch.full((m, N), float("nan"), dtype=dtype, device=DEVICE)
    workspace = torch.full((K * N,), float("nan"), dtype=torch.float32, device=DEVICE)
    if config.algo == "dequant":
        workspace = workspace.to(dtype)
    y = qk.wna16_gemm_triton(x.to(DEVICE), prep["triton_qweight"], prep["triton_scales"], prep.get("triton_zeros"),
                             bias.to(DEVICE), scheme.bits, config=config, out=out, workspace=workspace)
    assert y.data_ptr() == out.data_ptr()
    err = rel_mean_error(y.cpu(), reference_output(x, weight, bias))
    assert err <= tolerance(dtype), f"seed={gen.initial_seed()} {config}: relative mean error {err:.2e}"


@pytest.mark.parametrize("scheme,k", [(Scheme(4, None, False), 200), (Scheme(8, None, True), 100),
                                      (Scheme(4, 40, True), 120)], ids=("int4-ch-K200", "int8-ch-K100", "int4-g40"))
def test_ragged_k_and_odd_groups(scheme, k, gen):
    """K not a multiple of BLOCK_K (masked tail, partly filled last word); a group size of 40 (gather mode)."""
    dtype = torch.float16
    weight = random_weight(scheme, 48, k, dtype, gen)
    prep = _prepared(weight)
    for m in (1, 17):
        x = torch.randn(m, k, generator=gen).to(dtype)
        y = qk.wna16_linear(x.to(DEVICE), prep, bits=scheme.bits, in_features=k, out_features=48, backend="triton")
        err = rel_mean_error(y.cpu(), reference_output(x, weight))
        assert err <= tolerance(dtype), f"seed={gen.initial_seed()} M={m}: relative mean error {err:.2e}"


def test_leading_dims_and_torch_twin(gen):
    """[B, T, K] inputs; the pure-torch twin on the Triton layout agrees with the reference too."""
    scheme, dtype = Scheme(4, 64, False), torch.bfloat16
    weight = random_weight(scheme, N, K, dtype, gen)
    prep = _prepared(weight)
    x = torch.randn(2, 3, K, generator=gen).to(dtype)
    y = qk.wna16_linear(x.to(DEVICE), prep, bits=4, in_features=K, out_features=N, backend="triton")
    assert y.shape == (2, 3, N)
    ref = reference_output(x.reshape(6, K), weight).reshape(2, 3, N)
    assert rel_mean_error(y.cpu(), ref) <= tolerance(dtype)
    twin = qk.wna16_gemm_torch(x.reshape(6, K).to(DEVICE), prep["triton_qweight"], prep["triton_scales"],
                               prep["triton_zeros"], None, 4)
    assert rel_mean_error(twin.cpu(), ref.reshape(6, N)) <= tolerance(dtype)


def test_invalid_operands_raise(gen):
    weight = random_weight(Scheme(4, 32, False), N, K, torch.float16, gen)
    prep = _prepared(weight)
    qw, sc, zr = prep["triton_qweight"], prep["triton_scales"], prep["triton_zeros"]
    x = torch.randn(2, K, dtype=torch.float16, device=DEVICE)
    op = torch.ops.quantkit.wna16_gemm
    with pytest.raises(ValueError, match="x must be 2-D"):
        op(x.to(torch.int32), qw, sc, zr, None, 4)
    with pytest.raises(ValueError, match="qweight must be int32"):
        op(x[:, :128], qw, sc, zr, None, 4)
    with pytest.raises(ValueError, match="bits must be one of"):
        op(x, qw, sc, zr, None, 3)
    with pytest.raises(ValueError, match="zeros must be uint8"):
        op(x, qw, sc, zr.to(torch.int32), None, 4)
    with pytest.raises(ValueError, match="bias must be"):
        op(x, qw, sc, zr, torch.zeros(N + 1, device=DEVICE), 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        op(x, qw, sc.repeat_interleave(8, 0)[: K // 4], None, None, 4)  # group size 4 < 8 values per word
    with pytest.raises(ValueError, match="does not divide"):
        op(x, qw, sc[:3], None, None, 4)
    with pytest.raises(ValueError, match="out must be a row-major"):
        qk.wna16_gemm_triton(x, qw, sc, zr, None, 4, out=torch.empty(2, N, device=DEVICE))
    with pytest.raises(ValueError, match="workspace must be a contiguous torch.float32"):
        qk.wna16_gemm_triton(x, qw, sc, zr, None, 4, config=WNA16Config("gemv", 2, 128, split_k=2, num_warps=1),
                             workspace=torch.empty(N, device=DEVICE))
    with pytest.raises(ValueError, match="cannot run M=2 rows"):
        qk.wna16_gemm_triton(x, qw, sc, zr, None, 4, config=WNA16Config("gemv", 1, 128, num_warps=1))
    with pytest.raises(ValueError, match="in_features=256"):
        qk.wna16_linear(x[:, :100], prep, bits=4, in_features=K, out_features=N, backend="triton")
    with pytest.raises(ValueError, match="does not read"):
        qk.wna16_linear(x, prep, bits=4, in_features=K, out_features=N, backend="reference")


def test_opcheck(gen):
    for scheme, m in ((Scheme(4, 64, False), 3), (Scheme(8, None, True), 1)):
        weight = random_weight(scheme, N, K, torch.bfloat16, gen)
        prep = _prepared(weight)
        x = torch.randn(m, K, generator=gen).to(torch.bfloat16).to(DEVICE)
        bias = torch.randn(N, generator=gen).to(torch.bfloat16).to(DEVICE)
        args = (x, prep["triton_qweight"], prep["triton_scales"], prep.get("triton_zeros"), bias, scheme.bits)
        torch.library.opcheck(torch.ops.quantkit.wna16_gemm.default, args)


def test_fake_implementation_allocates_output():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(7, 4096, dtype=torch.float16)
        qw = torch.empty(512, 11008, dtype=torch.int32)
        sc = torch.empty(32, 11008, dtype=torch.float16)
        y = torch.ops.quantkit.wna16_gemm(x, qw, sc, None, None, 4)
    assert y.shape == (7, 11008) and y.dtype == torch.float16


def test_torch_compile_fullgraph(gen):
    """torch.compile traces the op without graph breaks (aot_eager: no C++ compiler needed on CPU)."""
    scheme, dtype = Scheme(4, 128, True), torch.float16
    weight = random_weight(scheme, N, K, dtype, gen)
    prep = _prepared(weight)

    def f(x):
        return qk.wna16_linear(x, prep, bits=4, in_features=K, out_features=N, backend="triton") * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    x = torch.randn(4, K, generator=gen).to(dtype)
    y = compiled(x.to(DEVICE))
    assert rel_mean_error(y.cpu(), 2 * reference_output(x, weight)) <= tolerance(dtype)


def test_auto_keeps_the_reference_for_groups_triton_cannot_hold(gen, monkeypatch):
    """On CUDA "auto" picks Triton; a layer whose group size the Triton layout cannot hold (int8 in
    groups of 4) must then keep the exact reference layout instead of failing at load time, while
    an explicit backend="triton" still refuses it with a message naming the fix."""
    scheme = Scheme(bits=8, group_size=4, symmetric=True)
    w = random_weight(scheme, 64, 64, torch.float32, gen)
    monkeypatch.setattr(qk.wna16, "resolve_backend", lambda backend, device, dtype=None: "triton")
    prep = qk.prepare_wna16(w.weight_packed, w.weight_scale, None, bits=8, in_features=64, backend="auto")
    assert qk.prepared_layout(prep) == "reference"
    with pytest.raises(ValueError, match="use backend='reference' for this layer"):
        qk.prepare_wna16(w.weight_packed, w.weight_scale, None, bits=8, in_features=64, backend="triton")
