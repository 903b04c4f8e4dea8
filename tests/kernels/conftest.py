"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter when no GPU is present.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when quantkit.kernels is first imported,
so it is set here, before any test module of this folder imports quantkit. (pytest collects this
folder before the tests/test_*.py files, which import quantkit too.)
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture
def aten_cpu_path(monkeypatch):
    """The "torch" backend on PyTorch's own CPU kernels (the fallback where quantkit's C++ kernel does not
    build): what the tests of that path pin, on machines where the C++ kernel is available too."""
    from quantkit.kernels import wna16
    from quantkit.kernels.cpu_extension import CpuKernels

    monkeypatch.setattr(wna16, "load_cpu_kernels", lambda: CpuKernels(False, "the aten path, forced by a test"))
