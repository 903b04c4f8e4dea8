"""Where the Triton kernels run: ``kernels_interpreted()`` (under Triton's interpreter, on CPU tensors) and
``triton_can_run_on(device)``. Asked by the entry points (``triton_ops``, which re-exports both) and by the
kernel modules themselves; imports neither triton nor the kernel modules, so it is cheap and on no cycle.
Depends on torch only.
"""

from __future__ import annotations

import os
import sys

import torch

#: what triton reads as true in TRITON_INTERPRET (its getenv_bool: case-insensitive, nothing stripped)
_TRUE = ("1", "true", "on", "yes", "y")


def kernels_interpreted() -> bool:
    """True when the Triton kernels run under Triton's interpreter (on CPU tensors).

    Once the kernels are built: what triton decided then. Before: what it would decide now (triton's
    knob if triton is imported, else the TRITON_INTERPRET variable, read as triton reads it)."""
    kernels = sys.modules.get(f"{__package__}.wna16_triton")
    if kernels is not None:
        return kernels.KERNELS_INTERPRETED
    triton = sys.modules.get("triton")
    if triton is not None and hasattr(triton, "knobs"):
        return bool(triton.knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUE


def triton_can_run_on(device: torch.device | str) -> bool:
    """CUDA tensors always; CPU tensors when the kernels run under Triton's interpreter."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and kernels_interpreted())
