"""Write evals/robustness.md: each bad input of fixtures/robustness_cases.py run as a real `quantkit`
process, with the message it printed and its exit status; then the rows of any evals/robustness-*.md.

    python evals/robustness.py            # 10-60 s per case on 2 shared cores (each case starts Python and torch)
    python evals/robustness.py --keep-rows   # only refresh the sections copied from evals/robustness-*.md
    python evals/robustness.py --cases TOPIC # run fixtures/robustness_cases_TOPIC.py into evals/robustness-TOPIC.md
                                             # (then --keep-rows copies it into evals/robustness.md)

Nothing is typed in by hand: the table is what the commands printed on this run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import importlib  # noqa: E402

from fixtures.robustness_cases import CASES  # noqa: E402


def error_line(stderr: str) -> str:
    """The last `quantkit ...: error: ...` line (argparse and quantkit both print one)."""
    lines = [line for line in stderr.splitlines() if ": error: " in line and line.startswith("quantkit")]
    return lines[-1] if lines else (stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]


def shell_word(arg: str) -> str:
    """An argument as a shell would need it typed: $'...' with escapes when it holds a control character."""
    if all(c.isprintable() for c in arg):
        return arg
    return "$'" + "".join(c if c.isprintable() and c not in "'\\" else repr(c)[1:-1] for c in arg) + "'"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def run_cases(root: Path, cases) -> list[str]:
    rows = []
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    for case in cases:
        work = root / case.name
        work.mkdir()
        if case.needs_non_root and os.geteuid() == 0:
            rows.append(f"| {cell(case.bad_input)} | - | - | not run: permissions do not stop root (tested as a normal user) |")
            continue
        argv = case.setup(work)
        proc = subprocess.run([sys.executable, "-m", "quantkit.commands.cli", *argv], cwd=work, env=env,
                              capture_output=True, text=True)
        shown = " ".join(shell_word(a.replace(str(work), ".").replace(str(root), "..")) for a in argv)
        message = error_line(proc.stderr).replace(str(work), ".").replace(str(root), "..")
        if case.status == 0 and proc.returncode == 0:
            try:
                message = f"(valid: handled) {case.check(work, proc.stdout)}"
            except AssertionError as e:
                message = f"WRONG RESULT: {e}"
        traceback = " (traceback printed!)" if "Traceback" in proc.stderr else ""
        rows.append(f"| {cell(case.bad_input)} | `quantkit {cell(shown)}` | {proc.returncode} | {cell(message)}{traceback} |")
        print(f"{case.name}: exit {proc.returncode}: {message}", flush=True)
    return rows


def other_tables() -> list[str]:
    """The contents of evals/robustness-*.md, each under a heading naming its file (its own title, if it
    starts with one, goes into that heading; its other headings move two levels down)."""
    out = []
    for path in sorted(Path(__file__).parent.glob("robustness-*.md")):
        lines = path.read_text().rstrip().splitlines()
        title = lines.pop(0)[2:] if lines and lines[0].startswith("# ") else path.stem
        body = ["##" + line if line.startswith("#") else line for line in lines]
        out += ["", f"## {title} (from `{path.relative_to(ROOT)}`)", *body]
    return out


TABLE_HEADER = ["| bad input | command | exit | message |", "|---|---|---:|---|"]


def previous_rows(path: Path) -> list[str]:
    """The rows this script wrote into `path` last time (its own table, not the copied ones)."""
    lines = path.read_text().splitlines()
    start = lines.index(TABLE_HEADER[1]) + 1
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep-rows", action="store_true",
                        help="reuse the case rows already in evals/robustness.md; only refresh the copied tables")
    parser.add_argument("--cases", metavar="TOPIC",
                        help="run fixtures/robustness_cases_TOPIC.py and write evals/robustness-TOPIC.md")
    args = parser.parse_args()
    if args.cases:
        return write_topic(args.cases)
    out = Path(__file__).parent / "robustness.md"
    if args.keep_rows:
        rows = previous_rows(out)
    else:
        with tempfile.TemporaryDirectory(prefix="quantkit-robustness-") as tmp:
            rows = run_cases(Path(tmp), CASES)
    lines = [
        "# Bad input: what quantkit says",
        "",
        "Each row is a mistake a user can make, the command that makes it, the exit status and the error "
        "line `quantkit` printed (stderr; no traceback). Exit status 2 means bad input; nothing is written "
        "when a command fails. `.` is the case's work folder, `..` the folder of all cases. Generated by "
        "`python evals/robustness.py` from `fixtures/robustness_cases.py`, whose cases "
        "`tests/test_robustness.py` also checks.",
        "",
        *TABLE_HEADER,
        *rows,
        *other_tables(),
    ]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


def run_python_cases(root: Path, cases) -> list[str]:
    """Rows of the Python API's cases (PythonCase), each run in this process: the exception and its message."""
    rows = []
    for case in cases:
        work = root / case.name
        work.mkdir()
        os.chdir(work)
        try:
            case.call(work)
            shown = "no error (WRONG)"
        except Exception as e:  # noqa: BLE001 (the row says what was raised)
            shown = f"{type(e).__name__}: {e}".replace(str(work), ".")
        rows.append(f"| {cell(case.bad_input)} | {cell(shown)} |")
        print(f"{case.name}: {shown}", flush=True)
    os.chdir(ROOT)
    return rows


def write_topic(topic: str) -> int:
    """Run one topic's cases into evals/robustness-TOPIC.md: its module docstring's first line is the title."""
    module = importlib.import_module(f"fixtures.robustness_cases_{topic}")
    with tempfile.TemporaryDirectory(prefix="quantkit-robustness-") as tmp:
        rows = run_cases(Path(tmp), module.CASES)
        python_rows = run_python_cases(Path(tmp), getattr(module, "PYTHON_CASES", []))
    out = Path(__file__).parent / f"robustness-{topic}.md"
    title = (module.__doc__ or topic).strip().splitlines()[0]
    python_table = (["", "### The Python API", "", "| bad input | raised |", "|---|---|", *python_rows]
                    if python_rows else [])
    out.write_text("\n".join([f"# {title}", "", f"Generated by `python evals/robustness.py --cases {topic}`. Exit 0 "
                              "rows are odd inputs that are valid: the message column says how they were handled.",
                              "", *TABLE_HEADER, *rows, *python_table]) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
