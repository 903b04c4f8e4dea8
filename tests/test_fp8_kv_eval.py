"""Evaluating an FP8-KV model measures the FP8 cache: in memory after quantize, and loaded from disk."""

import copy

import pytest
import torch

import quantkit
from quantkit.harness.quality import evaluate_quality
from quantkit.modules.kv_cache import FP8KVCache, disable_fp8_kv_cache, fp8_cache_for, fp8_kv_cache_enabled

from .conftest import make_random_model

VOCAB = 512


@pytest.fixture(scope="module")
def kv_models():
    """(float model, the same model quantized in memory with the kv-fp8 recipe)."""
    float_model = make_random_model("llama", seed=5, vocab=VOCAB)
    g = torch.Generator().manual_seed(0)
    calibration = [torch.randint(0, VOCAB, (2, 64), generator=g) for _ in range(2)]
    fp8 = quantkit.quantize(copy.deepcopy(float_model), "kv-fp8", calibration, progress=False)
    return float_model, fp8


def _windows(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(seed))  # [N, W]


@torch.no_grad()
def test_forward_after_quantize_reads_the_fp8_cache(kv_models):
    float_model, fp8 = kv_models
    assert fp8_kv_cache_enabled(fp8) is not None
    ids = _windows(1)
    logits = fp8(ids).logits  # no cache given: a full prefill pass
    explicit = fp8(ids, cache=fp8_cache_for(fp8)).logits
    torch.testing.assert_close(logits, explicit, rtol=0, atol=0)
    assert (logits - float_model(ids).logits).abs().max() > 1e-4, "the FP8 cache must change the logits"
    out = fp8.generate(ids[:1, :8], max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, FP8KVCache)


@torch.no_grad()
def test_copies_and_disable_keep_their_own_forward(kv_models):
    float_model, fp8 = kv_models
    ids = _windows(2)
    twin = copy.deepcopy(fp8)
    torch.testing.assert_close(twin(ids).logits, fp8(ids).logits, rtol=0, atol=0)
    disable_fp8_kv_cache(twin)
    torch.testing.assert_close(twin(ids).logits, float_model(ids).logits, rtol=0, atol=0)


def test_eval_of_a_saved_kv_fp8_checkpoint_measures_the_fp8_cache(kv_models, tmp_path):
    float_model, fp8 = kv_models
    windows = _windows(3)
    in_memory = evaluate_quality(fp8, float_model, windows, progress=False)
    loaded = quantkit.load(quantkit.save(fp8, tmp_path / "kv"))
    from_disk = evaluate_quality(loaded, float_model, windows, progress=False)
    assert from_disk.kl_divergence > 0 and in_memory.kl_divergence > 0
    assert from_disk.kl_divergence == pytest.approx(in_memory.kl_divergence, rel=0.05)
    assert from_disk.perplexity != from_disk.baseline_perplexity
