"""Load a script of evals/kernels/ as a module, for the tests that run it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EVALS_KERNELS = Path(__file__).resolve().parents[2] / "evals" / "kernels"


def load_eval_script(name: str) -> ModuleType:
    """evals/kernels/<name>.py as a fresh module called <name>, registered in sys.modules (dataclasses
    look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, EVALS_KERNELS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
