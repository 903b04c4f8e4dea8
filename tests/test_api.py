"""quantize / save / load on random models of several families, and bad input."""

import json

import pytest
import torch

import quantkit
from quantkit.core.errors import CheckpointError, QuantizationError
from quantkit.modules import QuantLinear

from .conftest import FAMILIES, make_random_model

RECIPES = ("w8a16-rtn", "w4a16-rtn", "w4a16-rtn-asym")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_quantize_save_load_round_trip(tmp_path, family, recipe):
    model = make_random_model(family)
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        float_logits = model(ids).logits
        quantkit.quantize(model, recipe, progress=False)
        quant_logits = model(ids).logits
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down per block; lm_head ignored
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, QuantLinear)
    rel = (quant_logits - float_logits).norm() / float_logits.norm()
    assert 0 < rel < (0.05 if recipe.startswith("w8") else 0.5)

    out = quantkit.save(model, tmp_path / "ckpt")
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["format"] == "pack-quantized"
    assert qcfg["quantization_status"] == "compressed" and qcfg["ignore"] == ["lm_head"]
    assert not list(tmp_path.glob(".ckpt.tmp-*")), "temporary folder left behind"

    loaded = quantkit.load(out, backend="reference")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, quant_logits)
    for a, b in zip(layers, [m for m in loaded.modules() if isinstance(m, QuantLinear)]):
        assert torch.equal(a.weight_packed, b.weight_packed) and torch.equal(a.weight_scale, b.weight_scale)


def test_checkpoint_tensors_follow_compressed_tensors_layout(tmp_path):
    from safetensors import safe_open

    model = quantkit.quantize(make_random_model("llama"), "w4a16-rtn-asym", progress=False)
    out = quantkit.save(model, tmp_path / "ckpt")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        prefix = "model.layers.0.mlp.down_proj."  # in 384, out 128
        assert f.get_tensor(prefix + "weight_packed").shape == (128, 384 * 4 // 32)
        assert f.get_tensor(prefix + "weight_packed").dtype == torch.int32
        assert f.get_tensor(prefix + "weight_scale").shape == (128, 3)
        assert f.get_tensor(prefix + "weight_zero_point").shape == (128 * 4 // 32, 3)
        assert f.get_tensor(prefix + "weight_shape").tolist() == [128, 384]
    assert not any(k.endswith("g_idx") for k in keys)
    assert "lm_head.weight" not in keys  # tied to the embedding


def test_nan_weight_is_refused():
    model = make_random_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    with pytest.raises(QuantizationError, match=r"model\.layers\.1\.mlp\.up_proj\.weight \(1 NaN/Inf value\)"):
        quantkit.quantize(model, "w4a16-rtn", progress=False)


def test_group_size_must_divide_in_features_under_the_error_rule(tmp_path):
    model = make_random_model("llama")
    recipe = {"version": 1, "weights": {"num_bits": 4, "strategy": "group", "group_size": 128}, "indivisible": "error"}
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(320, 128, bias=False)  # 320 % 128 != 0
    with pytest.raises(QuantizationError, match=r"down_proj \(in_features=320\).*does not divide"):
        quantkit.quantize(model, recipe, progress=False)
    assert not any(isinstance(m, QuantLinear) for m in model.modules()), "the model must be left untouched"


def test_existing_output_folder_is_refused_and_kept(tmp_path):
    model = quantkit.quantize(make_random_model("llama"), "w8a16-rtn", progress=False)
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    for force in (False, True):  # never advised force=True, which would be refused
        with pytest.raises(FileExistsError, match=r"quantkit did not write it .* would delete precious.txt") as e:
            quantkit.save(model, out, force=force)
        assert "force=True" not in str(e.value)
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]
    (out / "precious.txt").unlink()
    with pytest.raises(FileExistsError, match="force=True"):  # an empty folder: force=True would replace it
        quantkit.save(model, out)
    quantkit.save(model, out, force=True)  # an empty folder holds nothing to lose
    quantkit.save(model, out, force=True)  # nor does a checkpoint quantkit wrote
    assert (out / "model.safetensors").exists()


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    import quantkit.api as api

    model = quantkit.quantize(make_random_model("llama"), "w8a16-rtn", progress=False)

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(api, "write_state_dict", boom)
    with pytest.raises(OSError, match="disk full"):
        quantkit.save(model, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_truncated_checkpoint_is_refused(tmp_path):
    model = quantkit.quantize(make_random_model("llama"), "w4a16-rtn", progress=False)
    out = quantkit.save(model, tmp_path / "ckpt")
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        quantkit.load(out)


def test_missing_and_non_model_folders(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        quantkit.load(tmp_path / "nowhere")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="no config.json"):
        quantkit.load(tmp_path / "notes")


def test_pickle_only_folder_is_refused(random_model_folder):
    folder = random_model_folder("llama")
    (folder / "model.safetensors").unlink()
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="never loads pickled weights"):
        quantkit.load(folder)


def test_unsupported_quant_method(tmp_path):
    model = quantkit.quantize(make_random_model("llama"), "w8a16-rtn", progress=False)
    out = quantkit.save(model, tmp_path / "ckpt")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "gptq"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quant_method 'gptq' is not supported"):
        quantkit.load(out)


def test_model_without_linears_is_refused():
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 1))
    with pytest.raises(ValueError, match="no nn.Linear module matches"):
        quantkit.quantize(model, "w8a16-rtn", progress=False)
