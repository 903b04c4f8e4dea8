"""The quality frontier: KL against bits per weight, one GGUF file per (llama.cpp type, quantkit method).

For one float model and one calibration / evaluation text pair, every built-in recipe that writes one of
llama.cpp's types from Q2_K to Q8_0 with round-to-nearest or GPTQ (TYPES below) is run through the command line
a user has:

    quantkit quantize MODEL --recipe RECIPE [--calib ...] --out WORK/TYPE-METHOD.gguf [--float-type T]
    quantkit eval WORK/TYPE-METHOD.gguf --baseline MODEL --window 512 --max-tokens 4096 --json ...

and each file is measured as it lies on disk (the `gguf` package reads its tensor table):

- file_bytes: the file's size (os.stat), metadata and tokenizer included;
- bits_per_weight: 8 * file_bytes / parameters, where parameters counts every element of every tensor in the
  file (embedding, linears, norms): llama.cpp's own "bits per weight" of a file;
- linear_bits_per_weight: 8 * the data bytes of the decoder blocks' 2-D tensors (the linears the recipe
  quantizes, `blk.N.*.weight` with two dimensions) / their elements: the quantized weights alone.

Writes OUT/frontier.json (the records `quantkit advise --frontier` reads), OUT/frontier.md (the table) and
OUT/frontier.png (KL, log scale, against bits per weight, one line per method). Steps are cached under --work:
a file and its eval JSON that exist are not made again (delete them to remeasure). Run it on a quiet machine
for the quantize seconds to mean anything; every command runs with one thread (OMP_NUM_THREADS=1).

    python evals/quality/frontier/frontier.py --model ref:small --work /tmp/frontier-small \
        --out evals/quality/frontier/ref-small
    python evals/quality/frontier/frontier.py --model /tmp/smollm2-float --texts smollm2 \
        --work /tmp/frontier-smollm2 --out evals/quality/frontier/smollm2-135m
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
QUANTKIT_CLI = [sys.executable, "-m", "quantkit"]  # the command line, in this environment
CALIB_SAMPLES, CALIB_SEQ_LEN = 16, 256  # 4096 calibration tokens, as evals/gguf/
EVAL_WINDOW, EVAL_TOKENS = 512, 4096  # 8 windows of 512 tokens, as evals/gguf/
METHODS = {"rtn": "RTN", "gptq": "GPTQ"}


@dataclass(frozen=True)
class FrontierType:
    """One llama.cpp type (a llama-quantize file type, or one grid everywhere) and the recipes that write it.

    name: the type as llama.cpp names it (str); recipe: the built-in recipe with `{method}` for rtn / gptq (str);
    float_type: `quantize --float-type` for the token embedding / output head (str): `auto` for llama-quantize's
    mixes (their own Q6_K head), else the type llama-quantize gives a tied embedding in that file type."""

    name: str
    recipe: str
    float_type: str


#: in the order they are run (the types people pick first, then the rest)
TYPES = (
    FrontierType("Q2_K", "w2a16-{method}-q2k", "auto"),
    FrontierType("Q3_K_M", "w3a16-{method}-q3km", "auto"),
    FrontierType("Q4_K_M", "w4a16-{method}-q4km", "auto"),
    FrontierType("Q8_0", "w8a16-{method}-g32", "q8_0"),
    FrontierType("Q4_0", "w4a16-{method}-q40", "q6_k"),
    FrontierType("Q3_K_S", "w3a16-{method}-q3ks", "auto"),
    FrontierType("Q3_K_L", "w3a16-{method}-q3kl", "auto"),
    FrontierType("Q4_K_S", "w4a16-{method}-q4ks", "auto"),
    FrontierType("Q4_K", "w4a16-{method}-q4k", "q6_k"),  # every linear Q4_K (llama-quantize --pure)
    FrontierType("Q4_1", "w4a16-{method}-asym-g32", "q6_k"),
    FrontierType("Q5_K_S", "w5a16-{method}-q5ks", "auto"),
    FrontierType("Q5_K_M", "w5a16-{method}-q5km", "auto"),
    FrontierType("Q6_K", "w6a16-{method}-q6k", "auto"),
)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_logged(cmd: list[str], logfile: Path) -> dict:
    """Run `cmd` (one thread), its output to `logfile`; {"wall_seconds", "cpu_seconds"} it took (cpu: user + system
    of the process, which a shared machine's other work, or a pause of the process, does not add to). Exits
    naming the log on failure."""
    log(" ".join(cmd))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(logfile, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}; see {logfile}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_seconds": wall, "cpu_seconds": cpu}


def texts(args, work: Path) -> tuple[list[str], list[str], str, str]:
    """(quantize's calibration options, eval's data options, calibration in words, evaluation in words)."""
    calib_size = ["--calib-samples", str(CALIB_SAMPLES), "--calib-seq-len", str(CALIB_SEQ_LEN)]
    if args.texts == "ref":
        return (["--calib", "ref", *calib_size], [],
                "the reference models' training text (--calib ref), 16 windows of 256 tokens",
                "the reference models' held-out text (eval's default), 8 windows of 512 tokens")
    sys.path.insert(0, str(REPO / "evals" / "quality"))
    import smollm2

    work.mkdir(parents=True, exist_ok=True)
    calib, evaluation = work / "calibration.txt", work / "evaluation.txt"
    if not evaluation.is_file():
        smollm2.write_texts(work)
    return (["--calib", str(calib), *calib_size], ["--data", str(evaluation)],
            "the Python documentation topics (pydoc_data.topics), 16 windows of 256 tokens",
            "Debian's licence texts (" + ", ".join(smollm2.EVAL_FILES) + "), 8 windows of 512 tokens")


def measure_file(path: Path) -> dict:
    """The file's bytes, its parameters and both bits-per-weight figures (see the module docstring)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    file_bytes = path.stat().st_size
    parameters = sum(int(t.n_elements) for t in reader.tensors)
    linears = [t for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    linear_bytes = sum(int(t.n_bytes) for t in linears)
    linear_weights = sum(int(t.n_elements) for t in linears)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"file_bytes": file_bytes, "parameters": parameters, "bits_per_weight": 8 * file_bytes / parameters,
            "linear_bits_per_weight": 8 * linear_bytes / linear_weights, "tensor_types": types}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def measure(args, work: Path, kind: FrontierType, method: str, calib_opts: list[str], data_opts: list[str]) -> dict:
    """Quantize (unless the file and its timing exist), evaluate (unless the file evaluated is this one, by its
    SHA-256) and measure one (type, method): its frontier record (dict)."""
    recipe = kind.recipe.format(method=method)
    out = work / f"{kind.name}-{method}.gguf"
    timing, scores = work / f"{out.stem}.seconds.json", work / f"{out.stem}.eval.json"
    scored = work / f"{out.stem}.eval.sha256"  # the file the eval JSON is of (and the --dtype, unless auto)
    if not (out.is_file() and timing.is_file()):
        cmd = [*QUANTKIT_CLI, "quantize", args.model, "--recipe", recipe, "--out", str(out), "--force"]
        if kind.float_type != "auto":
            cmd += ["--float-type", kind.float_type]
        if method != "rtn":
            cmd += calib_opts
        timing.write_text(json.dumps(run_logged(cmd, work / f"{out.stem}.quantize.log")))
    digest = sha256(out)
    stamp = digest if args.eval_dtype == "auto" else f"{digest} {args.eval_dtype}"
    if not (scores.is_file() and scored.is_file() and scored.read_text().strip() == stamp):
        run_logged([*QUANTKIT_CLI, "eval", str(out), "--baseline", args.model, "--window", str(EVAL_WINDOW),
                    "--max-tokens", str(EVAL_TOKENS), "--dtype", args.eval_dtype, "--json", str(scores), *data_opts],
                   work / f"{out.stem}.eval.log")
        scored.write_text(stamp + "\n")
    result = json.loads(scores.read_text())
    seconds = json.loads(timing.read_text())
    record = {"type": kind.name, "method": METHODS[method], "recipe": recipe, "float_type": kind.float_type,
              **measure_file(out), "sha256": digest, "kl_divergence": result["kl_divergence"],
              "perplexity": result["perplexity"], "baseline_perplexity": result.get("baseline_perplexity"),
              "top1_agreement": result.get("top1_agreement"), "eval_dtype": result.get("dtype"),
              "quantize_seconds": round(seconds["cpu_seconds"], 1),
              "quantize_wall_seconds": round(seconds["wall_seconds"], 1)}
    log(f"{kind.name} {METHODS[method]}: {record['file_bytes']} bytes, {record['bits_per_weight']:.3f} bits/weight, "
        f"KL {record['kl_divergence']:.4g}, {record['quantize_seconds']:.0f} CPU seconds")
    return record


def cpu_name() -> str:
    from quantkit.harness.hardware import cpu_name as name

    return name()


def table(frontier: dict) -> str:
    rows = ["| type | method | recipe | MiB | bytes | bits/weight (file) | bits/weight (linears) | KL | top-1 | "
            "perplexity (float) | quantize seconds |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(frontier["records"], key=lambda r: (r["bits_per_weight"], r["method"])):
        base = f" ({r['baseline_perplexity']:.2f})" if r.get("baseline_perplexity") else ""
        rows.append(f"| {r['type']} | {r['method']} | `{r['recipe']}` | {r['file_bytes'] / 2**20:.2f} | "
                    f"{r['file_bytes']} | {r['bits_per_weight']:.3f} | {r['linear_bits_per_weight']:.3f} | "
                    f"{r['kl_divergence']:.3g} | {r['top1_agreement']:.3f} | {r['perplexity']:.2f}{base} | "
                    f"{r['quantize_seconds']:.0f} |")
    return "\n".join(rows)


def markdown(frontier: dict) -> str:
    return (f"# Quality frontier: {frontier['model']}\n\n"
            f"Made by `{frontier['command']}` on {frontier['cpu']}, one thread per command. Quantize seconds: the CPU "
            f"seconds (user + system) of the `quantkit quantize` process, Python's start and the model's loading "
            f"included (the JSON has the wall seconds too, which other work on the machine stretched). Calibration "
            f"(GPTQ): {frontier['calibration']}. Evaluation: "
            f"{frontier['evaluation']}; KL is KL(float || file) in nats per token, quantkit's eval of the GGUF "
            f"file against the float model, both computed in {eval_dtypes(frontier)}. "
            f"{frontier['bits_per_weight_counted']}\n\n{table(frontier)}\n\n"
            f"![KL against bits per weight](frontier.png)\n")


def eval_dtypes(frontier: dict) -> str:
    """The compute dtype(s) the evals ran in, in words."""
    return " / ".join(sorted({str(r.get("eval_dtype")) for r in frontier["records"]}))


def plot(frontier: dict, out_png: Path) -> None:
    """KL (log scale) against the file's bits per weight: one line per method, the types named along the top."""
    import matplotlib.pyplot as plt

    from quantkit.harness.plots import DPI, STYLE, variant_colors

    methods = sorted({r["method"] for r in frontier["records"]})
    colors = variant_colors([], methods)
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(8, 5))
        for method in methods:
            points = sorted((r["bits_per_weight"], r["kl_divergence"], r["type"])
                            for r in frontier["records"] if r["method"] == method)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=colors[method], label=method)
        # the types along the top, once for both methods (points a few hundredths of a bit apart share a name)
        clusters: list[list[tuple[float, str]]] = []
        for x, name in sorted({(r["bits_per_weight"], r["type"]) for r in frontier["records"]}):
            if clusters and x - clusters[-1][-1][0] < 0.06:
                clusters[-1].append((x, name))
            else:
                clusters.append([(x, name)])
        for cluster in clusters:
            names = "/".join(dict.fromkeys(name for _, name in cluster))
            ax.text(cluster[0][0], 1.01, names, transform=ax.get_xaxis_transform(), rotation=90, fontsize=7,
                    ha="center", va="bottom")
            ax.axvline(cluster[0][0], color="#999999", linewidth=0.5, alpha=0.5)
        ax.set_yscale("log")
        ax.set_xlabel("bits per weight (8 x file bytes / parameters)")
        ax.set_ylabel("KL(float || quantized), nats per token (log)")
        ax.set_title(f"{frontier['model']}: KL against file size, Q2_K to Q8_0 (lower is better)", pad=80)
        ax.legend()
        fig.savefig(out_png, dpi=DPI, bbox_inches="tight")
        plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ref:small", help="float model: ref:NAME or a local folder")
    parser.add_argument("--texts", choices=("ref", "smollm2"), default="ref",
                        help="calibration / evaluation texts: the reference corpus's, or evals/quality/smollm2.py's")
    parser.add_argument("--work", type=Path, required=True, help="folder for the GGUF files, logs and eval JSON")
    parser.add_argument("--out", type=Path, required=True, help="folder for frontier.json, frontier.md, frontier.png")
    parser.add_argument("--types", default="", help="comma-separated subset of: " + ", ".join(t.name for t in TYPES))
    parser.add_argument("--methods", default="rtn,gptq", help="comma-separated subset of: rtn, gptq")
    parser.add_argument("--eval-dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="`quantkit eval --dtype`: auto computes in the float model's dtype (bfloat16 for a bf16 "
                             "model, whose rounding then adds to every KL); float32 measures the quantization alone")
    args = parser.parse_args(argv)
    wanted = {t for t in args.types.split(",") if t}
    unknown = wanted - {t.name for t in TYPES}
    methods = [m for m in args.methods.split(",") if m]
    if unknown or not set(methods) <= set(METHODS):
        parser.error(f"unknown types {sorted(unknown)} or methods {methods}")
    args.work.mkdir(parents=True, exist_ok=True)
    calib_opts, data_opts, calib_words, eval_words = texts(args, args.work)
    records = [measure(args, args.work, kind, method, calib_opts, data_opts)
               for kind in TYPES if not wanted or kind.name in wanted for method in methods]
    from quantkit.files.outputs import atomic_write_text

    frontier = {
        "format": "quantkit-frontier", "version": 1, "model": args.model,
        "command": "python evals/quality/frontier/frontier.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cpu": cpu_name(), "python": platform.python_version(), "calibration": calib_words, "evaluation": eval_words,
        "bits_per_weight_counted": "bits/weight (file) = 8 x the file's bytes (metadata and tokenizer included) / "
                                   "every element of every tensor in it; bits/weight (linears) = 8 x the data bytes "
                                   "of the decoder blocks' 2-D tensors / their elements.",
        "records": records,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "frontier.json", json.dumps(frontier, indent=1) + "\n")
    atomic_write_text(args.out / "frontier.md", markdown(frontier))
    plot(frontier, args.out / "frontier.png")
    log(f"wrote {args.out}/frontier.json, frontier.md, frontier.png")


if __name__ == "__main__":
    main()
