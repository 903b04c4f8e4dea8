"""Fused q/k/v and gate/up projections (modules/fused_linear.py): the same outputs as the separate layers.

The fused linear runs each output row exactly as the part it came from (same weights, same activation
rows), so logits and greedy tokens are equal bit for bit on the CPU backend; a save writes the checkpoint back.
"""

from __future__ import annotations

import pytest
import torch

import quantkit
from quantkit.modules.fused_linear import FusedLinearGroup, FusedPart, fuse_projections, is_fused
from quantkit.modules.quant_linear import QuantLinear


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = quantkit.load("ref:tiny")
    quantkit.quantize(model, "w4a16-rtn-asym", progress=False)
    out = tmp_path_factory.mktemp("fused") / "w4"
    quantkit.save(model, out)
    return out


def test_load_fuses_on_the_cpu_backend_and_matches_the_separate_layers(checkpoint):
    separate = quantkit.load(checkpoint, fuse=False)
    fused = quantkit.load(checkpoint)
    assert not is_fused(separate) and is_fused(fused)
    layer = fused.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, FusedPart) and isinstance(layer.mlp.up_proj, FusedPart)
    assert isinstance(layer.self_attn.qkv_proj_fused, FusedLinearGroup)
    assert isinstance(layer.self_attn.o_proj, QuantLinear) and isinstance(layer.mlp.down_proj, QuantLinear)
    ids = torch.randint(0, separate.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(separate(ids).logits, fused(ids).logits)
    with torch.inference_mode():
        a = separate.generate(ids[:1], max_new_tokens=6, do_sample=False)
        b = fused.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)
    again = quantkit.save(fused, checkpoint.parent / "again")  # the parts' tensors, split back from the fused ones
    from safetensors.torch import load_file

    before, after = load_file(checkpoint / "model.safetensors"), load_file(again / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_part_called_alone_or_with_another_input_recomputes(checkpoint):
    separate = quantkit.load(checkpoint, fuse=False)
    fused = quantkit.load(checkpoint)
    attn_s, attn_f = separate.model.layers[1].self_attn, fused.model.layers[1].self_attn
    x, y = torch.randn(1, 3, 128), torch.randn(1, 3, 128)
    assert torch.equal(attn_f.k_proj(x), attn_s.k_proj(x))  # first call: k only
    assert torch.equal(attn_f.k_proj(y), attn_s.k_proj(y))  # another input: recomputed
    assert torch.equal(attn_f.q_proj(x), attn_s.q_proj(x))
    x.add_(1.0)  # the same tensor changed in place: its version moved on, so v is recomputed
    assert torch.equal(attn_f.v_proj(x), attn_s.v_proj(x))


def test_fusion_skips_parts_with_different_schemes():
    from quantkit.core.quantized_weight import QuantizedWeight
    from quantkit.core.scheme import QuantScheme

    def layer(bits):
        scheme = QuantScheme(num_bits=bits, symmetric=True, strategy="channel")
        q = torch.randint(-8, 8, (32, 64), dtype=torch.int8)
        return QuantLinear.from_weight(QuantizedWeight(q, torch.rand(32, 1) + 0.1, None, scheme))

    parent = torch.nn.Module()
    parent.gate_proj, parent.up_proj = layer(4), layer(8)
    assert fuse_projections(parent) == 0 and isinstance(parent.gate_proj, QuantLinear)


def test_compiled_parts_run_their_own_rows(checkpoint):
    fused = quantkit.load(checkpoint)
    group = fused.model.layers[0].self_attn.qkv_proj_fused
    x = torch.randn(1, 2, 128)
    whole = group.fused(x)
    start = group.sizes[0]
    assert torch.equal(group.fused.forward_rows(x, start, start + group.sizes[1]), whole[..., start:start + group.sizes[1]])
    ids = torch.randint(0, fused.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = fused(ids).logits
        compiled = torch.compile(fused, backend="aot_eager")(ids).logits
    assert torch.allclose(compiled, eager, rtol=1e-5, atol=1e-5)
