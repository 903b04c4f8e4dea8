"""Peak host memory while quantizing random Llama models of several depths: grows with the block, not the depth.

    python evals/calibration/memory_benchmark.py --layers 4,16                    # models loaded in memory
    python evals/calibration/memory_benchmark.py --layers 4,16 --offload          # every block offloaded to disk
    python evals/calibration/memory_benchmark.py --layers 4,16 --json out.json    # also write the numbers

Each depth is measured in a fresh process that loads a saved random model. Memory is the process's
*anonymous* resident memory (resident minus file-backed pages, /proc/self/statm), sampled every
millisecond during `quantkit.quantize`: file pages of memory-mapped weights are cache the kernel can
drop at any time, anonymous memory is what must fit. `overhead = peak - before quantizing` is what
calibration adds on top of the loaded model (glibc's mmap threshold is fixed, see MMAP_THRESHOLD); one warm-up quantization of a 1-block model runs first,
so that lazily imported code does not count.

With --offload, every decoder block stays on disk (accelerate `device_map` + `offload_folder`): the
peak is then about one float block, the calibration activations and the quantized blocks done so far
(about 1/8 of a float32 block each at 4 bits), whatever the model's size.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
# glibc serves allocations above this size with mmap and returns them to the system on free. Its default
# threshold adapts upwards (to 32 MiB) after large frees, after which freed blocks of a small model stay
# in the heap and RSS measures the allocator's fragmentation rather than live memory. A fixed threshold
# gives the regime of real models, whose tensors are far above 32 MiB anyway.
MMAP_THRESHOLD = 128 * 1024


def anonymous_rss() -> int:
    """Resident bytes not backed by files (heap, tensors), from /proc/self/statm."""
    fields = Path("/proc/self/statm").read_text().split()
    return (int(fields[1]) - int(fields[2])) * PAGE


class PeakSampler:
    """Samples anonymous_rss() every `interval` seconds in a thread while in the `with` block."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, anonymous_rss())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakSampler":
        self.peak = anonymous_rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anonymous_rss())


def make_config(layers: int, hidden: int, intermediate: int, seq_len: int):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128), vocab_size=1024, max_position_embeddings=max(256, seq_len),
        tie_word_embeddings=True,
    )


def save_random_model(folder: Path, layers: int, hidden: int, intermediate: int, seq_len: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(make_config(layers, hidden, intermediate, seq_len)).save_pretrained(folder)


def measure(folder: Path, recipe: str, offload: bool, samples: int, seq_len: int) -> dict:
    """Load the model saved in `folder` and quantize it, measuring anonymous memory."""
    import torch
    import transformers

    import quantkit

    torch.set_num_threads(1)
    config = transformers.AutoConfig.from_pretrained(folder)
    batches = [torch.randint(0, 1024, (1, seq_len), generator=torch.Generator().manual_seed(i)) for i in range(samples)]

    warm = transformers.LlamaForCausalLM(make_config(1, 128, 384, seq_len)).eval()
    quantkit.quantize(warm, recipe, calibration_data=batches, progress=False)
    del warm
    gc.collect()

    if offload:
        device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
        device_map.update({f"model.layers.{i}": "disk" for i in range(config.num_hidden_layers)})
        offload_dir = tempfile.mkdtemp(prefix="offload-")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, device_map=device_map, offload_folder=offload_dir, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    block = model.model.layers[0]
    block_bytes = sum(p.numel() * 4 for p in block.parameters())
    model_bytes = sum(p.numel() * 4 for p in transformers.LlamaForCausalLM(config).parameters()) if offload else \
        sum(p.numel() * p.element_size() for p in model.parameters())
    before = anonymous_rss()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        quantkit.quantize(model, recipe, calibration_data=batches, progress=False)
    seconds = time.perf_counter() - start
    activations = samples * seq_len * config.hidden_size * 4
    return dict(layers=config.num_hidden_layers, hidden=config.hidden_size, intermediate=config.intermediate_size,
                recipe=recipe, offload=offload, model_mib=model_bytes / MIB, block_mib=block_bytes / MIB,
                activations_mib=activations / MIB, before_mib=before / MIB, peak_mib=sampler.peak / MIB,
                overhead_mib=(sampler.peak - before) / MIB, seconds=seconds)


def run(layers: list[int], *, hidden: int = 512, intermediate: int = 1536, recipe: str = "w4a16-gptq",
        offload: bool = False, samples: int = 8, seq_len: int = 256, one_process: bool = False) -> list[dict]:
    """Measure each depth in a fresh process (one_process: all depths in one process, deepest first, which
    saves the start-up time and can only favour the shallower models); returns one result per depth."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = []
        for depth in layers:
            folder = Path(tmp) / f"llama-{depth}"
            save_random_model(folder, depth, hidden, intermediate, seq_len)
            folders.append(str(folder))
        groups = [sorted(folders, key=lambda f: -int(f.rsplit("-", 1)[1]))] if one_process else [[f] for f in folders]
        for group in groups:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, os.path.abspath(__file__), "--measure", ",".join(group), "--json", str(out),
                   "--recipe", recipe, "--samples", str(samples), "--seq-len", str(seq_len)]
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
            subprocess.run(cmd + (["--offload"] if offload else []), check=True, env=env)
            for r in json.loads(out.read_text()):
                results[r["layers"]] = r
    return [results[d] for d in layers]


def markdown(results: list[dict]) -> str:
    lines = ["| layers | model fp32 (MiB) | one block (MiB) | activations (MiB) | before (MiB) | peak (MiB) "
             "| peak - before (MiB) | time (s) |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['layers']} | {r['model_mib']:.0f} | {r['block_mib']:.1f} | {r['activations_mib']:.1f} "
                     f"| {r['before_mib']:.0f} | {r['peak_mib']:.0f} | {r['overhead_mib']:.0f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="4,16", help="comma-separated depths (default: 4,16)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--recipe", default="w4a16-gptq")
    p.add_argument("--samples", type=int, default=8, help="calibration windows (default: 8)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window (default: 256)")
    p.add_argument("--offload", action="store_true", help="load the model with every block offloaded to disk")
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--measure", metavar="FOLDER", help=argparse.SUPPRESS)  # internal: one measurement
    args = p.parse_args(argv)
    if args.measure:
        results = []
        for folder in args.measure.split(","):
            results.append(measure(Path(folder), args.recipe, args.offload, args.samples, args.seq_len))
            gc.collect()
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        return 0
    results = run([int(d) for d in args.layers.split(",")], hidden=args.hidden, intermediate=args.intermediate,
                  recipe=args.recipe, offload=args.offload, samples=args.samples, seq_len=args.seq_len)
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
