"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter when no GPU is present.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when quantkit.kernels is first imported,
so it is set here, before any test module of this folder imports quantkit. (pytest collects this
folder before the tests/test_*.py files, which import quantkit too.)
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
