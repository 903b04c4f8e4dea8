"""CPU decode-step time of the static FP8 cache against the growing FP8 cache and both bf16 caches.

    python evals/kv_cache/cpu_static_timing.py --model ref:small --contexts 512 2048

All four caches (decode_timing.KINDS) are timed side by side, interleaved, with the model in bf16
and one CPU thread; the ratios to the bf16 DynamicCache are what to read (absolute CPU times mean
little). The whole measurement is repeated ``--runs`` times: the table shows the median ratio and
the range over runs (on a shared machine the ratios move from run to run; the FP8 columns of one
run move together). Writes <out>/cpu_static_timing.{json,md} (default out: evals/kv_cache/results-small).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_timing import KINDS, decode_step_times  # noqa: E402
from kv_variants import unit_scales  # noqa: E402

HERE = Path(__file__).resolve().parent


RATIOS = ("fp8_over_bf16_time", "fp8-static_over_bf16_time", "bf16-static_over_bf16_time")


def summarize(runs: list[list[dict]]) -> list[dict]:
    """Per context: median, min and max over runs of each ratio to the bf16 DynamicCache."""
    rows = []
    for per_context in zip(*runs):
        row = {"context": per_context[0]["context"],
               "bf16_step_ms": statistics.median(r["bf16_step_ms"] for r in per_context)}
        for key in RATIOS:
            values = [r[key] for r in per_context]
            row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        rows.append(row)
    return rows


def markdown(report: dict) -> str:
    lines = [
        "# Static FP8 KV cache on CPU: decode step time",
        "",
        f"Reproduce: `{report['command']}`  ",
        f"Model: {report['model']} in bf16; batch 1; {report['steps']} timed steps per cache after "
        f"{report['warmup']} warm-up steps, kinds interleaved, median; {len(report['runs'])} runs. "
        f"Machine: {report['machine']}.",
        "",
        "Both FP8 caches dequantize what attention reads to bf16 every step (a 256-entry table on CPU); the "
        "static caches hold the context plus the timed steps (outside torch.compile attention reads only the "
        "written positions). Each column is the step time over the bf16 DynamicCache's, measured side by side: "
        "median over runs [min - max].",
        "",
        "| context | FP8 growing / bf16 | FP8 static / bf16 | bf16 static / bf16 | bf16 step ms |",
        "|---:|---:|---:|---:|---:|",
    ]

    def cell(ratio: dict) -> str:
        return f"{ratio['median']:.2f}x [{ratio['min']:.2f} - {ratio['max']:.2f}]"

    for r in report["rows"]:
        lines.append(f"| {r['context']} | {cell(r['fp8_over_bf16_time'])} | {cell(r['fp8-static_over_bf16_time'])} | "
                     f"{cell(r['bf16-static_over_bf16_time'])} | {r['bf16_step_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="ref:small")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results-small")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from quantkit.formats.loading import load_float_model

    model = load_float_model(args.model, dtype=torch.bfloat16).eval()
    runs = [decode_step_times(model, args.contexts, unit_scales(model), steps=args.steps, warmup=args.warmup,
                              kinds=KINDS) for _ in range(args.runs)]
    report = {
        "command": "python evals/kv_cache/cpu_static_timing.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()}, torch {torch.__version__}, {args.threads} CPU thread(s)",
        "model": args.model, "steps": args.steps, "warmup": args.warmup, "rows": summarize(runs), "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_static_timing.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "cpu_static_timing.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
