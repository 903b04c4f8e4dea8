"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling.

The filters are transformers' logits warpers (``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, applied in that order, keeping at least one token) written out with the same
operations, and the draw is ``torch.multinomial`` on their softmax, as transformers' ``generate`` draws:
the same logits, settings and random state give transformers' distribution and its tokens.

    config = SamplingConfig(temperature=0.8, top_k=40, top_p=0.95)
    tokens = sample(logits, config, generator)   # logits fp32 [B, V] -> int64 [B]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.errors import UsageError


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen.

    temperature: 0 picks the most likely token (greedy; top_k and top_p then do nothing); > 0 divides
      the logits by it and samples.
    top_k: sample among the k most likely tokens (ties at the k-th logit kept, as transformers does);
      0: no limit.
    top_p: sample among the most likely tokens whose probabilities (after temperature and top-k) add up
      to at least top_p (nucleus sampling); 1: no limit. 0 < top_p <= 1.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UsageError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise UsageError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UsageError(f"top_k must be an integer >= 0 (0: no top-k limit), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1] (1: no top-p limit), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        limits = [f"top-k {self.top_k}"] * (self.top_k > 0) + [f"top-p {self.top_p:g}"] * (self.top_p < 1)
        return f"sampling at temperature {self.temperature:g}" + (f", {', '.join(limits)}" if limits else "")


def filtered_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """logits fp32 [B, V] -> fp32 [B, V]: divided by the temperature, -inf outside the top-k and then the
    top-p set (transformers' warpers, same operations). Needs a sampling config (temperature > 0)."""
    if config.greedy:
        raise UsageError("a greedy config (temperature 0) samples nothing: take logits.argmax(-1)")
    scores = logits if config.temperature == 1 else logits / config.temperature
    if config.top_k:
        kth = torch.topk(scores, min(config.top_k, scores.shape[-1]))[0][..., -1, None]  # [B, 1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if config.top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=False)  # [B, V] ascending
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= 1 - config.top_p
        remove[..., -1:] = False  # the most likely token always stays
        scores = scores.masked_fill(remove.scatter(1, order, remove), -math.inf)
    return scores


def sample(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each sequence: logits fp32 [B, V] -> int64 [B]. Greedy: argmax; else one draw
    from softmax(filtered_logits) with `generator` (None: torch's global generator, as transformers)."""
    if logits.dim() != 2:
        raise UsageError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if config.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filtered_logits(logits, config), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
