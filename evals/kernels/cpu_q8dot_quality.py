"""`quantkit eval` with every quantized linear on the int8-activation kernel (decode's numerics).

    python evals/kernels/cpu_q8dot_quality.py CHECKPOINT --baseline ref:small --window 512 --max-tokens 32768 \
        --dtype float32 --json OUT.json

An evaluation feeds whole windows (512 tokens) through each linear, so by default it runs the
dequantize-once path (exact weights, unrounded activations: ``wna16_cpu_q8.Q8DOT_MAX_ROWS``), which
is not what a decode step computes. This raises the switch above any window, so every call rounds
its activations to int8 in blocks of 32 as decode does: the quality cost of the activation rounding,
beside the same evaluation on the default path. Arguments are `quantkit eval`'s.
"""

import sys

import quantkit.kernels.wna16_cpu_q8 as q8
from quantkit.cli import main

q8.Q8DOT_MAX_ROWS = 1 << 30
sys.exit(main(["eval", *sys.argv[1:]]))
