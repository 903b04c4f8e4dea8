"""The FP8 KV cache in generation: same tokens as a fake-quantized reference, saturation, GQA,
batch 2 with left padding, sliding windows, the generate() hook and the kernel attention path."""

import warnings

import pytest
import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from quantkit.calibration.kv_scales import quantize_kv_cache
from quantkit.modules.kv_scales import attach_kv_scales, cache_keyword, read_kv_scales
from quantkit.kernels import decode_attention as decode_attention_module
from quantkit.modules.kv_cache import (
    FP8KVCache, FP8SlidingWindowKVLayer, disable_fp8_kv_cache, enable_fp8_kv_cache, fp8_cache_for,
    fp8_kv_cache_enabled,
)

from .conftest import make_random_model

FP8 = torch.float8_e4m3fn
VOCAB = 512


class FakeQuantLayer(DynamicLayer):
    """Reference: a plain DynamicLayer holding fp8 round-tripped K/V (same scales), written independently."""

    def __init__(self, k_scale, v_scale):
        super().__init__()
        self.scales = (k_scale.float().reshape(1, -1, 1, 1), v_scale.float().reshape(1, -1, 1, 1))

    def update(self, key_states, value_states, *args, **kwargs):
        def round_trip(x, s):
            return ((x.float() / s).clamp(-448, 448).to(FP8).float() * s).to(x.dtype)

        return super().update(round_trip(key_states, self.scales[0]), round_trip(value_states, self.scales[1]))


def reference_cache(scales):
    return Cache(layers=[FakeQuantLayer(*scales[i]) for i in sorted(scales)])


def calibrated_model(family="llama", dtype=torch.float32, per_head=False, seed=0):
    """A random GQA model with calibrated k_scale/v_scale buffers, and those scales as stored (model dtype)."""
    model = make_random_model(family, seed=seed, vocab=VOCAB).to(dtype)
    quantize_kv_cache(model, [torch.randint(0, VOCAB, (2, 48))], per_head=per_head)
    scales, missing = read_kv_scales(model)
    assert not missing
    return model, scales


def left_padded_batch(lengths=(20, 13)):
    """Batch 2, the shorter prompt left-padded: ids [2, T], attention_mask [2, T]."""
    total = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), total))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, total - n:] = 1
        ids[row, : total - n] = 0
    return ids, mask


def cache_arg(model, cache) -> dict:
    """The forward/generate keyword for a cache: `cache` (transformers >= 5.24) or `past_key_values`."""
    return {cache_keyword(model): cache}


def generated_cache(out):
    """The cache generate() returned (`cache` from transformers 5.24, `past_key_values` before)."""
    return out.cache if hasattr(out, "cache") else out.past_key_values


def greedy(model, ids, mask, cache=None, new_tokens=12, with_logits=False):
    """Greedy generation: token ids [B, T + new_tokens] (and the logits of each step [steps, B, V])."""
    kwargs = cache_arg(model, cache) if cache is not None else {}
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True, **kwargs)
    return (out.sequences, torch.stack(out.logits)) if with_logits else out.sequences


@pytest.mark.parametrize("family,dtype,per_head", [
    ("llama", torch.float32, False), ("qwen2", torch.bfloat16, True), ("mistral", torch.float32, False),
])
def test_greedy_tokens_match_fake_quant_reference(family, dtype, per_head):
    model, scales = calibrated_model(family, dtype, per_head)  # GQA: 4 query heads, 2 KV heads
    ids, mask = left_padded_batch()
    expected, expected_logits = greedy(model, ids, mask, cache=reference_cache(scales), with_logits=True)
    cache = fp8_cache_for(model)
    tokens, logits = greedy(model, ids, mask, cache=cache, with_logits=True)
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    layer = cache.layers[0]
    assert layer.keys.dtype == FP8 and layer.values.dtype == FP8
    assert layer.keys.shape == (2, 2, ids.shape[1] + 11, 32)  # the last token is never fed back


def test_logits_match_reference_step_by_step():
    model, scales = calibrated_model("llama")
    ids, mask = left_padded_batch((16, 9))
    fp8, ref = fp8_cache_for(model), reference_cache(scales)
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask, **cache_arg(model, fp8))
        b = model(input_ids=ids, attention_mask=mask, **cache_arg(model, ref))
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)
        for _ in range(3):
            token = a.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            a = model(input_ids=token, attention_mask=mask, **cache_arg(model, fp8))
            b = model(input_ids=token, attention_mask=mask, **cache_arg(model, ref))
            torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)


def test_cache_holds_half_the_bytes_of_bf16():
    model, _ = calibrated_model("llama", torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 40))
    fp8, bf16 = fp8_cache_for(model), DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, **cache_arg(model, fp8))
        model(input_ids=ids, **cache_arg(model, bf16))
    bf16_bytes = sum(t.numel() * t.element_size() for layer in bf16.layers for t in (layer.keys, layer.values))
    assert bf16_bytes == 2 * 2 * 2 * 40 * 32 * 2 * 2  # layers * (K, V) * B * T * D * Hkv * 2 bytes
    assert fp8.nbytes * 2 == bf16_bytes


def test_values_beyond_range_saturate_instead_of_nan():
    model, _ = calibrated_model("llama")
    tiny = {i: (torch.full((1,), 1e-4), torch.full((1,), 1e-4)) for i in range(2)}
    attach_kv_scales(model, tiny)  # |K|, |V| >> 448 * 1e-4: most values saturate
    cache = fp8_cache_for(model)
    ids = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        logits = model(input_ids=ids, **cache_arg(model, cache)).logits
    keys = cache.layers[0].keys.float()
    assert torch.isfinite(keys).all() and torch.isfinite(logits).all()
    assert keys.abs().max() == 448 and (keys.abs() == 448).float().mean() > 0.1
    dequantized_keys, _ = cache.layers[0].dequantized()
    assert dequantized_keys.abs().max() <= 448 * 1e-4 * (1 + 1e-6)


def test_sliding_window_layers_keep_the_window():
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        sliding_window=8)
    model = transformers.MistralForCausalLM(config).eval()
    quantize_kv_cache(model, [torch.randint(0, VOCAB, (1, 32))])
    scales, _ = read_kv_scales(model)
    ids, mask = left_padded_batch((12, 7))
    cache = fp8_cache_for(model)
    assert all(isinstance(layer, FP8SlidingWindowKVLayer) for layer in cache.layers)
    out = greedy(model, ids, mask, cache=cache, new_tokens=6)
    ref_layers = [FakeQuantLayer(*scales[i]) for i in range(2)]
    ref = Cache(layers=[_sliding(layer, 8) for layer in ref_layers])
    assert torch.equal(out, greedy(model, ids, mask, cache=ref, new_tokens=6))
    assert cache.layers[0].keys.shape[-2] == 7
    enable_fp8_kv_cache(model, attention="kernel")  # decode steps read the 8-token window through the op
    try:
        assert torch.equal(greedy(model, ids, mask, new_tokens=6), out)
    finally:
        disable_fp8_kv_cache(model)


def _sliding(layer: FakeQuantLayer, window: int):
    from transformers.cache_utils import DynamicSlidingWindowLayer

    class FakeQuantSlidingLayer(DynamicSlidingWindowLayer):
        def update(self, k, v, *args, **kwargs):
            def round_trip(x, s):
                return ((x.float() / s).clamp(-448, 448).to(FP8).float() * s).to(x.dtype)

            return super().update(round_trip(k, layer.scales[0]), round_trip(v, layer.scales[1]))

    return FakeQuantSlidingLayer(window)


def test_enable_fp8_kv_cache_hooks_generate():
    model, scales = calibrated_model("llama")
    ids, mask = left_padded_batch()
    expected = greedy(model, ids, mask, cache=reference_cache(scales))
    enable_fp8_kv_cache(model, attention="dequantize")
    assert fp8_kv_cache_enabled(model) == "dequantize"
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    assert isinstance(generated_cache(out), FP8KVCache)
    assert torch.equal(out.sequences, expected)
    # An explicit cache still wins.
    explicit = DynamicCache(config=model.config)
    greedy(model, ids, mask, cache=explicit)
    assert explicit.layers[0].keys.dtype == torch.float32
    disable_fp8_kv_cache(model)
    assert fp8_kv_cache_enabled(model) is None
    out = model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    assert type(generated_cache(out)) is DynamicCache


def test_kernel_attention_path_matches_dequantize_path(monkeypatch):
    """Decode steps through torch.ops.quantkit.decode_attention_fp8 (interpreter on CPU) give the same tokens."""
    model, _ = calibrated_model("llama", per_head=True)
    ids, mask = left_padded_batch((14, 9))
    expected, expected_logits = greedy(model, ids, mask, cache=fp8_cache_for(model), new_tokens=5, with_logits=True)
    calls = []
    original = decode_attention_module.decode_attention_fp8

    def counting(*args, **kwargs):
        calls.append(args[1].dtype)
        return original(*args, **kwargs)

    monkeypatch.setattr(decode_attention_module, "decode_attention_fp8", counting)
    enable_fp8_kv_cache(model, attention="kernel")
    try:
        assert model.config._attn_implementation == "quantkit_fp8"
        tokens, logits = greedy(model, ids, mask, new_tokens=5, with_logits=True)
        assert torch.equal(tokens, expected)
        torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)  # other summation order
    finally:
        disable_fp8_kv_cache(model)
    assert model.config._attn_implementation == "sdpa"
    assert calls == [FP8] * (4 * 2)  # 4 decode steps x 2 layers; the prefill went through sdpa


def test_missing_scales_warn_and_use_one():
    model = make_random_model("llama", vocab=VOCAB)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = fp8_cache_for(model)
    assert any("scale 1.0" in str(w.message) for w in caught)
    assert all(torch.equal(layer.k_scale, torch.ones(1)) for layer in cache.layers)


def test_per_head_scale_of_wrong_size_is_rejected():
    model = make_random_model("llama", vocab=VOCAB)
    attach_kv_scales(model, {i: (torch.ones(3), torch.ones(3)) for i in range(2)})  # 2 KV heads, 3 scales
    with pytest.raises(ValueError, match="3 entries but the layer caches 2 KV heads"):
        with torch.no_grad():
            model(input_ids=torch.randint(0, VOCAB, (1, 4)), **cache_arg(model, fp8_cache_for(model)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads_with_scales", [1, 3])
def test_table_dequantization_equals_the_primitive(dtype, heads_with_scales):
    from quantkit.modules.kv_cache import _dequantize_table, dequantize_fp8_by_table
    from quantkit.core.primitives import dequantize_fp8

    scale = torch.rand(heads_with_scales) * 0.1 + 1e-3
    codes = torch.randint(0, 256, (2, 3, 40, 16), dtype=torch.uint8)
    codes[0, 0, 0, :] = torch.arange(16, dtype=torch.uint8) + 120  # include 0x7f (NaN) and its neighbours
    q = codes.view(torch.float8_e4m3fn)  # [B, H=3, T, D]
    expected = dequantize_fp8(q, scale.reshape(1, -1, 1, 1), dtype)
    got = dequantize_fp8_by_table(q, _dequantize_table(scale, dtype))
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
