"""`quantkit demo`: the main job end to end on a built-in reference model.

Builds (or reuses) the reference model, quantizes it with each recipe, evaluates every checkpoint
against the unquantized model on the held-out text, and writes a report.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DEFAULT_RECIPES = "w8a16-rtn,w4a16-rtn,w4a16-rtn-asym"


def register(sub) -> None:
    p = sub.add_parser("demo", help="quantize the built-in reference model with several recipes, evaluate, report")
    p.add_argument("--model", default="ref:small", help="model to demonstrate on (default: ref:small)")
    p.add_argument("--recipes", default=DEFAULT_RECIPES, help=f"comma-separated recipes (default: {DEFAULT_RECIPES})")
    p.add_argument("--out", default="out/demo", help="output folder (default: out/demo)")
    p.add_argument("--max-tokens", type=int, default=131072, help="evaluation tokens (default: 131072)")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import quantkit
    from quantkit.eval.data import eval_token_windows
    from quantkit.eval.quality import evaluate_quality
    from quantkit.loading import atomic_output_dir, folder_size_bytes, load_float_model, resolve_model_source

    recipes = [quantkit.load_recipe(r.strip()) for r in args.recipes.split(",") if r.strip()]
    out = Path(args.out)
    with atomic_output_dir(out, force=args.force) as tmp:
        print(f"[1/3] reference model {args.model}")
        source = resolve_model_source(args.model)
        baseline = load_float_model(source, dtype=None)
        windows = eval_token_windows(source, None, max_tokens=args.max_tokens, model_config=baseline.config)
        rows = []
        for i, recipe in enumerate(recipes):
            print(f"[2/3] {recipe.name}: quantize and save ({i + 1}/{len(recipes)})")
            start = time.perf_counter()
            model = quantkit.quantize(load_float_model(source, dtype=None), recipe)
            quantize_seconds = time.perf_counter() - start
            ckpt = quantkit.save(model, tmp / "checkpoints" / recipe.name, tokenizer_source=source)
            print(f"[3/3] {recipe.name}: evaluate against the baseline on {windows.numel()} tokens")
            result = evaluate_quality(quantkit.load(ckpt), baseline, windows).to_dict()
            result.update(recipe=recipe.name, scheme=recipe.weights.describe() if recipe.weights else "-",
                          quantize_seconds=quantize_seconds, checkpoint_bytes=folder_size_bytes(ckpt))
            (tmp / f"eval-{recipe.name}.json").write_text(json.dumps(result, indent=2) + "\n")
            rows.append(result)
        report = _markdown(args.model, source, rows, folder_size_bytes(Path(source)))
        (tmp / "report.md").write_text(report)
        (tmp / "report.json").write_text(json.dumps({"model": args.model, "results": rows}, indent=2) + "\n")
    print("\n" + report)
    print(f"written to {out}/ (report.md, report.json, checkpoints/)")
    return 0


def _markdown(name: str, source: str, rows: list[dict], baseline_bytes: int) -> str:
    from quantkit.report_text import human_bytes

    r0 = rows[0]
    lines = [
        f"# quantkit demo: {name}",
        "",
        f"Model folder: `{source}`. Evaluation: {r0['windows']} non-overlapping windows of {r0['window']} tokens "
        f"of held-out text ({r0['tokens']} predictions). KL is KL(P_baseline || P_quantized) in nats per token.",
        "",
        "| variant | scheme | perplexity | Δ ppl | KL | top-1 agreement | checkpoint | quantize time |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        f"| baseline | {'float'} | {r0['baseline_perplexity']:.3f} | - | 0 | 1 | {human_bytes(baseline_bytes)} | - |",
    ]
    for r in rows:
        lines.append(
            f"| {r['recipe']} | {r['scheme']} | {r['perplexity']:.3f} | "
            f"{r['perplexity'] / r['baseline_perplexity'] - 1:+.2%} | {r['kl_divergence']:.5f} | "
            f"{r['top1_agreement']:.4f} | {human_bytes(r['checkpoint_bytes'])} | {r['quantize_seconds']:.1f} s |"
        )
    return "\n".join(lines) + "\n"
