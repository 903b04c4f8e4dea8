"""The C++ decode loop with a Hadamard-rotated fp8 cache: its logits against transformers with quantkit's
rotated FP8 cache (the prompt runs there, so both store the same codes of k H and v H)."""

import pytest
import torch

import quantkit
from quantkit.modules.kv_cache import fp8_cache_for
from quantkit.modules.kv_scales import attach_kv_scales, attach_rotated_kv_scales

from .test_cpu_decoder import (
    assert_close_logits, decoder_steps, float_model, fp8_transformers_steps, random_inputs,
)

pytestmark = pytest.mark.skipif(quantkit.runtime.cpu_decoder.decoder_unavailable(float_model()) is not None,
                                reason="quantkit's C++ CPU kernels are not available here")


@pytest.mark.parametrize("per_head", [False, True])
def test_rotated_fp8_loop_matches_transformers_with_the_rotated_fp8_cache(per_head):
    """Same tolerance as the unrotated fp8 test (a key near a code boundary may take the neighbour)."""
    model = float_model()
    heads = model.config.num_key_value_heads
    g = torch.Generator().manual_seed(3)

    def draw():
        return {i: (torch.rand(heads if per_head else 1, generator=g) * 0.01 + 0.002,
                    torch.rand(heads if per_head else 1, generator=g) * 0.01 + 0.002) for i in range(2)}

    plain, rotated = draw(), draw()
    attach_kv_scales(model, plain)
    attach_rotated_kv_scales(model, rotated, "hadamard")
    assert fp8_cache_for(model).rotation == "hadamard"
    decoder = quantkit.CpuDecoder(model, max_len=300)
    assert decoder.cache_dtype == "fp8" and decoder.rotation == "hadamard"
    ids, tokens = random_inputs(model.config.vocab_size, 2, 250, 12, seed=4)
    got, want = decoder_steps(decoder, ids, tokens), fp8_transformers_steps(model, ids, tokens)
    assert_close_logits(got, want, 1e-3)
    unrotated = fp8_transformers_steps(model, ids, tokens, rotation="none")
    assert (got - unrotated).abs().max() > 5e-3  # the loop did rotate: the unrotated cache rounds otherwise
