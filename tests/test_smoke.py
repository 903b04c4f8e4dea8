"""Smoke set: the main paths end to end on the tiny reference model, fast enough to run on every
transformers version pyproject allows (CI runs this file on the oldest, the whole suite on the newest).

quantize (RTN weights; calibrated FP8 KV scales) -> eval -> bench (float, W4 and FP8-KV variants,
prefill and decode on static and FP8 caches) -> load -> generate (with the FP8 cache switched on).
"""

import json

import pytest
import torch

from quantkit.commands.cli import main


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("smoke")
    assert main(["quantize", "ref:tiny", "--recipe", "w4a16-rtn", "--out", str(root / "w4")]) == 0
    assert main(["quantize", "ref:tiny", "--recipe", "kv-fp8", "--out", str(root / "kv"),
                 "--calib-samples", "4", "--calib-seq-len", "64"]) == 0
    return root


def test_eval(checkpoints, tmp_path):
    report = tmp_path / "eval.json"
    assert main(["eval", str(checkpoints / "w4"), "--baseline", "ref:tiny", "--window", "128", "--max-tokens", "1024",
                 "--json", str(report)]) == 0
    result = json.loads(report.read_text())
    assert result["windows"] == 8 and 1 < result["baseline_perplexity"] < 1000 and result["kl_divergence"] > 0


def test_bench_float_w4_and_fp8_kv(checkpoints, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "ref:tiny", "--variants", f"w4a16-rtn,{checkpoints / 'kv'}", "--prompt-lens", "16",
                 "--context-lens", "32", "--batch-sizes", "2", "--warmup", "0", "--repeats", "1", "--device", "cpu",
                 "--gpu", "h200", "--json", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert len(data["variants"]) == 3 and len(data["prefill"]) == 3 and len(data["decode"]) == 3
    caches = {r["variant"]: r["cache"] for r in data["decode"]}
    assert caches[data["baseline"]] == "StaticCache" and caches["kv"] == "StaticFP8KVCache"
    assert all(r["median_s"] > 0 for r in data["prefill"] + data["decode"])


def test_load_and_generate(checkpoints):
    import quantkit
    from quantkit.modules.kv_cache import FP8KVCache, StaticFP8KVCache

    ids = torch.randint(0, 4096, (1, 12), generator=torch.Generator().manual_seed(0))
    w4 = quantkit.load(checkpoints / "w4")
    tokens = w4.generate(ids, max_new_tokens=4, do_sample=False)
    assert tokens.shape == (1, 16) and torch.equal(tokens[:, :12], ids)

    kv = quantkit.load(checkpoints / "kv")
    generated = kv.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert isinstance(generated.past_key_values, FP8KVCache), "generate() must store the KV cache in FP8"
    assert generated.sequences.shape == (1, 16)
    static = kv.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                         cache_implementation="static")
    assert isinstance(static.past_key_values, StaticFP8KVCache), "a static cache must be the static FP8 cache"
    assert torch.equal(static.sequences, generated.sequences)
