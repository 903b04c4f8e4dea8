"""The CPU "torch" backend (PyTorch's weight-only CPU kernels) against the reference; backend rules; errors.

The torch backend computes in bf16 whatever the activation dtype (its documented numerics), so every
dtype is held to the bf16 tolerance here.
"""

from __future__ import annotations

import pytest
import torch

import quantkit.kernels as qk

from .wna16_cases import Scheme, random_weight, reference_output, rel_mean_error, tolerance

# PyTorch's CPU kernels: the "torch" backend's fallback (quantkit's C++ kernel: test_wna16_cpu_q8.py).
pytestmark = pytest.mark.usefixtures("aten_cpu_path")

N, K = 96, 256
BF16_TOL = tolerance(torch.bfloat16)

CPU_SCHEMES = {  # scheme -> the layout the torch backend must pick
    Scheme(4, 32, True): "cpu_int4",
    Scheme(4, 64, False): "cpu_int4",
    Scheme(4, 128, True): "cpu_int4",
    Scheme(4, 128, False): "cpu_int4",
    Scheme(4, 256, True): "cpu_int4",
    Scheme(4, None, False): "cpu_int4",  # per channel: groups of 256 with the scale repeated
    Scheme(8, None, True): "cpu_int8",
    Scheme(8, None, False): "cpu_int8",
    Scheme(8, 64, True): "cpu_int4",  # int8 groups: two int4 halves
    Scheme(8, 128, False): "cpu_int4",
}


@pytest.fixture
def gen():
    g = torch.Generator()
    g.seed()
    return g


def _prepare(weight, backend="torch"):
    return qk.prepare_wna16(weight.weight_packed, weight.weight_scale, weight.weight_zero_point,
                            bits=weight.bits, in_features=weight.in_features, backend=backend)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("scheme", list(CPU_SCHEMES), ids=lambda s: s.id)
def test_torch_backend_matches_reference(scheme, dtype, gen):
    weight = random_weight(scheme, N, K, dtype, gen)
    prep = _prepare(weight)
    assert qk.prepared_layout(prep) == CPU_SCHEMES[scheme]
    assert all(isinstance(t, torch.Tensor) for t in prep.values())
    bias = torch.randn(N, generator=gen).to(dtype)
    for m in (1, 3, 16, 33):
        x = torch.randn(m, K, generator=gen).to(dtype)
        with_bias = bias if m != 3 else None
        y = qk.wna16_linear(x, prep, bits=scheme.bits, in_features=K, out_features=N, backend="torch", bias=with_bias)
        assert y.shape == (m, N) and y.dtype == dtype
        err = rel_mean_error(y, reference_output(x, weight, with_bias))
        assert err <= BF16_TOL, f"seed={gen.initial_seed()} M={m}: relative mean error {err:.2e}"


def test_fp32_models_run_in_bf16_on_the_torch_backend(gen):
    """The documented trade: fp32 activations are rounded to bf16 (fast path); 'reference' stays exact."""
    weight = random_weight(Scheme(4, 128, True), N, K, torch.float32, gen)
    x = torch.randn(4, K, generator=gen)
    ref = reference_output(x, weight)
    fast = qk.wna16_linear(x, _prepare(weight), bits=4, in_features=K, out_features=N, backend="torch")
    exact = qk.wna16_linear(x, _prepare(weight, "reference"), bits=4, in_features=K, out_features=N,
                            backend="reference")
    assert rel_mean_error(exact, ref) <= tolerance(torch.float32)
    assert tolerance(torch.float32) < rel_mean_error(fast, ref) <= BF16_TOL


@pytest.mark.parametrize(
    "scheme,n", [(Scheme(2, 64, True), 96), (Scheme(4, 128, True), 40), (Scheme(4, 16, False), 96)],
    ids=("int2", "int4-N40", "int4-g16"),
)
def test_layers_the_cpu_kernels_cannot_run_fall_back_to_the_reference(scheme, n, gen):
    weight = random_weight(scheme, n, K, torch.bfloat16, gen)
    prep = _prepare(weight)
    assert qk.prepared_layout(prep) == "reference"
    assert prep["weight_packed"] is weight.weight_packed  # no copy
    x = torch.randn(2, K, generator=gen).to(torch.bfloat16)
    y = qk.wna16_linear(x, prep, bits=scheme.bits, in_features=K, out_features=n, backend="torch")
    assert rel_mean_error(y, reference_output(x, weight)) <= BF16_TOL


def test_resolve_backend_rules():
    assert qk.resolve_backend("auto", torch.device("cpu"), torch.bfloat16) == "torch"
    assert qk.resolve_backend("auto", "cpu") == "torch"
    # fp32 models get the CPU kernels at bf16 precision (test_wna16_auto_cpu); fp16 ones stay exact
    assert qk.resolve_backend("auto", torch.device("cpu"), torch.float32) == "torch"
    assert qk.resolve_backend("auto", "cpu", torch.float16) == "reference"
    assert qk.resolve_backend("auto", "cuda", torch.float32) == "triton"
    assert qk.resolve_backend("auto", "cuda:0", torch.bfloat16) == "triton"
    assert qk.resolve_backend("auto", "meta", torch.bfloat16) == "reference"
    assert qk.resolve_backend("reference", "cpu", torch.float16) == "reference"
    with pytest.raises(ValueError, match="choose one of"):
        qk.resolve_backend("marlin", "cpu", torch.float16)
    with pytest.raises(ValueError, match="needs CPU weights"):
        qk.resolve_backend("torch", "cuda", torch.float16)
    if not qk.kernels_interpreted():
        with pytest.raises(ValueError, match="needs the weights on a CUDA device"):
            qk.resolve_backend("triton", "cpu", torch.float16)


def test_invalid_weights_raise(gen):
    w = random_weight(Scheme(4, 64, False), N, K, torch.float16, gen)
    kw = dict(bits=4, in_features=K, backend="torch")
    with pytest.raises(ValueError, match="bits=3 is not supported"):
        qk.prepare_wna16(w.weight_packed, w.weight_scale, w.weight_zero_point, bits=3, in_features=K, backend="torch")
    with pytest.raises(TypeError, match="2-D int32"):
        qk.prepare_wna16(w.weight_packed.to(torch.int64), w.weight_scale, None, **kw)
    with pytest.raises(ValueError, match="words per row"):
        qk.prepare_wna16(w.weight_packed[:, :-1], w.weight_scale, None, **kw)
    with pytest.raises(ValueError, match="does not divide"):
        qk.prepare_wna16(w.weight_packed, w.weight_scale[:, :3], None, **kw)
    with pytest.raises(ValueError, match="weight_zero_point must be int32"):
        qk.prepare_wna16(w.weight_packed, w.weight_scale, w.weight_zero_point[:, :1], **kw)
    with pytest.raises(ValueError, match="weight_scale must be"):
        qk.prepare_wna16(w.weight_packed, w.weight_scale.to(torch.int32), None, **kw)
    prep = qk.prepare_wna16(w.weight_packed, w.weight_scale, w.weight_zero_point, **kw)
    with pytest.raises(TypeError, match="x must be one of"):
        qk.wna16_linear(torch.ones(1, K, dtype=torch.int32), prep, bits=4, in_features=K, out_features=N,
                        backend="torch")
    with pytest.raises(ValueError, match="does not read"):
        qk.wna16_linear(torch.ones(1, K), prep, bits=4, in_features=K, out_features=N, backend="triton")
    with pytest.raises(ValueError, match="not a prepared WNA16 weight"):
        qk.wna16_linear(torch.ones(1, K), {"w": w.weight_packed}, bits=4, in_features=K, out_features=N,
                        backend="torch")


def test_opcheck_cpu_ops(gen):
    x = torch.randn(3, K, generator=gen).to(torch.bfloat16)
    bias = torch.randn(N, generator=gen)
    int4 = _prepare(random_weight(Scheme(4, 64, False), N, K, torch.bfloat16, gen))
    int8g = _prepare(random_weight(Scheme(8, 128, False), N, K, torch.bfloat16, gen))
    int8 = _prepare(random_weight(Scheme(8, None, False), N, K, torch.bfloat16, gen))
    op4, op8 = torch.ops.quantkit.wna16_int4_cpu.default, torch.ops.quantkit.wna16_int8_cpu.default
    torch.library.opcheck(op4, (x, int4["cpu_int4_weight"], int4["cpu_int4_scales_zeros"], None, None, bias))
    torch.library.opcheck(op4, (x.float(), int8g["cpu_int4_weight"], int8g["cpu_int4_scales_zeros"],
                                int8g["cpu_int4_weight_lo"], int8g["cpu_int4_scales_zeros_lo"], None))
    torch.library.opcheck(op8, (x, int8["cpu_int8_weight"], int8["cpu_int8_scale"], int8["cpu_int8_zero_scale"], bias))
    torch.library.opcheck(op8, (x.half(), int8["cpu_int8_weight"], int8["cpu_int8_scale"], None, None))


def test_cpu_op_errors_name_the_problem(gen):
    prep = _prepare(random_weight(Scheme(4, 64, True), N, K, torch.bfloat16, gen))
    x = torch.randn(2, K).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="scales_zeros must be bf16"):
        torch.ops.quantkit.wna16_int4_cpu(x, prep["cpu_int4_weight"], prep["cpu_int4_scales_zeros"].float())
    with pytest.raises(RuntimeError, match="x has K=128"):
        torch.ops.quantkit.wna16_int4_cpu(x[:, :128], prep["cpu_int4_weight"], prep["cpu_int4_scales_zeros"])


def test_torch_compile_fullgraph_on_cpu_ops(gen):
    weight = random_weight(Scheme(8, None, False), N, K, torch.bfloat16, gen)
    prep = _prepare(weight)

    def f(x):
        return qk.wna16_linear(x, prep, bits=8, in_features=K, out_features=N, backend="torch").relu()

    x = torch.randn(2, 5, K, generator=gen).to(torch.bfloat16)
    y = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    ref = reference_output(x.reshape(10, K), weight).relu().reshape(2, 5, N)
    assert rel_mean_error(y, ref) <= BF16_TOL
