"""What the size of CpuDecoder's cache blocks costs: the decode attention alone and the whole W4 decode step of
SmolLM2-135M at batch 1, for a bf16 and an fp8 cache, in blocks of 256 and 1024 positions; and the attention
with a cache per kv head in blocks of 256 that are separate tensors or slices of one tensor laid end to end in
memory (what a jump between blocks costs); side by side in one run.

    python evals/kv_cache/cpu_loop/cache_blocks.py FLOAT_FOLDER --out evals/kv_cache/cpu_loop/cache-blocks-epyc \
        --contexts 2048,8000 --threads 1 --repeats 41

FLOAT_FOLDER: SmolLM2-135M-Instruct as a bf16 folder (evals/quality/smollm2.py's convert_gguf makes it). The
caches hold random values (time does not depend on them), fp8 with scales of 1.0. Repeats interleave every
configuration; figures are medians of the wall time (with one thread: of the thread's CPU time).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from quantkit.files.outputs import write_output_file
from quantkit.harness.hardware import cpu_name
from quantkit.kernels.cpu_extension import ISA_NAMES, cpu_kernel_isa
from measure import decoder_at, load_variants, timed  # this folder's measure.py (the script's folder is on sys.path)

CACHES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
BLOCKS = (256, 1024)


def attention(config, cache: str, block: int, context: int, per_head: bool, adjacent: bool = False):
    """The op over every layer's blocks (the decoder's layout); per_head: one cache per kv head (the same work in
    3x the calls), whose blocks are, with adjacent, slices of one tensor end to end in memory."""
    layers, heads, head_dim = config.num_hidden_layers, config.num_attention_heads, config.hidden_size // config.num_attention_heads
    hkv = 1 if per_head else config.num_key_value_heads
    group = heads // config.num_key_value_heads
    n, dtype, g = -(-(context + 1) // block), CACHES[cache], torch.Generator().manual_seed(context)
    caches = []
    for _ in range(layers * (config.num_key_value_heads if per_head else 1)):
        if adjacent:
            k = torch.randn(n * block // 16, head_dim, 16, generator=g).clamp(-8, 8).to(dtype)
            v = torch.randn(n * block, head_dim, generator=g).clamp(-8, 8).to(dtype)
            caches.append(([k[j * block // 16:(j + 1) * block // 16].view(1, 1, block // 16, head_dim, 16) for j in range(n)],
                           [v[j * block:(j + 1) * block].view(1, 1, block, head_dim) for j in range(n)]))
        else:
            caches.append(([torch.randn(1, hkv, block // 16, head_dim, 16, generator=g).clamp(-8, 8).to(dtype)
                            for _ in range(n)],
                           [torch.randn(1, hkv, block, head_dim, generator=g).clamp(-8, 8).to(dtype) for _ in range(n)]))
    q, one, lengths = torch.randn(1, hkv * group, head_dim, generator=g), torch.ones(1), torch.tensor([context + 1])
    isa = ISA_NAMES.index(cpu_kernel_isa())

    def run():
        for k, v in caches:
            torch.ops.quantkit.decode_attention_cpu(q, k, v, [], [], one, one, lengths, head_dim ** -0.5, 0, isa)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default="2048,8000")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model = load_variants(args.model, Path(tmp))["w4a16-rtn"]
    rows = []
    for context in [int(x) for x in args.contexts.split(",")]:
        print(f"context {context}", flush=True)
        runs = {}
        for cache in CACHES:
            for block in BLOCKS:
                runs[("attention", cache, f"{block}")] = attention(model.config, cache, block, context, False)
            runs[("attention, a cache per kv head", cache, "256")] = attention(model.config, cache, 256, context, True)
            runs[("attention, a cache per kv head", cache, "256 end to end")] = attention(
                model.config, cache, 256, context, True, adjacent=True)
            for block in BLOCKS:
                runs[("W4 decode step", cache, f"{block}")] = decoder_at(model, cache, context, context, cpu_kernel_isa(),
                                                                        cache_block=block)[1]
        cpu, wall = timed(runs, args.repeats)
        for (what, cache, block), seconds in (cpu if args.threads == 1 else wall).items():
            rows.append((context, what, cache, block, seconds * 1e3))
    base = {(c, w, k): ms for c, w, k, b, ms in rows if b == "256"}
    lines = [f"# CpuDecoder's cache blocks: 256 against 1024 positions, {args.threads} thread(s): {cpu_name()}", "",
             f"Medians of {args.repeats} repeats (ms; {'thread CPU time' if args.threads == 1 else 'wall time'}). "
             f"Load average before the run: {load_before:.2f}. The attention rows are the op alone over 30 layers; "
             "the rows of a cache per kv head split the kv heads into separate caches (the same work in 3x the "
             "calls), whose blocks are separate tensors or, end to end, slices of one tensor adjacent in memory.", "",
             "| context | what | cache | block | ms | vs blocks of 256 |", "|---:|---|---|---|---:|---:|"]
    for context, what, cache, block, ms in rows:
        lines.append(f"| {context} | {what} | {cache} | {block} | {ms:.2f} | {base[(context, what, cache)] / ms:.2f}x |")
    ms_of = {(c, w, k, b): ms for c, w, k, b, ms in rows}
    lines += ["", "The fp8 cache against the bf16 cache (bf16 ms / fp8 ms):", ""]
    for context, what, cache, block, _ in rows:
        if cache != "bf16":
            continue
        ratio = ms_of[(context, what, "bf16", block)] / ms_of[(context, what, "fp8", block)]
        lines.append(f"- context {context}, {what}, blocks of {block}: {ratio:.2f}x")
    lines += ["", "Command: `python evals/kv_cache/cpu_loop/cache_blocks.py FLOAT_FOLDER --out OUT "
              f"--contexts {args.contexts} --threads {args.threads} --repeats {args.repeats}`"]
    text = "\n".join(lines) + "\n"
    print(text)
    write_output_file(Path(args.out) / "README.md", text)


if __name__ == "__main__":
    main()
