"""The command line, in process: quantize, inspect, errors with exit code 2 and nothing written."""

import json

import pytest

from quantkit.cli import main


def test_quantize_and_inspect(random_model_folder, tmp_path, capsys):
    src = random_model_folder("qwen2")
    out = tmp_path / "w4"
    assert main(["quantize", str(src), "--recipe", "w4a16-rtn-asym", "--out", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "layers quantized : 14" in summary and "bits/weight" in summary and "smaller" in summary
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"

    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "int4 g128 asym" in shown and "model.layers.1.mlp.down_proj" in shown and "[128, 384]" in shown
    assert "ignored: lm_head" in shown


def test_existing_output_is_refused_before_work(random_model_folder, tmp_path, capsys):
    src = random_model_folder("llama")
    out = tmp_path / "exists"
    out.mkdir()
    assert main(["quantize", str(src), "--recipe", "w8a16-rtn", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and list(out.iterdir()) == []


@pytest.mark.parametrize("args, message", [
    (["--recipe", "w4a16-nope"], "built-in recipes"),
    (["--recipe", "w4a16-rtn", "MISSING"], "does not exist"),
])
def test_errors_exit_2(random_model_folder, tmp_path, capsys, args, message):
    src = str(random_model_folder("llama")) if "MISSING" not in args else str(tmp_path / "missing-model")
    args = [a for a in args if a != "MISSING"]
    assert main(["quantize", src, *args, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_eval_on_the_tiny_reference_model(tmp_path, capsys):
    results = {}
    for recipe in ("w8a16-rtn", "w4a16-rtn"):
        out = tmp_path / recipe
        assert main(["quantize", "ref:tiny", "--recipe", recipe, "--out", str(out)]) == 0
        assert (out / "tokenizer.json").is_file(), "the tokenizer travels with the checkpoint"
        report = tmp_path / f"{recipe}.json"
        assert main(["eval", str(out), "--baseline", "ref:tiny", "--window", "128", "--max-tokens", "4096",
                     "--json", str(report)]) == 0
        results[recipe] = json.loads(report.read_text())
    capsys.readouterr()
    for r in results.values():
        assert {"perplexity", "kl_divergence", "top1_agreement", "baseline_perplexity"} <= set(r)
        assert r["windows"] == 32 and r["window"] == 128
        assert 1 < r["baseline_perplexity"] < 1000 and r["kl_divergence"] > 0
    w8, w4 = results["w8a16-rtn"], results["w4a16-rtn"]
    assert w8["baseline_perplexity"] == w4["baseline_perplexity"]
    assert w8["kl_divergence"] < w4["kl_divergence"] and w8["top1_agreement"] > w4["top1_agreement"]
