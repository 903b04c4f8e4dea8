"""A checkpoint whose FP8 KV cache is Hadamard-rotated: the standard k_scale / v_scale stay the unrotated
scales (what vLLM and transformers read), the rotated-basis ones live in quantkit_kv_rotation.st named by
config.json, and quantkit.load brings the rotation and both scale sets back."""

import json

import pytest
import torch
from safetensors import safe_open

import quantkit
from quantkit.calibration.kv_scales import calibrate_kv_scales, quantize_kv_cache
from quantkit.core.errors import CheckpointError
from quantkit.formats.compressed_tensors import build_quantization_config
from quantkit.formats.kv_rotation_file import CONFIG_KEY, SCALES_FILE
from quantkit.modules.kv_cache import fp8_cache_for
from quantkit.modules.kv_scales import kv_rotation_of, read_kv_scales
from quantkit.quantization.recipe import load_recipe

from .conftest import make_random_model

VOCAB = 512


@pytest.fixture(scope="module")
def rotated_checkpoint(tmp_path_factory):
    model = make_random_model("llama", seed=4, vocab=VOCAB).to(torch.bfloat16)
    batches = [torch.randint(0, VOCAB, (2, 64)) for _ in range(2)]
    plain, rotated = calibrate_kv_scales(model, batches, rotation="hadamard")
    quantize_kv_cache(model, batches, rotation="hadamard")
    model.config.quantization_config = build_quantization_config(model, load_recipe("kv-fp8").kv_cache)
    path = quantkit.save(model, tmp_path_factory.mktemp("kv-rot") / "ckpt")
    return path, plain, rotated


def test_standard_scales_are_the_unrotated_ones(rotated_checkpoint):
    path, plain, rotated = rotated_checkpoint
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for i, (k, v) in plain.items():
            stored_k = f.get_tensor(f"model.layers.{i}.self_attn.k_scale").float()
            torch.testing.assert_close(stored_k, k.to(torch.bfloat16).float(), rtol=0, atol=0)
            assert not torch.equal(stored_k, rotated[i][0].to(torch.bfloat16).float())
    assert not any("rotated" in n for n in names)


def test_rotated_scales_and_rotation_are_stored_beside_the_weights(rotated_checkpoint):
    path, _, rotated = rotated_checkpoint
    config = json.loads((path / "config.json").read_text())
    assert config[CONFIG_KEY] == {"rotation": "hadamard", "scales_file": SCALES_FILE}
    assert "rotation" not in json.dumps(config["quantization_config"])  # compressed-tensors' part unchanged
    assert not list(path.glob("*.safetensors"))[1:]  # engines glob *.safetensors: only model.safetensors
    with safe_open(str(path / SCALES_FILE), framework="pt") as f:
        for i, (k, v) in rotated.items():
            torch.testing.assert_close(f.get_tensor(f"model.layers.{i}.self_attn.k_scale").float(),
                                       k.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_load_round_trip_keeps_rotation_and_both_scale_sets(rotated_checkpoint, tmp_path):
    path, plain, rotated = rotated_checkpoint
    model = quantkit.load(path)
    assert kv_rotation_of(model) == "hadamard"
    got_plain, _ = read_kv_scales(model)
    got_rotated, missing = read_kv_scales(model, rotated=True)
    assert not missing
    for i in plain:
        torch.testing.assert_close(got_plain[i][0], plain[i][0].to(torch.bfloat16).float(), rtol=0, atol=0)
        torch.testing.assert_close(got_rotated[i][1], rotated[i][1].to(torch.bfloat16).float(), rtol=0, atol=0)
    assert fp8_cache_for(model).rotation == "hadamard"
    again = quantkit.save(model, tmp_path / "again")
    assert json.loads((again / "config.json").read_text())[CONFIG_KEY]["rotation"] == "hadamard"
    assert (again / SCALES_FILE).read_bytes() == (path / SCALES_FILE).read_bytes()


def test_missing_rotation_file_is_named(rotated_checkpoint, tmp_path):
    path, _, _ = rotated_checkpoint
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    (copy / SCALES_FILE).unlink()
    with pytest.raises(CheckpointError, match=f"{SCALES_FILE} is missing"):
        quantkit.load(copy)
    config = json.loads((copy / "config.json").read_text())
    config[CONFIG_KEY] = {"rotation": "random"}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=CONFIG_KEY):
        quantkit.load(copy)


def test_recipe_option_round_trips_and_quantize_rotates():
    recipe = load_recipe("w4a16-rtn-kv-fp8-hadamard")
    assert recipe.kv_cache_rotation == "hadamard"
    assert recipe.to_dict()["kv_cache"]["rotation"] == "hadamard"
    assert load_recipe(recipe.to_dict()).kv_cache_rotation == "hadamard"
    assert load_recipe("w4a16-rtn-kv-fp8").kv_cache_rotation == "none"
    model = make_random_model("llama", seed=5, vocab=VOCAB)
    quantkit.quantize(model, recipe, [torch.randint(0, VOCAB, (4, 64))], progress=False)
    assert kv_rotation_of(model) == "hadamard"
    assert not read_kv_scales(model, rotated=True)[1]


@pytest.mark.parametrize("kv_cache,message", [
    ({"num_bits": 8, "type": "float", "strategy": "tensor", "rotation": "random"}, "rotation must be one of none, hadamard"),
    ({"num_bits": 8, "type": "float", "strategy": "tensor", "rotation": 1}, "rotation must be one of none, hadamard"),
])
def test_bad_rotation_in_a_recipe_names_the_choices(kv_cache, message):
    from quantkit.core.config_utils import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_recipe({"version": 1, "kv_cache": kv_cache})


def test_rotation_needs_a_power_of_two_head_dim_before_any_work():
    from quantkit.core.errors import QuantizationError

    model = make_random_model("llama", seed=5, vocab=VOCAB)
    for layer in model.model.layers:
        layer.self_attn.head_dim = 48
    with pytest.raises(QuantizationError, match="power of two.*48"):
        quantkit.quantize(model, "w4a16-rtn-kv-fp8-hadamard", [torch.randint(0, VOCAB, (4, 64))], progress=False)
