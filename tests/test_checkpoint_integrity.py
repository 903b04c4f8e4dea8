"""Corrupt weight files, checkpoints whose tensors or config do not fit together, and baselines that are
not the checkpoint's source are refused with an error naming the problem (the command-line cases are
in robustness_cases_checkpoint.py); inspect counts bits per weight one way."""

import copy
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import quantkit
from quantkit.commands.cli import main
from quantkit.core.errors import CheckpointError, UsageError
from quantkit.formats.safetensors_io import read_header, safetensors_files

from .conftest import make_random_model
from fixtures.robustness_cases import _rewrite_header

LINEAR = "model.layers.1.mlp.down_proj"  # [out 128, in 384]: int4 g128 -> packed [128, 48], scale [128, 3]


@pytest.fixture(scope="module")
def source():
    return make_random_model("llama")


@pytest.fixture(scope="module")
def checkpoint(source, tmp_path_factory):
    model = quantkit.quantize(copy.deepcopy(source), "w4a16-rtn", progress=False)
    return quantkit.save(model, tmp_path_factory.mktemp("ckpt") / "w4")


def _edited(checkpoint, tmp_path, edit):
    path = tmp_path / "edited"
    shutil.copytree(checkpoint, path)
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _set(name, value):
    return lambda tensors: tensors.__setitem__(name, value)


def _scale_value(value):
    def edit(tensors):
        tensors[f"{LINEAR}.weight_scale"][3, 2] = value
    return edit


EDITS = {
    "scale-zero": (_scale_value(0.0), rf"scales must be positive normal numbers \({LINEAR}\.weight_scale: 1 of 384 values, e\.g\. 0\)"),
    "scale-negative": (_scale_value(-0.5), r"weight_scale: 1 of 384 values, e\.g\. -0\.5\)"),
    "scale-denormal": (_scale_value(1e-39), r"weight_scale: 1 of 384 values, e\.g\. 1e-39\)"),
    "scale-int32": (lambda t: t.__setitem__(f"{LINEAR}.weight_scale", t[f"{LINEAR}.weight_scale"].to(torch.int32)),
                    rf"{LINEAR}\.weight_scale is I32, expected F16, BF16, F32 or F64"),
    "packed-float": (lambda t: t.__setitem__(f"{LINEAR}.weight_packed", t[f"{LINEAR}.weight_packed"].float()),
                     rf"{LINEAR}\.weight_packed is F32, expected I32 \(int32\)"),
    "shape-float": (_set(f"{LINEAR}.weight_shape", torch.tensor([128.0, 384.0])),
                    rf"{LINEAR}\.weight_shape is F32, expected an integer dtype"),
    "missing-scale": (lambda t: t.pop(f"{LINEAR}.weight_scale"), rf"\(missing: {LINEAR}\.weight_scale\)"),
    "unexpected": (_set("model.layers.1.mlp.down_proj.weight", torch.ones(128, 384)),
                   rf"\(unexpected: {LINEAR}\.weight\)"),
}


@pytest.mark.parametrize("edit, message", EDITS.values(), ids=EDITS.keys())
def test_load_and_inspect_refuse_a_broken_checkpoint_naming_the_tensor(checkpoint, tmp_path, capsys, edit, message):
    path = _edited(checkpoint, tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        quantkit.load(path)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err


def test_fp32_scales_at_the_smallest_normal_number_are_accepted(checkpoint, tmp_path):
    tiny = torch.finfo(torch.float32).tiny
    path = _edited(checkpoint, tmp_path, _scale_value(tiny))
    assert quantkit.load(path).get_submodule(LINEAR).weight_scale[3, 2] == tiny


def test_a_checkpoint_without_its_quantization_config_is_not_loaded_as_a_float_model(checkpoint, tmp_path, capsys):
    path = tmp_path / "stripped"
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    message = r"holds quantized tensors \(model\.layers\.0\.mlp\.down_proj\.weight_packed, .* but its config\.json has no quantization_config"
    with pytest.raises(CheckpointError, match=message):
        quantkit.load(path)
    assert main(["inspect", str(path)]) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("qcfg, message", [
    (None, "quantization_config is not a mapping"),
    ({}, "quantization_config has no quant_method"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": "w4"}}, "config_groups must map group names"),
    ({"quant_method": "compressed-tensors", "ignore": "lm_head"}, "ignore must be a list of module names"),
])
def test_a_broken_quantization_config_is_named(checkpoint, tmp_path, qcfg, message):
    path = tmp_path / "broken"
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = qcfg
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        quantkit.load(path)


# -- safetensors headers and indexes ------------------------------------------------------------------------

def _file_with_header(tmp_path, edit):
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.int32)}, str(path), metadata={"format": "pt"})
    _rewrite_header(path, edit)
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda h: h.update(__metadata__=["pt"]), "__metadata__ must map names to strings"),
    (lambda h: h.update(__metadata__=3), "__metadata__ must map names to strings"),
    (lambda h: h.update(__metadata__={"format": {"nested": 1}}), "__metadata__ must map names to strings"),
    (lambda h: h.update(a={"nested": {"dtype": "F32"}}), "the header entry of 'a' is malformed"),
    (lambda h: h["a"].update(dtype="F4"), "the header entry of 'a' is malformed"),
    (lambda h: h["a"].update(shape=[2, -3]), "the header entry of 'a' is malformed"),
    (lambda h: h["a"].update(shape=[2, "3"]), "the header entry of 'a' is malformed"),
], ids=["metadata-list", "metadata-int", "metadata-nested", "entry-nested", "unknown-dtype", "negative-dim",
        "string-dim"])
def test_read_header_refuses_a_malformed_header(tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        read_header(_file_with_header(tmp_path, edit))


def test_read_header_gives_each_tensor_dtype_and_shape(tmp_path):
    header = read_header(_file_with_header(tmp_path, lambda h: None))
    assert header == {"a": ("F32", (2, 3)), "b": ("I32", (4,))}
    assert header["a"].nbytes == 24 and header["b"].nbytes == 16


def _indexed(tmp_path, weight_map, **extra):
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"a": torch.ones(2)}, str(folder / "shard.safetensors"))
    index = {"metadata": {"total_size": 8}, "weight_map": weight_map, **extra}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize("weight_map, extra, message", [
    ({"a": "/tmp/shard.safetensors"}, {}, "outside the model folder"),
    ({"a": "../model/shard.safetensors"}, {}, "outside the model folder"),
    ([["a", "shard.safetensors"]], {}, "'weight_map' must be a non-empty object"),
    ({}, {}, "'weight_map' must be a non-empty object"),
    ({"a": 7}, {}, "the weight_map entry of 'a' is 7"),
    ({"a": "shard.safetensors"}, {"metadata": None}, "'metadata' must be an object"),
], ids=["absolute", "parent", "list", "empty", "not-a-name", "no-metadata"])
def test_a_malformed_index_is_refused(tmp_path, weight_map, extra, message):
    with pytest.raises(CheckpointError, match=message):
        safetensors_files(_indexed(tmp_path, weight_map, **extra))


def test_an_index_may_name_a_linked_shard(tmp_path):
    """Hub caches link each shard to a blob elsewhere: the index names the link, inside the folder."""
    folder = _indexed(tmp_path, {"a": "linked.safetensors"})
    blob = tmp_path / "blob"
    (folder / "shard.safetensors").rename(blob)
    (folder / "linked.safetensors").symlink_to(blob)
    assert safetensors_files(folder) == [folder / "linked.safetensors"]


# -- inspect's figures ----------------------------------------------------------------------------------------

def _inspect(capsys, path) -> str:
    assert main(["inspect", str(path)]) == 0
    return capsys.readouterr().out


def test_inspect_gives_one_bits_per_weight_and_says_what_it_counts(source, tmp_path, capsys):
    model = quantkit.quantize(copy.deepcopy(source), "w4a16-rtn", progress=False)
    for dtype, expected in [(torch.bfloat16, 4 + 16 / 128), (torch.float32, 4 + 32 / 128)]:
        out = _inspect(capsys, quantkit.save(model, tmp_path / str(dtype), dtype=dtype))
        group = float(re.search(r"group 0: int4 g128 sym \(14 linears, ([\d.]+) bits/weight stored\)", out).group(1))
        total = float(re.search(r"quantized linears \(14\): .* of weight_packed, weight_scale, weight_zero_point "
                                r"= ([\d.]+) bits/weight", out).group(1))
        assert group == total == pytest.approx(expected, abs=1e-3)
        assert "k_scale" not in out and "kv scales" not in out


def test_inspect_lists_kv_scales_only_when_there_are_some(source, tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    calibration = [torch.randint(0, 512, (2, 64), generator=g) for _ in range(2)]
    model = quantkit.quantize(copy.deepcopy(source), "kv-fp8", calibration, progress=False)
    out = _inspect(capsys, quantkit.save(model, tmp_path / "kv"))
    assert re.search(r"kv scales +\d+ B .* k_scale / v_scale of the FP8 KV cache", out)
    assert "metadata" not in out, "a KV-only checkpoint has no weight_shape tensors"


# -- the baseline is the checkpoint's source -------------------------------------------------------------------

def _windows():
    return torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))


def test_a_checkpoint_matches_its_source_in_other_dtypes(source, checkpoint, tmp_path):
    from quantkit.harness.baseline import source_mismatches

    loaded = quantkit.load(checkpoint)
    assert source_mismatches(loaded, source) == []
    assert source_mismatches(loaded, copy.deepcopy(source).to(torch.bfloat16)) == []
    half = quantkit.load(quantkit.save(loaded, tmp_path / "fp16", dtype=torch.float16))
    assert source_mismatches(half, source) == [], "fp16 rounding of the embeddings is not another model"


def test_scales_folded_into_the_norms_do_not_make_another_model(source, checkpoint):
    """AWQ folds its scales into the norms in front of the linears; the embeddings stay as they were."""
    from quantkit.harness.baseline import source_mismatches

    loaded = quantkit.load(checkpoint)
    with torch.no_grad():
        loaded.model.layers[0].input_layernorm.weight.mul_(1.7)
    assert source_mismatches(loaded, source) == []


def test_a_baseline_with_other_weights_or_shapes_is_refused_unless_allowed(source, checkpoint):
    from quantkit.harness.quality import evaluate_quality

    loaded = quantkit.load(checkpoint)
    other = make_random_model("llama", seed=1)
    with pytest.raises(UsageError, match=r"is not the model .* was quantized from \(the input embeddings differ by "
                                         r"up to [\d.e+]+x what rounding to their dtypes explains\)"):
        evaluate_quality(loaded, other, _windows(), progress=False)
    narrow = make_random_model("llama", layers=1)
    with pytest.raises(UsageError, match=r"num_hidden_layers 2 in the model, 1 in the baseline.*--allow-other-baseline"):
        evaluate_quality(loaded, narrow, _windows(), progress=False)
    result = evaluate_quality(loaded, other, _windows(), progress=False, allow_other_baseline=True)
    own = evaluate_quality(loaded, source, _windows(), progress=False)
    assert result.kl_divergence > 10 * own.kl_divergence, "measured against the other model, as asked"


def test_the_refusal_names_the_source_recorded_in_recipe_yaml(tmp_path, random_model_folder):
    from quantkit.harness.quality import check_comparable
    from quantkit.quantization.provenance import recorded_source

    folder = random_model_folder()
    path = quantkit.save(quantkit.quantize(quantkit.load(folder), "w8a16-rtn", progress=False), tmp_path / "w8")
    assert recorded_source(path) == str(folder)
    with pytest.raises(UsageError, match=f"its recipe.yaml says it was made from {re.escape(str(folder))}"):
        check_comparable({"model": quantkit.load(path)}, make_random_model("llama", seed=1), _windows())
