"""The README's Python snippet on CPU for an fp32 model: `generate` timed quantized (backend "auto") against float.

    python evals/kernels/cpu_auto_generate.py --out evals/kernels/cpu --realtime

For each model, in fp32: the float model, and the README's path to a quantized one
(``quantkit.quantize(model, RECIPE)``, ``quantkit.save``, ``quantkit.load(path, backend="auto")``);
with ``--reference-on`` naming the model, also the same checkpoint loaded with ``backend="reference"``
(the exact fp32 path, which "auto" took for fp32 models on CPU before). Each variant runs
``model.generate(prompt, max_new_tokens=N, min_new_tokens=N, do_sample=False)``; the variants run in
turn, round after round (interleaved, so load drifts over all alike), the first round is a warm-up.
A variant's time is the median over the other rounds, shown with their range; the speedup is the
float model's median over the variant's.

Models: ``ref:small`` (trained, 5.2 M parameters: 21 MB of fp32 weights, which sit in the CPU's
caches, so its decode is bound by per-op overheads, not by memory) and
``evals/configs/llama-1b-random.json`` (random weights, 0.85 B parameters: 3.4 GB in fp32, far
beyond any cache: decode reads every weight from DRAM). Outputs OUT/cpu_auto_generate.{json,md}.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import quantkit
from quantkit.harness.hardware import cpu_name
from quantkit.harness.variants import load_source_model
from quantkit.modules.quant_linear import QuantLinear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_timing import realtime_priority  # noqa: E402

DEFAULT_MODELS = "ref:small,evals/configs/llama-1b-random.json"


def variants(source: str, recipe: str, with_reference: bool, folder: Path) -> dict:
    """name -> fp32 model: "float", "auto" (the README's quantize / save / load), optionally "reference"."""
    float_model = load_source_model(source, dtype=torch.float32, device="cpu")
    quantized = quantkit.quantize(copy.deepcopy(float_model), recipe, progress=False)
    quantkit.save(quantized, folder)
    del quantized
    gc.collect()
    models = {"float": float_model, "auto": quantkit.load(folder, backend="auto")}
    if with_reference:
        models["reference"] = quantkit.load(folder, backend="reference")
    return models


def backends(model) -> list[str]:
    """The backends the model's quantized linears run on."""
    return sorted({m.backend for m in model.modules() if isinstance(m, QuantLinear)})


@torch.inference_mode()
def generate(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, list[int]]:
    """Seconds of one greedy ``generate`` of exactly ``new_tokens`` tokens, and the tokens."""
    t0 = time.perf_counter()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0, out[0, prompt.shape[1]:].tolist()


def time_model(source: str, args, folder: Path) -> dict:
    models = variants(source, args.recipe, source in args.reference_on.split(","), folder)
    vocab = models["float"].config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(args.seed))
    times: dict[str, list[float]] = {name: [] for name in models}
    tokens = {}
    for name, model in models.items():  # warm-up round, outside the real-time class
        tokens[name] = generate(model, prompt, args.new_tokens)[1]
    with realtime_priority(args.realtime):
        for _ in range(args.rounds):
            for name, model in models.items():
                seconds, _ = generate(model, prompt, args.new_tokens)
                times[name].append(seconds)
    params = sum(p.numel() for p in models["float"].parameters())
    base = statistics.median(times["float"])
    row = {"model": source, "parameters": params, "variants": {}}
    for name, model in models.items():
        med = statistics.median(times[name])
        row["variants"][name] = {
            "backends": backends(model) or ["-"], "median_s": med, "min_s": min(times[name]), "max_s": max(times[name]),
            "speedup_vs_float": base / med,
        }
        print(f"{source} {name:<9} {med:6.2f} s (range {min(times[name]):.2f}-{max(times[name]):.2f}) "
              f"{base / med:.2f}x of float", flush=True)
    if "reference" in models:
        row["auto_tokens_equal_reference"] = tokens["auto"] == tokens["reference"]
    del models
    gc.collect()
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated: ref:NAME, model folders or random-model configs")
    p.add_argument("--recipe", default="w4a16-rtn")
    p.add_argument("--reference-on", default="ref:small",
                   help="comma-separated models that also time backend 'reference' (slow on large models)")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens (random ids)")
    p.add_argument("--new-tokens", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--realtime", action="store_true", help="time under SCHED_FIFO (Linux, root)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"command": "python evals/kernels/cpu_auto_generate.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": cpu_name(), "capability": torch.backends.cpu.get_cpu_capability(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "recipe": args.recipe,
              "prompt_tokens": args.prompt, "new_tokens": args.new_tokens, "rounds": args.rounds,
              "realtime_priority": args.realtime, "models": []}
    for source in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="quantkit-auto-generate-") as tmp:
            result["models"].append(time_model(source, args, Path(tmp) / "quantized"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_auto_generate.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "cpu_auto_generate.md").write_text(to_markdown(result))
    print(to_markdown(result))
    return result


def to_markdown(result: dict) -> str:
    lines = [f"# `generate` on CPU, fp32 model: float vs {result['recipe']} loaded with backend \"auto\"", "",
             f"{result['machine']} ({result['capability']}), {result['threads']} threads, torch {result['torch']}"
             f"{', timed under SCHED_FIFO (shared machine)' if result['realtime_priority'] else ''}. "
             f"Each run: `model.generate` of {result['new_tokens']} tokens (greedy) after a "
             f"{result['prompt_tokens']}-token prompt; variants interleaved over {result['rounds']} rounds after a "
             "warm-up round; median seconds and the range of the rounds.", "",
             f"Command: `{result['command']}`", "",
             "| model | parameters | variant | quantized linears run on | seconds (median) | range | speedup vs float |",
             "|---|---:|---|---|---:|---:|---:|"]
    for row in result["models"]:
        for name, v in row["variants"].items():
            lines.append(f"| {row['model']} | {row['parameters'] / 1e6:.1f} M | {name} | {', '.join(v['backends'])} | "
                         f"{v['median_s']:.2f} | {v['min_s']:.2f}-{v['max_s']:.2f} | {v['speedup_vs_float']:.2f}x |")
    same = [f"{row['model']}: {'yes' if row['auto_tokens_equal_reference'] else 'no'}"
            for row in result["models"] if "auto_tokens_equal_reference" in row]
    if same:
        lines += ["", "Greedy tokens of \"auto\" equal to those of \"reference\" (same checkpoint): " + "; ".join(same) + "."]
    lines += ["", "Ratios were measured side by side in one run; absolute times depend on the machine and its load."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
