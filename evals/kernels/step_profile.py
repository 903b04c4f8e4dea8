"""Where one decode step's time goes: torch.profiler over decode steps of a model, grouped by op.

    python evals/kernels/step_profile.py MODEL [--steps 20] [--context 64] [--out FILE.md]

MODEL: a float folder or a quantized checkpoint (quantkit.load, bf16, CPU). Runs a prefill of
``--context`` random tokens, then ``--steps`` single-token steps through a DynamicCache under the
profiler; prints the wall time per step, the CPU self time per step of the heaviest ops, and the rest
(Python, module calls, the profiler's own cost: the profiler inflates small ops, so read the shares).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import quantkit
    from transformers import DynamicCache

    model = quantkit.load(args.model, dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context))
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(ids, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(3):  # warm-up
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(args.steps):
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
        wall = (time.perf_counter() - t) / args.steps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                out = model(tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        by_op[e.key][0] += e.self_cpu_time_total / args.steps / 1e3
        by_op[e.key][1] += e.count / args.steps
    total = sum(v[0] for v in by_op.values())
    lines = [f"# One decode step of {args.model}", "",
             f"{wall * 1e3:.2f} ms per step without the profiler (median-free mean of {args.steps}); profiled: "
             f"{total:.2f} ms of op self time per step over {sum(v[1] for v in by_op.values()):.0f} op calls.", "",
             "| op | ms / step (self, profiled) | calls / step |", "|---|---:|---:|"]
    for name, (ms, calls) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[: args.top]:
        lines.append(f"| {name} | {ms:.3f} | {calls:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
