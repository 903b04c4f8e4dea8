"""The grouped weight-only MoE op against its pure-torch reference, and the reference against the
definition (each token through its top-k experts' dequantized gated MLPs, one token at a time): over
expert counts, top-k, token counts (0 tokens, experts that get no token), bits, symmetric or not, and
the CPU backends."""

from __future__ import annotations

import pytest
import torch

from quantkit import kernels
from quantkit.algorithms import rtn_quantize
from quantkit.kernels.cpu_extension import load_cpu_kernels
from quantkit.kernels import MoEExpertWeights, StackedWNA16, wna16_moe, wna16_moe_reference
from quantkit.modules.quant_linear import QuantLinear
from quantkit.core.scheme import QuantScheme

H, I = 128, 96  # I = 96: groups of 32 only (a ragged-free, non-power-of-two width)


def _experts(num_experts: int, bits: int, symmetric: bool, seed: int, group: int = 32):
    g = torch.Generator().manual_seed(seed)
    scheme = QuantScheme(num_bits=bits, type="int", symmetric=symmetric, strategy="group", group_size=group)
    experts = []
    for _ in range(num_experts):
        layers = []
        for n, k in ((I, H), (I, H), (H, I)):
            w = torch.randn(n, k, generator=g) * 0.1
            layers.append(QuantLinear.from_weight(rtn_quantize(w, scheme)))
        experts.append(layers)
    return experts, scheme


def _stacked(experts, which: int, bits: int, k: int, group: int) -> StackedWNA16:
    layers = [ex[which] for ex in experts]
    zp = None if layers[0].weight_zero_point is None else torch.stack([l.weight_zero_point for l in layers])
    return StackedWNA16(torch.stack([l.weight_packed for l in layers]), torch.stack([l.weight_scale for l in layers]),
                        zp, bits, k, group)


def _routing(tokens: int, num_experts: int, top_k: int, seed: int, skip_last: bool):
    """top_k distinct experts per token; with skip_last, expert E-1 never gets a token."""
    g = torch.Generator().manual_seed(seed)
    pool = num_experts - 1 if skip_last and num_experts > top_k else num_experts
    idx = torch.stack([torch.randperm(pool, generator=g)[:top_k] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, top_k, dtype=torch.int64)
    w = torch.rand(tokens, top_k, generator=g)
    return idx, w / w.sum(-1, keepdim=True).clamp(min=1e-6)


def _definition(x, idx, w, experts):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(idx.shape[1]):
            gate, up, down = (l.dequantized_weight().double() for l in experts[int(idx[t, s])])
            h = x[t].double()
            out[t] += w[t, s].double() * (down @ (torch.nn.functional.silu(gate @ h) * (up @ h)))
    return out


CASES = [(1, 1, 3), (4, 2, 0), (4, 2, 1), (8, 2, 5), (8, 3, 40), (6, 1, 17)]


@pytest.mark.parametrize("num_experts,top_k,tokens", CASES)
@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True)])
def test_reference_matches_definition_and_op(num_experts, top_k, tokens, bits, symmetric):
    experts, _ = _experts(num_experts, bits, symmetric, seed=num_experts * 10 + tokens)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    idx, w = _routing(tokens, num_experts, top_k, seed=tokens + 1, skip_last=True)
    gate, up, down = (_stacked(experts, j, bits, k, 32) for j, k in ((0, H), (1, H), (2, I)))
    ref = wna16_moe_reference(x, idx, w, gate, up, down)
    assert ref.shape == x.shape and ref.dtype == x.dtype
    torch.testing.assert_close(ref.double(), _definition(x, idx, w, experts), rtol=1e-4, atol=1e-5)
    op = torch.ops.quantkit.wna16_moe_ref(x, idx, w, gate.packed, gate.scale, gate.zero_point, up.packed, up.scale,
                                          up.zero_point, down.packed, down.scale, down.zero_point, bits, 32)
    torch.testing.assert_close(op, ref, rtol=0, atol=0)

    prepared = [MoEExpertWeights.from_layers(*ex) for ex in experts]  # reference backend layers
    torch.testing.assert_close(wna16_moe(x, idx, w, prepared), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_experts,top_k,tokens", CASES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["q8dot", "aten"])
def test_cpu_kernels_match_reference(num_experts, top_k, tokens, bits, dtype, path, request):
    """Both CPU paths of the "torch" backend: quantkit's int8-activation kernel (where it builds) and
    PyTorch's kernels (its fallback)."""
    if path == "aten":
        request.getfixturevalue("aten_cpu_path")
    elif not load_cpu_kernels().available:
        pytest.skip(load_cpu_kernels().reason)
    experts, _ = _experts(num_experts, bits, True, seed=7 + tokens)
    for ex in experts:
        for layer in ex:
            assert layer.prepare("torch") == "torch"
            assert kernels.prepared_layout(layer.kernel_inputs()[0]) == ("cpu_q8" if path == "q8dot" else "cpu_int4")
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens + 3)).to(dtype)
    idx, w = _routing(tokens, num_experts, top_k, seed=tokens + 5, skip_last=False)
    gate, up, down = (_stacked(experts, j, bits, k, 32) for j, k in ((0, H), (1, H), (2, I)))
    ref = wna16_moe_reference(x.float(), idx, w, gate, up, down)
    got = wna16_moe(x, idx, w.to(dtype), [MoEExpertWeights.from_layers(*ex) for ex in experts])
    assert got.dtype == dtype and got.shape == x.shape
    if tokens:
        err = (got.float() - ref).abs().mean() / ref.abs().mean()
        assert err < 2 ** -6, err  # aten: bf16 compute; q8dot: activations rounded to int8 per block of 32


def test_skips_out_of_range_experts():
    """Entries >= E (transformers' expert-parallel padding) contribute nothing, in both paths."""
    experts, _ = _experts(3, 4, True, seed=1)
    x = torch.randn(4, H)
    idx = torch.tensor([[0, 3], [3, 3], [1, 2], [2, 0]])
    w = torch.rand(4, 2)
    gate, up, down = (_stacked(experts, j, 4, k, 32) for j, k in ((0, H), (1, H), (2, I)))
    ref = wna16_moe_reference(x, idx, w, gate, up, down)
    assert torch.equal(ref[1], torch.zeros(H))
    torch.testing.assert_close(wna16_moe(x, idx, w, [MoEExpertWeights.from_layers(*ex) for ex in experts]), ref,
                               rtol=1e-5, atol=1e-6)


def test_opcheck():
    experts, _ = _experts(4, 4, False, seed=2)
    x = torch.randn(6, H)
    idx, w = _routing(6, 4, 2, seed=3, skip_last=True)
    gate, up, down = (_stacked(experts, j, 4, k, 32) for j, k in ((0, H), (1, H), (2, I)))
    args = (x, idx, w, gate.packed, gate.scale, gate.zero_point, up.packed, up.scale, up.zero_point,
            down.packed, down.scale, down.zero_point, 4, 32)
    torch.library.opcheck(torch.ops.quantkit.wna16_moe_ref.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
