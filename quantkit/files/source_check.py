"""Whether a float model holds exactly the tensors of its source folder.

transformers fills a tensor the weights lack (or whose shape disagrees with config.json) with fresh
random values, drops tensors the model has no place for, and casts integer or fp8 tensors into a
float parameter as if they were float weights. Quantizing such a model gives a checkpoint that is not
the source. `SourceMismatch` collects those tensors from transformers' loading info and the dtypes the
weight files store; `check_source` refuses them (or, asked not to be strict, warns).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field

from torch import nn

from ..core.errors import CheckpointError, first_names

#: safetensors dtype names a float parameter may be stored in.
FLOAT_STORAGE = ("F64", "F32", "F16", "BF16")
#: How many tensor names a message lists of each kind.
NAMES_SHOWN = 4
#: The CLI flag and the Python argument that load a source as transformers does.
OVERRIDE = "--allow-source-mismatch (Python: strict=False)"


@dataclass(frozen=True)
class SourceMismatch:
    """Tensors a loaded float model does not hold as its source stores them.

    missing: parameters the weights lack (randomly initialised); unexpected: stored tensors the model
    has no place for (dropped); mismatched: (name, stored shape, shape config.json gives) (randomly
    initialised); not_float: (name, stored dtype) of float parameters stored as integers or fp8.
    """

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    not_float: tuple[tuple[str, str], ...] = ()
    hints: tuple[str, ...] = field(default=(), compare=False)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched or self.not_float)

    def describe(self) -> str:
        """One clause per kind, each naming its first tensors."""
        parts = []
        if self.missing:
            parts.append(f"missing from the weights (random values would take their place): {_names(self.missing)}")
        if self.mismatched:
            shown = [f"{n} ({_dims(s)} stored, {_dims(m)} from config.json)" for n, s, m in self.mismatched]
            parts.append(f"stored in another shape than config.json gives (random values would take their place): "
                         f"{_names(shown)}")
        if self.unexpected:
            parts.append(f"stored but not in the model config.json describes (they would be dropped): "
                         f"{_names(self.unexpected)}")
        if self.not_float:
            shown = [f"{n} ({dtype})" for n, dtype in self.not_float]
            parts.append(f"float weights stored as integers or fp8 (they would be cast as plain values, without "
                         f"scales): {_names(shown)}")
        return "; ".join(parts + list(self.hints))


def _names(items) -> str:
    return first_names(sorted(items), NAMES_SHOWN)


def _dims(shape) -> str:
    return "x".join(str(d) for d in shape) or "scalar"


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def source_mismatch(model: nn.Module, loading_info: dict, dtypes: dict[str, str] | None) -> SourceMismatch:
    """What `model` (just loaded by transformers' from_pretrained with output_loading_info=True and
    ignore_mismatched_sizes=True) lacks or lost of its source.

    loading_info: from_pretrained's {"missing_keys", "unexpected_keys", "mismatched_keys", ...}; tied weights,
    non-persistent buffers (rotary inv_freq) and the keys a model declares ignorable are not in it.
    dtypes: the stored dtype of each source tensor (safetensors header dtype names, e.g. "F32", "I32", "F8_E4M3"), or None when unknown (a hub model).
    """
    missing = tuple(sorted(loading_info.get("missing_keys") or ()))
    unexpected = tuple(sorted(loading_info.get("unexpected_keys") or ()))
    mismatched = tuple(sorted((str(n), tuple(s), tuple(m)) for n, s, m in loading_info.get("mismatched_keys") or ()))
    params = {name for name, p in model.named_parameters(remove_duplicate=False) if p.is_floating_point()}
    not_float = tuple(sorted((n, d) for n, d in (dtypes or {}).items() if n in params and d not in FLOAT_STORAGE))
    hints = []
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    stored_layers = {int(m.group(1)) for n in unexpected if (m := _LAYER.search(n))}
    if isinstance(layers, int) and stored_layers and min(stored_layers) >= layers:
        hints.append(f"config.json says num_hidden_layers: {layers}, but the weights hold "
                     f"{max(stored_layers) + 1} layers")
    if mismatched:
        hints.append("config.json's sizes (hidden_size, intermediate_size, vocab_size, heads) disagree with "
                     "the weights")
    return SourceMismatch(missing, unexpected, mismatched, not_float, tuple(hints))


def check_source(source: str, mismatch: SourceMismatch, *, strict: bool) -> None:
    """CheckpointError naming the tensors when the model is not its source and `strict`; a warning otherwise."""
    if not mismatch:
        return
    if strict:
        raise CheckpointError(
            f"{source} would not be reproduced: {mismatch.describe()}. Fix the source (re-download it, or "
            f"correct config.json), or pass {OVERRIDE} to use the model as transformers loads it"
        )
    warnings.warn(f"{source}: loaded as transformers builds it, which differs from its weights: "
                  f"{mismatch.describe()}", stacklevel=3)
