"""Linears whose in_features the recipe's group size does not divide (576 and 960, SmolLM2's widths):
the recipe's `indivisible` rule (smaller-group by default, channel, ragged, error) picks each layer's
scheme, quantize says which layers got what, the checkpoint records one config group per scheme, and
quantkit (every backend) and inspect read it back."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

import quantkit
from quantkit.core.config_utils import ConfigError
from quantkit.modules import QuantLinear
from quantkit.core.scheme import QuantScheme

G128 = QuantScheme(num_bits=4, strategy="group", group_size=128)


def _model(hidden: int, intermediate: int, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
                                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 192,
                                      vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).eval()


# (hidden, intermediate): SmolLM2-135M's 576 / 1536 (down_proj's 1536 divides) and SmolLM2-360M's 960 / 2560
WIDTHS = [(576, 1536), (960, 2560)]


@pytest.mark.parametrize("k,rule,expected", [
    (576, "smaller-group", ("group", 64)), (960, "smaller-group", ("group", 64)), (1000, "smaller-group", ("channel", None)),
    (576, "channel", ("channel", None)), (576, "ragged", ("group", 128)), (1536, "error", ("group", 128)),
    (1536, "channel", ("group", 128)),  # a group that divides is kept whatever the rule
])
def test_fitted_scheme(k, rule, expected):
    fitted = G128.fitted(k, rule)
    assert (fitted.strategy, fitted.group_size) == expected
    assert fitted.groups_for(k) == (1 if fitted.strategy == "channel" else -(-k // fitted.group_size))


def test_error_rule_names_the_ways_out():
    with pytest.raises(ValueError, match="does not divide in_features 576.*indivisible"):
        G128.fitted(576, "error")


def test_recipe_reads_and_records_the_rule():
    recipe = quantkit.load_recipe({"weights": {"num_bits": 4, "strategy": "group", "group_size": 128},
                                   "indivisible": "ragged"})
    assert recipe.indivisible == "ragged" and recipe.weights_for(576).group_size == 128
    assert quantkit.load_recipe("w4a16-gptq").indivisible == "smaller-group"
    assert quantkit.load_recipe(recipe.to_dict()).indivisible == "ragged"  # recipe.yaml round trip
    with pytest.raises(ConfigError, match="indivisible must be one of"):
        quantkit.load_recipe({"weights": {"num_bits": 4, "strategy": "channel"}, "indivisible": "pad"})


def _schemes(model) -> dict[str, QuantScheme]:
    return {n.rsplit(".", 1)[-1]: m.scheme for n, m in model.named_modules() if isinstance(m, QuantLinear)}


@pytest.mark.parametrize("rule", ["smaller-group", "channel", "ragged"])
@pytest.mark.parametrize("recipe", ["w4a16-rtn", "w4a16-rtn-asym"])
@pytest.mark.parametrize("hidden,intermediate", WIDTHS)
def test_rtn_rules_round_trip(hidden, intermediate, recipe, rule, tmp_path):
    chosen = dataclasses.replace(quantkit.load_recipe(recipe), indivisible=rule)
    model = _model(hidden, intermediate)
    with pytest.warns(UserWarning, match=f"does not divide in_features {hidden}.*indivisible: {rule}"):
        quantkit.quantize(model, chosen, progress=False)
    schemes = _schemes(model)
    want = {"smaller-group": ("group", 64), "channel": ("channel", None), "ragged": ("group", 128)}[rule]
    for kind in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"):
        assert (schemes[kind].strategy, schemes[kind].group_size) == want, kind
    assert (schemes["down_proj"].strategy, schemes["down_proj"].group_size) == ("group", 128)  # 1536, 2560 divide
    path = quantkit.save(model, tmp_path / "ckpt")
    groups = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]
    assert len(groups) == (1 if rule == "ragged" else 2)
    if rule != "ragged":  # separate config groups name their layers
        down = [g for g in groups.values() if g["weights"]["group_size"] == 128]
        assert len(down) == 1 and down[0]["targets"] == ["model.layers.0.mlp.down_proj"]
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        expected = model(ids).logits
        for backend in ("reference", "torch"):
            loaded = quantkit.load(path, backend=backend, fuse=False)  # fused projections: one scheme per group
            assert _schemes(loaded) == schemes
            got = loaded(ids).logits
            tol = 0 if backend == "reference" else 0.02  # the CPU kernels compute in bf16
            assert ((got - expected).norm() / expected.norm()).item() <= tol + 1e-6, backend


def test_a_divided_width_is_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantkit.quantize(_model(640, 1536), "w4a16-rtn", progress=False)  # 640 = 5 x 128


@pytest.mark.parametrize("rule", ["smaller-group", "ragged"])
@pytest.mark.parametrize("recipe", ["w4a16-gptq", "w4a16-awq-asym"])
def test_calibrated_algorithms_take_each_layers_scheme(recipe, rule, tmp_path):
    """GPTQ and AWQ quantize every layer with its own fitted scheme and beat RTN on the model's output over
    the calibration tokens (what they minimise the error on)."""
    chosen = dataclasses.replace(quantkit.load_recipe(recipe), indivisible=rule)
    rtn = dataclasses.replace(quantkit.load_recipe("w4a16-rtn-asym" if "asym" in recipe else "w4a16-rtn"),
                              indivisible=rule)
    calib = [torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(1))]
    float_model = _model(576, 1536, seed=3)
    ids = calib[0]
    with torch.no_grad():
        reference = float_model(ids).logits
    errors = {}
    for name, r in (("calibrated", chosen), ("rtn", rtn)):
        model = _model(576, 1536, seed=3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantkit.quantize(model, r, calibration_data=calib, progress=False)
        with torch.no_grad():
            errors[name] = (model(ids).logits - reference).norm().item()
        if name == "calibrated":
            schemes = _schemes(model)
            assert schemes["q_proj"].group_size == (64 if rule == "smaller-group" else 128)
            loaded = quantkit.load(quantkit.save(model, tmp_path / "ckpt"), backend="reference")
            with torch.no_grad():
                torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert errors["calibrated"] < errors["rtn"], errors


def test_inspect_marks_ragged_layers(tmp_path, capsys):
    from quantkit.commands.cli import main

    recipe = dataclasses.replace(quantkit.load_recipe("w4a16-rtn"), indivisible="ragged")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = quantkit.quantize(_model(576, 1536), recipe, progress=False)
    path = quantkit.save(model, tmp_path / "ckpt")
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tensors: " in out and "q_proj  [576, 576]" in out
    assert out.count("int4 g128 sym ragged") == 6 and "down_proj     [576, 1536]      int4 g128 sym  " in out
