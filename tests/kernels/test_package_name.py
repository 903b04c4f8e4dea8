"""The kernels ship inside the package (quantkit/kernels/): the repository root holds no top-level `kernels`
package, which would shadow the hub `kernels` package transformers (>= 5.25) depends on and imports
whenever Python runs from the repository root (python -m pytest, the eval scripts)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_repository_root_shadows_no_kernels_package():
    assert not (ROOT / "kernels").exists()
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.find_spec('kernels')\n"
        f"assert spec is None or not spec.origin or not spec.origin.startswith({str(ROOT)!r} + '/kernels'), spec\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "import quantkit.kernels, torch\n"
        "assert hasattr(torch.ops.quantkit, 'wna16_int4_cpu')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_quantkit_kernels_is_the_package_folder():
    spec = importlib.util.find_spec("quantkit.kernels")
    assert Path(spec.origin).resolve() == ROOT / "quantkit" / "kernels" / "__init__.py"
