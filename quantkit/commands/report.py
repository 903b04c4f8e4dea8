"""`quantkit report`: one Markdown report with its JSON and PNG plots, from `quantkit bench` and
`quantkit eval` results."""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report", help="render bench and quality results as Markdown + JSON + PNG plots",
        description=__doc__,
        epilog="Example: quantkit report --bench bench.json --quality w8.json w4.json --out evals/reports/run1",
    )
    p.add_argument("--bench", help="JSON written by `quantkit bench --json`")
    p.add_argument("--quality", nargs="+", default=[], metavar="FILE", help="JSON files written by `quantkit eval`")
    p.add_argument("--out", required=True, help="output folder (report.md, report.json, *.png)")
    p.add_argument("--title", default="quantkit evaluation report", help="report title")
    p.add_argument("--note", action="append", default=[], help="a paragraph to put under the title (repeatable)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from quantkit.eval.report import render_report
    from quantkit.eval.results import load_bench, load_quality

    if not args.bench and not args.quality:
        print("error: nothing to report: give --bench FILE and/or --quality FILE...", file=sys.stderr)
        return 2
    try:
        bench = load_bench(args.bench) if args.bench else None
        quality = load_quality(args.quality)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = render_report(bench, quality, args.out, title=args.title, notes=args.note)
    print(f"wrote {path}")
    return 0
