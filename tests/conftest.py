"""Shared fixtures: small random models of several families (dimensions real kernels accept).

Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter. Triton reads TRITON_INTERPRET
when a kernel is decorated, so it is set here, before any test module is collected: some import triton
before quantkit does (transformers' fine-grained fp8 integration, for one).
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fixtures.random_models import make_random_model  # noqa: E402, F401 (the tests import it from here)

FAMILIES = ("llama", "mistral", "qwen2")


@pytest.fixture
def random_model_folder(tmp_path):
    """Factory: save a random model (float32, safetensors) to a folder and return its path."""

    def make(family: str = "llama", **kwargs):
        model = make_random_model(family, **kwargs)
        folder = tmp_path / f"{family}-float"
        model.save_pretrained(folder)
        return folder

    return make


@pytest.fixture(autouse=True)
def _no_vllm_engine_state_left():
    """After each test, tear down what a vLLM engine built in this process left: its distributed groups.

    vLLM builds them once per process and reuses them: an engine whose construction failed (the FP8-KV
    refusal on a CPU without AVX-512) leaves a dense model's groups, which have no expert-parallel group,
    and the next MoE engine stops on "expert parallel group is not initialized". Nothing is done where vLLM
    was never imported."""
    yield
    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is not None and state.model_parallel_is_initialized():
        state.cleanup_dist_env_and_memory()
