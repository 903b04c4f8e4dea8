"""Decode speed inside vLLM on CPU: quantkit W4 / W8 checkpoints (quantkit's plugin kernel) against
vLLM's own unquantized bf16 and fp32, at batch 1 and 8, on a random ~1B Llama.

    OMP_NUM_THREADS=2 VLLM_ENABLE_V1_MULTIPROCESSING=0 python evals/engines/vllm_decode_cpu.py \\
        --work /tmp/vllm-bench --out evals/engines

(run with a Python that has vLLM's CPU build and quantkit installed: `pip install -e '.[vllm]'`, then
`pip uninstall -y torchvision torchaudio torchcodec`). Writes vllm_decode_cpu.{json,md}.

The model: ``evals/configs/llama-1b-random.json`` (hidden 2048, intermediate 5632, 16 layers, 32 heads,
8 KV heads, vocab 32000), random-initialised (speed does not depend on the values), saved in bf16;
W4 (``w4a16-rtn``: int4, groups of 128) and W8 (``w8a16-rtn``: int8 per channel) checkpoints made from
it by ``quantkit.quantize`` + ``quantkit.save`` (lm_head stays bf16). Each variant is one
``vllm.LLM`` (eager mode, token-id prompts, no tokenizer); the quantized ones run in bf16 through
``QuantkitWNA16LinearKernel`` (asserted from vLLM's own record of the kernel it chose).

Measurement: for each batch size B, B random prompts of ``--prompt-len`` tokens are generated greedily
with ``ignore_eos`` twice: 1 token (prefill only) and 1 + ``--new-tokens`` tokens; one decode step is
(t_long - t_short) / new_tokens, the median over ``--repeats`` pairs after a warm-up. tokens/s = B /
step. A variant whose first step (1 vs 2 tokens, the warm-up) takes over ``--max-step-s`` is timed on
that step alone (the table says so): vLLM's bf16 linears at batch 8 on CPUs that emulate bf16 GEMMs
(no avx512_bf16 / AMX) take tens of seconds per step. The baseline is the faster of bf16 and fp32 at each batch size; every variant's ratio to it is
printed side by side. fp32 runs with vLLM's default cache dtype for the model (timing only: vLLM with a
float32 model gives wrong tokens on AVX2 CPUs); the `-fp32` quantized variants run the model in fp32 around
quantkit's kernel, which rounds its activations to bf16 (as `quantkit.load(backend="auto")` does).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from quantkit.harness.hardware import cpu_name
from quantkit.files.outputs import atomic_write_text

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {  # name -> (recipe or None for the float model, vLLM dtype)
    "bf16": (None, "bfloat16"),
    "fp32": (None, "float32"),
    "w8a16": ("w8a16-rtn", "bfloat16"),
    "w4a16": ("w4a16-rtn", "bfloat16"),
    "w8a16-fp32": ("w8a16-rtn", "float32"),  # quantkit's kernel with activations rounded to bf16 in the linears
    "w4a16-fp32": ("w4a16-rtn", "float32"),
}
KERNEL = "QuantkitWNA16LinearKernel"


def build_checkpoints(config_path: Path, work: Path) -> dict[str, Path]:
    """The random bf16 float folder and one quantkit checkpoint per recipe (kept in ``work`` for reruns)."""
    import transformers

    import quantkit

    float_dir = work / "float-bf16"
    if not (float_dir / "config.json").exists():
        config = transformers.LlamaConfig(**{k: v for k, v in json.loads(config_path.read_text()).items()
                                             if k != "model_type"})
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(float_dir)
        del model
    folders = {"float": float_dir}
    for recipe in sorted({r for r, _ in VARIANTS.values() if r}):
        folder = work / recipe
        if not (folder / "config.json").exists():
            model = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
            quantkit.quantize(model, recipe)
            quantkit.save(model, folder, dtype=torch.bfloat16)
            del model
            gc.collect()
        folders[recipe] = folder
    return folders


def time_variant(folder: Path, dtype: str, args) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsWNA16

    CompressedTensorsWNA16._kernel_backends_being_used.clear()
    llm = LLM(model=str(folder), dtype=dtype, skip_tokenizer_init=True, enforce_eager=True, seed=0,
              max_model_len=args.prompt_len + args.new_tokens + 16, max_num_seqs=max(args.batch_sizes),
              kv_cache_memory_bytes=1 << 30)
    kernels = sorted(CompressedTensorsWNA16._kernel_backends_being_used)
    g = torch.Generator().manual_seed(0)
    rows = {}
    try:
        for batch in args.batch_sizes:
            prompts = [TokensPrompt(prompt_token_ids=torch.randint(100, 30000, (args.prompt_len,), generator=g).tolist())
                       for _ in range(batch)]

            def run(tokens: int) -> float:
                params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True,
                                        detokenize=False)
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                assert all(len(o.outputs[0].token_ids) == tokens for o in outputs)
                return elapsed

            probe = run(2) - run(1)  # warm-up, and a first estimate of one step
            if probe > args.max_step_s:  # e.g. bf16 GEMMs where the CPU emulates bf16: one pair is all we time
                steps, pairs = [probe], "1 step, once"
            else:
                steps = [(run(1 + args.new_tokens) - run(1)) / args.new_tokens for _ in range(args.repeats)]
                pairs = f"{args.new_tokens} steps, median of {args.repeats}"
            step = statistics.median(steps)
            rows[batch] = {"step_s": step, "tokens_per_s": batch / step, "steps_s": steps, "timed": pairs}
            print(f"  batch {batch}: {step * 1e3:.1f} ms/step, {batch / step:.2f} tokens/s ({pairs})", flush=True)
    finally:
        del llm
        gc.collect()
    return {"kernels": kernels, "batches": rows}


def render(result: dict) -> str:
    batches = result["batch_sizes"]
    lines = [
        "# vLLM decode on CPU: quantkit W4 / W8 (plugin kernel) vs vLLM's own bf16 and fp32",
        "",
        f"CPU: {result['cpu']} ({result['threads']} torch threads); vLLM {result['vllm']}, torch {result['torch']}.",
        f"Model: {result['config']} (random weights); prompt {result['prompt_len']} tokens, "
        f"{result['new_tokens']} decode steps timed, median of {result['repeats']}; eager mode.",
        "",
        "Command: `" + result["command"] + "`",
        "",
        "| variant | linear kernel | " + " | ".join(f"batch {b}: tokens/s | vs baseline" for b in batches) + " |",
        "|---|---|" + "---:|---:|" * len(batches),
    ]
    for name, run in result["variants"].items():
        cells = []
        for b in batches:
            row = run["batches"][str(b)]
            note = "" if row["timed"].endswith(f"median of {result['repeats']}") else f" ({row['timed']})"
            cells.append(f"{row['tokens_per_s']:.2f}{note} | "
                         f"{row['tokens_per_s'] / result['baseline'][str(b)]['tokens_per_s']:.2f}x")
        kernel = ", ".join(run["kernels"]) or "vLLM's dense linear"
        lines.append(f"| {name} | {kernel} | " + " | ".join(cells) + " |")
    lines += ["", "Baseline (the faster of bf16 and fp32): "
              + ", ".join(f"batch {b}: {result['baseline'][str(b)]['variant']}" for b in batches) + ".",
              "", "On a GPU the same plugin runs quantkit's Triton kernels inside vLLM: not measured yet."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "evals/configs/llama-1b-random.json")
    parser.add_argument("--work", type=Path, required=True, help="folder for the model and checkpoints")
    parser.add_argument("--out", type=Path, required=True, help="folder for vllm_decode_cpu.{json,md}")
    parser.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-step-s", type=float, default=5.0,
                        help="a variant whose first timed step takes longer is timed on that step alone")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()

    import vllm

    folders = build_checkpoints(args.config, args.work)
    runs = {}
    for name in args.variants.split(","):
        recipe, dtype = VARIANTS[name]
        print(f"{name}: vLLM dtype {dtype}", flush=True)
        runs[name] = time_variant(folders[recipe or "float"], dtype, args)
        if recipe:
            assert runs[name]["kernels"] == [KERNEL], runs[name]["kernels"]
        runs[name]["batches"] = {str(b): row for b, row in runs[name]["batches"].items()}
    baseline = {}
    for b in args.batch_sizes:
        best = max((n for n in runs if VARIANTS[n][0] is None), key=lambda n: runs[n]["batches"][str(b)]["tokens_per_s"])
        baseline[str(b)] = {"variant": best, **runs[best]["batches"][str(b)]}
    result = {
        "cpu": cpu_name(), "threads": torch.get_num_threads(), "vllm": vllm.__version__, "torch": torch.__version__,
        "config": str(args.config.relative_to(REPO)) if args.config.is_relative_to(REPO) else str(args.config),
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "batch_sizes": args.batch_sizes, "variants": runs, "baseline": baseline,
        "command": "OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "?") + " VLLM_ENABLE_V1_MULTIPROCESSING="
                   + os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") + " python " + " ".join(
                       [str(Path(sys.argv[0]).resolve().relative_to(REPO)) if Path(sys.argv[0]).resolve().is_relative_to(REPO)
                        else sys.argv[0], *sys.argv[1:]]),
    }
    atomic_write_text(args.out / "vllm_decode_cpu.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(args.out / "vllm_decode_cpu.md", render(result))
    print(render(result))


if __name__ == "__main__":
    main()
