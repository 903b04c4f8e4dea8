"""Fixtures of the kernel tests (which run the Triton kernels in Triton's interpreter without a GPU: the
TRITON_INTERPRET default is set in tests/conftest.py, before any test module is collected)."""

import pytest


@pytest.fixture
def aten_cpu_path(monkeypatch):
    """The "torch" backend on PyTorch's own CPU kernels (the fallback where quantkit's C++ kernel does not
    build): what the tests of that path pin, on machines where the C++ kernel is available too."""
    from quantkit.kernels import wna16
    from quantkit.kernels.cpu_extension import CpuKernels

    monkeypatch.setattr(wna16, "load_cpu_kernels", lambda: CpuKernels(False, "the aten path, forced by a test"))
