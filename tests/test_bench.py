"""`quantkit bench` on a tiny model: valid JSON with both sections, and a decode step that is a true
decode step (same logits as generation with a dynamic cache)."""

import argparse
import json
import re

import pytest
import torch

from quantkit.harness.roofline import ModelShape, kv_cache_bytes, weight_memory_bytes
from quantkit.harness.timing import SCHEMA, cache_tensor_bytes, make_decode_cache, rewind
from quantkit.harness.variants import build_variant, float_variant, load_source_model, model_tensor_bytes
from quantkit.modules.kv_scales import cache_keyword

# every linear's input a multiple of 128 and output of 64 (what the kernels and vLLM accept)
TINY_LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=4096, max_position_embeddings=256)


def tiny_model_source(tmp_path) -> str:
    """The tiny reference model when it is available, else a random one of a similar shape."""
    try:
        from quantkit.refmodels import reference_model_path

        return str(reference_model_path("tiny"))
    except Exception:
        path = tmp_path / "tiny-llama.json"
        path.write_text(json.dumps(TINY_LLAMA))
        return str(path)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_measure_interleaves_variants(tmp_path):
    from quantkit.harness.timing import BenchSettings, TimedRun, measure

    calls = []

    def timed(name):
        variant = float_variant(torch.nn.Linear(4, 4))
        return TimedRun(variant, torch.device("cpu"), lambda: calls.append(name),
                        before=lambda: calls.append(name.lower()), cache=lambda: None, cache_allocated_before=False)

    settings = BenchSettings(prompt_lens=[1], context_lens=[1], batch_sizes=[1], warmup=1, repeats=2)
    out = measure([timed("A"), timed("B")], settings)
    # warm-up, then repeats alternate between the variants, then one untimed call each for memory
    assert calls == ["a", "A", "b", "B"] + ["a", "A", "b", "B"] * 2 + ["a", "A", "b", "B"]
    assert [len(o["times_s"]) for o in out] == [2, 2]
    assert out[0]["memory"]["method"] == "tensor_bytes"


@torch.inference_mode()
def test_decode_step_matches_generation_with_a_dynamic_cache(tmp_path):
    from transformers import DynamicCache

    model = load_source_model(tiny_model_source(tmp_path), dtype=torch.float32, device="cpu", seed=1)
    variant = float_variant(model)
    shape = ModelShape.from_config(model.config)
    g = torch.Generator().manual_seed(2)
    batch, context = 2, 37
    prompt = torch.randint(0, shape.vocab, (batch, context), generator=g)
    token = torch.randint(0, shape.vocab, (batch, 1), generator=g)

    kw = cache_keyword(model)  # `cache` (transformers 5.24) or `past_key_values` (5.17)
    reference_cache = DynamicCache(config=model.config)
    model(input_ids=prompt, use_cache=True, **{kw: reference_cache})
    reference = model(input_ids=token, use_cache=True, **{kw: reference_cache}).logits  # [B, 1, V]

    cache = make_decode_cache(variant, context + 1)  # what decode_run uses: exactly one free slot
    model(input_ids=prompt, use_cache=True, **{kw: cache})
    for _ in range(3):  # repeated steps must each decode at the same context
        logits = model(input_ids=token, use_cache=True, **{kw: cache}).logits
        rewind(cache, 1)
        assert int(cache.get_seq_length()) == context
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    # the cache holds exactly what the roofline counts
    assert cache_tensor_bytes(cache) - kv_cache_bytes(shape, variant.scheme, context + 1, batch) < 64 * shape.layers


def test_variant_bytes_match_the_roofline(tmp_path):
    source = tiny_model_source(tmp_path)
    model = load_source_model(source, dtype=torch.bfloat16, device="cpu", seed=0)
    shape = ModelShape.from_config(model.config)
    base = float_variant(model)
    rotary = sum(b.numel() * b.element_size() for b in model.model.rotary_emb.buffers())  # not weights
    assert model_tensor_bytes(model) - rotary == weight_memory_bytes(shape, base.scheme)
    w4 = build_variant("w4a16-rtn", model, dtype=torch.bfloat16, device="cpu", backend="reference")
    assert w4.scheme.weight_bits == 4 and w4.scheme.group_size == 128 and w4.source == "recipe:w4a16-rtn"
    predicted = weight_memory_bytes(shape, w4.scheme)
    assert predicted < 0.8 * weight_memory_bytes(shape, base.scheme)
    # packed weights + scales; QuantLinear also keeps a 16-byte weight_shape per layer
    assert abs(model_tensor_bytes(w4.model) - predicted) < 0.01 * predicted
    # the float model is untouched
    assert model_tensor_bytes(model) - rotary == weight_memory_bytes(shape, base.scheme)


def _bench_parser():
    from quantkit.commands import bench

    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    return parser


def test_bench_command_writes_both_sections(tmp_path, capsys):
    out = tmp_path / "bench.json"
    source = tiny_model_source(tmp_path)
    args = _bench_parser().parse_args([
        "bench", source, "--variants", "w4a16-rtn,w4a16-rtn-asym", "--prompt-lens", "16,64,100000",
        "--context-lens", "16,64", "--batch-sizes", "1,3", "--warmup", "1", "--repeats", "2",
        "--backend", "reference", "--json", str(out), "--quiet", "--device", "cpu",
    ])
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    assert data["schema"] == SCHEMA
    assert [v["name"] for v in data["variants"]] == [data["baseline"], "w4a16-rtn", "w4a16-rtn-asym"]
    assert data["device"]["type"] == "cpu" and data["device"]["spec"]["source"] == "probe"
    assert data["settings"]["memory_method"] == "tensor_bytes"
    # 2 prompt lengths (100000 exceeds the context and is skipped) x 3 variants; 2 contexts x 2 batches x 3
    assert len(data["prefill"]) == 6 and len(data["decode"]) == 12
    assert any(s["phase"] == "prefill" and s["prompt_len"] == 100000 for s in data["skipped"])
    for r in data["prefill"] + data["decode"]:
        assert len(r["times_s"]) == 2 and r["median_s"] > 0
        assert r["roofline"]["predicted_s"] > 0 and r["roofline"]["bound"] in {"memory", "compute"}
        assert r["roofline"]["measured_over_predicted"] == pytest.approx(r["median_s"] / r["roofline"]["predicted_s"])
        assert r["memory"]["peak_bytes"] >= r["memory"]["weights_bytes"] > 0
    decode = {(r["variant"], r["batch"], r["context_len"]): r for r in data["decode"]}
    base_row = decode[(data["baseline"], 3, 64)]
    w4_row = decode[("w4a16-rtn", 3, 64)]
    assert base_row["mode"] == "eager"
    # decode of 4-bit weights reads fewer bytes; the KV cache is the same size
    assert w4_row["roofline"]["bytes_breakdown"]["weights"] < 0.3 * base_row["roofline"]["bytes_breakdown"]["weights"]
    assert w4_row["memory"]["kv_cache_bytes"] == base_row["memory"]["kv_cache_bytes"]
    assert w4_row["memory"]["weights_bytes"] < base_row["memory"]["weights_bytes"]
    assert "quantkit bench " in data["command"] and "--variants w4a16-rtn,w4a16-rtn-asym" in data["command"]
    captured = capsys.readouterr()
    printed = captured.out
    assert "TTFT" in printed and "TPOT" in printed and "speedup w4a16-rtn" in printed
    # each phase's dtype and why, and the skipped length said on stderr even with --quiet
    assert re.search(r"prefill timed in \w+ \((matmul probe|--dtype)", printed)
    assert data["dtype_reasons"].keys() == {"prefill", "decode"}
    assert "bench: skipping prefill, prompt 100000: exceeds the model's context 256" in captured.err


def test_bench_rejects_bad_input(tmp_path, capsys):
    parser = _bench_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "x", "--prompt-lens", "16,zero"])
    assert "comma-separated integers" in capsys.readouterr().err
    source = tiny_model_source(tmp_path)
    from quantkit.commands.cli import main

    assert main(["bench", source, "--baseline", source, "--quiet"]) == 2
    assert "quantkit bench: error: --baseline is for a quantized MODEL" in capsys.readouterr().err


def test_bench_checks_that_the_baseline_is_the_checkpoints_source(tmp_path, capsys):
    """As `eval` does: a checkpoint benchmarked against a float model it was not quantized from is refused
    (here: the tiny model with its embedding rows reversed); --allow-other-baseline takes that model."""
    import quantkit
    from quantkit.commands.cli import main

    checkpoint, other = tmp_path / "w4", tmp_path / "other"
    quantkit.save(quantkit.quantize(quantkit.load("ref:tiny"), "w4a16-rtn", progress=False), checkpoint)
    model = quantkit.load("ref:tiny")
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(model.get_input_embeddings().weight.flip(0))
    model.save_pretrained(other)
    argv = ["bench", str(checkpoint), "--baseline", str(other), "--prompt-lens", "8", "--context-lens", "8",
            "--batch-sizes", "1", "--warmup", "0", "--repeats", "1", "--gpu", "h200", "--device", "cpu",
            "--dtype", "float32", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"the baseline {other} is not the model {checkpoint} was quantized from (the input embeddings differ" in err
    out = tmp_path / "bench.json"
    assert main([*argv, "--allow-other-baseline", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [v["name"] for v in data["variants"]][1:] == ["w4"] and len(data["decode"]) == 2
    assert data["command"].endswith("--allow-other-baseline")


def test_the_default_cache_limit_is_a_quarter_of_the_timed_devices_memory():
    """--gpu h200 on a CPU prices the roofline only: the KV cache limit comes from this machine's RAM."""
    import os

    from quantkit.harness.benchmark import benchmark

    data = benchmark("ref:tiny", gpu="h200", device="cpu", dtype="float32", prompt_lens=[8], context_lens=[8],
                     batch_sizes=[1], warmup=0, repeats=1, quiet=True)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert data["settings"]["max_cache_bytes"] == ram / 4 != data["device"]["spec"]["memory_bytes"] / 4


def test_fp8_kv_variant_decodes_with_half_the_cache_bytes(tmp_path):
    from quantkit.harness.timing import BenchSettings, decode_run, measure

    model = load_source_model(tiny_model_source(tmp_path), dtype=torch.bfloat16, device="cpu", seed=0)
    shape = ModelShape.from_config(model.config)
    base = float_variant(model)
    both = build_variant("w4a16-rtn+kv-fp8", model, dtype=torch.bfloat16, device="cpu", backend="reference")
    assert both.name == "w4a16-rtn+kv-fp8" and both.kv_cache is not None
    assert (both.scheme.weight_bits, both.scheme.kv_bytes) == (4, 1)
    settings = BenchSettings(prompt_lens=[8], context_lens=[40], batch_sizes=[2], warmup=1, repeats=2)
    cpu = torch.device("cpu")
    fp8, bf16 = (measure([decode_run(v, shape, 2, 40, settings, cpu)], settings)[0] for v in (both, base))
    assert fp8["cache"] == "StaticFP8KVCache" and bf16["cache"] == "StaticCache"
    # fp8 stores 1 byte per value: 41 positions (one free slot) as the bf16 static cache's 41
    # (+ per-layer scales and dequantization tables)
    expected = kv_cache_bytes(shape, both.scheme, 41, 2)
    assert expected <= fp8["memory"]["kv_cache_bytes"] < expected + 2048 * shape.layers
    assert fp8["memory"]["kv_cache_bytes"] < 0.55 * bf16["memory"]["kv_cache_bytes"]
