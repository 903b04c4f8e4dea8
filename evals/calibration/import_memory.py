"""Anonymous memory (RssAnon) and time of each import a calibration run makes, in one fresh interpreter.

    python evals/calibration/import_memory.py            # the steps below, in this order
    python evals/calibration/import_memory.py --json out.json

Steps, cumulative: torch; transformers; quantkit; quantkit.kernels; the API and the CLI's quantize command
(quantkit.api, quantkit.commands.quantize); transformers' LlamaForCausalLM (the model class a Llama
calibration run builds: transformers 5 imports torch._dynamo there, through masking_utils); then
quantkit.kernels.register_ops() (what a Triton path pays on first use). Each row: RssAnon after the step
(/proc/self/status: heap and tensors, not file pages), the step's growth and time, and whether
torch._dynamo, torch._inductor and triton are loaded.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

from memory_depth import rss_anon  # this folder's memory_depth.py (the script's folder is on sys.path)

STEPS = (
    ("torch", "import torch"),
    ("transformers", "import transformers"),
    ("quantkit", "import quantkit"),
    ("quantkit.kernels", "import quantkit.kernels"),
    ("quantkit.api + commands.quantize", "import quantkit.api, quantkit.commands.quantize"),
    ("transformers LlamaForCausalLM", "from transformers import LlamaForCausalLM"),
    # (before the ops were registered on first use there was no register_ops: the import defined them)
    ("quantkit.kernels.register_ops()", "import quantkit.kernels as k; getattr(k, 'register_ops', lambda: None)()"),
)
WATCHED = ("torch._dynamo", "torch._inductor", "triton")


def rss_anon_mb() -> float:
    """This process's RssAnon in MiB (memory_depth.rss_anon reads it)."""
    return rss_anon(os.getpid()) / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    importlib.invalidate_caches()
    rows = []
    before = rss_anon_mb()
    for name, statement in STEPS:
        start = time.perf_counter()
        exec(statement, {})
        seconds = time.perf_counter() - start
        now = rss_anon_mb()
        rows.append(dict(step=name, rss_anon_mb=round(now, 1), added_mb=round(now - before, 1),
                         seconds=round(seconds, 2), loaded=[m for m in WATCHED if m in sys.modules]))
        before = now
    print("| step (cumulative) | RssAnon (MB) | added (MB) | time (s) | loaded |")
    print("|---|---:|---:|---:|---|")
    for row in rows:
        print(f"| {row['step']} | {row['rss_anon_mb']:.0f} | {row['added_mb']:+.0f} | {row['seconds']:.2f} | "
              f"{', '.join(row['loaded']) or '-'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
