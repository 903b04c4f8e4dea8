"""quantkit::wna16_cpu_q8dot (C++, int8-rounded activations, integer dot products) on every code path.

Tolerances: against ``wna16_cpu_q8dot_reference`` (the same activation rounding, exact float64
products) the kernel differs only by fp32 summation order and the output cast: <= eps of x's dtype
(``wna16_cases.tolerance``: 1e-5 fp32). Against the exact float product the reference's error is the
activation rounding's: a block's values move by at most d/2 = max|x|/254, so on Gaussian x (max|x| of
32 values ~ 2.5 sigma) the relative mean error is ~ 2.5 / (127 sqrt(12)) = 5.7e-3; held to
``Q8_TOL`` = 2^-6, which allows a block maximum of ~4 sigma. A wrong nibble, scale, zero or block
scale moves outputs by O(1).
"""

from __future__ import annotations

import pytest
import torch

import quantkit.kernels as qk
from quantkit.kernels import cpu_extension, cpu_flags, cpu_kernel_choice
from quantkit.kernels.cpu_extension import cpu_kernel_isa, load_cpu_kernels
from quantkit.kernels.wna16_cpu_q8 import quantize_activations_q8, wna16_cpu_q8dot_reference
from quantkit.kernels.wna16_layout import check_wna16_weight, cpu_q8_supports

from .wna16_cases import Scheme, random_weight, reference_output, rel_mean_error, tolerance

Q8_TOL = 2.0**-6
ISAS = ("avx512-vnni", "avx2", "scalar")
SCHEMES = [
    Scheme(4, 128, True), Scheme(4, 128, False), Scheme(4, 32, True), Scheme(4, 64, False), Scheme(4, None, True),
    Scheme(4, None, False), Scheme(8, None, True), Scheme(8, None, False), Scheme(8, 32, False), Scheme(8, 128, True),
]
SHAPES = [(37, 96), (130, 256), (64, 576)]  # (N, K): ragged N, K % 64 == 32 (a padded superblock), K = 9 * 64
# the per-row code (1-3 rows), the lanes code from 4 (int4) / 8 (int8) rows in chunks of 8 or 16, ragged chunks
ROWS = (1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 64, 200)


@pytest.fixture(scope="session")
def q8_kernels():
    """The C++ library, built once per machine (cached) and shared by every test of the session."""
    if cpu_extension.compiler() is None:
        pytest.skip("no C++ compiler on this machine: the C++ CPU kernels cannot build (the aten path runs)")
    kernels = load_cpu_kernels()
    assert kernels.available, kernels.reason
    return kernels


@pytest.fixture
def gen():
    g = torch.Generator()
    g.seed()
    return g


@pytest.fixture(params=ISAS)
def isa(request, q8_kernels):
    got = cpu_kernel_isa(request.param)
    try:
        if got != request.param:
            pytest.skip(f"this CPU cannot run the {request.param} path (best: {cpu_kernel_isa('auto')})")
        yield request.param
    finally:
        cpu_kernel_isa("auto")


def _prepared(scheme, n, k, dtype, gen):
    """A random weight and its cpu_q8 layout (a group size that does not divide K: in uniform groups of the gcd)."""
    weight = random_weight(scheme, n, k, dtype, gen)
    prep = qk.prepare_wna16(weight.weight_packed, weight.weight_scale, weight.weight_zero_point, bits=scheme.bits,
                            in_features=k, backend="torch", group_size=scheme.group_size)
    assert qk.prepared_layout(prep) == "cpu_q8"
    return weight, prep


def _op(x, prep, bias=None):
    return torch.ops.quantkit.wna16_cpu_q8dot(x, prep["cpu_q8_weight"], prep["cpu_q8_scale"], prep.get("cpu_q8_zero"), bias)


def _ref(x, prep, bias=None):
    return wna16_cpu_q8dot_reference(x, prep["cpu_q8_weight"], prep["cpu_q8_scale"], prep.get("cpu_q8_zero"), bias)


@pytest.mark.parametrize("n,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.id)
def test_kernel_matches_its_reference_on_every_path(isa, scheme, n, k, gen):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        weight, prep = _prepared(scheme, n, k, dtype, gen)
        bias = torch.randn(n, generator=gen).to(dtype)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen).to(dtype)
            with_bias = bias if m % 2 else None
            y = _op(x, prep, with_bias)
            assert y.shape == (m, n) and y.dtype == dtype
            err = rel_mean_error(y, _ref(x, prep, with_bias))
            assert err <= tolerance(dtype), f"{isa} {dtype} M={m} seed={gen.initial_seed()}: {err:.2e}"


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.id)
def test_the_reference_differs_from_the_float_product_by_the_activation_rounding(scheme, gen):
    n, k = 96, 576
    weight, prep = _prepared(scheme, n, k, torch.float32, gen)
    x = torch.randn(8, k, generator=gen)
    exact = reference_output(x, weight)
    # the layout holds the weight exactly: with activations on the int8 grid already, no error at all
    q, d = quantize_activations_q8(x)
    on_grid = (q.float().view(8, -1, 32) * d.unsqueeze(-1)).view(8, k)
    assert rel_mean_error(_ref(on_grid, prep), reference_output(on_grid, weight)) <= 1e-6
    err = rel_mean_error(_ref(x, prep), exact)
    assert 1e-4 < err <= Q8_TOL, f"seed={gen.initial_seed()}: activation rounding error {err:.2e}"


def test_activation_rounding_is_round_half_even_per_block_of_32():
    x = torch.zeros(1, 64)
    x[0, 0] = 127.0  # d = 1 in block 0
    x[0, 1:5] = torch.tensor([0.5, 1.5, -2.5, 3.49])
    x[0, 32] = -254.0  # d = 2 in block 1
    x[0, 33:36] = torch.tensor([1.0, 3.0, -5.0])  # halves of d: 0.5, 1.5, -2.5 -> 0, 2, -2
    q, d = quantize_activations_q8(x)
    assert d.tolist() == [[1.0, 2.0]]
    assert q[0, :5].tolist() == [127, 0, 2, -2, 3] and q[0, 32:36].tolist() == [-127, 0, 2, -2]


def test_unpack_is_the_exact_dequantized_weight(q8_kernels, gen):
    n, k = 80, 256
    for scheme in (Scheme(4, 128, False), Scheme(8, None, True)):
        weight, prep = _prepared(scheme, n, k, torch.float32, gen)
        unpacked = torch.ops.quantkit.wna16_cpu_q8dot_unpack(
            prep["cpu_q8_weight"], prep["cpu_q8_scale"], prep.get("cpu_q8_zero"), k, False)
        assert torch.equal(unpacked, weight.dequantized)  # exact
        unpacked_bf16 = torch.ops.quantkit.wna16_cpu_q8dot_unpack(
            prep["cpu_q8_weight"], prep["cpu_q8_scale"], prep.get("cpu_q8_zero"), k, True)
        assert torch.equal(unpacked_bf16, weight.dequantized.to(torch.bfloat16))  # torch's round to nearest even


@pytest.mark.parametrize("native", (False, True), ids=("no-amx", "amx-bf16"))
def test_prompts_take_the_chosen_path_and_match_its_reference(q8_kernels, native, monkeypatch, gen):
    """Prompts run the int8 GEMM (int8-rounded activations), except bf16 prompts where the CPU has AMX
    bf16 tiles: those dequantize once and run the bf16 matmul on unrounded activations."""
    monkeypatch.setattr(cpu_flags, "native_bf16", lambda: native)
    monkeypatch.setattr(cpu_flags, "amx_bf16", lambda: native)
    n, k = 80, 256
    rows = cpu_kernel_choice.DEQUANT_MIN_ROWS["cpu_q8"]
    for scheme in (Scheme(4, 128, False), Scheme(8, None, True)):
        weight, prep = _prepared(scheme, n, k, torch.float32, gen)
        operands = (prep["cpu_q8_weight"], prep["cpu_q8_scale"], prep.get("cpu_q8_zero"), None)
        for dtype, m in ((torch.float32, rows + 3), (torch.bfloat16, rows - 1), (torch.bfloat16, rows)):
            path = cpu_kernel_choice.choose(m, k, n, dtype, "cpu_q8")
            dequantized = native and dtype == torch.bfloat16 and m >= rows
            assert isinstance(path, cpu_kernel_choice.Q8Dequantized if dequantized else cpu_kernel_choice.Q8Dot)
            x = torch.randn(m, k, generator=gen).to(dtype)
            y = qk.wna16_linear(x, prep, bits=scheme.bits, in_features=k, out_features=n, backend="torch")
            assert rel_mean_error(y, path.reference(x, *operands)) <= tolerance(dtype), f"{scheme.id} {dtype} M={m}"
            err = rel_mean_error(y, reference_output(x.float(), weight))
            assert err <= (tolerance(dtype) if dequantized else Q8_TOL), f"{scheme.id} {dtype} M={m}: {err:.2e}"


def test_auto_on_cpu_picks_the_q8_kernel_and_names_it(q8_kernels, gen):
    weight = random_weight(Scheme(4, 128, True), 64, 256, torch.float32, gen)
    prep = qk.prepare_wna16(weight.weight_packed, weight.weight_scale, None, bits=4, in_features=256, backend="auto")
    assert qk.prepared_layout(prep) == "cpu_q8"
    x = torch.randn(2, 256, generator=gen)
    y = qk.wna16_linear(x, prep, bits=4, in_features=256, out_features=64, backend="torch")
    assert rel_mean_error(y, reference_output(x, weight)) <= Q8_TOL
    assert qk.wna16.describe_layouts(["cpu_q8", "cpu_q8", "reference"]).startswith(
        f"quantkit::wna16_cpu_q8dot ({cpu_kernel_isa()}) x 2")


@pytest.mark.parametrize("scheme,k", [(Scheme(2, None, True), 128), (Scheme(4, 16, True), 128), (Scheme(8, None, True), 80)],
                         ids=("int2", "group16", "k80"))
def test_layers_the_kernel_cannot_run_keep_the_previous_path(q8_kernels, scheme, k, gen):
    weight = random_weight(scheme, 48, k, torch.float32, gen)
    shape = check_wna16_weight(weight.weight_packed, weight.weight_scale, weight.weight_zero_point, scheme.bits, k)
    assert not cpu_q8_supports(shape)
    assert qk.planned_layout(shape, "torch") != "cpu_q8"


def test_no_compiler_or_a_failed_build_falls_back_with_the_reason(monkeypatch, tmp_path, gen):
    monkeypatch.setenv("QUANTKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "quantkit-no-such-compiler")
    kernels = load_cpu_kernels.__wrapped__()  # the uncached body: this process's loaded library is untouched
    assert not kernels.available and "no C++ compiler" in kernels.reason
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    with pytest.warns(UserWarning, match="did not build"):
        kernels = load_cpu_kernels.__wrapped__()
    assert not kernels.available and "did not build" in kernels.reason
    monkeypatch.setenv("QUANTKIT_CPU_KERNELS", "0")
    assert "turned off" in load_cpu_kernels.__wrapped__().reason
    # and the backend then runs PyTorch's kernels
    from quantkit.kernels import wna16

    monkeypatch.setattr(wna16, "load_cpu_kernels", lambda: kernels)
    weight = random_weight(Scheme(4, 128, True), 64, 256, torch.float32, gen)
    shape = check_wna16_weight(weight.weight_packed, weight.weight_scale, None, 4, 256)
    assert qk.planned_layout(shape, "torch") == "cpu_int4"


def test_opcheck_and_compile(q8_kernels, gen):
    weight, prep = _prepared(Scheme(4, 64, False), 48, 128, torch.float32, gen)
    x = torch.randn(3, 128, generator=gen)
    bias = torch.randn(48, generator=gen)
    torch.library.opcheck(torch.ops.quantkit.wna16_cpu_q8dot.default,
                          (x, prep["cpu_q8_weight"], prep["cpu_q8_scale"], prep["cpu_q8_zero"], bias))
    torch.library.opcheck(torch.ops.quantkit.wna16_cpu_q8dot_unpack.default,
                          (prep["cpu_q8_weight"], prep["cpu_q8_scale"], prep["cpu_q8_zero"], 128, True))

    def f(x):
        return qk.wna16_linear(x, prep, bits=4, in_features=128, out_features=48, backend="torch", bias=bias)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), f(x))
    # prompts choose their path by rows, dtype and the CPU's features: that choice must trace too (vLLM
    # compiles its forward with fullgraph)
    x_long = torch.randn(40, 128, generator=gen, dtype=torch.bfloat16)
    torch._dynamo.reset()
    torch.testing.assert_close(compiled(x_long), f(x_long), rtol=0, atol=0)


def test_the_isa_variable_forces_a_lower_path(q8_kernels, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CPU_KERNEL_ISA", "scalar")
    try:
        assert load_cpu_kernels.__wrapped__().available
        assert cpu_kernel_isa() == "scalar"
    finally:
        cpu_kernel_isa("auto")
    assert cpu_kernel_isa() != "scalar" or cpu_extension.ISA_NAMES.index(cpu_kernel_isa()) == 0
