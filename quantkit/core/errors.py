"""Exceptions with messages that name the problem and the fix.

Every error quantkit raises for bad input is a QuantkitError: the command line prints its message
(no traceback) and exits with status 2 (NoSpaceError: 1); `run_command` does that for each command line
(`quantkit`, `python -m quantkit.refmodels`). Each kind is also a ValueError (or
FileExistsError, OSError), so Python callers that caught those before still do.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

#: The longest message an error carries: whatever it quotes of the input (a value, a list of keys), it stays
#: one readable line.
MAX_MESSAGE_CHARS = 2000


def first_names(items, shown: int) -> str:
    """The first `shown` of `items` joined with ", ", and "and N more" for the rest: what a message lists."""
    items = list(items)
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(str(i) for i in items[:shown]) + more


def shorten(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message` cut to at most `limit` characters: its start and its end (which says what to do) are kept,
    the middle is replaced by the number of characters left out."""
    if len(message) <= limit:
        return message
    head = (limit - 60) * 3 // 4
    tail = limit - 60 - head
    return f"{message[:head]} [... {len(message) - head - tail} characters left out ...] {message[-tail:]}"


class QuantkitError(Exception):
    """Bad input that quantkit can name: the message says what is wrong and what to do (at most
    MAX_MESSAGE_CHARS characters)."""

    def __init__(self, *args):
        super().__init__(*(shorten(a) if isinstance(a, str) else a for a in args))


class UsageError(QuantkitError, ValueError):
    """An argument or option is invalid (unknown GPU or reference model, a device that is not there, ...)."""


class ConfigError(QuantkitError, ValueError):
    """A config (recipe, checkpoint metadata) has an unknown key or an invalid value."""


class CheckpointError(QuantkitError, ValueError):
    """A model or checkpoint folder is missing, incomplete, corrupt or of an unsupported kind."""


class QuantizationError(QuantkitError, ValueError):
    """The model or data cannot be quantized as asked (NaN weights, bad shapes, unsupported model)."""


class EvaluationError(QuantkitError, ValueError):
    """An evaluation cannot run as asked (window longer than the model's context, too little text)."""


class OutputExistsError(QuantkitError, FileExistsError):
    """The output path already exists and replacing it was not asked for.

    path: the existing output. The command line names its own flags (--out, --force) in the message.
    """

    def __init__(self, path: "str | Path", detail: str = ""):
        self.path = Path(path)
        self.detail = detail
        super().__init__(
            f"output {self.path} already exists{detail}: choose another path, or pass force=True to replace it"
        )


class OutputRefusedError(QuantkitError, FileExistsError):
    """Writing the output would overwrite or delete what is not a previous output of quantkit: an input of
    the command, the working folder, or a folder holding files quantkit did not write."""


class NoSpaceError(QuantkitError, OSError):
    """The disk (or the user's quota) has no room for the output; nothing was written.

    exit_status: the command line's status for it (1: a file could not be written; not bad input).
    """

    exit_status = 1


def one_line(message: str) -> str:
    """`message` as one line: its lines joined by spaces (a YAML or library message may span several)."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


class CommandParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors keep the command lines' contract: one line `PROG: error: MESSAGE`
    on stderr (PROG names the command, e.g. `quantkit bench`), exit status 2; `--help` shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None, command: str = "command"):
    """`parser.parse_args(argv)`, with arguments no option takes reported by the subcommand they were given to
    (`quantkit inspect A B`: `quantkit inspect: error: unrecognized arguments: B`)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        chosen = getattr(args, command, None)
        subparsers = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        owner = subparsers.choices.get(chosen, parser) if subparsers is not None else parser
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def run_command(prog: str, command: Callable[[], "int | None"]) -> int:
    """Run one command of a command line (`command()`, whose result is the exit status; None is 0) and
    return its exit status, printing each failure as one line `PROG: error: MESSAGE` on stderr.

    2: bad input (a QuantkitError; an existing output names the flags --out and --force); 1: a file
    could not be read or written (an OSError naming it, or NoSpaceError); 130: interrupted; 141 (as a shell
    reports SIGPIPE), silently: the reader of stdout went away (`quantkit recipes | head`). Any other
    exception is a bug of quantkit and keeps its traceback.
    """
    def fail(message: str, status: int = 2) -> int:
        print(f"{prog}: error: {shorten(one_line(message))}", file=sys.stderr)
        return status

    try:
        return int(command() or 0)
    except BrokenPipeError:  # the pipe's reader has closed: nothing more can be said on stdout
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the interpreter's own flush at exit fails no more
        return 141
    except OutputExistsError as e:
        return fail(f"output {e.path} already exists{e.detail}: choose another --out, or pass --force to replace it")
    except QuantkitError as e:
        return fail(str(e), getattr(e, "exit_status", 2))
    except OSError as e:  # a file that cannot be read or written (permissions, full disk, not a folder)
        if e.filename is None:
            raise
        where = f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 else "")
        return fail(f"{where}: {e.strerror or e}", 1)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


__all__ = [
    "CheckpointError", "CommandParser", "ConfigError", "EvaluationError", "NoSpaceError", "OutputExistsError",
    "OutputRefusedError",
    "QuantizationError", "QuantkitError", "UsageError", "one_line", "parse_command_line", "run_command",
    "shorten",
]
