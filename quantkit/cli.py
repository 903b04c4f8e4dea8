"""`quantkit` command line: a thin layer over the Python API. Each subcommand lives in quantkit.commands."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules in quantkit.commands; each exposes register(subparsers) and sets `func=run` on its parser.
COMMANDS = ("quantize", "eval", "bench", "advise", "report", "inspect", "demo", "recipes", "refmodel")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quantkit", description="Quantize LLMs (INT8/INT4 weights, FP8 KV cache) for fast decoding, and measure it."
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"quantkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"quantkit.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import CheckpointError, ConfigError, EvaluationError, QuantizationError

    try:
        return int(args.func(args) or 0)
    except (CheckpointError, ConfigError, EvaluationError, QuantizationError, FileExistsError, FileNotFoundError) as e:
        print(f"quantkit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
