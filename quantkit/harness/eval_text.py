"""Evaluation text -> token windows.

Only what the evaluation needs is read: a text file is read up to a prefix that holds the tokens asked
for (at least READ_CHARS characters, so the text's length is reported whole for ordinary files), and a
file that is one huge line costs no more than that prefix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..calibration.data import load_texts, parse_source
from ..core.errors import CheckpointError, EvaluationError
from ..formats.loading import resolve_model_source
from ..refmodels import heldout_text_path
from .quality import model_context, token_windows

#: Characters read at least (the whole of an ordinary evaluation file), and per token asked for.
READ_CHARS = 2 << 20
CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class EvalTokens:
    """The evaluation text's tokens: ids int64 [T]; whole: True when ids is all of the text, False when only
    its first T tokens were read (the text has more)."""

    ids: torch.Tensor
    whole: bool


def _text_prefix(data: str | None, limit: int | None) -> tuple[str, bool]:
    """At most `limit` characters (None: all) of the evaluation text, and whether that is all of it. Text
    files (and the held-out text) are read only that far; JSON/Parquet/hub sources are loaded whole by
    calibration.data, then cut."""
    if data is None:
        files = (str(heldout_text_path()),)
    else:
        spec = parse_source(data, what="evaluation")
        if spec.builder != "text":
            text = "\n\n".join(load_texts(data, what="evaluation"))
            return (text, True) if limit is None or len(text) <= limit else (text[:limit], False)
        files = spec.files
    parts, left = [], limit
    for name in files:
        part, whole = _read_text_file(Path(name), -1 if left is None else max(left, 0))
        if part.strip():
            parts.append(part)
            left = None if left is None else left - len(part) - 2  # 2: the blank line joining files
        if not whole:
            return "\n\n".join(parts), False
    if not parts:
        raise EvaluationError(f"the evaluation text {data} is empty; give a file with text in it")
    return "\n\n".join(parts), True


def _read_text_file(path: Path, limit: int) -> tuple[str, bool]:
    """Up to `limit` characters (-1: all) of a UTF-8 text file (a BOM is dropped) and whether that is the whole file;
    EvaluationError for bytes that are not UTF-8 text."""
    if limit >= path.stat().st_size:  # no more characters than bytes: all of it (read(limit) would reserve limit)
        limit = -1
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read(limit)
            whole = not f.read(1)
    except UnicodeDecodeError as e:
        raise EvaluationError(
            f"evaluation {path} could not be read as UTF-8 text ({type(e).__name__}: {e}); give a UTF-8 text file"
        ) from None
    if "\0" in text:
        raise EvaluationError(f"evaluation {path} holds NUL bytes: it is not a text file; give a UTF-8 text file")
    return text, whole


def read_eval_tokens(tokenizer, data: str | None, max_tokens: int | None = None) -> EvalTokens:
    """The evaluation text's tokens, at most `max_tokens` of them (None: all): any calibration SOURCE
    (text/JSONL/Parquet file or folder, hub:...), or None for the reference models' held-out text."""
    limit = None if max_tokens is None else max(READ_CHARS, CHARS_PER_TOKEN * max_tokens)
    while True:
        text, whole = _text_prefix(data, limit)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if whole or len(ids) > max_tokens:  # the last token of a prefix may be cut: keep only those before it
            break
        limit *= 4
    ids = torch.tensor(ids if whole else ids[:max_tokens], dtype=torch.int64)  # [T]
    return EvalTokens(ids, whole)


def load_tokenizer(source: str):
    from transformers import AutoTokenizer  # import time: transformers loads only where it is used

    try:
        return AutoTokenizer.from_pretrained(resolve_model_source(source))
    except Exception as e:  # noqa: BLE001 (a corrupt tokenizer file raises KeyError, or tokenizers' own Exception)
        raise CheckpointError(
            f"could not load a tokenizer for {source!r} ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); the model folder needs its tokenizer files "
            f"(tokenizer.json, tokenizer_config.json), readable ones"
        ) from None


#: Files of a model folder that make up its tokenizer (any one present: the folder has a tokenizer of its own).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")
#: Text both tokenizers encode when compared (words, digits, punctuation, spaces, non-ASCII letters).
_PROBE_TEXT = "The quick brown fox, 1234 jumps over the lazy dog!\n  Déjà vu: naïve café; x = f(y) + 3.14"


def check_model_tokenizer(model: str, baseline: str, tokenizer) -> str:
    """Which tokenizer the evaluation uses (always the baseline's, `tokenizer`), in words for the log. A
    local `model` folder with tokenizer files of its own must agree with it: same vocabulary, same ids for a
    probe text; CheckpointError when its tokenizer cannot be read, EvaluationError when it differs (the
    scores would compare the checkpoint on text it was never meant to see)."""
    folder = Path(os.path.expanduser(resolve_model_source(model)))
    own = [name for name in TOKENIZER_FILES if (folder / name).exists()] if folder.is_dir() else []
    if not own:
        return f"the baseline's tokenizer ({baseline}); {model} has no tokenizer files of its own"
    if folder.resolve() == Path(os.path.expanduser(resolve_model_source(baseline))).resolve():
        return f"the tokenizer of {baseline}"
    theirs = load_tokenizer(model)
    if theirs.get_vocab() != tokenizer.get_vocab():
        ours, other = tokenizer.get_vocab(), theirs.get_vocab()
        differ = sum(ours.get(t) != i for t, i in other.items()) + len(set(ours) - set(other))
        raise EvaluationError(f"{model}'s own tokenizer ({', '.join(own)}) differs from the baseline's: {differ} "
                              f"tokens of {len(ours)} differ; the evaluation tokenizes with the baseline's, so the "
                              f"checkpoint would be scored on ids it may read otherwise: give the checkpoint the "
                              f"tokenizer files of the model it was quantized from")
    if theirs(_PROBE_TEXT)["input_ids"] != tokenizer(_PROBE_TEXT)["input_ids"]:
        raise EvaluationError(f"{model}'s own tokenizer ({', '.join(own)}) splits text differently from the "
                              f"baseline's (same vocabulary, other rules); give the checkpoint the tokenizer files of "
                              f"the model it was quantized from")
    return f"the baseline's tokenizer ({baseline}), the same as {model}'s own"


def eval_window(window: int | None, model_config=None) -> int:
    """Tokens per evaluation window: `window`, default min(context, 2048). A window longer than the model's
    context (model_config's max_position_embeddings) is an EvaluationError: positions the model was never
    trained on give a perplexity that means nothing, and attention over them can take very long."""
    context = model_context(model_config)
    if window is None:
        return min(context or 2048, 2048)
    if context is not None and window > context:
        raise EvaluationError(
            f"--window {window} is longer than the model's context of {context} tokens (max_position_embeddings): "
            f"use --window {context} or less"
        )
    return window


def eval_token_windows(
    tokenizer_source: str, data: str | None, *, window: int | None = None, max_tokens: int | None = None,
    model_config=None,
) -> torch.Tensor:
    """[num_windows, window] int64 token windows of the first `max_tokens` tokens (None: all) of the
    evaluation text; window as eval_window."""
    window = eval_window(window, model_config)
    text = read_eval_tokens(load_tokenizer(tokenizer_source), data, max_tokens)
    return token_windows(text.ids, window, max_tokens)
