"""Sizes and durations as a person reads them (the CLI's summaries, the messages of a full disk, the advisor's
size budgets) and sizes as people write them (`60MB`, `1.5GB`, `500MiB`)."""

from __future__ import annotations

import re
from decimal import Decimal


def human_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def human_seconds(seconds: float) -> str:
    """A duration as a person reads it: '42 s', '7.5 min', '2.1 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"

#: unit -> bytes: decimal (kB, MB, GB, TB: powers of 1000, as file managers and disk makers count) and binary
#: (KiB, MiB, GiB, TiB: powers of 1024). Matched without regard to case ("60mb" is 60 MB).
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
UNIT_NAMES = "B, kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
EXAMPLES = "60MB, 1.5GB, 500MiB"

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([A-Za-z]*)\s*")


def parse_byte_size(text: str) -> int:
    """`text` (str, a positive number and a unit: "60MB", "1.5 GB", "500MiB") as a whole number of bytes (int,
    rounded down, at least 1). ValueError, whose message names the units, for a bare number, an unknown unit,
    a size below one byte, or anything else."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size: give a number and a unit, e.g. {EXAMPLES} (units: {UNIT_NAMES})")
    number, exponent, unit = match.groups()
    if not unit:
        raise ValueError(f"{text!r} has no unit: give one, e.g. {EXAMPLES} (units: {UNIT_NAMES})")
    factor = UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"{text!r}: unknown unit {unit!r}; use one of {UNIT_NAMES}, e.g. {EXAMPLES}")
    try:
        value = Decimal(number).scaleb(int(exponent or 0)) * factor  # exact: "0.1GB" is 100000000 bytes
    except ArithmeticError:  # an exponent beyond Decimal's range
        value = Decimal("Infinity") if int(exponent) > 0 and Decimal(number) else Decimal(0)
    if value > 2**63:
        raise ValueError(f"{text!r} is too large a size: give one below 8 EiB, e.g. {EXAMPLES}")
    if value < 1:
        raise ValueError(f"{text!r} is less than one byte: give a positive size, e.g. {EXAMPLES}")
    return int(value)  # whole bytes, rounded down


def format_bytes(n: int) -> str:
    """`n` bytes (int) for a reader (str): decimal MB / GB with the exact MiB beside ("62.3 MB (59.4 MiB)"),
    plain bytes below 1 kB."""
    if n < 1000:
        return f"{n} B"
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= factor:
            decimal = f"{n / factor:.3g} {unit}"
            break
    binary = next(f"{n / f:.3g} {u}" for u, f in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                  if n >= f or u == "KiB")
    return f"{decimal} ({binary})"
