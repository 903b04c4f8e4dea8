"""evals/kernels/bench_decode_cpu.py end to end on a tiny Llama: runs, reports, and --fuse keeps the outputs."""

from __future__ import annotations

import json

import torch

from .eval_scripts import load_eval_script

TINY = ["--layers", "2", "--hidden", "256", "--intermediate", "768", "--heads", "4", "--kv-heads", "2",
        "--vocab", "512", "--prompt", "8", "--new-tokens", "3", "--rounds", "2", "--threads", "1"]


def test_decode_bench_runs_and_reports(tmp_path):
    bench = load_eval_script("bench_decode_cpu")
    result = bench.main(["--out", str(tmp_path), "--variants", "bf16,w8,w4-all", *TINY])
    saved = json.loads((tmp_path / "decode_cpu.json").read_text())
    assert set(saved["variants"]) == {"bf16", "w8", "w4-all"}
    for name, v in saved["variants"].items():
        assert v["steps_timed"] == 3 and v["tokens_per_s"] > 0 and v["median_prefill_ms"] > 0
        assert abs(v["prefill_speedup_vs_bf16"] - result["variants"]["bf16"]["median_prefill_ms"]
                   / v["median_prefill_ms"]) < 1e-9
        assert abs(v["speedup_vs_bf16"] - result["variants"]["bf16"]["median_ms_per_token"]
                   / v["median_ms_per_token"]) < 1e-9
    assert saved["variants"]["w4-all"]["lm_head_quantized"] and not saved["variants"]["w8"]["lm_head_quantized"]
    size = {name: v["weight_GB"] for name, v in saved["variants"].items()}
    assert size["w4-all"] < size["w8"] < size["bf16"]
    assert "| w8 | w8a16-rtn |" in (tmp_path / "decode_cpu.md").read_text()


def test_fused_projections_match_separate_linears():
    bench = load_eval_script("bench_decode_cpu")
    args = bench.argparse.Namespace(hidden=256, intermediate=768, layers=2, heads=4, kv_heads=2, vocab=512, seed=0)
    base = bench.build_model(args)
    separate = bench.quantized_copy(base, "w8a16-rtn", False, "torch", fuse=False)
    fused = bench.quantized_copy(base, "w8a16-rtn", False, "torch", fuse=True)
    assert any(isinstance(m, bench.FusedProjections) for m in fused.modules())
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        a, b = separate(ids).logits.float(), fused(ids).logits.float()
    assert ((a - b).abs().mean() / a.abs().mean()).item() < 2 ** -7  # bf16 compute, other summation split
