"""`quantkit` command line: a thin layer over the Python API. Each subcommand lives in quantkit.commands."""

from __future__ import annotations

import argparse
import importlib
import sys

from .. import __version__
from ..core.errors import CommandParser, parse_command_line, run_command

# Modules in quantkit.commands; each exposes register(subparsers) and sets `func=run` on its parser.
COMMANDS = ("quantize", "export", "eval", "bench", "advise", "report", "inspect", "demo", "recipes", "refmodel",
            "generate")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="quantkit", description="Quantize LLMs (INT8/INT4 weights, FP8 KV cache) for fast decoding, and measure it."
    )
    parser.add_argument("--version", action="version", version=f"quantkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"quantkit.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status.

    0: done; 1: the command ran but its answer is negative (e.g. `advise` found no scheme) or a file
    could not be read or written; 2: bad input (usage, recipe, model, data), with the message on
    stderr and no traceback; 130: interrupted.
    """
    args = parse_command_line(build_parser(), argv)

    return run_command(f"quantkit {args.command}", lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
