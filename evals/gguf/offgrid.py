"""SmolLM2-135M-Instruct moved off the Q4_1 grid it ships on, so that block types with a float minimum per 32
weights (Q4_1, and in part Q4_K) gain nothing from the model's origin.

The model ships as llama.cpp Q4_1: every block of 32 weights of its linears lies exactly on 16 levels
d * u + m, and llama.cpp's Q4_1 recovers it almost losslessly (evals/gguf/README.md). A short fine-tune alone
does not move it off that grid: 30 AdamW steps at lr 3e-4 moved the weights by 0.04 of a step (rms), and at
lr 3e-3 the loss diverged (2.3 -> 9.1 in 20 steps). So each linear weight first gets Gaussian noise of
NOISE times its block's Q4_1 step d (seeded), which puts it between the levels, and then a short fine-tune
on text that is neither compare.py's calibration text (the Python documentation topics) nor its evaluation
text (Debian's licence texts) -- the Python standard library's source, the reference models' training
corpus -- trains the model again from there (gradient norm clipped at 1). Only the decoder's linears and norms
change (the tied embedding stays as shipped: both sides write it in Q8_0 or Q6_K anyway).

How far it moved is measured against the original grid: for every linear weight, its change and its
distance to the nearest level of its original Q4_1 block, in units of that block's step d. The fine-tuned
model is saved in bfloat16 (its distance is measured after that rounding).

    python evals/gguf/offgrid.py --src WORK/smollm2-float --out WORK/smollm2-offgrid

(compare.py --model smollm2-offgrid runs this first.) Writes OUT (a model folder) and OUT/offgrid.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

STEPS, BATCH, SEQ, LR, WARMUP, SEED = 20, 4, 256, 2e-4, 3, 0
NOISE = 0.35  # the noise's standard deviation, in units of each block's Q4_1 step


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def q4_1_distance(before: torch.Tensor, after: torch.Tensor) -> dict:
    """before [N, K] on a Q4_1 grid (blocks of 32: d = (max - min) / 15, levels min + d * u), after the
    moved weight: the change and the distance to the nearest original level, in units of each block's d."""
    b = before.float().reshape(-1, 32)
    a = after.float().reshape(-1, 32)
    lo = b.amin(dim=1, keepdim=True)
    d = ((b.amax(dim=1, keepdim=True) - lo) / 15).clamp(min=1e-12)
    on_grid = ((b - lo) / d - ((b - lo) / d).round()).abs()  # ~0: the shipped model is on its grid
    level = (a - lo) / d
    off = (level - level.round().clamp(0, 15)).abs()
    moved = (a - b).abs() / d
    return {"weights": b.numel(), "shipped_off_grid_max": on_grid.max().item(),
            "moved_rms": moved.pow(2).mean().sqrt().item(), "moved_median": moved.median().item(),
            "off_grid_mean": off.mean().item(), "off_grid_over_0.25": (off > 0.25).float().mean().item()}


def fine_tune(src: Path, out: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.refmodels import corpus

    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    before = {n: m.weight.detach().clone() for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for n, w in before.items():
            blocks = w.reshape(-1, 32)
            step = (blocks.amax(dim=1, keepdim=True) - blocks.amin(dim=1, keepdim=True)) / 15
            noise = torch.randn(blocks.shape, generator=g) * step * NOISE
            model.get_submodule(n).weight.add_(noise.reshape(w.shape))
    model.get_input_embeddings().weight.requires_grad_(False)  # tied with lm_head: both stay as shipped
    params = [p for p in model.parameters() if p.requires_grad]
    text = corpus.train_text(4_000_000)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][:STEPS * BATCH * SEQ])
    batches = ids.reshape(STEPS, BATCH, SEQ)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    model.train()
    losses, start = [], time.perf_counter()
    for step in range(STEPS):
        loss = model(batches[step], labels=batches[step]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 10 == 0 or step == STEPS - 1:
            log(f"step {step + 1}/{STEPS}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)")
    model.eval()
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    moved = {n: q4_1_distance(w, model.get_submodule(n).weight.detach()) for n, w in before.items()}
    total = sum(v["weights"] for v in moved.values())

    def mean(key):
        return sum(v[key] * v["weights"] for v in moved.values()) / total

    summary = {
        "noise": NOISE, "steps": STEPS, "batch": BATCH, "seq_len": SEQ, "lr": LR, "warmup": WARMUP, "seed": SEED,
        "text": "the Python standard library's source (quantkit.refmodels.corpus.train_text)",
        "tokens": STEPS * BATCH * SEQ, "loss_first": losses[0], "loss_last": losses[-1],
        "seconds": time.perf_counter() - start,
        "shipped_off_grid_max": max(v["shipped_off_grid_max"] for v in moved.values()),
        "moved_rms": mean("moved_rms"), "off_grid_mean": mean("off_grid_mean"),
        "off_grid_over_0.25": mean("off_grid_over_0.25"),
    }
    (out / "offgrid.json").write_text(json.dumps({"summary": summary, "per_linear": moved}, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, required=True, help="SmolLM2's float folder (evals/quality/smollm2.py makes it)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    summary = fine_tune(args.src, args.out)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
