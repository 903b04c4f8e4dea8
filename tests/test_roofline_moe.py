"""The roofline on mixture-of-experts models: shapes from each family's config (parameter count equal to
the model's), and decode steps that read only the experts the batch's tokens reach."""

from __future__ import annotations

import pytest

from quantkit.harness.roofline import (
    ModelShape, decode_cost, decoder_weight_bytes, linear_weight_bytes, moe_roofline_note, prefill_cost,
    standard_schemes, weight_memory_bytes,
)
from fixtures.moe_fixtures import MOE_FAMILIES, make_moe_model


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_shape_counts_every_parameter(family):
    model = make_moe_model(family)
    shape = ModelShape.from_config(model.config)
    assert shape.is_moe and shape.experts == 8 and shape.experts_per_token == 2 and shape.expert_intermediate == 128
    assert shape.shared_intermediate == (256 if family == "qwen2_moe" else 0)
    norms_extra = sum(p.numel() for n, p in model.named_parameters()  # not modelled: q/k norms, biases
                      if "q_norm" in n or "k_norm" in n or n.endswith(".bias"))
    assert shape.params + norms_extra == sum(p.numel() for p in model.parameters())


def test_decode_reads_the_routed_experts_only():
    shape = ModelShape.from_config(make_moe_model("qwen3_moe").config)
    for scheme in standard_schemes(2):
        expert = sum(linear_weight_bytes(i, o, scheme) for _, i, o in shape.expert_linears())
        one = decode_cost(shape, scheme, 100, batch=1).bytes["weights"]
        all_experts = decoder_weight_bytes(shape, scheme)
        assert all_experts - one == pytest.approx(shape.layers * (8 - 2) * expert)
        reads = [decode_cost(shape, scheme, 100, batch=b).bytes["weights"] for b in (1, 2, 4, 16, 256)]
        assert reads == sorted(reads) and reads[-1] == pytest.approx(all_experts, rel=1e-6)
        assert prefill_cost(shape, scheme, 512).bytes["weights"] == pytest.approx(all_experts, rel=1e-6)
        assert weight_memory_bytes(shape, scheme) > all_experts  # every expert stays resident
    assert shape.experts_read(1) == 2 and shape.experts_read(2) == pytest.approx(8 * (1 - (6 / 8) ** 2))
    assert "top-2" in moe_roofline_note(shape)


def test_qwen3_30b_a3b_active_parameters():
    """Published: 30.5B parameters, 3.3B active (checks the counting on a real config's numbers)."""
    shape = ModelShape.from_config(dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        vocab_size=151936))
    assert shape.params / 1e9 == pytest.approx(30.5, abs=0.1)
    active = shape.active_linear_params + 2 * shape.vocab * shape.hidden
    assert active / 1e9 == pytest.approx(3.3, abs=0.1)


def test_dense_shapes_unchanged():
    shape = ModelShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=100)
    assert not shape.is_moe and shape.experts_read(4) == 0
    assert [n for n, _, _ in shape.linears()][-3:] == ["gate_proj", "up_proj", "down_proj"]
