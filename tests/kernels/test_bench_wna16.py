"""evals/kernels/bench_wna16.py runs end to end on CPU (Triton interpreted) and writes consistent JSON and Markdown."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

from .wna16_cases import tolerance

SCRIPT = Path(__file__).resolve().parents[2] / "evals" / "kernels" / "bench_wna16.py"
# On a GPU machine the same runs exercise the CUDA-graph timer on the Triton kernels.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ("triton",) if DEVICE == "cuda" else ("triton", "torch", "reference")


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_wna16", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bench_runs_every_cpu_backend_and_reports_consistently(tmp_path):
    bench = _load_bench()
    out = tmp_path / "bench"
    result = bench.main(["--out", str(out), "--device", DEVICE, "--backends", ",".join(BACKENDS),
                         "--shapes", "256x64", "--ms", "1,3", "--schemes", "w4g128,w8ch", "--reps", "1",
                         "--max-copies", "1", "--dtypes", "float16,bfloat16"])
    saved = json.loads((out / "bench_wna16.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
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
    assert markdown.count("| 256x64 |") == len(saved["rows"])
    assert "Measured copy bandwidth" in markdown


def test_bench_sweep_times_alternative_configs(tmp_path):
    bench = _load_bench()
    result = bench.main(["--out", str(tmp_path), "--device", DEVICE, "--backends", "triton", "--shapes", "256x64",
                         "--ms", "1", "--schemes", "w4g128", "--reps", "1", "--max-copies", "1", "--sweep"])
    (row,) = result["rows"]
    assert len(row["sweep"]) >= 10
    assert all("us" in s for s in row["sweep"]), [s for s in row["sweep"] if "error" in s]
    assert {s["config"]["algo"] for s in row["sweep"]} == {"gemv", "dot", "dequant"}
    assert "## Sweep" in (tmp_path / "bench_wna16.md").read_text()
