"""GPTQ on the output head: a recipe with the head targeted (`ignore: []`), the head calibrated by GPTQ on the
final norm of the quantized blocks' outputs, against the same recipe with the head rounded to nearest (as
every calibrated recipe did before, and as AWQ still does).

ref:small, in memory (the embedding lookup stays float), scored against the float model by quantkit's harness on
8 windows of 512 tokens of the reference models' held-out text; calibration: the first 4096 tokens of their
training text (16 windows of 256), as evals/gguf/compare.py.

    python evals/quality/lm_head_gptq.py --out evals/quality/lm-head-gptq
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

import quantkit
from quantkit.calibration import gptq_processor
from quantkit.harness.eval_text import load_tokenizer, read_eval_tokens
from quantkit.harness.quality import evaluate_quality, token_windows
from quantkit.formats.loading import load_float_model
from quantkit.refmodels import corpus, resolve_model_name

RECIPES = ("w8a16-gptq-g32", "w4a16-gptq-g32", "w4a16-gptq-q4k", "w4a16-gptq")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    p.add_argument("--recipes", default=",".join(RECIPES))
    args = p.parse_args()
    torch.set_num_threads(2)
    folder = resolve_model_name("ref:small")
    tokenizer = load_tokenizer(folder)
    calib = torch.tensor(tokenizer(corpus.train_text(2_000_000), add_special_tokens=False)["input_ids"][:4096])
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "heldout.txt"
        text.write_text(corpus.heldout_text(2_000_000))
        windows = token_windows(read_eval_tokens(tokenizer, str(text), 8 * 512).ids, 512, 8 * 512)
    baseline = quantkit.load(folder, dtype=torch.float32)
    rows = []
    for name in args.recipes.split(","):
        recipe = dataclasses.replace(quantkit.load_recipe(name), ignore=())
        for head in ("RTN", "GPTQ"):
            model = load_float_model(folder, dtype=torch.float32)
            original = gptq_processor.GPTQProcessor.quantize_head
            if head == "RTN":  # the processor without its head step: the head is left to round to nearest
                del gptq_processor.GPTQProcessor.quantize_head
            try:
                start = time.perf_counter()
                quantkit.quantize(model, recipe, calib.reshape(16, 256), progress=False)
                seconds = time.perf_counter() - start
            finally:
                gptq_processor.GPTQProcessor.quantize_head = original
            r = evaluate_quality(model, baseline, windows, progress=False, allow_other_baseline=True)
            rows.append(dict(recipe=name, head=head, kl=r.kl_divergence, top1=r.top1_agreement,
                             perplexity=r.perplexity, baseline_perplexity=r.baseline_perplexity,
                             quantize_seconds=round(seconds, 1)))
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    meta = dict(model="ref:small", windows=int(windows.shape[0]), window=512, calibration_tokens=4096,
                cpu=platform.processor() or platform.machine(), torch=torch.__version__)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    lines = ["| recipe, lm_head quantized too | lm_head | KL | top-1 | perplexity (float) | KL, GPTQ head / RTN head |",
             "|---|---|---:|---:|---:|---:|"]
    for rtn, gptq in zip(rows[::2], rows[1::2]):
        for r in (rtn, gptq):
            ratio = f"{gptq['kl'] / rtn['kl']:.2f}x" if r is gptq else ""
            lines.append(f"| {r['recipe']} | {r['head']} | {r['kl']:.3g} | {r['top1']:.4f} | "
                         f"{r['perplexity']:.2f} ({r['baseline_perplexity']:.2f}) | {ratio} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
