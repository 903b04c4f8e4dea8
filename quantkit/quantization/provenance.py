"""How a checkpoint was made: the recipe and calibration data, saved beside the weights as recipe.yaml.

``quantkit.quantize`` records what it applied on the model (``record``); ``quantkit.save`` writes
it as ``recipe.yaml``: the recipe itself (loadable with ``--recipe DIR/recipe.yaml``), preceded by
comments naming the source model, the calibration data and the command that repeats the run.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from .. import __version__
from .recipe import Recipe

RECIPE_FILE = "recipe.yaml"
_MODEL_LINE = "# model      : "  # the recipe.yaml comment naming the source model
_ATTRIBUTE = "_quantkit_provenance"


@dataclass(frozen=True)
class Provenance:
    """recipe: what quantize applied. calibration: describe_calibration's dict (source, samples,
    seq_len, seed), or None when the recipe needed no calibration data."""

    recipe: Recipe
    calibration: dict | None = None
    moe_routing: dict | None = None


def record(model: nn.Module, recipe: Recipe, calibration: dict | None, moe_routing: dict | None = None) -> None:
    """Remember on ``model`` how it was quantized (read back by ``of`` and written by save). moe_routing:
    quantkit.modules.moe.routed_token_summary of the calibration (MoE models calibrated with GPTQ/AWQ)."""
    object.__setattr__(model, _ATTRIBUTE, Provenance(recipe, calibration, moe_routing))


def describe_moe_routing(routing: dict | None) -> str | None:
    """'tokens routed per expert: least 0, median 210, most 800 (64 experts); never routed: ...' or None."""
    if not routing:
        return None
    never = routing["never_routed"]
    text = (f"calibration tokens routed per expert: least {routing['least']}, median {routing['median']}, "
            f"most {routing['most']} ({routing['experts']} experts)")
    if never:
        text += f"; never routed ({len(never)}): {', '.join(never[:8])}{' ...' if len(never) > 8 else ''}"
    return text


def of(model: nn.Module) -> Provenance | None:
    """How ``model`` was quantized in this process, or None (e.g. a model loaded from a checkpoint)."""
    return vars(model).get(_ATTRIBUTE)


def describe_calibration(calibration: dict | None) -> str:
    """One line: which calibration data, how many samples of how many tokens, which seed."""
    if calibration is None:
        return "none (the recipe needs no calibration data)"
    source = calibration["source"]
    source = "ref (the reference models' training text)" if source == "ref" else source
    seed = "" if calibration["seed"] is None else f", seed {calibration['seed']}"
    return f"{source}: {calibration['samples']} samples x {calibration['seq_len']} tokens{seed}"


def recorded_source(checkpoint: Path) -> str | None:
    """The source model a checkpoint's recipe.yaml names, or None (no recipe.yaml, or no source recorded)."""
    try:
        text = (Path(checkpoint) / RECIPE_FILE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    line = next((line for line in text.splitlines() if line.startswith(_MODEL_LINE)), None)
    source = line[len(_MODEL_LINE):].strip() if line else ""
    return source if source not in ("", "unknown") else None


def _one_line(text: str) -> str:
    """`text` for a comment line of recipe.yaml: control characters (a newline would end the comment and
    start YAML) written as escapes."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


def reproduce_command(calibration: dict | None, source: str | None, recipe: str, out: str = "OUT") -> list[str]:
    """The `quantkit quantize` command line that repeats a run: the source, the recipe (a name or a file),
    the output and the calibration data (describe_calibration's dict, or None)."""
    command = ["quantkit", "quantize", source or "MODEL", "--recipe", recipe, "--out", out]
    if calibration is not None and calibration["source"] != "token ids":
        command += ["--calib", str(calibration["source"]), "--calib-samples", str(calibration["samples"]),
                    "--calib-seq-len", str(calibration["seq_len"]), "--seed", str(calibration["seed"])]
    return command


def recipe_file_text(provenance: Provenance, source: str | None, checkpoint) -> str:
    """The text of ``checkpoint``/recipe.yaml: comments (source model, calibration, the command that
    repeats the run) and the recipe's YAML."""
    calibration = provenance.calibration
    command = reproduce_command(calibration, source, f"{checkpoint}/{RECIPE_FILE}")
    lines = [
        f"# Written by quantkit {__version__}: the recipe this checkpoint was quantized with.",
        f"# recipe     : {_one_line(provenance.recipe.name)}",
        f"{_MODEL_LINE}{_one_line(source or 'unknown')}",
        f"# calibration: {_one_line(describe_calibration(calibration))}",
        f"# reproduce  : {_one_line(shlex.join(command))}",
    ]
    routing = describe_moe_routing(provenance.moe_routing)
    if routing:
        lines.append(f"# moe        : {routing}")
    if calibration is not None and calibration["source"] == "token ids":
        lines.append("#              (calibrated on token ids given in Python: pass the same ids to quantkit.quantize)")
    return "\n".join(lines) + "\n" + provenance.recipe.to_yaml()
