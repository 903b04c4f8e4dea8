"""evals/kernels/bench_wna16.py runs end to end on CPU (Triton interpreted) and writes consistent JSON and Markdown."""

from __future__ import annotations

import json
import math

import torch

from .eval_scripts import load_eval_script
from .wna16_cases import tolerance

# On a GPU machine the same runs exercise the CUDA-graph timer on the Triton kernels.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ("triton",) if DEVICE == "cuda" else ("triton", "torch", "reference")


def test_bench_runs_every_cpu_backend_and_reports_consistently(tmp_path):
    bench = load_eval_script("bench_wna16")
    out = tmp_path / "bench"
    result = bench.main(["--out", str(out), "--quick", "--device", DEVICE, "--backends", ",".join(BACKENDS),
                         "--shapes", "256x64", "--ms", "1,3", "--schemes", "w4g128,w8ch", "--reps", "1",
                         "--max-copies", "1", "--dtypes", "float16,bfloat16"])
    saved = json.loads((out / "bench_wna16.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    assert saved["complete"] is True  # written after every row, marked complete at the end
    assert len(saved["rows"]) == 2 * len(BACKENDS) * 2  # schemes x backends x M
    assert saved["copy_bandwidth_GBps"] > 0
    for row in saved["rows"]:
        assert row["bytes"] == bench.moved_bytes(bench.SCHEMES[row["scheme"]], row["M"], 256, 64)
        for tag in ("float16", "bfloat16"):
            assert math.isfinite(row[f"speedup_{tag}"]) and row[f"speedup_{tag}"] > 0
            assert math.isclose(row[f"speedup_{tag}"], row[f"matmul_us_{tag}"] / row[f"us_{tag}"], rel_tol=1e-9)
            # the torch backend computes in bf16 whatever the dtype
            assert row[f"rel_err_{tag}"] <= tolerance(torch.bfloat16), row
    markdown = (out / "bench_wna16.md").read_text()
    side_by_side = {(r["scheme"], r["M"]) for r in saved["rows"]}  # one line per scheme x M comparing backends
    assert markdown.count("| 256x64 |") == len(saved["rows"]) + len(side_by_side)
    assert "Measured copy bandwidth" in markdown
    assert "## Side by side (float16)" in markdown


def test_bench_reports_peers_it_cannot_run(tmp_path):
    """tinygemm and gemlite are timed on CUDA only: elsewhere (or without gemlite) each is listed as skipped
    with its reason, never silently dropped."""
    bench = load_eval_script("bench_wna16")
    result = bench.main(["--out", str(tmp_path), "--device", DEVICE, "--backends", "triton,tinygemm,gemlite",
                         "--shapes", "256x64", "--ms", "1", "--schemes", "w8ch", "--reps", "1", "--max-copies", "1"])
    assert [r["backend"] for r in result["rows"]] == ["triton"]  # int8: no peer runs it
    reasons = {s["backend"]: s["reason"] for s in result["skipped"]}
    assert set(reasons) == {"tinygemm", "gemlite"}
    assert "int4 only" in reasons["tinygemm"]
    assert "## Skipped" in (tmp_path / "bench_wna16.md").read_text()


def test_bench_sweep_times_alternative_configs(tmp_path):
    bench = load_eval_script("bench_wna16")
    result = bench.main(["--out", str(tmp_path), "--device", DEVICE, "--backends", "triton", "--shapes", "256x64",
                         "--ms", "1", "--schemes", "w4g128", "--reps", "1", "--max-copies", "1", "--sweep"])
    (row,) = result["rows"]
    assert len(row["sweep"]) >= 10
    assert all("us" in s for s in row["sweep"]), [s for s in row["sweep"] if "error" in s]
    assert {s["config"]["algo"] for s in row["sweep"]} == {"gemv", "dot", "dequant"}
    assert "## Sweep" in (tmp_path / "bench_wna16.md").read_text()
