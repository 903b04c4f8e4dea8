"""Small files users name as inputs (recipes, results JSON): regular files only, read up to a size limit.

A device such as /dev/zero, a pipe or a folder is refused before anything is read, and no file is read
past its limit, so a wrong path can neither hang a command nor fill its memory.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..core.errors import QuantkitError, UsageError
from ..refmodels import resolve_model_name


def read_input_bytes(path: "str | os.PathLike", what: str, max_bytes: int,
                     error: type[QuantkitError] = UsageError) -> bytes:
    """The bytes of the regular file `path`; `error` saying "cannot read {what} {path}: ..." when it is
    missing, not a regular file or larger than max_bytes."""
    path = Path(path)
    if not path.is_file():
        why = "no such file" if not path.exists() else "not a regular file (a folder, a device or a pipe)"
        raise error(f"cannot read {what} {path}: {why}")
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise error(f"cannot read {what} {path}: it is larger than {_size(max_bytes)}, the limit for {what}")
    return raw


def read_input_text(path: "str | os.PathLike", what: str, max_bytes: int,
                    error: type[QuantkitError] = UsageError) -> str:
    """read_input_bytes decoded as UTF-8 (a byte-order mark is dropped); `error` for other bytes."""
    raw = read_input_bytes(path, what, max_bytes, error)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"cannot read {what} {path}: it is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def input_paths(*names: str | None) -> list[str]:
    """The local paths among `names` (ref:NAME as its folder), which an output must never overwrite; names
    that are no local path (hub ids, recipe names, None) are left out."""
    paths = []
    for name in names:
        if name:
            path = os.path.expanduser(resolve_model_name(name))
            if os.path.lexists(path):
                paths.append(path)
    return paths
