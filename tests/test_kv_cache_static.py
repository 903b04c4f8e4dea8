"""The static FP8 KV cache: same tokens and logits as the growing FP8 cache, in-place writes,
generate(cache_implementation="static"), a decode step under torch.compile without graph breaks,
and (on CUDA) a decode step captured in a CUDA graph."""


import pytest
import torch

from quantkit.modules.kv_scales import cache_keyword
from quantkit.core.errors import QuantizationError
from quantkit.modules.kv_cache import (
    StaticFP8KVCache, disable_fp8_kv_cache, enable_fp8_kv_cache, fp8_cache_for,
)

from .test_kv_cache import FP8, calibrated_model, generated_cache, greedy, left_padded_batch

NEW_TOKENS = 6


@pytest.mark.parametrize("family,dtype,per_head", [("llama", torch.float32, True), ("qwen2", torch.bfloat16, False)])
def test_static_cache_gives_the_tokens_and_logits_of_the_growing_cache(family, dtype, per_head):
    model, _ = calibrated_model(family, dtype, per_head)
    ids, mask = left_padded_batch()
    expected, expected_logits = greedy(model, ids, mask, cache=fp8_cache_for(model), new_tokens=NEW_TOKENS,
                                       with_logits=True)
    cache = fp8_cache_for(model, max_cache_len=ids.shape[1] + NEW_TOKENS + 5)  # room to spare: masked tail
    tokens, logits = greedy(model, ids, mask, cache=cache, new_tokens=NEW_TOKENS, with_logits=True)
    assert isinstance(cache, StaticFP8KVCache)
    assert torch.equal(tokens, expected)
    # same stored codes, same attention; only the summation over the (masked) longer cache differs
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logits.float(), expected_logits.float(), rtol=tol, atol=tol)
    layer = cache.layers[0]
    assert layer.keys.dtype == FP8 and layer.keys.shape == (2, 2, ids.shape[1] + NEW_TOKENS + 5, 32)
    assert int(layer.cumulative_length) == ids.shape[1] + NEW_TOKENS - 1


def test_writes_in_place_at_the_written_length():
    model, scales = calibrated_model("llama")
    ids = torch.randint(1, 512, (1, 9))
    cache = fp8_cache_for(model, max_cache_len=16)
    kw = cache_keyword(model)
    with torch.no_grad():
        model(input_ids=ids, **{kw: cache})
        layer = cache.layers[1]
        pointers = (layer.keys.data_ptr(), layer.values.data_ptr())
        before = layer.keys.clone()
        model(input_ids=ids[:, :1], **{kw: cache})
    assert (layer.keys.data_ptr(), layer.values.data_ptr()) == pointers  # no reallocation
    assert int(layer.cumulative_length) == 10 and cache.get_seq_length() == 10
    changed = (layer.keys.view(torch.uint8) != before.view(torch.uint8)).any(dim=-1).any(dim=0).any(dim=0)  # [16]
    assert changed.nonzero().flatten().tolist() == [9]  # only position 9 was written
    assert cache.nbytes == 2 * 2 * 1 * 2 * 16 * 32  # layers * (K, V) * B * Hkv * max_len * D bytes
    cache.crop(-3)
    assert int(layer.cumulative_length) == 7


@pytest.mark.parametrize("attention", ["dequantize", "kernel"])
def test_generate_with_cache_implementation_static(attention):
    model, _ = calibrated_model("llama", per_head=True)
    ids, mask = left_padded_batch((14, 9))
    expected = greedy(model, ids, mask, cache=fp8_cache_for(model), new_tokens=NEW_TOKENS)
    enable_fp8_kv_cache(model, attention=attention)
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             cache_implementation="static", return_dict_in_generate=True)
    finally:
        disable_fp8_kv_cache(model)
    cache = generated_cache(out)
    assert isinstance(cache, StaticFP8KVCache) and cache.attention == attention
    assert torch.equal(out.sequences, expected)


def _decode_step(model, attention):
    """A prefilled static cache and a one-token decode step function over it (step(token, mask, position))."""
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in left_padded_batch((12, 7)))
    max_len = ids.shape[1] + 4
    cache = fp8_cache_for(model, max_cache_len=max_len, attention=attention)
    kw = cache_keyword(model)
    full_mask = torch.cat([mask, mask.new_zeros(2, max_len - ids.shape[1])], dim=1)  # [B, max_len]
    with torch.no_grad():
        token = model(input_ids=ids, attention_mask=full_mask, **{kw: cache}).logits[:, -1:].argmax(-1)  # [B, 1]
    full_mask[:, ids.shape[1]] = 1
    position = mask.sum(dim=1, keepdim=True)  # [B, 1]

    def step(token, attention_mask, position_ids):
        return model(input_ids=token, attention_mask=attention_mask, position_ids=position_ids, **{kw: cache}).logits

    return cache, step, (token, full_mask, position)


@pytest.mark.parametrize("attention", ["dequantize", "kernel"])
def test_decode_step_compiles_without_graph_breaks(attention):
    model, _ = calibrated_model("llama", per_head=True)
    if attention == "kernel":
        enable_fp8_kv_cache(model, attention="kernel")  # the model's attention reads the fp8 cache
    cache, step, args = _decode_step(model, attention)
    ops = []

    def recording_backend(gm, example_inputs):
        ops.extend(str(node.target) for node in gm.graph.nodes if node.op in ("call_function", "call_method"))
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    with torch.no_grad():
        eager = step(*args)
        cache.crop(-1)
        compiled = torch.compile(step, fullgraph=True, backend=recording_backend)(*args)  # raises on a graph break
    disable_fp8_kv_cache(model)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert int(cache.layers[0].cumulative_length) == args[1].shape[1] - 3
    assert any("index_copy" in op for op in ops), "the in-place cache write (pure torch on CPU) is in the graph"
    assert any("decode_attention_fp8" in op for op in ops) == (attention == "kernel")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("attention", ["dequantize", "kernel"])
def test_decode_step_captures_in_a_cuda_graph(attention):
    model, _ = calibrated_model("llama", torch.bfloat16, per_head=True)
    model = model.cuda()
    if attention == "kernel":
        enable_fp8_kv_cache(model, attention="kernel")
    cache, step, args = _decode_step(model, attention)
    with torch.no_grad():
        eager = step(*args)
        cache.crop(-1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (Triton compiles) outside the capture
            step(*args)
            cache.crop(-1)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records the step without running it: the length stays put
            out = step(*args)
        graph.replay()  # writes at the same position as the eager step, advances the length by one
        torch.cuda.synchronize()
    disable_fp8_kv_cache(model)
    torch.testing.assert_close(out.float(), eager.float(), rtol=2e-2, atol=2e-2)
    assert int(cache.layers[0].cumulative_length) == args[1].shape[1] - 3


def test_sliding_window_models_are_refused_clearly():
    import transformers

    config = transformers.MistralConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512, sliding_window=8)
    scales = {i: (torch.ones(1), torch.ones(1)) for i in range(2)}
    with pytest.raises(QuantizationError, match="full attention only"):
        StaticFP8KVCache(config, 32, scales)
