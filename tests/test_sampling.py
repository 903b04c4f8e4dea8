"""quantkit.runtime.sampling: transformers' warpers and draw, exactly; the sampled token is always one the settings
allow; greedy is argmax; bad settings are refused with the rule."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from quantkit.core.errors import UsageError
from quantkit.runtime.sampling import SamplingConfig, filtered_logits, sample

CONFIGS = [SamplingConfig(1.0), SamplingConfig(0.7), SamplingConfig(1.3, top_k=5), SamplingConfig(1.0, top_p=0.9),
           SamplingConfig(0.8, top_k=40, top_p=0.95), SamplingConfig(2.0, top_k=1), SamplingConfig(0.5, top_p=0.01),
           SamplingConfig(1.0, top_p=1e-9)]  # the most likely token stays however small top_p


def transformers_warpers(config: SamplingConfig) -> LogitsProcessorList:
    """What transformers' generate applies for do_sample=True with these settings (_get_logits_processor)."""
    warpers = LogitsProcessorList()
    if config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k:
        warpers.append(TopKLogitsWarper(config.top_k))
    if config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(config.top_p))
    return warpers


def random_logits(batch, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * 3


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.describe())
@pytest.mark.parametrize("batch,vocab", [(1, 50), (3, 1000), (2, 8192)])
def test_filters_equal_transformers_warpers(config, batch, vocab):
    logits = random_logits(batch, vocab, seed=vocab + batch)
    logits[0, :4] = logits[0, 4]  # ties at the top
    want = transformers_warpers(config)(torch.zeros(batch, 1, dtype=torch.long), logits.clone())
    assert torch.equal(filtered_logits(logits, config), want)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.describe())
def test_same_random_state_draws_transformers_tokens(config):
    """transformers' _sample: softmax of the warped scores, torch.multinomial on the global generator."""
    logits = random_logits(4, 500, seed=7)
    torch.manual_seed(123)
    want = torch.multinomial(torch.softmax(transformers_warpers(config)(None, logits.clone()), -1), 1).squeeze(1)
    torch.manual_seed(123)
    assert torch.equal(sample(logits, config), want)


def test_a_seeded_generator_repeats_its_draws():
    logits = random_logits(2, 300, seed=1)
    config = SamplingConfig(1.0)
    draws = [torch.stack([sample(logits, config, g) for _ in range(20)])
             for g in (torch.Generator().manual_seed(5), torch.Generator().manual_seed(5))]
    assert torch.equal(*draws)
    assert draws[0].unique().numel() > 1  # it does sample


@st.composite
def logits_and_config(draw):
    batch, vocab = draw(st.integers(1, 3)), draw(st.integers(1, 64))
    values = draw(st.lists(st.floats(-30, 30, allow_nan=False, width=32), min_size=batch * vocab,
                           max_size=batch * vocab))
    config = SamplingConfig(draw(st.floats(0.05, 5.0)), draw(st.integers(0, vocab + 2)),
                            draw(st.floats(1e-3, 1.0, exclude_min=True) | st.just(1.0)))
    return torch.tensor(values, dtype=torch.float32).reshape(batch, vocab), config, draw(st.integers(0, 2**31))


@settings(max_examples=200, deadline=None)
@given(logits_and_config())
def test_the_sampled_token_is_inside_the_top_k_and_top_p_sets(case):
    """The rules stated from the logits alone: a top-k token has fewer than k logits above its own; a top-p
    token has less than top_p of the (tempered, top-k) probability on tokens more likely than itself."""
    logits, config, seed = case
    tokens = sample(logits, config, torch.Generator().manual_seed(seed))
    for row, token in zip(logits, tokens.tolist()):
        if config.top_k:
            assert (row > row[token]).sum() < config.top_k
        kth = torch.topk(row, min(config.top_k, row.numel()))[0][-1] if config.top_k else -math.inf
        kept = row.masked_fill(row < kth, -math.inf)
        probs = torch.softmax(kept.double() / config.temperature, -1)
        assert probs[token] > 0
        assert probs[probs > probs[token]].sum() < config.top_p + 1e-5


@settings(max_examples=100, deadline=None)
@given(logits_and_config())
def test_greedy_is_argmax(case):
    logits, _, _ = case
    assert torch.equal(sample(logits, SamplingConfig(0.0, top_k=3, top_p=0.5)), logits.argmax(-1))
    assert SamplingConfig().greedy


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5), st.booleans(), st.none()),
       st.one_of(st.integers(-5, 100), st.floats(0, 3), st.booleans()),
       st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 2)))
def test_settings_are_valid_or_refused_with_the_rule(temperature, top_k, top_p):
    valid = (not isinstance(temperature, bool) and isinstance(temperature, (int, float)) and math.isfinite(temperature)
             and temperature >= 0 and not isinstance(top_k, bool) and isinstance(top_k, int) and top_k >= 0
             and math.isfinite(top_p) and 0 < top_p <= 1)
    if valid:
        SamplingConfig(temperature, top_k, top_p)
    else:
        with pytest.raises(UsageError, match="temperature|top_k|top_p"):
            SamplingConfig(temperature, top_k, top_p)


def test_logits_must_be_batch_by_vocab():
    with pytest.raises(UsageError, match=r"\[batch, vocab\]"):
        sample(torch.zeros(5), SamplingConfig())
