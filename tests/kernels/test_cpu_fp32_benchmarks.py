"""evals/kernels/cpu_activation_paths.py and cpu_auto_generate.py, small: they run, and what they time is one computation."""

from __future__ import annotations

import json

import pytest
import torch

from .eval_scripts import load_eval_script
from .wna16_cases import tolerance


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_activation_paths_bench_runs_and_its_paths_agree(dtype, tmp_path):
    bench = load_eval_script("cpu_activation_paths")
    bench.main(["--out", str(tmp_path), "--shapes", "256x128", "--ms", "2,40", "--reps", "1", "--threads", "1",
                "--dtype", dtype])
    saved = json.loads((tmp_path / f"cpu_activation_paths_{dtype}.json").read_text())
    assert len(saved["rows"]) == 2 * 2  # formats x M
    assert all(r["fused_bf16_vs_dense"] > 0 and r["dequant_fp32_vs_dense"] > 0 for r in saved["rows"])
    assert tuple("fused_native_vs_dense" in r for r in saved["rows"][:2]) == (True, False)  # timed up to M = 8
    assert "| 256x128 | int8 | 40 |" in (tmp_path / f"cpu_activation_paths_{dtype}.md").read_text()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 256, generator=gen).to(getattr(torch, dtype))
    for fmt in ("int4", "int8"):
        calls = bench.paths(fmt, bench.layer(fmt, 256, 128, gen), torch.zeros(128, 256, dtype=x.dtype), x, True)
        exact = calls.pop("reference")().double()
        del calls["dense"]
        for name, call in calls.items():  # the same weight: within the bf16 scales' and activations' rounding
            y = call()
            assert y.dtype == x.dtype, name
            err = ((y.double() - exact).abs().mean() / exact.abs().mean()).item()
            assert err < tolerance(torch.bfloat16), f"{fmt} {name}: {err:.2e}"


def test_auto_generate_bench_runs_on_a_tiny_model(tmp_path):
    bench = load_eval_script("cpu_auto_generate")
    bench.main(["--out", str(tmp_path), "--models", "ref:tiny", "--reference-on", "ref:tiny", "--rounds", "1",
                "--new-tokens", "2", "--prompt", "4", "--threads", "1"])
    saved = json.loads((tmp_path / "cpu_auto_generate.json").read_text())
    (row,) = saved["models"]
    assert list(row["variants"]) == ["float", "auto", "reference"]
    assert row["variants"]["auto"]["backends"] == ["torch"] and row["variants"]["reference"]["backends"] == ["reference"]
    assert all(v["median_s"] > 0 for v in row["variants"].values())
    assert "| ref:tiny |" in (tmp_path / "cpu_auto_generate.md").read_text()
