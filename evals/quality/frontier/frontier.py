"""The quality frontier: KL against bits per weight, one GGUF file per (llama.cpp type, method): quantkit's
methods, and llama.cpp's own quantizer beside them.

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

With --llama-bin (a folder holding llama.cpp's llama-quantize and llama-imatrix), llama.cpp's own quantizer
writes the same types from the same float model, scored by the same eval (methods `llama` and
`llama-imatrix`, evals/gguf/llama_tools.py's command lines):

    quantkit export MODEL --format gguf --float-type f32 --out WORK/float.gguf
    llama-imatrix -m WORK/float.gguf -f WORK/calibration-stream.txt -c 512 --chunks 8 -o WORK/imatrix.gguf
    llama-quantize [--imatrix WORK/imatrix.gguf] WORK/float.gguf WORK/TYPE-llama[-imatrix].gguf TYPE 1

(Q4_K: `llama-quantize --pure --token-embedding-type q6_k ... Q4_K_S`, every linear Q4_K as quantkit's file;
Q8_0 takes no importance matrix, so it has no llama-imatrix row). The calibration text is the token stream
`quantize --calib` cuts its 16 windows of 256 from (the same shuffled pieces, seed 0), decoded.

With --autoround-python (the Python of an environment with the `auto-round` package), auto-round's SignRound
tuning and its own GGUF export write the same types (method `auto-round`, autoround_export.py run by that
Python), calibrated on the very token windows GPTQ takes (WORK/calibration-windows.json, written with
quantkit's own sample_token_windows):

    AUTOROUND_PYTHON evals/quality/frontier/autoround_export.py --model MODEL --type TYPE \
        --windows WORK/calibration-windows.json --iters N [--lr LR] --out WORK/TYPE-auto-round.gguf

(Q2_K: auto-round's gguf:q2_k_s, the one Q2_K mix it writes for a dense model; Q4_K, every linear Q4_K, has
no auto-round format and no auto-round row).

Writes OUT/frontier.json (the records `quantkit advise --frontier` reads; it recommends only the quantkit
records, `quantizer` "quantkit"), OUT/frontier.md (the table, and with llama.cpp rows the KL ratio per type)
and OUT/frontier.png (KL, log scale, against bits per weight, one line per method). Steps are cached under
--work: a file and its eval JSON that exist are not made again (delete them to remeasure). --merge keeps the
records of OUT/frontier.json that this run does not measure (a run of some types or methods adds to the
frontier instead of replacing it). Run it on a quiet machine for the quantize seconds to mean anything; every
command runs with one thread (OMP_NUM_THREADS=1).

    python evals/quality/frontier/frontier.py --model ref:small --work /tmp/frontier-small \
        --out evals/quality/frontier/ref-small
    python evals/quality/frontier/frontier.py --model ref:small --work /tmp/frontier-small \
        --out evals/quality/frontier/ref-small --methods llama,llama-imatrix --llama-bin /tmp/llama --merge
    python evals/quality/frontier/frontier.py --model /tmp/smollm2-float --texts smollm2 \
        --work /tmp/frontier-smollm2 --out evals/quality/frontier/smollm2-135m
    python evals/quality/frontier/frontier.py --model /tmp/smollm2-float --texts smollm2 \
        --work /tmp/frontier-smollm2-ar --out /tmp/frontier-smollm2-ar-out --types Q4_K_M \
        --methods auto-round --autoround-python /tmp/ar-venv/bin/python --autoround-iters 50 --autoround-lr 0.005
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

from quantkit.quantization.recipe import builtin_recipes

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
QUANTKIT_CLI = [sys.executable, "-m", "quantkit"]  # the command line, in this environment
CALIB_SAMPLES, CALIB_SEQ_LEN = 16, 256  # 4096 calibration tokens, as evals/gguf/
EVAL_WINDOW, EVAL_TOKENS = 512, 4096  # 8 windows of 512 tokens, as evals/gguf/
METHODS = {"rtn": "RTN", "gptq": "GPTQ", "gptq-refined": "GPTQ refined", "llama": "llama.cpp",
           "llama-imatrix": "llama.cpp+imatrix", "auto-round": "auto-round"}
QUANTKIT_METHODS = ("rtn", "gptq", "gptq-refined")
LLAMA_METHODS = ("llama", "llama-imatrix")  # llama.cpp's llama-quantize (needs --llama-bin)
AUTOROUND_METHODS = ("auto-round",)  # the auto-round package (needs --autoround-python)

sys.path.insert(0, str(REPO / "evals" / "gguf"))
import llama_tools  # noqa: E402 (llama.cpp's command lines, shared with evals/gguf/compare.py)
sys.path.insert(0, str(HERE))
from autoround_export import FORMATS as AUTOROUND_FORMATS  # noqa: E402 (frontier types -> auto-round's formats)


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


def texts(args, work: Path) -> tuple[str, list[str], list[str], str, str]:
    """(the calibration source, quantize's calibration options, eval's data options, calibration in words,
    evaluation in words)."""
    calib_size = ["--calib-samples", str(CALIB_SAMPLES), "--calib-seq-len", str(CALIB_SEQ_LEN)]
    if args.texts == "ref":
        return ("ref", ["--calib", "ref", *calib_size], [],
                "the reference models' training text (--calib ref), 16 windows of 256 tokens",
                "the reference models' held-out text (eval's default), 8 windows of 512 tokens")
    sys.path.insert(0, str(REPO / "evals" / "quality"))
    import smollm2

    work.mkdir(parents=True, exist_ok=True)
    calib, evaluation = work / "calibration.txt", work / "evaluation.txt"
    if not evaluation.is_file():
        smollm2.write_texts(work)
    return (str(calib), ["--calib", str(calib), *calib_size], ["--data", str(evaluation)],
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


class LlamaCpp:
    """llama.cpp's quantizer for one float model: the float GGUF and the importance matrix (made once, cached
    under work), then one llama-quantize command per (type, with or without the matrix)."""

    def __init__(self, args, work: Path, calib_source: str):
        from quantkit.refmodels import resolve_model_name

        self.bins = Path(args.llama_bin)
        self.folder = resolve_model_name(args.model) if args.model.startswith("ref:") else args.model
        self.float_gguf, self.imatrix = work / "float.gguf", work / "imatrix.gguf"
        if not self.float_gguf.is_file():
            run_logged(llama_tools.float_gguf_command(self.folder, self.float_gguf), work / "float.gguf.log")
        if not self.imatrix.is_file():
            text = calibration_stream(self.folder, calib_source, work / "calibration-stream.txt")
            run_logged(llama_tools.imatrix_command(self.bins, self.float_gguf, text, self.imatrix, threads=1),
                       work / "imatrix.log")

    def command(self, kind: FrontierType, method: str, out: Path) -> tuple[list[str], str]:
        """(the llama-quantize command that writes `kind` to `out`, the same without its paths and thread count:
        how the table names it)."""
        imatrix = self.imatrix if method == "llama-imatrix" else None
        if kind.name in llama_tools.FILE_TYPES:
            cmd = llama_tools.quantize_command(self.bins, self.float_gguf, out, kind.name, imatrix, threads=1)
        elif kind.name == "Q4_K":  # every linear Q4_K, the embedding as quantkit's Q4_K file
            cmd = llama_tools.quantkit_layout_q4k_command(self.bins, self.float_gguf, out, self.folder,
                                                          kind.float_type, imatrix, threads=1)
        else:
            raise SystemExit(f"llama-quantize has no file type {kind.name}")
        paths = {str(self.float_gguf), str(out), str(self.imatrix)}
        shown = ["llama-quantize"] + [a for a in cmd[1:-1] if a not in paths]
        return cmd, " ".join(shown)


class AutoRoundTool:
    """auto-round's tuning and GGUF export of one float model (autoround_export.py, run by --autoround-python),
    calibrated on the token windows GPTQ takes (written once under work)."""

    SCRIPT = HERE / "autoround_export.py"

    def __init__(self, args, work: Path, calib_source: str):
        from quantkit.refmodels import resolve_model_name

        self.python, self.iters, self.lr = args.autoround_python, args.autoround_iters, args.autoround_lr
        self.folder = str(resolve_model_name(args.model)) if args.model.startswith("ref:") else args.model
        self.windows = calibration_windows(self.folder, calib_source, work / "calibration-windows.json")
        done = subprocess.run([self.python, "-c", "import auto_round; print(auto_round.__version__)"],
                              capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if done.returncode:
            raise SystemExit(f"--autoround-python {self.python}: cannot import auto_round: "
                             f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
        log(f"auto-round {done.stdout.strip().splitlines()[-1]} ({self.python}), {self.iters} iterations per block, "
            f"learning rate {self.lr or '1 / iterations (its own)'}")

    def command(self, kind: FrontierType, out: Path) -> tuple[list[str], str]:
        """(the command that writes `kind` to `out`, how the table names it: auto-round's format and iterations)."""
        if kind.name not in AUTOROUND_FORMATS:
            raise SystemExit(f"auto-round has no GGUF format for {kind.name}")
        cmd = [self.python, str(self.SCRIPT), "--model", self.folder, "--type", kind.name, "--windows",
               str(self.windows), "--iters", str(self.iters), "--out", str(out)]
        if self.lr is not None:
            cmd[-2:-2] = ["--lr", str(self.lr)]
        lr = "" if self.lr is None else f" lr={self.lr:g}"
        return cmd, f"auto-round {AUTOROUND_FORMATS[kind.name]} iters={self.iters}{lr}"


def calibration_windows(folder: str, source: str, out: Path) -> Path:
    """The 16 windows of 256 token ids `quantkit quantize --calib SOURCE --calib-samples 16 --calib-seq-len 256`
    calibrates on (quantkit's sample_token_windows, seed 0, the model's tokenizer), as a JSON list of lists."""
    if not out.is_file():
        from quantkit.calibration.data import load_texts, sample_token_windows
        from quantkit.files.outputs import atomic_write_text
        from quantkit.harness.eval_text import load_tokenizer

        windows = sample_token_windows(load_texts(source), load_tokenizer(folder), CALIB_SAMPLES, CALIB_SEQ_LEN)
        atomic_write_text(out, json.dumps(windows.tolist()) + "\n")
    return out


def calibration_stream(folder: str, source: str, out: Path) -> Path:
    """The text llama-imatrix reads: the token stream `quantkit quantize --calib SOURCE --calib-samples 16
    --calib-seq-len 256` cuts its windows from (the same shuffled pieces, seed 0: its first 16 x 255 tokens are
    the windows' own, less their BOS), 64 tokens more than the 4096 that 8 chunks of 512 take, decoded."""
    if not out.is_file():
        from quantkit.calibration.data import load_texts, sample_token_windows
        from quantkit.harness.eval_text import load_tokenizer

        tokenizer = load_tokenizer(folder)
        stream = sample_token_windows(load_texts(source), tokenizer, 1, CALIB_SAMPLES * CALIB_SEQ_LEN + 64)[0]
        if tokenizer.bos_token_id is not None and int(stream[0]) == tokenizer.bos_token_id:
            stream = stream[1:]
        out.write_text(tokenizer.decode(stream.tolist()))
    return out


def measure(args, work: Path, kind: FrontierType, method: str, calib_opts: list[str], data_opts: list[str],
            llama: LlamaCpp | None = None, autoround: AutoRoundTool | None = None) -> dict:
    """Quantize (unless the file and its timing exist), evaluate (unless the file evaluated is this one, by its
    SHA-256) and measure one (type, method): its frontier record (dict). quantkit's methods run `quantkit
    quantize`; llama's, `llama-quantize` (through `llama`); auto-round, autoround_export.py (through
    `autoround`)."""
    out = work / f"{kind.name}-{method}.gguf"
    timing, scores = work / f"{out.stem}.seconds.json", work / f"{out.stem}.eval.json"
    scored = work / f"{out.stem}.eval.sha256"  # the file the eval JSON is of (and the --dtype, unless auto)
    if method in QUANTKIT_METHODS:
        recipe = kind.recipe.format(method=method)
        cmd = [*QUANTKIT_CLI, "quantize", args.model, "--recipe", recipe, "--out", str(out), "--force"]
        if kind.float_type != "auto":
            cmd += ["--float-type", kind.float_type]
        if method != "rtn":
            cmd += calib_opts
        fields = {"quantizer": "quantkit", "recipe": recipe, "float_type": kind.float_type}
        made_by = {"command": cmd, "recipe_sha256": sha256(builtin_recipes()[recipe])}
    elif method in AUTOROUND_METHODS:
        cmd, shown = autoround.command(kind, out)
        fields = {"quantizer": "auto-round", "recipe": shown}
        made_by = {"command": cmd}
    else:
        cmd, shown = llama.command(kind, method, out)
        fields = {"quantizer": "llama.cpp", "recipe": shown}
        made_by = {}
    # a file made by another command or recipe text (other iterations, a changed recipe) is made again
    stale = timing.is_file() and any(json.loads(timing.read_text()).get(k) != v for k, v in made_by.items())
    if not (out.is_file() and timing.is_file()) or stale:
        seconds = run_logged(cmd, work / f"{out.stem}.quantize.log")
        timing.write_text(json.dumps({**seconds, **made_by}))
    if method in LLAMA_METHODS:  # the version llama-quantize printed
        quantize_log = (work / f"{out.stem}.quantize.log").read_text(errors="replace")
        fields["llama_cpp_build"] = llama_tools.build_of(quantize_log)
    if method in AUTOROUND_METHODS:  # what autoround_export.py printed last: the version and settings it ran
        quantize_log = (work / f"{out.stem}.quantize.log").read_text(errors="replace").strip().splitlines()
        settings = json.loads(quantize_log[-1])
        fields["auto_round_version"] = settings["auto_round_version"]
        fields["auto_round_settings"] = {k: settings[k] for k in ("format", "iters", "lr", "nsamples", "seqlen",
                                                                  "batch_size", "seed")}
    digest = sha256(out)
    stamp = digest if args.eval_dtype == "auto" else f"{digest} {args.eval_dtype}"
    if not (scores.is_file() and scored.is_file() and scored.read_text().strip() == stamp):
        run_logged([*QUANTKIT_CLI, "eval", str(out), "--baseline", args.model, "--window", str(EVAL_WINDOW),
                    "--max-tokens", str(EVAL_TOKENS), "--dtype", args.eval_dtype, "--json", str(scores), *data_opts],
                   work / f"{out.stem}.eval.log")
        scored.write_text(stamp + "\n")
    result = json.loads(scores.read_text())
    seconds = json.loads(timing.read_text())
    record = {"type": kind.name, "method": METHODS[method], **fields,
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


def by_type(records: list[dict]) -> list[dict]:
    """The records grouped by type (the types in order of their smallest file's bits per weight), each type's
    in METHODS' order."""
    smallest: dict[str, float] = {}
    for r in records:
        smallest[r["type"]] = min(smallest.get(r["type"], r["bits_per_weight"]), r["bits_per_weight"])
    order = list(METHODS.values())
    return sorted(records, key=lambda r: (smallest[r["type"]], r["type"], order.index(r["method"])
                                          if r["method"] in order else len(order), r["method"]))


def is_quantkit(record: dict) -> bool:
    """Whether quantkit wrote the record's file (records written before the `quantizer` key are quantkit's)."""
    return record.get("quantizer", "quantkit") == "quantkit"


def is_llama(record: dict) -> bool:
    """Whether llama.cpp's llama-quantize wrote the record's file."""
    return record.get("quantizer") == "llama.cpp"


def table(frontier: dict) -> str:
    rows = ["| type | method | recipe | MiB | bytes | bits/weight (file) | bits/weight (linears) | KL | top-1 | "
            "perplexity (float) | quantize seconds |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in by_type(frontier["records"]):
        base = f" ({r['baseline_perplexity']:.2f})" if r.get("baseline_perplexity") else ""
        rows.append(f"| {r['type']} | {r['method']} | `{r['recipe']}` | {r['file_bytes'] / 2**20:.2f} | "
                    f"{r['file_bytes']} | {r['bits_per_weight']:.3f} | {r['linear_bits_per_weight']:.3f} | "
                    f"{r['kl_divergence']:.3g} | {r['top1_agreement']:.3f} | {r['perplexity']:.2f}{base} | "
                    f"{r['quantize_seconds']:.0f} |")
    return "\n".join(rows)


def ratio_table(frontier: dict) -> str:
    """Per type with quantkit and llama.cpp records: quantkit's lowest KL against llama.cpp's, with and without
    the importance matrix ("" where the frontier has no llama.cpp record)."""
    types = dict.fromkeys(r["type"] for r in by_type(frontier["records"]))
    rows = ["| type | quantkit best (MiB) | llama.cpp (MiB) | llama.cpp+imatrix (MiB) | quantkit best / "
            "llama.cpp+imatrix | quantkit best / llama.cpp's best |", "|---|---:|---:|---:|---:|---:|"]
    for kind in types:
        ours = [r for r in frontier["records"] if r["type"] == kind and is_quantkit(r)]
        theirs = {r["method"]: r for r in frontier["records"] if r["type"] == kind and is_llama(r)}
        if not ours or not theirs:
            continue
        best = min(ours, key=lambda r: r["kl_divergence"])
        plain, imatrix = theirs.get(METHODS["llama"]), theirs.get(METHODS["llama-imatrix"])
        their_best = min(theirs.values(), key=lambda r: r["kl_divergence"])

        def cell(r: dict | None) -> str:
            return "-" if r is None else f"{r['kl_divergence']:.3g} ({r['file_bytes'] / 2**20:.2f})"

        versus_imatrix = f"{best['kl_divergence'] / imatrix['kl_divergence']:.2f}x" if imatrix else "-"
        rows.append(f"| {kind} | {best['kl_divergence']:.3g} ({best['method']}, {best['file_bytes'] / 2**20:.2f}) | "
                    f"{cell(plain)} | {cell(imatrix)} | {versus_imatrix} | "
                    f"{best['kl_divergence'] / their_best['kl_divergence']:.2f}x ({their_best['method']}) |")
    return "\n".join(rows) if len(rows) > 2 else ""


def markdown(frontier: dict) -> str:
    commands = " then (merged) ".join(f"`{c}`" for c in frontier["commands"])
    llama = [r for r in frontier["records"] if is_llama(r)]
    llama_words = ""
    if llama:
        builds = ", ".join(sorted({str(r.get("llama_cpp_build")) for r in llama}))
        llama_words = (f" llama.cpp rows: `llama-quantize` (llama.cpp {builds}) of the float model as `quantkit "
                       f"export --float-type f32` writes it, with one thread, its quantize seconds the CPU seconds of "
                       f"that process; llama.cpp+imatrix: with `--imatrix` of `llama-imatrix` on the calibration "
                       f"tokens GPTQ takes (8 chunks of 512; its own seconds not counted). Q8_0 takes no importance "
                       f"matrix.")
    autoround = [r for r in frontier["records"] if r.get("quantizer") == "auto-round"]
    if autoround:
        versions = ", ".join(sorted({str(r.get("auto_round_version")) for r in autoround}))
        llama_words += (f" auto-round rows: the `auto-round` package ({versions}), its SignRound tuning (the "
                        f"iterations per block in the recipe column) on the calibration windows GPTQ takes, then its "
                        f"own GGUF export (evals/quality/frontier/autoround_export.py), with one thread; its quantize "
                        f"seconds the CPU seconds of that process (Q2_K: auto-round's gguf:q2_k_s mix).")
    ratios = ratio_table(frontier)
    ratios = (f"\n\nquantkit's lowest KL at each type (of any of its methods) over llama.cpp's, file sizes in MiB in "
              f"parentheses:\n\n{ratios}") if ratios else ""
    return (f"# Quality frontier: {frontier['model']}\n\n"
            f"Made by {commands} on {frontier['cpu']}, one thread per command. Quantize seconds: the CPU "
            f"seconds (user + system) of the `quantkit quantize` process, Python's start and the model's loading "
            f"included (the JSON has the wall seconds too, which other work on the machine stretched). Calibration "
            f"(GPTQ): {frontier['calibration']}. Evaluation: "
            f"{frontier['evaluation']}; KL is KL(float || file) in nats per token, quantkit's eval of the GGUF "
            f"file against the float model, both computed in {eval_dtypes(frontier)}. "
            f"{frontier['bits_per_weight_counted']}{llama_words}\n\n{table(frontier)}{ratios}\n\n"
            f"![KL against bits per weight](frontier.png)\n")


def eval_dtypes(frontier: dict) -> str:
    """The compute dtype(s) the evals ran in, in words."""
    return " / ".join(sorted({str(r.get("eval_dtype")) for r in frontier["records"]}))


def plot(frontier: dict, out_png: Path) -> None:
    """KL (log scale) against the file's bits per weight: one line per method, the types named along the top."""
    import matplotlib.pyplot as plt

    from quantkit.harness.plots import DPI, STYLE, variant_colors

    methods = list(dict.fromkeys(r["method"] for r in by_type(frontier["records"])))
    methods.sort(key=lambda m: list(METHODS.values()).index(m) if m in METHODS.values() else len(METHODS))
    colors = variant_colors([], methods)
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(8, 5))
        for method in methods:
            points = sorted((r["bits_per_weight"], r["kl_divergence"], r["type"], is_quantkit(r))
                            for r in frontier["records"] if r["method"] == method)
            ours = all(p[3] for p in points)  # llama.cpp's lines dashed, its points hollow
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o" if ours else "s",
                    markersize=6 if ours else 8, linestyle="-" if ours else "--", zorder=3 if ours else 2,
                    markerfacecolor=colors[method] if ours else "none", color=colors[method], label=method)
        # the types along the top, once for every method (points a few hundredths of a bit apart share a name)
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


def merged(frontier: dict, previous_path: Path) -> dict:
    """`frontier` with the records of the frontier at `previous_path` that it does not measure (by type and
    method) kept as they are, and that frontier's commands before its own."""
    previous = json.loads(previous_path.read_text())
    if previous.get("model") != frontier["model"]:
        raise SystemExit(f"--merge: {previous_path} is of {previous.get('model')}, not {frontier['model']}")
    measured = {(r["type"], r["method"]) for r in frontier["records"]}
    kept = [r for r in previous["records"] if (r["type"], r["method"]) not in measured]
    commands = previous.get("commands") or [previous["command"]]
    cpus = " / ".join(c for c in dict.fromkeys([*previous.get("cpu", "").split(" / "), frontier["cpu"]]) if c)
    for key in ("calibration", "evaluation"):
        if previous.get(key) != frontier[key]:
            raise SystemExit(f"--merge: {previous_path} has another {key} ({previous.get(key)!r})")
    return {**frontier, "commands": list(dict.fromkeys([*commands, *frontier["commands"]])), "cpu": cpus,
            "records": kept + frontier["records"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ref:small", help="float model: ref:NAME or a local folder")
    parser.add_argument("--texts", choices=("ref", "smollm2"), default="ref",
                        help="calibration / evaluation texts: the reference corpus's, or evals/quality/smollm2.py's")
    parser.add_argument("--work", type=Path, required=True, help="folder for the GGUF files, logs and eval JSON")
    parser.add_argument("--out", type=Path, required=True, help="folder for frontier.json, frontier.md, frontier.png")
    parser.add_argument("--types", default="", help="comma-separated subset of: " + ", ".join(t.name for t in TYPES))
    parser.add_argument("--methods", default="rtn,gptq,gptq-refined",
                        help="comma-separated subset of: " + ", ".join(METHODS) + " (llama, llama-imatrix: "
                             "llama.cpp's llama-quantize without and with an importance matrix; need --llama-bin; "
                             "auto-round: the auto-round package, needs --autoround-python)")
    parser.add_argument("--llama-bin", default=None,
                        help="folder with llama.cpp's llama-quantize and llama-imatrix (.ci/llama_cpp_build)")
    parser.add_argument("--autoround-python", default=None,
                        help="the Python of an environment with the auto-round package (method auto-round; see "
                             "the README's auto-round section)")
    parser.add_argument("--autoround-iters", type=int, default=200,
                        help="auto-round's SignRound iterations per block (its default 200; its light recipe: 50, "
                             "with --autoround-lr 0.005)")
    parser.add_argument("--autoround-lr", type=float, default=None,
                        help="auto-round's learning rate (default: its own, 1 / iterations)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the records of OUT/frontier.json that this run does not measure")
    parser.add_argument("--eval-dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="`quantkit eval --dtype`: auto computes in the float model's dtype (bfloat16 for a bf16 "
                             "model, whose rounding then adds to every KL); float32 measures the quantization alone")
    args = parser.parse_args(argv)
    wanted = {t for t in args.types.split(",") if t}
    unknown = wanted - {t.name for t in TYPES}
    methods = [m for m in args.methods.split(",") if m]
    if unknown or not set(methods) <= set(METHODS):
        parser.error(f"unknown types {sorted(unknown)} or methods {methods}")
    if set(methods) & set(LLAMA_METHODS) and args.llama_bin is None:
        parser.error("methods llama and llama-imatrix need --llama-bin DIR (llama-quantize and llama-imatrix)")
    if set(methods) & set(AUTOROUND_METHODS) and args.autoround_python is None:
        parser.error("method auto-round needs --autoround-python PYTHON (an environment with auto-round)")
    if args.merge and not (args.out / "frontier.json").is_file():
        parser.error(f"--merge: no {args.out / 'frontier.json'} to merge into")
    args.work.mkdir(parents=True, exist_ok=True)
    calib_source, calib_opts, data_opts, calib_words, eval_words = texts(args, args.work)
    llama = LlamaCpp(args, args.work, calib_source) if set(methods) & set(LLAMA_METHODS) else None
    autoround = AutoRoundTool(args, args.work, calib_source) if set(methods) & set(AUTOROUND_METHODS) else None
    records = [measure(args, args.work, kind, method, calib_opts, data_opts, llama, autoround)
               for kind in TYPES if not wanted or kind.name in wanted for method in methods
               if not (method == "llama-imatrix" and kind.name in llama_tools.IGNORES_IMATRIX)
               and not (method in AUTOROUND_METHODS and kind.name not in AUTOROUND_FORMATS)]
    from quantkit.files.outputs import atomic_write_text

    frontier = {
        "format": "quantkit-frontier", "version": 1, "model": args.model,
        "commands": ["python evals/quality/frontier/frontier.py " + " ".join(argv if argv is not None
                                                                              else sys.argv[1:])],
        "cpu": cpu_name(), "python": platform.python_version(), "calibration": calib_words, "evaluation": eval_words,
        "bits_per_weight_counted": "bits/weight (file) = 8 x the file's bytes (metadata and tokenizer included) / "
                                   "every element of every tensor in it; bits/weight (linears) = 8 x the data bytes "
                                   "of the decoder blocks' 2-D tensors / their elements.",
        "records": records,
    }
    if args.merge:
        frontier = merged(frontier, args.out / "frontier.json")
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "frontier.json", json.dumps(frontier, indent=1) + "\n")
    atomic_write_text(args.out / "frontier.md", markdown(frontier))
    plot(frontier, args.out / "frontier.png")
    log(f"wrote {args.out}/frontier.json, frontier.md, frontier.png")


if __name__ == "__main__":
    main()
