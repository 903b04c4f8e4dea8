"""Results files and the numbers derived from them: one home for the readers report, plots and advise share.

- ``quantkit bench --json`` (schema ``quantkit.bench/1``): ``prefill`` and ``decode`` records per
  variant, with roofline predictions -> load_bench, records, speedups, speedup_summary, roofline_problem;
- ``quantkit eval`` JSON (``perplexity``, ``kl_divergence``, ``top1_agreement``,
  ``baseline_perplexity``, its noise, window counts) -> load_quality -> QualityResult.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import UsageError
from ..files.inputs import read_input_text
from .hardware import DeviceSpec
from .timing import SCHEMA

SHAPE_KEYS = {"prefill": ("batch", "prompt_len"), "decode": ("batch", "context_len")}
#: The largest results file read (a bench JSON of many shapes is a few hundred KiB).
MAX_RESULTS_BYTES = 64 << 20


#: Times a bench file may hold, in seconds: no forward pass takes less than a nanosecond or more than
#: a million seconds; values beyond make ratios and plot limits overflow (1e308 s gives infinite axes).
TIME_RANGE = (1e-12, 1e6)
#: Roofline intensities and measured/predicted ratios beyond this are not from a bench run.
MAX_RATIO = 1e12

# -- reading ----------------------------------------------------------------------------------------

def _parse_json(text: str, path: Path, what: str):
    """The JSON value of `text`; UsageError for invalid JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: nested thousands of levels deep
        raise UsageError(f"cannot read {what} {path}: {e}") from None


def _refuse_non_finite(data: Any, path: Path) -> None:
    """UsageError naming the first NaN or infinite number anywhere in `data` (Python's json reads the bare words
    NaN and Infinity, and 1e400 as infinity): no file quantkit writes holds one, and a report made from it would
    not be valid JSON. Called after the field checks, which name the usual fields with their allowed ranges."""
    stack = [("", data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise _bad(path, where or "the value", value, "a finite number (JSON has no NaN or Infinity)")
        if isinstance(value, dict):
            stack += [(f"{where}.{k}" if where else str(k), v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(value)]


def load_bench(path: str | Path) -> dict:
    """Read a `quantkit bench --json` file; every number the report and plots use is checked here."""
    path = Path(path)
    data = _parse_json(read_input_text(path, "bench results", MAX_RESULTS_BYTES), path, "bench results")
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or "prefill" not in data or "decode" not in data:
        raise UsageError(f"{path} is not a `quantkit bench --json` file (schema {SCHEMA!r} with prefill and decode)")
    _check_bench(data, path)
    _refuse_non_finite(data, path)
    return data


# -- checking results files at the edge -------------------------------------------------------------
# field -> (lowest allowed, highest allowed, what the range means)
QUALITY_FIELDS = {
    "perplexity": (1.0, math.inf, "a perplexity is exp(cross-entropy), at least 1"),
    "baseline_perplexity": (1.0, math.inf, "a perplexity is exp(cross-entropy), at least 1"),
    # KL of two distributions is >= 0; float32 sums may round a zero a hair below it
    "kl_divergence": (-1e-6, math.inf, "KL divergence in nats per token, at least 0"),
    "top1_agreement": (0.0, 1.0, "a share of positions, from 0 to 1"),
    "log_ppl_ratio_stderr": (0.0, math.inf, "a standard error, at least 0"),
}
QUALITY_COUNTS = {"window": 2, "windows": 1, "tokens": 1}  # field -> smallest allowed


def _bad(path: Path, where: str, value: Any, allowed: str) -> UsageError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return UsageError(f"{path}: {where} is {shown}; allowed: {allowed}. The file is not what `quantkit` wrote: "
                      "re-run the command that makes it")


def _number(path: Path, where: str, value: Any, low: float, high: float, why: str, *, low_open: bool = False,
            optional: bool = False) -> float | None:
    """``value`` as a float, if it is a finite number within [low, high] ((low, high] with ``low_open``)."""
    if value is None and optional:
        return None
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"
    allowed = f"a finite number in {interval} ({why})"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(path, where, value, allowed)
    v = float(value)
    if not math.isfinite(v) or v < low or (low_open and v == low) or v > high:
        raise _bad(path, where, value, allowed)
    return v


#: The largest count a bench file may hold (shapes, bytes): integers past 2**53 have no exact float, and
#: numpy and the plots take them as Python objects.
MAX_COUNT = 2**53


def _count(path: Path, where: str, value: Any, low: int, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_COUNT:
        raise _bad(path, where, value, f"a whole number in [{low}, 2**53]")
    return value


def _check_bench(data: dict, path: Path) -> None:
    """Every field the report, plots and speedups read: positive times and shapes, a usable device spec."""
    variants = data.get("variants")
    if not isinstance(variants, list) or not variants or not all(
            isinstance(v, dict) and isinstance(v.get("name"), str) for v in variants):
        raise _bad(path, "variants", variants, "a non-empty list of objects with a name")
    for v in variants:
        _count(path, f"variants[{v['name']!r}].weight_bytes", v.get("weight_bytes"), 0)
    listed = [v["name"] for v in variants]
    if twice := next((name for name in listed if listed.count(name) > 1), None):
        raise UsageError(f"{path}: the variant name {twice!r} is duplicated ({listed.count(twice)} variants have it), "
                         f"and records are told apart by variant name. The file is not what `quantkit` wrote: "
                         f"re-run the command that makes it")
    names = set(listed)
    spec = (data.get("device") or {}).get("spec") if isinstance(data.get("device"), dict) else None
    if not isinstance(spec, dict):
        raise _bad(path, "device.spec", spec, "an object (the roofline's device)")
    for key in ("memory_bandwidth", "peak_flops"):
        _number(path, f"device.spec.{key}", spec.get(key), 0.0, math.inf, "per second", low_open=True)
    if isinstance(data["prefill"], list) and isinstance(data["decode"], list) and not data["prefill"] + data["decode"]:
        raise UsageError(f"{path}: prefill and decode are both empty, so there is nothing to report; re-run "
                         f"`quantkit bench` with shapes that fit the model")
    low_s, high_s = TIME_RANGE
    for phase, keys in SHAPE_KEYS.items():
        recs = data[phase]
        if not isinstance(recs, list):
            raise _bad(path, phase, recs, "a list of records")
        for i, r in enumerate(recs):
            where = f"{phase}[{i}]"
            if not isinstance(r, dict) or r.get("variant") not in names:
                raise _bad(path, f"{where}.variant", r.get("variant") if isinstance(r, dict) else r,
                           f"one of the variants {sorted(names)}")
            for k in keys:
                _count(path, f"{where}.{k}", r.get(k), 1)
            _number(path, f"{where}.median_s", r.get("median_s"), low_s, high_s, "seconds")
            times = r.get("times_s")
            if times is not None:
                if not isinstance(times, list) or not times:
                    raise _bad(path, f"{where}.times_s", times, "a non-empty list of seconds")
                for j, t in enumerate(times):
                    _number(path, f"{where}.times_s[{j}]", t, low_s, high_s, "seconds")
                if not min(times) <= r["median_s"] <= max(times):
                    raise _bad(path, f"{where}.median_s", r["median_s"],
                               f"the median of its own repeats times_s, between {min(times):g} and {max(times):g}")
            roof = r.get("roofline")
            if not isinstance(roof, dict):
                raise _bad(path, f"{where}.roofline", roof, "an object (the roofline prediction)")
            _number(path, f"{where}.roofline.predicted_s", roof.get("predicted_s"), low_s, high_s, "seconds")
            for k in ("intensity", "measured_over_predicted"):
                _number(path, f"{where}.roofline.{k}", roof.get(k), 0.0, MAX_RATIO, "positive", low_open=True)
            if "achieved_bandwidth" in r:
                _number(path, f"{where}.achieved_bandwidth", r["achieved_bandwidth"], 0.0, math.inf, "bytes per "
                        "second", low_open=True)
            memory = r.get("memory")
            if memory is not None:
                if not isinstance(memory, dict):
                    raise _bad(path, f"{where}.memory", memory, "an object (bytes per part)")
                for k in ("weights_bytes", "kv_cache_bytes", "peak_bytes"):
                    if k in memory or phase == "decode":
                        _count(path, f"{where}.memory.{k}", memory.get(k), 0)
    try:
        DeviceSpec.from_dict(spec)
    except (TypeError, ValueError) as e:
        raise _bad(path, "device.spec", spec, f"the roofline's device as `quantkit bench` writes it ({e})") from None


@dataclass
class QualityResult:
    """Quality of one variant against its unquantized baseline.

    Made by quantkit.harness.quality.evaluate_variants (every measured field) or read back from a
    `quantkit eval` JSON by load_quality (the fields the file has; the others stay None).
    """

    name: str
    perplexity: float
    baseline_perplexity: float | None = None
    kl_divergence: float | None = None  # KL(P_baseline || P_model), nats per predicted token
    top1_agreement: float | None = None  # share of positions where both models' argmax agree
    source: str = ""  # the JSON file the result was read from
    model: str | None = None  # the evaluated model (a checkpoint folder describes its own scheme)
    log_ppl_ratio_stderr: float | None = None  # standard error of log(perplexity / baseline); None for 1 window
    dtype: str | None = None  # the dtype both models were evaluated in
    window: int | None = None  # tokens per evaluation window
    windows: int | None = None  # number of windows
    tokens: int | None = None  # predicted tokens the averages are over

    #: The measured fields, in the order `quantkit eval` writes them.
    MEASURED = ("perplexity", "baseline_perplexity", "kl_divergence", "top1_agreement", "window", "windows", "tokens",
                "log_ppl_ratio_stderr", "dtype")
    #: The fields a report lists.
    REPORTED = ("name", "perplexity", "baseline_perplexity", "kl_divergence", "top1_agreement", "source", "model",
                "log_ppl_ratio_stderr", "dtype")

    @property
    def perplexity_increase(self) -> float | None:
        """Relative perplexity increase over the baseline (0.02 = +2%)."""
        if not self.baseline_perplexity:
            return None
        return self.perplexity / self.baseline_perplexity - 1.0

    @property
    def within_noise(self) -> bool | None:
        """Whether the perplexity change is within two standard errors of zero (None: noise unknown)."""
        return perplexity_change_within_noise(self.perplexity, self.baseline_perplexity, self.log_ppl_ratio_stderr)

    def to_dict(self) -> dict:
        """The measured fields: what `quantkit eval` writes (and load_quality reads back)."""
        return {key: getattr(self, key) for key in self.MEASURED}

    def report_dict(self) -> dict:
        """The fields a report lists, with the perplexity increase and whether it is within the noise."""
        return {key: getattr(self, key) for key in self.REPORTED} | {
            "perplexity_increase": self.perplexity_increase, "within_noise": self.within_noise}


def perplexity_change_within_noise(perplexity: float, baseline: float | None,
                                   log_ratio_stderr: float | None) -> bool | None:
    """Whether |log(perplexity / baseline)| is within two of its standard errors (None: no baseline or no noise)."""
    if log_ratio_stderr is None or not baseline:
        return None
    return abs(math.log(perplexity / baseline)) <= 2 * log_ratio_stderr


def _quality_label(d: dict, fallback: str) -> str:
    """The variant a result is about: its variant / name / recipe / label, else the model folder's name."""
    for key in ("variant", "name", "recipe", "label"):
        value = d.get(key)
        if isinstance(value, str) and value:
            return Path(value).stem if value.endswith((".yaml", ".yml")) else value
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            return value["name"]
    model = d.get("model")
    if isinstance(model, str) and model.strip("/"):
        return Path(model.rstrip("/")).name
    return fallback


def _quality_records(data: Any, fallback: str) -> Iterable[tuple[str, dict]]:
    if isinstance(data, list):
        for i, item in enumerate(data):
            yield from _quality_records(item, f"{fallback}[{i}]")
    elif isinstance(data, dict):
        if "perplexity" in data:
            yield _quality_label(data, fallback), data
        else:
            for key in ("results", "variants"):
                if isinstance(data.get(key), (list, dict)):
                    items = data[key].items() if isinstance(data[key], dict) else enumerate(data[key])
                    for k, item in items:
                        if isinstance(item, dict):
                            label = _quality_label(item, k if isinstance(k, str) else f"{fallback}[{k}]")
                            if "perplexity" in item:
                                yield label, item


def load_quality(paths: Sequence[str | Path]) -> list[QualityResult]:
    """Read `quantkit eval` JSON files; one file may hold one result or a list of them."""
    results = []
    for path in paths:
        path = Path(path)
        data = _parse_json(read_input_text(path, "quality results", MAX_RESULTS_BYTES), path, "quality results")
        found = list(_quality_records(data, path.stem))
        if found:
            for label, d in found:  # the fields first: their messages give the allowed ranges
                _quality_result(label, d, path, f"result {label!r}: " if len(found) > 1 else "")
            _refuse_non_finite(data, path)
        if not found:
            raise UsageError(f"{path} has no `perplexity`: pass the JSON written by `quantkit eval`")
        for label, d in found:
            results.append(_quality_result(label, d, path, f"result {label!r}: " if len(found) > 1 else ""))
    names = [r.name for r in results]
    if twice := next((name for name in names if names.count(name) > 1), None):
        first, second = [r.source for r in results if r.name == twice][:2]
        where = f"{first} twice" if first == second else f"{first} and {second}"
        raise UsageError(f"two quality results are named {twice!r} ({where}), and results are told apart by name: "
                         f"give each result once, or name them apart with a \"label\" in their JSON")
    return results


def _quality_result(label: str, d: dict, path: Path, which: str) -> QualityResult:
    """One `quantkit eval` record, its numbers checked against what they can be (``which``: names the
    record in errors when the file holds several)."""
    values = {key: _number(path, f"{which}{key}", d.get(key), low, high, why, optional=key != "perplexity")
              for key, (low, high, why) in QUALITY_FIELDS.items()}
    counts = {key: _count(path, f"{which}{key}", d.get(key), low, optional=True)
              for key, low in QUALITY_COUNTS.items()}
    if values["kl_divergence"] is not None:
        values["kl_divergence"] = max(values["kl_divergence"], 0.0)
    return QualityResult(name=label, **values, **counts, source=str(path),
                         model=d.get("model") if isinstance(d.get("model"), str) else None,
                         dtype=d.get("dtype") if isinstance(d.get("dtype"), str) else None)


# -- derived numbers --------------------------------------------------------------------------------

def records(bench: dict, phase: str, variant: str | None = None, **match) -> list[dict]:
    out = [r for r in bench[phase] if (variant is None or r["variant"] == variant)
           and all(r.get(k) == v for k, v in match.items())]
    return sorted(out, key=lambda r: tuple(r[k] for k in SHAPE_KEYS[phase]))


def roofline_problem(bench: dict) -> str | None:
    """Why the bench's device spec gives no usable roofline (None when it does)."""
    return DeviceSpec.from_dict(bench["device"]["spec"]).roofline_problem


def variant_names(bench: dict) -> list[str]:
    return [v["name"] for v in bench["variants"]]


def time_range(r: dict) -> tuple[float, float]:
    """(fastest, slowest) of a record's timed repeats; (median, median) when the record has none."""
    times = r.get("times_s") or [r["median_s"]]
    return min(times), max(times)


def ranges_overlap(a: dict, b: dict) -> bool:
    """Whether two records' repeat ranges overlap: then the run does not show which is faster."""
    (a_lo, a_hi), (b_lo, b_hi) = time_range(a), time_range(b)
    return a_lo <= b_hi and b_lo <= a_hi


def speedups(bench: dict, phase: str) -> list[dict]:
    """Measured and roofline speedup of each variant over the baseline, shape by shape. ``measured`` is
    the ratio of medians; ``low`` / ``high`` bound it by the repeats (slowest baseline over fastest
    variant repeat, and the other way round); ``separated``: the two repeat ranges do not overlap."""
    base = bench.get("baseline")
    if base is None or base not in variant_names(bench):
        return []
    keys = SHAPE_KEYS[phase]
    base_by_shape = {tuple(r[k] for k in keys): r for r in records(bench, phase, base)}
    out = []
    for r in bench[phase]:
        shape = tuple(r[k] for k in keys)
        b = base_by_shape.get(shape)
        if r["variant"] == base or b is None:
            continue
        (b_lo, b_hi), (r_lo, r_hi) = time_range(b), time_range(r)
        out.append({"variant": r["variant"], **dict(zip(keys, shape)),
                    "measured": b["median_s"] / r["median_s"], "low": b_lo / r_hi, "high": b_hi / r_lo,
                    "separated": not ranges_overlap(b, r),
                    "predicted": b["roofline"]["predicted_s"] / r["roofline"]["predicted_s"]})
    return sorted(out, key=lambda s: (s["variant"], shape_key(s, phase)))


def shape_key(r: dict, phase: str) -> tuple:
    return tuple(r[k] for k in SHAPE_KEYS[phase])


def speedup_summary(bench: dict) -> list[dict]:
    """Per quantized variant: median measured/predicted speedup of prefill and of decode at the smallest
    batch, over the measured lengths, and the range (``*_low`` .. ``*_high``) the repeats allow over them."""
    pf, dc = speedups(bench, "prefill"), speedups(bench, "decode")
    out = []
    for name in variant_names(bench):
        p = [s for s in pf if s["variant"] == name]
        d = [s for s in dc if s["variant"] == name and s["batch"] == min(x["batch"] for x in dc)]
        if not p and not d:
            continue
        row = {"variant": name, "decode_batch": d[0]["batch"] if d else None}
        for phase, rows in (("prefill", p), ("decode", d)):
            row[f"{phase}_measured"] = statistics.median(s["measured"] for s in rows) if rows else None
            row[f"{phase}_predicted"] = statistics.median(s["predicted"] for s in rows) if rows else None
            row[f"{phase}_low"] = min(s["low"] for s in rows) if rows else None
            row[f"{phase}_high"] = max(s["high"] for s in rows) if rows else None
        out.append(row)
    return out
