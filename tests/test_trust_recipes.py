"""Built-in recipes on models without `lm_head` (encoders, classifiers, base models), ignore entries naming a
module that holds linears, the FP8 KV cache on models that do not generate, and impossible MoE configs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from torch import nn

import quantkit
from quantkit.core.errors import CheckpointError, QuantizationError
from quantkit.modules.quant_linear import QuantLinear
from quantkit.quantization.recipe import DEFAULT_IGNORE, builtin_recipes, load_recipe

from fixtures.moe_fixtures import make_moe_model

BERT = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128, vocab_size=100)
LLAMA = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
             intermediate_size=128, vocab_size=100, pad_token_id=0)
WEIGHT_RECIPES = sorted(name for name in builtin_recipes() if load_recipe(name).weights is not None)
#: model class -> (config, its output head: the module a built-in recipe keeps float)
MODELS = {
    "BertModel": (transformers.BertConfig(**BERT), None),
    "BertForMaskedLM": (transformers.BertConfig(**BERT), "cls.predictions.decoder"),
    "BertForSequenceClassification": (transformers.BertConfig(**BERT), "classifier"),
    "LlamaModel": (transformers.LlamaConfig(**LLAMA), None),
    "LlamaForSequenceClassification": (transformers.LlamaConfig(**LLAMA), "score"),
}


def _model(cls_name: str) -> nn.Module:
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(MODELS[cls_name][0]).eval()


def _whisper() -> nn.Module:
    return transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, num_mel_bins=16, max_source_positions=32, max_target_positions=32))


def _float_linears(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if type(m) is nn.Linear]


def test_every_builtin_weight_recipe_keeps_the_default_ignore_list():
    assert len(WEIGHT_RECIPES) >= 26
    assert all(load_recipe(name).ignore == DEFAULT_IGNORE for name in WEIGHT_RECIPES)


@pytest.mark.parametrize("cls_name", sorted(MODELS))
@pytest.mark.parametrize("recipe", WEIGHT_RECIPES)
def test_builtin_recipes_reach_the_linears_of_encoders_and_classifiers(recipe, cls_name):
    model = _model(cls_name)
    r = load_recipe(recipe)
    names, left = r.linears(model)
    head = MODELS[cls_name][1]
    assert left == ([head] if head else [])
    assert names == [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != head]


@pytest.mark.parametrize("cls_name", sorted(MODELS))
def test_quantized_encoder_or_classifier_saves_and_loads_with_its_head_float(cls_name, tmp_path):
    model = _model(cls_name)
    quantkit.quantize(model, "w8a16-rtn", progress=False)
    head = MODELS[cls_name][1]
    assert _float_linears(model) == ([head] if head else [])
    ids = torch.randint(3, 100, (1, 12))
    with torch.no_grad():
        expected = model(input_ids=ids)[0]
    quantkit.save(model, tmp_path / "out")
    loaded = quantkit.load(tmp_path / "out", backend="reference")
    assert type(loaded).__name__ == cls_name
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids)[0], expected, rtol=1e-4, atol=1e-4)


def test_conv_models_with_leave_float_keep_their_output_head_float():
    vit = transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128, image_size=32, patch_size=8))
    with pytest.raises(QuantizationError, match="patch_embeddings.projection.weight"):
        quantkit.quantize(vit, "w4a16-rtn", progress=False)
    quantkit.quantize(vit, "w4a16-rtn", progress=False, leave_float=True)
    assert _float_linears(vit) == ["classifier"]
    whisper = _whisper()
    quantkit.quantize(whisper, "w4a16-rtn", progress=False, leave_float=True)
    assert _float_linears(whisper) == ["proj_out"]  # its output embeddings, as an LM's lm_head


@pytest.mark.parametrize("ignore", [("lm_head",), ("lm_haed",), ("score",)])
def test_a_users_own_ignore_entry_that_matches_nothing_stays_an_error(ignore):
    recipe = dataclasses.replace(load_recipe("w4a16-rtn"), ignore=ignore)
    with pytest.raises(QuantizationError, match=f"ignore entry '{ignore[0]}' matches no module"):
        quantkit.quantize(_model("BertModel"), recipe, progress=False)


def test_a_recipe_without_ignore_gets_the_default_list():
    recipe = quantkit.quantization.recipe.recipe_from_dict(
        {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}})
    assert recipe.ignore == DEFAULT_IGNORE
    model = _model("LlamaForSequenceClassification")
    quantkit.quantize(model, recipe, progress=False)
    assert _float_linears(model) == ["score"]


def test_ignoring_a_module_keeps_every_linear_inside_it_float():
    model = make_moe_model("qwen3_moe", layers=1, experts=4)
    recipe = dataclasses.replace(load_recipe("w4a16-rtn"), ignore=("lm_head", r"re:.*mlp\.experts$"))
    quantkit.quantize(model, recipe, progress=False)  # docs/moe.md's example
    left = _float_linears(model)
    assert left and all(".mlp.experts." in n or n == "lm_head" for n in left)
    assert any(isinstance(m, QuantLinear) for n, m in model.named_modules() if "self_attn" in n)


@pytest.mark.parametrize("cls_name", ["LlamaModel", "LlamaForSequenceClassification"])
def test_fp8_kv_cache_on_a_model_that_does_not_generate_is_refused(cls_name):
    with pytest.raises(QuantizationError, match="FP8 KV cache needs a decoder-only causal LM"):
        quantkit.quantize(_model(cls_name), "kv-fp8", torch.randint(0, 100, (2, 256)), progress=False)


def test_fp8_kv_cache_on_an_encoder_decoder_is_refused():
    whisper = _whisper()
    with pytest.raises(QuantizationError, match="encoder-decoder"):
        quantkit.quantize(whisper, "kv-fp8", torch.randint(0, 100, (2, 256)), progress=False)


@pytest.mark.parametrize("top_k", [9, 0])
def test_impossible_moe_config_is_refused_by_quantize(top_k):
    model = make_moe_model("qwen3_moe", layers=1)
    model.config.num_experts_per_tok = top_k
    with pytest.raises(QuantizationError, match=f"num_experts_per_tok {top_k} with num_experts 8"):
        quantkit.quantize(model, "w4a16-rtn", progress=False)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_impossible_moe_config_is_refused_by_load(family, tmp_path):
    model = make_moe_model(family, layers=1)
    model.save_pretrained(tmp_path / "float")
    quantkit.save(quantkit.quantize(model, "w4a16-rtn", progress=False), tmp_path / "w4")
    for folder in (tmp_path / "float", tmp_path / "w4"):
        config = json.loads((folder / "config.json").read_text())
        config["num_experts_per_tok"] = 9
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=r"num_experts_per_tok 9 with num_\w*experts 8"):
            quantkit.load(folder)
