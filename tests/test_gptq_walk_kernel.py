"""The C++ GPTQ column walk (kernels/csrc/gptq_walk.cpp) against its pure-PyTorch reference: bit for bit, on the
integer grids, the GGUF grids with an offset or a float minimum, and the non-uniform IQ4 grids (nearest of 16
values, ties included)."""

from __future__ import annotations

import pytest
import torch

from quantkit.algorithms import gptq
from quantkit.core.scheme import QuantScheme
from quantkit.gguf import grids
from quantkit.kernels import cpu_extension

pytestmark = pytest.mark.skipif(not cpu_extension.load_cpu_kernels().available,
                                reason="the C++ CPU kernels are unavailable here")

W4_G128 = QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=128)
W4_G32_ASYM = QuantScheme(num_bits=4, symmetric=False, strategy="group", group_size=32)
W8_CHANNEL = QuantScheme(num_bits=8, symmetric=True, strategy="channel")
Q4_K = QuantScheme(num_bits=4, symmetric=False, strategy="group", group_size=32, grid="q4_k")
Q6_K = QuantScheme(num_bits=6, symmetric=True, strategy="group", group_size=16, grid="q6_k")
Q4_0 = QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=32, grid="q4_0")
IQ4_NL = QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=32, grid="iq4_nl")
IQ4_XS = QuantScheme(num_bits=4, symmetric=True, strategy="group", group_size=32, grid="iq4_xs")


def _block(rows: int, n: int, groups: int, seed: int, zero: bool, grid: bool):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, n, generator=g) * 0.05  # [B, N]
    a = torch.randn(rows, rows, generator=g) / rows**0.5
    u = torch.linalg.cholesky(a @ a.T + torch.eye(rows), upper=True)  # [B, B] upper, positive diagonal
    scale = torch.rand(groups, n, generator=g) * 0.02 + 0.002  # [G, N]
    if grid:
        scale[0, : n // 4] = 0.0  # a group whose scale is 0 takes level 0
    zeros = torch.randint(0, 16, (groups, n), generator=g).float() if zero else None
    minimum = torch.rand(groups, n, generator=g) * 0.1 if grid else None
    group = torch.randint(0, groups, (rows,), generator=g)
    return w, u, scale, zeros, minimum, group


@pytest.mark.parametrize("scheme", [W4_G128, W4_G32_ASYM, Q4_K, Q6_K, Q4_0, IQ4_NL, IQ4_XS],
                         ids=lambda s: f"{s.grid}-{s.num_bits}")
@pytest.mark.parametrize("rows,n,start,stop", [(128, 300, 0, 128), (64, 1000, 16, 48), (17, 5, 0, 17), (128, 513, 96, 128)])
def test_kernel_walks_bit_for_bit_as_the_reference(scheme, rows, n, start, stop):
    grid = grids.GRID_WEIGHTS.get(scheme.grid)
    w, u, scale, zeros, minimum, group = _block(rows, n, 3, rows * n + start, not scheme.symmetric and grid is None,
                                                grid is not None)
    if grid is not None and grid.VALUES is not None:  # the non-uniform grids: scales of either sign, no minimum
        scale = scale * torch.where(torch.arange(n) % 3 == 1, -1.0, 1.0)
        minimum = torch.zeros_like(minimum)
        w[: rows // 2, : n // 2] = (torch.randint(-130, 130, (rows // 2, n // 2)) + 0.5) * scale[0, : n // 2]  # ties
    walks = {}
    for name in ("kernel", "reference"):
        w1, q1, err1 = w.clone(), torch.full_like(w, 1000.0), torch.full_like(w, 1000.0)
        if name == "kernel":
            walk = gptq._column_walk(scheme, grid, scale, zeros, minimum, group)
            assert walk.__name__ == "kernel"
            walk(w1, u, q1, err1, 0, start, stop)
        else:
            gptq._walk_columns_reference(w1, u, q1, err1, scheme, grid, scale, zeros, minimum, group.tolist(), start,
                                         stop)
        walks[name] = (w1, q1, err1)
    for got, expected in zip(walks["kernel"], walks["reference"]):
        assert torch.equal(got, expected)
    if stop < rows:
        assert not torch.equal(walks["kernel"][0][stop:], w[stop:])  # the later columns took the errors
    assert (walks["kernel"][1][start:stop] != 1000.0).all() and (walks["kernel"][1][stop:] == 1000.0).all()


@pytest.mark.parametrize("scheme,options", [
    (W4_G128, gptq.GPTQOptions()),
    (W4_G32_ASYM, gptq.GPTQOptions(act_order=False)),  # each group's scale from its updated columns, mid-block
    (W8_CHANNEL, gptq.GPTQOptions(observer="mse")),
    (Q4_K, gptq.GPTQOptions()),
    (Q6_K, gptq.GPTQOptions(act_order=False)),
    (IQ4_NL, gptq.GPTQOptions(observer="mse")),
    (IQ4_XS, gptq.GPTQOptions(act_order=False)),
], ids=["w4g128", "w4g32-asym-no-act-order", "w8-channel-mse", "q4_k", "q6_k", "iq4_nl-mse", "iq4_xs"])
def test_gptq_gives_the_same_levels_with_and_without_the_kernel(scheme, options, monkeypatch):
    g = torch.Generator().manual_seed(11)
    k = 512
    x = torch.randn(4, 256, k, generator=g) * torch.rand(k, generator=g).pow(2)
    h = gptq.hessian_of(x)
    w = torch.randn(200, k, generator=g) * 0.03
    with_kernel = gptq.gptq_quantize(w, h, scheme, options)
    monkeypatch.setattr(cpu_extension, "load_cpu_kernels", lambda: cpu_extension.CpuKernels(False, "off"))
    without = gptq.gptq_quantize(w, h, scheme, options)
    fields = [(k_, v) for k_, v in vars(with_kernel).items() if isinstance(v, torch.Tensor)]
    assert fields
    for key, value in fields:
        assert torch.equal(value, getattr(without, key)), key


def test_kernel_refuses_mismatched_shapes():
    w, u, scale, _, _, group = _block(8, 16, 2, 0, False, False)
    with pytest.raises(RuntimeError, match="q and err must be contiguous fp32"):
        torch.ops.quantkit.gptq_walk(w, u, torch.empty(8, 15), torch.empty(8, 16), scale, None, None, group, 0, 8, 0,
                                     -8.0, 7.0, 0.0)
    with pytest.raises(RuntimeError, match="a non-uniform grid needs values"):
        torch.ops.quantkit.gptq_walk(w, u, torch.empty(8, 16), torch.empty(8, 16), scale, None, torch.zeros_like(scale),
                                     group, 0, 8, 4, 0.0, 15.0, 0.0)
    with pytest.raises(RuntimeError, match="values must ascend"):
        torch.ops.quantkit.gptq_walk(w, u, torch.empty(8, 16), torch.empty(8, 16), scale, None, torch.zeros_like(scale),
                                     group, 0, 8, 4, 0.0, 15.0, 0.0, torch.tensor([1.0, 0.0]))
    with pytest.raises(RuntimeError, match="a zero point needs zero"):
        torch.ops.quantkit.gptq_walk(w, u, torch.empty(8, 16), torch.empty(8, 16), scale, None, None, group, 0, 8, 1,
                                     0.0, 15.0, 0.0)
