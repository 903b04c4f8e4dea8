"""RTN vs GPTQ vs AWQ (and llm-compressor's GPTQ) on a reference model: perplexity, KL, top-1, time.

    python evals/calibration/compare.py                          # ref:small, writes evals/calibration/results.*
    python evals/calibration/compare.py --llmcompressor-python /path/to/venv/bin/python

Calibration: the model's training text (quantkit's default for the reference models), N windows of L
tokens with a fixed seed. Evaluation: the held-out text, non-overlapping windows of the model's context,
through `quantkit.harness.quality.evaluate_variants` (KL of each quantized model's next-token distribution
from the unquantized one, top-1 agreement, perplexity; one baseline pass for all variants). All variants are quantized and evaluated in
one run, side by side, so their times compare (absolute CPU seconds depend on the machine and its load).
With --llmcompressor-python, llm-compressor's GPTQ (same scheme, damping, block size, static act-order)
runs in that interpreter on the *same* calibration windows, and its checkpoint is evaluated here.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECIPES = ("w4a16-rtn", "w4a16-gptq", "w4a16-awq", "w4a16-rtn-asym", "w4a16-gptq-asym", "w4a16-awq-asym")


def gptq_with_compressed_tensors_scales():
    """quantkit's w4a16-gptq with symmetric scales picked as llm-compressor's observer does,
    absmax / ((qmax - qmin) / 2) (int4: /7.5, the top value clipped to 7) instead of absmax / qmax (/7).
    Only to separate the algorithms from the scale convention in the side-by-side table."""
    from quantkit.quantization.recipe import load_recipe

    recipe = load_recipe("w4a16-gptq")
    options = dataclasses.replace(recipe.algorithm.options, symmetric_scale="half_range")
    return dataclasses.replace(recipe, algorithm=dataclasses.replace(recipe.algorithm, options=options))


def run_llmcompressor(python: str, model_dir: Path, calib, tmp: Path) -> tuple[Path | None, dict]:
    from safetensors.torch import save_file

    calib_file = tmp / "calibration.safetensors"
    save_file({"input_ids": calib.contiguous()}, str(calib_file))
    out = tmp / "llmcompressor-gptq"
    proc = subprocess.run([python, str(HERE / "llmcompressor_gptq.py"), str(model_dir), str(calib_file), str(out)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return None, {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return out, json.loads((out / "timing.json").read_text())


def markdown(meta: dict, rows: list[dict]) -> str:
    gptq = next((r["seconds"] for r in rows if r["variant"] == "quantkit w4a16-gptq"), None)
    lines = [
        f"# Calibrated INT4 on `{meta['model']}`",
        "",
        f"Calibration: {meta['calib_samples']} windows x {meta['calib_seq_len']} tokens of the training text "
        f"(seed {meta['seed']}). Evaluation: {meta['eval_tokens']} predicted tokens of the held-out text in "
        f"windows of {meta['window']} (baseline perplexity {meta['baseline_perplexity']:.3f}). Compute in "
        f"{meta['dtype']}, {meta['threads']} CPU threads, everything in one run "
        f"(`python evals/calibration/compare.py{meta['command_args']}`).",
        "",
        "| variant | perplexity | Δ ppl | KL (nats/token) | top-1 agreement | quantize time (s) | time / quantkit GPTQ |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rel = f"{r['seconds'] / gptq:.2f}" if (r["seconds"] is not None and gptq) else "-"
        secs = f"{r['seconds']:.1f}" if r["seconds"] is not None else "-"
        lines.append(f"| {r['variant']} | {r['perplexity']:.3f} | {r['perplexity'] - r['baseline_perplexity']:+.3f} "
                     f"| {r['kl']:.5f} | {100 * r['top1']:.2f}% | {secs} | {rel} |")
    if meta.get("llmcompressor"):
        lc = meta["llmcompressor"]
        if "error" in lc:
            lines += ["", f"llm-compressor GPTQ failed: `{' '.join(lc['error'])}`"]
        else:
            lines += ["", f"llm-compressor {lc['llmcompressor']}: `GPTQModifier(scheme={lc['scheme']}, "
                          f"actorder={lc['actorder']}, dampening_frac={lc['dampening_frac']}, "
                          f"block_size={lc['block_size']})` on the same {lc['samples']} x {lc['seq_len']} windows, "
                          f"its own environment (transformers <= 5.17); its time includes its data pipeline."]
    return "\n".join(lines) + "\n"


def _command_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The options that differ from their defaults, as a command line (paths to interpreters elided)."""
    parts = []
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in ("help", "out") or value == action.default:
            continue
        if value is True:
            parts.append(action.option_strings[0])
        else:
            parts.append(f"{action.option_strings[0]} {'PYTHON' if action.dest == 'llmcompressor_python' else value}")
    return "".join(" " + part for part in parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="ref:small")
    p.add_argument("--recipes", default=",".join(RECIPES[:3]), help=f"comma-separated (default: first three of {RECIPES})")
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--calib-seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-tokens", type=int, default=None, help="cap on held-out tokens (default: all)")
    p.add_argument("--window", type=int, default=None, help="evaluation window (default: the model's context)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--llmcompressor-python", help="python of an environment with llmcompressor installed")
    p.add_argument("--ct-scales", action="store_true",
                   help="also run quantkit's w4a16-gptq with llm-compressor's symmetric scale convention (absmax/7.5)")
    p.add_argument("--out", default=str(HERE / "results"), help="output stem: writes STEM.md and STEM.json")
    args = p.parse_args(argv)

    import torch

    import quantkit
    from quantkit.calibration import CalibrationConfig, calibration_batches
    from quantkit.harness.eval_text import eval_token_windows
    from quantkit.harness.quality import evaluate_variants
    from quantkit.formats.loading import load_float_model, resolve_model_source

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    source = resolve_model_source(args.model)
    baseline = load_float_model(source, dtype=dtype)
    windows = eval_token_windows(source, None, window=args.window, max_tokens=args.eval_tokens,
                                 model_config=baseline.config)
    calibration = CalibrationConfig(source="ref", num_samples=args.calib_samples, seq_len=args.calib_seq_len,
                                    seed=args.seed)
    calib = torch.cat(calibration_batches(calibration, baseline))  # [N, L]: what every variant calibrates on
    variants = [(f"quantkit {r}", r) for r in args.recipes.split(",")]
    if args.ct_scales:
        variants.append(("quantkit w4a16-gptq, scales absmax/7.5", gptq_with_compressed_tensors_scales()))
    warm_up = list(calib[:2].split(1))  # first calls pay for lazy imports: keep them out of the timings
    for _name, recipe in variants:
        quantkit.quantize(copy.deepcopy(baseline), recipe, calibration_data=warm_up, progress=False)
    models, seconds = {}, {}
    for name, recipe in variants:
        model = copy.deepcopy(baseline)
        start = time.perf_counter()
        quantkit.quantize(model, recipe, calibration_data=list(calib.split(max(1, 8192 // calib.shape[1]))),
                          progress=False)
        seconds[name] = time.perf_counter() - start
        models[name] = model
        print(f"{name}: quantized in {seconds[name]:.1f} s", flush=True)
    meta = dict(model=args.model, calib_samples=args.calib_samples, calib_seq_len=calib.shape[1], seed=args.seed,
                dtype=args.dtype, threads=args.threads, command_args=_command_args(p, args))
    with tempfile.TemporaryDirectory() as tmp:
        if args.llmcompressor_python:
            folder, info = run_llmcompressor(args.llmcompressor_python, Path(source), calib, Path(tmp))
            meta["llmcompressor"] = info
            if folder is not None:
                name = f"llm-compressor {info['llmcompressor']} GPTQ"
                models[name] = quantkit.load(folder, backend="reference", dtype=dtype)
                seconds[name] = info["seconds"]
                print(f"{name}: quantized in {seconds[name]:.1f} s", flush=True)
        results = evaluate_variants(models, baseline, windows, batch_size=args.batch_size)
    rows = [dict(variant=name, perplexity=q.perplexity, baseline_perplexity=q.baseline_perplexity,
                 kl=q.kl_divergence, top1=q.top1_agreement, seconds=seconds[name]) for name, q in results.items()]
    first = next(iter(results.values()))
    meta.update(eval_tokens=first.tokens, window=first.window, baseline_perplexity=first.baseline_perplexity)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
