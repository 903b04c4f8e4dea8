"""`quantkit report` renders Markdown + JSON + PNG plots from bench and quality results."""

import argparse
import json
import re
import statistics

import pytest
import torch

from quantkit.commands.cli import main
from quantkit.harness.hardware import DeviceSpec
from quantkit.harness.results import load_bench, load_quality, speedup_summary, speedups
from quantkit.harness.timing import BenchSettings, run_bench
from quantkit.harness.variants import build_variant, float_variant, load_source_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# A fixed device: what the roofline predicts must not depend on the machine running the tests (a
# probe on a CPU without native bf16 measures a matmul peak below its GEMV rate).
TEST_DEVICE = DeviceSpec(name="test CPU", memory_bandwidth=20e9, peak_flops=400e9, memory_bytes=16e9, source="probe")
TINY_LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=4096, max_position_embeddings=256)


@pytest.fixture(scope="module")
def bench_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = tmp / "tiny.json"
        config.write_text(json.dumps(TINY_LLAMA))
        model = load_source_model(str(config), dtype=torch.bfloat16, device="cpu")
        variants = [float_variant(model), build_variant("w4a16-rtn", model, dtype=torch.bfloat16, device="cpu",
                                                         backend="reference")]
        spec = TEST_DEVICE
        settings = BenchSettings(prompt_lens=[8, 32], context_lens=[8, 32], batch_sizes=[1, 2], warmup=0, repeats=2)
        data = run_bench(variants, spec, settings, device="cpu", model_label="tiny-random", progress=False)
    finally:
        torch.set_num_threads(threads)
    path = tmp / "bench.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def quality_files(tmp_path):
    a = tmp_path / "w8.json"
    a.write_text(json.dumps({"recipe": "w8a16-rtn", "perplexity": 20.1, "baseline_perplexity": 20.0,
                             "kl_divergence": 0.002, "top1_agreement": 0.99}))
    b = tmp_path / "w4.json"
    b.write_text(json.dumps({"recipe": "w4a16-rtn", "perplexity": 21.0, "baseline_perplexity": 20.0,
                             "kl_divergence": 0.03, "top1_agreement": 0.95}))
    return [a, b]


def _report_parser():
    from quantkit.commands import report

    parser = argparse.ArgumentParser()
    report.register(parser.add_subparsers())
    return parser


def test_report_renders_with_plots(bench_file, quality_files, tmp_path):
    out = tmp_path / "report"
    args = _report_parser().parse_args(["report", "--bench", str(bench_file), "--quality", *map(str, quality_files),
                                        "--out", str(out), "--note", "A test note."])
    assert args.func(args) == 0
    md = (out / "report.md").read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert set(images) == {"speedups.png", "ttft_vs_prompt.png", "tpot_vs_context.png", "roofline.png", "quality.png"}
    for name in images:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name
    for heading in ("## Prefill versus decode speedup", "## Time to first token", "## Time per output token",
                    "## Measured against the roofline", "## Memory", "## Quality"):
        assert heading in md
    assert "A test note." in md and "w8a16-rtn" in md and "+5.00%" in md
    assert "Measured: " in md and " (speedup of decode vs prefill, median [range over the lengths and repeats]: " in md
    payload = json.loads((out / "report.json").read_text())
    assert payload["bench"]["schema"] == "quantkit.bench/1"
    assert [q["name"] for q in payload["quality"]] == ["w8a16-rtn", "w4a16-rtn"]
    assert payload["quality"][1]["perplexity_increase"] == pytest.approx(0.05)


def test_report_without_quality_says_so(bench_file, tmp_path):
    out = tmp_path / "report"
    args = _report_parser().parse_args(["report", "--bench", str(bench_file), "--out", str(out)])
    assert args.func(args) == 0
    md = (out / "report.md").read_text()
    assert "No `quantkit eval` results" in md and not (out / "quality.png").exists()


def test_speedups_are_ratios_of_medians(bench_file):
    bench = load_bench(bench_file)
    decode = speedups(bench, "decode")
    assert {s["variant"] for s in decode} == {"w4a16-rtn"} and len(decode) == 4
    s = decode[0]
    rows = {r["variant"]: r for r in bench["decode"] if r["batch"] == s["batch"] and r["context_len"] == s["context_len"]}
    assert s["measured"] == pytest.approx(rows["bf16"]["median_s"] / rows["w4a16-rtn"]["median_s"])
    # the range the repeats allow: slowest baseline over fastest variant repeat, and the other way round
    base_t, w4_t = rows["bf16"]["times_s"], rows["w4a16-rtn"]["times_s"]
    assert s["low"] == pytest.approx(min(base_t) / max(w4_t)) and s["high"] == pytest.approx(max(base_t) / min(w4_t))
    assert s["low"] <= s["measured"] <= s["high"]
    assert s["separated"] == (min(base_t) > max(w4_t) or max(base_t) < min(w4_t))
    summary = speedup_summary(bench)
    assert [x["variant"] for x in summary] == ["w4a16-rtn"]
    # roofline of the fixed device: prefill barely moves, decode gains (the tiny model's bf16 lm_head limits it)
    assert summary[0]["decode_predicted"] > summary[0]["prefill_predicted"]
    assert summary[0]["decode_predicted"] == pytest.approx(statistics.median(
        s["predicted"] for s in decode if s["batch"] == 1))


def test_bad_inputs_are_named(tmp_path, capsys):
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="quantkit bench --json"):
        load_bench(wrong)
    with pytest.raises(ValueError, match="quantkit eval"):
        load_quality([wrong])
    assert main(["report", "--out", str(tmp_path / "r")]) == 2
    assert "nothing to report" in capsys.readouterr().err
    lst = tmp_path / "list.json"
    lst.write_text(json.dumps([{"variant": "a", "perplexity": 3.0}, {"name": "b", "perplexity": 4.0}]))
    assert [q.name for q in load_quality([lst])] == ["a", "b"]
