"""Mixture-of-experts structure table: every built-in recipe on a small random model of each MoE family.

    python evals/moe/make_table.py            # writes evals/moe/results.json; prints the tables
    python evals/moe/make_table.py --all      # every built-in recipe (the default: five representative ones)
    python evals/moe/make_table.py --quick    # two recipes per family, for a check

Models: random Qwen3-MoE, Qwen2-MoE (with its shared expert), Mixtral and OLMoE (hidden 256, 2 layers,
8 experts, top-2, expert width 128; vocabulary 4096 with ref:tiny's tokenizer so text can be fed). They
are untrained: the KL and top-1 columns show that the pipeline runs and how far each recipe moves a
model's outputs, not quality (a trained model's numbers differ). Calibration: the reference models'
training text ("ref"), 8 windows of 256 tokens, seed 0. Evaluation: the held-out text, 8 windows of
256 tokens. Decode: `quantkit bench` TPOT at batch 1, context 64 (float32 model; the int4/int8 CPU
kernels compute in bf16), float vs w4a16-rtn vs w8a16-rtn.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


def make_model(family: str, folder: Path) -> Path:
    import torch

    from quantkit.formats.loading import resolve_model_source
    from fixtures.moe_fixtures import make_moe_model

    model = make_moe_model(family)
    config = model.config
    config.vocab_size = 4096
    torch.manual_seed(0)
    model = type(model)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    tokenizer = Path(resolve_model_source("ref:tiny"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer / name, folder / name)
    return folder


def tpot_ms(source: Path, work: Path) -> dict[str, float]:
    """Median TPOT (ms) of float, w4a16-rtn and w8a16-rtn from one `quantkit bench` run."""
    out = work / f"{source.name}-bench.json"
    cmd = [sys.executable, "-m", "quantkit.commands.cli", "bench", str(source), "--variants", "w4a16-rtn", "w8a16-rtn",
           "--prompt-lens", "16", "--context-lens", "64", "--batch-sizes", "1", "--repeats", "5", "--warmup", "2",
           "--dtype", "float32", "--json", str(out), "--quiet"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    bench = json.loads(out.read_text())
    return {r["variant"]: 1e3 * r["median_s"] for r in bench["decode"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--no-bench", action="store_true")
    args = parser.parse_args()

    import torch

    import quantkit
    from quantkit.quantization import provenance
    from quantkit.calibration import CalibrationConfig
    from quantkit.harness.eval_text import eval_token_windows
    from quantkit.harness.quality import evaluate_variants
    from quantkit.formats.loading import folder_size_bytes
    from quantkit.quantization.recipe import builtin_recipes
    from quantkit.quantization.weight_census import weight_census

    torch.set_num_threads(2)
    recipes = ["w4a16-rtn", "w4a16-gptq"] if args.quick else sorted(builtin_recipes()) if args.all else [
        "w4a16-rtn", "w8a16-rtn", "w4a16-gptq", "w4a16-awq", "w4a16-gptq-kv-fp8"]
    rows, decode = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for family in FAMILIES:
            source = make_model(family, work / family)
            windows = eval_token_windows(str(source), None, window=256, max_tokens=8 * 256)
            baseline = quantkit.load(source)
            float_bytes = folder_size_bytes(source)
            for name in recipes:
                model = quantkit.load(source)
                calib = CalibrationConfig(source="ref", num_samples=8, seq_len=256, seed=0)
                start = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    quantkit.quantize(model, name, calib, progress=False, tokenizer=None)
                seconds = time.perf_counter() - start
                census = weight_census(model)
                out = quantkit.save(model, work / f"{family}-{name}")
                loaded = quantkit.load(out)
                q = evaluate_variants({name: loaded}, baseline, windows, progress=False)[name]
                routing = (provenance.of(model).moe_routing or {})
                rows.append({
                    "family": family, "recipe": name, "quantized_share": census.share(census.quantized),
                    "float_kinds": census.lines()[1].removeprefix("left float: "),
                    "float_mib": float_bytes / 2**20, "checkpoint_mib": folder_size_bytes(out) / 2**20,
                    "kl": q.kl_divergence, "top1": q.top1_agreement, "quantize_s": seconds,
                    "routed_least": routing.get("least"), "routed_median": routing.get("median"),
                    "routed_most": routing.get("most"), "never_routed": len(routing.get("never_routed", [])),
                })
                print(json.dumps(rows[-1]), flush=True)
            if not args.no_bench:
                decode[family] = tpot_ms(source, work)
                print(family, decode[family], flush=True)
    result = {"rows": rows, "decode_tpot_ms": decode, "command": "python evals/moe/make_table.py",
              "torch": torch.__version__}
    (HERE / ("results-quick.json" if args.quick else "results.json")).write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(table(result)))


def table(result: dict) -> list[str]:
    lines = ["| family | recipe | weights quantized | left float | size (MiB, float32 -> ckpt) | KL | top-1 | "
             "tokens per expert (least / median / most) | quantize s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        routed = (f"{r['routed_least']} / {r['routed_median']} / {r['routed_most']}"
                  if r["routed_least"] is not None else "-")
        lines.append(f"| {r['family']} | {r['recipe']} | {r['quantized_share']:.1f}% | {r['float_kinds']} | "
                     f"{r['float_mib']:.1f} -> {r['checkpoint_mib']:.1f} | {r['kl']:.4f} | {r['top1']:.3f} | "
                     f"{routed} | {r['quantize_s']:.1f} |")
    if result["decode_tpot_ms"]:
        lines += ["", "| family | decode TPOT float32 (ms) | w4a16-rtn | w8a16-rtn |", "|---|---|---|---|"]
        for family, t in result["decode_tpot_ms"].items():
            lines.append(f"| {family} | {t.get('float32', float('nan')):.2f} | {t.get('w4a16-rtn', float('nan')):.2f} | "
                         f"{t.get('w8a16-rtn', float('nan')):.2f} |")
    return lines


if __name__ == "__main__":
    main()
