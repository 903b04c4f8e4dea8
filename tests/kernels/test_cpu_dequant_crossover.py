"""evals/kernels/cpu_dequant_crossover.py on a tiny layer: runs, and its paths agree with each other."""

from __future__ import annotations

import json

import torch

from .eval_scripts import load_eval_script


def test_crossover_bench_runs_and_its_paths_agree(tmp_path):
    bench = load_eval_script("cpu_dequant_crossover")
    result = bench.main(["--out", str(tmp_path), "--shape", "256x128", "--ms", "2,40", "--reps", "1",
                         "--threads", "1"])
    saved = json.loads((tmp_path / "cpu_dequant_crossover.json").read_text())
    assert len(saved["rows"]) == len(result["rows"]) == 2 * 2 * 2  # formats x dtypes x M
    assert all(r["fused_vs_dense"] > 0 and r["dequant_vs_dense"] > 0 for r in saved["rows"])
    assert "| int4 | bfloat16 | 40 |" in (tmp_path / "cpu_dequant_crossover.md").read_text()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 256, generator=gen)
    for fmt in ("int4", "int8"):
        calls = bench.paths(fmt, bench.layer(fmt, 256, 128, gen), torch.zeros(128, 256), x)
        fused, dequant = calls["fused"]().float(), calls["dequantize_once"]().float()
        assert ((fused - dequant).abs().mean() / fused.abs().mean()).item() < 2 ** -7  # same weight, bf16 order
