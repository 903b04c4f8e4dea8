"""load and inspect check every tensor's shape, and weight_shape's values, against config.json."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import quantkit
from quantkit.commands.cli import main
from quantkit.core.errors import CheckpointError

from .conftest import make_random_model

LINEAR = "model.layers.1.mlp.down_proj"  # [out 128, in 384]: int4 g128 -> packed [128, 48], scale [128, 3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = quantkit.quantize(make_random_model("llama"), "w4a16-rtn", progress=False)
    return quantkit.save(model, tmp_path_factory.mktemp("ckpt") / "w4")


def _edited(checkpoint, tmp_path, name, value):
    import shutil

    path = tmp_path / "edited"
    shutil.copytree(checkpoint, path)
    tensors = load_file(path / "model.safetensors")
    tensors[name] = value
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


EDITS = [
    (f"{LINEAR}.weight_shape", torch.tensor([128, 256]),
     rf"{LINEAR}\.weight_shape: expected \[out, in\] = \[128, 384\] from config\.json, found \[128, 256\]"),
    (f"{LINEAR}.weight_scale", torch.ones(128, 2),
     rf"{LINEAR}\.weight_scale: expected shape \[128, 3\], found \[128, 2\]"),
    (f"{LINEAR}.weight_packed", torch.zeros(128, 47, dtype=torch.int32),
     rf"{LINEAR}\.weight_packed: expected shape \[128, 48\], found \[128, 47\]"),
    ("model.norm.weight", torch.ones(64),
     r"model\.norm\.weight: expected shape \[128\], found \[64\]"),
]


@pytest.mark.parametrize("name, value, message", EDITS, ids=["weight_shape", "scale", "packed", "norm"])
def test_load_names_the_tensor_expected_and_found(checkpoint, tmp_path, name, value, message):
    path = _edited(checkpoint, tmp_path, name, value)
    with pytest.raises(CheckpointError, match=message):
        quantkit.load(path)


@pytest.mark.parametrize("name, value, message", EDITS[:2], ids=["weight_shape", "scale"])
def test_inspect_exits_2_naming_the_tensor(checkpoint, tmp_path, capsys, name, value, message):
    import re

    path = _edited(checkpoint, tmp_path, name, value)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err


def test_edited_config_is_caught(checkpoint, tmp_path, capsys):
    import shutil

    path = tmp_path / "config-edited"
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 512
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight_packed: expected shape "
                                              r"\[512, 16\], found \[384, 16\]"):
        quantkit.load(path)
    assert main(["inspect", str(path)]) == 2


def test_intact_checkpoint_is_shown_as_checked(checkpoint, capsys):
    assert main(["inspect", str(checkpoint)]) == 0
    assert "tensors: all that config.json describes and no others, each in a usable dtype and its shape; scales " \
           "positive" in capsys.readouterr().out
