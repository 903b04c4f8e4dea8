"""kernels/ ships as quantkit.kernels; imported as a top-level `kernels` (repository root on sys.path, as
under pytest, where transformers' hub-kernels probe imports it) it must stay inert."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_top_level_kernels_import_is_inert_and_transformers_still_loads():
    code = (
        "import quantkit.kernels, kernels, torch\n"
        "assert kernels.__all__ == [] and len(quantkit.kernels.__all__) > 5\n"
        "from transformers import LlamaConfig\n"
        "assert hasattr(torch.ops.quantkit, 'wna16_int4_cpu')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
