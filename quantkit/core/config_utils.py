"""Strict construction of typed dataclass configs from plain dicts (YAML, JSON)."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, TypeVar

from .errors import ConfigError

T = TypeVar("T")
#: Unknown keys an error names (with a suggestion each); the rest are counted.
UNKNOWN_KEYS_SHOWN = 10


def from_dict(cls: type[T], data: Any, where: str) -> T:
    """Build dataclass `cls` from `data`, rejecting unknown keys with the list of allowed ones.

    where: a human-readable location for error messages, e.g. "recipe 'w4a16-rtn': weights".
    Nested dataclasses must be converted by the caller; values are validated by the dataclass itself.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    allowed = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = [k for k in data if k not in allowed]
    if unknown:
        hints = []
        for k in unknown[:UNKNOWN_KEYS_SHOWN]:
            shown = k[:100] + "..." if isinstance(k, str) and len(k) > 100 else k
            close = difflib.get_close_matches(str(shown), allowed, n=1)
            hints.append(f"{shown!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        if len(unknown) > UNKNOWN_KEYS_SHOWN:
            hints.append(f"and {len(unknown) - UNKNOWN_KEYS_SHOWN} more")
        raise ConfigError(f"{where}: unknown key(s) {', '.join(hints)}; allowed keys: {', '.join(allowed)}")
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        problem = _type_problem(value, hints.get(key, Any))
        if problem:
            raise ConfigError(f"{where}: {key} {problem}")
    try:
        return cls(**data)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _type_problem(value: Any, hint: Any) -> str | None:
    """Why `value` does not fit the annotation `hint` (None if it does). YAML gives ints, floats, bools and
    strings: an int field refuses 4.0 and True, a bool field refuses "false", a float field takes 1."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return None
    if origin is typing.Literal:
        return None if value in args else f"must be one of {', '.join(map(repr, args))}, got {value!r}"
    if origin in (typing.Union, types.UnionType):
        problems = [_type_problem(value, a) for a in args]
        return None if any(p is None for p in problems) else next(p for p in problems if p)
    if hint is type(None):
        return None if value is None else f"must be null, got {value!r}"
    if hint is bool:
        return None if isinstance(value, bool) else f"must be true or false (unquoted), got {_shown(value)}"
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else f"must be an integer (e.g. 4, not 4.0), got {_shown(value)}"
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"must be a number, got {_shown(value)}"
    if hint is str:
        return None if isinstance(value, str) else f"must be a string, got {_shown(value)}"
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return f"must be a list, got {_shown(value)}"
        item = args[0] if args else Any
        return next((f"item {i}: {p}" for i, v in enumerate(value) if (p := _type_problem(v, item))), None)
    return None


def _shown(value: Any) -> str:
    return f"{value!r} (a {type(value).__name__})"
