"""Why GPTQ and AWQ land where they do on SmolLM2-135M: one option changed at a time, KL to the float model.

Runs in the environment of smollm2.py (same model folder, texts, calibration windows and evaluation
windows under --work; run smollm2.py first). Each row is one built-in W4 recipe with one change (an
algorithm option, or the calibration size); the table gives its KL, perplexity and top-1 against the
float model, and its KL as a fraction of the recipe's unchanged KL and of RTN's.

    /work/venvs/smollm2-eval/bin/python evals/quality/smollm2_ablations.py [--rows NAME,...]

Writes evals/quality/smollm2-135m-ablations.{md,json}; checkpoints and results go under
--work/ablations (reused when present, so rows can be added in separate runs).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import smollm2

HERE = Path(__file__).resolve().parent
# (row name, built-in recipe, algorithm option overrides, calibration overrides, what the row asks)
ROWS = (
    ("gptq", "w4a16-gptq", {}, {}, "the built-in recipe (group ranges by the Hessian-weighted MSE search)"),
    ("gptq minmax", "w4a16-gptq", {"observer": "minmax"}, {},
     "plain GPTQ: min-max group ranges (llm-compressor's default)"),
    ("gptq minmax damp 0.1", "w4a16-gptq", {"observer": "minmax", "damp_percent": 0.1}, {},
     "is the Hessian under-damped?"),
    ("gptq minmax no act-order", "w4a16-gptq", {"observer": "minmax", "act_order": False}, {},
     "what static act-order buys"),
    ("gptq minmax half-range scale", "w4a16-gptq", {"observer": "minmax", "symmetric_scale": "half_range"}, {},
     "llm-compressor's scale rule (absmax / 7.5, top value clipped) instead of absmax / 7"),
    ("gptq minmax 4x calibration", "w4a16-gptq", {"observer": "minmax"}, {"num_samples": 64},
     "is 16 x 256 tokens too little?"),
    ("awq", "w4a16-awq", {}, {}, "the built-in recipe"),
    ("awq attention output", "w4a16-awq", {"block_outputs": True}, {},
     "q/k/v scales scored by the attention's output (AutoAWQ, llm-compressor), not the projections'"),
    ("rtn asym g32", "w4a16-rtn-asym", {"weights": {"group_size": 32}}, {},
     "the group of the GGUF's own Q4_1 format (asymmetric, 32 weights)"),
    ("awq no clip", "w4a16-awq", {"clip": False}, {}, "what the clipping search buys"),
    ("awq no duo scaling", "w4a16-awq", {"duo_scaling": False}, {}, "scales from activations only"),
    ("awq asym", "w4a16-awq-asym", {}, {}, "AutoAWQ's default scheme (asymmetric), against RTN asym"),
)
# FP8 KV: which of K and V the error comes from, simulated on the float model by rounding the k_proj / v_proj
# outputs to fp8 e4m3 with the kv-fp8 checkpoint's per-tensor scales (K before the rotary embedding: a rotation,
# which moves the rounding error but not its size).
KV_ROWS = (
    ("kv fp8 K and V (simulated)", ("k", "v"), "does rounding at the projections reproduce the cache's KL?"),
    ("kv fp8 K only (simulated)", ("k",), "how much of it is the keys'"),
    ("kv fp8 V only (simulated)", ("v",), "how much is the values'"),
)
REFERENCES = {"rtn": "w4a16-rtn", "rtn-asym": "w4a16-rtn-asym", "llm-compressor": "llm-compressor GPTQ (same groups)",
              "kv-fp8": "kv-fp8"}


def kv_rounding_hooks(model, kv_checkpoint: Path, which: tuple[str, ...]) -> list:
    """Forward hooks rounding each layer's k_proj / v_proj output (which: "k", "v") to fp8 e4m3 with the scales
    of the kv-fp8 checkpoint (per tensor [1] or per KV head [Hkv]). returns the hook handles."""
    from safetensors import safe_open

    from quantkit.core.primitives import dequantize_fp8, quantize_fp8

    handles = []
    with safe_open(str(kv_checkpoint / "model.safetensors"), "pt") as f:
        for i, layer in enumerate(model.model.layers):
            for part in which:
                scale = f.get_tensor(f"model.layers.{i}.self_attn.{part}_scale").float()  # [1] or [Hkv]

                def hook(module, args, out, scale=scale):
                    shaped = out.unflatten(-1, (scale.numel(), -1))  # [B, T, Hkv or 1, ...]
                    s = scale.reshape(-1, 1)
                    return dequantize_fp8(quantize_fp8(shaped, s), s, out.dtype).flatten(-2)

                handles.append(getattr(layer.self_attn, f"{part}_proj").register_forward_hook(hook))
    return handles


def recipe_for(builtin: str, options: dict):
    """The built-in recipe with `options` over its algorithm's options (and options["weights"] over its weights)."""
    import quantkit
    from quantkit.quantization.recipe import recipe_from_dict

    data = quantkit.load_recipe(builtin).to_dict()
    options = dict(options)
    data["weights"] = {**data["weights"], **options.pop("weights", {})}
    data["algorithm"] = {**data["algorithm"], **options}
    return recipe_from_dict(data, name=builtin)


def markdown(meta: dict, rows: list[dict], refs: dict) -> str:
    llmc = refs.get("llm-compressor")
    lines = [
        "# SmolLM2-135M: GPTQ and AWQ, one change at a time", "",
        f"Reproduce: `{meta['command']}` (after `python evals/quality/smollm2.py`; on {meta['cpu']}, 2 cores).", "",
        "Same model, calibration and evaluation windows as smollm2-135m.md (calibration: "
        f"{meta['calib_samples']} x {meta['calib_seq_len']} tokens of the Python documentation topics unless the "
        f"row says otherwise; evaluation: {meta['eval_tokens']} predictions on Debian's licence texts). "
        f"References from that table: RTN KL {refs['rtn']:.4f} (w4a16-rtn; asymmetric rows: w4a16-rtn-asym, "
        f"{refs['rtn-asym']:.4f})" + (f", llm-compressor GPTQ KL {llmc:.4f}" if llmc else "") + ".", "",
        "| row | what it asks | change | KL | KL / RTN's | RTN's KL removed | KL / llm-compressor's | perplexity | "
        "top-1 | quantize time |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    kv_rows = [r for r in rows if "kv" in r]
    for r in rows:
        if "kv" in r:
            continue
        change = ", ".join(f"{k}={v}" for k, v in {**r["options"], **r["calibration"]}.items()) or "-"
        vs_llmc = f"{r['kl'] / llmc:.3f}" if llmc and r["recipe"].startswith("w4a16-gptq") else "-"
        rtn = refs["rtn-asym" if r["recipe"].endswith("-asym") else "rtn"]
        lines.append(
            f"| {r['name']} | {r['asks']} | {change} | {r['kl']:.4f} | {r['kl'] / rtn:.3f} | "
            f"{(1 - r['kl'] / rtn) * 100:.1f}% | {vs_llmc} | {r['perplexity']:.3f} | {r['top1']:.4f} | "
            f"{r['seconds']:.0f} s |")
    if kv_rows:
        lines += ["", f"FP8 KV cache (the kv-fp8 row of smollm2-135m.md: KL {refs['kv-fp8']:.4f}, "
                  f"perplexity {refs['kv-fp8 perplexity']:.3f}):", "",
                  "| row | what it asks | KL | KL / kv-fp8's | perplexity | Δ ppl (± 2 s.e.) | top-1 |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for r in kv_rows:
            lines.append(f"| {r['name']} | {r['asks']} | {r['kl']:.4f} | {r['kl'] / refs['kv-fp8']:.3f} | "
                         f"{r['perplexity']:.3f} | {r['change'] * 100:+.2f}% ± {r['band'] * 100:.2f}% | {r['top1']:.4f} |")
    lines += ["", "KL is KL(P_float || P_variant) in nats per token over the evaluation windows. num_samples is the "
              "number of calibration windows of 256 tokens (16 in the table). Quantize time: quantize + save on the "
              "CPU above, 2 threads; a row made while other jobs shared the machine shows an upper bound, so compare "
              "times in smollm2-135m.md (timed alone) rather than here."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/smollm2-eval", help="smollm2.py's --work folder")
    p.add_argument("--rows", default=",".join(r[0] for r in (*ROWS, *KV_ROWS)),
                   help="comma-separated row names (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(HERE / "smollm2-135m-ablations"), help="output stem: STEM.md and STEM.json")
    args = p.parse_args(argv)

    import torch

    import quantkit
    from quantkit.calibration import CalibrationConfig
    from quantkit.harness.hardware import cpu_name
    from quantkit.harness.quality import evaluate_variants, token_windows
    from quantkit.formats.loading import load_float_model
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    float_dir = work / "float"
    table = json.loads((HERE / "smollm2-135m.json").read_text())
    meta = table["meta"]
    if not (float_dir / "config.json").is_file():
        raise SystemExit(f"{float_dir} is missing: run evals/quality/smollm2.py --work {work} first")
    calib_text, eval_text = smollm2.write_texts(work)
    tokenizer = AutoTokenizer.from_pretrained(float_dir)
    eval_ids = torch.tensor(tokenizer(eval_text.read_text()).input_ids)
    windows = token_windows(eval_ids, meta["window"], meta["windows"] * meta["window"])
    abl = work / "ablations"
    (abl / "checkpoints").mkdir(parents=True, exist_ok=True)
    (abl / "results").mkdir(exist_ok=True)
    wanted = args.rows.split(",")
    for name, builtin, options, calib, asks in ROWS:
        if name not in wanted:
            continue
        result_file = abl / "results" / f"{smollm2.slug(name)}.json"
        if result_file.is_file():
            continue
        config = CalibrationConfig(source=str(calib_text), num_samples=calib.get("num_samples", meta["calib_samples"]),
                                   seq_len=meta["calib_seq_len"], seed=meta["seed"])
        info = smollm2.run_quantize(abl, float_dir, name, recipe_for(builtin, options), config)
        baseline = load_float_model(str(float_dir), dtype=torch.float32)
        model = quantkit.load(info["dir"], backend="reference", dtype=torch.float32)
        q = evaluate_variants({name: model}, baseline, windows, batch_size=4, progress=False)[name]
        row = {"name": name, "recipe": builtin, "options": options, "calibration": calib, "asks": asks,
               "kl": q.kl_divergence, "perplexity": q.perplexity, "top1": q.top1_agreement, "seconds": info["seconds"]}
        result_file.write_text(json.dumps(row, indent=2) + "\n")
        smollm2.log(f"{name}: KL {q.kl_divergence:.4f} ppl {q.perplexity:.3f} top-1 {q.top1_agreement:.4f}")
    for name, which, asks in KV_ROWS:
        result_file = abl / "results" / f"{smollm2.slug(name)}.json"
        if name not in wanted or result_file.is_file():
            continue
        baseline = load_float_model(str(float_dir), dtype=torch.float32)
        model = load_float_model(str(float_dir), dtype=torch.float32)
        kv_rounding_hooks(model, work / "checkpoints" / "kv-fp8", which)
        q = evaluate_variants({name: model}, baseline, windows, batch_size=4, progress=False)[name]
        row = {"name": name, "kv": list(which), "asks": asks, "kl": q.kl_divergence, "perplexity": q.perplexity,
               "top1": q.top1_agreement, "change": q.perplexity / q.baseline_perplexity - 1,
               "band": 2 * q.log_ppl_ratio_stderr}
        result_file.write_text(json.dumps(row, indent=2) + "\n")
        smollm2.log(f"{name}: KL {q.kl_divergence:.4f} ppl {q.perplexity:.3f} top-1 {q.top1_agreement:.4f}")
    by_name = {r["name"]: r for r in table["rows"]}
    refs = {key: by_name[row]["kl"] for key, row in REFERENCES.items() if row in by_name}
    if "kv-fp8" in by_name:
        refs["kv-fp8 perplexity"] = by_name["kv-fp8"]["perplexity"]
    rows = [json.loads(f.read_text()) for name, *_ in (*ROWS, *KV_ROWS)
            if (f := abl / "results" / f"{smollm2.slug(name)}.json").is_file()]
    meta = {**{k: meta[k] for k in ("calib_samples", "calib_seq_len", "eval_tokens")},
            "command": "python evals/quality/smollm2_ablations.py", "cpu": cpu_name() or platform.processor()}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "references": refs, "rows": rows}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(meta, rows, refs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
