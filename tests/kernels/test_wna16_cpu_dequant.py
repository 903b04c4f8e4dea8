"""The large-M CPU path (dequantize once + dense matmul) against the reference, on both sides of the switch."""

from __future__ import annotations

import pytest
import torch

import quantkit.kernels as qk
from quantkit.kernels import cpu_flags, cpu_kernel_choice, wna16_cpu_dequant

from .test_wna16_cpu import CPU_SCHEMES, _prepare
from .wna16_cases import random_weight, reference_output, rel_mean_error, tolerance

# PyTorch's CPU kernels: the "torch" backend's fallback (quantkit's C++ kernel: test_wna16_cpu_q8.py).
pytestmark = pytest.mark.usefixtures("aten_cpu_path")

K = 256
BF16_TOL = tolerance(torch.bfloat16)


@pytest.fixture
def gen():
    g = torch.Generator()
    g.seed()
    return g


@pytest.fixture
def poisoned_scratch():
    """Scratch buffers full of NaN, so an element the dequantization forgets to write shows in the output."""
    wna16_cpu_dequant.release_scratch()
    for slot in ("int4", "int4_lo", "int8"):
        for dtype in (torch.float32, torch.bfloat16):
            wna16_cpu_dequant.scratch(slot, 4 * 208 * K, dtype).fill_(float("nan"))
    yield
    wna16_cpu_dequant.release_scratch()


@pytest.fixture
def path_spy(monkeypatch):
    """Counts the calls that took the dequantize-once path."""
    calls = []
    for name in ("int4_linear_dequantized", "int8_linear_dequantized"):
        original = getattr(cpu_kernel_choice, name)

        def spy(*args, _original=original, _name=name):
            calls.append(_name)
            return _original(*args)

        monkeypatch.setattr(cpu_kernel_choice, name, spy)
    return calls


@pytest.mark.parametrize("n", [16, 48, 96, 144, 208])
def test_unpack_reads_the_cpu_int4_layout(n, gen):
    """Full row blocks and every tail length N % 64 in (16, 32, 48) come back as W^T exactly."""
    block_n = wna16_cpu_dequant.int4_block_n()
    assert block_n in (64, 32), "PyTorch's CPU int4 layout changed: the dequantize-once path is off"
    u = torch.randint(0, 16, (n, K), dtype=torch.int32, generator=gen)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
    out = torch.full((K, n), 255, dtype=torch.uint8)
    wna16_cpu_dequant.unpack_int4_to(out, packed, block_n)
    assert torch.equal(out.t().to(torch.int32), u)


ACTIVATIONS = {  # id -> (x dtype, whether the CPU is taken to have native bf16)
    "bf16": (torch.bfloat16, True),
    "bf16-emulated": (torch.bfloat16, False),  # the GEMM runs in fp32
    "fp16": (torch.float16, True),
    "fp32": (torch.float32, True),
}


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("scheme", list(CPU_SCHEMES), ids=lambda s: s.id)
def test_both_sides_of_the_switch_match_the_reference(scheme, activation, gen, poisoned_scratch, path_spy, monkeypatch):
    dtype, native_bf16 = ACTIVATIONS[activation]
    monkeypatch.setattr(cpu_flags, "native_bf16", lambda: native_bf16)
    n = 208  # three full blocks of 64 (six of 32) and a tail of 16
    weight = random_weight(scheme, n, K, dtype, gen)
    prep = _prepare(weight)
    layout = CPU_SCHEMES[scheme]
    threshold = cpu_kernel_choice.DEQUANT_MIN_ROWS[layout]
    bias = torch.randn(n, generator=gen).to(dtype)
    for m, dequantized in ((threshold - 1, False), (threshold, True)):
        calls_before = len(path_spy)
        x = torch.randn(m, K, generator=gen).to(dtype)
        with_bias = bias if m != threshold else None
        y = qk.wna16_linear(x, prep, bits=scheme.bits, in_features=K, out_features=n, backend="torch", bias=with_bias)
        assert (len(path_spy) > calls_before) == dequantized, f"M={m}: wrong path"
        assert y.shape == (m, n) and y.dtype == dtype
        err = rel_mean_error(y, reference_output(x, weight, with_bias))
        assert err <= BF16_TOL, f"seed={gen.initial_seed()} M={m}: relative mean error {err:.2e}"


def test_compute_dtype_rule(monkeypatch):
    monkeypatch.setattr(cpu_flags, "native_bf16", lambda: True)
    assert cpu_flags.compute_dtype(torch.bfloat16) == torch.bfloat16
    assert cpu_flags.compute_dtype(torch.float32) == torch.float32
    assert cpu_flags.compute_dtype(torch.float16) == torch.float32
    monkeypatch.setattr(cpu_flags, "native_bf16", lambda: False)
    assert cpu_flags.compute_dtype(torch.bfloat16) == torch.float32


def test_fp32_activations_keep_fp32_products_on_the_dequantized_path(gen):
    """Only the bf16 scales round: the error is far below the fused kernels', which round x to bf16."""
    weight = random_weight(next(iter(CPU_SCHEMES)), 96, K, torch.float32, gen)
    prep = _prepare(weight)
    m = cpu_kernel_choice.DEQUANT_MIN_ROWS["cpu_int4"]
    x = torch.randn(m, K, generator=gen)
    ref = reference_output(x, weight)
    big = qk.wna16_linear(x, prep, bits=4, in_features=K, out_features=96, backend="torch")
    small = qk.wna16_linear(x[:4], prep, bits=4, in_features=K, out_features=96, backend="torch")
    assert rel_mean_error(big[:4], ref[:4]) < rel_mean_error(small, ref[:4]) <= BF16_TOL
