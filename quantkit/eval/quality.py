"""Quality of a quantized model against its baseline: perplexity, KL divergence, top-1 agreement.

Perplexity uses non-overlapping windows of a stated length over the whole token stream (the last
partial window is dropped); every window predicts its tokens 2..W from the ones before. KL is
KL(P_baseline || P_model) of the next-token distributions, averaged over the same positions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn
from tqdm.auto import tqdm


@dataclass
class QualityResult:
    perplexity: float
    baseline_perplexity: float
    kl_divergence: float
    top1_agreement: float
    window: int
    windows: int
    tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def token_windows(ids: torch.Tensor, window: int, max_tokens: int | None = None) -> torch.Tensor:
    """ids: int64 [T] -> [num_windows, window] non-overlapping windows (tail dropped)."""
    if ids.dim() != 1:
        raise ValueError(f"expected a 1-D token stream, got shape {tuple(ids.shape)}")
    if max_tokens is not None:
        ids = ids[:max_tokens]
    n = ids.numel() // window
    if n == 0:
        raise ValueError(f"the evaluation text has {ids.numel()} tokens, fewer than one window of {window}; "
                         f"give more text or a shorter --window")
    return ids[: n * window].reshape(n, window)  # [num_windows, window]


@torch.no_grad()
def evaluate_quality(
    model: nn.Module, baseline: nn.Module, windows: torch.Tensor, *, batch_size: int = 8, progress: bool = True,
) -> QualityResult:
    """Run both models over the same windows ([num_windows, W] int64) and compare them."""
    nll = base_nll = kl = agree = 0.0
    count = 0
    device = next(model.parameters()).device
    base_device = next(baseline.parameters()).device
    batches = windows.split(batch_size)
    for batch in tqdm(batches, desc="eval", unit="batch", disable=not progress):
        logp = torch.log_softmax(model(batch.to(device)).logits[:, :-1].float(), dim=-1).cpu()  # [B, W-1, V]
        base_logp = torch.log_softmax(baseline(batch.to(base_device)).logits[:, :-1].float(), dim=-1).cpu()
        target = batch[:, 1:].unsqueeze(-1)  # [B, W-1, 1]
        nll += -logp.gather(-1, target).sum().item()
        base_nll += -base_logp.gather(-1, target).sum().item()
        kl += (base_logp.exp() * (base_logp - logp)).sum().item()
        agree += (logp.argmax(-1) == base_logp.argmax(-1)).sum().item()
        count += target.numel()
    return QualityResult(
        perplexity=math.exp(nll / count),
        baseline_perplexity=math.exp(base_nll / count),
        kl_divergence=kl / count,
        top1_agreement=agree / count,
        window=windows.shape[1],
        windows=windows.shape[0],
        tokens=count,
    )


@torch.no_grad()
def perplexity(model: nn.Module, windows: torch.Tensor, *, batch_size: int = 8) -> float:
    """Perplexity alone over [num_windows, W] windows."""
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for batch in windows.split(batch_size):
        logp = torch.log_softmax(model(batch.to(device)).logits[:, :-1].float(), dim=-1)
        nll += -logp.gather(-1, batch[:, 1:].to(device).unsqueeze(-1)).sum().item()
        count += batch[:, 1:].numel()
    return math.exp(nll / count)
