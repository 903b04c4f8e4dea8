"""kv-fp8 checkpoints: calibrated k_scale / v_scale on disk where vLLM and compressed-tensors read them."""

import inspect
import json

import pytest
import torch
from safetensors import safe_open

import quantkit
from quantkit.calibration.kv_scales import quantize_kv_cache
from quantkit.formats.compressed_tensors import build_quantization_config
from quantkit.modules.kv_scales import read_kv_scales
from quantkit.quantization.recipe import load_recipe

from .conftest import make_random_model

pytest.importorskip("compressed_tensors")

VOCAB = 512


@pytest.fixture(scope="module")
def kv_checkpoint(tmp_path_factory):
    """A bf16 random Llama with calibrated FP8 KV scales saved with the kv-fp8 recipe."""
    recipe = load_recipe("kv-fp8")
    model = make_random_model("llama", seed=3, vocab=VOCAB).to(torch.bfloat16)
    batches = [torch.randint(0, VOCAB, (2, 64)) for _ in range(2)]
    quantize_kv_cache(model, batches)
    model.config.quantization_config = build_quantization_config(model, recipe.kv_cache)
    path = quantkit.save(model, tmp_path_factory.mktemp("kv-fp8") / "ckpt")
    scales, _ = read_kv_scales(model)
    return path, scales


def test_recipe_declares_the_fp8_kv_scheme():
    recipe = load_recipe("kv-fp8")
    assert recipe.weights is None
    assert (recipe.kv_cache.num_bits, recipe.kv_cache.type, recipe.kv_cache.strategy) == (8, "float", "tensor")


def test_checkpoint_holds_calibrated_scales_and_scheme(kv_checkpoint):
    path, scales = kv_checkpoint
    qcfg = json.loads((path / "config.json").read_text())["quantization_config"]
    kv = qcfg["kv_cache_scheme"]
    assert {k: kv[k] for k in ("num_bits", "type", "symmetric", "strategy", "dynamic")} == {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for i, (k_scale, v_scale) in scales.items():
            for name, expected in (("k_scale", k_scale), ("v_scale", v_scale)):
                stored = f.get_tensor(f"model.layers.{i}.self_attn.{name}")
                assert stored.shape == (1,) and stored.dtype == torch.bfloat16
                assert stored.float().item() != 1.0
                torch.testing.assert_close(stored.float(), expected, rtol=0, atol=0)


def test_scales_pop_out_of_the_checkpoint_state_dict(kv_checkpoint):
    """What a loader does: build the model from config, pop the scales, load the rest strictly, attach."""
    from quantkit.modules.kv_scales import attach_kv_scales, pop_kv_scales
    from quantkit.formats.safetensors_io import read_state_dict

    path, scales = kv_checkpoint
    state = read_state_dict(path)
    model = make_random_model("llama", seed=4, vocab=VOCAB).to(torch.bfloat16)
    popped = pop_kv_scales(model, state)
    assert not [k for k in state if k.endswith(("k_scale", "v_scale"))]
    model.load_state_dict(state, strict=False)
    attach_kv_scales(model, popped)
    loaded, missing = read_kv_scales(model)
    assert not missing
    for i in scales:
        torch.testing.assert_close(loaded[i][0], scales[i][0], rtol=0, atol=0)
        torch.testing.assert_close(loaded[i][1], scales[i][1], rtol=0, atol=0)


def _accept_renamed_cache_argument(monkeypatch):
    """compressed-tensors 0.20 spots cached attention modules by a `past_key_value(s)` argument, which
    transformers 5.24 renamed to `cache`: accept that name too (what a fixed compressed-tensors does)."""
    from compressed_tensors.quantization.lifecycle import apply, initialize

    original = initialize.is_cached_attention_module

    def is_cached_attention_module(module):
        if original(module):
            return True
        return (
            initialize._is_attention_module(module)
            and any(hasattr(module, n) for n in initialize._KV_CACHE_PROJECTION_NAMES)
            and "cache" in inspect.signature(module.forward).parameters
        )

    monkeypatch.setattr(initialize, "is_cached_attention_module", is_cached_attention_module)
    monkeypatch.setattr(apply, "is_cached_attention_module", is_cached_attention_module)


def _hf_scales(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    found = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if hasattr(attn, "k_scale") and hasattr(attn, "v_scale"):
            found[i] = (attn.k_scale.detach().float().reshape(-1), attn.v_scale.detach().float().reshape(-1))
    return found


def test_transformers_compressed_tensors_load_the_calibrated_scales(kv_checkpoint, monkeypatch):
    path, scales = kv_checkpoint
    _accept_renamed_cache_argument(monkeypatch)
    loaded = _hf_scales(path)
    assert sorted(loaded) == sorted(scales)
    for i, (k_scale, v_scale) in scales.items():
        torch.testing.assert_close(loaded[i][0], k_scale, rtol=0, atol=0)
        torch.testing.assert_close(loaded[i][1], v_scale, rtol=0, atol=0)


def _attention_takes_cache_argument() -> bool:
    """Whether transformers' attention modules take the cache as `cache` (5.24) or `past_key_values` (5.17)."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    return "cache" in inspect.signature(LlamaAttention.forward).parameters


@pytest.mark.xfail(_attention_takes_cache_argument(), strict=True, reason=(
    "compressed-tensors 0.20.1 looks for a `past_key_value(s)` argument on attention modules; transformers "
    "5.24 calls it `cache`, so the kv_cache_scheme is ignored and k_scale/v_scale load as unexpected keys"))
def test_unpatched_transformers_compressed_tensors_load_the_scales(kv_checkpoint):
    path, scales = kv_checkpoint
    assert sorted(_hf_scales(path)) == sorted(scales)
