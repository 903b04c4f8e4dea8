"""Strict construction of typed dataclass configs from plain dicts (YAML, JSON)."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config (recipe, checkpoint metadata) has an unknown key or an invalid value."""


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
        for k in unknown:
            close = difflib.get_close_matches(str(k), allowed, n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(f"{where}: unknown key(s) {', '.join(hints)}; allowed keys: {', '.join(allowed)}")
    try:
        return cls(**data)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
