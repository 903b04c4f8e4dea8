"""Evaluation text -> token windows."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CheckpointError
from ..loading import resolve_model_source
from .quality import token_windows


def read_eval_text(data: str | None) -> str:
    """A text file, a folder of .txt files (sorted), or None for the reference models' held-out text."""
    if data is None:
        from ..refmodels import heldout_text_path

        return heldout_text_path().read_text()
    path = Path(data)
    if path.is_file():
        return path.read_text(errors="replace")
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise FileNotFoundError(f"evaluation data folder {path} has no .txt files")
        return "\n\n".join(f.read_text(errors="replace") for f in files)
    raise FileNotFoundError(f"evaluation data {data!r} is neither a file nor a folder")


def load_tokenizer(source: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(resolve_model_source(source))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"no tokenizer found for {source!r} ({e}); the model folder needs its tokenizer files") from None


def eval_token_windows(
    tokenizer_source: str, data: str | None, *, window: int | None = None, max_tokens: int | None = None,
    model_config=None,
) -> torch.Tensor:
    """[num_windows, window] int64 token windows of the evaluation text."""
    tokenizer = load_tokenizer(tokenizer_source)
    text = read_eval_text(data)
    if window is None:
        context = getattr(model_config, "max_position_embeddings", 2048) or 2048
        window = min(context, 2048)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)
    return token_windows(ids, window, max_tokens)
