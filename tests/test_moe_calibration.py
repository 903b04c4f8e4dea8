"""GPTQ and AWQ on mixture-of-experts models: per-expert statistics (from every calibration token by
default, or from the tokens routed to each expert), the block output from the real routing, experts no
token reaches, routed-token counts in the summary and recipe.yaml."""

from __future__ import annotations

import warnings

import pytest
import torch

import quantkit
from quantkit.quantization import provenance
from quantkit.calibration import gptq_processor
from quantkit.modules.quant_experts import QuantExperts
from fixtures.moe_fixtures import MOE_FAMILIES, make_moe_model

CALIB = torch.randint(3, 512, (8, 64), generator=torch.Generator().manual_seed(0))
HELD_OUT = torch.randint(3, 512, (4, 64), generator=torch.Generator().manual_seed(1))


def _error(model, float_logits) -> float:
    with torch.no_grad():
        return (model(HELD_OUT).logits - float_logits).pow(2).mean().item()


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("recipe", ["w4a16-gptq", "w4a16-awq"])
def test_calibrated_recipes_quantize_experts_better_than_rtn(family, recipe, tmp_path):
    model = make_moe_model(family)
    with torch.no_grad():
        want = model(HELD_OUT).logits
    quantkit.quantize(model, recipe, CALIB, progress=False)
    assert all(m.quantized for m in model.modules() if isinstance(m, QuantExperts))
    rtn = make_moe_model(family)
    quantkit.quantize(rtn, "w4a16-rtn", progress=False)
    assert _error(model, want) < _error(rtn, want)
    routing = provenance.of(model).moe_routing
    assert routing["experts"] == 16 and routing["least"] <= routing["median"] <= routing["most"]
    assert sum(int(m.routed_tokens.sum()) for m in model.modules() if isinstance(m, QuantExperts)) == 2 * 8 * 64 * 2
    out = quantkit.save(model, tmp_path / "q")
    assert "calibration tokens routed per expert: least" in (out / "recipe.yaml").read_text()
    loaded = quantkit.load(out, backend="reference")
    torch.testing.assert_close(loaded(HELD_OUT).logits, model(HELD_OUT).logits, rtol=0, atol=0)


def _starve(model, layer: int, expert: int) -> None:
    """Make `layer`'s router never pick `expert` (top-2): its logit is 0, while rows 0/1 and 2/3 are
    negatives of each other, so two experts always score above 0."""
    with torch.no_grad():
        w = model.model.layers[layer].mlp.gate.weight
        w[1], w[3], w[expert] = -w[0], -w[2], 0.0


def _hessians(monkeypatch):
    """linear name -> the Hessian its GPTQ call was factored from."""
    seen, current = {}, []
    real, real_factor = gptq_processor.gptq_quantize, gptq_processor.factor_hessian

    def spy_factor(h, *args, **kw):
        current[:] = [h.clone()]
        return real_factor(h, *args, **kw)

    def spy(weight, factor, scheme, options, **kw):
        seen[kw["name"]] = current[0]
        return real(weight, factor, scheme, options, **kw)

    monkeypatch.setattr(gptq_processor, "factor_hessian", spy_factor)
    monkeypatch.setattr(gptq_processor, "gptq_quantize", spy)
    return seen


def test_routed_only_statistics_and_rtn_fallback(monkeypatch):
    seen = _hessians(monkeypatch)
    model = make_moe_model("qwen3_moe")
    recipe = quantkit.load_recipe("w4a16-gptq").to_dict()
    recipe["algorithm"]["moe_calibrate_all_experts"] = False
    _starve(model, 0, 7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantkit.quantize(model, recipe, CALIB, progress=False)
    msgs = " ".join(str(w.message) for w in caught)
    assert "model.layers.0.mlp.experts.7.gate_proj" in msgs and "RTN" in msgs
    routing = provenance.of(model).moe_routing
    assert "model.layers.0.mlp.experts.7" in routing["never_routed"]
    starved_layer = model.model.layers[0].mlp.experts
    assert int(starved_layer.routed_tokens[7]) == 0
    scales = starved_layer.experts()[7].gate_proj.weight_scale
    assert torch.isfinite(scales).all() and (scales > 0).all()
    assert "model.layers.0.mlp.experts.7.gate_proj" not in seen  # RTN, not GPTQ with an empty H
    h = [seen[f"model.layers.0.mlp.experts.{e}.gate_proj"] for e in range(7)]
    assert not torch.equal(h[0], h[1])  # each expert its own routed tokens
    for e in range(7):  # gate and up read the same rows: one Hessian
        assert torch.equal(seen[f"model.layers.0.mlp.experts.{e}.gate_proj"],
                           seen[f"model.layers.0.mlp.experts.{e}.up_proj"])


def test_all_tokens_statistics_by_default(monkeypatch):
    seen = _hessians(monkeypatch)
    model = make_moe_model("olmoe")
    _starve(model, 1, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantkit.quantize(model, "w4a16-gptq", CALIB, progress=False)
    assert not any("RTN" in str(w.message) and "expert" in str(w.message) for w in caught)
    h = [seen[f"model.layers.1.mlp.experts.{e}.gate_proj"] for e in range(8)]
    for e in range(1, 8):  # every expert saw every token: the same Hessian, the never-routed one included
        assert torch.equal(h[0], h[e])
    assert "model.layers.1.mlp.experts.5" in provenance.of(model).moe_routing["never_routed"]
    # down_proj inputs differ per expert (each expert's own activations)
    assert not torch.equal(seen["model.layers.1.mlp.experts.0.down_proj"], seen["model.layers.1.mlp.experts.1.down_proj"])


def test_kv_fp8_recipe_on_moe(tmp_path):
    model = make_moe_model("mixtral")
    quantkit.quantize(model, "w4a16-gptq-kv-fp8", CALIB, progress=False)
    out = quantkit.save(model, tmp_path / "q")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.layers.0.self_attn.k_scale", "model.layers.1.self_attn.v_scale"} <= names
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight_packed" in names
    loaded = quantkit.load(out)
    assert loaded.generate(HELD_OUT[:1, :8], max_new_tokens=4, do_sample=False, pad_token_id=0).shape == (1, 12)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_awq_fold_into_the_moe_input_keeps_the_float_function(family):
    """AWQ's scales for the MoE block's input fold into post_attention_layernorm: every expert's (and the
    shared expert's) gate/up columns and the routers' weight columns are scaled, so the float model
    computes what it did (routing included); without the routers the routing would change."""
    from quantkit.calibration.adapters import moe_groups
    from quantkit.calibration.awq_processor import fold_scales
    from quantkit.modules.moe import unfuse_experts

    model = make_moe_model(family)
    unfuse_experts(model)
    with torch.no_grad():
        want = model(HELD_OUT).logits
        for layer in model.model.layers:
            group = moe_groups(layer)[0]
            assert group.prev == "post_attention_layernorm" and group.also_scale
            s = torch.rand(256, generator=torch.Generator().manual_seed(3)) + 0.5
            fold_scales(layer.get_submodule(group.prev),
                        [layer.get_submodule(n) for n in group.linears + group.also_scale], s)
        torch.testing.assert_close(model(HELD_OUT).logits, want, rtol=1e-4, atol=1e-4)
