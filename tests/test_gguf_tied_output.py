"""GGUF output of a model with tied embeddings whose output head is quantized (`--tie-output`): the quantized
head written once, as token_embd, as llama.cpp's files of such models are; and the refusals, before any work."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

gguf = pytest.importorskip("gguf")

import quantkit  # noqa: E402
from quantkit.commands.cli import main  # noqa: E402
from quantkit.quantization.recipe import load_recipe  # noqa: E402

from .test_gguf_export import _checkpoint, _read  # noqa: E402

T = gguf.GGMLQuantizationType


def _with_head(name: str):
    """The built-in recipe `name` with the output head quantized too (ignore: [])."""
    return dataclasses.replace(load_recipe(name), ignore=())


def _dequantized(tensor) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())


def test_export_writes_the_quantized_head_once_as_token_embd(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path, "qwen2", _with_head("w8a16-rtn-g32"))  # tied; qwen2: no q/k row permutation
    tied, plain = tmp_path / "tied.gguf", tmp_path / "plain.gguf"
    assert main(["export", str(ckpt), "--format", "gguf", "--out", str(tied), "--tie-output"]) == 0
    printed = capsys.readouterr().out
    assert "token_embd is the quantized output head" in printed and "RMS change of" in printed
    _, tensors = _read(tied)
    assert "output.weight" not in tensors and tensors["token_embd.weight"].tensor_type == T.Q8_0
    model = quantkit.load(ckpt, backend="reference")
    assert torch.equal(_dequantized(tensors["token_embd.weight"]), model.lm_head.dequantized_weight().float())
    # without the option: the head as output.weight and the float embedding beside it, a larger file
    assert main(["export", str(ckpt), "--format", "gguf", "--out", str(plain)]) == 0
    assert "--tie-output writes it once" in capsys.readouterr().out  # the option is pointed out
    _, both = _read(plain)
    assert both["output.weight"].tensor_type == T.Q8_0 and both["token_embd.weight"].tensor_type == T.BF16
    assert plain.stat().st_size > tied.stat().st_size
    # transformers' GGUF reader ties lm_head to token_embd: quantkit's load of the file runs the quantized head
    from_file = quantkit.load(tied)
    assert torch.equal(from_file.lm_head.weight.float(), model.lm_head.dequantized_weight().float())


def test_a_mixs_head_is_tied_in_the_mixs_output_type(tmp_path):
    """A Q4_K_M mix with the head quantized: the head takes the mix's output type (Q6_K; ref:small's width
    256 needs no fallback), written as token_embd, the type llama-quantize gives a tied model's embedding."""
    recipe = load_recipe("w4a16-rtn-q4km")
    out = tmp_path / "m.gguf"
    model = quantkit.load("ref:small", dtype=torch.float32)
    quantkit.quantize(model, dataclasses.replace(recipe, ignore=()), progress=False)
    from quantkit.gguf.writing import export_gguf
    from quantkit.formats.loading import resolve_model_source

    result = export_gguf(model, resolve_model_source("ref:small"), out, mix=recipe.mix, tie_output=True)
    assert result.tensors["token_embd.weight"] == "Q6_K" and "output.weight" not in result.tensors
    assert result.tied_lookup_change is not None and 0 < result.tied_lookup_change < 0.1


def test_tie_output_refusals(tmp_path, capsys, random_model_folder):
    # the head left float: refused at export ...
    ckpt = _checkpoint(tmp_path, "llama", "w8a16-rtn-g32")
    assert main(["export", str(ckpt), "--format", "gguf", "--out", str(tmp_path / "a.gguf"), "--tie-output"]) == 2
    assert "output head is not quantized" in capsys.readouterr().err and not (tmp_path / "a.gguf").exists()
    # ... and by quantize before any work, as is an output that is no GGUF file
    out = tmp_path / "b.gguf"
    assert main(["quantize", "ref:tiny", "--recipe", "w8a16-rtn-g32", "--out", str(out), "--tie-output"]) == 2
    err = capsys.readouterr().err
    assert "leaves lm_head in float" in err and "ignore: []" in err and not out.exists()
    assert main(["quantize", "ref:tiny", "--recipe", "w8a16-rtn-g32", "--out", str(tmp_path / "dir"),
                 "--tie-output"]) == 2
    assert "--tie-output is for GGUF output" in capsys.readouterr().err
    # a model whose embedding is not its head: refused up front (config) and at export (the values)
    untied_src = random_model_folder("llama", tied=False)
    recipe_file = tmp_path / "head.yaml"
    recipe_file.write_text("version: 1\nweights: {num_bits: 8, type: int, symmetric: true, strategy: group, "
                           "group_size: 32}\ntargets: [Linear]\nignore: []\nalgorithm: {name: rtn}\n")
    assert main(["quantize", str(untied_src), "--recipe", str(recipe_file), "--out", str(out), "--tie-output"]) == 2
    assert "tie_word_embeddings false" in capsys.readouterr().err and not out.exists()
    untied = _checkpoint(tmp_path, "mistral", _with_head("w8a16-rtn-g32"), tied=False)
    assert not json.loads((untied / "config.json").read_text())["tie_word_embeddings"]
    assert main(["export", str(untied), "--format", "gguf", "--out", str(out), "--tie-output"]) == 2
    assert "different matrices" in capsys.readouterr().err and not out.exists()
