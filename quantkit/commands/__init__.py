"""CLI subcommands: one module each, with register(subparsers) and run(args) -> int.

Modules here import torch, transformers and the rest of quantkit inside ``run``, never at the top:
building the parser (``quantkit --help``) must stay fast.
"""

import argparse
import math

# --dtype choices; "auto" keeps the checkpoint's dtype.
DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")


def torch_dtype(name: str):
    """The torch dtype of a --dtype choice (None for "auto")."""
    import torch

    return None if name == "auto" else getattr(torch, name)


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by commands that load models."""
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="auto", help="compute dtype (default: the checkpoint's)")
    parser.add_argument("--device", default="cpu", help="torch device to run on (default: cpu)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow model code from the model folder / hub (only for sources you trust)")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (bad values exit 2 with the option named)."""
    return _number(text, int, minimum=1)


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _number(text, int, minimum=0)


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a number >= 0."""
    return _number(text, float, minimum=0)


def _number(text: str, kind: type, minimum: float | None = None):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if minimum is not None and value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
    return value


def check_backend(name: str) -> str:
    """`--backend` value, checked before any work (UsageError listing the backends)."""
    from quantkit.errors import UsageError
    from quantkit.kernels.wna16 import BACKENDS

    if name not in BACKENDS:
        raise UsageError(f"--backend {name!r} is unknown; choose one of {', '.join(BACKENDS)}")
    return name
