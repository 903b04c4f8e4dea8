"""Weights whose group size does not divide K (a ragged last group, as compressed-tensors lays it out:
ceil(K / group_size) scales): the reference dequantization against an independent per-input gather, and
every backend (Triton interpreted on CPU, PyTorch's CPU kernels, the reference) against it, through
prepare_wna16(group_size=...), on fresh random inputs. K = 576 and 960 are real model widths (SmolLM2)."""

from __future__ import annotations

import pytest
import torch

import quantkit.kernels as qk
from quantkit.kernels.packing import unpack_int32, unpack_zero_point
from quantkit.kernels.wna16_layout import check_wna16_weight, uniform_groups

from .wna16_cases import Scheme, random_weight, reference_output, rel_mean_error, tolerance

# PyTorch's CPU kernels: the "torch" backend's fallback (quantkit's C++ kernel: test_wna16_cpu_q8.py).
pytestmark = pytest.mark.usefixtures("aten_cpu_path")

N = 48  # a multiple of 16 (the CPU int4 kernel's N) and of 8 (int4 zero points packed along N)
# (K, group size): gcd(g, K) = 64, 64, 8 (Triton's word block: the CPU int4 kernel cannot take it), 32
SHAPES = [(576, 128), (960, 128), (200, 64), (96, 64)]
SCHEMES = [Scheme(bits, None, sym) for bits in (4, 8) for sym in (True, False)]


@pytest.fixture
def gen():
    g = torch.Generator()
    g.seed()  # fresh inputs every run
    return g


def _ragged(scheme: Scheme, group: int) -> Scheme:
    return Scheme(scheme.bits, group, scheme.symmetric)


def _gathered(weight, group: int) -> torch.Tensor:
    """fp32 [N, K]: w[n, k] = (q[n, k] - zp[n, k // group]) * s[n, k // group], indexed input by input."""
    k = weight.in_features
    q = unpack_int32(weight.weight_packed, weight.bits, k).float()
    index = torch.arange(k) // group  # [K]
    s = weight.weight_scale.float()[:, index]
    if weight.weight_zero_point is not None:
        q = q - unpack_zero_point(weight.weight_zero_point, weight.bits, weight.out_features).float()[:, index]
    return q * s


@pytest.mark.parametrize("k,group", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.id.replace("-ch", ""))
def test_reference_dequantizes_the_last_group_short(scheme, k, group, gen):
    weight = random_weight(_ragged(scheme, group), N, k, torch.float32, gen)
    assert weight.weight_scale.shape == (N, -(-k // group))
    torch.testing.assert_close(weight.dequantized, _gathered(weight, group), rtol=0, atol=0)


@pytest.mark.parametrize("k,group", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.id.replace("-ch", ""))
def test_uniform_groups_describe_the_same_weight(scheme, k, group, gen):
    weight = random_weight(_ragged(scheme, group), N, k, torch.bfloat16, gen)
    shape = check_wna16_weight(weight.weight_packed, weight.weight_scale, weight.weight_zero_point, weight.bits, k,
                               group)
    assert shape.ragged_group_size == group
    scale, zero, uniform = uniform_groups(weight.weight_scale, weight.weight_zero_point, shape)
    assert uniform.ragged_group_size is None and k % uniform.groups == 0 and group % uniform.group_size == 0
    again = qk.dequantize_wna16(weight.weight_packed, scale.float(), zero, weight.bits, k)  # no group_size: uniform
    torch.testing.assert_close(again, weight.dequantized, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
@pytest.mark.parametrize("k,group", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.id.replace("-ch", ""))
def test_backends_match_the_reference(scheme, k, group, backend, gen):
    if backend == "triton" and not torch.cuda.is_available() and not qk.kernels_interpreted():
        pytest.fail("TRITON_INTERPRET=1 must be set before quantkit.kernels is imported (tests/conftest.py)")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if backend == "reference" else torch.bfloat16
    weight = random_weight(_ragged(scheme, group), N, k, dtype, gen)
    prepared = qk.prepare_wna16(weight.weight_packed, weight.weight_scale, weight.weight_zero_point,
                                bits=weight.bits, in_features=k, backend=backend, group_size=group)
    prepared = {name: t.to(device) for name, t in prepared.items()}
    for m in (1, 5):
        x = torch.randn(m, k, generator=gen).to(dtype)
        y = qk.wna16_linear(x.to(device), prepared, bits=weight.bits, in_features=k, out_features=N,
                            backend=backend)
        assert y.shape == (m, N) and y.dtype == dtype
        assert rel_mean_error(y.cpu(), reference_output(x, weight)) <= tolerance(dtype), (m, qk.prepared_layout(prepared))


def test_cpu_kernel_layout_when_the_gcd_allows_it(gen):
    """576 in groups of 128 runs on the CPU int4 kernel (as groups of 64); 200 in groups of 64 (gcd 8) cannot,
    and keeps the exact reference layout instead of failing."""
    for k, group, layout in ((576, 128, "cpu_int4"), (200, 64, "reference")):
        weight = random_weight(Scheme(4, group, True), N, k, torch.bfloat16, gen)
        prepared = qk.prepare_wna16(weight.weight_packed, weight.weight_scale, None, bits=4, in_features=k,
                                    backend="torch", group_size=group)
        assert qk.prepared_layout(prepared) == layout


def test_group_count_must_fit_the_group_size(gen):
    weight = random_weight(Scheme(4, 128, True), N, 576, torch.bfloat16, gen)  # 5 groups
    with pytest.raises(ValueError, match="ceil"):
        qk.prepare_wna16(weight.weight_packed, weight.weight_scale, None, bits=4, in_features=576,
                         backend="reference", group_size=64)  # 576 / 64 needs 9
    with pytest.raises(ValueError, match="group_size"):
        qk.prepare_wna16(weight.weight_packed, weight.weight_scale, None, bits=4, in_features=576,
                         backend="reference")  # 5 groups do not divide 576: the group size must be given
