"""Where one GPTQ block's time goes: a random bf16 Llama block quantized with w4a16-gptq, timed by phase.

    python evals/calibration/block_profile.py [--hidden 2048 --intermediate 5632 --samples 16 --seq-len 256]

Each phase is the cumulative time of the functions that do it, measured by wrapping them (one process,
one block; the calibration forwards are what remains of the block's time):
- range search: the "mse" observer's search of each group's range (primitives.mse_clip_ratio);
- Hessians: accumulating X^T X from the captured inputs (algorithms.gptq.HessianSum);
- inversion: the factor of each step's damped inverse Hessian (algorithms.gptq._damped_inverse_factor,
  once per step since the step's linears share one factor_hessian);
- column walk: the rest of gptq_quantize (quantize a column, spread its error over the ones left).
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import transformers

import quantkit
from quantkit.core import primitives
from quantkit.algorithms import gptq
from quantkit.calibration import gptq_processor


def timed(totals: dict[str, float], key: str, fn):
    """fn, wrapped to add its seconds to totals[key] on every call (ddp_phases.py uses it too)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                      num_hidden_layers=1, num_attention_heads=args.hidden // 64,
                                      num_key_value_heads=max(1, args.hidden // 256), vocab_size=4096,
                                      max_position_embeddings=args.seq_len)
    model = transformers.LlamaForCausalLM(config).eval().to(torch.bfloat16)
    calibration = torch.randint(0, 4096, (args.samples, args.seq_len))
    totals: dict[str, float] = {}
    # wrapped where they are looked up: gptq's own module globals, and the processor's import of gptq
    gptq.mse_clip_ratio = timed(totals, "range search", primitives.mse_clip_ratio)
    gptq.HessianSum.add = timed(totals, "Hessians", gptq.HessianSum.add)
    gptq.HessianSum.hessian = timed(totals, "Hessians", gptq.HessianSum.hessian)
    gptq._damped_inverse_factor = timed(totals, "inversion", gptq._damped_inverse_factor)
    gptq_processor.gptq_quantize = timed(totals, "gptq_quantize", gptq.gptq_quantize)
    start = time.perf_counter()
    quantkit.quantize(model, "w4a16-gptq", calibration, progress=False)
    total = time.perf_counter() - start
    walk = totals.pop("gptq_quantize") - totals.get("range search", 0)  # the inversion runs before, per step
    phases = dict(totals, **{"column walk": walk})
    phases["calibration forwards and the rest"] = total - sum(phases.values())
    print(f"| phase | seconds | share |\n|---|---:|---:|")
    for name, seconds in phases.items():
        print(f"| {name} | {seconds:.2f} | {100 * seconds / total:.0f}% |")
    print(f"| whole block | {total:.2f} | 100% |")
    print(f"\nOne block of hidden {args.hidden}, intermediate {args.intermediate}, {args.samples} x {args.seq_len} "
          f"tokens; {torch.get_num_threads()} threads; torch {torch.__version__}.")


if __name__ == "__main__":
    main()
