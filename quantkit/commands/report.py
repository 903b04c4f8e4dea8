"""`quantkit report`: one Markdown report with its JSON and PNG plots, from `quantkit bench` and
`quantkit eval` results."""

from __future__ import annotations

import argparse
from pathlib import Path

from quantkit.core.errors import UsageError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report", help="render bench and quality results as Markdown + JSON + PNG plots",
        description=__doc__,
        epilog="Example: quantkit report --bench bench.json --quality w8.json w4.json --out evals/reports/run1",
    )
    p.add_argument("--bench", help="JSON written by `quantkit bench --json`")
    p.add_argument("--quality", nargs="+", default=[], metavar="FILE", help="JSON files written by `quantkit eval`")
    p.add_argument("--out", required=True, help="output folder (report.md, report.json, *.png); other files in it are kept")
    p.add_argument("--force", action="store_true", help="replace a report already in the output folder")
    p.add_argument("--title", default="quantkit evaluation report", help="report title")
    p.add_argument("--note", action="append", default=[], help="a paragraph to put under the title (repeatable)")
    p.set_defaults(func=run)


# A report in --out is recognised by these files; without --force they are never overwritten.
REPORT_FILES = ("report.md", "report.json")


def run(args: argparse.Namespace) -> int:
    from quantkit.harness.report import REPORT_OUTPUTS, render_report
    from quantkit.harness.results import load_bench, load_quality
    from quantkit.files.outputs import publish_files

    if not args.bench and not args.quality:
        raise UsageError("nothing to report: give --bench FILE and/or --quality FILE...")
    bench = load_bench(args.bench) if args.bench else None
    quality = load_quality(args.quality)
    with publish_files(args.out, REPORT_FILES, force=args.force, inputs=(args.bench, *args.quality),
                       owned=REPORT_OUTPUTS) as tmp:
        render_report(bench, quality, tmp, title=args.title, notes=args.note)
    path = Path(args.out) / "report.md"
    print(f"wrote {path}")
    return 0
