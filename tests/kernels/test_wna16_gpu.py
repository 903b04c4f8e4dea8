"""Triton WNA16 kernels on a real CUDA device (skipped without one): real decode/prefill shapes, every
algorithm the rules pick, NaN-poisoned buffers, and CUDA-graph capture of the op.

The interpreter tests (test_wna16_triton.py) cover every scheme on small shapes; these check what
the interpreter cannot: the compiled kernels, the real launch configurations (split-K over many
programs, 16-byte loads, divisibility specializations) and graph replay.
"""

from __future__ import annotations

import pytest
import torch

import quantkit.kernels as qk

from .wna16_cases import Scheme, random_weight, reference_output, rel_mean_error, tolerance

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPES = [(4096, 4096), (4096, 6144), (14336, 4096)]  # K x N
MS = (1, 2, 3, 4, 8, 16, 33, 64, 200, 2048)


@pytest.fixture
def gen():
    g = torch.Generator()
    g.seed()
    return g


def _prepare(weight):
    prep = qk.prepare_wna16(weight.weight_packed, weight.weight_scale, weight.weight_zero_point,
                            bits=weight.bits, in_features=weight.in_features, backend="triton")
    return {k: v.cuda() for k, v in prep.items()}


@pytest.mark.parametrize("scheme", [Scheme(4, 128, True), Scheme(4, 32, False), Scheme(8, None, True),
                                    Scheme(8, 128, False)], ids=lambda s: s.id)
@pytest.mark.parametrize("k,n", SHAPES, ids=lambda v: str(v))
def test_real_shapes_every_m(scheme, k, n, gen):
    dtype = torch.bfloat16
    weight = random_weight(scheme, n, k, dtype, gen)
    prep = _prepare(weight)
    for m in MS:
        x = torch.randn(m, k, generator=gen).to(dtype)
        cfg = qk.choose_config(m, n, k, scheme.bits, torch.cuda.get_device_properties(0).multi_processor_count)
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        y = qk.wna16_gemm_triton(x.cuda(), prep["triton_qweight"], prep["triton_scales"], prep.get("triton_zeros"),
                                 None, scheme.bits, out=out)
        err = rel_mean_error(y.cpu(), reference_output(x, weight))
        assert err <= tolerance(dtype), f"seed={gen.initial_seed()} M={m} {cfg}: relative mean error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_every_algorithm_on_device(dtype, gen):
    scheme, k, n = Scheme(4, 64, False), 1024, 1000  # ragged N
    weight = random_weight(scheme, n, k, dtype, gen)
    prep = _prepare(weight)
    configs = [qk.WNA16Config("gemv", 1, 512, 7, num_warps=2, num_stages=1),
               qk.WNA16Config("gemv", 4, 256, 2, num_warps=2, num_stages=1),
               qk.WNA16Config("dot", 16, 128, 4), qk.WNA16Config("dot", 128, 128, 1, num_warps=8),
               qk.WNA16Config("dequant", 1, 64)]
    for cfg in configs:
        m = min(cfg.block_m, 4) if cfg.algo == "gemv" else 37
        x = torch.randn(m, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype)
        y = qk.wna16_gemm_triton(x.cuda(), prep["triton_qweight"], prep["triton_scales"], prep["triton_zeros"],
                                 bias.cuda(), 4, config=cfg)
        err = rel_mean_error(y.cpu(), reference_output(x, weight, bias))
        assert err <= tolerance(dtype), f"seed={gen.initial_seed()} {cfg}: relative mean error {err:.2e}"


def test_cuda_graph_replay_matches_eager(gen):
    """Every decode M captured in one CUDA graph (after a warm-up run compiles the kernels) replays to the
    same outputs as eager calls on new inputs."""
    scheme, k, n, dtype = Scheme(4, 128, True), 4096, 4096, torch.bfloat16
    weight = random_weight(scheme, n, k, dtype, gen)
    prep = _prepare(weight)
    xs = [torch.randn(m, k, generator=gen).to(dtype).cuda() for m in (1, 2, 4, 8, 16)]

    def step():
        return [qk.wna16_linear(x, prep, bits=4, in_features=k, out_features=n, backend="triton") for x in xs]

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for x in xs:
        x.copy_(torch.randn(x.shape, generator=gen).to(dtype))
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(xs, outs):
        ref = reference_output(x.cpu(), weight)
        assert rel_mean_error(y.cpu(), ref) <= tolerance(dtype)


def test_torch_compile_fullgraph_on_device(gen):
    scheme, k, n, dtype = Scheme(4, 128, True), 4096, 4096, torch.bfloat16
    weight = random_weight(scheme, n, k, dtype, gen)
    prep = _prepare(weight)

    def f(x):
        return qk.wna16_linear(x, prep, bits=4, in_features=k, out_features=n, backend="triton") * 2

    compiled = torch.compile(f, fullgraph=True)
    x = torch.randn(1, k, generator=gen).to(dtype)
    y = compiled(x.cuda())
    assert rel_mean_error(y.cpu(), 2 * reference_output(x, weight)) <= tolerance(dtype)
