"""Quality of a quantized model against its baseline: perplexity, KL divergence, top-1 agreement.

Perplexity uses non-overlapping windows of a stated length over the whole token stream (the last
partial window is dropped); every window predicts its tokens 2..W from the ones before. KL is
KL(P_baseline || P_model) of the next-token distributions, averaged over the same positions.

Noise: the change in log-perplexity is the mean over windows of each window's change in mean
negative log-likelihood; its standard error (the spread of those per-window changes over
sqrt(windows), windows taken as independent samples of the text) says how large a perplexity
change the text alone would produce by chance.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from tqdm.auto import tqdm

from ..core.errors import EvaluationError, UsageError
from .baseline import check_same_source
from .results import QualityResult


def token_windows(ids: torch.Tensor, window: int, max_tokens: int | None = None) -> torch.Tensor:
    """ids: int64 [T] -> [num_windows, window] non-overlapping windows (tail dropped).

    window: >= 2 (a window predicts its tokens 2..W); max_tokens: None (all) or >= 1.
    """
    if ids.dim() != 1:
        raise ValueError(f"expected a 1-D token stream, got shape {tuple(ids.shape)}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise EvaluationError(f"the window must be an integer >= 2 (a window predicts its tokens 2..W), got {window!r}")
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise EvaluationError(f"max_tokens must be None (all) or an integer >= 1, got {max_tokens!r}")
        ids = ids[:max_tokens]
    n = ids.numel() // window
    if n == 0:
        raise EvaluationError(f"the evaluation text has {ids.numel()} tokens, fewer than one window of {window}; "
                              f"give more text (or a larger --max-tokens) or a shorter --window")
    return ids[: n * window].reshape(n, window)  # [num_windows, window]


def evaluate_quality(
    model: nn.Module, baseline: nn.Module, windows: torch.Tensor, *, batch_size: int = 8, progress: bool = True,
    allow_other_baseline: bool = False,
) -> QualityResult:
    """Run both models over the same windows ([num_windows, W] int64) and compare them (see check_comparable)."""
    return evaluate_variants({"model": model}, baseline, windows, batch_size=batch_size, progress=progress,
                             allow_other_baseline=allow_other_baseline)["model"]


def check_comparable(
    models: dict[str, nn.Module], baseline: nn.Module, windows: torch.Tensor, *, allow_other_baseline: bool = False,
) -> None:
    """UsageError unless every model shares the baseline's vocabulary and the token ids fit it, and (unless
    allow_other_baseline) the baseline is the model each was quantized from (harness/baseline.py)."""
    def vocab(m: nn.Module) -> int | None:
        return getattr(getattr(m, "config", None), "vocab_size", None)

    base_vocab = vocab(baseline)
    for name, model in models.items():
        which = (getattr(model, "name_or_path", "") or "the model") if name == "model" else f"variant {name!r}"
        if vocab(model) is not None and base_vocab is not None and vocab(model) != base_vocab:
            raise UsageError(
                f"{which} has a vocabulary of {vocab(model)} tokens but the baseline has {base_vocab}: they are "
                f"different models; compare a checkpoint with the float model it was quantized from"
            )
        if not allow_other_baseline:
            check_same_source(model, baseline, which)
    if windows.numel() and base_vocab is not None and int(windows.max()) >= base_vocab:
        raise UsageError(
            f"the evaluation text has token ids up to {int(windows.max())}, beyond the models' vocabulary of "
            f"{base_vocab}: the tokenizer does not belong to these models"
        )


@torch.no_grad()
def evaluate_variants(
    models: dict[str, nn.Module], baseline: nn.Module, windows: torch.Tensor, *, batch_size: int = 8,
    progress: bool = True, allow_other_baseline: bool = False,
) -> dict[str, QualityResult]:
    """Compare several models with one baseline; the baseline runs once per batch for all of them."""
    check_comparable(models, baseline, windows, allow_other_baseline=allow_other_baseline)
    context = model_context(getattr(baseline, "config", None))
    if context is not None and windows.shape[1] > context:
        raise EvaluationError(f"windows of {windows.shape[1]} tokens are longer than the model's context of {context} "
                              f"tokens (max_position_embeddings): use windows of {context} tokens or fewer")
    sums = {name: {"nll": 0.0, "kl": 0.0, "agree": 0.0} for name in models}
    window_deltas: dict[str, list[torch.Tensor]] = {name: [] for name in models}  # per-window change in mean NLL
    base_nll, count = 0.0, 0
    for index, batch in enumerate(tqdm(windows.split(batch_size), desc="eval", unit="batch", disable=not progress)):
        target = batch[:, 1:].unsqueeze(-1)  # [B, W-1, 1]
        base_logp = _log_probs(baseline, batch, "the baseline", index * batch_size)  # [B, W-1, V]
        base_p = base_logp.exp()
        base_top1 = base_logp.argmax(-1)
        base_window_nll = -base_logp.gather(-1, target).squeeze(-1).mean(-1)  # [B]
        base_nll += -base_logp.gather(-1, target).sum().item()
        for name, model in models.items():
            logp = _log_probs(model, batch, repr(name), index * batch_size)  # [B, W-1, V]
            acc = sums[name]
            acc["nll"] += -logp.gather(-1, target).sum().item()
            window_deltas[name].append(-logp.gather(-1, target).squeeze(-1).mean(-1) - base_window_nll)
            acc["kl"] += (base_p * (base_logp - logp)).sum().item()
            acc["agree"] += (logp.argmax(-1) == base_top1).sum().item()
        count += target.numel()
    return {
        name: QualityResult(
            name=name,
            perplexity=math.exp(acc["nll"] / count),
            baseline_perplexity=math.exp(base_nll / count),
            kl_divergence=acc["kl"] / count,
            top1_agreement=acc["agree"] / count,
            window=windows.shape[1],
            windows=windows.shape[0],
            tokens=count,
            log_ppl_ratio_stderr=_stderr(torch.cat(window_deltas[name])),
            dtype=str(next(baseline.parameters()).dtype).removeprefix("torch."),
        )
        for name, acc in sums.items()
    }


def _log_probs(model: nn.Module, batch: torch.Tensor, what: str, first_window: int) -> torch.Tensor:
    """[B, W] token ids -> fp32 log-probabilities of the next token [B, W-1, V] on the CPU; NaN/Inf logits
    are an EvaluationError (a perplexity of nan, or a wrong finite one, must not be printed)."""
    device = next(model.parameters()).device
    logits = model(batch.to(device)).logits[:, :-1].float()  # [B, W-1, V]
    if not torch.isfinite(logits).all():
        raise EvaluationError(
            f"{what} produced NaN/Inf logits on windows {first_window}..{first_window + batch.shape[0] - 1}: its "
            f"weights or activations overflow (fp16?); evaluate it in bfloat16 or float32 (--dtype), or check the "
            f"checkpoint"
        )
    return torch.log_softmax(logits, dim=-1).cpu()


def model_context(model_config) -> int | None:
    """The longest sequence the model was built for (max_position_embeddings), or None if unknown."""
    if model_config is None:
        return None
    if hasattr(model_config, "get_text_config"):
        model_config = model_config.get_text_config(decoder=True)
    context = getattr(model_config, "max_position_embeddings", None)
    return int(context) if isinstance(context, int) and context > 0 else None


def _stderr(values: torch.Tensor) -> float | None:
    """Standard error of the mean of ``values`` ([n] float), None when n < 2."""
    if values.numel() < 2:
        return None
    return float(values.double().std() / math.sqrt(values.numel()))


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
