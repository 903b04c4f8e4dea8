"""The command line, in process: quantize, inspect, errors with exit code 2 and nothing written."""

import json
import re

import pytest
import torch

from quantkit.commands.cli import main


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
        assert "; ± is two standard errors over windows)" in capsys.readouterr().out
    for r in results.values():
        assert {"perplexity", "kl_divergence", "top1_agreement", "baseline_perplexity"} <= set(r)
        assert r["log_ppl_ratio_stderr"] > 0 and r["dtype"] == "float32"
        assert r["windows"] == 32 and r["window"] == 128
        assert 1 < r["baseline_perplexity"] < 1000 and r["kl_divergence"] > 0
    w8, w4 = results["w8a16-rtn"], results["w4a16-rtn"]
    assert w8["baseline_perplexity"] == w4["baseline_perplexity"]
    assert w8["kl_divergence"] < w4["kl_divergence"] and w8["top1_agreement"] > w4["top1_agreement"]


def test_demo_end_to_end_on_tiny(tmp_path, capsys, monkeypatch):
    from quantkit.commands import cli
    from quantkit.harness import benchmark as bench
    from quantkit.harness import speed_model

    # speed is timed on a model sized from the last-level cache: a 64 KiB cache keeps it tiny here
    monkeypatch.setattr(speed_model, "last_level_cache", lambda: speed_model.CacheInfo(64 << 10, "a test's 64 KiB"))

    # the demo's bench step calls bench.benchmark with typed arguments, not the argument parser
    parsers, calls, real_build_parser, real_benchmark = [], [], cli.build_parser, bench.benchmark
    monkeypatch.setattr(cli, "build_parser", lambda: parsers.append(1) or real_build_parser())
    monkeypatch.setattr(bench, "benchmark", lambda *a, **kw: calls.append((a, kw)) or real_benchmark(*a, **kw))
    out = tmp_path / "demo"
    assert main(["demo", "--model", "ref:tiny", "--recipes", "w8a16-rtn,w4a16-rtn-asym", "--max-tokens", "2048",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert len(parsers) == 1, "only the demo's own command line is parsed"
    [(positional, keywords)] = calls
    assert positional[0].endswith("speed-model.json") and keywords["variants"] == ["w8a16-rtn", "w4a16-rtn-asym"]
    assert all(isinstance(n, int) for n in keywords["prompt_lens"] + keywords["context_lens"])
    assert keywords["decode_loop"] == "auto"  # the bench asks CpuDecoder of every variant it builds
    # every path printed exists: none names the temporary folder the output was assembled in
    assert ".tmp-" not in printed and f"model {out / 'speed-model.json'}" in printed
    speed = json.loads((out / "speed-model.json").read_text())
    bench_json = json.loads((out / "bench.json").read_text())
    assert bench_json["model"]["shape"]["layers"] == speed["num_hidden_layers"]
    assert "decode_loop_reason" not in bench_json  # the reason goes to the report's note, not the bench file
    # the smallest variant's weights still exceed the (patched) cache twice
    assert min(v["weight_bytes"] for v in bench_json["variants"]) >= 2 * (64 << 10)
    report = (out / "report.md").read_text()
    assert "a test's 64 KiB" in report and "random-weight Llama" in report
    assert "| w8a16-rtn | int8 per-channel sym |" in report and "| w4a16-rtn-asym | int4 g128 asym |" in report
    # the results table is one Markdown block (a blank line between rows would break it)
    assert re.search(r"\n\| baseline \|[^\n]*\n\| w8a16-rtn \|[^\n]*\n\| w4a16-rtn-asym \|", report)
    # the bench lengths fit the model's context; Reproduce names the demo, not a temporary folder
    assert "## Skipped shapes" not in report and ".tmp" not in report
    assert f"quantkit demo --model ref:tiny --recipes w8a16-rtn,w4a16-rtn-asym --out {out}" in report
    assert "This run timed prefill in" in report
    assert "Quality was measured in float32 and speed in" in report or "both measured in float32" in report
    assert "±" in report  # perplexity changes come with their noise
    # decode from a short context to 8k, and where the cache overtakes the weights
    assert max(keywords["context_lens"]) >= 8000 and "Where the KV cache overtakes the weights, batch 1" in report
    rows = json.loads((out / "quality.json").read_text())["results"]
    assert [r["recipe"] for r in rows] == ["w8a16-rtn", "w4a16-rtn-asym"]
    assert rows[0]["linear_bits_per_weight"] > 8 > rows[1]["linear_bits_per_weight"] > 4
    assert (out / "checkpoints" / "w4a16-rtn-asym" / "model.safetensors").is_file()
    assert main(["demo", "--model", "ref:tiny", "--out", str(out)]) == 2, "an existing output folder is refused"
    from quantkit.core.errors import OutputRefusedError
    from quantkit.files.outputs import check_replaceable

    check_replaceable(out)  # what demo --force may replace: its marker lists every file, checkpoints included
    (out / "checkpoints" / "w8a16-rtn" / "notes.txt").write_text("the user's notes")
    with pytest.raises(OutputRefusedError, match=r"files quantkit did not write \(checkpoints/w8a16-rtn/notes.txt\)"):
        check_replaceable(out)


def test_gptq_weights_and_fp8_kv_in_one_command(tmp_path, capsys):
    from safetensors import safe_open

    import quantkit
    from quantkit.modules.kv_cache import FP8KVCache

    out = tmp_path / "w4kv"
    assert main(["quantize", "ref:tiny", "--recipe", "w4a16-gptq-kv-fp8", "--out", str(out),
                 "--calib-samples", "8", "--calib-seq-len", "128"]) == 0
    capsys.readouterr()
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["kv_cache_scheme"]["type"] == "float" and qcfg["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        scales = [float(f.get_tensor(f"model.layers.{i}.self_attn.{kv}_scale")) for i in (0, 1) for kv in "kv"]
    assert all(s > 0 and s != 1.0 for s in scales), scales
    model = quantkit.load(out)
    assert float(model.model.layers[0].self_attn.k_scale) == scales[0]
    ids = torch.randint(0, 4096, (1, 12))
    generated = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert isinstance(generated.past_key_values, FP8KVCache)
