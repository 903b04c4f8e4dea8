"""A dry run of evals/reports/gpu_script.sh on CPU with a tiny model, so the GPU report script cannot rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_bench import TINY_LLAMA

SCRIPT = Path(__file__).resolve().parents[1] / "evals" / "reports" / "gpu_script.sh"


@pytest.mark.slow
def test_gpu_script_dry_run_on_cpu(tmp_path):
    config = tmp_path / "tiny-llama.json"
    config.write_text(json.dumps(TINY_LLAMA))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "SKIP_INSTALL": "1", "DEVICE": "cpu", "CONFIG": str(config),
           "PROMPTS": "16", "CONTEXTS": "16", "BATCHES": "1", "COMPILE_BACKEND": "eager", "WARMUP": "1",
           "REPEATS": "1", "ROOFLINE": "h200", "VARIANTS": "w4a16-rtn", "KV_VARIANTS": "kv-fp8",
           "OMP_NUM_THREADS": "1"}
    env.update({f"LIMIT_{part}": "900" for part in ("COMPILED", "KV", "EAGER")})  # the limits are for the GPU
    done = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (out / "gpu_script.log").is_file()
    for part, variants, mode in (("compiled", ["w4a16-rtn"], "compiled (eager)"),
                                 ("compiled-kv", ["kv-fp8"], "compiled (eager)"),
                                 ("eager", ["w4a16-rtn", "kv-fp8"], "eager")):
        bench = json.loads((out / part / "bench.json").read_text())
        assert [v["name"] for v in bench["variants"]][1:] == variants
        assert {r["mode"] for r in bench["decode"]} == {mode}
        assert all(r["bandwidth_fraction"] > 0 for r in bench["decode"])
        report = (out / part / "report.md").read_text()
        assert "gpu_script.sh" in report and "% of bandwidth" in report
