"""The advisor's recommendation moves in the expected direction with memory, output length and quality."""

import argparse
import json

import pytest

from quantkit.harness.advisor import Workload, advise, quality_key
from quantkit.harness.hardware import known_gpu
from quantkit.harness.results import QualityResult
from quantkit.harness.roofline import ModelShape

# An 8B Llama-3-like shape: 16 GB of fp16 weights.
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)


@pytest.fixture
def shape():
    return ModelShape.from_config(LLAMA_8B)


def test_roomy_memory_long_output_prefers_quantized(shape):
    a = advise(shape, known_gpu("h200"), Workload(prompt_len=1024, output_len=1024, batch=1))
    assert a.recommended is not None and a.recommended.scheme.weight_bits == 4
    fp16 = next(c for c in a.candidates if c.name == "fp16")
    # decode dominates and W4 reads ~3x fewer bytes per step
    assert fp16.total_s / a.recommended.total_s > 2.5
    assert a.recommended.decode_bound == "memory" and a.recommended.prefill_bound == "compute"


def test_output_length_moves_the_choice(shape):
    gpu = known_gpu("h100-sxm")
    short = advise(shape, gpu, Workload(prompt_len=4096, output_len=1, batch=1))
    long = advise(shape, gpu, Workload(prompt_len=4096, output_len=2048, batch=1))
    # one token: all prefill (compute-bound), quantization buys nothing -> keep full precision
    assert short.recommended.name == "fp16"
    assert "within" in short.reason or "fastest" in short.reason
    assert long.recommended.scheme.quantized

    def gain(advice):
        c = {x.name: x for x in advice.candidates}
        return c["fp16"].total_s / c["w4g128"].total_s

    gains = [gain(advise(shape, gpu, Workload(4096, o, 1))) for o in (1, 16, 256, 4096)]
    assert gains == sorted(gains) and gains[0] == pytest.approx(1.0, abs=0.01) and gains[-1] > 2.5


def test_tight_memory_forces_w4(shape):
    gpu = known_gpu("l4")
    work = Workload(prompt_len=2048, output_len=256, batch=4)
    roomy = advise(shape, gpu, work, memory_budget=24e9, min_gain=10.0)  # quality first unless 11x faster
    assert roomy.recommended.name == "fp16"
    tight = advise(shape, gpu, work, memory_budget=8e9, min_gain=10.0)  # W8 weights alone are ~9 GB
    assert tight.recommended.scheme.weight_bits == 4
    assert all(not c.fits for c in tight.candidates if c.scheme.weight_bits > 8)
    assert "needs" in tight.reason
    none = advise(shape, gpu, work, memory_budget=2e9)
    assert none.recommended is None and "nothing fits" in none.reason


def test_larger_batch_makes_fp8_kv_matter_more(shape):
    gpu = known_gpu("h200")

    def kv_gain(batch):
        c = {x.name: x for x in advise(shape, gpu, Workload(4096, 512, batch)).candidates}
        return c["w4g128"].tpot_s / c["w4g128+kv8"].tpot_s

    assert kv_gain(64) > kv_gain(8) > kv_gain(1) > 1.0


def test_quality_budget_excludes_lossy_schemes(shape):
    quality = [
        QualityResult("w8a16-rtn", perplexity=10.05, baseline_perplexity=10.0, kl_divergence=0.001),
        QualityResult("w4a16-rtn", perplexity=10.6, baseline_perplexity=10.0, kl_divergence=0.04),
    ]
    work = Workload(prompt_len=1024, output_len=1024, batch=1)
    a = advise(shape, known_gpu("h200"), work, quality=quality, max_ppl_increase=0.03)
    assert a.recommended.scheme.weight_bits == 8
    by_name = {c.name: c for c in a.candidates}
    assert not by_name["w4g128"].within_quality and not by_name["w4g128+kv8"].within_quality
    assert by_name["w8"].quality.kl_divergence == 0.001
    # relaxing the budget lets W4 back in
    b = advise(shape, known_gpu("h200"), work, quality=quality, max_ppl_increase=0.10)
    assert b.recommended.scheme.weight_bits == 4
    c = advise(shape, known_gpu("h200"), work, quality=quality, max_kl=0.01)
    assert c.recommended.scheme.weight_bits == 8


def test_quality_key_from_recipe_name_and_checkpoint(tmp_path):
    assert quality_key(QualityResult("w4a16-rtn", 1.0)) == (4, 16, True)
    assert quality_key(QualityResult("w4a16-rtn-asym", 1.0)) == (4, 16, False)
    assert quality_key(QualityResult("w8a16-rtn", 1.0)) == (8, 16, True)
    assert quality_key(QualityResult("kv-fp8", 1.0)) == (16, 8, True)
    assert quality_key(QualityResult("small-w4-kv8", 1.0)) == (4, 8, True)
    assert quality_key(QualityResult("small-w4a16-rtn-asym", 1.0)) == (4, 16, False)
    assert quality_key(QualityResult("something", 1.0)) is None
    # a float32 checkpoint folder describes its own scheme (matched whatever its dtype)
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float32", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                                   "strategy": "channel"}}}, "ignore": ["lm_head"]}}))
    assert quality_key(QualityResult("renamed", 1.0, model=str(tmp_path))) == (8, 16, True)


def test_advise_command(tmp_path, capsys):
    from quantkit.commands import advise as advise_cmd

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **LLAMA_8B}))
    q = tmp_path / "w4.json"
    q.write_text(json.dumps({"recipe": "w4a16-rtn", "perplexity": 11.0, "baseline_perplexity": 10.0,
                             "kl_divergence": 0.05, "top1_agreement": 0.9}))
    parser = argparse.ArgumentParser()
    advise_cmd.register(parser.add_subparsers())
    out = tmp_path / "advice.json"
    args = parser.parse_args(["advise", str(tmp_path), "--gpu", "a100", "--prompt-len", "512", "--output-len", "512",
                              "--batch", "2", "--quality", str(q), "--max-ppl-increase", "5", "--json", str(out)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "recommendation:" in text and "w4g128" in text
    advice = json.loads(out.read_text())
    # W4 exceeds the 5% budget and no other lossy scheme was measured: only the float model is known to be within it
    assert advice["recommended"] == "fp16"
    assert len(advice["candidates"]) == 6
    from quantkit.commands.cli import main

    assert main(["advise", str(tmp_path), "--gpu", "voodoo5", "--prompt-len", "1", "--output-len", "1"]) == 2
    assert "quantkit advise: error: unknown GPU" in capsys.readouterr().err


def test_advise_refuses_a_probe_that_measured_nonsense(tmp_path, capsys, monkeypatch):
    from quantkit.commands.cli import main
    from quantkit.harness import hardware

    # what a bf16 matmul probe measures on a CPU without native bf16: 0.3 GFLOP/s at 11 GB/s
    emulated = hardware.DeviceSpec(name="AVX2 CPU", memory_bandwidth=11e9, peak_flops=0.3e9, memory_bytes=16e9,
                                   source="probe", notes="bfloat16 matmul n=1536")
    monkeypatch.setattr(hardware, "resolve_device_spec", lambda name, device=None, dtype=None: emulated)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **LLAMA_8B}))
    assert main(["advise", str(tmp_path), "--gpu", "probe", "--prompt-len", "512", "--output-len", "512"]) == 2
    err = capsys.readouterr().err
    assert "no roofline to advise from" in err and "0.3 GFLOP/s" in err


def test_only_measured_schemes_are_recommended_when_quality_is_given(shape):
    """A GPTQ W4 result says nothing of W4 + FP8 KV: that scheme, faster on paper, is not recommended."""
    gptq = QualityResult("w4a16-gptq", perplexity=10.3, baseline_perplexity=10.0, kl_divergence=0.02)
    a = advise(shape, known_gpu("h200"), Workload(prompt_len=1024, output_len=1024), quality=[gptq])
    by_name = {c.name: c for c in a.candidates}
    assert by_name["w4g128+kv8"].total_s < by_name["w4g128"].total_s  # the faster one...
    assert a.recommended.name == "w4g128" and a.recommended.quality is gptq  # ...is not the one recommended
    assert "quality not measured" in " ".join(by_name["w4g128+kv8"].excluded_because)
    assert "NOT measured" not in a.reason and "perplexity +3.00%" in a.reason
    # a quality budget without any result: nothing lossy is known to be within it
    budget_only = advise(shape, known_gpu("h200"), Workload(1024, 1024), max_ppl_increase=0.05)
    assert budget_only.recommended.name == "fp16"
    # no quality asked about at all: speed and memory only, and the reason says so
    speed_only = advise(shape, known_gpu("h200"), Workload(1024, 1024))
    assert speed_only.recommended.scheme.quantized and "quality was NOT measured" in speed_only.reason


def test_advice_labels_derated_and_datasheet_figures(shape):
    from quantkit.harness.advisor import format_advice

    first = format_advice(advise(shape, known_gpu("h200"), Workload(128, 128)))[0]
    assert "4.32 TB/s" in first and "791 TFLOP/s" in first and "derated" in first
    assert "datasheet's 4.80 TB/s and 989 TFLOP/s" in first and "(datasheet)" not in first


def test_workload_must_fit_the_context():
    from quantkit.core.errors import UsageError

    small = ModelShape.from_config(LLAMA_8B | {"max_position_embeddings": 512})
    advise(small, known_gpu("h200"), Workload(prompt_len=500, output_len=12))  # 512 in all: fits
    with pytest.raises(UsageError, match="513 tokens, longer than the model's context of 512"):
        advise(small, known_gpu("h200"), Workload(prompt_len=500, output_len=13))
