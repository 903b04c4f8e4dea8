"""Floating dtypes by name: the one table the benchmarks, the demo and the roofline read."""

from __future__ import annotations

from typing import Any

import torch

from .errors import UsageError

#: name, as configs, the CLI and torch spell it -> torch dtype
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
#: the short names benchmarks accept
SHORT_DTYPE_NAMES = ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32")


def parse_dtype(name: str, choices: tuple[str, ...] = SHORT_DTYPE_NAMES) -> torch.dtype:
    """A floating dtype from one of `choices`; ValueError naming them otherwise."""
    if name not in choices:
        raise UsageError(f"unknown dtype {name!r}; choose one of {sorted(choices)}")
    return FLOAT_DTYPES[name]


#: the floating dtypes a checkpoint's float tensors (embeddings, norms, scales) can be written in
CHECKPOINT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def checkpoint_dtype(dtype: Any) -> torch.dtype:
    """`dtype` as a torch dtype if a checkpoint can hold it: one of CHECKPOINT_DTYPES, given as a torch
    dtype or by name ("bfloat16", "float16", "float32", their short names, or "torch.float16");
    UsageError naming the choices otherwise."""
    found = FLOAT_DTYPES.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if found not in CHECKPOINT_DTYPES:
        raise UsageError(f"dtype {dtype!r} cannot be written in a checkpoint: choose torch.bfloat16, torch.float16 "
                         f"or torch.float32 (or their names 'bfloat16', 'float16', 'float32')")
    return found


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a torch dtype or a config's dtype string ("bfloat16", "torch.float16", ...)."""
    if hasattr(dtype, "itemsize"):
        return int(dtype.itemsize)
    key = str(dtype).removeprefix("torch.")
    if key not in FLOAT_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}")
    return FLOAT_DTYPES[key].itemsize
