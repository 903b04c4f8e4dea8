"""CLI subcommands: one module each, with register(subparsers) and run(args) -> int.

Modules here import torch, transformers and the rest of quantkit inside ``run``: building the parser
(``quantkit --help``) must stay fast. At the top they import only what loads no torch (core.errors,
core.units, files.inputs, gguf.choices, refmodels); files.outputs stays inside ``run`` too, where the tests
replace its free-space check.
"""

import argparse
import math
import os

# --dtype choices; "auto" keeps the checkpoint's dtype.
DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")


def torch_dtype(name: str):
    """The torch dtype of a --dtype choice (None for "auto")."""
    import torch

    return None if name == "auto" else getattr(torch, name)


def int_at_least(minimum: int, why: str = ""):
    """An argparse `type`: an integer >= minimum, else argparse's usage error naming the flag (exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}{why}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def add_model_options(parser: argparse.ArgumentParser, *,
                      dtype_help: str = "compute dtype (default: the checkpoint's)") -> None:
    """Options shared by commands that load models."""
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="auto", help=dtype_help)
    parser.add_argument("--device", default="cpu", help="torch device to run on (default: cpu)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow model code from the model folder / hub (only for sources you trust)")
    add_source_mismatch_option(parser)


def add_source_mismatch_option(parser: argparse.ArgumentParser) -> None:
    """--allow-source-mismatch: load a float model whose weights do not match its config.json as transformers does."""
    parser.add_argument("--allow-source-mismatch", action="store_true",
                        help="use a float model even when its weights do not match the model config.json describes "
                             "(tensors missing, unexpected, of another shape, or integer/fp8 float weights): "
                             "transformers fills missing tensors with random values and drops unexpected ones "
                             "(default: refuse, naming the tensors)")


def add_other_baseline_option(parser: argparse.ArgumentParser, checkpoints: str, allows: str = "") -> None:
    """--allow-other-baseline: use a baseline that is not the model `checkpoints` were quantized from
    (harness/baseline.py); `allows` says what stays required."""
    parser.add_argument("--allow-other-baseline", action="store_true",
                        help=f"compare with a baseline that is not the model {checkpoints} quantized from (by "
                             f"default the baseline's shapes and embeddings must match, and a different model is "
                             f"refused){allows}")


def positive_float(text: str) -> float:
    """An argparse `type`: a finite number > 0."""
    value = _finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """An argparse `type`: a finite number >= 0."""
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value