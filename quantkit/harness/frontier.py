"""A measured quality frontier and the choice it answers: which GGUF type fits a size budget best.

A frontier file (`frontier.json`, written by evals/quality/frontier/frontier.py) holds one record per
(llama.cpp type, quantkit method): the recipe, the file's real size in bytes and bits per weight, and quantkit's
KL of the file against the float model. It may hold records of other quantizers too (`"quantizer":
"llama.cpp"`: llama-quantize's own files, measured the same way for comparison); those are read but never
recommended, as quantkit does not write them. `load_frontier` reads and checks it at the edge (one UsageError
line naming the problem and the fix); `choose_by_size` names the quantkit record with the lowest measured KL
whose measured size fits a `SizeBudget`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core.errors import UsageError
from ..files.inputs import read_input_text
from ..core.units import format_bytes

FORMAT = "quantkit-frontier"
#: The quantizer of the records `choose_by_size` recommends (a record without the key is quantkit's).
QUANTKIT = "quantkit"
#: The largest frontier file read (one of ten types and two methods is a few KiB).
MAX_FRONTIER_BYTES = 4 << 20
MAKE_IT = "make one with `python evals/quality/frontier/frontier.py --model MODEL --work DIR --out DIR`"


@dataclass(frozen=True)
class FrontierRecord:
    """One measured GGUF file.

    type: llama.cpp's type (str, "Q4_K_M"); method: quantkit's rounding (str, "GPTQ"); recipe: the built-in
    recipe that wrote it (str); file_bytes: the file's size (int > 0); bits_per_weight: 8 * file_bytes / the
    file's parameters (float > 0); kl_divergence: KL(float || file), nats per token (float >= 0);
    perplexity, top1_agreement, quantize_seconds: as measured (float or None where the file has none);
    float_type: the `--float-type` the file was written with (str; "auto" where the file does not say);
    quantizer: what wrote the file (str): "quantkit" (the recipe is a built-in recipe), or another tool
    ("llama.cpp": the recipe is its command line), measured for comparison."""

    type: str
    method: str
    recipe: str
    file_bytes: int
    bits_per_weight: float
    kl_divergence: float
    perplexity: float | None = None
    top1_agreement: float | None = None
    quantize_seconds: float | None = None
    float_type: str = "auto"
    quantizer: str = QUANTKIT

    @property
    def label(self) -> str:
        """'Q4_K_M GPTQ' (str): how tables and messages name the record."""
        return f"{self.type} {self.method}"

    def quantize_command(self, model: str) -> str:
        """The `quantkit quantize` command line that writes this file from `model` (str)."""
        float_type = "" if self.float_type == "auto" else f" --float-type {self.float_type}"
        calib = "" if self.method.upper() == "RTN" else " --calib TEXT"
        return f"quantkit quantize {model} --recipe {self.recipe}{float_type}{calib} --out MODEL-{self.type}.gguf"


@dataclass(frozen=True)
class Frontier:
    """The records of one frontier file. model: the float model they were measured on (str, or None when the
    file does not name it); records: the files quantkit writes (tuple[FrontierRecord, ...], at least one: the
    candidates); source: the file (str); others: the records of other quantizers (tuple[FrontierRecord, ...]),
    never candidates."""

    model: str | None
    records: tuple[FrontierRecord, ...]
    source: str
    others: tuple[FrontierRecord, ...] = ()


@dataclass(frozen=True)
class SizeBudget:
    """The most a file may take: max_bytes (int or None) and / or max_bits_per_weight (float or None)."""

    max_bytes: int | None = None
    max_bits_per_weight: float | None = None

    def __post_init__(self):
        if self.max_bytes is None and self.max_bits_per_weight is None:
            raise UsageError("a size budget needs --max-size or --max-bits-per-weight (or both)")

    def fits(self, record: FrontierRecord) -> bool:
        """Whether `record`'s measured file is within every limit given (bool; a limit is inclusive)."""
        return ((self.max_bytes is None or record.file_bytes <= self.max_bytes)
                and (self.max_bits_per_weight is None or record.bits_per_weight <= self.max_bits_per_weight))

    def describe(self) -> str:
        """The budget in words (str): 'at most 60 MB (57.2 MiB) and 5 bits per weight'."""
        parts = ([format_bytes(self.max_bytes)] if self.max_bytes is not None else []) + (
            [f"{self.max_bits_per_weight:g} bits per weight"] if self.max_bits_per_weight is not None else [])
        return "at most " + " and ".join(parts)


@dataclass(frozen=True)
class SizeChoice:
    """What `choose_by_size` found. chosen: the fitting record of lowest KL (FrontierRecord or None when nothing
    fits); fitting: the records within the budget, lowest KL first (then the smaller file); too_large: those over
    it, smallest file first (tuples); smallest: the smallest measured file (FrontierRecord); reason: one sentence
    (str)."""

    budget: SizeBudget
    frontier: Frontier
    chosen: FrontierRecord | None
    fitting: tuple[FrontierRecord, ...]
    too_large: tuple[FrontierRecord, ...]
    smallest: FrontierRecord
    reason: str

    def to_dict(self) -> dict:
        """The choice as JSON-ready data (dict)."""
        return {"model": self.frontier.model, "frontier": self.frontier.source,
                "budget": {"max_bytes": self.budget.max_bytes, "max_bits_per_weight": self.budget.max_bits_per_weight},
                "recommended": None if self.chosen is None else asdict(self.chosen), "reason": self.reason,
                "fitting": [asdict(r) for r in self.fitting], "too_large": [asdict(r) for r in self.too_large],
                "not_candidates": [f"{r.label} ({r.quantizer})" for r in self.frontier.others]}


def _rank(record: FrontierRecord) -> tuple:
    """Lowest KL first; equal KL: the smaller file, then type and method by name (a fixed order)."""
    return (record.kl_divergence, record.file_bytes, record.type, record.method)


def choose_by_size(frontier: Frontier, budget: SizeBudget) -> SizeChoice:
    """The quantkit record of lowest measured KL whose measured file fits `budget` (ties: the smaller file, then
    by name), with every quantkit record sorted into fitting and too large (SizeChoice); the records of other
    quantizers (frontier.others) are no candidates."""
    fitting = tuple(sorted((r for r in frontier.records if budget.fits(r)), key=_rank))
    too_large = tuple(sorted((r for r in frontier.records if not budget.fits(r)),
                             key=lambda r: (r.file_bytes, r.bits_per_weight, *_rank(r))))
    smallest = min(frontier.records, key=lambda r: (r.file_bytes, r.bits_per_weight, r.kl_divergence))
    if fitting:
        chosen = fitting[0]
        reason = (f"the lowest measured KL ({chosen.kl_divergence:.3g}) of the {len(fitting)} of "
                  f"{len(frontier.records)} measured files within {budget.describe()}")
    else:
        chosen = None
        reason = (f"nothing fits {budget.describe()}: the smallest measured file is {smallest.label} "
                  f"(`{smallest.recipe}`), {format_bytes(smallest.file_bytes)}, {smallest.bits_per_weight:.3f} bits "
                  f"per weight; raise the budget, or measure smaller types")
    return SizeChoice(budget, frontier, chosen, fitting, too_large, smallest, reason)


def format_size_choice(choice: SizeChoice) -> list[str]:
    """The table of candidates (those that fit, then those that do not) and the recommendation, as lines."""
    lines = [f"frontier: {choice.frontier.source}" + (f" (model {choice.frontier.model})" if choice.frontier.model
                                                      else ""),
             f"budget: {choice.budget.describe()}", ""]
    shown = [*choice.fitting, *choice.too_large]
    method_w = max([6, *(len(r.method) for r in shown)])  # columns as wide as their longest entry
    recipe_w = max([22, *(len(r.recipe) for r in shown)])
    header = (f"  {'type':<8} {'method':<{method_w}} {'recipe':<{recipe_w}} {'size':>22} {'bits/weight':>11} "
              f"{'KL':>10} {'top-1':>6}")
    for title, rows in (("fits", choice.fitting), ("too large", choice.too_large)):
        if not rows:
            continue
        lines += [f"{title}:", header]
        for r in rows:
            mark = "*" if r is choice.chosen else " "
            top1 = "-" if r.top1_agreement is None else f"{r.top1_agreement:.3f}"
            size = format_bytes(r.file_bytes)
            lines.append(f"{mark} {r.type:<8} {r.method:<{method_w}} {r.recipe:<{recipe_w}} {size:>22} "
                         f"{r.bits_per_weight:>11.3f} {r.kl_divergence:>10.3g} {top1:>6}")
        lines.append("")
    if choice.chosen is not None:
        lines.append(f"recommendation: {choice.chosen.label} (recipe {choice.chosen.recipe}), "
                     f"{format_bytes(choice.chosen.file_bytes)}: {choice.reason}")
        if choice.frontier.model is not None:
            lines.append(f"make it: {choice.chosen.quantize_command(choice.frontier.model)}")
    else:
        lines.append(f"recommendation: none: {choice.reason}")
    others = choice.frontier.others
    if others:
        tools = ", ".join(sorted({r.quantizer for r in others}))
        lines.append(f"not candidates: {len(others)} files of {tools} measured beside them (quantkit does not write "
                     f"those; see the frontier's table)")
    return lines


# -- reading --------------------------------------------------------------------------------------

def load_frontier(path: str | Path) -> Frontier:
    """Read and check a frontier file (Frontier); UsageError naming the problem and the fix for a missing or
    unreadable file, bad JSON, a missing key or a value of the wrong type."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"cannot read frontier {path}: no such file; give the frontier.json of the model, or "
                         f"{MAKE_IT}")
    text = read_input_text(path, "frontier", MAX_FRONTIER_BYTES)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise UsageError(f"cannot read frontier {path}: not JSON ({e}); give the frontier.json that "
                         f"evals/quality/frontier/frontier.py wrote") from None
    return parse_frontier(data, str(path))


def parse_frontier(data: Any, source: str) -> Frontier:
    """`data` (a frontier file's JSON value) as a Frontier; UsageError naming the first bad key (source: the
    file, for messages)."""
    if not isinstance(data, dict):
        raise _bad(source, "the file", data, f"a JSON object with \"format\": \"{FORMAT}\" and \"records\"")
    if data.get("format") != FORMAT:
        raise _bad(source, "format", data.get("format"), f"\"{FORMAT}\" (a frontier.json)")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad(source, "model", model, "the float model's name (a string)")
    records = data.get("records")
    if not isinstance(records, list) or not records:
        raise _bad(source, "records", records, "a non-empty list of measured files")
    parsed = tuple(_record(source, i, r) for i, r in enumerate(records))
    seen = set()
    for r in parsed:
        if (r.type, r.method) in seen:
            raise UsageError(f"{source}: {r.label} is measured twice; keep one record per type and method")
        seen.add((r.type, r.method))
    ours = tuple(r for r in parsed if r.quantizer == QUANTKIT)
    if not ours:
        raise _bad(source, "records", f"{len(parsed)} records of " + ", ".join(sorted({r.quantizer for r in parsed})),
                   f"at least one file quantkit writes (\"quantizer\": \"{QUANTKIT}\", or no quantizer key)")
    return Frontier(model, ours, source, tuple(r for r in parsed if r.quantizer != QUANTKIT))


def _record(source: str, i: int, r: Any) -> FrontierRecord:
    where = f"records[{i}]"
    if not isinstance(r, dict):
        raise _bad(source, where, r, "an object (type, method, recipe, file_bytes, bits_per_weight, kl_divergence)")
    for key in ("type", "method", "recipe"):
        if key not in r:
            raise _missing(source, where, key)
        if not isinstance(r[key], str) or not r[key]:
            raise _bad(source, f"{where}.{key}", r[key], "a non-empty string")
    for key in ("file_bytes", "bits_per_weight", "kl_divergence"):
        if key not in r:
            raise _missing(source, where, key)
    file_bytes = r["file_bytes"]
    if isinstance(file_bytes, bool) or not isinstance(file_bytes, int) or not 0 < file_bytes <= 2**63:
        raise _bad(source, f"{where}.file_bytes", file_bytes, "a whole number of bytes, at least 1")
    return FrontierRecord(
        type=r["type"], method=r["method"], recipe=r["recipe"], file_bytes=file_bytes,
        bits_per_weight=_number(source, f"{where}.bits_per_weight", r["bits_per_weight"], 0.0, low_open=True),
        kl_divergence=max(_number(source, f"{where}.kl_divergence", r["kl_divergence"], -1e-6), 0.0),
        perplexity=_number(source, f"{where}.perplexity", r.get("perplexity"), 1.0, optional=True),
        top1_agreement=_number(source, f"{where}.top1_agreement", r.get("top1_agreement"), 0.0, 1.0, optional=True),
        quantize_seconds=_number(source, f"{where}.quantize_seconds", r.get("quantize_seconds"), 0.0, optional=True),
        float_type=_float_type(source, f"{where}.float_type", r.get("float_type", "auto")),
        quantizer=_quantizer(source, f"{where}.quantizer", r.get("quantizer", QUANTKIT)),
    )


def _quantizer(source: str, where: str, value: Any) -> str:
    """What wrote the record's file: a short name of letters, digits and . _ + - ("quantkit", "llama.cpp")."""
    if not isinstance(value, str) or not value or len(value) > 32 or not all(
            c.isascii() and (c.isalnum() or c in "._+-") for c in value):
        raise _bad(source, where, value, "a quantizer's name such as quantkit or llama.cpp")
    return value


def _float_type(source: str, where: str, value: Any) -> str:
    """The record's --float-type: a short name of letters, digits and _ (it is printed in a command line)."""
    if not isinstance(value, str) or not value.replace("_", "").isalnum() or len(value) > 16:
        raise _bad(source, where, value, "a --float-type name such as auto, f16, q8_0 or q6_k")
    return value


def _number(source: str, where: str, value: Any, low: float, high: float = math.inf, *, low_open: bool = False,
            optional: bool = False) -> float | None:
    """`value` as a float when it is a finite number in [low, high] ((low, high] with low_open); else UsageError."""
    if value is None and optional:
        return None
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
        low < value if low_open else low <= value) and value <= high
    if not ok:
        raise _bad(source, where, value, f"a finite number in {interval}")
    return float(value)


def _missing(source: str, where: str, key: str) -> UsageError:
    return UsageError(f"{source}: {where} has no {key!r}; every record needs type, method, recipe, file_bytes, "
                      f"bits_per_weight and kl_divergence: {MAKE_IT}")


def _bad(source: str, where: str, value: Any, allowed: str) -> UsageError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return UsageError(f"{source}: {where} is {shown}; expected {allowed}. Give the frontier.json that "
                      f"evals/quality/frontier/frontier.py wrote, or {MAKE_IT}")
