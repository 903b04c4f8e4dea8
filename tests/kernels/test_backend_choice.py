"""kernels.backend_choice: the Triton kernel and the reference as kernel paths (each against its reference),
which backend "auto" and explicit choices resolve to (with the reasons of refusals), and which path each
layout and number of rows takes.

Tolerances (``wna16_cases.tolerance``): the Triton kernel against its pure-torch twin on the same layout,
and the fp32 reference against its float64 twin, differ by summation order and the output cast only:
<= eps of x's dtype (1e-5 for fp32). The Triton kernel runs in Triton's interpreter on CPU tensors
(TRITON_INTERPRET is set in tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

import quantkit.kernels as qk
from quantkit.kernels import backend_choice as policy
from quantkit.kernels import cpu_flags, cpu_kernel_choice, wna16, wna16_layout
from quantkit.kernels.cpu_extension import load_cpu_kernels

from .wna16_cases import Scheme, random_weight, reference_output, rel_mean_error, tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (scheme, M, N, K): decode and prompt rows, ragged N, per channel and groups, int2/int4/int8
CASES = [
    (Scheme(4, 32, True), 1, 80, 128),
    (Scheme(4, 64, False), 5, 48, 256),
    (Scheme(8, None, False), 3, 96, 64),
    (Scheme(2, 64, True), 17, 64, 128),
]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture
def gen():
    g = torch.Generator()
    g.seed()  # fresh inputs every run
    return g


def _case_ids(cases):
    return [f"{s.id}-M{m}-N{n}-K{k}" for s, m, n, k in cases]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme,m,n,k", CASES, ids=_case_ids(CASES))
def test_triton_gemm_matches_its_reference(scheme, m, n, k, dtype, gen):
    if DEVICE == "cpu" and not qk.kernels_interpreted():
        pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    weight = random_weight(scheme, n, k, dtype, gen)
    prepared = qk.prepare_wna16(weight.weight_packed, weight.weight_scale, weight.weight_zero_point,
                                bits=scheme.bits, in_features=k, backend="triton")
    prepared = {key: t.to(DEVICE) for key, t in prepared.items()}
    path = policy.choose_kernel(m, k, n, dtype, qk.prepared_layout(prepared))
    assert path is policy.TRITON_GEMM
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    operands = (*path.operands(prepared), bias.to(DEVICE), scheme.bits)
    y = path.apply(x.to(DEVICE), *operands).cpu()
    assert y.dtype == dtype and y.shape == (m, n)
    ref = path.reference(x.to(DEVICE), *operands).cpu()
    assert rel_mean_error(y, ref) <= tolerance(dtype), f"{scheme.id} {dtype} M={m}"
    assert rel_mean_error(y, reference_output(x.float(), weight, bias.float())) <= tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme,m,n,k", CASES, ids=_case_ids(CASES))
def test_reference_matches_its_float64_reference(scheme, m, n, k, dtype, gen):
    weight = random_weight(scheme, n, k, dtype, gen)
    prepared = qk.prepare_wna16(weight.weight_packed, weight.weight_scale, weight.weight_zero_point,
                                bits=scheme.bits, in_features=k, backend="reference")
    path = policy.choose_kernel(m, k, n, dtype, qk.prepared_layout(prepared))
    assert path is policy.REFERENCE
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    operands = (*path.operands(prepared), scheme.bits, bias)
    y = path.apply(x, *operands)
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel_mean_error(y, path.reference(x, *operands)) <= tolerance(dtype), f"{scheme.id} {dtype} M={m}"
    assert rel_mean_error(y, reference_output(x.float(), weight, bias.float())) <= tolerance(dtype)


def test_each_path_refuses_another_layout_and_says_why():
    assert "reads the triton layout, not cpu_q8" in policy.TRITON_GEMM.can_run(1, 64, 64, torch.float32, "cpu_q8")
    assert "not one of" in policy.TRITON_GEMM.can_run(1, 64, 64, torch.int8, "triton")
    assert "reads the reference layout, not triton" in policy.REFERENCE.can_run(1, 64, 64, torch.float32, "triton")
    assert policy.REFERENCE.can_run(1, 64, 64, torch.float64, "reference") is None
    with pytest.raises(ValueError, match="no CPU kernel path reads the 'marlin' layout"):
        policy.choose_kernel(1, 64, 64, torch.float32, "marlin")


# (backend, device, dtype) -> the concrete backend, as the rules before the policy classes gave it
RESOLVED = [
    ("auto", "cuda", torch.float32, "triton"),
    ("auto", "cuda:0", torch.float16, "triton"),
    ("auto", "cuda", None, "triton"),
    ("auto", "cpu", torch.bfloat16, "torch"),
    ("auto", "cpu", torch.float32, "torch"),
    ("auto", "cpu", None, "torch"),
    ("auto", "cpu", torch.float16, "reference"),
    ("auto", "meta", torch.bfloat16, "reference"),
    ("auto", "meta", None, "reference"),
    ("torch", "cpu", torch.float16, "torch"),
    ("triton", "cuda", torch.bfloat16, "triton"),
    ("reference", "cuda", torch.float16, "reference"),
    ("reference", "meta", None, "reference"),
]


@pytest.mark.parametrize("backend,device,dtype,expected", RESOLVED)
def test_resolve_backend_picks_what_the_rules_say(backend, device, dtype, expected):
    assert qk.resolve_backend(backend, device, dtype) == expected


# (backend, device) -> the message a user sees
REFUSED = [
    ("marlin", "cpu", "unknown backend 'marlin'; choose one of ('auto', 'triton', 'torch', 'reference')"),
    ("torch", "cuda", "backend 'torch' runs PyTorch's CPU kernels and needs CPU weights, got cuda"),
    ("torch", "meta", "backend 'torch' runs PyTorch's CPU kernels and needs CPU weights, got meta"),
    ("triton", "meta", "backend 'triton' needs the weights on a CUDA device (got meta); on CPU use 'torch' or "
                       "'reference' (or set TRITON_INTERPRET=1 before importing quantkit to run the kernels "
                       "interpreted)"),
]


@pytest.mark.parametrize("backend,device,message", REFUSED)
def test_resolve_backend_refuses_with_the_reason(backend, device, message):
    with pytest.raises(ValueError) as error:
        qk.resolve_backend(backend, device, torch.float32)
    assert str(error.value) == message


def test_triton_on_the_cpu_is_refused_unless_interpreted(monkeypatch):
    monkeypatch.setattr(policy, "triton_can_run_on", lambda device: False)
    with pytest.raises(ValueError, match=r"needs the weights on a CUDA device \(got cpu\)"):
        qk.resolve_backend("triton", "cpu")
    monkeypatch.setattr(policy, "triton_can_run_on", lambda device: True)
    assert qk.resolve_backend("triton", "cpu") == "triton"


def test_auto_says_why_it_passes_each_backend_over():
    triton, cpu, reference = policy.BACKEND_ORDER
    cpu_device, cuda = torch.device("cpu"), torch.device("cuda")
    assert "not a CUDA device" in triton.auto_skips(cpu_device, torch.bfloat16)
    assert triton.auto_skips(cuda, torch.float16) is None
    assert "not the CPU" in cpu.auto_skips(cuda, torch.bfloat16)
    assert "torch.float16 model keeps the reference's precision" in cpu.auto_skips(cpu_device, torch.float16)
    assert reference.auto_skips(torch.device("meta"), None) is None
    assert [b.name for b in policy.BACKEND_ORDER] == ["triton", "torch", "reference"]


def test_the_backend_policy_beside_resolve_backend():
    assert [policy.fuses_projections(b) for b in ("torch", "triton", "reference", "triton+torch")] == [
        True, False, False, False]
    assert policy.benchmark_backend("auto", "cpu") == "torch"
    assert policy.benchmark_backend("auto", "cuda") == "auto"
    assert policy.benchmark_backend("reference", "cpu") == "reference"


def test_each_layout_names_the_kernel_that_decodes_it():
    assert qk.wna16.KERNEL_NAMES == {
        "cpu_q8": "quantkit::wna16_cpu_q8dot",
        "cpu_int4": "aten._weight_int4pack_mm_for_cpu",
        "cpu_int8": "aten._weight_int8pack_mm",
        "triton": "quantkit::wna16_gemm (Triton)",
        "reference": "reference (dequantize + fp32 matmul)",
    }
    for layout, name in qk.wna16.KERNEL_NAMES.items():
        assert policy.choose_kernel(1, 256, 64, torch.bfloat16, layout).name == name


@pytest.mark.parametrize("amx", (False, True), ids=("no-amx", "amx-bf16"))
@pytest.mark.parametrize("layout", ("cpu_q8", "cpu_int4", "cpu_int8", "triton", "reference"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_paths_by_rows_is_the_choice_at_every_row_count(layout, dtype, amx, monkeypatch):
    monkeypatch.setattr(cpu_flags, "amx_bf16", lambda: amx)
    runs = policy.paths_by_rows(256, 64, dtype, layout)
    assert runs[0][0] == 1 and [r for r, _ in runs] == sorted({r for r, _ in runs})
    for m in range(1, 2 * max(cpu_kernel_choice.DEQUANT_MIN_ROWS.values()) + 2):
        expected = next(path for first, path in reversed(runs) if first <= m)
        assert policy.choose_kernel(m, 256, 64, dtype, layout) is expected, f"{layout} M={m}"


def test_paths_by_rows_names_the_dequantize_once_switch(monkeypatch):
    monkeypatch.setattr(cpu_flags, "amx_bf16", lambda: True)
    rows = cpu_kernel_choice.DEQUANT_MIN_ROWS
    names = lambda layout, dtype: [(r, p.name) for r, p in policy.paths_by_rows(256, 64, dtype, layout)]  # noqa: E731
    assert names("cpu_q8", torch.float32) == [(1, "quantkit::wna16_cpu_q8dot")]
    assert names("cpu_q8", torch.bfloat16) == [
        (1, "quantkit::wna16_cpu_q8dot"), (rows["cpu_q8"], "quantkit::wna16_cpu_q8dot_unpack + bf16 at::linear")]
    assert names("cpu_int4", torch.bfloat16) == [
        (1, "aten._weight_int4pack_mm_for_cpu"), (rows["cpu_int4"], "int4 dequantized once + at::linear")]
    assert names("cpu_int8", torch.float32) == [
        (1, "aten._weight_int8pack_mm"), (rows["cpu_int8"], "int8 dequantized once + at::linear")]


# each layout with a weight it holds: (layout, scheme)
LAYOUT_WEIGHTS = [("cpu_q8", Scheme(4, 32, True)), ("cpu_int4", Scheme(4, 64, False)), ("cpu_int8", Scheme(8, None, True)),
                  ("triton", Scheme(4, 32, False)), ("reference", Scheme(2, 64, True))]


@pytest.mark.parametrize("layout,scheme", LAYOUT_WEIGHTS, ids=[layout for layout, _ in LAYOUT_WEIGHTS])
def test_each_layouts_path_prepares_what_it_reads(layout, scheme, gen):
    """The layout's decode path builds the layout from the on-disk tensors (its ``prepare``, which
    ``prepare_wna16`` calls): the dict is of that layout, holds the path's operands, and the path run on it
    gives the float product of the weight, for fresh random x."""
    if layout == "cpu_q8" and not load_cpu_kernels().available:
        pytest.skip("quantkit's C++ kernels do not build here")
    if layout == "triton" and DEVICE == "cpu" and not qk.kernels_interpreted():
        pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    n, k, m = 64, 256, 3
    weight = random_weight(scheme, n, k, torch.bfloat16, gen)
    shape = wna16_layout.check_wna16_weight(weight.weight_packed, weight.weight_scale, weight.weight_zero_point,
                                               scheme.bits, k, scheme.group_size)
    path = wna16.LAYOUT_PATHS[layout]
    prepared = path.prepare(weight.weight_packed, weight.weight_scale, weight.weight_zero_point, shape)
    assert qk.prepared_layout(prepared) == layout and path.operands(prepared)[0] is not None
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    backend = {"triton": "triton", "reference": "reference"}.get(layout, "torch")
    y = qk.wna16_linear(x, prepared, bits=scheme.bits, in_features=k, out_features=n, backend=backend)
    assert rel_mean_error(y, reference_output(x.float(), weight, None)) <= tolerance(torch.bfloat16)
