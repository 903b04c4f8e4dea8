"""Peak anonymous memory of `quantkit quantize` against depth, random bf16 Llamas, as a user runs it.

    python evals/calibration/memory_depth.py --layers 2,4 --recipe w4a16-gptq
    python evals/calibration/memory_depth.py --layers 2,4 --recipe w4a16-rtn --json out.json
    python evals/calibration/memory_depth.py --layers 2,4 --keep-freed-pages   # without malloc_trim

Each depth: a random Llama (bf16 safetensors, ref:tiny's tokenizer) saved to a temporary folder, then
`quantkit quantize FOLDER --recipe R --out OUT --calib ref --calib-samples N --calib-seq-len L` run as a
child process whose RssAnon (/proc/PID/status: heap and tensors, not the file pages of memory-mapped
weights) is sampled every 5 ms. `per layer %` is the growth of the peak per added decoder layer as a
percentage of that layer's bf16 bytes: 0% when the pipeline holds one block at a time.
--quantize-only measures inside one process around `quantkit.quantize` alone (the bf16 model loaded with
quantkit.formats.loading.load_float_model first, RssAnon sampled every 3 ms by a thread): the whole command's peak
also holds the load and the save, and moves by tens of MB between runs.
--keep-freed-pages runs the same command with quantkit.calibration.offload.release_freed_memory a no-op
(glibc keeps freed heap pages), the behaviour the trimming after each layer and block removes.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 1e6
# `quantkit` in this interpreter, glibc's trimming disabled when argv[1] is "keep"
CLI = ("import sys; import quantkit.calibration.offload as o; from quantkit.commands.cli import main\n"
       "if sys.argv.pop(1) == 'keep': o._libc_malloc_trim = lambda: None\n"
       "sys.exit(main(sys.argv[1:]))")
# quantkit.quantize alone in this interpreter: argv keep|trim FOLDER RECIPE SAMPLES SEQ_LEN; prints the peak
QUANTIZE_ONLY = (
    "import json, sys, threading, time\n"
    "import quantkit, quantkit.calibration.offload as o\n"
    "from quantkit.calibration import CalibrationConfig\n"
    "from quantkit.formats.loading import load_float_model\n"
    "if sys.argv[1] == 'keep': o._libc_malloc_trim = lambda: None\n"
    "def anon():\n"
    "    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('RssAnon:'))\n"
    "model = load_float_model(sys.argv[2])\n"
    "peak, done = [anon()], []\n"
    "def sample():\n"
    "    while not done:\n"
    "        peak[0] = max(peak[0], anon()); time.sleep(0.003)\n"
    "sampler = threading.Thread(target=sample); sampler.start()\n"
    "quantkit.quantize(model, sys.argv[3], CalibrationConfig(source='ref', num_samples=int(sys.argv[4]), "
    "seq_len=int(sys.argv[5])), progress=False)\n"
    "done.append(1); sampler.join()\n"
    "print(json.dumps({'peak': peak[0]}))\n")
TINY = Path(__file__).resolve().parents[2] / "quantkit" / "refmodels" / "weights" / "tiny"


def rss_anon(pid: int) -> int | None:
    """RssAnon of process `pid` in bytes (None once it has exited)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def save_model(folder: Path, layers: int, hidden: int, intermediate: int, vocab: int,
               kv_heads: int | None = None) -> int:
    """Save a random bf16 Llama in `folder` with ref:tiny's tokenizer, one shard per decoder layer, written
    tensor by tensor (an 8B-shaped model never sits in memory); returns one decoder layer's bf16 bytes.
    Weights are normal(0, 0.02) as transformers initialises a Llama, norms 1."""
    import torch
    import transformers

    from quantkit.formats.safetensors_io import INDEX_FILE, save_safetensors_file

    heads = hidden // 64
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads or heads, vocab_size=vocab,
        max_position_embeddings=2048, tie_word_embeddings=False, dtype="bfloat16")
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in transformers.LlamaForCausalLM(config).state_dict().items()}
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, folder / name)
    shard_of = {n: (n.split(".")[2] if n.startswith("model.layers.") else "rest") for n in shapes}
    shards = sorted(set(shard_of.values()), key=lambda k: (k == "rest", int(k) if k.isdigit() else 0))
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in (n for n in shapes if shard_of[n] == shard):
            shape = shapes[name]
            tensors[name] = (torch.ones(shape) if "norm" in name else
                             torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
            weight_map[name] = file
        save_safetensors_file(tensors, folder / file)
        del tensors
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return sum(math.prod(shape) * 2 for n, shape in shapes.items() if n.startswith("model.layers.0."))


def measure(folder: Path, out: Path, recipe: str, samples: int, seq_len: int, keep: bool,
            quantize_only: bool = False) -> tuple[int, float]:
    """Run `quantkit quantize` on `folder` (quantize_only: quantkit.quantize alone); returns (peak RssAnon
    bytes, seconds)."""
    if quantize_only:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", QUANTIZE_ONLY, "keep" if keep else "trim", str(folder), recipe,
                               str(samples), str(seq_len)], capture_output=True, text=True, check=True)
        return json.loads(proc.stdout.strip().splitlines()[-1])["peak"], time.perf_counter() - start
    cmd = [sys.executable, "-c", CLI, "keep" if keep else "trim", "quantize", str(folder), "--recipe", recipe,
           "--out", str(out), "--calib", "ref", "--calib-samples", str(samples), "--calib-seq-len", str(seq_len)]
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    peak = 0
    while child.poll() is None:
        peak = max(peak, rss_anon(child.pid) or 0)
        time.sleep(0.005)
    if child.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited with {child.returncode}")
    return peak, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="2,4")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: as many as query heads)")
    p.add_argument("--work-dir", metavar="DIR", help="where the models and outputs are made, then removed (default: the temporary folder; the 8B shape needs ~25 GB)")
    p.add_argument("--recipe", default="w4a16-gptq")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--keep-freed-pages", action="store_true", help="disable the malloc_trim after each layer/block")
    p.add_argument("--quantize-only", action="store_true", help="measure around quantkit.quantize alone, in one process")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        for depth in (int(d) for d in args.layers.split(",")):
            folder = Path(tmp) / f"llama-{depth}"
            layer_bytes = save_model(folder, depth, args.hidden, args.intermediate, args.vocab, args.kv_heads)
            disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
            peak, seconds = measure(folder, Path(tmp) / f"out-{depth}", args.recipe, args.samples, args.seq_len,
                                   args.keep_freed_pages, args.quantize_only)
            rows.append(dict(layers=depth, recipe=args.recipe, trim=not args.keep_freed_pages,
                             quantize_only=args.quantize_only, layer_bytes=layer_bytes, disk_bytes=disk,
                             peak_bytes=peak, seconds=seconds))
    print(f"| layers | bf16 on disk (MB) | peak RssAnon (MB) | per added layer (% of its bf16 bytes) | time (s) |")
    print("|---:|---:|---:|---:|---:|")
    for prev, row in zip([None] + rows, rows):
        per = "" if prev is None else \
            f"{100 * (row['peak_bytes'] - prev['peak_bytes']) / ((row['layers'] - prev['layers']) * row['layer_bytes']):.0f}%"
        print(f"| {row['layers']} | {row['disk_bytes'] / MB:.0f} | {row['peak_bytes'] / MB:.0f} | {per} "
              f"| {row['seconds']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
