"""`python evals/calibration/ddp_phases.py quantize ...`: `quantkit quantize ...` with per-process phase timers.

Runs the command as `python -m quantkit` does (also under torchrun) and prints, at exit, on stderr, this
process's wall time from its start and the seconds spent in GPTQ's phases, summed over every call:
ctx.forward (the block's calibration passes, the Hessian sums inside them), hessian.add, add_hessians
(the all-reduce), factor_hessian, gptq_quantize (the column walk, _qparams's range search inside it),
gather_rows (the all-gather of the walked rows).
"""

import atexit
import collections
import os
import sys
import time

START = time.perf_counter()
SPENT: dict[str, float] = collections.defaultdict(float)


def timed(owner, name: str, label: str | None = None) -> None:
    """Replace owner.name by a wrapper that adds its time to SPENT[label or name]."""
    function = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            SPENT[label or name] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def report() -> None:
    phases = " ".join(f"{name}={seconds:.1f}" for name, seconds in SPENT.items())
    print(f"[rank {os.environ.get('RANK', '0')}] wall {time.perf_counter() - START:.1f}s {phases}", file=sys.stderr)


def main() -> int:
    import quantkit.algorithms.gptq as gptq
    import quantkit.calibration.gptq_processor as processor
    import quantkit.calibration.runner as runner
    from quantkit.commands.cli import main as quantkit_main

    for name in ("factor_hessian", "gptq_quantize", "add_hessians", "gather_rows"):
        timed(processor, name)
    timed(runner.BlockContext, "forward", "ctx.forward")
    timed(gptq.HessianSum, "add", "hessian.add")
    timed(gptq, "_qparams")
    atexit.register(report)
    sys.argv = ["quantkit", *sys.argv[1:]]
    return quantkit_main()


if __name__ == "__main__":
    sys.exit(main())
