"""quantkit.CpuDecoder (quantkit/cpu_decoder.py, kernels/csrc/decode_step.cpp): the C++ decode loop gives
the logits of the model's own transformers forward, for float and quantized models, and refuses what
it cannot run with the reason."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import quantkit
from quantkit.cpu_decoder import unsupported_reason
from quantkit.errors import UsageError
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
    assert decoder.position == 16
    head_dim = model.model.layers[0].self_attn.head_dim
    assert decoder.cache_bytes() == 4 * 2 * 2 * batch * 2 * 32 * head_dim  # fp32, K and V, layers, B, kv heads, max_len


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
        want = type(quantized).generate(quantized, ids, max_new_tokens=8, do_sample=False)  # transformers' own
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
    attach_kv_scales(model, {i: (torch.tensor([0.1]), torch.tensor([0.2])) for i in range(2)})
    assert "FP8 KV cache" in unsupported_reason(model)
    model = make_random_model("llama")
    model.model.layers[1].mlp.down_proj = torch.nn.Identity()
    assert "layer 1 down_proj" in unsupported_reason(model)


def test_refuses_a_moe_model():
    from .moe_fixtures import make_moe_model

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
    with pytest.raises(RuntimeError, match="2 tokens for a cache of 1"):
        decoder.position = 6
        decoder.step(torch.tensor([1, 2]))


def test_bench_times_every_variant_in_the_loop():
    """--decode-loop quantkit: baseline and variants decode in the C++ loop; the roofline prices its fp32 cache."""
    from quantkit.commands.bench import benchmark

    data = benchmark("ref:tiny", variants=["w4a16-rtn"], device="cpu", dtype="bf16", prompt_lens=[8],
                     context_lens=[16], batch_sizes=[1, 2], warmup=0, repeats=1, quiet=True, decode_loop="quantkit")
    assert len(data["decode"]) == 4 and {r["mode"] for r in data["decode"]} == {"quantkit C++ decode loop"}
    model = quantkit.load("ref:tiny")
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    per_position = 4 * 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim  # fp32 K and V, every layer
    for r in data["decode"]:  # 17 positions: 16 cached + the step's
        assert r["memory"]["kv_cache_bytes"] == per_position * r["batch"] * 17
        assert r["roofline"]["bytes_breakdown"]["kv_read"] == per_position * r["batch"] * 17  # the roofline reads the new one too
    assert "--decode-loop quantkit" in data["command"]


def test_bench_refuses_the_loop_where_it_cannot_run():
    from quantkit.harness.timing import BenchSettings, decode_run

    with pytest.raises(UsageError, match="drop --compile"):
        BenchSettings(decode_loop="quantkit", compile_backend="inductor")
    with pytest.raises(UsageError, match="choose one of transformers, quantkit"):
        BenchSettings(decode_loop="vllm")
    with pytest.raises(UsageError, match="runs on the CPU"):  # a GPU run is refused before any model is touched
        decode_run(None, None, 1, 8, BenchSettings(decode_loop="quantkit"), torch.device("cuda"))


def test_the_demo_decodes_in_the_loop_unless_a_recipe_needs_transformers():
    from quantkit.commands.demo import _decode_loop

    assert _decode_loop([quantkit.load_recipe("w8a16-rtn"), quantkit.load_recipe("w4a16-rtn")]) == ("quantkit", "")
    loop, why = _decode_loop([quantkit.load_recipe("w4a16-rtn"), quantkit.load_recipe("w4a16-gptq-kv-fp8")])
    assert loop == "transformers" and "w4a16-gptq-kv-fp8" in why
