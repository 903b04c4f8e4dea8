"""The report's sentences, tables and plots say what the numbers show, on synthetic bench results
(fixed times and a fixed device: nothing here depends on the machine running the tests)."""

import json
import re

import pytest

from quantkit.harness import plots
from quantkit.harness.hardware import DeviceSpec
from quantkit.harness.formatting import fmt_perplexity_change
from quantkit.harness.report import _headline, render_report, summary_lines
from quantkit.harness.results import QualityResult, speedup_summary
from quantkit.harness.roofline import ModelShape, RooflineScheme, decode_cost, predict, prefill_cost

SHAPE = ModelShape(hidden=2048, intermediate=5632, layers=4, heads=32, kv_heads=8, head_dim=64, vocab=32000)
BF16 = RooflineScheme("bf16", 16)
W4 = RooflineScheme("w4a16-rtn", 4, 128)
CPU = DeviceSpec(name="test CPU", memory_bandwidth=10e9, peak_flops=100e9, memory_bytes=16e9, source="probe")
# what a bf16 matmul probe measures on a CPU without native bf16
EMULATED = DeviceSpec(name="AVX2 CPU", memory_bandwidth=11e9, peak_flops=0.3e9, memory_bytes=16e9, source="probe",
                      notes="bfloat16 matmul n=1536")


def synthetic_bench(spec: DeviceSpec, speed: dict[str, dict[str, float]], *, batches=(1,), skipped=()) -> dict:
    """A `quantkit bench` result with given median times: speed[variant][phase] scales the roofline time."""
    prefill, decode = [], []
    for scheme in (BF16, W4):
        for p in (64, 256):
            cost = prefill_cost(SHAPE, scheme, p)
            prefill.append(_record(scheme.name, cost, spec, speed[scheme.name]["prefill"], batch=1, prompt_len=p))
        for b in batches:
            for c in (128, 512):
                cost = decode_cost(SHAPE, scheme, c, b)
                decode.append(_record(scheme.name, cost, spec, speed[scheme.name]["decode"], batch=b, context_len=c))
    return {
        "schema": "quantkit.bench/1",
        "model": {"name": "synthetic", "shape": SHAPE.__dict__, "params": SHAPE.params, "dtype": "bfloat16"},
        "device": {"type": "cpu", "torch": "x", "name": spec.name, "threads": 2, "spec": spec.to_dict()},
        "settings": {"timer": "perf_counter", "warmup": 1, "repeats": 3, "memory_method": "tensor_bytes"},
        "variants": [{"name": s.name, "source": "float" if s is BF16 else "recipe:w4a16-rtn", "weight_bytes": 1e9}
                     for s in (BF16, W4)],
        "baseline": "bf16", "prefill": prefill, "decode": decode, "skipped": list(skipped),
        "command": "quantkit bench synthetic",
    }


def _record(variant, cost, spec, slowdown, **keys):
    pred = predict(cost, spec)
    median = pred.seconds * slowdown
    return {"variant": variant, **keys, "median_s": median, "times_s": [median],
            "memory": {"weights_bytes": 1e9, "kv_cache_bytes": 1e6, "peak_bytes": 1.001e9},
            "roofline": {**pred.to_dict(), "bytes": cost.total_bytes, "flops": cost.total_flops,
                         "bytes_breakdown": cost.bytes, "flops_breakdown": cost.flops,
                         "measured_over_predicted": slowdown},
            "achieved_bandwidth": cost.total_bytes / median, "achieved_flops": cost.total_flops / median}


@pytest.fixture
def no_plots(monkeypatch):
    """Text-only checks: skip drawing the PNGs (seconds each on a loaded machine)."""
    monkeypatch.setattr(plots, "bench_plots", lambda bench, out, colors=None: {})
    monkeypatch.setattr(plots, "quality_plots", lambda quality, out, colors=None: {})


SAME = {"bf16": {"prefill": 2.0, "decode": 2.0}, "w4a16-rtn": {"prefill": 2.0, "decode": 2.0}}


def test_headline_when_no_variant_gains_more_in_decode():
    summary = [{"variant": "w4", "prefill_measured": 1.2, "decode_measured": 0.9},
               {"variant": "w8", "prefill_measured": 1.1, "decode_measured": 1.0}]
    line = _headline(summary)
    assert line.startswith("Measured: decode speeds up less than prefill for every variant")
    mixed = _headline([summary[0], {"variant": "w8", "prefill_measured": 1.0, "decode_measured": 1.6}])
    assert "more than prefill for w8; decode speeds up less than prefill for w4" in mixed


def test_headline_names_ratios_equal_as_printed_no_difference(tmp_path, no_plots):
    # slow the quantized variant so both its measured speedups come out at 0.97x (0.9712 and 0.9738)
    pred = speedup_summary(synthetic_bench(CPU, {n: {"prefill": 1.0, "decode": 1.0} for n in ("bf16", "w4a16-rtn")}))[0]
    speed = {"bf16": {"prefill": 1.0, "decode": 1.0},
             "w4a16-rtn": {"prefill": pred["prefill_predicted"] / 0.9738, "decode": pred["decode_predicted"] / 0.9712}}
    bench = synthetic_bench(CPU, speed)
    line = _headline(speedup_summary(bench))
    assert line.startswith("Measured: the run shows no difference between the decode and prefill speedups")
    assert "w4a16-rtn 0.97x vs 0.97x" in line
    md = render_report(bench, [], tmp_path).read_text()
    assert "shows no difference between the decode and prefill speedups" in md and "more than prefill" not in md
    three = _headline([{"variant": "w8", "prefill_measured": 1.0, "decode_measured": 1.6},
                       {"variant": "w4", "prefill_measured": 1.2, "decode_measured": 0.9},
                       {"variant": "w4g", "prefill_measured": 1.004, "decode_measured": 0.996}])
    assert ("more than prefill for w8; decode speeds up less than prefill for w4; the run shows no difference "
            "between the decode and prefill speedups (their ranges overlap or they are equal as printed) for w4g (") in three
    # without repeats to bound them, a difference that shows in the printed digits still counts
    assert "more than prefill for w8" in _headline([{"variant": "w8", "prefill_measured": 0.97, "decode_measured": 0.98}])


def test_headline_claims_only_what_the_repeats_separate():
    def s(name, p, p_lo, p_hi, d, d_lo, d_hi):
        return {"variant": name, "prefill_measured": p, "prefill_low": p_lo, "prefill_high": p_hi,
                "decode_measured": d, "decode_low": d_lo, "decode_high": d_hi}

    line = _headline([s("w4", 0.7, 0.5, 0.9, 2.0, 1.8, 2.3), s("w8", 0.9, 0.7, 1.1, 1.2, 0.8, 1.5),
                      s("w4-asym", 1.0, 0.9, 1.1, 0.5, 0.4, 0.6)])
    assert line.startswith("Measured: decode speeds up more than prefill for w4; decode speeds up less than prefill "
                           "for w4-asym; the run shows no difference")
    assert line.rstrip(").").endswith("w4 2.00x [1.80-2.30] vs 0.70x [0.50-0.90], w8 1.20x [0.80-1.50] vs 0.90x "
                                      "[0.70-1.10], w4-asym 0.50x [0.40-0.60] vs 1.00x [0.90-1.10]")
    assert "for w8" in line.split("no difference")[1]


def test_noisy_repeats_support_no_claim(tmp_path, no_plots):
    """Repeats that range 48-536 ms (a loaded machine): medians alone would say decode gains more; the
    report says the run does not show it, and its tables show each spread."""
    speed = {"bf16": {"prefill": 1.0, "decode": 1.0}, "w4a16-rtn": {"prefill": 1.0, "decode": 0.5}}
    bench = synthetic_bench(CPU, speed)
    for r in bench["decode"]:
        r["times_s"] = [r["median_s"] * 0.2, r["median_s"], r["median_s"] * 2.5]
    md = render_report(bench, [], tmp_path).read_text()
    assert "more than prefill" not in md and "shows no difference" in md
    w4_row = next(line for line in md.split("Time per output token")[1].splitlines() if line.startswith("| w4a16-rtn"))
    assert re.search(r"\| [\d.]+ \[[\d.]+-[\d.]+\] \([\d.]+x, ranges overlap\)", w4_row), w4_row
    separated = synthetic_bench(CPU, speed)
    md = render_report(separated, [], tmp_path / "b").read_text()
    assert "decode speeds up more than prefill for w4a16-rtn" in md
    decode_tables = md.split("## Time per output token")[1].split("\n## ")[0]
    assert "x)" in decode_tables and "x, ranges overlap" not in decode_tables


def test_why_paragraph_follows_the_bound(tmp_path, no_plots):
    # ridge 1.6 flop/byte: a decode step at batch 4 does ~4 flop/byte, so it is compute-bound
    spec = DeviceSpec(name="slow-compute CPU", memory_bandwidth=10e9, peak_flops=16e9, memory_bytes=16e9,
                      source="probe")
    bench = synthetic_bench(spec, SAME, batches=(4,))
    md = render_report(bench, [], tmp_path).read_text()
    why = next(line for line in md.splitlines() if line.startswith("Why:"))
    decode_part = why[why.index("A decode step"):]
    assert "(compute-bound)" in decode_part and "set by the bytes" not in decode_part
    # a memory-bound decode names the weight cut that the records show, not a fixed ~3.9x
    md = render_report(synthetic_bench(CPU, SAME), [], tmp_path / "b").read_text()
    why = next(line for line in md.splitlines() if line.startswith("Why:"))
    w = [r for r in synthetic_bench(CPU, SAME)["decode"] if r["batch"] == 1 and r["context_len"] == 128]
    ratio = w[0]["roofline"]["bytes_breakdown"]["weights"] / w[1]["roofline"]["bytes_breakdown"]["weights"]
    assert "(memory-bound)" in why and f"w4a16-rtn cuts them {ratio:.1f}x" in why


def test_why_paragraph_says_when_quantized_decode_falls_short_of_the_roofline(tmp_path, no_plots):
    slow_kernels = {"bf16": {"prefill": 1.0, "decode": 1.0}, "w4a16-rtn": {"prefill": 1.0, "decode": 8.0}}
    md = render_report(synthetic_bench(CPU, slow_kernels), [], tmp_path).read_text()
    why = next(line for line in md.splitlines() if line.startswith("Why:"))
    assert "the baseline reaches 100% of the bandwidth, but w4a16-rtn gains" in why
    assert "their kernels, not the bytes they read, set their decode time" in why
    md = render_report(synthetic_bench(CPU, SAME), [], tmp_path / "b").read_text()
    assert "not the bytes they read" not in md


def test_why_paragraph_says_when_quantized_decode_gains_more_than_the_roofline(tmp_path, no_plots):
    slow_baseline = {"bf16": {"prefill": 1.0, "decode": 2.5}, "w4a16-rtn": {"prefill": 1.0, "decode": 1.0}}
    md = render_report(synthetic_bench(CPU, slow_baseline), [], tmp_path).read_text()
    why = next(line for line in md.splitlines() if line.startswith("Why:"))
    assert "w4a16-rtn gains" in why and "more than the roofline predicts: the baseline reaches only 40% of the" in why
    assert "not the bytes they read" not in why
    md = render_report(synthetic_bench(CPU, SAME), [], tmp_path / "b").read_text()
    assert "more than the roofline predicts" not in md


def test_why_paragraph_says_why_int8_prompts_beat_the_float_roofline(tmp_path, no_plots):
    fast_prompts = {"bf16": {"prefill": 2.0, "decode": 1.0}, "w4a16-rtn": {"prefill": 1.0, "decode": 1.0}}
    bench = synthetic_bench(CPU, fast_prompts)
    md = render_report(bench, [], tmp_path).read_text()
    assert "integer dot products" not in md  # only a variant that runs the C++ kernel is explained so
    bench["variants"][1]["kernels"] = "quantkit::wna16_cpu_q8dot (avx512-vnni) x 44"
    md = render_report(bench, [], tmp_path / "b").read_text()
    why = next(line for line in md.splitlines() if line.startswith("Why:"))
    assert "the quantized prompts gain more (w4a16-rtn 2.00x against a predicted" in why
    assert "integer dot products" in why
    bench = synthetic_bench(CPU, SAME)
    bench["variants"][1]["kernels"] = "quantkit::wna16_cpu_q8dot (avx512-vnni) x 44"
    assert "integer dot products" not in render_report(bench, [], tmp_path / "c").read_text()


def test_roofline_title_only_claims_what_the_points_show():
    bench = synthetic_bench(CPU, SAME)
    assert "left of the ridge" in plots._roofline_title(bench)  # ridge 10: decode ~1, prefill >> 10
    wide = synthetic_bench(DeviceSpec(name="x", memory_bandwidth=1e9, peak_flops=500e9, memory_bytes=1e9,
                                      source="probe"), SAME)  # ridge 500: prefill of 64 tokens is left of it
    assert "left of the ridge" not in plots._roofline_title(wide)


def test_no_roofline_from_a_nonsense_probe(tmp_path):
    bench = synthetic_bench(EMULATED, SAME)
    assert DeviceSpec.from_dict(bench["device"]["spec"]).roofline_problem
    md = render_report(bench, [], tmp_path).read_text()
    assert "TFLOP/s" not in md and "ridge 0" not in md and "## Measured against the roofline" not in md
    assert "Roofline: not shown, because the matmul probe (bfloat16 matmul n=1536) measured 0.3 GFLOP/s" in md
    assert "roofline" not in md.split("## Prefill versus decode speedup")[1].split("## Time to first")[0].lower()
    assert not (tmp_path / "roofline.png").exists() and (tmp_path / "speedups.png").exists()
    assert not any("of roofline" in line for line in summary_lines(bench))
    # a sound probe keeps it
    md = render_report(synthetic_bench(CPU, SAME), [], tmp_path / "ok").read_text()
    assert "## Measured against the roofline" in md and "ridge 10 flop/byte" in md


def test_skipped_shapes_read_as_text(tmp_path, no_plots):
    skipped = [{"phase": "decode", "context_len": 2048, "batch": 4, "reason": "KV cache 1.0 GiB > limit 0.5 GiB"}]
    md = render_report(synthetic_bench(CPU, SAME, skipped=skipped), [], tmp_path).read_text()
    assert "- decode, context 2048, batch 4: KV cache 1.0 GiB > limit 0.5 GiB" in md
    assert "{" not in md.split("## Skipped shapes")[1]


def test_tables_render_as_markdown(tmp_path, no_plots):
    table = "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |"
    md = render_report(synthetic_bench(CPU, SAME), [], tmp_path, notes=["A paragraph.", table]).read_text()
    assert table in md
    _assert_tables_contiguous(md)


def _assert_tables_contiguous(md: str) -> None:
    """Every Markdown table is one block: a header, a |---| rule and its rows, with no blank line inside."""
    for block in md.split("\n\n"):
        lines = [line for line in block.strip("\n").splitlines() if line]
        if lines and lines[0].startswith("|"):
            assert len(lines) >= 3 and re.match(r"^\|(\s*:?-+:?\s*\|)+$", lines[1]), block
            assert all(line.startswith("|") for line in lines), block


def test_one_colour_per_variant_across_plots():
    colors = plots.variant_colors(["bf16", "w8a16-rtn", "w4a16-rtn"], ["small-w8a16-rtn", "small-w4a16-rtn", "other"])
    assert colors["small-w8a16-rtn"] == colors["w8a16-rtn"] and colors["small-w4a16-rtn"] == colors["w4a16-rtn"]
    assert len({colors[n] for n in ("bf16", "w8a16-rtn", "w4a16-rtn", "other")}) == 4
    assert colors["bf16"] == plots.BASELINE_COLOR


def test_perplexity_change_says_when_it_is_noise(tmp_path, no_plots):
    assert fmt_perplexity_change(87.533, 87.536, 2e-4) == "-0.00% ± 0.04% (within noise)"
    assert fmt_perplexity_change(88.0, 87.5, 1e-3) == "+0.57% ± 0.20%"
    assert fmt_perplexity_change(88.0, None, 1e-3) == "–"
    quality = [QualityResult("w8a16-rtn", 87.533, 87.536, 4.7e-6, 0.998, log_ppl_ratio_stderr=2e-4, dtype="float32"),
               QualityResult("w4a16-rtn", 87.633, 87.536, 1.2e-3, 0.968, log_ppl_ratio_stderr=None, dtype="float32")]
    md = render_report(synthetic_bench(CPU, SAME), quality, tmp_path).read_text()
    assert "| w8a16-rtn | 87.536 | 87.533 | -0.00% ± 0.04% (within noise) |" in md
    assert "do not carry a standard error" in md  # the second result has none
    # quality in float32, speed in bfloat16: said plainly
    assert "Quality was measured in float32 and speed in bfloat16" in md
    payload = json.loads((tmp_path / "report.json").read_text())
    assert [q["within_noise"] for q in payload["quality"]] == [True, None]


def test_evaluation_measures_its_noise():
    import torch

    from quantkit.harness.quality import evaluate_variants

    torch.manual_seed(0)

    class Bigram(torch.nn.Module):
        def __init__(self, noise):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(64, 64) + noise * torch.randn(64, 64))

        def forward(self, ids):
            return type("Out", (), {"logits": self.table[ids]})()  # [B, T, V]

    base = Bigram(0.0)
    near = Bigram(0.0)
    near.table.data = base.table.data + 1e-3 * torch.randn(64, 64)
    windows = torch.randint(0, 64, (16, 32), generator=torch.Generator().manual_seed(1))
    result = evaluate_variants({"near": near}, base, windows, progress=False)["near"]
    assert result.dtype == "float32" and result.log_ppl_ratio_stderr > 0
    # the per-window changes average to the whole change in log-perplexity
    import math
    assert abs(math.log(result.perplexity / result.baseline_perplexity)) < 3 * result.log_ppl_ratio_stderr + 1e-3
    one = evaluate_variants({"near": near}, base, windows[:1], progress=False)["near"]
    assert one.log_ppl_ratio_stderr is None


def test_speedup_summary_of_synthetic_bench_is_ratio_of_times():
    speed = {"bf16": {"prefill": 1.0, "decode": 1.0}, "w4a16-rtn": {"prefill": 2.0, "decode": 1.0}}
    s = speedup_summary(synthetic_bench(CPU, speed))[0]
    assert s["prefill_measured"] == pytest.approx(s["prefill_predicted"] / 2.0)
    assert s["decode_measured"] == pytest.approx(s["decode_predicted"])
