"""quantkit's calibrated weights exported to GGUF beside llama.cpp's own quantizer, at the same block types.

For one float model (SmolLM2-135M-Instruct as evals/quality/smollm2.py makes it; "smollm2-offgrid", that model
moved off the Q4_1 grid it ships on by evals/gguf/offgrid.py's short fine-tune; or ref:small):
- llama.cpp: the float model as GGUF (llama.cpp's convert_hf_to_gguf.py; for ref:small, whose tokenizer
  llama.cpp's converter does not know, quantkit's export of the float model), `llama-imatrix` on the
  calibration tokens, `llama-quantize` to Q4_0, Q4_1, Q8_0 and the K-quant mixes, with and without the importance
  matrix;
- quantkit: RTN / GPTQ on the GGUF grids (the *-g32 recipes) from the same calibration tokens (the first
  4096 tokens of the calibration text: 16 windows of 256 for quantkit, the same text as 8 chunks of 512
  for llama-imatrix), `quantkit export --format gguf`; RTN / GPTQ / AWQ on the Q4_K grid and in
  llama-quantize's Q4_K_M / Q4_K_S / Q3_K_M / Q2_K mixes (the *-q4k, *-q4km, *-q4ks, *-q3km, *-q2k recipes: the
  file is the only form);
- every file scored by one harness: quantkit's eval (transformers + gguf dequantize the file) against
  the float model on the evaluation text (8 windows of 512 tokens): KL, top-1, perplexity; file sizes,
  bits per weight (file bits / parameters); `llama-bench -p 0 -n 32 -t 2` decode speed; and llama.cpp's own
  KL of each file (`llama-perplexity --kl-divergence` against the float GGUF, 8 chunks of 512 tokens).

    python evals/gguf/compare.py --model smollm2 --work /work/gguf-work --llama-bin /work/llama/build/bin \
        --llama-src /work/llama/src --out evals/gguf/smollm2-135m
    python evals/gguf/compare.py --model ref:small --work /work/gguf-work/small ... --out evals/gguf/ref-small

Steps are cached under --work (a file that exists is not made again). Run it on a machine with little
else running: the timings are upper bounds on a shared machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_tools  # noqa: E402 (llama.cpp's command lines, shared with evals/quality/frontier/frontier.py)

REPO = Path(__file__).resolve().parents[2]
QUANTKIT_CLI = str(Path(sys.executable).parent / "quantkit")  # the command line of this environment
CALIB_TOKENS = 4096
# (row, GGUF type, recipe); each exported with the embedding as stored (auto) and as Q8_0
QUANTKIT = (
    ("quantkit RTN", "Q4_0", "w4a16-rtn-g32", {}),
    ("quantkit RTN absmax/7 (the rule before signed)", "Q4_0", "w4a16-rtn-g32", {"symmetric_scale": "qmax"}),
    ("quantkit GPTQ", "Q4_0", "w4a16-gptq-g32", {}),
    ("quantkit GPTQ absmax/7 start (the rule before signed)", "Q4_0", "w4a16-gptq-g32", {"symmetric_scale": "qmax"}),
    # on llama.cpp's Q4_0 grid with its signed scales (GGUF only): RTN is llama.cpp's rule
    ("quantkit RTN", "Q4_0", "w4a16-rtn-q40", {}),
    ("quantkit GPTQ", "Q4_0", "w4a16-gptq-q40", {}),
    ("quantkit RTN", "Q4_1", "w4a16-rtn-asym-g32", {}),
    ("quantkit GPTQ", "Q4_1", "w4a16-gptq-asym-g32", {}),
    ("quantkit RTN", "Q8_0", "w8a16-rtn-g32", {}),
    ("quantkit GPTQ", "Q8_0", "w8a16-gptq-g32", {}),
    # on llama.cpp's Q4_K grid: no checkpoint (compressed-tensors cannot hold it), quantize writes the GGUF file
    ("quantkit RTN", "Q4_K", "w4a16-rtn-q4k", {}),
    ("quantkit GPTQ", "Q4_K", "w4a16-gptq-q4k", {}),
    ("quantkit AWQ", "Q4_K", "w4a16-awq-q4k", {}),
    # llama-quantize's mixes, tensor by tensor the types of llama.cpp's own Q4_K_M / Q4_K_S file
    ("quantkit RTN", "Q4_K_M", "w4a16-rtn-q4km", {}),
    ("quantkit GPTQ", "Q4_K_M", "w4a16-gptq-q4km", {}),
    ("quantkit AWQ", "Q4_K_M", "w4a16-awq-q4km", {}),
    ("quantkit GPTQ", "Q4_K_S", "w4a16-gptq-q4ks", {}),
    ("quantkit RTN", "Q3_K_M", "w3a16-rtn-q3km", {}),
    ("quantkit GPTQ", "Q3_K_M", "w3a16-gptq-q3km", {}),
    ("quantkit RTN", "Q2_K", "w2a16-rtn-q2k", {}),
    ("quantkit GPTQ", "Q2_K", "w2a16-gptq-q2k", {}),
    # the output head quantized too, by the recipe's algorithm (GPTQ calibrates it), and written once as the tied
    # token_embd (--tie-output): the types llama-quantize gives a tied model's token_embd (Q8_0 in Q8_0 files,
    # Q6_K or its Q8_0 fallback in the mixes), so the same bits
    ("quantkit GPTQ, head GPTQ tied", "Q8_0", "w8a16-gptq-g32", {"head": "tied"}),
    ("quantkit GPTQ, head GPTQ tied", "Q4_K_M", "w4a16-gptq-q4km", {"head": "tied"}),
    ("quantkit GPTQ, head GPTQ tied", "Q4_K_S", "w4a16-gptq-q4ks", {"head": "tied"}),
)
LLAMA_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K_S", "Q4_K_M", "Q3_K_M", "Q2_K")
IMATRIX_TYPES = tuple(t for t in LLAMA_TYPES if t not in llama_tools.IGNORES_IMATRIX)
MIX_TYPES = ("Q4_K_M", "Q4_K_S", "Q3_K_M", "Q2_K")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sh(cmd: list[str], logfile: Path) -> None:
    log(" ".join(cmd))
    with open(logfile, "w") as f:
        run = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if run.returncode:
        raise SystemExit(f"failed ({run.returncode}): {' '.join(cmd)}; see {logfile}")


def float_model(args, work: Path) -> tuple[Path, Path, Path]:
    """(float model folder, calibration text, evaluation text)."""
    if args.model.startswith("smollm2"):
        sys.path.insert(0, str(REPO / "evals" / "quality"))
        import smollm2

        folder = work / "smollm2-float"
        if not (folder / "config.json").is_file():
            smollm2.convert_gguf(folder)
        calib, evaluation = work / "calibration.txt", work / "evaluation.txt"
        if not evaluation.is_file():
            smollm2.write_texts(work)
        if args.model == "smollm2-offgrid":
            sys.path.insert(0, str(REPO / "evals" / "gguf"))
            import offgrid

            moved = work / "smollm2-offgrid"
            if not (moved / "offgrid.json").is_file():
                offgrid.fine_tune(folder, moved)
            folder = moved
        return folder, calib, evaluation
    from quantkit.refmodels import corpus, resolve_model_name

    folder = Path(resolve_model_name(args.model))
    calib, evaluation = work / "calibration.txt", work / "evaluation.txt"
    if not evaluation.is_file():  # the reference models' training text and their held-out text
        calib.write_text(corpus.train_text(2_000_000))
        evaluation.write_text(corpus.heldout_text(2_000_000))
    return folder, calib, evaluation


def calibration_ids(folder: Path, calib: Path, work: Path) -> tuple[torch.Tensor, Path]:
    """The first 4096 tokens of the calibration text ([16, 256]) and the text they decode to (llama-imatrix's)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(calib.read_text(), add_special_tokens=False)["input_ids"][:CALIB_TOKENS]
    text = work / "calibration-4096.txt"
    if not text.is_file():
        text.write_text(tok.decode(ids))
    return torch.tensor(ids).reshape(16, 256), text


def llama_cpp_files(args, work: Path, folder: Path, calib_text: Path) -> dict[str, Path]:
    bins = Path(args.llama_bin)
    files = {}
    src_gguf = work / "float.gguf"
    if not src_gguf.is_file():
        llama_src = args.llama_src if args.model.startswith("smollm2") else None  # ref:small: quantkit's export
        sh(llama_tools.float_gguf_command(folder, src_gguf, llama_src), work / "convert.log")
    imatrix = work / "imatrix.gguf"
    if not imatrix.is_file():
        sh(llama_tools.imatrix_command(bins, src_gguf, calib_text, imatrix), work / "imatrix.log")
    for kind in LLAMA_TYPES:
        if args.types and kind not in args.types:
            continue
        for with_imatrix in (False, True):
            if with_imatrix and kind not in IMATRIX_TYPES:
                continue
            name = f"llama.cpp {kind}" + (", importance matrix" if with_imatrix else "")
            out = work / f"llama-{kind}{'-imatrix' if with_imatrix else ''}.gguf"
            if not out.is_file():
                sh(llama_tools.quantize_command(bins, src_gguf, out, kind, imatrix if with_imatrix else None),
                   work / f"{out.stem}.log")
            files[name] = (kind, out)
    # Q4_K laid out as quantkit's export is (llama_tools.quantkit_layout_q4k_command): the same types tensor by tensor
    for with_imatrix in (False, True) if not args.types or "Q4_K" in args.types else ():
        name = "llama.cpp Q4_K in quantkit's layout" + (", importance matrix" if with_imatrix else "")
        out = work / f"llama-Q4_K-quantkit-layout{'-imatrix' if with_imatrix else ''}.gguf"
        if not out.is_file():
            sh(llama_tools.quantkit_layout_q4k_command(bins, src_gguf, out, folder, args.embedding,
                                                       imatrix if with_imatrix else None), work / f"{out.stem}.log")
        files[name] = ("Q4_K", out)
    return files


def quantkit_files(args, work: Path, folder: Path, calib_ids: torch.Tensor) -> dict[str, tuple[str, Path, float]]:
    import quantkit
    from quantkit.gguf.writing import export_gguf
    from quantkit.formats.loading import load_float_model

    files = {}
    in_memory = {}  # Q4_K-grid recipes: slug -> the quantized model
    for (row, kind, recipe_name, overrides), float_type in [(v, t) for v in QUANTKIT for t in ("auto", args.embedding)]:
        tied_head = overrides.get("head") == "tied"
        overrides = {k: v for k, v in overrides.items() if k != "head"}
        if float_type != "auto" and (overrides or tied_head):
            continue  # ablations and tied heads: one row each, the embedding as the row says
        if overrides and args.no_ablations:
            continue
        if tied_head and not json.loads((folder / "config.json").read_text()).get("tie_word_embeddings"):
            continue
        if args.only_recipes and recipe_name not in args.only_recipes.split(","):
            continue
        if args.types and kind not in args.types:
            continue
        if float_type != "auto" and args.no_ablations and recipe_name not in (
                "w4a16-gptq-g32", "w8a16-rtn-g32", "w8a16-gptq-g32", "w4a16-gptq-q4k", "w4a16-gptq-q40"):
            continue  # the embedding as Q8_0 only for the rows the speed comparison reads
        mix = quantkit.load_recipe(recipe_name).mix
        if mix is not None and float_type != "auto":
            continue  # a mix's "auto" is llama-quantize's own embedding and output types
        slug = recipe_name + "".join(f"-{k}-{v}" for k, v in overrides.items()) + ("-head-tied" if tied_head else "")
        ckpt = work / "checkpoints" / slug
        out = work / f"quantkit-{slug}{'' if float_type == 'auto' else '-emb-' + float_type}.gguf"
        info = work / f"quantkit-{slug}.json"
        grid = quantkit.load_recipe(recipe_name).weights.grid
        if grid != "uniform" and not out.is_file():  # the GGUF file is the only form: quantize writes it
            if slug not in in_memory:  # once per recipe, written with each embedding type
                log(f"quantize {slug}")
                model = load_float_model(str(folder), dtype=torch.float32)
                start = time.perf_counter()
                r = quantkit.load_recipe(recipe_name)
                r = dataclasses.replace(r, ignore=()) if tied_head else r
                quantkit.quantize(model, r, calib_ids if r.needs_calibration else None, progress=False)
                info.write_text(json.dumps({"quantize_seconds": round(time.perf_counter() - start, 1)}))
                in_memory[slug] = model
            export_gguf(in_memory[slug], folder, out, float_type=float_type, mix=mix, tie_output=tied_head)
        if not out.is_file():
            if not (ckpt / "config.json").is_file():
                log(f"quantize {slug}")
                model = load_float_model(str(folder), dtype=torch.float32)
                start = time.perf_counter()
                r = quantkit.load_recipe(recipe_name)
                r = dataclasses.replace(r, ignore=()) if tied_head else r
                if overrides:
                    r = dataclasses.replace(r, algorithm=dataclasses.replace(
                        r.algorithm, options=dataclasses.replace(r.algorithm.options, **overrides)))
                quantkit.quantize(model, r, calib_ids if r.needs_calibration else None, progress=False)
                seconds = time.perf_counter() - start
                quantkit.save(model, ckpt, force=True,
                              dtype=torch.bfloat16 if args.model.startswith("smollm2") else torch.float16)
                info.write_text(json.dumps({"quantize_seconds": round(seconds, 1)}))
            sh([QUANTKIT_CLI, "export", str(ckpt), "--format", "gguf", "--out", str(out), "--force", "--float-type",
                float_type] + (["--tie-output"] if tied_head else []), work / f"export-{out.stem}.log")
        embedding = "" if float_type == "auto" else f", embedding {float_type}"
        files[f"{row} {kind} ({recipe_name}{embedding})"] = (kind, out, json.loads(info.read_text())["quantize_seconds"])
    return files


def tensor_types(path: Path) -> dict[str, str]:
    """GGUF tensor name -> its ggml type, as the gguf package reads the file."""
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def bench(bins: Path, path: Path, work: Path) -> float | None:
    out = work / f"bench-{path.stem}.json"
    if not out.is_file():
        run = subprocess.run([str(bins / "llama-bench"), "-m", str(path), "-p", "0", "-n", "32", "-t", "2", "-r", "3",
                              "-o", "json"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if run.returncode:
            log(f"llama-bench failed on {path}: {run.stderr[-500:]}")
            return None
        out.write_text(run.stdout)
    data = json.loads(out.read_text())
    return float(data[0]["avg_ts"]) if data else None


def llama_kl(bins: Path, path: Path, work: Path, evaluation: Path) -> float | None:
    """llama.cpp's own KL of a file against the float model (`llama-perplexity --kl-divergence`, base
    log-probs from work/float.gguf, 8 chunks of 512 tokens of the evaluation text, the second half of each
    chunk scored, as llama-perplexity does): its "Mean KLD"."""
    base = work / "kld-base.bin"
    common = ["-f", str(evaluation), "-c", "512", "-b", "512", "--chunks", "8", "-t", "2"]
    if not base.is_file():
        sh([str(bins / "llama-perplexity"), "-m", str(work / "float.gguf"), "--kl-divergence-base", str(base), *common],
           work / "kld-base.log")
    out = work / f"kld-{path.stem}.log"
    for attempt in range(2):  # this ggml build's llama-perplexity now and then exits 0 before its summary (2 threads)
        if not out.is_file():
            sh([str(bins / "llama-perplexity"), "-m", str(path), "--kl-divergence-base", str(base), "--kl-divergence",
                *common], out)
        for line in out.read_text(errors="replace").splitlines():
            if "Mean    KLD:" in line:
                return float(line.split("KLD:")[1].split()[0])
        log(f"no KL summary in {out} (attempt {attempt + 1})")
        out.unlink()
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, smollm2-offgrid or ref:small")
    p.add_argument("--work", required=True)
    p.add_argument("--llama-bin", required=True)
    p.add_argument("--llama-src", default="/work/llama/src")
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--no-llama-kl", action="store_true", help="leave out llama-perplexity's KL column")
    p.add_argument("--embedding", default="q8_0", choices=("q8_0", "q6_k"),
                   help="the second embedding type of each quantkit row: llama-quantize's for the model (Q6_K when "
                        "its width is a multiple of 256, else Q8_0)")
    p.add_argument("--only-recipes", default=None, help="comma-separated quantkit recipes to run (default: all)")
    p.add_argument("--types", default=None, type=lambda s: s.split(","),
                   help="comma-separated GGUF types (Q4_0, Q4_1, Q8_0, Q4_K, Q4_K_M, Q4_K_S, Q3_K_M, Q2_K) whose rows to "
                        "make (default: all)")
    p.add_argument("--no-ablations", action="store_true",
                   help="leave out the rows of the previous scale rule, and the --embedding variant but for GPTQ "
                        "Q4_0 / Q4_K and RTN / GPTQ Q8_0")
    args = p.parse_args()
    torch.set_num_threads(2)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    folder, calib, evaluation = float_model(args, work)
    calib_ids, calib_text = calibration_ids(folder, calib, work)
    variants = {name: (kind, path, None) for name, (kind, path) in llama_cpp_files(args, work, folder, calib_text).items()}
    variants.update(quantkit_files(args, work, folder, calib_ids))

    import quantkit
    from quantkit.harness.eval_text import load_tokenizer, read_eval_tokens
    from quantkit.harness.quality import evaluate_quality, token_windows

    baseline = quantkit.load(str(folder), dtype=torch.float32)
    n_params = sum(t.numel() for t in baseline.state_dict().values() if t.is_floating_point())
    n_params -= baseline.lm_head.weight.numel() if baseline.config.tie_word_embeddings else 0
    ids = read_eval_tokens(load_tokenizer(str(folder)), str(evaluation), 8 * 512).ids
    windows = token_windows(ids, 512, 8 * 512)
    rows = []
    for name, (kind, path, seconds) in variants.items():
        cache = work / f"eval-{path.stem}.json"
        if not cache.is_file():
            log(f"eval {name}")
            model = quantkit.load(path)
            r = evaluate_quality(model, baseline, windows, progress=False)
            cache.write_text(json.dumps(r.to_dict()))
            del model
        r = json.loads(cache.read_text())
        size = path.stat().st_size
        rows.append(dict(variant=name, type=kind, mib=round(size / 2**20, 1), bits_per_weight=round(8 * size / n_params, 2),
                         kl=r["kl_divergence"], top1=r["top1_agreement"], perplexity=r["perplexity"],
                         baseline_perplexity=r["baseline_perplexity"], quantize_seconds=seconds,
                         decode_tokens_per_s=None if args.no_bench else bench(Path(args.llama_bin), path, work),
                         llama_cpp_kl=None if args.no_llama_kl else llama_kl(Path(args.llama_bin), path, work,
                                                                             evaluation)))
        if name.startswith("quantkit") and kind in (*MIX_TYPES, "Q8_0"):  # llama.cpp's types tensor by tensor?
            rows[-1]["same_types_as_llama_cpp"] = tensor_types(path) == tensor_types(variants[f"llama.cpp {kind}"][1])
        log(json.dumps(rows[-1]))
    meta = dict(model=args.model, float_folder=str(folder), eval_windows=int(windows.shape[0]), window=512,
                calibration_tokens=CALIB_TOKENS, cpu=platform.processor() or platform.machine(), torch=torch.__version__)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    lines = ["| type | variant | MiB | bits/weight | KL | KL (llama.cpp) | top-1 | perplexity (float) | decode t/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["type"], r["kl"])):
        tps = f"{r['decode_tokens_per_s']:.1f}" if r["decode_tokens_per_s"] else "-"
        lkl = f"{r['llama_cpp_kl']:.3g}" if r["llama_cpp_kl"] is not None else "-"
        lines.append(f"| {r['type']} | {r['variant']} | {r['mib']} | {r['bits_per_weight']} | {r['kl']:.3g} | {lkl} | "
                     f"{r['top1']:.3f} | {r['perplexity']:.2f} ({r['baseline_perplexity']:.2f}) | {tps} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
