"""planned_layout: the layout prepare_wna16 builds, told from shapes alone (meta tensors), as engines ask it."""

from __future__ import annotations

import pytest
import torch

import quantkit.kernels as qk
from quantkit.kernels.wna16_layout import check_wna16_weight

from .wna16_cases import Scheme, random_weight

# PyTorch's CPU kernels: the "torch" backend's fallback (quantkit's C++ kernel: test_wna16_cpu_q8.py).
pytestmark = pytest.mark.usefixtures("aten_cpu_path")

CASES = [  # (scheme, N, K, backend, layout)
    (Scheme(8, None, True), 96, 128, "torch", "cpu_int8"),
    (Scheme(8, None, False), 96, 128, "torch", "cpu_int8"),
    (Scheme(8, 64, True), 96, 128, "torch", "cpu_int4"),
    (Scheme(4, 128, False), 96, 256, "torch", "cpu_int4"),
    (Scheme(4, None, True), 96, 128, "torch", "cpu_int4"),
    (Scheme(4, 64, True), 40, 128, "torch", "reference"),  # N % 16 != 0
    (Scheme(4, 16, True), 96, 128, "torch", "reference"),  # groups the CPU int4 kernel cannot take
    (Scheme(2, 64, True), 96, 128, "torch", "reference"),
    (Scheme(4, 64, False), 96, 128, "reference", "reference"),
    (Scheme(4, 64, True), 96, 128, "triton", "triton"),
    (Scheme(8, None, False), 40, 200, "triton", "triton"),
]


def _meta_shape(weight):
    def meta(t):
        return None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta")

    return check_wna16_weight(meta(weight.weight_packed), meta(weight.weight_scale), meta(weight.weight_zero_point),
                              weight.bits, weight.in_features)


@pytest.mark.parametrize("scheme, n, k, backend, layout", CASES, ids=lambda c: getattr(c, "id", str(c)))
def test_planned_layout_is_the_layout_prepare_builds(scheme, n, k, backend, layout):
    weight = random_weight(scheme, n, k, torch.bfloat16, torch.Generator().manual_seed(n + k))
    assert qk.planned_layout(_meta_shape(weight), backend) == layout
    prepared = qk.prepare_wna16(weight.weight_packed, weight.weight_scale, weight.weight_zero_point,
                                bits=weight.bits, in_features=k, backend=backend)
    assert qk.prepared_layout(prepared) == layout


def test_planned_layout_refuses_what_the_triton_layout_cannot_hold():
    weight = random_weight(Scheme(4, 4, True), 32, 64, torch.bfloat16, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="multiple of 8"):
        qk.planned_layout(_meta_shape(weight), "triton")
    with pytest.raises(ValueError, match="multiple of 8"):
        qk.prepare_wna16(weight.weight_packed, weight.weight_scale, None, bits=4, in_features=64, backend="triton")
