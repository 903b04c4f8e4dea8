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
    """Run one command; returns the exit status.

    0: done; 1: the command ran but its answer is negative (e.g. `advise` found no scheme) or a file
    could not be read or written; 2: bad input (usage, recipe, model, data), with the message on
    stderr and no traceback; 130: interrupted.
    """
    args = build_parser().parse_args(argv)
    from .errors import OutputExistsError, QuantkitError

    try:
        return int(args.func(args) or 0)
    except OutputExistsError as e:
        return _fail(args, f"output {e.path} already exists{e.detail}: choose another --out, or pass --force to replace it")
    except QuantkitError as e:
        return _fail(args, str(e), status=getattr(e, "exit_status", 2))
    except OSError as e:  # a file that cannot be read or written (permissions, full disk, not a folder)
        if e.filename is None:
            raise
        where = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 else "")
        return _fail(args, f"{where}: {e.strerror or e}", status=1)
    except KeyboardInterrupt:
        print(f"quantkit {args.command}: interrupted", file=sys.stderr)
        return 130


def _fail(args: argparse.Namespace, message: str, status: int = 2) -> int:
    from .errors import shorten

    print(f"quantkit {args.command}: error: {shorten(message)}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
