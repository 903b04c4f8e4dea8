"""Roofline bytes and flops against hand-computed cases, and the prefill/decode asymmetry it predicts."""

import json
from dataclasses import replace

import pytest

from quantkit.harness.hardware import DeviceSpec, KNOWN_GPUS, known_gpu, match_known_gpu
from quantkit.harness.roofline import (
    ModelShape,
    RooflineScheme,
    decode_cost,
    decoder_weight_bytes,
    kv_cache_bytes,
    linear_weight_bytes,
    predict,
    prefill_cost,
    scheme_from_quantization_config,
    scheme_from_weight_args,
    weight_memory_bytes,
)

# hidden 8, intermediate 16, 2 layers, 2 heads of dim 4, 1 KV head, vocab 32, untied lm_head.
# Per layer: q 8x8=64, k 8x4=32, v 8x4=32, o 8x8=64, gate 8x16=128, up 128, down 16x8=128 -> 576;
# two layers -> 1152 linear weights. KV values per token: 2 (K,V) * 2 layers * 1 head * 4 = 16.
TINY = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=4, vocab_size=32, tie_word_embeddings=False)
BF16 = RooflineScheme("bf16", weight_bits=16)
W4G4 = RooflineScheme("w4g4", weight_bits=4, group_size=4)


@pytest.fixture
def tiny():
    return ModelShape.from_config(TINY)


def test_shape_from_config(tiny, tmp_path):
    assert (tiny.hidden, tiny.kv_heads, tiny.head_dim, tiny.linear_params) == (8, 1, 4, 1152)
    assert tiny.kv_values_per_token == 16
    assert tiny.params == 1152 + 2 * 32 * 8 + 5 * 8
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert ModelShape.from_config(tmp_path) == tiny
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelShape.from_config({k: v for k, v in TINY.items() if k != "intermediate_size"})


def test_linear_weight_bytes_by_hand():
    # [out=8, in=128] W4 per group of 32: 8*128/2 = 512 value bytes + 8*4 scales * 2 bytes = 64
    assert linear_weight_bytes(128, 8, RooflineScheme("w4", 4, 32)) == 576
    # asymmetric adds one 4-bit zero per scale: 8*4/2 = 16
    assert linear_weight_bytes(128, 8, RooflineScheme("w4a", 4, 32, symmetric=False)) == 592
    # W8 per channel: 8*128 + 8 scales * 2 bytes
    assert linear_weight_bytes(128, 8, RooflineScheme("w8", 8, None)) == 1040
    assert linear_weight_bytes(128, 8, BF16) == 2048


def test_weight_bytes_tiny(tiny):
    assert decoder_weight_bytes(tiny, BF16) == 2304
    # 4-bit values + one 2-byte scale per 4 weights = 8 bits per weight: exactly half of bf16
    assert decoder_weight_bytes(tiny, W4G4) == 1152
    # asymmetric zero points: per layer q 8 + k 4 + v 4 + o 8 + gate 16 + up 16 + down 16 = 72 bytes
    assert decoder_weight_bytes(tiny, replace(W4G4, symmetric=False)) == 1152 + 144
    # + embeddings 32*8*2 + lm_head 512 + norms 5*8*2
    assert weight_memory_bytes(tiny, BF16) == 2304 + 512 + 512 + 80
    assert kv_cache_bytes(tiny, BF16, tokens=10, batch=3) == 3 * 10 * 16 * 2
    assert kv_cache_bytes(tiny, replace(BF16, kv_bytes=1), tokens=10, batch=3) == 3 * 10 * 16


def test_decode_cost_by_hand(tiny):
    c = decode_cost(tiny, BF16, context_len=3, batch=2)
    assert c.bytes == {
        "weights": 2304,
        "lm_head": 8 * 32 * 2,
        "embeddings": 2 * 8 * 2,
        # per layer sum(in + out) = 128 values; 2 tokens * 2 layers * 128 * 2 bytes + logits 2*32*2
        "activations": 1024 + 128,
        "kv_write": 2 * 1 * 16 * 2,
        "kv_read": 2 * 4 * 16 * 2,  # 3 cached positions + the new one
    }
    assert c.total_bytes == 4320
    assert c.flops == {"linear": 2 * 2 * 1152, "attention": 4 * 2 * 2 * 2 * 4 * 4, "lm_head": 2 * 2 * 8 * 32}
    assert c.total_flops == 6144
    assert c.intensity == pytest.approx(6144 / 4320)


def test_prefill_cost_by_hand(tiny):
    c = prefill_cost(tiny, BF16, prompt_len=3, batch=1)
    assert c.bytes == {"weights": 2304, "lm_head": 512, "embeddings": 48, "activations": 1536 + 64,
                       "kv_write": 96, "kv_read": 96}
    # causal attention: 3 * 4 / 2 = 6 query-key pairs, 4 flops per pair and head dim, 2 layers x 2 heads
    assert c.flops == {"linear": 2 * 3 * 1152, "attention": 4 * 2 * 2 * 4 * 6, "lm_head": 2 * 8 * 32}


def test_predict_takes_the_larger_time(tiny):
    dev = DeviceSpec("toy", memory_bandwidth=1000.0, peak_flops=1e4, memory_bytes=1e9, source="test")
    c = decode_cost(tiny, BF16, context_len=3, batch=2)
    p = predict(c, dev)
    assert p.memory_s == pytest.approx(4.32) and p.compute_s == pytest.approx(0.6144)
    assert p.seconds == pytest.approx(4.32) and p.bound == "memory"
    fast_memory = replace(dev, memory_bandwidth=1e6)
    assert predict(c, fast_memory).bound == "compute"
    assert predict(c, fast_memory).seconds == pytest.approx(0.6144)


LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False)


def predicted_speedups(shape, base, variant, device, *, prompt_len, context_len, batch=1) -> dict[str, float]:
    """Roofline speedup of ``variant`` over ``base`` for a prefill and a decode step."""
    pf = predict(prefill_cost(shape, base, prompt_len, batch), device).seconds / predict(
        prefill_cost(shape, variant, prompt_len, batch), device).seconds
    dc = predict(decode_cost(shape, base, context_len, batch), device).seconds / predict(
        decode_cost(shape, variant, context_len, batch), device).seconds
    return {"prefill": pf, "decode": dc}


@pytest.mark.parametrize("gpu", sorted(KNOWN_GPUS))
def test_decode_memory_bound_prefill_compute_bound(gpu):
    shape, dev = ModelShape.from_config(LLAMA_1B), KNOWN_GPUS[gpu]
    w4 = RooflineScheme("w4g128", 4, 128)
    assert predict(decode_cost(shape, BF16, 1024, 1), dev).bound == "memory"
    assert predict(prefill_cost(shape, BF16, 2048, 1), dev).bound == "compute"
    sp = predicted_speedups(shape, BF16, w4, dev, prompt_len=2048, context_len=1024, batch=1)
    # lm_head and embeddings stay bf16, so the decode gain is below the 3.9x of the linears alone
    assert 2.5 < sp["decode"] < 3.9
    assert sp["prefill"] < 1.05
    # decode speedup shrinks as the KV cache (not quantized) grows
    sp_long = predicted_speedups(shape, BF16, w4, dev, prompt_len=2048, context_len=16384, batch=16)
    assert sp_long["decode"] < sp["decode"]


def test_scheme_from_compressed_tensors_config():
    cfg = {
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128}}},
            "ignore": ["lm_head"],
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"},
        },
    }
    s = scheme_from_quantization_config(cfg)
    assert (s.weight_bits, s.group_size, s.symmetric, s.kv_bytes, s.quantize_lm_head) == (4, 128, False, 1, False)
    assert s.name == "w4g128+kv8"
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "channel"
    assert scheme_from_quantization_config(cfg).group_size is None
    assert scheme_from_quantization_config({"torch_dtype": "float16"}).weight_bits == 16
    with pytest.raises(ValueError, match="integer"):
        scheme_from_weight_args({"num_bits": 8, "type": "float"})


def test_known_gpus():
    h200 = known_gpu("H200")
    assert h200.datasheet_bandwidth == 4.8e12
    assert h200.memory_bandwidth == pytest.approx(0.9 * 4.8e12)
    assert known_gpu("NVIDIA H100 SXM") is KNOWN_GPUS["h100-sxm"]
    assert known_gpu("rtx_4090") is KNOWN_GPUS["rtx4090"]
    assert match_known_gpu("NVIDIA H200") is h200
    assert match_known_gpu("NVIDIA L4") is KNOWN_GPUS["l4"]
    with pytest.raises(ValueError, match="probe"):
        known_gpu("voodoo5")
