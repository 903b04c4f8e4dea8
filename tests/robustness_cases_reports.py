"""Results files and workloads that `report` and `advise` must refuse: impossible numbers, prompts beyond the context."""

from __future__ import annotations

import json
import math

from .robustness_cases import Case

GOOD_QUALITY = {"recipe": "w4a16-rtn", "perplexity": 12.0, "baseline_perplexity": 11.0, "kl_divergence": 0.02,
                "top1_agreement": 0.9, "window": 256, "windows": 4, "tokens": 1020, "log_ppl_ratio_stderr": 0.01}


def _quality_file(work, **changes) -> str:
    path = work / "quality.json"
    path.write_text(json.dumps(GOOD_QUALITY | changes) + "\n")  # json writes NaN as the bare word NaN
    return str(path)


def _advise(work, **changes):
    return ["advise", "ref:tiny", "--gpu", "h200", "--prompt-len", "64", "--output-len", "64",
            "--quality", _quality_file(work, **changes)]


def _report(work, **changes):
    return ["report", "--quality", _quality_file(work, **changes), "--out", str(work / "report")]


def _bench_file(work, edit) -> str:
    """A minimal bench JSON of two variants, changed by ``edit``."""
    def record(variant, **shape):
        return {"variant": variant, "batch": 1, **shape, "median_s": 0.01, "times_s": [0.01, 0.011],
                "roofline": {"predicted_s": 0.005, "intensity": 1.0, "measured_over_predicted": 2.0, "bound": "memory"}}
    bench = {"schema": "quantkit.bench/1",
             "variants": [{"name": "bf16", "weight_bytes": 100}, {"name": "w4", "weight_bytes": 30}],
             "device": {"spec": {"memory_bandwidth": 1e10, "peak_flops": 1e11}},
             "prefill": [record("bf16", prompt_len=16), record("w4", prompt_len=16)],
             "decode": [record("bf16", context_len=16), record("w4", context_len=16)]}
    edit(bench)
    path = work / "bench.json"
    path.write_text(json.dumps(bench) + "\n")
    return str(path)


def _report_bench(edit):
    return lambda work: ["report", "--bench", _bench_file(work, edit), "--out", str(work / "report")]


def _set(phase, key, value):
    def edit(bench):
        bench[phase][1][key] = value
    return edit


CASES = [
    Case("advise-nan-perplexity", "`advise --quality` whose perplexity is NaN",
         lambda w: _advise(w, perplexity=math.nan), "perplexity is nan; allowed: a finite number in [1, inf)"),
    Case("report-negative-perplexity", "`report --quality` with a negative perplexity",
         lambda w: _report(w, perplexity=-3.0), "perplexity is -3.0", creates="report"),
    Case("advise-negative-kl", "`advise --quality` with KL divergence -1",
         lambda w: _advise(w, kl_divergence=-1), "kl_divergence is -1; allowed"),
    Case("report-top1-700", "`report --quality` with top-1 agreement 7 (700%)",
         lambda w: _report(w, top1_agreement=7.0), "top1_agreement is 7.0; allowed: a finite number in [0, 1]",
         creates="report"),
    Case("report-zero-baseline-ppl", "`report --quality` with a baseline perplexity of 0",
         lambda w: _report(w, baseline_perplexity=0), "baseline_perplexity is 0", creates="report"),
    Case("report-string-perplexity", "`report --quality` with perplexity as a string",
         lambda w: _report(w, perplexity="12.0"), "perplexity is '12.0'", creates="report"),
    Case("report-bench-nan-time", "`report --bench` with a NaN median time",
         _report_bench(_set("decode", "median_s", math.nan)), "decode[1].median_s is nan", creates="report"),
    Case("report-bench-negative-repeat", "`report --bench` with a negative repeat time",
         _report_bench(_set("prefill", "times_s", [0.01, -0.5])), "prefill[1].times_s[1] is -0.5", creates="report"),
    Case("report-bench-unknown-variant", "`report --bench` with a record of a variant it does not list",
         _report_bench(_set("prefill", "variant", "w3")), "prefill[1].variant is 'w3'", creates="report"),
    Case("advise-prompt-beyond-context", "`advise --prompt-len 2048` for a model of 256 positions",
         lambda w: ["advise", "ref:tiny", "--gpu", "h200", "--prompt-len", "2048", "--output-len", "16"],
         "longer than the model's context of 256"),
    Case("advise-output-beyond-context", "`advise` whose prompt fits but prompt + output does not",
         lambda w: ["advise", "ref:tiny", "--gpu", "h200", "--prompt-len", "200", "--output-len", "100"],
         "longer than the model's context of 256"),
]
