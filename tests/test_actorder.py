"""GPTQ's act-order with static groups is recorded as compressed-tensors records it: actorder "weight"
for grouped schemes (no g_idx, same layout); per-channel schemes keep null, which every reader accepts."""

import json

import pytest
import torch

import quantkit
from quantkit.core.config_utils import ConfigError
from quantkit.core.scheme import QuantScheme

from .conftest import make_random_model

CALIBRATION = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))


def _weights_args(path) -> list[dict]:
    groups = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]
    return [g["weights"] for g in groups.values()]


@pytest.mark.parametrize("recipe, actorder", [("w4a16-gptq", "weight"), ("w8a16-gptq", None)])
def test_written_actorder_says_what_gptq_did(recipe, actorder, tmp_path):
    model = quantkit.quantize(make_random_model("llama"), recipe, CALIBRATION, progress=False)
    path = quantkit.save(model, tmp_path / recipe)
    assert [w["actorder"] for w in _weights_args(path)] == [actorder]
    # the readers take it as it is: compressed-tensors' own arguments, and quantkit's loader (kept on re-save)
    from compressed_tensors.quantization import QuantizationArgs

    parsed = QuantizationArgs.model_validate(_weights_args(path)[0])
    assert parsed.actorder == actorder  # a str enum in compressed-tensors: equal to its value
    again = quantkit.save(quantkit.load(path, backend="reference"), tmp_path / "again")
    assert [w["actorder"] for w in _weights_args(again)] == [actorder]


def test_rtn_and_no_act_order_write_null(tmp_path):
    model = quantkit.quantize(make_random_model("llama"), "w4a16-rtn", progress=False)
    assert [w["actorder"] for w in _weights_args(quantkit.save(model, tmp_path / "rtn"))] == [None]
    recipe = {"weights": {"num_bits": 4, "strategy": "group", "group_size": 128},
              "algorithm": {"name": "gptq", "act_order": False}}
    model = quantkit.quantize(make_random_model("llama"), recipe, CALIBRATION, progress=False)
    assert [w["actorder"] for w in _weights_args(quantkit.save(model, tmp_path / "plain"))] == [None]


def test_reader_accepts_static_groups_and_refuses_g_idx_orderings():
    args = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    assert QuantScheme.from_dict({**args, "actorder": "static"}).actorder == "weight"
    assert QuantScheme.from_dict({**args, "actorder": "weight"}).actorder == "weight"
    for ordering in ("group", "dynamic", True):
        with pytest.raises(ValueError, match="g_idx"):
            QuantScheme.from_dict({**args, "actorder": ordering})


def test_recipes_cannot_claim_an_ordering():
    with pytest.raises(ConfigError, match="actorder is recorded by the algorithm"):
        quantkit.load_recipe({"weights": {"num_bits": 4, "strategy": "group", "group_size": 128, "actorder": "weight"}})
