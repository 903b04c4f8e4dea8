"""Evaluation text -> token windows."""

from __future__ import annotations

import torch

from ..errors import CheckpointError, EvaluationError
from ..loading import resolve_model_source
from .quality import model_context, token_windows


def read_eval_text(data: str | None) -> str:
    """The evaluation text: any calibration SOURCE (text/JSONL/Parquet file or folder, hub:...), or None
    for the reference models' held-out text."""
    if data is None:
        from ..refmodels import heldout_text_path

        return heldout_text_path().read_text(encoding="utf-8")
    from ..calibration.data import load_texts

    return "\n\n".join(load_texts(data, what="evaluation"))


def load_tokenizer(source: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(resolve_model_source(source))
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"no tokenizer found for {source!r} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
            f"the model folder needs its tokenizer files (tokenizer.json, tokenizer_config.json)"
        ) from None


def eval_token_windows(
    tokenizer_source: str, data: str | None, *, window: int | None = None, max_tokens: int | None = None,
    model_config=None,
) -> torch.Tensor:
    """[num_windows, window] int64 token windows of the evaluation text.

    window: default min(context, 2048); a window longer than the model's context (model_config's
    max_position_embeddings) is an EvaluationError: positions the model was never trained on give
    a perplexity that means nothing, and attention over them can take very long.
    """
    context = model_context(model_config)
    if window is None:
        window = min(context or 2048, 2048)
    elif context is not None and window > context:
        raise EvaluationError(
            f"--window {window} is longer than the model's context of {context} tokens (max_position_embeddings): "
            f"use --window {context} or less"
        )
    tokenizer = load_tokenizer(tokenizer_source)
    text = read_eval_text(data)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)
    return token_windows(ids, window, max_tokens)
