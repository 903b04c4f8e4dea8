"""`python evals/calibration/ddp_phases.py quantize ...`: `quantkit quantize ...` with per-process phase timers.

Runs the command as `python -m quantkit` does (also under torchrun) and prints, at exit, on stderr, this
process's wall time from its start and the seconds spent in GPTQ's phases, summed over every call:
ctx.forward (the block's calibration passes, the Hessian sums inside them), hessian.add, add_hessians
(the all-reduce), factor_hessian, gptq_quantize (the column walk, _qparams's range search inside it),
gather_rows (the all-gather of the walked rows).
"""

import atexit
import os
import sys
import time

from block_profile import timed  # this folder: the script's own (python puts it on sys.path)

START = time.perf_counter()
SPENT: dict[str, float] = {}


def wrap(owner, name: str, label: str | None = None) -> None:
    """Replace owner.name by block_profile's timer, adding its time to SPENT[label or name]."""
    setattr(owner, name, timed(SPENT, label or name, getattr(owner, name)))


def report() -> None:
    phases = " ".join(f"{name}={seconds:.1f}" for name, seconds in SPENT.items())
    print(f"[rank {os.environ.get('RANK', '0')}] wall {time.perf_counter() - START:.1f}s {phases}", file=sys.stderr)


def main() -> int:
    import quantkit.algorithms.gptq as gptq
    import quantkit.calibration.gptq_processor as processor
    import quantkit.calibration.runner as runner
    from quantkit.commands.cli import main as quantkit_main

    for name in ("factor_hessian", "gptq_quantize", "add_hessians", "gather_rows"):
        wrap(processor, name)
    wrap(runner.BlockContext, "forward", "ctx.forward")
    wrap(gptq.HessianSum, "add", "hessian.add")
    wrap(gptq, "_qparams")
    atexit.register(report)
    sys.argv = ["quantkit", *sys.argv[1:]]
    return quantkit_main()


if __name__ == "__main__":
    sys.exit(main())
