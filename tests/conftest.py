"""Shared fixtures: small random models of several families (dimensions real kernels accept)."""

from __future__ import annotations

import sys

import pytest
import torch

FAMILIES = ("llama", "mistral", "qwen2")


def make_random_model(family: str = "llama", *, seed: int = 0, vocab: int = 512, layers: int = 2, tied: bool = True,
                      hidden: int = 128, intermediate: int = 384):
    """A random-initialised causal LM: hidden 128, intermediate 384 (by default), 4 heads, 2 KV heads (GQA)."""
    import transformers

    common = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256, tie_word_embeddings=tied)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    torch.manual_seed(seed)
    return model_cls(config_cls(**common)).eval()


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
