"""quantkit.CpuDecoder (quantkit/runtime/cpu_decoder.py, quantkit/kernels/csrc/decode_step.cpp): the C++ decode loop gives
the logits of the model's own transformers forward, for float and quantized models, and refuses what
it cannot run with the reason."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import quantkit
from quantkit.runtime.cpu_decoder import unsupported_reason
from quantkit.core.errors import UsageError
from quantkit.kernels.cpu_extension import load_cpu_kernels
from quantkit.modules.kv_scales import attach_kv_scales, cache_keyword

from .conftest import make_random_model

pytestmark = pytest.mark.skipif(not load_cpu_kernels().available, reason=load_cpu_kernels().reason)


def transformers_steps(model, ids, tokens):
    """Logits [steps, B, V] of the model's own forward: prefill ids, then one step per column of tokens."""
    with torch.inference_mode():
        cache, kw = DynamicCache(), cache_keyword(model)
        model(ids, use_cache=True, **{kw: cache})
        return torch.stack([model(tokens[:, i:i + 1], use_cache=True, **{kw: cache}).logits[:, -1].float()
                            for i in range(tokens.shape[1])])


def decoder_steps(decoder, ids, tokens):
    decoder.prefill(ids)
    return torch.stack([decoder.step(tokens[:, i]) for i in range(tokens.shape[1])])


def assert_close_logits(got, want, rtol):
    scale = want.abs().max()
    assert (got - want).abs().max() <= rtol * scale, f"max diff {(got - want).abs().max():.3g} vs scale {scale:.3g}"


def random_inputs(vocab, batch, prompt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, prompt), generator=g), torch.randint(0, vocab, (batch, steps), generator=g)


@pytest.mark.parametrize("family,tied", [("llama", True), ("mistral", False), ("qwen2", True), ("qwen3", False)])
@pytest.mark.parametrize("batch", [1, 3])
def test_float_model_matches_its_transformers_forward(family, tied, batch):
    model = make_random_model(family, tied=tied, seed=batch)
    if family == "mistral":
        model.config.sliding_window = None
    if family == "qwen2":  # q/k/v biases (Qwen2's), non-zero so that a dropped bias shows
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data.normal_(0, 0.5)
    for norm in [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]:  # not all ones
        norm.weight.data.uniform_(0.5, 1.5)
    ids, tokens = random_inputs(model.config.vocab_size, batch, 11, 5, seed=batch)
    decoder = quantkit.CpuDecoder(model, max_len=32)
    assert_close_logits(decoder_steps(decoder, ids, tokens), transformers_steps(model, ids, tokens), 1e-4)
    assert decoder.lengths.tolist() == [16] * batch
    head_dim = model.model.layers[0].self_attn.head_dim
    assert decoder.cache_dtype == "fp32"
    assert decoder.cache_block == 32  # max_len rounded up to a multiple of 32
    assert decoder.cache_bytes() == 4 * 2 * 2 * batch * 2 * 32 * head_dim  # fp32, K and V, layers, B, kv heads, a block


@pytest.fixture(scope="module", params=["w4a16-rtn-asym", "w8a16-rtn", "w4a16-rtn-g32"])
def quantized(request, tmp_path_factory):
    model = quantkit.load("ref:tiny", dtype=torch.float32)
    quantkit.quantize(model, request.param, progress=False)
    out = tmp_path_factory.mktemp("decoder") / request.param
    quantkit.save(model, out)
    return quantkit.load(out, dtype=torch.float32)


def test_quantized_model_matches_its_transformers_forward(quantized):
    """Same q8dot kernel on the same fp32 activations in both: agreement to fp32 rounding."""
    decoder = quantkit.CpuDecoder(quantized, max_len=64)
    ids, tokens = random_inputs(quantized.config.vocab_size, 2, 13, 6, seed=3)
    assert_close_logits(decoder_steps(decoder, ids, tokens), transformers_steps(quantized, ids, tokens), 1e-4)


def test_generate_is_greedy_generate(quantized):
    ids, _ = random_inputs(quantized.config.vocab_size, 2, 9, 0, seed=5)
    with torch.inference_mode():
        want = quantized.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(quantkit.CpuDecoder(quantized, max_len=32).generate(ids, 8), want)


def test_bf16_model_runs_close_to_transformers(tmp_path):
    """bf16: the loop keeps the residual stream in fp32 where transformers rounds it to bf16 per layer."""
    model = quantkit.load("ref:tiny", dtype=torch.bfloat16)
    quantkit.quantize(model, "w4a16-rtn", progress=False)
    quantkit.save(model, tmp_path / "w4")
    model = quantkit.load(tmp_path / "w4", dtype=torch.bfloat16)
    ids, tokens = random_inputs(model.config.vocab_size, 1, 7, 4, seed=1)
    decoder = quantkit.CpuDecoder(model, max_len=16)
    assert_close_logits(decoder_steps(decoder, ids, tokens), transformers_steps(model, ids, tokens), 0.05)


def test_refuses_a_layer_not_on_the_cpp_kernel():
    """quantize() in place leaves the reference path (quantkit.load prepares the kernels): named, not run slowly."""
    model = quantkit.load("ref:tiny", dtype=torch.float32)
    quantkit.quantize(model, "w8a16-rtn", progress=False)
    with pytest.raises(UsageError, match="layer 0 q_proj: a quantized linear prepared for 'reference'"):
        quantkit.CpuDecoder(model)


def test_refuses_what_it_cannot_run():
    model = make_random_model("mistral")
    model.config.sliding_window = 64
    assert "sliding-window" in unsupported_reason(model)
    with pytest.raises(UsageError, match="sliding-window.*transformers"):
        quantkit.CpuDecoder(model)
    model = make_random_model("llama")
    model.config.hidden_act = "gelu"
    assert "hidden_act" in unsupported_reason(model)
    model = make_random_model("llama")
    model.model.layers[1].mlp.down_proj = torch.nn.Identity()
    assert "layer 1 down_proj" in unsupported_reason(model)


def test_refuses_a_moe_model():
    from fixtures.moe_fixtures import make_moe_model

    assert "model type 'qwen3_moe'" in unsupported_reason(make_moe_model("qwen3_moe"))


def test_cache_limits_are_errors():
    model = make_random_model("llama")
    decoder = quantkit.CpuDecoder(model, max_len=8)
    with pytest.raises(UsageError, match="call prefill"):
        decoder.step(torch.tensor([1]))
    ids = torch.randint(0, 512, (1, 6))
    with pytest.raises(UsageError, match="exceed the decoder's max_len 8"):
        decoder.generate(ids, 3)
    decoder.prefill(ids)
    decoder.step(torch.tensor([1]))
    decoder.step(torch.tensor([1]))
    with pytest.raises(UsageError, match="cache is full"):
        decoder.step(torch.tensor([1]))
    decoder.truncate(6)
    with pytest.raises(UsageError, match="2 tokens for a cache of 1"):
        decoder.step(torch.tensor([1, 2]))


def test_bench_times_every_variant_in_the_loop():
    """--decode-loop quantkit: baseline and variants decode in the C++ loop, each in its own cache (the
    model's bf16, fp8 for the FP8-KV recipe), which the records name, count in bytes and price in the
    roofline; the printed table says it too."""
    from quantkit.harness.benchmark import benchmark
    from quantkit.harness.report import summary_lines

    data = benchmark("ref:tiny", variants=["w4a16-rtn", "kv-fp8"], device="cpu", dtype="bf16", prompt_lens=[8],
                     context_lens=[16], batch_sizes=[1, 2], warmup=0, repeats=1, quiet=True, decode_loop="quantkit")
    assert len(data["decode"]) == 6 and {r["mode"].split(",")[0] for r in data["decode"]} == {"quantkit C++ decode loop"}
    model = quantkit.load("ref:tiny")
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    values = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim  # K and V, every layer, per position
    for r in data["decode"]:  # 17 positions (16 cached + the step's) in one block of 32 (max_len 17, rounded up)
        value_bytes = 1 if r["variant"] == "kv-fp8" else 2
        assert r["cache_dtype"] == ("fp8" if r["variant"] == "kv-fp8" else "bf16")
        assert r["cache"] == f"CpuDecoder ({r['cache_dtype']})" and r["cache_dtype"] in r["mode"]
        assert r["cache_block"] == 32
        assert r["memory"]["kv_cache_bytes"] == values * value_bytes * r["batch"] * 32
        assert r["roofline"]["bytes_breakdown"]["kv_read"] == values * value_bytes * r["batch"] * 17
    table = "\n".join(summary_lines(data))
    assert "fp8 KV cache" in table and "bf16 KV cache" in table
    assert "--decode-loop quantkit" in data["command"]


def test_bench_refuses_the_loop_where_it_cannot_run():
    from quantkit.harness.timing import BenchSettings, decode_run

    with pytest.raises(UsageError, match="drop --compile"):
        BenchSettings(decode_loop="quantkit", compile_backend="inductor")
    with pytest.raises(UsageError, match="choose one of transformers, quantkit"):
        BenchSettings(decode_loop="vllm")
    with pytest.raises(UsageError, match="runs on the CPU"):  # a GPU run is refused before any model is touched
        decode_run(None, None, 1, 8, BenchSettings(decode_loop="quantkit"), torch.device("cuda"))


def test_bench_auto_decodes_in_the_loop_unless_a_variant_needs_transformers():
    """decode_loop="auto" (the demo's) asks CpuDecoder of every built variant: the C++ loop where it runs them all,
    else transformers, saying which variant it cannot run and why (here a GGUF K-quant layer)."""
    from quantkit.harness.benchmark import benchmark

    settings = dict(device="cpu", dtype="bf16", prompt_lens=[8], context_lens=[16], batch_sizes=[1], warmup=0,
                    repeats=1, quiet=True, decode_loop="auto")
    data = benchmark("ref:tiny", variants=["w8a16-rtn"], **settings)
    assert data["settings"]["decode_loop"] == "quantkit" and data["decode_loop_reason"] is None
    assert "--decode-loop quantkit" in data["command"]
    data = benchmark("ref:tiny", variants=["w4a16-rtn", "w4a16-rtn-q4k"], **settings)
    assert data["settings"]["decode_loop"] == "transformers" and "--decode-loop" not in data["command"]
    assert data["decode_loop_reason"].startswith("w4a16-rtn-q4k: layer 0 q_proj: GgufLinear")


# -- the KV cache: dtypes, blocks, per-row lengths ---------------------------------------------------

def float_model(seed=0):
    model = make_random_model("llama", seed=seed)
    for norm in [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]:
        norm.weight.data.uniform_(0.5, 1.5)
    return model


def fp8_transformers_steps(model, ids, tokens, rotation=None):
    """transformers' forward with quantkit's FP8 cache (modules/kv_cache.py): prefill, then one step per column
    (rotation: as fp8_cache_for's, None the model's own)."""
    from quantkit.modules.kv_cache import fp8_cache_for

    with torch.inference_mode():
        cache, kw = fp8_cache_for(model, rotation=rotation), cache_keyword(model)
        model(ids, use_cache=True, **{kw: cache})
        return torch.stack([model(tokens[:, i:i + 1], use_cache=True, **{kw: cache}).logits[:, -1].float()
                            for i in range(tokens.shape[1])])


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_cache_matches_transformers_with_the_fp8_cache(per_head):
    """The same fp8 codes in both (x / scale saturated, per tensor or per kv head), but for a key or value
    within fp32 rounding of a boundary between two codes (the loop's rotary and projections round
    differently from torch's), which can take the neighbouring code: 1e-3 of the logits' scale, against
    ~1e-2 between the fp8 and the fp32 cache."""
    model = float_model()
    heads = model.config.num_key_value_heads
    g = torch.Generator().manual_seed(1)
    scales = {i: (torch.rand(heads if per_head else 1, generator=g) * 0.01 + 0.002,
                  torch.rand(heads if per_head else 1, generator=g) * 0.01 + 0.002) for i in range(2)}
    attach_kv_scales(model, scales)
    decoder = quantkit.CpuDecoder(model, max_len=300, cache_block=256)
    assert decoder.cache_dtype == "fp8"
    ids, tokens = random_inputs(model.config.vocab_size, 2, 250, 12, seed=2)  # across the first block's end
    got, want = decoder_steps(decoder, ids, tokens), fp8_transformers_steps(model, ids, tokens)
    assert_close_logits(got, want, 1e-3)
    assert (got - transformers_steps(model, ids, tokens)).abs().max() > 5e-3  # the fp8 rounding is there
    assert decoder.cache_bytes() == 1 * 2 * 2 * 2 * heads * 512 * model.model.layers[0].self_attn.head_dim


@pytest.mark.parametrize("cache_dtype,rtol", [("bf16", 2e-2), ("fp16", 2e-3), ("int8", 3e-2), ("fp32", 1e-4)])
def test_cache_dtypes_stay_within_their_rounding(cache_dtype, rtol):
    """An fp32 model against its own fp32 forward: only the cache's rounding of K and V differs
    (bf16: 2^-9 relative per value, fp16: 2^-12, int8: 1/254 of each token's head amax)."""
    model = float_model(seed=3)
    ids, tokens = random_inputs(model.config.vocab_size, 2, 40, 6, seed=4)
    decoder = quantkit.CpuDecoder(model, max_len=64, cache_dtype=cache_dtype)
    got, want = decoder_steps(decoder, ids, tokens), transformers_steps(model, ids, tokens)
    assert_close_logits(got, want, rtol)
    block = decoder.cache_block
    values = 2 * 2 * 2 * 2 * block * model.model.layers[0].self_attn.head_dim  # K+V, layers, B, kv heads, a block
    per_value = {"bf16": 2, "fp16": 2, "int8": 1, "fp32": 4}[cache_dtype]
    scales = 2 * 2 * 2 * 2 * block * 4 if cache_dtype == "int8" else 0  # fp32 per token and head
    assert decoder.cache_bytes() == values * per_value + scales


def test_the_cache_grows_in_blocks():
    model = float_model()
    assert quantkit.CpuDecoder(model, max_len=100_000).cache_block == 1024  # the default
    assert quantkit.CpuDecoder(model, max_len=100).cache_block == 128  # no longer than max_len needs
    decoder = quantkit.CpuDecoder(model, max_len=100_000, cache_block=256)  # a limit: nothing is allocated for it
    assert decoder.cache_bytes() == 0
    ids, _ = random_inputs(model.config.vocab_size, 1, 255, 0)
    decoder.prefill(ids)
    one_block = decoder.cache_bytes()
    assert one_block == 4 * 2 * 2 * 2 * 256 * model.model.layers[0].self_attn.head_dim
    decoder.step(torch.tensor([3]))
    assert decoder.cache_bytes() == one_block
    decoder.step(torch.tensor([3]))  # position 256: a second block
    assert decoder.cache_bytes() == 2 * one_block


def test_blocks_of_huge_pages_hold_the_same_cache():
    """Blocks of 2 MiB and more (every layer's block in one allocation, aligned and advised for transparent
    huge pages: decode_step.cpp's zeros_on_huge_pages) hold the cache as small blocks do: the logits of the
    model's own forward, and the bytes of one block."""
    model = float_model(seed=5)
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    head_dim = model.model.layers[0].self_attn.head_dim
    per_position = layers * 2 * kv_heads * head_dim * 4  # keys of batch 2, fp32
    block = -(-(2 << 20) // per_position // 32) * 32
    assert layers * 2 * kv_heads * block * head_dim * 4 >= 2 << 20
    decoder = quantkit.CpuDecoder(model, max_len=block, cache_dtype="fp32", cache_block=block)
    ids, tokens = random_inputs(model.config.vocab_size, 2, 40, 6, seed=6)
    assert_close_logits(decoder_steps(decoder, ids, tokens), transformers_steps(model, ids, tokens), 1e-4)
    assert decoder.cache_bytes() == 2 * per_position * block


def test_the_cache_dtype_is_validated():
    model = float_model()
    with pytest.raises(UsageError, match="cache_dtype 'fp4': choose one of auto, fp32, bf16, fp16, fp8, int8"):
        quantkit.CpuDecoder(model, cache_dtype="fp4")
    with pytest.raises(UsageError, match="needs the checkpoint's calibrated k_scale / v_scale"):
        quantkit.CpuDecoder(model, cache_dtype="fp8")
    for block in (0, 48, 100, -32, True, 64.0):
        with pytest.raises(UsageError, match=f"cache_block must be a positive multiple of 32 positions, got {block!r}"):
            quantkit.CpuDecoder(model, cache_block=block)
    assert quantkit.CpuDecoder(model.to(torch.bfloat16)).cache_dtype == "bf16"


def test_a_left_padded_row_decodes_as_it_does_alone():
    model = float_model(seed=5)
    short, long = random_inputs(model.config.vocab_size, 1, 5, 0, seed=6)[0], random_inputs(
        model.config.vocab_size, 1, 9, 0, seed=7)[0]
    padded = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.int64), short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 4), torch.ones(1, 5)], 1), torch.ones(1, 9)]).to(torch.int64)
    decoder = quantkit.CpuDecoder(model, max_len=32)
    together = decoder.generate(padded, 6, attention_mask=mask)
    assert decoder.lengths.tolist() == [10, 14]
    assert torch.equal(together[0, 9:], decoder.generate(short, 6)[0, 5:])
    assert torch.equal(together[1, 9:], decoder.generate(long, 6)[0, 9:])
    logits = decoder.prefill(padded, mask)
    assert_close_logits(logits[:1], decoder.prefill(short), 1e-4)
    with pytest.raises(UsageError, match="row 0 is not left-padded"):
        decoder.prefill(padded, mask.flip(1))


def test_bad_calls_are_usage_errors():
    """issue 37's cases: each a one-line UsageError, not transformers' or torch's exception."""
    model = float_model()
    decoder = quantkit.CpuDecoder(model, max_len=16)
    with pytest.raises(UsageError, match="at least one token"):
        decoder.generate(torch.zeros(1, 0, dtype=torch.int64), 4)
    ids = torch.randint(0, 512, (1, 4))
    decoder.prefill(ids)
    for bad in (10**6, -1):
        with pytest.raises(UsageError, match=f"token id {bad}, outside the vocabulary"):
            decoder.step(torch.tensor([bad]))
    with pytest.raises(UsageError, match="max_new_tokens must be >= 0"):
        decoder.generate(ids, -5)
    with pytest.raises(UsageError, match="integer token ids"):
        decoder.step(torch.tensor([1.0]))
    with pytest.raises(UsageError, match="input_ids must be"):
        decoder.generate(ids.float(), 2)
    keys = [torch.zeros(1, 2, 3, model.model.layers[0].self_attn.head_dim)]
    with pytest.raises(UsageError, match="keys / values for 1 / 1 layers; the model has 2"):
        decoder.load_cache(keys, keys)
