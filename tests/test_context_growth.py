"""Where the KV cache overtakes the weights: harness/context_growth.py on a real bench run."""

import json
import re

import pytest
import torch

from quantkit.harness.context_growth import cache_growth, growth_lines, narrower_cache_pairs
from quantkit.harness.report import render_report
from quantkit.harness.timing import BenchSettings, run_bench
from quantkit.harness.variants import build_variant, float_variant, load_source_model

from .test_report import TEST_DEVICE, TINY_LLAMA

CONTEXTS = [8, 64, 200]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    config = tmp_path_factory.mktemp("growth") / "tiny.json"
    config.write_text(json.dumps(TINY_LLAMA))
    model = load_source_model(str(config), dtype=torch.bfloat16, device="cpu")
    variants = [float_variant(model)] + [build_variant(spec, model, dtype=torch.bfloat16, device="cpu",
                                                       backend="reference")
                                         for spec in ("w4a16-rtn", "w4a16-rtn+kv-fp8")]
    settings = BenchSettings(prompt_lens=[8], context_lens=CONTEXTS, batch_sizes=[1, 2], warmup=0, repeats=2)
    return run_bench(variants, TEST_DEVICE, settings, device="cpu", model_label="tiny-random", progress=False)


def _kv_bytes_per_token(value_bytes: int, batch: int) -> int:
    """K and V of every layer and KV head for one cached position, from the config itself."""
    head_dim = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]
    return 2 * TINY_LLAMA["num_hidden_layers"] * TINY_LLAMA["num_key_value_heads"] * head_dim * value_bytes * batch


@pytest.mark.parametrize("batch", [1, 2])
def test_the_cache_per_token_is_the_configs_kv_bytes_and_the_crossover_divides_the_weights_by_it(bench, batch):
    growth = {g.variant: g for g in cache_growth(bench, batch)}
    assert list(growth) == ["bf16", "w4a16-rtn", "w4a16-rtn+kv-fp8"]
    assert growth["bf16"].cache_bytes_per_token == _kv_bytes_per_token(2, batch)  # bf16 cache
    assert growth["w4a16-rtn"].cache_bytes_per_token == _kv_bytes_per_token(2, batch)
    assert growth["w4a16-rtn+kv-fp8"].cache_bytes_per_token == _kv_bytes_per_token(1, batch)  # FP8
    for g in growth.values():
        [record] = [r for r in bench["decode"] if r["variant"] == g.variant and r["batch"] == batch
                    and r["context_len"] == CONTEXTS[0]]
        parts = record["roofline"]["bytes_breakdown"]
        assert g.weight_bytes == parts["weights"] + parts["lm_head"]
        assert g.crossover_context == pytest.approx(g.weight_bytes / g.cache_bytes_per_token)
        assert g.cache_share(round(g.crossover_context) - 1) == pytest.approx(0.5, abs=1e-3)
        assert sorted(g.by_context) == CONTEXTS
    assert growth["bf16"].crossover_context > growth["w4a16-rtn"].crossover_context  # 16 against ~4.1 bits (a float head)
    assert growth["w4a16-rtn+kv-fp8"].crossover_context == pytest.approx(2 * growth["w4a16-rtn"].crossover_context)


def test_only_the_same_weights_with_a_narrower_cache_pair_up(bench):
    pairs = narrower_cache_pairs(cache_growth(bench, 1))
    assert [(wide.variant, narrow.variant) for wide, narrow in pairs] == [("w4a16-rtn", "w4a16-rtn+kv-fp8")]


def test_the_report_says_where_the_cache_overtakes_the_weights_and_what_fp8_buys(bench, tmp_path):
    lines = growth_lines(bench, 1)
    text = "\n".join(lines)
    growth = {g.variant: g for g in cache_growth(bench, 1)}
    row = re.search(r"\| w4a16-rtn \| [\d.]+ MiB \| ([\d.]+) KiB \| ([\d.]+k?) tokens \| (\d+)% \|", text)
    assert row, text
    assert float(row[1]) == pytest.approx(_kv_bytes_per_token(2, 1) / 1024, abs=0.05)
    w4 = growth["w4a16-rtn"]
    shown = float(row[2].rstrip("k")) * (1000 if row[2].endswith("k") else 1)
    assert shown == pytest.approx(w4.crossover_context, rel=0.03)  # shown as 2.4k
    assert int(row[3]) == round(100 * w4.cache_share(CONTEXTS[-1]))
    fp8 = growth["w4a16-rtn+kv-fp8"]
    measured = w4.by_context[200]["median_s"] / fp8.by_context[200]["median_s"]
    allowed = w4.step_bytes(200) / fp8.step_bytes(200)
    assert f"at 200 tokens its step ran {measured:.2f}x as fast" in text
    assert f"the weight and cache bytes allow {allowed:.2f}x" in text and allowed > 1
    render_report(bench, [], tmp_path, title="t")
    assert "Where the KV cache overtakes the weights, batch 1" in (tmp_path / "report.md").read_text()


def test_one_context_gives_no_growth_words(bench):
    one = dict(bench, decode=[r for r in bench["decode"] if r["context_len"] == CONTEXTS[0]])
    assert growth_lines(one, 1) == []
