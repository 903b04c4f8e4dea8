"""The decode step of a model on the Triton backend compiles without graph breaks (interpreted on CPU)."""

import pytest
import torch

import quantkit.kernels as qk

from ..test_bench_compile import assert_decode_step_compiles


@pytest.mark.slow  # 10-100 s interpreted on 2 CPU cores, depending on their load
@pytest.mark.skipif(not (torch.cuda.is_available() or qk.kernels_interpreted()),
                    reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_decode_step_compiles_fullgraph(tmp_path):
    assert_decode_step_compiles("triton", "w4a16-rtn", tmp_path)
