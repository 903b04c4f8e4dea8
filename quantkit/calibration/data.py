"""Calibration data: where the text comes from, and deterministic token windows sampled from it.

A calibration SOURCE is one of

- a local file: text (``.txt .text .md .rst .py``), JSON lines / JSON (``.jsonl .json``) or Parquet
  (``.parquet``); JSON and Parquet rows are read from the ``column`` field (default ``text``);
- a local folder: its ``*.parquet`` files if it has any, else its ``*.jsonl``/``*.json`` files, else its
  text files (searched recursively, in sorted order);
- a `datasets` hub dataset: ``hub:NAME[:CONFIG]:SPLIT:COLUMN``, e.g.
  ``hub:wikitext:wikitext-2-raw-v1:train:text`` or ``hub:allenai/c4:train:text`` (needs network access);
- ``ref``: the training text of the built-in reference models (the default for them).

Files are read with `datasets.load_dataset("text" | "json" | "parquet", data_files=...)`, offline.

Sampling (deterministic for a seed): every row is cut into pieces of at most 8192 characters at line
ends, the pieces are shuffled with the seed and tokenized in that order (joined by a blank line) until
there are ``num_samples * seq_len`` tokens, which are cut into ``num_samples`` windows of ``seq_len``.
When the tokenizer starts sequences with a BOS token, each window starts with it, as in inference.

In Python, `calibration_data` may also be token ids: a LongTensor [T] or [B, T], or a list of them.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import refmodels
from ..core.errors import QuantizationError
from ..refmodels import corpus, train_text_path

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
CHUNK_CHARS = 8192
MIN_CALIBRATION_TOKENS = 256
DEFAULT_NUM_SAMPLES = 128
DEFAULT_SEQ_LEN = 2048
BATCH_TOKENS = 8192  # default batch: as many samples as fit in this many tokens

SOURCE_HELP = (
    "a text/JSONL/Parquet file or folder, 'hub:NAME[:CONFIG]:SPLIT:COLUMN', or 'ref' (reference models' training text)"
)


@dataclass(frozen=True)
class CalibrationConfig:
    """How calibration data is drawn.

    source: see the module docstring; None means the model's default (the training text for the built-in
      reference models; other models need a source).
    num_samples, seq_len: number and length (tokens) of the windows; seq_len None: min(2048, model context).
    seed: the shuffling seed (same seed, same data, same windows).
    column: the text field of JSON/Parquet rows (hub sources name their column themselves).
    batch_size: windows per forward pass; None: as many as fit in 8192 tokens.
    """

    source: str | None = None
    num_samples: int = DEFAULT_NUM_SAMPLES
    seq_len: int | None = None
    seed: int = 0
    column: str = "text"
    batch_size: int | None = None

    def __post_init__(self) -> None:
        for key in ("num_samples", "seq_len", "seed", "batch_size"):
            value = getattr(self, key)
            if (value is not None or key in ("num_samples", "seed")) and (
                    isinstance(value, bool) or not isinstance(value, int)):
                raise QuantizationError(
                    f"calibration {key} must be an integer, got {value!r} (a {type(value).__name__})")
        if self.num_samples < 1:
            raise QuantizationError(f"calibration num_samples must be >= 1, got {self.num_samples}")
        if self.seq_len is not None and self.seq_len < 2:
            raise QuantizationError(f"calibration seq_len must be >= 2 tokens, got {self.seq_len}")
        if self.batch_size is not None and self.batch_size < 1:
            raise QuantizationError(f"calibration batch_size must be >= 1, got {self.batch_size}")
        if self.seq_len is not None:
            check_token_count(self.num_samples * self.seq_len, f"{self.num_samples} samples x {self.seq_len} tokens")


def check_token_count(total: int, what: str) -> None:
    """QuantizationError when calibration would see fewer than MIN_CALIBRATION_TOKENS tokens (`what`: how they
    were asked for): GPTQ's Hessians, AWQ's scales and FP8 KV absmaxes of a handful of tokens are noise."""
    if total < MIN_CALIBRATION_TOKENS:
        raise QuantizationError(
            f"calibration would see {total} tokens ({what}); calibration needs at least {MIN_CALIBRATION_TOKENS} "
            f"(typical: {DEFAULT_NUM_SAMPLES} samples x {DEFAULT_SEQ_LEN} tokens; CLI: --calib-samples N "
            f"--calib-seq-len L)"
        )


# -- sources ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    builder: str  # "text" | "json" | "parquet" | "hub"
    files: tuple[str, ...] = ()
    name: str = ""
    config: str | None = None
    split: str = "train"
    column: str = "text"

    def describe(self) -> str:
        if self.builder == "hub":
            return f"hub dataset {self.name}{':' + self.config if self.config else ''} [{self.split}].{self.column}"
        return self.files[0] if len(self.files) == 1 else f"{len(self.files)} {self.builder} files"


def _builder_for(path: Path) -> str | None:
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return "text"
    if suffix in JSON_SUFFIXES:
        return "json"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    return None


def parse_source(source: str | os.PathLike, column: str = "text", what: str = "calibration") -> _Source:
    """Resolve a calibration SOURCE string to files or a hub dataset (no loading yet).

    what: what the text is for, in error messages ("calibration", "evaluation").
    """
    text = str(source)
    if text == "ref":
        return _Source("text", (str(train_text_path()),))
    if text.startswith("hub:"):
        parts = text[4:].split(":")
        if len(parts) == 3:
            name, config, split, col = parts[0], None, parts[1], parts[2]
        elif len(parts) == 4:
            name, config, split, col = parts
        else:
            raise QuantizationError(
                f"{what} source {text!r}: expected hub:NAME[:CONFIG]:SPLIT:COLUMN, "
                f"e.g. hub:wikitext:wikitext-2-raw-v1:train:text"
            )
        if not all((name, split, col)) or config == "":
            raise QuantizationError(f"{what} source {text!r}: empty NAME, CONFIG, SPLIT or COLUMN")
        return _Source("hub", name=name, config=config, split=split, column=col)
    path = Path(os.path.expanduser(text))
    if path.is_file():
        builder = _builder_for(path)
        if builder is None:
            raise QuantizationError(
                f"{what} file {path} has an unknown type; use {', '.join(TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES)}"
            )
        return _Source(builder, (str(path),), column=column)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        for builder in ("parquet", "json", "text"):
            chosen = [str(p) for p in files if _builder_for(p) == builder]
            if chosen:
                return _Source(builder, tuple(chosen), column=column)
        raise QuantizationError(
            f"{what} folder {path} has no text ({', '.join(TEXT_SUFFIXES)}), JSON lines or Parquet files"
        )
    raise QuantizationError(f"{what} source {text!r} is not a file, a folder or a hub dataset; give {SOURCE_HELP}")


def load_texts(source: str | os.PathLike, column: str = "text", what: str = "calibration") -> list[str]:
    """The rows of a calibration SOURCE as strings (one per document / JSON row / Parquet row).

    what: what the text is for, in error messages ("calibration", "evaluation").
    """
    import datasets  # import time: datasets loads only for hub data

    spec = parse_source(source, column, what)
    progress_was = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()
    try:
        if spec.builder == "hub":
            try:
                data = datasets.load_dataset(spec.name, spec.config, split=spec.split)
            except Exception as e:  # network, unknown name/config/split: all end here
                raise QuantizationError(
                    f"could not load {what} {spec.describe()}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
                    f"without network access, give a local text/JSONL/Parquet file instead"
                ) from None
        else:
            data = _load_local(spec, what)
    finally:
        if progress_was:
            datasets.utils.logging.enable_progress_bar()
    col = "text" if spec.builder == "text" else spec.column
    if col not in data.column_names:
        hint = " (choose one with --calib-column / CalibrationConfig(column=...))" if what == "calibration" else ""
        raise QuantizationError(
            f"{what} {spec.describe()} has no column {col!r}; its columns: {', '.join(data.column_names)}{hint}"
        )
    texts = [t for t in data[col] if isinstance(t, str) and t]
    if not texts:
        raise QuantizationError(f"{what} {spec.describe()} has no non-empty text in column {col!r}")
    return texts


def _load_local(spec: _Source, what: str):
    """A `datasets` Dataset from local files; unreadable files (binary, not UTF-8, malformed) are named."""
    import datasets  # import time: datasets loads only for hub data

    try:
        if spec.builder == "text":
            return datasets.load_dataset("text", data_files=list(spec.files), sample_by="document", split="train")
        return datasets.load_dataset(spec.builder, data_files=list(spec.files), split="train")
    except Exception as e:  # datasets wraps the reader's error (UnicodeDecodeError, JSON, Arrow) in its own
        cause = e.__cause__ or e.__context__ or e
        kind = {"text": "UTF-8 text", "json": "JSON lines", "parquet": "Parquet"}[spec.builder]
        raise QuantizationError(
            f"{what} {spec.describe()} could not be read as {kind} ({type(cause).__name__}: "
            f"{str(cause).splitlines()[0][:200] if str(cause) else ''}); give a {kind} file"
        ) from None


# -- sampling ---------------------------------------------------------------------------------------


def _chunks(texts: list[str], size: int = CHUNK_CHARS) -> list[str]:
    """Each text cut into pieces of at most `size` characters, at a line end where there is one."""
    out = []
    for text in texts:
        start = 0
        while start < len(text):
            end = min(start + size, len(text))
            if end < len(text):
                cut = text.rfind("\n", start, end)
                end = cut + 1 if cut > start else end
            piece = text[start:end]
            if piece.strip():
                out.append(piece)
            start = end
    return out


def _adds_bos(tokenizer) -> int | None:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return bos if ids and ids[0] == bos else None


def sample_token_windows(
    texts: list[str], tokenizer, num_samples: int, seq_len: int, seed: int = 0, *, what: str = "calibration text"
) -> torch.Tensor:
    """num_samples windows of seq_len tokens from texts, deterministic for a seed. returns int64 [N, L]."""
    bos = _adds_bos(tokenizer)
    per_window = seq_len - (1 if bos is not None else 0)
    needed = num_samples * per_window
    pieces = _chunks(texts)
    random.Random(seed).shuffle(pieces)
    stream: list[int] = []
    for i in range(0, len(pieces), 32):
        batch = [p + "\n\n" for p in pieces[i:i + 32]]
        for ids in tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]:
            stream.extend(ids)
        if len(stream) >= needed:
            break
    if len(stream) < needed:
        raise QuantizationError(
            f"{what} has only {len(stream)} tokens, but {num_samples} samples x {seq_len} tokens need {needed}; "
            f"lower the sample count or length (--calib-samples / --calib-seq-len) or give more text"
        )
    windows = torch.tensor(stream[:needed], dtype=torch.int64).reshape(num_samples, per_window)  # [N, L(-1)]
    if bos is not None:
        windows = torch.cat([torch.full((num_samples, 1), bos, dtype=torch.int64), windows], dim=1)  # [N, L]
    return windows


# -- the entry point ----------------------------------------------------------------------------------


def default_source(model) -> str | None:
    """'ref' when `model` was loaded from a built-in reference model's folder (committed or cached), else None."""
    origin = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not origin:
        return None
    roots = [Path(refmodels.__file__).parent / "weights"]
    try:
        roots.append(corpus.cache_root() / "refmodels")
    except (ImportError, AttributeError):
        pass
    try:
        path = Path(os.path.expanduser(origin)).resolve()
        roots = [r.resolve() for r in roots]
    except (OSError, ValueError):
        return None
    return "ref" if any(path == r or r in path.parents for r in roots) else None


def _validate_token_tensors(data: list[torch.Tensor], vocab_size: int | None) -> list[torch.Tensor]:
    batches = []
    for i, t in enumerate(data):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise QuantizationError(
                f"calibration_data[{i}] must be an integer token tensor [T] or [B, T], got "
                f"{type(t).__name__}{'' if not isinstance(t, torch.Tensor) else ' of ' + str(t.dtype)}"
            )
        if t.dim() == 1:
            t = t.unsqueeze(0)  # [1, T]
        if t.dim() != 2 or t.shape[0] == 0 or t.shape[1] < 2:
            raise QuantizationError(f"calibration_data[{i}] has shape {tuple(t.shape)}; expected [T] or [B, T] with T >= 2")
        if vocab_size is not None and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
            raise QuantizationError(
                f"calibration_data[{i}] has token ids outside [0, {vocab_size}): tokenize with the model's tokenizer"
            )
        batches.append(t.to(torch.int64).cpu())
    return batches


def calibration_batches(calibration_data: Any, model, tokenizer=None) -> list[torch.Tensor]:
    """Token batches ([B, T] int64 each, on the CPU) for the runner, from any accepted form of calibration data.

    calibration_data: None (the model's default source), a SOURCE string / path, a CalibrationConfig, or
    token tensors ([T], [B, T] or a list of them). tokenizer: needed for text sources (default: loaded
    from the model's folder).
    """
    config = getattr(model, "config", None)
    vocab_size = getattr(config, "vocab_size", None)
    if isinstance(calibration_data, torch.Tensor):
        calibration_data = [calibration_data]
    if isinstance(calibration_data, (list, tuple)) and calibration_data and not isinstance(calibration_data[0], str):
        batches = _validate_token_tensors(list(calibration_data), vocab_size)
        check_token_count(sum(b.numel() for b in batches), "the token ids of calibration_data")
        return batches
    if calibration_data is None or isinstance(calibration_data, (str, os.PathLike)):
        cfg = CalibrationConfig(source=None if calibration_data is None else str(calibration_data))
    elif isinstance(calibration_data, CalibrationConfig):
        cfg = calibration_data
    else:
        raise QuantizationError(
            f"calibration_data must be a source string, a CalibrationConfig or token tensors, got "
            f"{type(calibration_data).__name__}"
        )
    source = cfg.source or default_source(model)
    if source is None:
        raise QuantizationError(
            "calibrated quantization needs calibration data: pass calibration_data= (Python) or --calib (CLI) "
            f"with {SOURCE_HELP}, or token tensors"
        )
    seq_len = _seq_len(cfg, config)
    check_token_count(cfg.num_samples * seq_len, f"{cfg.num_samples} samples x {seq_len} tokens")
    if tokenizer is None:
        tokenizer = _model_tokenizer(model)
    texts = load_texts(source, cfg.column)
    windows = sample_token_windows(
        texts, tokenizer, cfg.num_samples, seq_len, cfg.seed, what=f"calibration source {source!r}"
    )  # [N, L]
    if vocab_size is not None and int(windows.max()) >= vocab_size:
        raise QuantizationError(f"the tokenizer produced ids >= the model's vocab_size {vocab_size}: pass the model's tokenizer")
    batch = cfg.batch_size or max(1, BATCH_TOKENS // seq_len)
    return list(windows.split(batch))


def _seq_len(cfg: CalibrationConfig, model_config) -> int:
    """Tokens per calibration window: cfg.seq_len, or min(DEFAULT_SEQ_LEN, the model's context)."""
    context = getattr(model_config, "max_position_embeddings", None) or DEFAULT_SEQ_LEN
    seq_len = cfg.seq_len or min(DEFAULT_SEQ_LEN, context)
    if seq_len > context:
        raise QuantizationError(f"calibration seq_len {seq_len} exceeds the model's context of {context} tokens")
    return seq_len


def describe_calibration(calibration_data: Any, model) -> dict:
    """What calibration_batches(calibration_data, model) draws, as plain values:
    {"source", "samples", "seq_len", "seed"} (source "token ids" and seed None for token tensors)."""
    if isinstance(calibration_data, torch.Tensor):
        calibration_data = [calibration_data]
    if isinstance(calibration_data, (list, tuple)) and calibration_data and not isinstance(calibration_data[0], str):
        rows = [t if t.dim() == 2 else t.unsqueeze(0) for t in calibration_data]  # [B, T] each
        return {"source": "token ids", "samples": sum(int(t.shape[0]) for t in rows),
                "seq_len": max(int(t.shape[1]) for t in rows), "seed": None}
    if isinstance(calibration_data, CalibrationConfig):
        cfg = calibration_data
    else:
        cfg = CalibrationConfig(source=None if calibration_data is None else str(calibration_data))
    return {"source": cfg.source or default_source(model), "samples": cfg.num_samples,
            "seq_len": _seq_len(cfg, getattr(model, "config", None)), "seed": cfg.seed}


def _model_tokenizer(model):
    from transformers import AutoTokenizer  # import time: transformers loads only where it is used

    origin = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not origin:
        raise QuantizationError("a text calibration source needs a tokenizer: pass tokenizer= to quantkit.quantize")
    try:
        return AutoTokenizer.from_pretrained(origin)
    except (OSError, ValueError) as e:
        raise QuantizationError(
            f"could not load the tokenizer of {origin!r} for the calibration text ({str(e).splitlines()[0]}); "
            f"pass tokenizer= to quantkit.quantize"
        ) from None
