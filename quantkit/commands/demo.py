"""`quantkit demo`: the main job end to end on a built-in reference model.

Builds (or reuses) the reference model, quantizes it with each recipe, evaluates every checkpoint
against the unquantized model on the held-out text, times prefill and decode of each recipe on a
random-weight model sized to exceed the CPU's last-level cache (harness/speed_model.py), and writes
one report (Markdown, JSON, PNG plots).
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path

from quantkit.core.errors import UsageError
from quantkit.core.units import human_bytes
from quantkit.files.inputs import input_paths

from . import int_at_least

DEFAULT_RECIPES = "w8a16-rtn,w4a16-rtn,w4a16-rtn-asym,w4a16-rtn-kv-fp8"
SPEED_MODEL = "speed-model.json"  # the config of the model speed is timed on, in the output folder
CONTEXT_LENS = (128, 512, 2048, 8192)  # decode from a short context to one whose cache rivals W4's weights


def register(sub) -> None:
    p = sub.add_parser("demo", help="quantize the built-in reference model with several recipes, evaluate, report")
    p.add_argument("--model", default="ref:small", help="model to demonstrate on (default: ref:small)")
    p.add_argument("--recipes", default=DEFAULT_RECIPES, help=f"comma-separated recipes (default: {DEFAULT_RECIPES})")
    p.add_argument("--out", default="out/demo", help="output folder (default: out/demo)")
    p.add_argument("--max-tokens", type=int_at_least(2, " (at least one window of 2 tokens)"), default=32768, help="evaluation tokens (default: 32768)")
    p.add_argument("--no-bench", action="store_true", help="skip the prefill/decode timing")
    p.add_argument("--force", action="store_true",
                   help="replace an output folder an earlier demo wrote (never one holding other files)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import quantkit
    from quantkit.harness.eval_text import eval_token_windows, eval_window
    from quantkit.harness.quality import evaluate_variants
    from quantkit.formats.loading import folder_size_bytes, load_float_model, resolve_model_source, source_dtype
    from quantkit.files.outputs import atomic_output_dir
    from quantkit.harness.report import render_report
    from quantkit.harness.results import load_quality
    from quantkit.quantization.summaries import dtype_name, quantized_bits_per_weight

    recipes = [quantkit.load_recipe(r.strip()) for r in args.recipes.split(",") if r.strip()]
    if not recipes:
        raise UsageError(f"--recipes {args.recipes!r} names no recipe; give comma-separated recipes, e.g. "
                         f"{DEFAULT_RECIPES}")
    names = [r.name for r in recipes]
    if twice := next((name for name in names if names.count(name) > 1), None):
        raise UsageError(f"--recipes names the recipe {twice!r} twice (each is saved as checkpoints/NAME); "
                         f"give each recipe once")
    out = Path(args.out)
    with atomic_output_dir(out, force=args.force, inputs=input_paths(args.model)) as tmp:
        steps = 3 if args.no_bench else 4
        print(f"[1/{steps}] reference model {args.model}")
        source = resolve_model_source(args.model)
        baseline = load_float_model(source, dtype=None)
        window = eval_window(None, baseline.config)
        if args.max_tokens < window:
            raise UsageError(f"--max-tokens {args.max_tokens} is less than one evaluation window of {window} tokens "
                             f"(the model's context, at most 2048); give --max-tokens {window} or more")
        windows = eval_token_windows(source, None, max_tokens=args.max_tokens, model_config=baseline.config)
        rows, models = [], {}
        for i, recipe in enumerate(recipes):
            print(f"[2/{steps}] {recipe.name}: quantize and save ({i + 1}/{len(recipes)})")
            start = time.perf_counter()
            model = quantkit.quantize(load_float_model(source, dtype=None), recipe)
            quantize_seconds = time.perf_counter() - start
            ckpt = quantkit.save(model, tmp / "checkpoints" / recipe.name, tokenizer_source=source)
            models[recipe.name] = quantkit.load(ckpt)
            rows.append(dict(recipe=recipe.name, scheme=_scheme_words(recipe),
                             quantize_seconds=quantize_seconds, checkpoint_bytes=folder_size_bytes(ckpt),
                             linear_bits_per_weight=quantized_bits_per_weight(model, source_dtype(model))[0]))
        print(f"[3/{steps}] evaluate {len(models)} variants against the baseline on {windows.numel()} tokens")
        results = evaluate_variants(models, baseline, windows)
        for row in rows:
            row.update(results[row["recipe"]].to_dict())
        (tmp / "quality.json").write_text(json.dumps({"model": args.model, "results": rows}, indent=2) + "\n")
        bench, speed_note = None, None
        if not args.no_bench:
            print(f"[4/{steps}] time prefill and decode of each variant, on a model sized from this CPU's cache")
            bench, speed_note = _bench(args.model, recipes, tmp, out)
            bench["command"] = _demo_command(args)
            (tmp / "bench.json").write_text(json.dumps(bench, indent=1) + "\n")
        on_disk = folder_size_bytes(Path(source)) if Path(source).is_dir() else None  # a hub model: unknown here
        table = _markdown(args.model, source, rows, on_disk, dtype_name(baseline),
                          dtype_name(source_dtype(baseline)))
        notes = table.split("\n\n")[1:] + ([speed_note] if speed_note else [])
        render_report(bench, load_quality([tmp / "quality.json"]), tmp, title=f"quantkit demo: {args.model}",
                      notes=notes)
        report = table
    print("\n" + report)
    print(f"written to {out}/ (report.md with plots, report.json, quality.json"
          f"{'' if args.no_bench else ', bench.json, ' + SPEED_MODEL}, checkpoints/)")
    return 0


def _scheme_words(recipe) -> str:
    """'int4 g128 sym', 'int4 g128 sym + KV cache fp8-e4m3 per-tensor', 'KV cache fp8-e4m3 per-tensor'."""
    parts = ([recipe.weights.describe()] if recipe.weights else []) + (
        [f"KV cache {recipe.kv_cache.describe()}"] if recipe.kv_cache else [])
    return " + ".join(parts) or "-"


def _demo_command(args: argparse.Namespace) -> str:
    return shlex.join(["quantkit", "demo", "--model", args.model, "--recipes", args.recipes, "--out", args.out,
                       "--max-tokens", str(args.max_tokens)])


def _bench(model: str, recipes, tmp: Path, out: Path) -> tuple[dict, str]:
    """TTFT and TPOT of the float model and each recipe on a random-weight Llama whose weights exceed
    this CPU's last-level cache (its config written to ``tmp`` / SPEED_MODEL, ``tmp`` becoming ``out``),
    each phase in the dtype fastest here; short settings (two prompts, CONTEXT_LENS, five repeats); decode in
    quantkit's C++ loop where it runs every variant. Returns the results and a paragraph saying what was timed
    and why."""
    from quantkit.harness.benchmark import benchmark
    from quantkit.harness.speed_model import (CACHE_MULTIPLE, MAX_FLOAT32_BYTES, bandwidth_bound_config,
                                              last_level_cache)

    cache = last_level_cache()
    config = bandwidth_bound_config(cache.bytes)
    (tmp / SPEED_MODEL).write_text(json.dumps(config, indent=1) + "\n")
    bench = benchmark(str(tmp / SPEED_MODEL), variants=[r.name for r in recipes], device="cpu", dtype="auto", prompt_lens=[16, 64],
                      context_lens=list(CONTEXT_LENS), batch_sizes=[1, 4], warmup=1, repeats=5, quiet=True,
                      model_label=str(out / SPEED_MODEL), decode_loop="auto")
    loop, why_not = bench["settings"]["decode_loop"], bench.pop("decode_loop_reason")
    bench["bench_command"] = bench["command"].replace(str(tmp), str(out))
    weights = {v["name"]: v["weight_bytes"] for v in bench["variants"]}
    smallest = min(weights, key=weights.get)
    note = (f"Speed is timed on a random-weight Llama built for this machine (`{SPEED_MODEL}`: "
            f"{config['num_hidden_layers']} layers of width {config['hidden_size']}, "
            f"{bench['model']['params'] / 1e6:.0f} M parameters), not on {model}, so that its weights exceed the "
            f"CPU's last-level cache: a model that fits in that cache is timed at cache speed, where decode is not "
            f"bound by memory bandwidth and the roofline (DRAM bandwidth) does not apply. The cache is "
            f"{_mib(cache.bytes)} ({cache.source}); the model is sized for even the smallest variant's decoder "
            f"weights to be {CACHE_MULTIPLE:g}x it (float32 weights capped at {_mib(MAX_FLOAT32_BYTES)}). Weights in memory: {bench['baseline']} {_mib(weights[bench['baseline']])} "
            f"({weights[bench['baseline']] / cache.bytes:.1f}x the cache), {smallest} {_mib(weights[smallest])} "
            f"({weights[smallest] / cache.bytes:.1f}x). Random weights take the same time as trained ones; the "
            f"quality above is measured on the trained reference model. " + (
                "Decode steps run in quantkit's C++ decode loop (quantkit.CpuDecoder) for every variant, the float "
                "model included, so the variants differ only in their linears; prefill runs in transformers."
                if loop == "quantkit" else
                f"Decode steps run in transformers (quantkit's C++ decode loop does not run here: {why_not}), "
                f"whose per-op cost on a CPU can hide the gain from fewer bytes."))
    return bench, note


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def _markdown(name: str, source: str, rows: list[dict], baseline_bytes: int | None, dtype: str,
              stored_dtype: str) -> str:
    """The demo's summary table. dtype: what the models ran in; stored_dtype: what the source's weights
    (and so the checkpoints' float tensors) are stored in; baseline_bytes: the source folder on disk."""
    from quantkit.core.dtypes import dtype_bytes
    from quantkit.harness.formatting import fmt_perplexity_change

    r0 = rows[0]
    lines = [
        f"# quantkit demo: {name}",
        "",
        f"Model folder: `{source}`, run in {dtype}. Evaluation: the first {r0['windows']} non-overlapping windows of "
        f"{r0['window']} tokens of the held-out text ({r0['tokens']} predictions). KL is KL(P_baseline || P_quantized) "
        f"in nats per token; top-1 agreement is how often both models rank the same next token first.",
        "",
        "| variant | scheme | perplexity | Δ ppl | KL | top-1 agreement | bits/weight (linears) | size | quantize time |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| baseline | {stored_dtype} | {r0['baseline_perplexity']:.3f} | - | 0 | 1 | {8 * dtype_bytes(stored_dtype)} | "
        f"{human_bytes(baseline_bytes)} | - |",
    ]
    for r in rows:
        lines.append(
            f"| {r['recipe']} | {r['scheme']} | {r['perplexity']:.3f} | "
            f"{fmt_perplexity_change(r['perplexity'], r['baseline_perplexity'], r.get('log_ppl_ratio_stderr'))} | "
            f"{r['kl_divergence']:.2e} | "
            f"{r['top1_agreement']:.4f} | {r['linear_bits_per_weight']:.3f} | {human_bytes(r['checkpoint_bytes'])} | "
            f"{r['quantize_seconds']:.1f} s |"
        )
    lines += ["", f"Size: on disk, the baseline's folder and each quantized checkpoint (unquantized tensors such as "
              f"embeddings, norms and lm_head, and the scales, stay in the source's {stored_dtype}); every model "
              f"ran in {dtype} for the evaluation. Δ ppl ± two standard errors of the per-window change in "
              f"log-perplexity: a change within them is noise."]
    return "\n".join(lines) + "\n"

