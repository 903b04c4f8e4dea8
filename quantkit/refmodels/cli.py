"""``build`` command: regenerate a reference model (``python -m quantkit.refmodels build NAME``).

``add_build_arguments`` / ``run_build`` let the main CLI mount the same command as
``quantkit refmodel build``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..core.errors import CommandParser, parse_command_line, run_command
from .registry import REFERENCE_MODELS, get_spec
from .spec import TRAINING_RECORD
from .store import build_atomically, cache_folder


def add_build_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``build`` arguments (NAME, --out, --force, --threads) to ``parser``."""
    parser.add_argument("name", choices=sorted(REFERENCE_MODELS), help="reference model to build")
    parser.add_argument(
        "--out", type=Path, default=None,
        help="folder to write the model into (default: <cache>/refmodels/<name>-<spec hash>, "
             "cache = $QUANTKIT_CACHE_DIR, else $XDG_CACHE_HOME/quantkit or ~/.cache/quantkit)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder already holds this model")
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch threads for training (default: torch's default); results are bit-identical only "
             "for the same thread count",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def run_build(args: argparse.Namespace) -> int:
    """Build the model named by ``args`` (from ``add_build_arguments``); prints where it went."""
    from ..core.device import check_cpu_threads  # import time: torch, only once a model is built

    spec = get_spec(args.name)
    if args.threads is not None:
        check_cpu_threads(args.threads)
    destination = args.out if args.out is not None else cache_folder(spec)
    folder = build_atomically(spec, destination, force=args.force, num_threads=args.threads,
                              progress=not args.no_progress)
    record = json.loads((folder / TRAINING_RECORD).read_text(encoding="utf-8"))
    print(f"{spec.name}: {folder} (held-out perplexity {record['heldout_perplexity']}, "
          f"built in {record['build_wall_seconds']} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="python -m quantkit.refmodels",
                                     description="quantkit's built-in reference models")
    commands = parser.add_subparsers(dest="command", required=True)
    add_build_arguments(commands.add_parser("build", help="train a reference model into a folder"))
    args = parse_command_line(parser, argv)
    return run_command(f"{parser.prog} {args.command}", lambda: run_build(args))
